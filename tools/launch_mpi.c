/*
 * launch_mpi.c - `zinf launch --hostfile FILE`: the ranks of one job across nodes, started
 * by Open MPI's mpirun (launch_mpi.h). The hostfile is DeepSpeed's (`host slots=N`), read
 * and checked here with errors naming its line; mpirun gets Open MPI's form of it in a
 * temporary file, --map-by slot (consecutive ranks share a node, which the communicator's
 * split into nodes needs), the job's name, secret and the ZINF_* / OMPI_MCA_* / OMP_*
 * variables exported to every rank, and --tag-output, whose "[1,R]<stdout>:" tags become
 * the "[R] " a job on one node prints.
 *
 * mpirun is the launcher's only child, in a process group of its own: SIGINT, SIGTERM and
 * SIGHUP are passed on to it (it passes them on to the ranks), and its exit status is the
 * launcher's. It gets SIGTERM if the launcher dies.
 *
 * Not here: the job's name and secret (cmd_launch.c), the ranks' communicator (src/comm/),
 * what rank and world a rank is (zinf train reads Open MPI's OMPI_COMM_WORLD_*).
 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common.h"
#include "launch_mpi.h"

#define LINE_MAX_BYTES 4096

extern char **environ;

/* A name a host can have: labels of [A-Za-z0-9-] joined by '.', none empty, none starting
 * or ending with '-' (RFC 1123); an IPv4 address is one too. */
static bool hostname_ok(const char *s, size_t len)
{
    if (len == 0 || len > HOSTNAME_MAX_BYTES) return false;
    size_t label = 0;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (c == '.') {
            if (label == 0 || s[i - 1] == '-') return false;
            label = 0;
            continue;
        }
        if (!isalnum((unsigned char)c) && c != '-') return false;
        if (c == '-' && label == 0) return false;
        if (++label > 63) return false;
    }
    return label > 0 && s[len - 1] != '-';
}

int hostfile_read(const char *path, struct hostfile *h, char *err, size_t errlen)
{
    FILE *f = fopen(path, "re");
    if (!f) {
        int e = errno;
        snprintf(err, errlen, "--hostfile %s: %s", path, strerror(e));
        return -e;
    }
    memset(h, 0, sizeof(*h));
    char *line = NULL;
    size_t cap = 0;
    int lineno = 0, r = 0;
    while (r == 0 && getline(&line, &cap, f) >= 0) {
        lineno++;
        line[strcspn(line, "#\n")] = 0;
        char *p = line, *tok[3];
        int nt = 0;
        while (nt < 3) {
            p += strspn(p, " \t\r");
            if (!*p) break;
            tok[nt++] = p;
            p += strcspn(p, " \t\r");
            if (*p) *p++ = 0;
        }
        if (nt == 0) continue;
        p += strspn(p, " \t\r");
        if (nt == 3 || *p) {
            snprintf(err, errlen, "%s:%d: '%.40s': expected 'HOST' or 'HOST slots=N'", path,
                     lineno, tok[2]);
            r = -EINVAL;
            break;
        }
        if (!hostname_ok(tok[0], strlen(tok[0]))) {
            snprintf(err, errlen, "%s:%d: '%.80s' is not a host name (letters, digits, '-' and "
                     "'.', at most %d characters)", path, lineno, tok[0], HOSTNAME_MAX_BYTES);
            r = -EINVAL;
            break;
        }
        long slots = 1;
        if (nt == 2) {
            char *end = NULL;
            errno = 0;
            if (strncmp(tok[1], "slots=", 6) == 0) slots = strtol(tok[1] + 6, &end, 10);
            if (!end || end == tok[1] + 6 || *end || errno || slots < 1 ||
                slots > COMM_MAX_RANKS) {
                snprintf(err, errlen, "%s:%d: '%.40s': expected slots=N with N from 1 to %d",
                         path, lineno, tok[1], COMM_MAX_RANKS);
                r = -EINVAL;
                break;
            }
        }
        for (int k = 0; k < h->n && r == 0; k++)
            if (strcmp(h->host[k].name, tok[0]) == 0) {
                snprintf(err, errlen, "%s:%d: host %s is given twice (first on line %d)", path,
                         lineno, tok[0], h->host[k].line);
                r = -EINVAL;
            }
        if (r) break;
        if (h->n == HOSTFILE_MAX_HOSTS || h->total_slots + slots > COMM_MAX_RANKS) {
            snprintf(err, errlen, "%s:%d: more than %d %s", path, lineno,
                     h->n == HOSTFILE_MAX_HOSTS ? HOSTFILE_MAX_HOSTS : COMM_MAX_RANKS,
                     h->n == HOSTFILE_MAX_HOSTS ? "hosts" : "slots in all (the most ranks)");
            r = -EINVAL;
            break;
        }
        snprintf(h->host[h->n].name, sizeof(h->host[h->n].name), "%s", tok[0]);
        h->host[h->n].slots = (int)slots;
        h->host[h->n].line = lineno;
        h->n++;
        h->total_slots += (int)slots;
    }
    if (r == 0 && ferror(f)) {
        r = -EIO;
        snprintf(err, errlen, "--hostfile %s: read error", path);
    }
    if (r == 0 && h->n == 0) {
        snprintf(err, errlen, "%s: no hosts (one 'HOST slots=N' a line)", path);
        r = -EINVAL;
    }
    free(line);
    fclose(f);
    return r;
}

/* Whether a directory on PATH holds an mpirun that can be run. */
static bool find_mpirun(void)
{
    const char *path = getenv("PATH");
    if (!path) return false;
    const char *p = path;
    while (*p) {
        size_t n = strcspn(p, ":");
        char full[4096];
        snprintf(full, sizeof(full), "%.*s/mpirun", (int)(n ? n : 1), n ? p : ".");
        if (access(full, X_OK) == 0) return true;
        p += n + (p[n] == ':');
    }
    return false;
}

struct tagged {
    int fd;
    FILE *to;
    char buf[LINE_MAX_BYTES];
    size_t len;
};

/* One line of mpirun's: Open MPI's "[JOB,R]<stdout>:" or "<stderr>:" tag becomes "[R] ";
 * a line without one (mpirun's own) passes as it is. */
static void put_line(FILE *to, const char *s, size_t n)
{
    int job, rank, end = 0;
    char stream[8];
    char head[48];
    snprintf(head, sizeof(head), "%.*s", (int)MIN(n, sizeof(head) - 1), s);
    if (sscanf(head, "[%d,%d]<%7[a-z]>:%n", &job, &rank, stream, &end) == 3 && end > 0)
        fprintf(to, "[%d] %.*s\n", rank, (int)(n - (size_t)end), s + end);
    else
        fprintf(to, "%.*s\n", (int)n, s);
}

static void drain(struct tagged *t, bool flush)
{
    size_t start = 0;
    for (size_t i = 0; i < t->len; i++)
        if (t->buf[i] == '\n') {
            put_line(t->to, t->buf + start, i - start);
            start = i + 1;
        }
    if ((flush || (start == 0 && t->len == sizeof(t->buf))) && start < t->len) {
        put_line(t->to, t->buf + start, t->len - start);
        start = t->len;
    }
    memmove(t->buf, t->buf + start, t->len - start);
    t->len -= start;
    fflush(t->to);
}

/* Open MPI's form of the hostfile, in a temporary file: its path into buf. */
static int write_hosts(const struct hostfile *h, char *buf, size_t len)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(buf, len, "%s/zinf-hosts-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    int fd = mkostemp(buf, O_CLOEXEC);
    if (fd < 0) return -errno;
    FILE *f = fdopen(fd, "w");
    if (!f) {
        int e = errno;
        close(fd);
        unlink(buf);
        return -e;
    }
    for (int k = 0; k < h->n; k++)
        fprintf(f, "%s slots=%d\n", h->host[k].name, h->host[k].slots);
    if (fclose(f) != 0) {
        int e = errno;
        unlink(buf);
        return -e;
    }
    return 0;
}

static bool exported(const char *var)
{
    return strncmp(var, "ZINF_", 5) == 0 || strncmp(var, "OMPI_MCA_", 9) == 0 ||
           strncmp(var, "OMP_", 4) == 0;
}

int launch_mpi_run(const struct launch_mpi *l)
{
    struct hostfile *h = calloc(1, sizeof(*h));
    char err[600];
    if (!h) return 1;
    if (hostfile_read(l->hostfile, h, err, sizeof(err)) < 0) {
        fprintf(stderr, "zinf launch: %s\n", err);
        free(h);
        return 2;
    }
    int n = l->ranks ? l->ranks : h->total_slots;
    if (n > h->total_slots) {
        fprintf(stderr, "zinf launch: -n %d: more ranks than the %d slots of %s\n", n,
                h->total_slots, l->hostfile);
        free(h);
        return 2;
    }
    if (!find_mpirun()) {
        fprintf(stderr, "zinf launch: --hostfile runs the ranks with Open MPI's mpirun, which is "
                        "not on PATH: install openmpi-bin\n");
        free(h);
        return 127;
    }
    char hosts[4096];
    int we = write_hosts(h, hosts, sizeof(hosts));
    free(h);
    if (we < 0) {
        fprintf(stderr, "zinf launch: the hostfile for mpirun (%s): %s\n", hosts, strerror(-we));
        return 1;
    }
    setenv("ZINF_COMM_NAME", l->name, 1);
    setenv("ZINF_COMM_SECRET", l->secret, 1);

    /* mpirun's arguments: ours, the caller's (--mpi-arg), one -x for each variable passed. */
    size_t nenv = 0, ncmd = 0;
    for (char **e = environ; *e; e++) nenv += exported(*e);
    while (l->command[ncmd]) ncmd++;
    size_t cap = 16 + 2 * nenv + (size_t)l->n_mpi_args + ncmd + 1, na = 0;
    char **av = calloc(cap, sizeof(*av));
    char **names = calloc(nenv + 1, sizeof(*names));
    char np[16];
    snprintf(np, sizeof(np), "%d", n);
    if (!av || !names) {
        free(av);
        free(names);
        unlink(hosts);
        return 1;
    }
    av[na++] = "mpirun";
    av[na++] = "-np";
    av[na++] = np;
    av[na++] = "--hostfile";
    av[na++] = hosts;
    av[na++] = "--map-by";
    av[na++] = "slot";
    av[na++] = "--tag-output";
    if (geteuid() == 0) av[na++] = "--allow-run-as-root";
    size_t k = 0;
    for (char **e = environ; *e; e++)
        if (exported(*e) && (names[k] = strndup(*e, strcspn(*e, "=")))) {
            av[na++] = "-x";
            av[na++] = names[k++];
        }
    for (int i = 0; i < l->n_mpi_args; i++) av[na++] = l->mpi_args[i];
    for (size_t i = 0; i < ncmd; i++) av[na++] = l->command[i];
    av[na] = NULL;

    sigset_t mask, old;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGHUP);
    sigprocmask(SIG_BLOCK, &mask, &old);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    int p[2][2] = {{-1, -1}, {-1, -1}}, rc = 1;
    pid_t launcher = getpid(), pid = -1;
    if (sfd < 0 || pipe2(p[0], O_CLOEXEC) || pipe2(p[1], O_CLOEXEC)) {
        fprintf(stderr, "zinf launch: %s\n", strerror(errno));
        goto out;
    }
    fprintf(stderr, "zinf launch: %d rank%s on %s with mpirun\n", n, n == 1 ? "" : "s",
            l->hostfile);
    fflush(NULL);
    if ((pid = fork()) < 0) {
        fprintf(stderr, "zinf launch: fork: %s\n", strerror(errno));
        goto out;
    }
    if (pid == 0) {
        /* Its own process group: a terminal's Ctrl-C reaches the launcher, which passes it
         * on once (mpirun takes a second SIGINT as "abort now"). */
        setpgid(0, 0);
        if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != launcher) _exit(1);
        dup2(p[0][1], STDOUT_FILENO);
        dup2(p[1][1], STDERR_FILENO);
        /* A rank's place comes from Open MPI, not from a launcher around this one. */
        unsetenv("RANK");
        unsetenv("WORLD_SIZE");
        unsetenv("LOCAL_RANK");
        unsetenv("LOCAL_WORLD_SIZE");
        sigprocmask(SIG_SETMASK, &old, NULL);
        execvp(av[0], av);
        fprintf(stderr, "zinf launch: cannot run mpirun: %s\n", strerror(errno));
        _exit(127);
    }
    close(p[0][1]);
    close(p[1][1]);
    p[0][1] = p[1][1] = -1;
    struct tagged out[2] = {{.fd = p[0][0], .to = stdout}, {.fd = p[1][0], .to = stderr}};
    p[0][0] = p[1][0] = -1;
    int status = 0, stop_sig = 0;
    bool reaped = false;
    while (!reaped || out[0].fd >= 0 || out[1].fd >= 0) {
        struct pollfd pf[3] = {{.fd = sfd, .events = POLLIN},
                               {.fd = out[0].fd, .events = POLLIN},
                               {.fd = out[1].fd, .events = POLLIN}};
        /* Once mpirun is reaped, its pipes are read until they close, but not for longer
         * than a moment: a process it left behind may hold them. */
        if (poll(pf, 3, reaped ? 200 : -1) == 0 && reaped) break;
        for (int s = 0; s < 2; s++) {
            struct tagged *t = &out[s];
            if (t->fd < 0 || !(pf[1 + s].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            ssize_t got = read(t->fd, t->buf + t->len, sizeof(t->buf) - t->len);
            if (got > 0) {
                t->len += (size_t)got;
                drain(t, false);
            } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
                drain(t, true);
                close(t->fd);
                t->fd = -1;
            }
        }
        struct signalfd_siginfo si;
        while (read(sfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
            if (si.ssi_signo == SIGCHLD) continue;
            if (!stop_sig) {
                stop_sig = (int)si.ssi_signo;
                fprintf(stderr, "zinf launch: %s passed on to mpirun\n",
                        strsignal((int)si.ssi_signo));
            }
            kill(pid, (int)si.ssi_signo);
        }
        if (!reaped && waitpid(pid, &status, WNOHANG) == pid) reaped = true;
    }
    for (int s = 0; s < 2; s++)
        if (out[s].fd >= 0) {
            drain(&out[s], true);
            close(out[s].fd);
        }
    if (!reaped) waitpid(pid, &status, 0);
    if (WIFEXITED(status)) {
        rc = WEXITSTATUS(status);
        if (rc && rc != 127)
            fprintf(stderr, "zinf launch: failed: mpirun exited with status %d\n", rc);
    } else if (WIFSIGNALED(status)) {
        rc = 128 + WTERMSIG(status);
        fprintf(stderr, "zinf launch: failed: mpirun was killed by signal %d (%s)\n",
                WTERMSIG(status), strsignal(WTERMSIG(status)));
    }
    if (stop_sig) { /* as a job on one node says it */
        fprintf(stderr, "zinf launch: stopped by %s\n", strsignal(stop_sig));
        rc = 128 + stop_sig;
    }
out:
    for (int s = 0; s < 2; s++)
        for (int e = 0; e < 2; e++)
            if (p[s][e] >= 0) close(p[s][e]);
    if (sfd >= 0) close(sfd);
    sigprocmask(SIG_SETMASK, &old, NULL);
    unlink(hosts);
    for (size_t i = 0; i < k; i++) free(names[i]);
    free(names);
    free(av);
    return rc;
}

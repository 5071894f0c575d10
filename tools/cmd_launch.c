/*
 * cmd_launch.c - `zinf launch -n N [options] [--] COMMAND [ARGS...]`: the ranks of one job
 * on this node. It starts N copies of COMMAND with RANK, WORLD_SIZE, LOCAL_RANK,
 * LOCAL_WORLD_SIZE and ZINF_COMM_NAME (the name the ranks' communicator meets under,
 * src/comm/) in their environment, each bound to the CPUs of the NUMA node nearest its GPU
 * where hwloc knows one, and prefixes every line they print with "[rank] ".
 *
 * It owns their lifetime: SIGINT or SIGTERM is passed on to every rank (a trainer finishes
 * its step, flushes and exits; a second signal kills them); when one rank fails (exits
 * non-zero or dies of a signal) the others get SIGTERM, then SIGKILL after --grace
 * seconds, and the launcher exits non-zero naming the rank and what happened to it.
 *
 * Not here: the rendezvous itself (comm_open, with the name given here), what the ranks do.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cmd.h"
#include "comm/comm.h"
#include "common.h"
#include "topo/topo.h"

#define LINE_MAX_BYTES 4096

struct out {
    int fd; /* -1 once closed */
    char buf[LINE_MAX_BYTES];
    size_t len;
};

struct rank {
    pid_t pid;
    bool done;
    int status; /* waitpid's */
    struct out o[2]; /* stdout, stderr */
};

static void usage(FILE *f)
{
    fprintf(f, "usage: zinf launch -n N [--name NAME] [--grace S] [--no-bind] [--xml FILE]\n"
               "                   [--connect SOCKET] [--] COMMAND [ARGS...]\n"
               "Start N ranks of one job on this node: N copies of COMMAND, each with RANK,\n"
               "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and ZINF_COMM_NAME set, every line\n"
               "they print prefixed with \"[RANK] \" (stdout to stdout, stderr to stderr).\n"
               "  -n, --ranks N   how many ranks (1-%d)\n"
               "  --name NAME     the communicator's rendezvous name (default: launch-PID)\n"
               "  --grace S       after a rank fails, or after SIGINT/SIGTERM is passed on,\n"
               "                  how long the others have before SIGKILL (default 30)\n"
               "  --no-bind       leave every rank on every CPU (default: each rank on the\n"
               "                  CPUs of the NUMA node nearest GPU LOCAL_RANK, where known;\n"
               "                  each binding is said on stderr)\n"
               "  --xml FILE      place the ranks on the machine an hwloc XML file describes\n"
               "                  (said, not bound: to see what a machine would get)\n"
               "  --connect SOCKET  the ranks keep their state in the zinf daemon on SOCKET\n"
               "                  (zinf serve): ZINF_CONNECT is set, which zinf train takes;\n"
               "                  rank R of N is the daemon's job JOB-rank-R-of-N\n"
               "With N > 1, OMP_NUM_THREADS (CPUs / N) and OMP_WAIT_POLICY (passive) are set\n"
               "where the environment does not set them.\n"
               "SIGINT/SIGTERM: passed on to every rank; a second one kills them.\n"
               "Exit status: 0 every rank exited 0; 1 a rank failed (the launcher says which,\n"
               "and how); 2 bad usage; 127 COMMAND could not be run; 130/143 stopped by\n"
               "SIGINT/SIGTERM.\n",
            COMM_MAX_RANKS);
}

/* The NUMA node nearest GPU i (modulo the GPUs there are) of the topology, or -1; its bus
 * id into busid. */
static int gpu_node(struct topo *t, int i, char *busid, size_t len)
{
    json_t *j = t ? topo_to_json(t) : NULL;
    json_t *gpus = j ? json_object_get(j, "gpus") : NULL;
    int node = -1;
    size_t n = gpus ? json_array_size(gpus) : 0;
    if (n > 0) {
        json_t *g = json_array_get(gpus, (size_t)i % n), *nd = json_object_get(g, "numa_node");
        if (json_is_integer(nd)) node = (int)json_integer_value(nd);
        snprintf(busid, len, "%s", json_string_value(json_object_get(g, "busid")) ?: "?");
    }
    json_decref(j);
    return node;
}

/* Writes the complete lines of o (all of it when flush), each prefixed. */
static void emit(struct out *o, int rank, FILE *to, bool flush)
{
    size_t start = 0;
    for (size_t i = 0; i < o->len; i++) {
        if (o->buf[i] != '\n') continue;
        fprintf(to, "[%d] %.*s\n", rank, (int)(i - start), o->buf + start);
        start = i + 1;
    }
    if (flush && start < o->len) {
        fprintf(to, "[%d] %.*s\n", rank, (int)(o->len - start), o->buf + start);
        start = o->len;
    }
    if (start == 0 && o->len == sizeof(o->buf)) { /* a line longer than the buffer */
        fprintf(to, "[%d] %.*s\n", rank, (int)o->len, o->buf);
        start = o->len;
    }
    memmove(o->buf, o->buf + start, o->len - start);
    o->len -= start;
    fflush(to);
}

static void signal_all(struct rank *rk, int n, int sig)
{
    for (int r = 0; r < n; r++)
        if (!rk[r].done && rk[r].pid > 0) kill(rk[r].pid, sig);
}

static const char *sig_name(int sig)
{
    return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal";
}

static void describe(int status, char *buf, size_t len)
{
    if (WIFEXITED(status))
        snprintf(buf, len, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(buf, len, "was killed by signal %d (%s)", WTERMSIG(status),
                 strsignal(WTERMSIG(status)));
    else
        snprintf(buf, len, "ended with wait status %#x", status);
}

/* OpenMP's threads share the CPUs among the ranks (as torchrun does): without it each rank
 * runs a thread per CPU, and threads spinning between parallel regions starve the other
 * ranks (a step of two ranks on two CPUs ran 15 times slower). What the caller set stays. */
static void share_cpus(int n)
{
    cpu_set_t set;
    int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    if (n < 2) return;
    if (!getenv("OMP_NUM_THREADS")) {
        char v[16];
        snprintf(v, sizeof(v), "%d", MAX(1, cpus / n));
        setenv("OMP_NUM_THREADS", v, 1);
        fprintf(stderr,
                "zinf launch: OMP_NUM_THREADS=%s for each of %d ranks on %d CPUs (set "
                "OMP_NUM_THREADS to choose)\n",
                v, n, cpus);
    }
    if (!getenv("OMP_WAIT_POLICY")) setenv("OMP_WAIT_POLICY", "passive", 1);
}

int cmd_launch(int argc, char **argv)
{
    static const struct option opts[] = {{"ranks", required_argument, NULL, 'n'},
                                         {"name", required_argument, NULL, 'm'},
                                         {"grace", required_argument, NULL, 'g'},
                                         {"no-bind", no_argument, NULL, 'b'},
                                         {"xml", required_argument, NULL, 'x'},
                                         {"connect", required_argument, NULL, 'c'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    int n = 0, grace_s = 30;
    bool bind = true;
    const char *name = NULL, *xml = NULL;
    char *end;
    int c;

    optind = 1;
    /* "+": options end at COMMAND, whose own options are its own. */
    while ((c = getopt_long(argc, argv, "+n:h", opts, NULL)) != -1) {
        switch (c) {
        case 'n':
            n = (int)strtol(optarg, &end, 10);
            if (*end || n < 1 || n > COMM_MAX_RANKS) {
                fprintf(stderr, "zinf launch: -n %s: a number of ranks from 1 to %d\n", optarg,
                        COMM_MAX_RANKS);
                return 2;
            }
            break;
        case 'm':
            name = optarg;
            break;
        case 'g':
            grace_s = (int)strtol(optarg, &end, 10);
            if (*end || grace_s < 0) {
                fprintf(stderr, "zinf launch: --grace %s: seconds, 0 or more\n", optarg);
                return 2;
            }
            break;
        case 'b':
            bind = false;
            break;
        case 'x':
            xml = optarg;
            break;
        case 'c': {
            /* Every rank's state in the daemon on this socket (zinf train reads it). */
            struct stat st;
            int se = stat(optarg, &st) == 0 ? 0 : errno;
            if (se || !S_ISSOCK(st.st_mode)) {
                fprintf(stderr, "zinf launch: --connect %s: %s (start one with zinf serve)\n",
                        optarg, se == ENOENT || !se ? "no daemon's socket there" : strerror(se));
                return 2;
            }
            setenv("ZINF_CONNECT", optarg, 1);
            break;
        }
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (n == 0 || optind >= argc) {
        fprintf(stderr, "zinf launch: %s\n", n == 0 ? "-n N is required" : "no COMMAND to run");
        usage(stderr);
        return 2;
    }
    char defname[COMM_NAME_BYTES];
    if (!name) {
        snprintf(defname, sizeof(defname), "launch-%d", (int)getpid());
        name = defname;
    } else if (strlen(name) >= COMM_NAME_BYTES || strpbrk(name, "/ \t\n") || !*name) {
        fprintf(stderr, "zinf launch: --name '%s': 1-%d characters of [A-Za-z0-9._-]\n", name,
                COMM_NAME_BYTES - 1);
        return 2;
    }

    struct topo *t = NULL;
    if (bind) {
        int te = topo_open(xml, &t);
        if (te < 0 && xml) {
            char why[512];
            topo_open_error(xml, te, why, sizeof(why));
            fprintf(stderr, "zinf launch: --xml %s: %s\n", xml, why);
            return 2;
        }
        if (te < 0) t = NULL;
    }
    int nodes[COMM_MAX_RANKS];
    for (int r = 0; r < n; r++) {
        char busid[64] = "";
        nodes[r] = bind ? gpu_node(t, r, busid, sizeof(busid)) : -1;
        if (nodes[r] >= 0)
            fprintf(stderr, "zinf launch: rank %d on NUMA node %d (near GPU %s)%s\n", r, nodes[r],
                    busid, xml ? ": not bound, the machine is the XML file's" : "");
        if (xml) nodes[r] = -1; /* nothing of that machine to bind to here */
    }

    /* SIGCHLD, SIGINT and SIGTERM arrive through a signalfd; the ranks get them unblocked. */
    sigset_t mask, old;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGTERM);
    sigprocmask(SIG_BLOCK, &mask, &old);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) {
        fprintf(stderr, "zinf launch: signalfd: %s\n", strerror(errno));
        return 1;
    }

    share_cpus(n);
    struct rank *rk = calloc((size_t)n, sizeof(*rk));
    if (!rk) return 1;
    int exec_failed[2];
    if (pipe2(exec_failed, O_CLOEXEC) != 0) return 1;
    fflush(NULL);
    int started = 0, rc = 0;
    for (int r = 0; r < n; r++) {
        int p[2][2];
        if (pipe2(p[0], O_CLOEXEC) || pipe2(p[1], O_CLOEXEC)) {
            fprintf(stderr, "zinf launch: pipe: %s\n", strerror(errno));
            rc = 1;
            break;
        }
        pid_t pid = fork();
        if (pid < 0) {
            fprintf(stderr, "zinf launch: fork: %s\n", strerror(errno));
            rc = 1;
            break;
        }
        if (pid == 0) {
            char v[32];
            dup2(p[0][1], STDOUT_FILENO);
            dup2(p[1][1], STDERR_FILENO);
            snprintf(v, sizeof(v), "%d", r);
            setenv("RANK", v, 1);
            setenv("LOCAL_RANK", v, 1);
            snprintf(v, sizeof(v), "%d", n);
            setenv("WORLD_SIZE", v, 1);
            setenv("LOCAL_WORLD_SIZE", v, 1);
            setenv("ZINF_COMM_NAME", name, 1);
            int be = nodes[r] >= 0 ? topo_bind_thread(t, nodes[r]) : 0;
            if (be < 0)
                fprintf(stderr, "zinf launch: not bound to NUMA node %d: %s\n", nodes[r],
                        strerror(-be));
            sigprocmask(SIG_SETMASK, &old, NULL);
            execvp(argv[optind], argv + optind);
            int e = errno;
            if (write(exec_failed[1], &e, sizeof(e)) < 0) _exit(127);
            _exit(127);
        }
        close(p[0][1]);
        close(p[1][1]);
        rk[r].pid = pid;
        rk[r].o[0].fd = p[0][0];
        rk[r].o[1].fd = p[1][0];
        started++;
    }
    close(exec_failed[1]);
    int e = 0;
    if (read(exec_failed[0], &e, sizeof(e)) == (ssize_t)sizeof(e)) {
        fprintf(stderr, "zinf launch: cannot run '%s': %s\n", argv[optind], strerror(e));
        rc = 127;
    }
    close(exec_failed[0]);
    if (rc) signal_all(rk, started, SIGKILL);
    if (t) topo_close(t);

    /* Until every started rank has been reaped and its output drained. */
    int stop_sig = 0, failed_rank = -1, failed_status = 0, running = started;
    uint64_t kill_at = rc ? now_ns() : 0; /* 0: no deadline */
    uint64_t drain_until = 0;
    struct pollfd *pf = calloc((size_t)started * 2 + 1, sizeof(*pf));
    if (!pf) return 1;
    for (;;) {
        int open_fds = 0;
        pf[0] = (struct pollfd){.fd = sfd, .events = POLLIN};
        for (int r = 0; r < started; r++)
            for (int k = 0; k < 2; k++) {
                pf[1 + 2 * r + k] = (struct pollfd){.fd = rk[r].o[k].fd, .events = POLLIN};
                open_fds += rk[r].o[k].fd >= 0;
            }
        /* Once every rank is reaped, what they wrote is read for a moment more: a process
         * they left behind may hold their pipes open for as long as it likes. */
        if (running == 0 && !drain_until) drain_until = now_ns() + 200 * 1000000ull;
        if (running == 0 && (open_fds == 0 || now_ns() >= drain_until)) break;
        uint64_t until = kill_at && drain_until ? MIN(kill_at, drain_until) : kill_at | drain_until;
        int timeout = -1;
        if (until) {
            uint64_t now = now_ns();
            timeout = now >= until ? 0 : (int)((until - now) / 1000000 + 1);
        }
        int k = poll(pf, (nfds_t)started * 2 + 1, timeout);
        if (k < 0 && errno != EINTR) break;
        if (kill_at && now_ns() >= kill_at) {
            signal_all(rk, started, SIGKILL);
            kill_at = 0;
        }
        for (int r = 0; r < started; r++)
            for (int s = 0; s < 2; s++) {
                struct out *o = &rk[r].o[s];
                short re = pf[1 + 2 * r + s].revents;
                if (o->fd < 0 || !(re & (POLLIN | POLLHUP | POLLERR))) continue;
                ssize_t got = read(o->fd, o->buf + o->len, sizeof(o->buf) - o->len);
                if (got > 0) {
                    o->len += (size_t)got;
                    emit(o, r, s ? stderr : stdout, false);
                } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
                    emit(o, r, s ? stderr : stdout, true);
                    close(o->fd);
                    o->fd = -1;
                }
            }
        struct signalfd_siginfo si;
        while (read(sfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
            if (si.ssi_signo == SIGCHLD) continue; /* reaped below */
            if (stop_sig) {                       /* a second one: now */
                signal_all(rk, started, SIGKILL);
                continue;
            }
            stop_sig = (int)si.ssi_signo;
            fprintf(stderr, "zinf launch: %s: passed on to the ranks\n", sig_name(stop_sig));
            signal_all(rk, started, SIGTERM == stop_sig ? SIGTERM : SIGINT);
            if (!kill_at) kill_at = now_ns() + (uint64_t)grace_s * 1000000000ull;
        }
        for (;;) {
            int st;
            pid_t pid = waitpid(-1, &st, WNOHANG);
            if (pid <= 0) break;
            for (int r = 0; r < started; r++) {
                if (rk[r].pid != pid) continue;
                rk[r].done = true;
                rk[r].status = st;
                running--;
                bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
                if (!ok && failed_rank < 0 && !stop_sig && !rc) {
                    failed_rank = r;
                    failed_status = st;
                    char how[96];
                    describe(st, how, sizeof(how));
                    fprintf(stderr, "zinf launch: rank %d (pid %d) %s: stopping the others\n", r,
                            (int)pid, how);
                    signal_all(rk, started, SIGTERM);
                    kill_at = now_ns() + (uint64_t)grace_s * 1000000000ull;
                }
            }
        }
    }
    for (int r = 0; r < started; r++)
        for (int s = 0; s < 2; s++)
            if (rk[r].o[s].fd >= 0) {
                emit(&rk[r].o[s], r, s ? stderr : stdout, true);
                close(rk[r].o[s].fd);
            }
    free(pf);
    close(sfd);
    sigprocmask(SIG_SETMASK, &old, NULL);
    if (rc == 0 && failed_rank >= 0) {
        char how[96];
        describe(failed_status, how, sizeof(how));
        fprintf(stderr, "zinf launch: failed: rank %d %s\n", failed_rank, how);
        rc = 1;
    } else if (rc == 0 && stop_sig) {
        int bad = 0;
        for (int r = 0; r < started; r++)
            bad += !(WIFEXITED(rk[r].status) && WEXITSTATUS(rk[r].status) == 0);
        fprintf(stderr, "zinf launch: stopped by %s; %d of %d ranks exited 0\n",
                sig_name(stop_sig), started - bad, started);
        rc = 128 + stop_sig;
    }
    free(rk);
    return rc;
}

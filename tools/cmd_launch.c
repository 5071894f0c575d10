/*
 * cmd_launch.c - `zinf launch -n N [options] [--] COMMAND [ARGS...]`: the ranks of one job
 * on this node. It starts N copies of COMMAND with RANK, WORLD_SIZE, LOCAL_RANK,
 * LOCAL_WORLD_SIZE and ZINF_COMM_NAME (the name the ranks' communicator meets under,
 * src/comm/) in their environment, each bound to the CPUs of the NUMA node nearest its GPU
 * where hwloc knows one, and prefixes every line they print with "[rank] ".
 *
 * It owns their lifetime: SIGINT, SIGTERM or SIGHUP is passed on to every rank (a trainer
 * finishes its step, flushes and exits; a second signal kills them), and so is SIGQUIT; the
 * job stops and continues as one, as a shell's job does (Ctrl-Z: the ranks get SIGTSTP,
 * then the launcher stops itself; SIGCONT continues them too); when one rank fails (exits
 * non-zero or dies of a signal) the others get SIGTERM, then SIGKILL after --grace
 * seconds, and the launcher exits non-zero naming the rank and what happened to it. Each
 * rank runs in a process group of its own (what it starts is signalled with it), and gets
 * SIGTERM when the launcher dies, however it dies (PR_SET_PDEATHSIG).
 *
 * The job: its name is held for the launcher's life by a lock on /dev/shm/zinf-job-NAME
 * (mode 0600, this user's), so a second job of a live job's name is refused naming it, and
 * a file left by a launcher that is gone (its lock went with it) is taken over, or removed
 * by the next launcher of any name. Its ranks
 * get a random secret (ZINF_COMM_SECRET) that the rendezvous' name and handshake use: no
 * process without it can meet with them.
 *
 * Before anything starts, N is checked against the layout of zinf train's config where
 * COMMAND is zinf train (launch_layout.c).
 *
 * Not here: the rendezvous itself (comm_open, with the name given here), what the ranks do.
 */
#include <dirent.h>
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
#include <pwd.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cmd.h"
#include "comm/comm.h"
#include "common.h"
#include "launch_layout.h"
#include "launch_mpi.h"
#include "topo/topo.h"

#define LINE_MAX_BYTES 4096
#define MAX_GRACE_S 3600 /* --grace, at most */
#define MAX_MPI_ARGS 64  /* --mpi-arg, at most */

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
               "       zinf launch --hostfile FILE [-n N] [--name NAME] [--mpi-arg ARG]...\n"
               "                   [--] COMMAND [ARGS...]\n"
               "Start N ranks of one job on this node: N copies of COMMAND, each with RANK,\n"
               "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and ZINF_COMM_NAME set, every line\n"
               "they print prefixed with \"[RANK] \" (stdout to stdout, stderr to stderr).\n"
               "  -n, --ranks N   how many ranks (1-%d)\n"
               "  --name NAME     the job's name, which its ranks meet under: 1-%d characters\n"
               "                  of [A-Za-z0-9._-], not starting with '.' (default:\n"
               "                  launch-PID-RANDOM); one live job per name and user\n"
               "  --grace S       after a rank fails, or after SIGINT/SIGTERM/SIGHUP is passed\n"
               "                  on, how long the others have before SIGKILL (0-%d,\n"
               "                  default 30)\n"
               "  --no-bind       leave every rank on every CPU (default: each rank on the\n"
               "                  CPUs of the NUMA node nearest GPU LOCAL_RANK, where known;\n"
               "                  each binding is said on stderr)\n"
               "  --xml FILE      place the ranks on the machine an hwloc XML file describes\n"
               "                  (said, not bound: to see what a machine would get)\n"
               "  --connect SOCKET  the ranks keep their state in the zinf daemon on SOCKET\n"
               "                  (zinf serve): ZINF_CONNECT is set, which zinf train takes;\n"
               "                  rank R of N is the daemon's job JOB-rank-R-of-N\n"
               "  --hostfile FILE the ranks across the hosts of FILE (DeepSpeed's format:\n"
               "                  'HOST slots=N' a line, '#' comments; no slots=: 1), started\n"
               "                  by Open MPI's mpirun (on PATH) with --map-by slot; -n\n"
               "                  defaults to the slots in all. Each rank has\n"
               "                  OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK (zinf train takes\n"
               "                  them), ZINF_COMM_NAME, ZINF_COMM_SECRET and every ZINF_*,\n"
               "                  OMPI_MCA_* and OMP_* variable of the launcher's; the lines\n"
               "                  are prefixed \"[RANK] \" as on one node; the exit status is\n"
               "                  mpirun's; SIGINT/SIGTERM/SIGHUP go to mpirun\n"
               "  --mpi-arg ARG   with --hostfile: ARG passed to mpirun as it is (repeatable)\n"
               "With N > 1, OMP_NUM_THREADS (CPUs / N) and OMP_WAIT_POLICY (passive) are set\n"
               "where the environment does not set them.\n"
               "COMMAND zinf train --config FILE: N is checked, before any rank starts,\n"
               "against FILE's pipeline.stages x tensor_parallel.autotp_size (or\n"
               "sequence_parallel_size): a multiple of it, or exit 2 naming the N that fit.\n"
               "SIGINT/SIGTERM/SIGHUP: passed on to every rank; a second one kills them.\n"
               "SIGQUIT: passed on. Ctrl-Z (SIGTSTP) stops the ranks, then the launcher;\n"
               "SIGCONT (fg, bg) continues them. If the launcher dies, its ranks get SIGTERM.\n"
               "Exit status: 0 every rank exited 0; 1 a rank failed (the launcher says which,\n"
               "and how); 2 bad usage (an N that does not fit zinf train's config too), or a\n"
               "live job has the name; 127 COMMAND could not be\n"
               "run; 130/143/129 stopped by SIGINT/SIGTERM/SIGHUP.\n",
            COMM_MAX_RANKS, COMM_NAME_BYTES - 1, MAX_GRACE_S);
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

/* To each rank's process group (the rank and what it started). A stopped rank is woken to
 * take its SIGTERM or SIGINT, and woken first: a SIGCONT discards every stop signal pending,
 * so one sent after could land while the rank, already exiting, waits for a stop it asked
 * for (a sanitizer's leak check at exit attaches to its own threads with ptrace and waits
 * for each to stop; it waited forever, and the rank ran out the grace). */
static void signal_all(struct rank *rk, int n, int sig)
{
    for (int r = 0; r < n; r++)
        if (!rk[r].done && rk[r].pid > 0) {
            if (sig != SIGKILL && kill(-rk[r].pid, SIGCONT) != 0) kill(rk[r].pid, SIGCONT);
            if (kill(-rk[r].pid, sig) != 0) kill(rk[r].pid, sig);
        }
}

/* sig to each rank's process group as it is: no SIGCONT first (SIGTSTP, SIGCONT, SIGQUIT). */
static void forward(struct rank *rk, int n, int sig)
{
    for (int r = 0; r < n; r++)
        if (!rk[r].done && rk[r].pid > 0 && kill(-rk[r].pid, sig) != 0) kill(rk[r].pid, sig);
}

/* Ctrl-Z. The terminal's SIGTSTP reaches the launcher's process group, not the ranks', each
 * of which has its own: the ranks would train on, fill the pipes to a launcher that no
 * longer reads them and block there, and after zinf.comm_timeout the job would fail. So the
 * job stops as a shell's job does, every process at once: the ranks get SIGTSTP, then the
 * launcher stops itself (SIGSTOP: its SIGTSTP is blocked, taken through the signalfd). The
 * SIGCONT of fg or bg continues the launcher, whose loop passes it on to the ranks. */
static void stop_job(struct rank *rk, int n)
{
    forward(rk, n, SIGTSTP);
    fflush(NULL);
    raise(SIGSTOP);
}

/* Whether sig was ignored when we started (nohup's SIGHUP, a background job's SIGQUIT):
 * then it is left so, for the launcher and the ranks alike. */
static bool ignored(int sig)
{
    struct sigaction sa;
    return sigaction(sig, NULL, &sa) == 0 && sa.sa_handler == SIG_IGN;
}

/* The job's name, held: the lock on /dev/shm/zinf-job-NAME, taken without waiting. 0 and
 * *fd; -EBUSY a live launcher holds it (said, naming it); -EACCES it is not this user's. */
static int hold_name(const char *name, int *fd)
{
    char obj[COMM_NAME_BYTES + 16], path[COMM_NAME_BYTES + 32];
    snprintf(obj, sizeof(obj), "/zinf-job-%s", name);
    snprintf(path, sizeof(path), "/dev/shm%s", obj);
    for (int tries = 0; tries < 100; tries++) {
        int f = shm_open(obj, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        struct stat st, now;
        if (f < 0 && errno == EACCES && lstat(path, &st) == 0) {
            struct passwd *pw = getpwuid(st.st_uid);
            fprintf(stderr, "zinf launch: the job name '%s' is held by uid %u%s%s%s "
                    "(/dev/shm%s): give the job another --name\n", name, (unsigned)st.st_uid,
                    pw ? " (" : "", pw ? pw->pw_name : "", pw ? ")" : "", obj);
            return -EACCES;
        }
        if (f < 0) {
            int e = errno;
            fprintf(stderr, "zinf launch: /dev/shm%s: %s\n", obj, strerror(e));
            return -e;
        }
        if (fstat(f, &st) != 0 || st.st_uid != geteuid() || (st.st_mode & 07777) != 0600 ||
            !S_ISREG(st.st_mode)) {
            struct passwd *pw = getpwuid(st.st_uid);
            fprintf(stderr, "zinf launch: /dev/shm%s belongs to uid %u%s%s%s with mode %04o, not "
                    "to this user with 0600: give the job another --name\n", obj,
                    (unsigned)st.st_uid, pw ? " (" : "", pw ? pw->pw_name : "", pw ? ")" : "",
                    (unsigned)(st.st_mode & 07777));
            close(f);
            return -EACCES;
        }
        if (flock(f, LOCK_EX | LOCK_NB) != 0) {
            char buf[32] = "";
            ssize_t got = pread(f, buf, sizeof(buf) - 1, 0);
            buf[got > 0 ? got : 0] = 0;
            buf[strcspn(buf, "\n")] = 0;
            if (!buf[0]) { /* just made by another launcher, or being swept: look again */
                close(f);
                usleep(10000);
                continue;
            }
            fprintf(stderr, "zinf launch: a job named '%s' is running (its launcher is pid %s): "
                    "give this one another --name\n", name, buf[0] ? buf : "?");
            close(f);
            return -EBUSY;
        }
        /* Held; but a launcher that was leaving may have removed the name after we opened
         * it: then this lock is on a file no one else finds, and we start again. */
        if (lstat(path, &now) != 0 || now.st_ino != st.st_ino) {
            close(f);
            continue;
        }
        char pid[32];
        int n = snprintf(pid, sizeof(pid), "%d\n", (int)getpid());
        if (ftruncate(f, 0) != 0 || pwrite(f, pid, (size_t)n, 0) != n) { /* only informative */
        }
        *fd = f;
        return 0;
    }
    fprintf(stderr, "zinf launch: /dev/shm%s keeps changing under us\n", obj);
    return -EAGAIN;
}

/* Names held by launchers that are gone (killed: SIGKILL leaves the file, not the lock):
 * this user's zinf-job-* files whose lock can be taken are removed, while it is held. */
static void sweep_stale_names(void)
{
    DIR *d = opendir("/dev/shm");
    struct dirent *de;
    while (d && (de = readdir(d))) {
        char obj[300];
        struct stat st;
        if (strncmp(de->d_name, "zinf-job-", 9)) continue;
        snprintf(obj, sizeof(obj), "/%s", de->d_name);
        int f = shm_open(obj, O_RDWR | O_CLOEXEC, 0);
        if (f < 0) continue; /* another user's, or gone */
        if (fstat(f, &st) == 0 && st.st_uid == geteuid() && flock(f, LOCK_EX | LOCK_NB) == 0)
            shm_unlink(obj);
        close(f);
    }
    if (d) closedir(d);
}

static void release_name(const char *name, int fd)
{
    char obj[COMM_NAME_BYTES + 16];
    snprintf(obj, sizeof(obj), "/zinf-job-%s", name);
    shm_unlink(obj); /* while still holding the lock: nobody else holds this file */
    close(fd);
}

/* A parsed whole number in [lo, hi], or false. */
static bool parse_range(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!*s || *end || errno || v < lo || v > hi) return false;
    *out = v;
    return true;
}

static const char *sig_name(int sig)
{
    return sig == SIGINT    ? "SIGINT"
           : sig == SIGTERM ? "SIGTERM"
           : sig == SIGHUP  ? "SIGHUP"
                            : "a signal";
}

/* The ranks still running when the grace after sig ends, each named with its state (a rank
 * stopped, or asleep in the kernel, reads differently from one that ignores the signal). */
static void name_stragglers(const struct rank *rk, int n, int grace_s, int sig)
{
    for (int r = 0; r < n; r++)
        if (!rk[r].done && rk[r].pid > 0)
            fprintf(stderr, "zinf launch: rank %d (pid %d, state %c) still running %d s after "
                    "%s: killed\n", r, (int)rk[r].pid, comm_proc_state(rk[r].pid), grace_s,
                    sig_name(sig));
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
                                         {"hostfile", required_argument, NULL, 'H'},
                                         {"mpi-arg", required_argument, NULL, 'A'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    int n = 0, grace_s = 30;
    bool bind = true;
    const char *name = NULL, *xml = NULL, *hostfile = NULL;
    char *mpi_args[MAX_MPI_ARGS];
    int n_mpi_args = 0, c;

    optind = 1;
    /* "+": options end at COMMAND, whose own options are its own. */
    while ((c = getopt_long(argc, argv, "+n:h", opts, NULL)) != -1) {
        switch (c) {
        case 'n': {
            long v;
            if (!parse_range(optarg, 1, COMM_MAX_RANKS, &v)) {
                fprintf(stderr, "zinf launch: -n %s: a number of ranks from 1 to %d\n", optarg,
                        COMM_MAX_RANKS);
                return 2;
            }
            n = (int)v;
            break;
        }
        case 'm':
            name = optarg;
            break;
        case 'g': {
            long v;
            if (!parse_range(optarg, 0, MAX_GRACE_S, &v)) {
                fprintf(stderr, "zinf launch: --grace %s: whole seconds from 0 to %d\n", optarg,
                        MAX_GRACE_S);
                return 2;
            }
            grace_s = (int)v;
            break;
        }
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
        case 'H':
            hostfile = optarg;
            break;
        case 'A':
            if (n_mpi_args == MAX_MPI_ARGS) {
                fprintf(stderr, "zinf launch: --mpi-arg: at most %d of them\n", MAX_MPI_ARGS);
                return 2;
            }
            mpi_args[n_mpi_args++] = optarg;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (n_mpi_args && !hostfile) {
        fprintf(stderr, "zinf launch: --mpi-arg goes with --hostfile (the ranks under mpirun)\n");
        return 2;
    }
    if ((n == 0 && !hostfile) || optind >= argc) {
        fprintf(stderr, "zinf launch: %s\n",
                n == 0 && !hostfile ? "-n N is required (or --hostfile FILE)" : "no COMMAND to run");
        usage(stderr);
        return 2;
    }
    /* zinf train's ranks against its config's layout, before anything starts: across
     * nodes, N is the hostfile's slots where -n is not given (a hostfile that cannot be read
     * is launch_mpi_run's to say). */
    int world = n;
    if (!world && hostfile) {
        struct hostfile *hf = calloc(1, sizeof(*hf));
        char herr[512];
        if (hf && hostfile_read(hostfile, hf, herr, sizeof(herr)) == 0) world = hf->total_slots;
        free(hf);
    }
    if (world && launch_layout_check(argv + optind, world)) return 2;
    /* The job's secret, and its default name: random, so that neither can be guessed, and
     * two launchers of one PID (in containers that share /dev/shm) do not meet. */
    uint8_t rnd[COMM_SECRET_HEX / 2 + 4];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) {
        fprintf(stderr, "zinf launch: getrandom: %s\n", strerror(errno));
        return 1;
    }
    char secret[COMM_SECRET_HEX + 1], defname[COMM_NAME_BYTES];
    for (int i = 0; i < COMM_SECRET_HEX / 2; i++)
        snprintf(secret + 2 * i, 3, "%02x", rnd[i]);
    if (!name) {
        const uint8_t *x = rnd + COMM_SECRET_HEX / 2;
        snprintf(defname, sizeof(defname), "launch-%d-%02x%02x%02x%02x", (int)getpid(), x[0], x[1],
                 x[2], x[3]);
        name = defname;
    } else if (!comm_name_ok(name)) {
        fprintf(stderr,
                "zinf launch: --name '%.*s%s': 1-%d characters of [A-Za-z0-9._-], not starting "
                "with '.'\n",
                80, name, strlen(name) > 80 ? "..." : "", COMM_NAME_BYTES - 1);
        return 2;
    }

    struct topo *t = NULL;
    if (bind && !hostfile) { /* under mpirun, each node's binding is Open MPI's */
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

    /* SIGCHLD, the signals that stop the job and those passed on arrive through a signalfd;
     * the ranks get them unblocked. One ignored when we started is neither taken nor
     * passed on: the ranks ignore it too. */
    sigset_t mask, old;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGCONT);
    static const int optional[] = {SIGHUP, SIGQUIT, SIGTSTP};
    for (size_t i = 0; i < ARRAY_SIZE(optional); i++)
        if (!ignored(optional[i])) sigaddset(&mask, optional[i]);
    sigprocmask(SIG_BLOCK, &mask, &old);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) {
        fprintf(stderr, "zinf launch: signalfd: %s\n", strerror(errno));
        return 1;
    }

    sweep_stale_names();
    int name_fd = -1, he = hold_name(name, &name_fd);
    if (he < 0) {
        if (t) topo_close(t);
        close(sfd);
        sigprocmask(SIG_SETMASK, &old, NULL);
        return he == -EBUSY || he == -EACCES ? 2 : 1;
    }
    if (hostfile) { /* the ranks across nodes: mpirun starts them, and is our one child */
        close(sfd);
        sigprocmask(SIG_SETMASK, &old, NULL);
        struct launch_mpi lm = {.hostfile = hostfile, .ranks = n, .name = name,
                                .secret = secret, .mpi_args = mpi_args,
                                .n_mpi_args = n_mpi_args, .command = argv + optind};
        int lr = launch_mpi_run(&lm);
        release_name(name, name_fd);
        return lr;
    }
    share_cpus(n);
    struct rank *rk = calloc((size_t)n, sizeof(*rk));
    if (!rk) return 1;
    int exec_failed[2];
    if (pipe2(exec_failed, O_CLOEXEC) != 0) return 1;
    pid_t launcher = getpid();
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
            /* Its own process group; SIGTERM when the launcher dies, even if it died already
             * (then the parent is another process by now). */
            setpgid(0, 0);
            if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != launcher) _exit(1);
            dup2(p[0][1], STDOUT_FILENO);
            dup2(p[1][1], STDERR_FILENO);
            snprintf(v, sizeof(v), "%d", r);
            setenv("RANK", v, 1);
            setenv("LOCAL_RANK", v, 1);
            snprintf(v, sizeof(v), "%d", n);
            setenv("WORLD_SIZE", v, 1);
            setenv("LOCAL_WORLD_SIZE", v, 1);
            setenv("ZINF_COMM_NAME", name, 1);
            setenv("ZINF_COMM_SECRET", secret, 1);
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
        setpgid(pid, pid); /* as the child does: whichever runs first */
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
            if (!rc) name_stragglers(rk, started, grace_s, stop_sig ? stop_sig : SIGTERM);
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
            if (si.ssi_signo == SIGTSTP) {
                stop_job(rk, started);
                continue;
            }
            if (si.ssi_signo == SIGCONT || si.ssi_signo == SIGQUIT) {
                forward(rk, started, (int)si.ssi_signo);
                continue;
            }
            if (stop_sig) { /* a second one: now */
                signal_all(rk, started, SIGKILL);
                continue;
            }
            stop_sig = (int)si.ssi_signo;
            fprintf(stderr, "zinf launch: %s: passed on to the ranks\n", sig_name(stop_sig));
            signal_all(rk, started, stop_sig); /* SIGINT, SIGTERM or SIGHUP */
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
    /* A rank 0 killed while the ranks met leaves the rendezvous segment behind: it is this
     * job's (its name carries a tag keyed by the secret), and no rank is left to use it.
     * Only this user's is removed: what another user made under the name is not ours. */
    char seg[COMM_NAME_BYTES + 64], seg_path[COMM_NAME_BYTES + 80];
    struct stat seg_st;
    if (comm_segment_name(name, secret, seg, sizeof(seg)) == 0 &&
        snprintf(seg_path, sizeof(seg_path), "/dev/shm%s", seg) > 0 &&
        lstat(seg_path, &seg_st) == 0 && seg_st.st_uid == geteuid() && shm_unlink(seg) == 0)
        fprintf(stderr, "zinf launch: removed the rendezvous /dev/shm%s its ranks left\n", seg);
    release_name(name, name_fd);
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

/*
 * shm_intruder.c - another user against a running job of `zinf launch --name NAME`, for
 * test_pipeline.c (run as uid 65534 by setpriv while the job runs as root). From before the
 * job starts until its name goes away it watches /dev/shm and, for everything of the job
 * that appears there, tries what a hostile neighbour would:
 *   - open it to read, to write, and both (the segments, the launcher's name lock);
 *   - create, from each segment name it saw, the names the job would take next (the
 *     pipeline's other links under the same tag, and the tag of the one it saw under every
 *     link name), so that the job finds them taken;
 *   - read the ranks' and the launcher's environment (which holds ZINF_COMM_SECRET), their
 *     memory and their open files through /proc;
 *   - connect to any unix socket whose path names the job (/proc/net/unix).
 * Every attempt is a line on stdout: "refused WHAT: ERRNO", "OPENED WHAT" (the job's
 * object reached: a failure), "planted NAME" (a name created in /dev/shm: harmless only if
 * the job never uses it, which the test checks by the job's result) or "nothing WHAT".
 * Exit 0: nothing of the job was reached; 1: something was; 2: bad usage, or the job (its
 * launcher and RANKS ranks) not seen within SECONDS.
 *
 * Not here: the judgement of the job's result (test_pipeline.c), the daemon's socket
 * (test_serve_guard.c). It links nothing of zinf's: it is a stranger's program.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define MAX_SEEN 256

static const char *job;
static char seen[MAX_SEEN][NAME_MAX + 1]; /* entries of the job already tried */
static int n_seen, n_reached, n_planted;
static char planted[MAX_SEEN][NAME_MAX + 1];

static bool refused_errno(int e)
{
    return e == EACCES || e == EPERM || e == EEXIST || e == ENOENT || e == ECONNREFUSED;
}

/* One attempt's result: fd >= 0 reached it (closed here). */
static void report(const char *what, int fd, int e)
{
    if (fd >= 0) {
        printf("OPENED %s\n", what);
        close(fd);
        n_reached++;
    } else if (refused_errno(e))
        printf("refused %s: %s\n", what, strerror(e));
    else { /* anything else is no refusal we expected: count it against the job */
        printf("OPENED? %s: %s\n", what, strerror(e));
        n_reached++;
    }
    fflush(stdout);
}

static void try_open(const char *path, int flags, const char *how)
{
    char what[PATH_MAX + 32];
    snprintf(what, sizeof(what), "%s %s", how, path);
    int fd = open(path, flags | O_CLOEXEC | O_NOFOLLOW);
    report(what, fd, errno);
}

/* A name the job may take next, created first; ours are removed at the end. */
static void plant(const char *name)
{
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "/dev/shm/%s", name);
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
    if (fd >= 0) {
        close(fd);
        printf("planted %s\n", name);
        if (n_planted < MAX_SEEN) snprintf(planted[n_planted++], NAME_MAX + 1, "%s", name);
    } else {
        char what[PATH_MAX + 16];
        snprintf(what, sizeof(what), "create %s", path);
        report(what, -1, errno);
    }
    fflush(stdout);
}

/* From "zinf-comm-JOB.LINK.D.R.TAG" (or "zinf-comm-JOB.TAG"): the job's other names under
 * the tag seen, created first (the tag is all another user can learn of the secret). */
static void plant_next(const char *name)
{
    char prefix[NAME_MAX + 1];
    snprintf(prefix, sizeof(prefix), "zinf-comm-%s.", job);
    if (strncmp(name, prefix, strlen(prefix))) return;
    const char *tag = strrchr(name, '.');
    if (!tag || strlen(tag + 1) < 8) return;
    static const char *const links[] = {"pp", "pf0", "pb0", "pw", "tp", "sp"};
    char next[NAME_MAX + 1];
    for (size_t l = 0; l < sizeof(links) / sizeof(links[0]); l++)
        for (int d = 0; d < 2; d++)
            for (int r = 0; r < 2; r++) {
                snprintf(next, sizeof(next), "zinf-comm-%s.%s.%d.%d%s", job, links[l], d, r, tag);
                if (strcmp(next, name)) plant(next);
            }
    snprintf(next, sizeof(next), "zinf-comm-%s%s", job, tag); /* the ZeRO ranks' own */
    if (strcmp(next, name)) plant(next);
}

static bool is_ours(const char *name)
{
    for (int i = 0; i < n_planted; i++)
        if (!strcmp(planted[i], name)) return true;
    return false;
}

/* Everything of the job in /dev/shm not tried yet. Returns whether the job's name lock is
 * there. */
static bool scan(void)
{
    char lock[NAME_MAX + 1], comm[NAME_MAX + 1];
    snprintf(lock, sizeof(lock), "zinf-job-%s", job);
    snprintf(comm, sizeof(comm), "zinf-comm-%s.", job);
    bool live = false;
    DIR *d = opendir("/dev/shm");
    struct dirent *de;
    while (d && (de = readdir(d))) {
        if (strcmp(de->d_name, lock) && strncmp(de->d_name, comm, strlen(comm))) continue;
        if (!strcmp(de->d_name, lock)) live = true;
        if (is_ours(de->d_name)) continue;
        bool again = false;
        for (int i = 0; i < n_seen; i++)
            again |= !strcmp(seen[i], de->d_name);
        if (again || n_seen == MAX_SEEN) continue;
        snprintf(seen[n_seen++], NAME_MAX + 1, "%s", de->d_name);
        char path[PATH_MAX];
        snprintf(path, sizeof(path), "/dev/shm/%s", de->d_name);
        plant_next(de->d_name); /* first: the job's next names are being made now */
        try_open(path, O_RDONLY, "read");
        try_open(path, O_WRONLY, "write");
        try_open(path, O_RDWR, "read-write");
        try_open(path, O_RDWR | O_CREAT, "create-or-open");
        try_open(path, O_WRONLY | O_TRUNC, "truncate");
        if (unlink(path) == 0) {
            printf("OPENED unlink %s\n", path);
            n_reached++;
        } else
            report("unlink", -1, errno);
    }
    if (d) closedir(d);
    return live;
}

/* Whether the NUL-separated command line cmd (got bytes) has "--name JOB". */
static bool names_job(const char *cmd, size_t got)
{
    const char *prev = "";
    for (size_t i = 0; i < got; i += strlen(cmd + i) + 1) {
        if (!strcmp(prev, "--name") && !strcmp(cmd + i, job)) return true;
        prev = cmd + i;
    }
    return false;
}

/* The launcher (its command line names the job) and its children, the ranks. */
static int job_pids(int *pids, int max)
{
    int n = 0, launcher = -1;
    DIR *d = opendir("/proc");
    struct dirent *de;
    char path[300], buf[4096];
    if (!d) return 0;
    while (launcher < 0 && (de = readdir(d))) {
        snprintf(path, sizeof(path), "/proc/%s/cmdline", de->d_name);
        FILE *f = fopen(path, "re");
        if (!f) continue;
        size_t got = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[got] = 0;
        if (names_job(buf, got)) launcher = atoi(de->d_name);
    }
    if (launcher > 0 && n < max) pids[n++] = launcher;
    rewinddir(d);
    while (launcher > 0 && n < max && (de = readdir(d))) {
        snprintf(path, sizeof(path), "/proc/%s/stat", de->d_name);
        FILE *f = fopen(path, "re");
        int ppid = 0;
        if (!f) continue;
        if (fgets(buf, sizeof(buf), f)) {
            char *p = strrchr(buf, ')');
            if (p && sscanf(p + 2, "%*c %d", &ppid) != 1) ppid = 0;
        }
        fclose(f);
        if (ppid == launcher) pids[n++] = atoi(de->d_name);
    }
    closedir(d);
    return n;
}

/* The launcher's and the ranks' /proc entries, once all ranks are there: how many of
 * them were found (1 + ranks: tried). */
static int try_procs(int ranks)
{
    int pids[16], n = job_pids(pids, 16);
    if (n < 1 + ranks) return n;
    static const char *const files[] = {"environ", "mem", "maps", "fd", "map_files"};
    for (int i = 0; i < n; i++)
        for (size_t k = 0; k < sizeof(files) / sizeof(files[0]); k++) {
            char path[64];
            snprintf(path, sizeof(path), "/proc/%d/%s", pids[i], files[k]);
            bool dir = !strcmp(files[k], "fd") || !strcmp(files[k], "map_files");
            if (dir) {
                DIR *d = opendir(path);
                int e = errno;
                char what[96];
                snprintf(what, sizeof(what), "list %s", path);
                report(what, d ? dirfd(d) >= 0 ? dup(dirfd(d)) : -1 : -1, e);
                if (d) closedir(d);
            } else
                try_open(path, O_RDONLY, "read");
        }
    return n;
}

/* Unix sockets whose path names the job: connected to. (A zinf daemon's socket takes every
 * user by design, and may be another test's: test_serve_guard.c is its stranger.) */
static void try_sockets(void)
{
    FILE *f = fopen("/proc/net/unix", "re");
    char line[4096];
    int n = 0;
    while (f && fgets(line, sizeof(line), f)) {
        char *path = strrchr(line, ' ');
        if (!path || path[1] == '\n' || !strchr(path, '/')) continue;
        path++;
        path[strcspn(path, "\n")] = 0;
        if (!strstr(path, job)) continue;
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
        int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        int r = s >= 0 ? connect(s, (struct sockaddr *)&a, sizeof(a)) : -1;
        int e = errno;
        char what[PATH_MAX];
        snprintf(what, sizeof(what), "connect %s", path);
        report(what, r == 0 ? s : -1, e);
        if (r != 0 && s >= 0) close(s);
        n++;
    }
    if (f) fclose(f);
    if (!n) printf("nothing sockets: no unix socket names the job\n");
}

int main(int argc, char **argv)
{
    if (argc != 4 || atoi(argv[2]) < 1 || atoi(argv[2]) > 15 || atoi(argv[3]) < 1) {
        fprintf(stderr, "usage: shm_intruder JOB_NAME RANKS SECONDS\n");
        return 2;
    }
    job = argv[1];
    int ranks = atoi(argv[2]);
    int in = inotify_init1(IN_CLOEXEC);
    if (in < 0 || inotify_add_watch(in, "/dev/shm", IN_CREATE) < 0) {
        perror("shm_intruder: inotify on /dev/shm");
        return 2;
    }
    printf("watching /dev/shm as uid %d\n", (int)getuid());
    fflush(stdout);
    time_t end = time(NULL) + atoi(argv[3]);
    bool was_live = false, procs_tried = false;
    char ev[4096];
    while (time(NULL) < end) {
        bool live = scan();
        if (live && !procs_tried && try_procs(ranks) >= 1 + ranks) { /* the ranks run */
            try_sockets();
            procs_tried = true;
        }
        if (was_live && !live) break; /* the job is over */
        was_live |= live;
        /* The next creation in /dev/shm, or a look every 20 ms. */
        struct timespec ts = {0, 20 * 1000000};
        fd_set fs;
        FD_ZERO(&fs);
        FD_SET(in, &fs);
        if (pselect(in + 1, &fs, NULL, NULL, &ts, NULL) > 0 && read(in, ev, sizeof(ev)) < 0) break;
    }
    for (int i = 0; i < n_planted; i++) {
        char path[PATH_MAX];
        snprintf(path, sizeof(path), "/dev/shm/%.255s", planted[i]);
        unlink(path);
    }
    printf("done: %d of the job's entries seen, %d reached, %d names planted, %s\n", n_seen,
           n_reached, n_planted, procs_tried ? "its processes tried" : "its processes not found");
    close(in);
    if (!was_live || !procs_tried) return 2;
    return n_reached ? 1 : 0;
}

/* gnuplot.c - running gnuplot (gnuplot.h). */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "gnuplot.h"

extern char **environ;

int gnuplot_tmpdir(char *tmp, size_t len)
{
    const char *td = getenv("TMPDIR");
    snprintf(tmp, len, "%s/zinf-plot-XXXXXX", td && td[0] ? td : "/tmp");
    return mkdtemp(tmp) ? 0 : -errno;
}

void gnuplot_rmdir(const char *tmp, const char *const *names)
{
    char p[4096];
    for (; *names; names++) {
        snprintf(p, sizeof(p), "%s/%s", tmp, *names);
        unlink(p);
    }
    rmdir(tmp);
}

void gnuplot_quote(FILE *f, const char *s)
{
    fputc('\'', f);
    for (; *s; s++) {
        if (*s == '\'') fputc('\'', f);
        fputc(*s, f);
    }
    fputc('\'', f);
}

/* gnuplot's message, in one line, into why (empty when it said nothing): its first error
 * ("SCRIPT" line N: TEXT, given as TEXT: the script is a temporary file), with the "system
 * error: ..." line that may follow it; a warning only where there is no error; else the first
 * line that is not an echo of the script (the line above a caret) nor the caret itself. */
static void gnuplot_why(char *msg, char *why, size_t n)
{
    const char *error = NULL, *warning = NULL, *plain = NULL, *syserr = NULL;
    char *lines[64];
    size_t k = 0;

    for (char *save, *l = strtok_r(msg, "\n", &save); l && k < ARRAY_SIZE(lines);
         l = strtok_r(NULL, "\n", &save)) {
        size_t len = strlen(l);
        while (len && isspace((unsigned char)l[len - 1]))
            l[--len] = '\0';
        if (len) lines[k++] = l;
    }
    for (size_t i = 0; i < k; i++) {
        const char *l = lines[i], *at = l[0] == '"' ? strstr(l + 1, "\" line ") : NULL;
        if (at && (at = strstr(at, ": "))) {
            at += 2;
            if (!strncmp(at, "warning: ", 9)) {
                if (!warning) warning = at;
            } else if (!error) {
                error = at;
                if (i + 1 < k && !strncmp(lines[i + 1], "system error: ", 14))
                    syserr = lines[i + 1] + 14;
            }
        } else if (!plain && strspn(l, " ^") != strlen(l) &&
                   (i + 1 == k || strspn(lines[i + 1], " ^") != strlen(lines[i + 1]))) {
            plain = l;
        }
    }
    const char *first = error ? error : warning ? warning : plain ? plain : "";
    if (syserr)
        snprintf(why, n, "%s (%s)", first, syserr);
    else
        snprintf(why, n, "%s", first);
}

int gnuplot_run(const char *who, const char *script, const char *out)
{
    char *args[] = {"gnuplot", (char *)script, NULL};
    posix_spawn_file_actions_t fa;
    int fds[2], e;
    pid_t pid;

    unlink(out); /* what is there afterwards is gnuplot's */
    if (pipe2(fds, O_CLOEXEC)) {
        fprintf(stderr, "zinf %s: cannot run gnuplot: %s\n", who, strerror(errno));
        return 1;
    }
    /* gnuplot's stderr is the pipe's write end; this process keeps only the read end. */
    e = posix_spawn_file_actions_init(&fa);
    if (!e) {
        e = posix_spawn_file_actions_adddup2(&fa, fds[1], STDERR_FILENO);
        if (!e) e = posix_spawnp(&pid, "gnuplot", &fa, NULL, args, environ);
        posix_spawn_file_actions_destroy(&fa);
    }
    close(fds[1]);
    if (e) {
        close(fds[0]);
        fprintf(stderr, "zinf %s: cannot run gnuplot: %s%s\n", who, strerror(e),
                e == ENOENT ? " (install it: apt-get install gnuplot-nox; scripts/setup.sh does)"
                            : "");
        return 1;
    }
    /* Read to the end (gnuplot would block on a full pipe), keeping the first 4 KiB. */
    char msg[4096], chunk[4096];
    size_t len = 0;
    for (;;) {
        ssize_t r = read(fds[0], chunk, sizeof(chunk));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        size_t keep = MIN((size_t)r, sizeof(msg) - 1 - len);
        memcpy(msg + len, chunk, keep);
        len += keep;
    }
    msg[len] = '\0';
    close(fds[0]);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    struct stat sb;
    if (WIFEXITED(st) && !WEXITSTATUS(st) && !stat(out, &sb) && sb.st_size > 0) return 0;
    char why[512], how[64];
    gnuplot_why(msg, why, sizeof(why));
    if (WIFEXITED(st))
        snprintf(how, sizeof(how), "exit %d", WEXITSTATUS(st));
    else
        snprintf(how, sizeof(how), "signal %d", WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    if (WIFEXITED(st) && !WEXITSTATUS(st))
        fprintf(stderr, "zinf %s: gnuplot did not write %s%s%s\n", who, out, why[0] ? ": " : "",
                why);
    else if (why[0])
        fprintf(stderr, "zinf %s: gnuplot failed (%s): %s\n", who, how, why);
    else
        fprintf(stderr, "zinf %s: gnuplot failed (%s) and %s was not written\n", who, how, out);
    return 1;
}

/* gnuplot.c - running gnuplot (gnuplot.h). */
#include <errno.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

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

int gnuplot_run(const char *who, const char *script, const char *out)
{
    char *args[] = {"gnuplot", (char *)script, NULL};
    pid_t pid;
    unlink(out); /* what is there afterwards is gnuplot's */
    int e = posix_spawnp(&pid, "gnuplot", NULL, NULL, args, environ);
    if (e) {
        fprintf(stderr, "zinf %s: cannot run gnuplot: %s%s\n", who, strerror(e),
                e == ENOENT ? " (install it: apt-get install gnuplot-nox; scripts/setup.sh does)"
                            : "");
        return 1;
    }
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    struct stat sb;
    if (!WIFEXITED(st) || WEXITSTATUS(st) || stat(out, &sb) || sb.st_size == 0) {
        fprintf(stderr, "zinf %s: gnuplot failed (status %#x) and %s was not written\n", who, st,
                out);
        return 1;
    }
    return 0;
}

/*
 * tune_util.c - see tune_util.h.
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tune_util.h"

int tune_self_exe(char buf[PATH_MAX])
{
    ssize_t sl = readlink("/proc/self/exe", buf, PATH_MAX - 1);
    if (sl <= 0) {
        fprintf(stderr, "zinf tune: cannot find this program (/proc/self/exe): %s\n",
                strerror(errno));
        return 1;
    }
    buf[sl] = '\0';
    return 0;
}

int tune_check_out(const char *out, bool force)
{
    struct stat sb;
    if (!force && stat(out, &sb) == 0) {
        fprintf(stderr, "zinf tune: --out %s exists; --force to replace it\n", out);
        return 2;
    }
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp", out) >= (int)sizeof(tmp)) {
        fprintf(stderr, "zinf tune: --out %s: too long\n", out);
        return 2;
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        fprintf(stderr, "zinf tune: --out %s: cannot write there: %s\n", out, strerror(errno));
        return 2;
    }
    close(fd);
    unlink(tmp);
    return 0;
}

static int remove_one(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb, (void)type, (void)ftw;
    if (remove(path) < 0)
        fprintf(stderr, "zinf tune: cannot remove %s: %s\n", path, strerror(errno));
    return 0;
}

void tune_remove_tree(const char *path)
{
    if (access(path, F_OK) == 0) nftw(path, remove_one, 16, FTW_DEPTH | FTW_PHYS);
}

void tune_say_pick(const char *best, double best_med, const char *pick, double pick_med,
                   bool pick_is_best, unsigned nties, int digits, const char *unit)
{
    printf("# best median: %s: %.*f %s\n", best, digits, best_med, unit);
    if (!pick_is_best)
        printf("# picked: %s: %.*f %s; %u points tie with the best (their median is within its "
               "spread), this is the cheapest\n", pick, digits, pick_med, unit, nties);
    else
        printf("# picked: %s (%s)\n", pick,
               nties > 1 ? "the cheapest of the points that tie" : "no other point ties");
}

void tune_say_json(json_t *j)
{
    char *s = j ? json_dumps(j, JSON_PRESERVE_ORDER) : NULL;
    if (s) printf("%s\n", s);
    free(s);
    json_decref(j);
}

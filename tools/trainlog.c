/*
 * trainlog.c - the `zinf train --log` reader of trainlog.h.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainlog.h"

int trainlog_each(const char *cmd, const char *path, int (*each)(json_t *j, int line, void *arg),
                  void *arg)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "zinf %s: %s: %s\n", cmd, path, strerror(errno));
        return 2;
    }
    char *line = NULL;
    size_t cap = 0;
    int no = 0, rc = 0;
    while (rc == 0 && getline(&line, &cap, f) > 0) {
        no++;
        if (line[strspn(line, " \t\r\n")] == '\0') continue;
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        if (!json_is_object(j)) {
            if (!j && !strchr(line, '\n')) break; /* cut short by a kill: skipped */
            fprintf(stderr,
                    "zinf %s: %s:%d: not a JSON object (%s): is it a zinf train --log file?\n", cmd,
                    path, no, j ? "another JSON value" : je.text);
            rc = 2;
        } else {
            rc = each(j, no, arg);
        }
        json_decref(j);
    }
    free(line);
    fclose(f);
    return rc;
}

void *trainlog_at(struct trainlog_steps *s, int step, size_t elem)
{
    if (step < 0 || step > TRAINLOG_MAX_STEP) return NULL;
    if (step >= s->cap) {
        int cap = s->cap ? s->cap : 256;
        while (cap <= step)
            cap *= 2;
        char *v = realloc(s->v, (size_t)cap * elem);
        if (!v) return NULL;
        memset(v + (size_t)s->cap * elem, 0, (size_t)(cap - s->cap) * elem);
        s->v = v;
        s->cap = cap;
    }
    if (step > s->last) s->last = step;
    return (char *)s->v + (size_t)step * elem;
}

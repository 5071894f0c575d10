/*
 * trainlog.h - reading a `zinf train --log` file (JSON lines) for the commands that take one
 * (`zinf plot`, `zinf compare`): one parse per line, the errors said the same way, and a
 * by-step table that grows as steps come.
 *
 * Not here: what a command takes from each line.
 */
#ifndef ZINF_TOOLS_TRAINLOG_H
#define ZINF_TOOLS_TRAINLOG_H

#include <jansson.h>
#include <stddef.h>

#define TRAINLOG_MAX_STEP 100000000

/* Calls each(j, line, arg) for every line of path, parsed (blank lines skipped). A line that
 * is not a JSON object ends the read with "zinf CMD: PATH:LINE: not a JSON object ..." on
 * stderr, except a last line cut short (no newline), which a killed run leaves and which is
 * skipped. Returns 0, 2 after saying why (also when the file cannot be opened), or what each
 * returned when that was not 0 (each says why). */
int trainlog_each(const char *cmd, const char *path, int (*each)(json_t *j, int line, void *arg),
                  void *arg);

/* A table of elem-byte entries indexed by step. */
struct trainlog_steps {
    void *v;
    int cap;  /* entries allocated */
    int last; /* the highest step asked for so far */
};

/* Entry `step` (0..TRAINLOG_MAX_STEP), zeroed when new; NULL when out of range or memory. */
void *trainlog_at(struct trainlog_steps *s, int step, size_t elem);

#endif

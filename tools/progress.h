/*
 * progress.h - a progress bar on stderr for long work (zinf bench's passes, zinf train's
 * checkpoints): what, a bar, the bytes done of the total, the rate and the time left,
 * redrawn at most ten times a second on one line, erased at the end. Only on a terminal and
 * when the command prints no JSON: elsewhere (a log file, a pipe) the command's own lines
 * are all there is.
 */
#ifndef ZINF_TOOLS_PROGRESS_H
#define ZINF_TOOLS_PROGRESS_H

#include <stdbool.h>
#include <stdint.h>

struct progress {
    bool on;          /* drawing */
    bool drawn;       /* a line is on the screen */
    const char *what;
    uint64_t total;   /* bytes; 0: unknown (no bar, no ETA) */
    uint64_t t0, last; /* now_ns() at the start and at the last draw */
    uint64_t delay_ns; /* nothing is drawn before this much time has passed */
};

/* Whether progress is drawn at all: stderr is a terminal and json is false. */
bool progress_wanted(bool json);
void progress_start(struct progress *p, bool enabled, const char *what, uint64_t total);
/* done bytes of total so far (redrawn when 100 ms have passed since the last time). */
void progress_show(struct progress *p, uint64_t done);
/* Erase the line: what follows prints where it was. */
void progress_end(struct progress *p);

#endif

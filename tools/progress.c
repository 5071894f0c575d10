/* progress.c - the progress bar (progress.h). */
#include <stdio.h>
#include <unistd.h>

#include "common.h"
#include "progress.h"

#define BAR 30

bool progress_wanted(bool json)
{
    return !json && isatty(STDERR_FILENO);
}

void progress_start(struct progress *p, bool enabled, const char *what, uint64_t total)
{
    *p = (struct progress){.on = enabled, .what = what, .total = total, .t0 = now_ns()};
}

void progress_show(struct progress *p, uint64_t done)
{
    if (!p->on) return;
    uint64_t now = now_ns();
    if (now - p->t0 < p->delay_ns || (p->drawn && now - p->last < 100000000ull)) return;
    p->last = now;
    p->drawn = true;
    double s = (double)(now - p->t0) / 1e9, rate = s > 0 ? (double)done / s : 0;
    char a[32], b[32], bar[BAR + 1] = "";
    if (p->total) {
        unsigned fill = (unsigned)(done >= p->total ? BAR : BAR * done / p->total);
        for (unsigned i = 0; i < BAR; i++)
            bar[i] = i < fill ? '#' : '.';
        bar[BAR] = '\0';
    }
    fprintf(stderr, "\r\033[K%s", p->what);
    if (p->total) {
        double eta = rate > 0 && done < p->total ? (double)(p->total - done) / rate : 0;
        fprintf(stderr, " [%s] %3u%% %s of %s, %.0f MB/s, ETA %um%02us", bar,
                (unsigned)(done >= p->total ? 100 : 100 * done / p->total),
                format_size(done, a, sizeof(a)), format_size(p->total, b, sizeof(b)), rate / 1e6,
                (unsigned)eta / 60, (unsigned)eta % 60);
    } else {
        fprintf(stderr, " %s, %.0f MB/s", format_size(done, a, sizeof(a)), rate / 1e6);
    }
    fflush(stderr);
}

void progress_end(struct progress *p)
{
    if (p->on && p->drawn) {
        fputs("\r\033[K", stderr);
        fflush(stderr);
    }
    p->drawn = false;
}

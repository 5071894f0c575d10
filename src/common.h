/*
 * common.h - small helpers shared by every internal module: alignment, sizes, logging,
 * the monotonic clock. Not a place for policy; nothing here allocates or locks.
 */
#ifndef ZINF_COMMON_H
#define ZINF_COMMON_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "zinf_build.h"
#include "zinf.h"

#define ZINF_ALIGN 4096u /* O_DIRECT alignment of buffers, offsets and lengths */
#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))

static inline bool is_aligned(uint64_t v, uint64_t a)
{
    return (v & (a - 1)) == 0;
}
static inline uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) & ~(a - 1);
}
static inline uint64_t align_down(uint64_t v, uint64_t a)
{
    return v & ~(a - 1);
}
static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* A one-shot completion: a thread waits for a result that a callback on another thread
 * posts. Used by the synchronous wrappers around asynchronous requests. */
struct completion {
    pthread_mutex_t lock;
    pthread_cond_t cv;
    bool done;
    int res;
};
#define COMPLETION_INIT {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, 0}

static inline void completion_post(struct completion *c, int res)
{
    pthread_mutex_lock(&c->lock);
    c->res = res;
    c->done = true;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->lock);
}

static inline int completion_wait(struct completion *c)
{
    pthread_mutex_lock(&c->lock);
    while (!c->done)
        pthread_cond_wait(&c->cv, &c->lock);
    pthread_mutex_unlock(&c->lock);
    return c->res;
}

/* libnuma fills its cache of each node's CPU mask on first use without a lock, so two
 * threads asking at once (engines opening, IO threads starting) can leak or corrupt it:
 * every call that maps nodes to CPUs (numa_node_of_cpu, numa_run_on_node, ...) is made
 * holding this lock. */
extern pthread_mutex_t numa_call_lock;

/* Logging. Messages go to the sink (stderr by default) prefixed with "zinf: ". */
enum log_level { LOG_ERROR, LOG_WARN, LOG_NOTICE, LOG_DEBUG };
typedef void (*log_sink_fn)(enum log_level level, const char *msg, void *data);

void log_msg(enum log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define log_error(...) log_msg(LOG_ERROR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_WARN, __VA_ARGS__)
#define log_notice(...) log_msg(LOG_NOTICE, __VA_ARGS__)
#define log_debug(...) log_msg(LOG_DEBUG, __VA_ARGS__)
/* Replace the sink (NULL restores stderr); returns the previous one. Tests capture with it. */
log_sink_fn log_set_sink(log_sink_fn fn, void *data, void **old_data);
void log_set_level(enum log_level max_level);
/* s as a JSON string, escaped as JSON requires; NULL as null. */
void json_print_string(FILE *f, const char *s);

/* Parse "4G", "512M", "64k", "1048576", "1e8" into bytes (binary units). -EINVAL on junk,
 * -ERANGE on overflow. */
int parse_size(const char *s, uint64_t *out);
/* Format bytes as "1.5 GiB" into buf. */
const char *format_size(uint64_t bytes, char *buf, size_t len);

/* The edit distance of a and b (Damerau-Levenshtein, each letter edited once: insertions,
 * deletions, substitutions and swaps of two neighbours cost 1), capped: cap or more reads as
 * cap, and so do strings over 64 bytes. */
unsigned edit_distance(const char *a, const char *b, unsigned cap);
/* The one of names[0..n) that word most likely misspells, for a "did you mean" hint; NULL
 * when none is near: the nearest within a distance of 2 that is also under half word's
 * length (the first listed on a tie), else the only name that word (two letters or more)
 * begins. */
const char *nearest_name(const char *word, const char *const *names, size_t n);

#endif

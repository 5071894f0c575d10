/*
 * trace.h - a timeline of what the engine and the trainer do, in the Chrome trace-event
 * format that Perfetto (ui.perfetto.dev) and chrome://tracing open.
 *
 * Off by default. trace_start(FILE) turns it on for the whole process (zinf train
 * --trace FILE; ZINF_TRACE=FILE at the first engine a program opens); trace_stop() writes
 * what is left and closes the file. When off, an instrumented point costs one relaxed load
 * and a branch (trace_on()).
 *
 * When on, an event is a fixed-size record pushed into a ring of the calling thread's own
 * (single producer, no lock); one writer thread drains every ring about every 20 ms and
 * formats the JSON. A full ring drops the event and counts it (the count is written at the
 * end): the hot path never waits for the file. A thread's ring is made, and registered
 * under a lock, on its first event only.
 *
 * The file is a JSON array of events (the format's "JSON Array Format"), closed by
 * trace_stop(); a process that dies leaves it without its closing bracket, which both
 * viewers accept. Times are microseconds since trace_start().
 *
 * Events:
 *   - spans on the calling thread (ph X): they nest, as the thread's calls do;
 *   - async spans (ph b/e), which may overlap each other: transfers in flight;
 *   - counters (ph C): one series per name;
 *   - instants (ph i): evictions.
 * Names and categories are static strings; a tensor's name is copied (cut at
 * TRACE_TENSOR_CHARS - 1 bytes).
 *
 * Not here: what is traced where (engine, trainer), the JSONL step log (zinf train --log).
 */
#ifndef ZINF_TRACE_H
#define ZINF_TRACE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define TRACE_TENSOR_CHARS 48

extern atomic_bool trace_on_;

static inline bool trace_on(void)
{
    return __builtin_expect(atomic_load_explicit(&trace_on_, memory_order_relaxed), 0);
}

/* Start writing to path (created or truncated): 0, -EALREADY when a trace is being written,
 * or -errno when the file cannot be opened (logged, naming it). */
int trace_start(const char *path);
/* Write what the rings hold, close the array and the file: 0, or the first write error
 * (-errno, logged). No-op (0) when off. */
int trace_stop(void);
/* ZINF_TRACE=FILE in the environment: start writing there (FILE.rank-R for rank R > 0 of a
 * job, from RANK), once per process, and stop at exit. Called by every engine open; later
 * calls do nothing. */
void trace_from_env(void);
/* Names the calling thread's track ("io completion", "comm"); the first name sticks. Costs
 * nothing when off (the name waits for the thread's first event). */
void trace_thread_name(const char *name);
/* Events dropped for a full ring since trace_start(). */
uint64_t trace_dropped(void);

/* A span of this thread from t0 (now_ns() at its start) to now. tensor and detail may be
 * NULL; bytes < 0: none. */
void trace_span(const char *cat, const char *name, uint64_t t0, const char *tensor,
                const char *detail, int64_t bytes);
/* The same with a number in the name's place for the viewer's label ("block 3"): name is
 * printed as "%s %d". */
void trace_span_n(const char *cat, const char *name, int n, uint64_t t0);
/* An async span [t0, now) with its own id (it may overlap others of its name). */
void trace_async(const char *cat, const char *name, uint64_t id, uint64_t t0, const char *tensor,
                 const char *detail, int64_t bytes);
/* Counter name's value now; who >= 0 makes it one series per engine ("NAME (engine WHO)"). */
void trace_counter(const char *name, int who, int64_t value);
/* An instant on this thread. */
void trace_instant(const char *cat, const char *name, const char *tensor, const char *detail,
                   int64_t bytes);

#endif

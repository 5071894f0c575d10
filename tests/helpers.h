/* helpers.h - what several test programs need: scratch directories, random bytes,
 * capturing log messages. */
#ifndef ZINF_TESTS_HELPERS_H
#define ZINF_TESTS_HELPERS_H
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "zinf.h"

/* A fresh, empty directory for this test (under $ZINF_TEST_TMPDIR or /tmp). Free with
 * test_rmtree(), which removes it and everything below it. */
char *test_tmpdir(const char *tag);
void test_rmtree(char *path);
/* Writes dir/data.txt, text with structure for the trainer tests to learn, and its path
 * into path (len bytes). */
void test_write_training_text(const char *dir, char *path, size_t len);
/* A fresh directory on tmpfs (/dev/shm), or NULL when there is none. */
char *test_shmdir(const char *tag);

struct cuda_probe_info;
/* cuda_probe() in a child process: a process that has called CUDA cannot use it in the
 * children it forks (ranks, a daemon). Returns the number of usable devices. */
int test_cuda_probe_forked(struct cuda_probe_info *pi);

/* Whether the long sweeps run whole (ZINF_TEST_SOAK=1: meson's -Dsoak=true, which
 * scripts/test-soak.sh sets up). Without it a sweep runs a fixed part of its points that
 * still reaches each of its kinds (every kill point, every stage, every shape). */
bool test_soak(void);

/* Whether the build runs under the sanitizers (ZINF_TEST_SANITIZED, which tests/meson.build
 * sets there), and the long sweeps are not run whole (test_soak()): then a sweep may run a
 * smaller fixed part of its points, each kind still reached, the normal build running the
 * rest. The sanitizers find a misuse of memory on a path once; they need not see every
 * budget or shape that takes it. */
bool test_sanitized(void);

/* 4 KiB aligned allocation; free with free(). */
void *test_aligned_alloc(size_t bytes);
/* Deterministic pseudo-random bytes from a seed. */
void test_fill_random(void *buf, size_t bytes, uint64_t seed);
uint64_t test_rand(uint64_t *state);

/* Under LeakSanitizer, fail the current test if memory leaked so far (Criterion's
 * workers leave without the exit-time leak check failing the test). No-op otherwise. */
void test_leak_check(void);
/* Run `$ZINF_BIN ARGS` (ARGS from fmt) through the shell, stdout and stderr captured into
 * *out (malloc'd, NUL-terminated); returns its exit status, 128 when it did not exit. */
int test_run_zinf(char **out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Engine helpers that assert as they go: register a tensor, a buffer of random bytes
 * (free with free()), and a check that zinf_read returns exactly want. */
zinf_tensor test_register(zinf_engine *e, const char *name, size_t n, enum zinf_tier home);
unsigned char *test_rand_buf(size_t n, uint64_t seed);
void test_expect_content(zinf_engine *e, zinf_tensor t, const unsigned char *want, size_t n,
                         const char *what);

/* A trace file (trace.h) read back with a JSON parser. test_trace_load fails the test
 * when the file is not a JSON array of well-formed events, when spans of one thread do not
 * nest, or when an async begin has no end (or an end no begin). */
struct test_trace {
    void *root; /* json_t *: the array */
    size_t events, spans, asyncs, counters, instants;
    uint64_t dropped; /* the writer's count, from its last metadata event */
};
void test_trace_load(const char *path, struct test_trace *tr);
void test_trace_free(struct test_trace *tr);
/* Spans (X), async spans (b) and instants (i) named name, with args.detail detail when
 * detail is not NULL (either one a prefix when it ends in '*'). */
size_t test_trace_count(const struct test_trace *tr, const char *ph, const char *name,
                        const char *detail);
/* The latest value of counter name; -1 when it never appears. */
long long test_trace_counter(const struct test_trace *tr, const char *name);

/* Collect log messages in memory; test_log_text() returns all of them joined by '\n'. */
void test_log_capture_start(void);
const char *test_log_text(void);
void test_log_capture_stop(void);

/* One line, formatted, written to fd at once (up to 510 bytes, cut there): how a child
 * that runs as another user reports to the test through a pipe; nothing if it cannot. */
void test_report_line(int fd, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));
#endif

/*
 * bench_util.h - small helpers shared by the benchmark programs (swapin, hitpath,
 * eviction): the monotonic clock, size arguments, the per-page pattern their tensors are
 * filled with and checked against, and the command-line options they have in common. The
 * programs link the shared library and use only zinf.h, so nothing here comes from the
 * library's internals.
 */
#ifndef ZINF_BENCH_BENCH_UTIL_H
#define ZINF_BENCH_BENCH_UTIL_H

#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "zinf.h"

#define PAGE_BYTES 4096u /* unit of the pattern: one key per page */

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* "64M", "1G", "4096", "1.5G", "1e6": binary units for K/M/G/T, an optional trailing B. */
static inline int parse_size(const char *s, uint64_t *out)
{
    static const char units[] = "kmgt";
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || !isfinite(v) || v < 0) return -EINVAL;
    const char *u = *end ? strchr(units, tolower((unsigned char)*end)) : NULL;
    double mul = u ? ldexp(1.0, 10 * (int)(u - units + 1)) : 1;
    end += u != NULL;
    if (u && *end == 'i') end++;
    if (*end == 'B' || *end == 'b') end++;
    if (*end || v * mul >= 1.8e19) return -EINVAL;
    *out = (uint64_t)(v * mul);
    return 0;
}

/* Word j of page p of bench tensor tid: a hash of (tid, p), plus j. Every page of every
 * tensor differs, so a copy of the wrong tensor or the wrong page is caught. */
static inline uint64_t page_key(uint64_t tid, uint64_t page)
{
    uint64_t z = (tid << 40 ^ page) * 0x9e3779b97f4a7c15ull ^ 0x7a696e66ull;
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
    return z ^ (z >> 29);
}

/* Fill buf with the pattern of tensor bytes [off, off + len) of tensor tid. */
static inline void pattern_fill(void *buf, size_t len, uint64_t tid, uint64_t off)
{
    uint64_t *w = buf;
    for (size_t p = 0; p < len; p += PAGE_BYTES, w += PAGE_BYTES / 8) {
        uint64_t k = page_key(tid, (off + p) / PAGE_BYTES);
        for (unsigned j = 0; j < PAGE_BYTES / 8; j++)
            w[j] = k + j;
    }
}

/* Pages of buf (tensor bytes [off, off + len)) that do not hold the pattern. */
static inline uint64_t pattern_bad_pages(const void *buf, size_t len, uint64_t tid, uint64_t off)
{
    const uint64_t *w = buf;
    uint64_t bad = 0;
    for (size_t p = 0; p < len; p += PAGE_BYTES, w += PAGE_BYTES / 8) {
        uint64_t k = page_key(tid, (off + p) / PAGE_BYTES), diff = 0;
        for (unsigned j = 0; j < PAGE_BYTES / 8; j++)
            diff |= w[j] ^ (k + j);
        bad += diff != 0;
    }
    return bad;
}

/* ---- command-line options ------------------------------------------------------------ */

/* getopt_long() codes of the options that two or more programs take. A program lists in
 * its longopts those it takes, in the order of its usage text, and numbers its own options
 * from BENCH_O_OWN on. */
enum {
    BENCH_O_PATH = 256,
    BENCH_O_KIND,
    BENCH_O_DEV,
    BENCH_O_HOST,
    BENCH_O_NT,
    BENCH_O_TS,
    BENCH_O_BS,
    BENCH_O_QD,
    BENCH_O_JSON,
    BENCH_O_OWN
};

/* The values of those options. A field whose option a program does not take keeps the
 * program's default (hitpath has no --tensors, --block-size or --queue-depth). */
struct bench_opts {
    const char *path;
    enum zinf_device_kind kind;
    uint64_t device_bytes, host_bytes, tensor_bytes, block_size;
    unsigned tensors, queue_depth;
    bool json;
};

/* "emulated", "auto" or "cuda". */
static inline int parse_device_kind(const char *s, enum zinf_device_kind *out)
{
    if (!strcmp(s, "emulated"))
        *out = ZINF_DEVICE_EMULATED;
    else if (!strcmp(s, "auto"))
        *out = ZINF_DEVICE_AUTO;
    else if (!strcmp(s, "cuda"))
        *out = ZINF_DEVICE_CUDA;
    else
        return -EINVAL;
    return 0;
}

/* Take option ch (a getopt_long() code) with its argument arg into c, if it is one of the
 * options above: returns whether it was, and sets *bad when arg is no value for it. Sizes
 * must be nonzero, those of tensors and IO requests whole pages. */
static inline bool bench_common_opt(struct bench_opts *c, int ch, const char *arg, bool *bad)
{
    uint64_t v;
    switch (ch) {
    case BENCH_O_PATH:
        c->path = arg;
        return true;
    case BENCH_O_KIND:
        *bad = parse_device_kind(arg, &c->kind) < 0;
        return true;
    case BENCH_O_JSON:
        c->json = true;
        return true;
    case BENCH_O_DEV:
    case BENCH_O_HOST:
    case BENCH_O_NT:
    case BENCH_O_TS:
    case BENCH_O_BS:
    case BENCH_O_QD:
        break;
    default:
        return false;
    }
    if (parse_size(arg, &v) < 0 || v == 0) {
        *bad = true;
        return true;
    }
    switch (ch) {
    case BENCH_O_DEV:
        c->device_bytes = v;
        break;
    case BENCH_O_HOST:
        c->host_bytes = v;
        break;
    case BENCH_O_NT:
        *bad = v > 1000000;
        c->tensors = (unsigned)v;
        break;
    case BENCH_O_TS:
        *bad = v % PAGE_BYTES != 0;
        c->tensor_bytes = v;
        break;
    case BENCH_O_BS:
        *bad = v % PAGE_BYTES != 0;
        c->block_size = v;
        break;
    case BENCH_O_QD:
        *bad = v > 4096;
        c->queue_depth = (unsigned)v;
        break;
    }
    return true;
}

/* Say on stderr that arg is no value for option ch of program prog. Returns -1, for
 * parse_args() to return. */
static inline int bench_bad_value(const char *prog, const struct option *longopts, int ch,
                                  const char *arg)
{
    while (longopts->name && longopts->val != ch)
        longopts++;
    fprintf(stderr, "%s: bad value '%s' for --%s\n", prog, arg,
            longopts->name ? longopts->name : "?");
    return -1;
}

/* The programs take no operands: after getopt_long(), say on stderr which one came and
 * return -1, or return 0 when none did. */
static inline int bench_no_operands(const char *prog, int argc, char **argv)
{
    if (optind < argc) {
        fprintf(stderr, "%s: unexpected argument '%s'\n", prog, argv[optind]);
        return -1;
    }
    return 0;
}

#endif

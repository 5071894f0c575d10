/*
 * bench_util.h - small helpers shared by the benchmark programs (swapin, hitpath,
 * eviction): the monotonic clock, size arguments, and the per-page pattern their tensors
 * are filled with and checked against. The programs link the shared library and use only
 * zinf.h, so nothing here comes from the library's internals.
 */
#ifndef ZINF_BENCH_BENCH_UTIL_H
#define ZINF_BENCH_BENCH_UTIL_H

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

#endif

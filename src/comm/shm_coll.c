/*
 * shm_coll.c - the shm backend's collectives (shm_run, shm_pool of shm.h), through the
 * segment the ranks met in (shm.c).
 *
 * An operation moves its data in chunks through the segment's two sets of staging areas;
 * chunk k uses set k % 2 (k counts every chunk of the communicator's life). Each chunk is:
 * every rank copies its part into its own area, barrier, every rank reads (and reduces) what
 * it needs. A set is written again two chunks later, after a barrier that every rank
 * reaches only once it has read the set's previous contents, so one chunk needs one barrier
 * (allreduce needs two: the reduced result goes through the set's result area). Where every
 * rank's buffers are in its pool, the collective reads them there and copies once
 * (run_pooled).
 *
 * alltoall is reduce_scatter's movement without the sums: each chunk carries chunk / world
 * bytes of every destination's block, and each rank copies its part of every area out. Its
 * ranks say what they run before its first barrier and check one another after it, so a
 * rank in another operation, or with another size, fails the communicator at once (-EPROTO)
 * rather than moving the wrong bytes.
 *
 * Reductions add in rank order, out = ((s0 + s1) + s2) + ..., for every element whichever
 * rank computes it: results are bitwise the same on every rank, from run to run, and equal
 * to one process accumulating the same contributions in that order. With comm_req.acc the
 * chain starts from recv's contents, out = ((recv + s0) + s1) + ..., as that process would
 * go on from a partial sum it holds.
 *
 * A 16-bit wire (comm_req.wire) goes through the staging areas only, never the pools (which
 * would read the fp32 contributions in place): each rank writes its contribution rounded to
 * 16 bits, half the bytes, and the readers widen each to fp32 and add in the same rank
 * order. An allreduce's result area holds each part's sum rounded to 16 bits, which every
 * rank widens into recv.
 *
 * Not here: the segment, the rendezvous, the barrier and how a communicator fails (shm.c).
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_F16C_PATH 1
#elif defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "comm/shm.h"
#include "comm/shm_int.h"
#include "common.h"
#include "half.h"

/* Rank r's area in set k % 2; r == world: the set's result area. */
static char *area(struct shm *s, uint64_t k, int r)
{
    return s->data + ((k % 2) * ((size_t)s->world + 1) + (size_t)r) * s->chunk;
}


/* Four floats in a vector register (SSE on any x86-64, NEON on arm64); loads and stores
 * through memcpy, so any alignment does. Each lane adds on its own: a vector sum is
 * bitwise the scalar one. */
typedef float v4f __attribute__((vector_size(16)));

static inline v4f load4(const float *p)
{
    v4f v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void store4(float *p, v4f v)
{
    memcpy(p, &v, sizeof(v));
}

/* The reductions read their sources this far ahead (floats, 4 KiB): one core's loads of two
 * or more streams miss DRAM for want of requests in flight, which the hardware prefetcher
 * alone does not keep up (reduce_scatter in place at 2 ranks went from 0.51 to 0.59-0.64 of
 * a memcpy's busbw, bench/comm). */
#define SUM_PREFETCH 1024

/* The copies read this far ahead in each of their four streams (bytes): one stream's gathers
 * went from 8.5 to 9.3-10.3 GB/s of busbw at 256 MiB from 4 to 16 KiB ahead (bench/comm). */
#define COPY_PREFETCH 16384

/* Outputs at least this large are written around the caches where they are not one of the
 * sources (an output the reduction has just read is in the cache already): a result larger
 * than a core's L2 is evicted before anyone reads it, and a store that misses first reads
 * the line it overwrites. */
#define SUM_STREAM_BYTES ((size_t)8 << 20)

/* out[o][i] = src[0][i] + src[1][i] + ... in rank order for each of nout outputs, the one
 * sum of every path; with init, (init[i] + src[0][i]) + src[1][i] + ... 16 floats at a time,
 * every source read before any out is written: an out may be one of the sources or init (an
 * in-place reduction in the pools, one that adds onto recv). stream: write with non-temporal
 * stores where the CPU has them and every out is 16-byte aligned. */
static void sum_rank_order(const float *init, const float *const *src, int world,
                           float *const *out, int nout, size_t n, bool stream)
{
#if defined(__SSE__)
    for (int o = 0; o < nout; o++)
        stream &= ((uintptr_t)out[o] & 15) == 0;
#else
    stream = false;
#endif
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        if (i + SUM_PREFETCH < n)
            for (int r = 0; r < world; r++)
                __builtin_prefetch(src[r] + i + SUM_PREFETCH);
        v4f a = load4(src[0] + i), b = load4(src[0] + i + 4), c = load4(src[0] + i + 8),
            d = load4(src[0] + i + 12);
        if (init) { /* init + s0 is s0 + init: IEEE addition commutes */
            a += load4(init + i);
            b += load4(init + i + 4);
            c += load4(init + i + 8);
            d += load4(init + i + 12);
        }
        for (int r = 1; r < world; r++) {
            a += load4(src[r] + i);
            b += load4(src[r] + i + 4);
            c += load4(src[r] + i + 8);
            d += load4(src[r] + i + 12);
        }
        for (int o = 0; o < nout; o++) {
            float *p = out[o] + i;
#if defined(__SSE__)
            if (stream) {
                _mm_stream_ps(p, (__m128)a);
                _mm_stream_ps(p + 4, (__m128)b);
                _mm_stream_ps(p + 8, (__m128)c);
                _mm_stream_ps(p + 12, (__m128)d);
                continue;
            }
#endif
            store4(p, a);
            store4(p + 4, b);
            store4(p + 8, c);
            store4(p + 12, d);
        }
    }
#if defined(__SSE__)
    if (stream) _mm_sfence(); /* ordered before the barrier that tells the peers */
#endif
    for (; i < n; i++) {
        float a = init ? init[i] + src[0][i] : src[0][i];
        for (int r = 1; r < world; r++)
            a += src[r][i];
        for (int o = 0; o < nout; o++)
            out[o][i] = a;
    }
}

/* 64 bytes from src to dst, around the caches where stream (dst 16-byte aligned). */
static inline void copy64(char *dst, const char *src, bool stream)
{
    v4f v[4];
    memcpy(v, src, 64);
#if defined(__SSE__)
    if (stream) {
        for (int j = 0; j < 4; j++)
            _mm_stream_ps((float *)(void *)(dst + 16 * j), (__m128)v[j]);
        return;
    }
#else
    (void)stream;
#endif
    memcpy(dst, v, 64);
}

/* memcpy for the pooled collectives' large copies: four quarters of the buffer at once, 64
 * bytes of each in turn, each read COPY_PREFETCH bytes ahead (more reads in flight than one
 * stream keeps), and from SUM_STREAM_BYTES on written around the caches once dst is 16-byte
 * aligned. dst and src do not overlap. */
static void copy_ahead(char *dst, const char *src, size_t n)
{
    size_t i = 0;
#if defined(__SSE__)
    bool stream = n >= SUM_STREAM_BYTES;
    if (stream) {
        i = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, i);
    }
#else
    bool stream = false;
#endif
    size_t quarter = (n - i) / 4 / 64 * 64;
    for (size_t j = 0; j < quarter; j += 64)
        for (int q = 0; q < 4; q++) {
            size_t at = i + (size_t)q * quarter + j;
            if (j + COPY_PREFETCH < quarter) __builtin_prefetch(src + at + COPY_PREFETCH);
            copy64(dst + at, src + at, stream);
        }
    i += 4 * quarter;
    for (; i + 64 <= n; i += 64)
        copy64(dst + i, src + i, stream);
#if defined(__SSE__)
    if (stream) _mm_sfence();
#endif
    memcpy(dst + i, src + i, n - i);
}

/* The sum of element at + i of the areas of set k (after init's, where given). */
static void reduce_f32(struct shm *s, uint64_t k, size_t at, const float *init, float *out,
                       size_t n)
{
    const float *src[COMM_MAX_RANKS];
    for (int r = 0; r < s->world; r++)
        src[r] = (const float *)area(s, k, r) + at;
    sum_rank_order(init, src, s->world, &out, 1, n, false);
}

#if defined(HAVE_F16C_PATH)
/* fp16 eight at a time with F16C: vcvtps2ph rounds to nearest even, overflows to infinity,
 * keeps subnormals and quiets a NaN keeping its payload's top bits, as half_from_f32; and
 * vcvtph2ps is exact, as half_to_f32 (for the quiet NaNs that travel): the same bits. */
__attribute__((target("avx,f16c"))) static void to_f16_f16c(uint16_t *dst, const float *src,
                                                             size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(void *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        dst[i] = half_from_f32(src[i]);
}

/* reduce_wire's fp16 sums, eight lanes at a time, each lane in rank order. */
__attribute__((target("avx,f16c"))) static void sum_f16_f16c(const uint16_t *const *src,
                                                             int world, const float *init,
                                                             float *out, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(src[0] + i)));
        if (init) a = _mm256_add_ps(_mm256_loadu_ps(init + i), a);
        for (int r = 1; r < world; r++)
            a = _mm256_add_ps(
                a, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(src[r] + i))));
        _mm256_storeu_ps(out + i, a);
    }
    for (; i < n; i++) {
        float a = init ? init[i] + half_to_f32(src[0][i]) : half_to_f32(src[0][i]);
        for (int r = 1; r < world; r++)
            a += half_to_f32(src[r][i]);
        out[i] = a;
    }
}

static bool f16c(void)
{
    static int has = -1; /* racy but idempotent */
    if (has < 0) has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    return has;
}
#endif

/* The wire's 16 bits of n floats, and back. */
static void to_wire(enum comm_wire w, uint16_t *dst, const float *src, size_t n)
{
#if defined(HAVE_F16C_PATH)
    if (w == COMM_WIRE_F16 && f16c()) {
        to_f16_f16c(dst, src, n);
        return;
    }
#endif
    if (w == COMM_WIRE_F16)
        for (size_t i = 0; i < n; i++)
            dst[i] = half_from_f32(src[i]);
    else
        for (size_t i = 0; i < n; i++)
            dst[i] = bf16_from_f32(src[i]);
}

static float from_wire(enum comm_wire w, uint16_t h)
{
    return w == COMM_WIRE_F16 ? half_to_f32(h) : bf16_to_f32(h);
}

/* out[i] = ((init[i] + h0[i]) + h1[i]) + ... (without init: h0[i] + h1[i] + ...), the
 * 16-bit contributions at element at + i of set k's areas widened to fp32, in rank order. */
static void reduce_wire(struct shm *s, enum comm_wire w, uint64_t k, size_t at,
                        const float *init, float *out, size_t n)
{
    const uint16_t *src[COMM_MAX_RANKS];
    for (int r = 0; r < s->world; r++)
        src[r] = (const uint16_t *)(const void *)area(s, k, r) + at;
#if defined(HAVE_F16C_PATH)
    if (w == COMM_WIRE_F16 && f16c()) {
        sum_f16_f16c(src, s->world, init, out, n);
        return;
    }
#endif
    for (size_t i = 0; i < n; i++) {
        float a = init ? init[i] + from_wire(w, src[0][i]) : from_wire(w, src[0][i]);
        for (int r = 1; r < s->world; r++)
            a += from_wire(w, src[r][i]);
        out[i] = a;
    }
}

/* reduce_scatter over a 16-bit wire: each chunk carries chunk / world bytes of 16-bit
 * elements for every destination; the result is the fp32 sum. */
static int reduce_scatter_wire(struct shm *s, enum comm_wire w, const float *send, float *recv,
                               size_t count, bool acc)
{
    size_t per = s->chunk / (size_t)s->world / sizeof(uint16_t);
    for (size_t j = 0; j < count; j += per) {
        size_t m = MIN(per, count - j);
        uint64_t k = s->chunks++;
        uint16_t *mine = (uint16_t *)(void *)area(s, k, s->rank);
        for (int d = 0; d < s->world; d++)
            to_wire(w, mine + (size_t)d * per, send + (size_t)d * count + j, m);
        int r = shm_barrier(s);
        if (r) return r;
        reduce_wire(s, w, k, (size_t)s->rank * per, acc ? recv + j : NULL, recv + j, m);
    }
    return 0;
}

/* allreduce over a 16-bit wire: as allreduce, each rank's part of the sum rounded to 16 bits
 * in the result area, which every rank widens into recv. */
static int allreduce_wire(struct shm *s, enum comm_wire w, const float *send, float *recv,
                          size_t count, bool acc, float *tmp, size_t tmp_n)
{
    size_t per = MIN(s->chunk / sizeof(uint16_t), tmp_n * (size_t)s->world);
    for (size_t j = 0; j < count; j += per) {
        size_t m = MIN(per, count - j);
        uint64_t k = s->chunks++;
        to_wire(w, (uint16_t *)(void *)area(s, k, s->rank), send + j, m);
        int r = shm_barrier(s);
        if (r) return r;
        size_t lo = m * (size_t)s->rank / (size_t)s->world,
               hi = m * ((size_t)s->rank + 1) / (size_t)s->world;
        reduce_wire(s, w, k, lo, acc ? recv + j + lo : NULL, tmp, hi - lo);
        to_wire(w, (uint16_t *)(void *)area(s, k, s->world) + lo, tmp, hi - lo);
        if ((r = shm_barrier(s))) return r;
        const uint16_t *res = (const uint16_t *)(const void *)area(s, k, s->world);
#if defined(HAVE_F16C_PATH)
        if (w == COMM_WIRE_F16 && f16c()) { /* a sum of one source: its widening */
            sum_f16_f16c(&res, 1, NULL, recv + j, m);
            continue;
        }
#endif
        for (size_t i = 0; i < m; i++)
            recv[j + i] = from_wire(w, res[i]);
    }
    return 0;
}

static int allgather(struct shm *s, const char *send, char *recv, size_t bytes)
{
    for (size_t off = 0; off < bytes; off += s->chunk) {
        size_t n = MIN(s->chunk, bytes - off);
        uint64_t k = s->chunks++;
        memcpy(area(s, k, s->rank), send + off, n);
        int r = shm_barrier(s);
        if (r) return r;
        for (int q = 0; q < s->world; q++) {
            char *dst = recv + (size_t)q * bytes + off;
            if (q == s->rank && dst == send + off) continue; /* in place: it is there */
            memcpy(dst, area(s, k, q), n);
        }
    }
    return 0;
}

static int broadcast(struct shm *s, char *buf, size_t bytes, int root)
{
    for (size_t off = 0; off < bytes; off += s->chunk) {
        size_t n = MIN(s->chunk, bytes - off);
        uint64_t k = s->chunks++;
        if (s->rank == root) memcpy(area(s, k, root), buf + off, n);
        int r = shm_barrier(s);
        if (r) return r;
        if (s->rank != root) memcpy(buf + off, area(s, k, root), n);
    }
    return 0;
}

/* send holds world x count floats; recv gets the sum of every rank's rank-th count (acc:
 * added onto recv's). Each chunk carries chunk / world bytes for every destination. recv may
 * be send + rank x count (in place): the part of send a chunk overwrites was copied out in
 * that chunk. */
static int reduce_scatter(struct shm *s, const float *send, float *recv, size_t count, bool acc)
{
    size_t per = s->chunk / (size_t)s->world / sizeof(float);
    for (size_t j = 0; j < count; j += per) {
        size_t m = MIN(per, count - j);
        uint64_t k = s->chunks++;
        float *mine = (float *)area(s, k, s->rank);
        for (int d = 0; d < s->world; d++)
            memcpy(mine + (size_t)d * per, send + (size_t)d * count + j, m * sizeof(float));
        int r = shm_barrier(s);
        if (r) return r;
        reduce_f32(s, k, (size_t)s->rank * per, acc ? recv + j : NULL, recv + j, m);
    }
    return 0;
}

/* Each chunk: contributions in, every rank reduces 1/world of it into the set's result
 * area (acc: onto its own recv's, which every rank holds the same), barrier, every rank
 * copies the result out. */
static int allreduce(struct shm *s, const float *send, float *recv, size_t count, bool acc)
{
    size_t per = s->chunk / sizeof(float);
    for (size_t j = 0; j < count; j += per) {
        size_t m = MIN(per, count - j);
        uint64_t k = s->chunks++;
        memcpy(area(s, k, s->rank), send + j, m * sizeof(float));
        int r = shm_barrier(s);
        if (r) return r;
        size_t lo = m * (size_t)s->rank / (size_t)s->world,
               hi = m * ((size_t)s->rank + 1) / (size_t)s->world;
        reduce_f32(s, k, lo, acc ? recv + j + lo : NULL, (float *)area(s, k, s->world) + lo,
                   hi - lo);
        if ((r = shm_barrier(s))) return r;
        memcpy(recv + j, area(s, k, s->world), m * sizeof(float));
    }
    return 0;
}

/* Before the operation's first barrier: what this rank runs. */
static void say_op(struct shm *s, enum comm_op op, uint64_t bytes)
{
    struct shm_rank *me = &s->h->ranks[s->rank];
    me->says_op[(s->bars + 1) % 2] = (uint32_t)op;
    me->says_bytes[(s->bars + 1) % 2] = bytes;
}

/* After it: every rank runs the same (else the communicator fails, naming the first that
 * does not). */
static int same_op(struct shm *s)
{
    int i = (int)(s->bars % 2);
    const struct shm_rank *me = &s->h->ranks[s->rank];
    for (int p = 0; p < s->world; p++) {
        const struct shm_rank *q = &s->h->ranks[p];
        if (q->says_op[i] == me->says_op[i] && q->says_bytes[i] == me->says_bytes[i]) continue;
        char why[WHY_BYTES];
        snprintf(why, sizeof(why), "rank %d runs %s of %llu bytes where rank %d runs %s of %llu",
                 s->first + p, comm_op_name(q->says_op[i]), (unsigned long long)q->says_bytes[i],
                 s->first + s->rank, comm_op_name(me->says_op[i]),
                 (unsigned long long)me->says_bytes[i]);
        shm_fail(s, why);
        log_error("comm %s: rank %d: %s", s->job, s->first + s->rank, why);
        return -EPROTO;
    }
    return 0;
}

/* send and recv hold world blocks of bytes each; recv's block q is rank q's block `rank`.
 * check: the ranks check one another after the first chunk's barrier (no barrier came
 * since they said what they run). */
static int alltoall(struct shm *s, const char *send, char *recv, size_t bytes, bool check)
{
    size_t per = s->chunk / (size_t)s->world;
    for (size_t j = 0; j < bytes; j += per) {
        size_t m = MIN(per, bytes - j);
        uint64_t k = s->chunks++;
        char *mine = area(s, k, s->rank);
        for (int d = 0; d < s->world; d++)
            memcpy(mine + (size_t)d * per, send + (size_t)d * bytes + j, m);
        int r = shm_barrier(s);
        if (!r && j == 0 && check) r = same_op(s);
        if (r) return r;
        for (int q = 0; q < s->world; q++)
            memcpy(recv + (size_t)q * bytes + j, area(s, k, q) + (size_t)s->rank * per, m);
    }
    return 0;
}

void shm_pool(struct shm *s, char **base, size_t *bytes)
{
    *base = s->pools ? s->pools + (size_t)s->rank * s->pool : NULL;
    *bytes = s->pools ? s->pool : 0;
}

/* [p, p + n) inside this rank's pool: its offset there, else -1. */
static int64_t pool_off(const struct shm *s, const void *p, size_t n)
{
    if (!s->pools || !p) return -1;
    const char *b = s->pools + (size_t)s->rank * s->pool, *c = p;
    if (c < b || c > b + s->pool || n > (size_t)(b + s->pool - c)) return -1;
    return c - b;
}

static const char *peer(const struct shm *s, int q, uint64_t off)
{
    return s->pools + (size_t)q * s->pool + off;
}

/* The sum of element at + i of every rank's send, read in its pool (after init's, where
 * given), into out[0..nout). */
static void reduce_pooled(struct shm *s, size_t at, const float *init, float *const *out,
                          int nout, size_t n, bool stream)
{
    const float *src[COMM_MAX_RANKS];
    for (int q = 0; q < s->world; q++)
        src[q] = (const float *)peer(s, q, s->h->ranks[q].off_send) + at;
    sum_rank_order(init, src, s->world, out, nout, n, stream);
}

/* The one-copy collectives, once every rank has said its buffers are in its pool (and
 * passed the barrier after saying so). Each ends with a barrier: a rank may write its
 * buffers again only when no peer reads them any more. */
static int run_pooled(struct shm *s, const struct comm_req *q, size_t bytes)
{
    int me = s->rank;
    switch (q->op) {
    case COMM_ALLGATHER:
        for (int p = 0; p < s->world; p++) {
            char *dst = (char *)q->recv + (size_t)p * bytes;
            const char *src = peer(s, p, s->h->ranks[p].off_send);
            if (dst != src) copy_ahead(dst, src, bytes); /* in place: nothing to move */
        }
        break;
    case COMM_BROADCAST:
        if (me != q->root)
            copy_ahead(q->recv, peer(s, q->root, s->h->ranks[q->root].off_recv), bytes);
        break;
    case COMM_REDUCE_SCATTER: {
        float *out = q->recv;
        bool apart = (const char *)q->send + (size_t)me * bytes != (const char *)q->recv;
        reduce_pooled(s, (size_t)me * q->count, q->acc ? out : NULL, &out, 1, q->count,
                      apart && !q->acc && bytes >= SUM_STREAM_BYTES);
        break;
    }
    case COMM_ALLREDUCE: {
        /* Each rank reduces its 1/world and writes the sum into that part of every rank's
         * recv: one pass that reads and writes the buffer's size, as a memcpy does, with no
         * second phase. Only this rank reads or writes part `me` of any rank's buffers, and
         * each block is read from every send before it is written (in place, send == recv;
         * any other overlap is refused by comm_submit). */
        size_t n = q->count, lo = n * (size_t)me / (size_t)s->world,
               hi = n * ((size_t)me + 1) / (size_t)s->world;
        float *out[COMM_MAX_RANKS];
        bool apart = true;
        for (int p = 0; p < s->world; p++) {
            out[p] = (float *)peer(s, p, s->h->ranks[p].off_recv) + lo;
            apart &= s->h->ranks[p].off_recv != s->h->ranks[p].off_send;
        }
        /* acc: onto this rank's recv, which every rank holds the same. */
        reduce_pooled(s, lo, q->acc ? out[me] : NULL, out, s->world, hi - lo,
                      apart && (hi - lo) * sizeof(float) * (size_t)s->world >= SUM_STREAM_BYTES);
        break;
    }
    case COMM_ALLTOALL:
        for (int p = 0; p < s->world; p++)
            copy_ahead((char *)q->recv + (size_t)p * bytes,
                       peer(s, p, s->h->ranks[p].off_send) + (size_t)me * bytes, bytes);
        break;
    default:
        break;
    }
    return shm_barrier(s);
}

int shm_run(struct shm *s, const struct comm_req *q, bool *pooled)
{
    size_t esz = comm_dtype_bytes(q->dtype), bytes = q->count * esz;
    int r = shm_failed(s);
    *pooled = false;
    if (r) return r;
    /* Where the rank has a pool and there is data, the ranks first say whether their
     * buffers are in their pools; if all are, the collective copies once. Otherwise it
     * goes through the staging areas, whose first chunk's barrier comes after every rank
     * has read what the others said. */
    if (q->op == COMM_ALLTOALL && bytes) say_op(s, q->op, bytes);
    if (s->pools && bytes > 0 && q->op != COMM_BARRIER && q->wire == COMM_WIRE_F32) {
        bool a2a = q->op == COMM_ALLTOALL;
        size_t in = q->op == COMM_REDUCE_SCATTER || a2a ? bytes * (size_t)s->world : bytes,
               out = q->op == COMM_ALLGATHER || a2a ? bytes * (size_t)s->world : bytes;
        int64_t so = q->op == COMM_BROADCAST ? 0 : pool_off(s, q->send, in),
                ro = pool_off(s, q->recv, out);
        struct shm_rank *mine = &s->h->ranks[s->rank];
        mine->pooled = so >= 0 && ro >= 0;
        mine->off_send = (uint64_t)(so < 0 ? 0 : so);
        mine->off_recv = (uint64_t)(ro < 0 ? 0 : ro);
        if ((r = shm_barrier(s))) goto out;
        if (a2a && (r = same_op(s))) goto out;
        bool all = true;
        for (int p = 0; p < s->world; p++)
            all &= s->h->ranks[p].pooled != 0;
        if (all) {
            *pooled = true;
            r = run_pooled(s, q, bytes);
            goto out;
        }
    }
    switch (q->op) {
    case COMM_ALLGATHER:
        r = allgather(s, q->send, q->recv, bytes);
        break;
    case COMM_BROADCAST:
        r = broadcast(s, q->recv, bytes, q->root);
        break;
    case COMM_REDUCE_SCATTER:
        r = q->wire ? reduce_scatter_wire(s, q->wire, q->send, q->recv, q->count, q->acc)
                    : reduce_scatter(s, q->send, q->recv, q->count, q->acc);
        break;
    case COMM_ALLREDUCE:
        if (q->wire) {
            /* A part's fp32 sum, before it is rounded into the result area. */
            float part[8192];
            r = allreduce_wire(s, q->wire, q->send, q->recv, q->count, q->acc, part,
                               ARRAY_SIZE(part));
        } else {
            r = allreduce(s, q->send, q->recv, q->count, q->acc);
        }
        break;
    case COMM_BARRIER:
        r = shm_barrier(s);
        break;
    case COMM_ALLTOALL:
        /* Where the pools' barrier came first, the ranks have checked one another. */
        r = alltoall(s, q->send, q->recv, bytes, !s->pools);
        break;
    default: /* point-to-point: p2p.c */
        r = -EINVAL;
        break;
    }
out:
    if (r == -ECONNABORTED)
        log_error("comm %s: rank %d: %s", s->job, s->first + s->rank, shm_fail_reason(s));
    return r;
}

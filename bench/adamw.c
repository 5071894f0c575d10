/*
 * adamw.c - how many elements per second the AdamW step (src/train/adamw.h) updates, next
 * to the bound that this machine's memory bandwidth sets, measured in the same run.
 *
 * The step streams 28 bytes per element (param, grad, m, v read: 16 B; param, m, v written
 * back in place: 12 B), so it cannot beat bandwidth / 28 B. The bandwidth comes from four
 * STREAM-like kernels over arrays of the same size, counted as STREAM counts (bytes the
 * program reads and writes, no write-allocate traffic):
 *   copy     b = a                    8 B/elem
 *   triad    a = b + s c             12 B/elem
 *   inplace  a = a + s b             12 B/elem, written in place as AdamW writes
 *   rw4w3    p,m,v += g              28 B/elem: AdamW's loop (same vectors, chunks and
 *                                    threads) with the arithmetic taken out
 * and the bound is the best of them. copy and triad write to arrays they do not read, which
 * costs the hardware an extra read per written line that STREAM's count does not show;
 * AdamW writes in place and does not pay it, so copy and triad alone would understate the
 * bound. Each row is run for all cores and for one thread; the table says, per thread
 * count, which fraction of the bound AdamW reaches (target >= 0.95).
 *
 * Before a kernel is timed its output is checked: each AdamW kernel against the scalar
 * reference on the same input (max relative difference), each bandwidth kernel on a sample
 * of elements recomputed here. After timing, the AdamW steps that were timed are replayed
 * on a sample of elements and must match bit for bit.
 *
 * The machine may be shared, so the kernels take turns (one run each per round) and each
 * row reports its best run: load that comes and goes then slows every row alike rather
 * than whichever row it fell on. A ratio above 1 means AdamW moved its bytes faster than
 * any of the bandwidth kernels did (its loads and stores, spread out by the arithmetic
 * between them, suit the memory system a little better than back-to-back ones).
 *
 * Built with the other benchmarks (bench/meson.build), not part of the test suite:
 *   build/bench/adamw [--elems 64M] [--reps 10] [--threads N] [--json]
 * bench/adamw_vs_deepspeed.sh runs it next to DeepSpeed's cpu_adam.
 */
#include <errno.h>
#include <getopt.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "train/adamw.h"

#define MiB ((uint64_t)1 << 20)
#define SAMPLE 4096          /* elements checked after each timed row */
#define VERIFY_ELEMS 1000003 /* elements of the kernel-vs-reference check (odd on purpose) */
#define ADAM_BYTES_PER_ELEM 28.0
#define TARGET_RATIO 0.95

struct opts {
    uint64_t elems;
    unsigned reps, threads;
    bool json;
};

struct row {
    const char *kernel;
    unsigned threads;
    double bytes_per_elem;
    double best_s, mean_s;
    double check; /* largest relative error found by the checks */
    bool ok;
};

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* "64M", "1G", "1e6", "4096": binary units for K/M/G. */
static int parse_count(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || !isfinite(v) || v < 1) return -EINVAL;
    switch (*end) {
    case 'k':
    case 'K':
        v *= 1024;
        end++;
        break;
    case 'm':
    case 'M':
        v *= 1024 * 1024;
        end++;
        break;
    case 'g':
    case 'G':
        v *= 1024.0 * 1024 * 1024;
        end++;
        break;
    default:
        break;
    }
    if (*end || v > 1e12) return -EINVAL;
    *out = (uint64_t)v;
    return 0;
}

static uint64_t rng(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float urand(uint64_t *s) /* [-1, 1) */
{
    return (float)((double)(rng(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static float *big_alloc(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 2 * MiB, n * sizeof(float))) return NULL;
    return p;
}

/* Values as a training step sees them; page-faulted in by the threads that use them. */
static void fill(float *p, float *g, float *m, float *v, size_t n, uint64_t seed)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        uint64_t s = seed ^ (i * 0x9e3779b97f4a7c15ull);
        p[i] = urand(&s);
        g[i] = 0.01f * urand(&s);
        m[i] = 0.001f * urand(&s);
        v[i] = 1e-5f * (1.0f + urand(&s));
    }
}

static const struct adamw_hparams hp = {
    .lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};

/* Errors are measured per array as max |got - want| / max |want|: relative to the array's
 * scale, so that elements near zero do not turn rounding into large relative errors. */
struct err {
    double diff[3], mag[3];
};

static void err_add(struct err *e, int k, double got, double want)
{
    double d = fabs(got - want);
    if (d > e->diff[k] || isnan(d)) e->diff[k] = d;
    if (fabs(want) > e->mag[k]) e->mag[k] = fabs(want);
}

static double err_rel(const struct err *e)
{
    double worst = 0;
    for (int k = 0; k < 3; k++)
        if (e->diff[k] > 0 || isnan(e->diff[k]))
            worst = fmax(worst, e->mag[k] > 0 ? e->diff[k] / e->mag[k] : INFINITY);
    return worst;
}

/* ---- bandwidth kernels ----------------------------------------------------------------- */

enum bw_kind { BW_COPY, BW_TRIAD, BW_INPLACE, BW_RW4W3 };
static const char *const bw_names[] = {"copy", "triad", "inplace", "rw4w3"};
static const double bw_bytes[] = {8, 12, 12, 28};

/* p, m, v += g over chunks of 64 Ki elements as adamw_update() splits them, with 512-bit
 * vectors as its AVX-512 kernel uses (the lanes past the end are left to a scalar loop;
 * there are 15 at most). The tightest bound: AdamW's memory traffic with nothing else. */
__attribute__((target("avx512f"))) static void rw4w3_avx512(float *p, const float *g, float *m,
                                                            float *v, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 G = _mm512_loadu_ps(g + i);
        _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), G));
        _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), G));
        _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), G));
    }
    for (; i < n; i++) {
        p[i] += g[i];
        m[i] += g[i];
        v[i] += g[i];
    }
}

__attribute__((target("avx2"))) static void rw4w3_avx2(float *p, const float *g, float *m, float *v,
                                                       size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 G = _mm256_loadu_ps(g + i);
        _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), G));
        _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), G));
        _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), G));
    }
    for (; i < n; i++) {
        p[i] += g[i];
        m[i] += g[i];
        v[i] += g[i];
    }
}

static void rw4w3(float *p, const float *g, float *m, float *v, size_t n)
{
    const size_t chunk = (size_t)1 << 16;
    size_t nchunks = (n + chunk - 1) / chunk;
    bool avx512 = adamw_best_isa() == ADAMW_ISA_AVX512, avx2 = adamw_best_isa() == ADAMW_ISA_AVX2;
#pragma omp parallel for schedule(static)
    for (size_t k = 0; k < nchunks; k++) {
        size_t i0 = k * chunk, len = n - i0 < chunk ? n - i0 : chunk;
        if (avx512)
            rw4w3_avx512(p + i0, g + i0, m + i0, v + i0, len);
        else if (avx2)
            rw4w3_avx2(p + i0, g + i0, m + i0, v + i0, len);
        else
            for (size_t i = i0; i < i0 + len; i++) {
                p[i] += g[i];
                m[i] += g[i];
                v[i] += g[i];
            }
    }
}

/* Built for each of these targets and picked at load time, so the bandwidth rows use
 * vectors as wide as the AdamW kernels do. */
__attribute__((target_clones("avx512f", "avx2", "default"))) static void
bw_run(enum bw_kind k, float *restrict a, float *restrict b, float *restrict c, float *restrict d,
       size_t n)
{
    const float s = 0.5f;
    switch (k) {
    case BW_COPY:
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++)
            b[i] = a[i];
        break;
    case BW_TRIAD:
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++)
            a[i] = b[i] + s * c[i];
        break;
    case BW_INPLACE:
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++)
            a[i] = a[i] + s * b[i];
        break;
    case BW_RW4W3: /* a=param, b=grad, c=m, d=v */
        rw4w3(a, b, c, d, n);
        break;
    }
}

/* The kernel run once on the sampled elements' saved inputs, compared with the arrays. */
static double bw_check(enum bw_kind k, const size_t *idx, float in[][4], const float *a,
                       const float *b, const float *c, const float *d)
{
    struct err e = {0};
    for (int j = 0; j < SAMPLE; j++) {
        size_t i = idx[j];
        float A = in[j][0], B = in[j][1], C = in[j][2], D = in[j][3];
        switch (k) {
        case BW_COPY:
            err_add(&e, 0, b[i], A);
            break;
        case BW_TRIAD:
            err_add(&e, 0, a[i], B + 0.5f * C);
            break;
        case BW_INPLACE:
            err_add(&e, 0, a[i], A + 0.5f * B);
            break;
        case BW_RW4W3:
            err_add(&e, 0, a[i], A + B);
            err_add(&e, 1, c[i], C + B);
            err_add(&e, 2, d[i], D + B);
            break;
        }
    }
    return err_rel(&e);
}

/* ---- rows -------------------------------------------------------------------------------- */

/* Four arrays and a sample of their elements, saved before a run to be checked after it. */
struct arrays {
    size_t n;
    float *p, *g, *m, *v;
    size_t idx[SAMPLE];
    float saved[SAMPLE][4];
};

static int arrays_alloc(struct arrays *A, size_t n, uint64_t seed)
{
    A->n = n;
    A->p = big_alloc(n);
    A->g = big_alloc(n);
    A->m = big_alloc(n);
    A->v = big_alloc(n);
    for (int j = 0; j < SAMPLE; j++)
        A->idx[j] = j == 0 ? 0 : j == 1 ? n - 1 : (size_t)(rng(&seed) % n);
    return A->p && A->g && A->m && A->v ? 0 : -ENOMEM;
}

static void arrays_free(struct arrays *A)
{
    free(A->p);
    free(A->g);
    free(A->m);
    free(A->v);
}

static void save_sample(struct arrays *A)
{
    for (int j = 0; j < SAMPLE; j++) {
        size_t i = A->idx[j];
        A->saved[j][0] = A->p[i];
        A->saved[j][1] = A->g[i];
        A->saved[j][2] = A->m[i];
        A->saved[j][3] = A->v[i];
    }
}

/* A bandwidth kernel once on fresh values, checked on the sample. */
static double bw_verify(struct arrays *B, enum bw_kind k)
{
    fill(B->p, B->g, B->m, B->v, B->n, 3);
    save_sample(B);
    bw_run(k, B->p, B->g, B->m, B->v, B->n);
    return bw_check(k, B->idx, B->saved, B->p, B->g, B->m, B->v);
}

/* An AdamW kernel against the scalar reference on VERIFY_ELEMS elements, three steps. */
static double adam_verify(enum adamw_isa isa)
{
    size_t n = VERIFY_ELEMS;
    float *b[8] = {0};
    int failed = 0;
    for (int i = 0; i < 8; i++)
        failed |= !(b[i] = malloc(n * sizeof(float)));
    if (failed) goto out;
    fill(b[0], b[1], b[2], b[3], n, 7);
    for (int i = 0; i < 4; i++)
        memcpy(b[4 + i], b[i], n * sizeof(float));
    for (int step = 1; step <= 3; step++) {
        failed |= adamw_update_isa(ADAMW_ISA_SCALAR, b[0], b[1], b[2], b[3], n, &hp, step, 0.9f);
        failed |= adamw_update_isa(isa, b[4], b[5], b[6], b[7], n, &hp, step, 0.9f);
    }
    static const int arr[3] = {0, 2, 3}; /* p, m, v */
    struct err e = {0};
    for (int k = 0; k < 3 && !failed; k++)
        for (size_t i = 0; i < n; i++)
            err_add(&e, k, b[4 + arr[k]][i], b[arr[k]][i]);
out:
    for (int i = 0; i < 8; i++)
        free(b[i]);
    return failed ? INFINITY : err_rel(&e);
}

/* What a row runs: a bandwidth kernel on B, or an AdamW kernel on A. */
struct kernel {
    const char *name;
    bool adam;
    enum bw_kind bw;
    enum adamw_isa isa;
};

/* Every kernel of one thread count. The kernels take turns, one run each per round, so
 * that whatever else the machine does slows them alike rather than whichever row it
 * happened to fall on; each row keeps its best run. AdamW steps on A (all kernels in turn,
 * the step count running on), the bandwidth kernels on B. */
static void time_rows(struct arrays *A, struct arrays *B, const struct kernel *ks, int nk,
                      unsigned threads, unsigned reps, struct row *rows)
{
    omp_set_num_threads((int)threads);
    for (int i = 0; i < nk; i++) {
        rows[i] =
            (struct row){.kernel = ks[i].name,
                         .threads = threads,
                         .bytes_per_elem = ks[i].adam ? ADAM_BYTES_PER_ELEM : bw_bytes[ks[i].bw],
                         .best_s = INFINITY};
        rows[i].check = ks[i].adam ? adam_verify(ks[i].isa) : bw_verify(B, ks[i].bw);
    }
    fill(A->p, A->g, A->m, A->v, A->n, 1);
    save_sample(A);
    int step = 0, failed = 0;
    for (unsigned r = 0; r < reps; r++) {
        for (int i = 0; i < nk; i++) {
            uint64_t t0 = now_ns();
            if (ks[i].adam)
                failed |=
                    adamw_update_isa(ks[i].isa, A->p, A->g, A->m, A->v, A->n, &hp, ++step, 1.0f);
            else
                bw_run(ks[i].bw, B->p, B->g, B->m, B->v, B->n);
            double sec = (now_ns() - t0) * 1e-9;
            rows[i].best_s = fmin(rows[i].best_s, sec);
            rows[i].mean_s += sec / reps;
        }
    }
    /* The timed AdamW steps replayed on the sampled elements, one element at a time, each
     * step through the kernel that ran it: a kernel computes an element the same way
     * wherever it sits, so the bits must match exactly. */
    struct err e = {0};
    for (int j = 0; j < SAMPLE; j++) {
        float p = A->saved[j][0], g = A->saved[j][1], m = A->saved[j][2], v = A->saved[j][3];
        int st = 0;
        for (unsigned r = 0; r < reps; r++)
            for (int i = 0; i < nk; i++)
                if (ks[i].adam) adamw_update_isa(ks[i].isa, &p, &g, &m, &v, 1, &hp, ++st, 1.0f);
        size_t k = A->idx[j];
        err_add(&e, 0, A->p[k], p);
        err_add(&e, 1, A->m[k], m);
        err_add(&e, 2, A->v[k], v);
    }
    double replay = failed ? INFINITY : err_rel(&e);
    for (int i = 0; i < nk; i++) {
        rows[i].ok = rows[i].check <= 1e-6 && (!ks[i].adam || replay == 0);
        if (ks[i].adam) rows[i].check = fmax(rows[i].check, replay);
    }
}

/* ---- output ------------------------------------------------------------------------------ */

static double gbs(const struct row *r, size_t n)
{
    return r->bytes_per_elem * (double)n / r->best_s * 1e-9;
}

static void print_row(const struct opts *o, const struct row *r, size_t n, double ratio)
{
    double gel = (double)n / r->best_s * 1e-9;
    if (o->json) {
        printf("{\"bench\": \"adamw\", \"kernel\": \"%s\", \"threads\": %u, \"elements\": %zu, "
               "\"bytes_per_elem\": %.0f, \"best_ms\": %.3f, \"mean_ms\": %.3f, \"gbps\": %.3f, "
               "\"gelem_per_s\": %.4f, \"ratio_to_bound\": ",
               r->kernel, r->threads, n, r->bytes_per_elem, r->best_s * 1e3, r->mean_s * 1e3,
               gbs(r, n), gel);
        if (ratio >= 0)
            printf("%.3f", ratio);
        else
            printf("null");
        printf(", \"max_rel_err\": %.3g, \"verified\": %s}\n", r->check, r->ok ? "true" : "false");
        return;
    }
    char rs[16] = "-";
    if (ratio >= 0) snprintf(rs, sizeof(rs), "%.3f", ratio);
    printf("  %13s %7u %10zu %9.2f %9.2f %8.2f %9.4f %7s %9.1e %8s\n", r->kernel, r->threads,
           r->bytes_per_elem > 0 ? n : 0, r->best_s * 1e3, r->mean_s * 1e3, gbs(r, n), gel, rs,
           r->check, r->ok ? "ok" : "FAIL");
}

static void usage(FILE *f)
{
    fprintf(f, "usage: adamw [--elems N] [--reps N] [--threads N] [--json]\n"
               "  --elems N     elements per array, 4 arrays (default 64M = 256 MiB each)\n"
               "  --reps N      timed runs per row, the best is reported (default 10)\n"
               "  --threads N   the 'all cores' thread count (default: online CPUs)\n"
               "  --json        one JSON object per row, then a summary object\n");
}

static int parse_args(int argc, char **argv, struct opts *o)
{
    enum { O_ELEMS = 256, O_REPS, O_THREADS, O_JSON };
    static const struct option longopts[] = {
        {"elems", required_argument, NULL, O_ELEMS},
        {"reps", required_argument, NULL, O_REPS},
        {"threads", required_argument, NULL, O_THREADS},
        {"json", no_argument, NULL, O_JSON},
        {"help", no_argument, NULL, 'h'},
        {0},
    };
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    *o = (struct opts){.elems = 64 * MiB, .reps = 10, .threads = cpus > 0 ? (unsigned)cpus : 1};
    int ch;
    uint64_t v;
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (ch) {
        case O_ELEMS:
            if (parse_count(optarg, &o->elems)) goto bad;
            break;
        case O_REPS:
            if (parse_count(optarg, &v) || v > 100000) goto bad;
            o->reps = (unsigned)v;
            break;
        case O_THREADS:
            if (parse_count(optarg, &v) || v > 4096) goto bad;
            o->threads = (unsigned)v;
            break;
        case O_JSON:
            o->json = true;
            break;
        case 'h':
            usage(stdout);
            return 1;
        default:
            usage(stderr);
            return -1;
        }
        continue;
    bad:
        fprintf(stderr, "adamw: bad value '%s'\n", optarg);
        return -1;
    }
    if (optind < argc) {
        fprintf(stderr, "adamw: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    return 0;
}

static void cpu_model(char *buf, size_t len)
{
    snprintf(buf, len, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[256];
    while (fgets(line, sizeof(line), f)) {
        char *c = strchr(line, ':');
        if (!strncmp(line, "model name", 10) && c) {
            snprintf(buf, len, "%s", c + 2);
            buf[strcspn(buf, "\n")] = '\0';
            break;
        }
    }
    fclose(f);
}

int main(int argc, char **argv)
{
    struct opts o;
    int r = parse_args(argc, argv, &o);
    if (r) return r > 0 ? 0 : 2;

    /* A for AdamW, B for the bandwidth kernels, so neither disturbs the other's values. */
    struct arrays *A = calloc(1, sizeof(*A)), *B = calloc(1, sizeof(*B));
    if (!A || !B || arrays_alloc(A, (size_t)o.elems, 12345) ||
        arrays_alloc(B, (size_t)o.elems, 54321)) {
        fprintf(stderr, "adamw: cannot allocate 8 x %llu floats\n",
                (unsigned long long)o.elems);
        return 1;
    }
    size_t n = A->n;

    unsigned tcounts[2] = {o.threads, 1};
    int ntc = o.threads == 1 ? 1 : 2;
    enum adamw_isa best = adamw_best_isa();
    char cpu[128];
    double load[3] = {0};
    cpu_model(cpu, sizeof(cpu));
    if (getloadavg(load, 3) < 0) load[0] = NAN;
    if (!o.json) {
        printf("# zinf bench adamw: %zu elements per array (%.0f MiB each; 4 arrays for AdamW, "
               "4 for the bandwidth kernels), %u rounds, best run of each row reported\n",
               n, n * 4.0 / MiB, o.reps);
        printf("# cpu: %s, %ld online, threads: %u and 1; adamw kernel chosen at run time: %s; "
               "load average %.2f\n",
               cpu, sysconf(_SC_NPROCESSORS_ONLN), o.threads, adamw_isa_name(best), load[0]);
        printf("# bytes per element as STREAM counts them: copy 8, triad 12, inplace 12, "
               "rw4w3 28; adamw 28 (read param, grad, m, v; write param, m, v)\n");
        printf("# bound = best bandwidth row at that thread count / 28 B; ratio = adamw "
               "elements/s / bound (target >= %.1f)\n",
               TARGET_RATIO);
        printf("# max_rel: max|diff| / max|value| per array of the row's check (adamw: against "
               "the scalar reference, 1e6 elements, 3 steps; verified also needs the timed\n"
               "# steps, replayed one element at a time on %d sampled elements, to match "
               "bit for bit)\n",
               SAMPLE);
        printf("#\n");
        printf("# %13s %7s %10s %9s %9s %8s %9s %7s %9s %8s\n", "kernel", "threads", "elements",
               "best", "mean", "GB/s", "Gelem/s", "ratio", "max_rel", "verified");
        printf("# %13s %7s %10s %9s %9s %8s %9s %7s %9s %8s\n", "", "", "", "(ms)", "(ms)", "", "",
               "", "", "");
    }

    int fails = 0;
    double ratio_best[2] = {0}, bound[2] = {0};
    const char *bound_by[2] = {"", ""};
    static char names[3][24];
    for (int t = 0; t < ntc; t++) {
        struct kernel ks[8];
        struct row rows[8];
        int nk = 0;
        for (int k = BW_COPY; k <= BW_RW4W3; k++)
            ks[nk++] = (struct kernel){.name = bw_names[k], .bw = (enum bw_kind)k};
        for (int i = ADAMW_ISA_AVX512; i >= ADAMW_ISA_SCALAR; i--) {
            enum adamw_isa isa = (enum adamw_isa)i;
            if (adamw_update_isa(isa, NULL, NULL, NULL, NULL, 0, &hp, 1, 1.0f)) continue;
            if (isa == ADAMW_ISA_SCALAR && tcounts[t] != 1) continue; /* one thread by design */
            snprintf(names[isa], sizeof(names[isa]), "adamw/%s", adamw_isa_name(isa));
            ks[nk++] = (struct kernel){.name = names[isa], .adam = true, .isa = isa};
        }
        time_rows(A, B, ks, nk, tcounts[t], o.reps, rows);
        for (int i = 0; i < nk; i++) {
            double gel = (double)n / rows[i].best_s * 1e-9;
            if (!ks[i].adam && gbs(&rows[i], n) / ADAM_BYTES_PER_ELEM > bound[t]) {
                bound[t] = gbs(&rows[i], n) / ADAM_BYTES_PER_ELEM;
                bound_by[t] = ks[i].name;
            }
            double ratio = ks[i].adam ? gel / bound[t] : -1; /* bandwidth rows come first */
            if (ks[i].adam && ks[i].isa == best) ratio_best[t] = ratio;
            fails += !rows[i].ok;
            print_row(&o, &rows[i], n, ratio);
        }
    }

    bool met = true;
    for (int t = 0; t < ntc; t++)
        met &= ratio_best[t] >= TARGET_RATIO;
    if (!o.json) {
        for (int t = 0; t < ntc; t++)
            printf("# %u thread%s: bound %.4f Gelem/s (%s, %.2f GB/s); adamw/%s %.4f Gelem/s = "
                   "%.3f of the bound\n",
                   tcounts[t], tcounts[t] == 1 ? "" : "s", bound[t], bound_by[t],
                   bound[t] * ADAM_BYTES_PER_ELEM, adamw_isa_name(best), ratio_best[t] * bound[t],
                   ratio_best[t]);
        printf("# target >= %.1f of the bound: %s\n", TARGET_RATIO, met ? "met" : "NOT met");
        printf("# %s\n", fails ? "FAILED: see the rows marked FAIL" : "all rows verified");
    } else {
        printf("{\"bench\": \"adamw\", \"summary\": true, \"elements\": %zu, \"kernel\": \"%s\"", n,
               adamw_isa_name(best));
        for (int t = 0; t < ntc; t++)
            printf(", \"threads_%u\": {\"bound_gelem_per_s\": %.4f, \"bound_kernel\": \"%s\", "
                   "\"ratio\": %.3f}",
                   tcounts[t], bound[t], bound_by[t], ratio_best[t]);
        printf(", \"target_met\": %s, \"verified\": %s}\n", met ? "true" : "false",
               fails ? "false" : "true");
    }
    arrays_free(A);
    arrays_free(B);
    free(A);
    free(B);
    return fails ? 1 : 0;
}

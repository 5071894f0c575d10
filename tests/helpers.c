/* helpers.c - see helpers.h. */
#include <errno.h>
#include <stdarg.h>
#include <ftw.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "helpers.h"
#include "tiers/cuda_probe.h"

#include <criterion/criterion.h>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ZINF_TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define ZINF_TEST_ASAN 1
#endif
#ifdef ZINF_TEST_ASAN
#include <sanitizer/lsan_interface.h>
void test_leak_check(void)
{
    cr_assert_eq(__lsan_do_recoverable_leak_check(), 0, "memory leaked (report above)");
}
#else
void test_leak_check(void)
{
}
#endif

static char *make_dir(const char *base, const char *tag)
{
    char path[4096];
    mkdir(base, 0755);
    snprintf(path, sizeof(path), "%s/zinf-%s-XXXXXX", base, tag);
    if (!mkdtemp(path))
        return NULL;
    return strdup(path);
}

char *test_tmpdir(const char *tag)
{
    const char *base = getenv("ZINF_TEST_TMPDIR");
    return make_dir(base && *base ? base : "/tmp", tag);
}

bool test_soak(void)
{
    const char *v = getenv("ZINF_TEST_SOAK");
    return v && *v && strcmp(v, "0") != 0;
}

bool test_sanitized(void)
{
    const char *v = getenv("ZINF_TEST_SANITIZED");
    return v && *v && strcmp(v, "none") != 0 && !test_soak();
}

char *test_shmdir(const char *tag)
{
    struct stat st;
    if (stat("/dev/shm", &st) != 0 || !S_ISDIR(st.st_mode))
        return NULL;
    return make_dir("/dev/shm", tag);
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *ftw)
{
    return remove(p);
}

void test_rmtree(char *path)
{
    if (!path)
        return;
    nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(path);
}

void *test_aligned_alloc(size_t bytes)
{
    void *p = NULL;
    if (posix_memalign(&p, ZINF_ALIGN, bytes ? bytes : ZINF_ALIGN))
        return NULL;
    return p;
}

uint64_t test_rand(uint64_t *s)
{
    /* splitmix64: good enough for test data, and reproducible from the seed. */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void test_fill_random(void *buf, size_t bytes, uint64_t seed)
{
    unsigned char *p = buf;
    uint64_t s = seed;
    size_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
        uint64_t v = test_rand(&s);
        memcpy(p + i, &v, 8);
    }
    if (i < bytes) {
        uint64_t v = test_rand(&s);
        memcpy(p + i, &v, bytes - i);
    }
}

zinf_tensor test_register(zinf_engine *e, const char *name, size_t n, enum zinf_tier home)
{
    zinf_tensor t = 0;
    int r = zinf_register(e, name, n, home, &t);
    cr_assert_eq(r, 0, "register %s (%zu bytes): %s", name, n, zinf_strerror(r));
    cr_assert_neq(t, 0);
    return t;
}

unsigned char *test_rand_buf(size_t n, uint64_t seed)
{
    unsigned char *b = malloc(n ? n : 1);
    cr_assert_not_null(b);
    test_fill_random(b, n, seed);
    return b;
}

void test_expect_content(zinf_engine *e, zinf_tensor t, const unsigned char *want, size_t n,
                         const char *what)
{
    unsigned char *got = malloc(n ? n : 1);
    cr_assert_not_null(got);
    int r = zinf_read(e, t, 0, got, n);
    cr_assert_eq(r, 0, "%s: zinf_read: %s", what, zinf_strerror(r));
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i])
            cr_assert_fail("%s: byte %zu of %zu is %02x, want %02x", what, i, n, got[i], want[i]);
    free(got);
}

static pthread_mutex_t cap_lock = PTHREAD_MUTEX_INITIALIZER;
static char *cap_text;
static size_t cap_len;

static void cap_sink(enum log_level level, const char *msg, void *data)
{
    size_t n = strlen(msg);
    pthread_mutex_lock(&cap_lock);
    char *t = realloc(cap_text, cap_len + n + 2);
    if (t) {
        cap_text = t;
        memcpy(cap_text + cap_len, msg, n);
        cap_len += n;
        cap_text[cap_len++] = '\n';
        cap_text[cap_len] = '\0';
    }
    pthread_mutex_unlock(&cap_lock);
}

void test_log_capture_start(void)
{
    test_log_capture_stop();
    log_set_sink(cap_sink, NULL, NULL);
}

const char *test_log_text(void)
{
    return cap_text ? cap_text : "";
}

void test_log_capture_stop(void)
{
    log_set_sink(NULL, NULL, NULL);
    pthread_mutex_lock(&cap_lock);
    free(cap_text);
    cap_text = NULL;
    cap_len = 0;
    pthread_mutex_unlock(&cap_lock);
}

void test_write_training_text(const char *dir, char *path, size_t len)
{
    snprintf(path, len, "%s/data.txt", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    for (int i = 0; i < 400; i++)
        fprintf(f, "the quick brown fox %d jumps over the lazy dog %d times.\n", i % 17, i % 5);
    fclose(f);
}

/* ---- trace files ------------------------------------------------------------------------ */

#include <jansson.h>

struct span_ref {
    long long tid;
    double ts, end;
    const char *name;
};

static int span_order(const void *a, const void *b)
{
    const struct span_ref *x = a, *y = b;
    if (x->tid != y->tid) return x->tid < y->tid ? -1 : 1;
    if (x->ts != y->ts) return x->ts < y->ts ? -1 : 1;
    return x->end > y->end ? -1 : x->end < y->end; /* the outer one first */
}

void test_trace_load(const char *path, struct test_trace *tr)
{
    json_error_t je;
    memset(tr, 0, sizeof(*tr));
    json_t *root = json_load_file(path, 0, &je);
    cr_assert_not_null(root, "%s: not JSON: %s (line %d)", path, je.text, je.line);
    cr_assert(json_is_array(root), "%s: not a JSON array", path);
    tr->root = root;
    size_t n = json_array_size(root), ns = 0;
    struct span_ref *sp = calloc(n + 1, sizeof(*sp));
    cr_assert_not_null(sp);
    /* Async begins waiting for their end, by cat/name/id. */
    json_t *open = json_object();
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(root, i);
        const char *ph = json_string_value(json_object_get(e, "ph"));
        const char *name = json_string_value(json_object_get(e, "name"));
        cr_assert(ph && name && json_is_integer(json_object_get(e, "pid")),
                  "%s: event %zu lacks ph, name or pid", path, i);
        tr->events++;
        if (!strcmp(ph, "M")) {
            if (!strcmp(name, "zinf_dropped_events"))
                tr->dropped = (uint64_t)json_integer_value(
                    json_object_get(json_object_get(e, "args"), "dropped"));
            continue;
        }
        json_t *ts = json_object_get(e, "ts"), *tid = json_object_get(e, "tid");
        cr_assert(json_is_number(ts) && json_is_integer(tid), "%s: event %zu (%s) lacks ts or tid",
                  path, i, name);
        cr_assert_geq(json_number_value(ts), 0, "%s: %s before the trace started", path, name);
        if (!strcmp(ph, "X")) {
            json_t *dur = json_object_get(e, "dur");
            cr_assert(json_is_number(dur) && json_number_value(dur) >= 0, "%s: span %s lacks dur",
                      path, name);
            sp[ns++] = (struct span_ref){.tid = json_integer_value(tid),
                                         .ts = json_number_value(ts),
                                         .end = json_number_value(ts) + json_number_value(dur),
                                         .name = name};
            tr->spans++;
        } else if (!strcmp(ph, "b") || !strcmp(ph, "e")) {
            const char *id = json_string_value(json_object_get(e, "id"));
            const char *cat = json_string_value(json_object_get(e, "cat"));
            cr_assert(id && cat, "%s: async %s lacks id or cat", path, name);
            char key[256];
            snprintf(key, sizeof(key), "%s/%s/%s", cat, name, id);
            json_t *b = json_object_get(open, key);
            if (ph[0] == 'b') {
                cr_assert_null(b, "%s: async %s begins twice", path, key);
                json_object_set_new(open, key, json_real(json_number_value(ts)));
                tr->asyncs++;
            } else {
                cr_assert_not_null(b, "%s: async %s ends without a begin", path, key);
                cr_assert_geq(json_number_value(ts), json_real_value(b), "%s: %s ends first", path,
                              key);
                json_object_del(open, key);
            }
        } else if (!strcmp(ph, "C")) {
            cr_assert(json_is_integer(json_object_get(json_object_get(e, "args"), "value")),
                      "%s: counter %s lacks args.value", path, name);
            tr->counters++;
        } else if (!strcmp(ph, "i")) {
            tr->instants++;
        } else {
            cr_assert_fail("%s: event %zu has phase %s", path, i, ph);
        }
    }
    cr_assert_eq(json_object_size(open), 0, "%s: %zu async spans never end", path,
                 json_object_size(open));
    json_decref(open);
    /* Spans of a thread nest: each lies within the one open around it, or after it. The
     * file rounds to nanoseconds (0.001 us). */
    qsort(sp, ns, sizeof(*sp), span_order);
    struct span_ref *stack[256];
    int depth = 0;
    for (size_t i = 0; i < ns; i++) {
        if (i && sp[i].tid != sp[i - 1].tid) depth = 0;
        while (depth && stack[depth - 1]->end <= sp[i].ts + 0.0015)
            depth--;
        if (depth)
            cr_assert_leq(sp[i].end, stack[depth - 1]->end + 0.0015,
                          "%s: thread %lld: span %s [%.3f, %.3f] overlaps %s [%.3f, %.3f]", path,
                          sp[i].tid, sp[i].name, sp[i].ts, sp[i].end, stack[depth - 1]->name,
                          stack[depth - 1]->ts, stack[depth - 1]->end);
        cr_assert_lt(depth, 256);
        stack[depth++] = &sp[i];
    }
    free(sp);
}

void test_trace_free(struct test_trace *tr)
{
    json_decref(tr->root);
    tr->root = NULL;
}

static bool name_matches(const char *got, const char *want)
{
    size_t n = strlen(want);
    if (n && want[n - 1] == '*') return !strncmp(got, want, n - 1);
    return !strcmp(got, want);
}

size_t test_trace_count(const struct test_trace *tr, const char *ph, const char *name,
                        const char *detail)
{
    size_t k = 0, i;
    json_t *e;
    json_array_foreach((json_t *)tr->root, i, e)
    {
        const char *p = json_string_value(json_object_get(e, "ph"));
        const char *nm = json_string_value(json_object_get(e, "name"));
        if (!p || strcmp(p, ph) || !nm || !name_matches(nm, name)) continue;
        if (detail) {
            const char *d =
                json_string_value(json_object_get(json_object_get(e, "args"), "detail"));
            if (!d || !name_matches(d, detail)) continue;
        }
        k++;
    }
    return k;
}

long long test_trace_counter(const struct test_trace *tr, const char *name)
{
    long long v = -1;
    double last = -1;
    size_t i;
    json_t *e;
    /* The file is in order per thread: the last value is the latest one. */
    json_array_foreach((json_t *)tr->root, i, e)
    {
        const char *p = json_string_value(json_object_get(e, "ph"));
        const char *nm = json_string_value(json_object_get(e, "name"));
        double ts = json_number_value(json_object_get(e, "ts"));
        if (p && !strcmp(p, "C") && nm && !strcmp(nm, name) && ts >= last) {
            v = json_integer_value(json_object_get(json_object_get(e, "args"), "value"));
            last = ts;
        }
    }
    return v;
}

int test_run_zinf(char **out, const char *fmt, ...)
{
    char args[4096], cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof(args), fmt, ap);
    va_end(ap);
    const char *bin = getenv("ZINF_BIN");
    cr_assert_not_null(bin, "ZINF_BIN is not set");
    snprintf(cmd, sizeof(cmd), "%s %s 2>&1", bin, args);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t cap = 4096, len = 0, n;
    char *buf = malloc(cap);
    cr_assert_not_null(buf);
    while ((n = fread(buf + len, 1, cap - len - 1, p)) > 0) {
        len += n;
        if (cap - len < 1024) {
            buf = realloc(buf, cap *= 2);
            cr_assert_not_null(buf);
        }
    }
    buf[len] = '\0';
    int st = pclose(p);
    *out = buf;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

void test_report_line(int fd, const char *fmt, va_list ap)
{
    char buf[512];
    int n = vsnprintf(buf, sizeof(buf) - 1, fmt, ap);
    if (n < 0) return;
    if (n > (int)sizeof(buf) - 2) n = (int)sizeof(buf) - 2;
    buf[n++] = '\n';
    if (write(fd, buf, (size_t)n) < 0) {
        /* the parent sees the child's exit status */
    }
}

int test_cuda_probe_forked(struct cuda_probe_info *pi)
{
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        cuda_probe(pi);
        _exit(write(fds[1], pi, sizeof(*pi)) == (ssize_t)sizeof(*pi) ? 0 : 1);
    }
    close(fds[1]);
    cr_assert_eq(read(fds[0], pi, sizeof(*pi)), (ssize_t)sizeof(*pi), "the probe died");
    close(fds[0]);
    waitpid(pid, NULL, 0);
    return pi->device_count;
}

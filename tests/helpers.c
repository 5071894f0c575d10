/* helpers.c - see helpers.h. */
#include <errno.h>
#include <ftw.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "helpers.h"

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

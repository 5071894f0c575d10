/*
 * fuzz_driver.c - runs LLVMFuzzerTestOneInput without libFuzzer, so that every compiler
 * gets the fuzz target as a quick unit test: each file of the corpus directories given on
 * the command line as it is, then a fixed number of deterministic mutations of them (bit
 * flips, byte changes, truncations, deletions, insertions of JSON punctuation and
 * tokens, splices of two seeds). A file named on the command line instead of a
 * directory is run alone, to replay one crash.
 *
 * It is not a fuzzer: there is no coverage feedback, and the same seed always gives the
 * same inputs.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MUTATIONS 10000    /* spread over the seeds; a few seconds even under ASan */
#define MAX_SEEDS 256
#define MAX_SEED_BYTES 65536

struct seed {
    uint8_t *data;
    size_t size;
};

static uint64_t rng_state = 0x5eed;

static uint64_t rnd(void)
{
    /* splitmix64, so that a failing mutation can be found again from its number. */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static size_t below(size_t n)
{
    return n ? (size_t)(rnd() % n) : 0;
}

static int read_file(const char *path, struct seed *s)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    s->data = malloc(MAX_SEED_BYTES);
    s->size = s->data ? fread(s->data, 1, MAX_SEED_BYTES, f) : 0;
    fclose(f);
    return s->data ? 0 : -1;
}

static const char *const tokens[] = {
    "{", "}", "[", "]", ":", ",", "\"", "\\", " ", "\n", "null", "true", "false", "-1", "0",
    "1e999", "1e19", "0.5", "-0", "4096", "1e8", "\"nvme\"", "\"cpu\"", "\"\"", "[\"/a\"]",
    "\"/nvme0/\"", "\\u0000", "\\ud800", "\"4G\"", "\"99999999T\"", "9223372036854775807",
    "{\"device\": \"nvme\", \"nvme_path\": [\"/x\", \"/y\"]}", "\"aio\": ", "\"zinf\": ",
    "\"zero_optimization\": ", "\"offload_param\": ", "\"nvme_paths\": ", "\"thread_count\": ",
    "\"stage3_prefetch_bucket_size\": ", "\"prefetch_bucket_size\": ", "\xff", "\xc3\xa9",
};

/* Apply 1..4 random edits to buf (size *n, capacity cap). */
static void mutate(uint8_t *buf, size_t *n, size_t cap, const struct seed *seeds, size_t nseeds)
{
    int edits = 1 + (int)below(4);

    for (int e = 0; e < edits; e++) {
        size_t at = below(*n + 1);
        switch (below(7)) {
        case 0: /* flip a bit */
            if (*n)
                buf[below(*n)] ^= (uint8_t)(1u << below(8));
            break;
        case 1: /* any byte */
            if (*n)
                buf[below(*n)] = (uint8_t)rnd();
            break;
        case 2: /* truncate */
            *n = at;
            break;
        case 3: { /* delete a range */
            size_t len = below(*n - at + 1);
            memmove(buf + at, buf + at + len, *n - at - len);
            *n -= len;
            break;
        }
        case 4:
        case 5: { /* insert a token */
            const char *t = tokens[below(sizeof(tokens) / sizeof(tokens[0]))];
            size_t len = strlen(t);
            if (*n + len > cap)
                break;
            memmove(buf + at + len, buf + at, *n - at);
            memcpy(buf + at, t, len);
            *n += len;
            break;
        }
        case 6: { /* splice: the tail of another seed after this point */
            const struct seed *o = &seeds[below(nseeds)];
            size_t from = below(o->size + 1), len = o->size - from;
            if (at + len > cap)
                len = cap - at;
            memcpy(buf + at, o->data + from, len);
            *n = at + len;
            break;
        }
        }
    }
}

static int add_dir(const char *dir, struct seed *seeds, size_t *nseeds)
{
    struct dirent **names;
    int n = scandir(dir, &names, NULL, alphasort);

    if (n < 0)
        return -1;
    for (int i = 0; i < n; i++) {
        char path[4096];
        struct stat st;
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]->d_name);
        if (stat(path, &st) == 0 && S_ISREG(st.st_mode) && *nseeds < MAX_SEEDS &&
            read_file(path, &seeds[*nseeds]) == 0)
            (*nseeds)++;
        free(names[i]);
    }
    free(names);
    return 0;
}

int main(int argc, char **argv)
{
    static struct seed seeds[MAX_SEEDS];
    size_t nseeds = 0, runs = 0;
    int ret = 1;

    if (argc < 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR|FILE...\n", argv[0]);
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            perror(argv[i]);
            goto out;
        }
        if (S_ISDIR(st.st_mode) ? add_dir(argv[i], seeds, &nseeds) != 0
                                : (nseeds < MAX_SEEDS && read_file(argv[i], &seeds[nseeds++]))) {
            fprintf(stderr, "%s: cannot read\n", argv[i]);
            goto out;
        }
    }
    if (!nseeds) {
        fprintf(stderr, "no seeds in the corpus\n");
        goto out;
    }
    for (size_t i = 0; i < nseeds; i++, runs++)
        LLVMFuzzerTestOneInput(seeds[i].data, seeds[i].size);

    /* A lone file replays a crash: no mutations. */
    if (argc == 2 && nseeds == 1) {
        struct stat st;
        if (stat(argv[1], &st) == 0 && !S_ISDIR(st.st_mode)) {
            printf("%zu input(s) ran\n", runs);
            ret = 0;
            goto out;
        }
    }
    size_t cap = MAX_SEED_BYTES * 2;
    uint8_t *buf = malloc(cap);
    if (!buf)
        goto out;
    for (size_t m = 0; m < MUTATIONS; m++, runs++) {
        const struct seed *s = &seeds[m % nseeds];
        size_t n = s->size;
        memcpy(buf, s->data, n);
        mutate(buf, &n, cap, seeds, nseeds);
        /* An exact-size copy, so that a read past the end is caught by ASan. */
        uint8_t *exact = malloc(n ? n : 1);
        if (!exact)
            break;
        memcpy(exact, buf, n);
        LLVMFuzzerTestOneInput(exact, n);
        free(exact);
    }
    free(buf);
    printf("%zu seeds, %zu inputs ran, no crash\n", nseeds, runs);
    ret = 0;
out:
    for (size_t i = 0; i < nseeds; i++)
        free(seeds[i].data);
    return ret;
}

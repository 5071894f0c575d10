/*
 * weights_io.c - safetensors files of zinf's GPT model, read and written (weights_io.h).
 *
 * The format: an 8-byte little-endian header length N, N bytes of JSON (an object: per
 * tensor its "dtype", "shape" and "data_offsets" [begin, end) into the data, and an optional
 * "__metadata__" of strings), then the data, which the ranges must cover exactly. GPT-2's
 * names and layout are transformers' GPT2LMHeadModel's: its Conv1D layers keep their weights
 * (in, out), the transpose of zinf's (out, in) (ops_linear_forward's W), so the blocks' four
 * matrices are transposed on the way in and out; every other tensor is the same.
 *
 * Not here: the engine, the trainer (the caller reads and writes the values through them).
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "dirs.h"
#include "train/ops.h"
#include "weights_io.h"
#include "zinf.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian, and so are the floats this file copies as they are"
#endif

#define MAX_HEADER_BYTES (100u * 1000 * 1000) /* safetensors' own limit on the header */
#define MAX_DIMS 8
#define MAX_PROBLEMS 12 /* lines of err; the rest are counted */

/* ---- names ------------------------------------------------------------------------------- */

/* GPT-2's names of a block's tensors, in enum gpt_block_slot order. */
static const char *const hf_slot[GPT_BLOCK_NSLOTS] = {
    "ln_1.weight",       "ln_1.bias",       "attn.c_attn.weight", "attn.c_attn.bias",
    "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight",        "ln_2.bias",
    "mlp.c_fc.weight",   "mlp.c_fc.bias",   "mlp.c_proj.weight",  "mlp.c_proj.bias",
};
static const char *const hf_top[4] = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"};

static const char *prefix_of(enum weights_names names)
{
    return names == WEIGHTS_HF ? "transformer." : "";
}

void weights_name(const struct gpt_tensor_desc *d, enum weights_names names, char *name,
                  size_t len)
{
    if (names == WEIGHTS_ZINF)
        snprintf(name, len, "%s", d->name);
    else if (d->block >= 0)
        snprintf(name, len, "%sh.%d.%s", prefix_of(names), d->block, hf_slot[d->slot]);
    else
        snprintf(name, len, "%s%s", prefix_of(names), hf_top[d->slot]);
}

bool weights_transposed(const struct gpt_tensor_desc *d, enum weights_names names)
{
    return names != WEIGHTS_ZINF && d->block >= 0 && d->ndim == 2;
}

/* The shape of tensor d in a file under names: zinf's, or transposed. */
static int file_shape(const struct gpt_tensor_desc *d, enum weights_names names,
                      uint64_t shape[2])
{
    bool tr = weights_transposed(d, names);
    shape[0] = d->shape[tr ? 1 : 0];
    shape[1] = d->shape[tr ? 0 : 1];
    return d->ndim;
}

static const char *names_said(enum weights_names names)
{
    return names == WEIGHTS_ZINF ? "zinf's names" : names == WEIGHTS_HF
                                                        ? "GPT-2's names (GPT2LMHeadModel)"
                                                        : "GPT-2's names (GPT2Model)";
}

/* ---- dtypes ------------------------------------------------------------------------------ */

enum { DT_F32, DT_BF16, DT_F16, DT_OTHER };

static const struct {
    const char *name;
    unsigned bytes;
} dtypes[] = {
    {"F32", 4}, {"BF16", 2}, {"F16", 2}, {"F64", 8}, {"I64", 8}, {"I32", 4}, {"I16", 2},
    {"I8", 1},  {"U64", 8},  {"U32", 4}, {"U16", 2}, {"U8", 1},  {"BOOL", 1}, {"F8_E4M3", 1},
    {"F8_E5M2", 1},
};

/* ---- problems ---------------------------------------------------------------------------- */

/* The lines of err: each "PATH: what", at most MAX_PROBLEMS, then how many more. */
struct problems {
    const char *path;
    char *buf;
    size_t cap, len;
    int n;
};

__attribute__((format(printf, 2, 3))) static void say(struct problems *p, const char *fmt, ...)
{
    p->n++;
    if (p->n > MAX_PROBLEMS || !p->buf || p->cap == 0) return;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    int k = snprintf(p->buf + p->len, p->cap - p->len, "%s%s: %s", p->len ? "\n" : "", p->path,
                     line);
    if (k > 0) p->len = MIN(p->cap - 1, p->len + (size_t)k);
}

/* Close the list: how many were left out. -EINVAL when there was any. */
static int problems_end(struct problems *p)
{
    if (p->n > MAX_PROBLEMS && p->buf && p->len + 1 < p->cap)
        snprintf(p->buf + p->len, p->cap - p->len, "\n%s: and %d more problems", p->path,
                 p->n - MAX_PROBLEMS);
    return p->n ? -EINVAL : 0;
}

static const char *shape_text(int ndim, const uint64_t *shape, char *buf, size_t len)
{
    size_t at = (size_t)snprintf(buf, len, "(");
    for (int k = 0; k < ndim && at < len; k++)
        at += (size_t)snprintf(buf + at, len - at, "%s%llu", k ? ", " : "",
                               (unsigned long long)shape[k]);
    if (at < len) snprintf(buf + at, len - at, ndim == 1 ? ",)" : ")");
    return buf;
}

/* ---- reading ----------------------------------------------------------------------------- */

struct entry {
    const char *name; /* the header's, alive as long as it */
    int file;         /* the shard that holds it: index into weights_file.files */
    int dtype;        /* index into dtypes[] */
    int ndim;
    uint64_t shape[MAX_DIMS];
    uint64_t begin, end; /* of the data */
    bool used;
};

/* One safetensors file: the whole model, or one shard of a Hugging Face folder's. */
struct shard {
    char *path;
    int fd;
    json_t *header;
    uint64_t data_start; /* 8 + the header's length */
};

struct weights_file {
    char *path;  /* as given: a file, or a folder */
    struct shard *files;
    int nfiles;
    json_t *index; /* name -> entry, for find() */
    int n;
    struct entry *e;
    json_t *config;    /* the config.json that goes with it, or NULL */
    char *config_path; /* where that is */
    char notes[512];   /* what the run leaves out of what the files say: weights_file_notes() */
    enum weights_names names;
    int ntensors;
    struct gpt_tensor_desc *desc;
    int *at; /* layout index -> entry */
    void *raw;
    float *tmp;
    size_t cap; /* elements of raw (4 bytes each) and tmp */
};

static int pread_full(int fd, void *buf, size_t n, uint64_t off)
{
    unsigned char *p = buf;
    while (n) {
        ssize_t k = pread(fd, p, n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return -errno;
        if (k == 0) return -EIO;
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return 0;
}

static int entry_cmp(const void *a, const void *b)
{
    const struct entry *x = *(const struct entry *const *)a, *y = *(const struct entry *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : 0;
}

static struct entry *find(struct weights_file *w, const char *name)
{
    json_t *i = json_object_get(w->index, name);
    return i ? &w->e[json_integer_value(i)] : NULL;
}

/* One header entry, checked: e filled, or a problem said (and e->dtype -1). */
static void parse_entry(struct problems *p, const char *key, json_t *v, struct entry *e)
{
    json_t *dt = json_object_get(v, "dtype"), *sh = json_object_get(v, "shape"),
           *of = json_object_get(v, "data_offsets");
    e->name = key;
    e->dtype = -1;
    if (!json_is_object(v) || !json_is_string(dt) || !json_is_array(sh) || !json_is_array(of) ||
        json_array_size(of) != 2) {
        say(p, "bad header: tensor '%s' lacks a dtype, a shape or data_offsets [begin, end]", key);
        return;
    }
    for (size_t k = 0; k < ARRAY_SIZE(dtypes); k++)
        if (!strcmp(json_string_value(dt), dtypes[k].name)) e->dtype = (int)k;
    if (e->dtype < 0) {
        say(p, "bad header: tensor '%s': unknown dtype '%s'", key, json_string_value(dt));
        return;
    }
    if (json_array_size(sh) > MAX_DIMS) {
        say(p, "bad header: tensor '%s' has %zu dimensions (a GPT's have 1 or 2)", key,
            json_array_size(sh));
        return;
    }
    e->ndim = (int)json_array_size(sh);
    uint64_t numel = 1;
    for (int k = 0; k < e->ndim; k++) {
        json_t *d = json_array_get(sh, (size_t)k);
        if (!json_is_integer(d) || json_integer_value(d) < 0 ||
            (uint64_t)json_integer_value(d) > (1ull << 40)) {
            say(p, "bad header: tensor '%s': its shape is not a list of sizes", key);
            e->dtype = -1;
            return;
        }
        e->shape[k] = (uint64_t)json_integer_value(d);
        numel = e->shape[k] && numel > (1ull << 44) / e->shape[k] ? (1ull << 44) : numel * e->shape[k];
    }
    json_t *b = json_array_get(of, 0), *n = json_array_get(of, 1);
    if (!json_is_integer(b) || !json_is_integer(n) || json_integer_value(b) < 0 ||
        json_integer_value(n) < json_integer_value(b)) {
        say(p, "bad header: tensor '%s': data_offsets is not [begin, end] with begin <= end", key);
        e->dtype = -1;
        return;
    }
    e->begin = (uint64_t)json_integer_value(b);
    e->end = (uint64_t)json_integer_value(n);
    if (e->end - e->begin != numel * dtypes[e->dtype].bytes) {
        char s0[96];
        say(p,
            "bad header: tensor '%s': data_offsets [%llu, %llu) span %llu bytes, but %s %s "
            "takes %llu",
            key, (unsigned long long)e->begin, (unsigned long long)e->end,
            (unsigned long long)(e->end - e->begin), dtypes[e->dtype].name,
            shape_text(e->ndim, e->shape, s0, sizeof(s0)),
            (unsigned long long)(numel * dtypes[e->dtype].bytes));
        e->dtype = -1;
    }
}

/* What a file that is not a regular one is, for the message that refuses it. */
static const char *kind_of(mode_t m)
{
    return S_ISDIR(m)    ? "a folder"
           : S_ISFIFO(m) ? "a FIFO"
           : S_ISSOCK(m) ? "a socket"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
                         : "not a regular file";
}

/* name, relative to the folder dfd (AT_FDCWD: as it is), opened for reading without waiting
 * for a writer (a FIFO would block an open without O_NONBLOCK for good), and its type:
 * the fd, or -errno. Links are followed: Hugging Face's cache keeps a model's files as
 * links to its blobs. */
static int open_file(int dfd, const char *name, struct stat *st)
{
    int fd = openat(dfd, name, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) return -errno;
    if (fstat(fd, st) < 0) {
        int r = -errno;
        close(fd);
        return r;
    }
    return fd;
}

/* Shard k's header and the data's extent: its entries appended to w->e, everything but the
 * names checked. */
static int read_header(struct weights_file *w, int k, struct problems *p, char *err,
                       size_t errlen)
{
    struct shard *f = &w->files[k];
    struct stat st;
    if (fstat(f->fd, &st) < 0) {
        snprintf(err, errlen, "%s: %s", f->path, strerror(errno));
        return -errno;
    }
    if (!S_ISREG(st.st_mode)) {
        say(p, "%s, not a safetensors file", kind_of(st.st_mode));
        return problems_end(p);
    }
    uint64_t size = (uint64_t)st.st_size;
    unsigned char len8[8];
    int r = pread_full(f->fd, len8, (size_t)MIN(size, 8), 0);
    if (r < 0) {
        snprintf(err, errlen, "%s: %s", f->path, strerror(-r));
        return r;
    }
    /* torch.save's files: a zip archive of pickles (since PyTorch 1.6), or a pickle (its
     * protocol 2 to 5 opens with 0x80 and the protocol's number). */
    bool zip = size >= 4 && !memcmp(len8, "PK\x03\x04", 4);
    if (zip || (size >= 2 && len8[0] == 0x80 && len8[1] >= 2 && len8[1] <= 5)) {
        say(p,
            "a PyTorch %s (as torch.save writes, pytorch_model.bin), not a safetensors file: "
            "convert it in Python, with transformers: "
            "GPT2LMHeadModel.from_pretrained(DIR).save_pretrained(OUT, safe_serialization=True) "
            "writes OUT/model.safetensors; or with safetensors: "
            "safetensors.torch.save_file(torch.load(FILE), \"model.safetensors\")",
            zip ? "zip archive of pickles" : "pickle");
        return problems_end(p);
    }
    if (size < 8) {
        say(p, "not a safetensors file: %llu bytes, fewer than the 8 of the header's length",
            (unsigned long long)size);
        return problems_end(p);
    }
    uint64_t hlen = 0;
    for (int b = 7; b >= 0; b--)
        hlen = hlen << 8 | len8[b];
    if (hlen > size - 8 || hlen > MAX_HEADER_BYTES || hlen < 2) {
        say(p,
            "not a safetensors file, or a truncated one: its first 8 bytes give a header of "
            "%llu bytes, and %llu follow them",
            (unsigned long long)hlen, (unsigned long long)(size - 8));
        return problems_end(p);
    }
    char *text = malloc(hlen);
    if (!text) {
        snprintf(err, errlen, "%s: a header of %llu bytes: out of memory", f->path,
                 (unsigned long long)hlen);
        return -ENOMEM;
    }
    if ((r = pread_full(f->fd, text, hlen, 8)) < 0) {
        free(text);
        snprintf(err, errlen, "%s: %s", f->path, strerror(-r));
        return r;
    }
    json_error_t je;
    bool brace = text[0] == '{';
    f->header = brace ? json_loadb(text, hlen, JSON_REJECT_DUPLICATES, &je) : NULL;
    free(text);
    if (!json_is_object(f->header)) {
        say(p, "not a safetensors file: its header is not a JSON object (%s)",
            !brace ? "it does not start with '{'" : f->header ? "another JSON value" : je.text);
        return problems_end(p);
    }
    f->data_start = 8 + hlen;
    size_t cap = json_object_size(f->header);
    struct entry *grown = realloc(w->e, ((size_t)w->n + cap + 1) * sizeof(*w->e));
    if (grown) w->e = grown;
    if (!w->index) w->index = json_object();
    struct entry **by = calloc(cap ? cap : 1, sizeof(*by));
    if (!grown || !w->index || !by) {
        free(by);
        snprintf(err, errlen, "%s: out of memory", f->path);
        return -ENOMEM;
    }
    int first = w->n;
    const char *key;
    json_t *v;
    json_object_foreach(f->header, key, v) {
        if (!strcmp(key, "__metadata__")) {
            const char *mk;
            json_t *mv;
            bool ok = json_is_object(v);
            json_object_foreach(v, mk, mv) ok = ok && json_is_string(mv);
            if (!ok) say(p, "bad header: __metadata__ is not an object of strings");
            continue;
        }
        json_t *had = json_object_get(w->index, key);
        if (had) {
            say(p, "tensor '%s' is in %s too", key,
                w->files[w->e[json_integer_value(had)].file].path);
            continue;
        }
        json_object_set_new(w->index, key, json_integer(w->n));
        w->e[w->n] = (struct entry){.file = k};
        parse_entry(p, key, v, &w->e[w->n++]);
    }
    if (p->n) {
        free(by);
        return problems_end(p);
    }
    /* The ranges cover the data exactly, in some order, without a gap or an overlap. */
    int n = w->n - first;
    for (int i = 0; i < n; i++)
        by[i] = &w->e[first + i];
    qsort(by, (size_t)n, sizeof(*by), entry_cmp);
    uint64_t at = 0;
    for (int i = 0; i < n && !p->n; i++) {
        if (by[i]->begin != at)
            say(p, "bad header: tensor '%s' starts at byte %llu of the data, %s at %llu",
                by[i]->name, (unsigned long long)by[i]->begin,
                by[i]->begin > at ? "leaving a gap: the tensors before it end"
                                  : "inside the tensor before it, which ends",
                (unsigned long long)at);
        at = by[i]->end;
    }
    free(by);
    if (p->n) return problems_end(p);
    uint64_t have = size - f->data_start;
    if (have < at)
        say(p, "truncated: the header gives %llu bytes of tensor data, the file holds %llu",
            (unsigned long long)at, (unsigned long long)have);
    else if (have > at)
        say(p, "%llu bytes after the last tensor's data (the header gives %llu bytes, the file "
               "holds %llu)",
            (unsigned long long)(have - at), (unsigned long long)at, (unsigned long long)have);
    return problems_end(p);
}

/* A file of the model, open as fd, at path: added to w->files. 0 or -ENOMEM (fd closed). */
static int add_file(struct weights_file *w, const char *path, int fd)
{
    struct shard *grown = realloc(w->files, ((size_t)w->nfiles + 1) * sizeof(*grown));
    char *copy = strdup(path);
    if (!grown || !copy) {
        if (grown) w->files = grown;
        free(copy);
        close(fd);
        return -ENOMEM;
    }
    w->files = grown;
    w->files[w->nfiles++] = (struct shard){.path = copy, .fd = fd};
    return 0;
}

/* A JSON file of a Hugging Face folder (dfd), opened as open_file opens: its object, or NULL
 * with a problem said under its path (also kept in *path_out, len bytes); *absent where it
 * does not exist (nothing said). */
static json_t *load_json(int dfd, const char *dir, const char *name, struct problems *p,
                         char *path_out, size_t len, bool *absent)
{
    struct stat st;
    json_error_t je;
    const char *was = p->path;
    snprintf(path_out, len, "%s%s%s", dir, dir[0] && dir[strlen(dir) - 1] != '/' ? "/" : "",
             name);
    *absent = false;
    int fd = open_file(dfd, name, &st);
    if (fd == -ENOENT) {
        *absent = true;
        return NULL;
    }
    p->path = path_out;
    json_t *j = NULL;
    if (fd < 0)
        say(p, "%s", strerror(-fd));
    else if (!S_ISREG(st.st_mode))
        say(p, "%s, not a JSON file", kind_of(st.st_mode));
    else if (!(j = json_loadfd(fd, JSON_REJECT_DUPLICATES, &je)))
        say(p, "not JSON: line %d: %s", je.line, je.text);
    else if (!json_is_object(j)) {
        say(p, "not a JSON object");
        json_decref(j);
        j = NULL;
    }
    if (fd >= 0) close(fd);
    p->path = was;
    return j;
}

/* A Hugging Face folder (dfd, at dir): model.safetensors, or the shards that
 * model.safetensors.index.json's weight_map names, each read and checked, and the map held
 * to (every tensor in the shard it names, and no other). */
static int open_folder(struct weights_file *w, int dfd, struct problems *p, char *err,
                       size_t errlen)
{
    struct stat st;
    char path[4200];
    bool absent;
    int r, fd = open_file(dfd, "model.safetensors", &st);
    snprintf(path, sizeof(path), "%s%smodel.safetensors", w->path,
             w->path[strlen(w->path) - 1] != '/' ? "/" : "");
    if (fd >= 0 || fd != -ENOENT) {
        if (fd < 0) {
            snprintf(err, errlen, "%s: %s", path, strerror(-fd));
            return fd;
        }
        if ((r = add_file(w, path, fd)) < 0) {
            snprintf(err, errlen, "%s: out of memory", path);
            return r;
        }
        p->path = w->files[0].path;
        r = read_header(w, 0, p, err, errlen);
        p->path = w->path;
        return r;
    }
    json_t *ix = load_json(dfd, w->path, "model.safetensors.index.json", p, path, sizeof(path),
                           &absent);
    if (absent) {
        say(p, "a folder without model.safetensors or model.safetensors.index.json: --init "
               "reads a safetensors file, or a Hugging Face folder holding one (or its shards)");
        return problems_end(p);
    }
    json_t *map = json_object_get(ix, "weight_map");
    if (ix && !json_is_object(map)) {
        const char *was = p->path;
        p->path = path;
        say(p, "no \"weight_map\" object (tensor name -> shard file)");
        p->path = was;
    }
    if (p->n) {
        json_decref(ix);
        return problems_end(p);
    }
    /* Each shard once, in the order the map first names it: a plain name in this folder. */
    const char *key;
    json_t *v;
    json_t *seen = json_object();
    r = seen ? 0 : -ENOMEM;
    json_object_foreach(map, key, v) {
        const char *shard = json_string_value(v);
        if (r < 0 || p->n) break;
        if (!shard || !shard[0] || strchr(shard, '/') || !strcmp(shard, "..") ||
            !strcmp(shard, ".")) {
            const char *was = p->path;
            p->path = path;
            say(p, "weight_map: tensor '%s': the shard is not a file name in this folder", key);
            p->path = was;
            break;
        }
        if (json_object_get(seen, shard)) continue;
        json_object_set_new(seen, shard, json_integer(w->nfiles));
        char sp[4200];
        snprintf(sp, sizeof(sp), "%s%s%s", w->path,
                 w->path[strlen(w->path) - 1] != '/' ? "/" : "", shard);
        fd = open_file(dfd, shard, &st);
        if (fd < 0) {
            snprintf(err, errlen, "%s: %s (named by %s)", sp, strerror(-fd), path);
            r = fd == -ENOENT ? -EINVAL : fd;
            break;
        }
        if ((r = add_file(w, sp, fd)) < 0) {
            snprintf(err, errlen, "%s: out of memory", sp);
            break;
        }
        p->path = w->files[w->nfiles - 1].path;
        r = read_header(w, w->nfiles - 1, p, err, errlen);
        p->path = w->path;
    }
    /* The map and the shards agree, both ways. */
    for (int i = 0; r == 0 && !p->n && i < w->n; i++) {
        const char *in = json_string_value(json_object_get(map, w->e[i].name));
        json_t *at = in ? json_object_get(seen, in) : NULL;
        if (!at || json_integer_value(at) != w->e[i].file)
            say(p, "tensor '%s' is in %s, but model.safetensors.index.json %s", w->e[i].name,
                w->files[w->e[i].file].path, in ? "puts it in another shard" : "does not list it");
    }
    json_object_foreach(map, key, v) {
        if (r < 0 || p->n) break;
        if (!json_object_get(w->index, key))
            say(p, "model.safetensors.index.json puts tensor '%s' in %s, which does not hold it",
                key, json_string_value(v));
    }
    json_decref(seen);
    json_decref(ix);
    if (r < 0) return r;
    return problems_end(p);
}

/* The names most of the entries follow. */
static enum weights_names guess_names(const struct weights_file *w)
{
    int votes[3] = {0};
    for (int i = 0; i < w->n; i++) {
        const char *k = w->e[i].name;
        size_t len = strlen(k);
        if (!strcmp(k, "lm_head.weight")) continue; /* either GPT-2 naming */
        if (!strncmp(k, "transformer.", 12))
            votes[WEIGHTS_HF]++;
        else if ((len > 7 && !strcmp(k + len - 7, ".weight")) ||
                 (len > 5 && !strcmp(k + len - 5, ".bias")))
            votes[WEIGHTS_HF_MODEL]++;
        else
            votes[WEIGHTS_ZINF]++;
    }
    enum weights_names best = WEIGHTS_ZINF;
    for (int k = 1; k < 3; k++)
        if (votes[k] > votes[best]) best = (enum weights_names)k;
    return best;
}

/* The heads the file's model has, where something says: its metadata (zinf writes "heads"),
 * else the config.json that goes with it (n_head). 0: unknown. */
static long file_heads(const struct weights_file *w, const char **from)
{
    json_t *meta = json_object_get(w->files[0].header, "__metadata__");
    const char *h = json_string_value(json_object_get(meta, "heads"));
    if (h) {
        *from = "its metadata";
        return strtol(h, NULL, 10);
    }
    json_t *nh = json_object_get(w->config, "n_head");
    *from = "its config.json";
    return json_is_integer(nh) ? (long)json_integer_value(nh) : 0;
}

/* GPT2Config's keys that change the function the model computes, in the config.json that
 * goes with the file, against what zinf's trainer computes: GELU's tanh approximation,
 * LayerNorm's epsilon 1e-5, attention scaled by 1/sqrt(head size) alone, a tied head, an MLP
 * 4 x wide, no cross-attention. A key left out is GPT2Config's default, which is zinf's. A
 * value the trainer cannot compute is refused, naming it; dropout, which zinf does not apply,
 * is noted (weights_file_notes). */
static void check_config(struct weights_file *w, struct problems *p)
{
    json_t *c = w->config, *v;
    const char *was = p->path;
    p->path = w->config_path;
    if ((v = json_object_get(c, "model_type")) && !(json_is_string(v) &&
                                                     !strcmp(json_string_value(v), "gpt2")))
        say(p, "model_type %s: zinf's model is GPT-2's (\"gpt2\")",
            json_is_string(v) ? json_string_value(v) : "(not a string)");
    static const char *const gelus[] = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"};
    if ((v = json_object_get(c, "activation_function"))) {
        bool ok = false;
        for (size_t k = 0; k < ARRAY_SIZE(gelus); k++)
            ok |= json_is_string(v) && !strcmp(json_string_value(v), gelus[k]);
        if (!ok)
            say(p, "activation_function \"%s\": zinf's MLP computes GELU's tanh approximation, "
                   "\"gelu_new\" (also named \"gelu_pytorch_tanh\" and \"gelu_fast\"), and no "
                   "other",
                json_is_string(v) ? json_string_value(v) : "(not a string)");
    }
    if ((v = json_object_get(c, "layer_norm_epsilon")) &&
        !(json_is_number(v) && (float)json_number_value(v) == OPS_LN_EPS))
        say(p, "layer_norm_epsilon %.9g: zinf's LayerNorm adds %g, and no other epsilon",
            json_is_number(v) ? json_number_value(v) : NAN, (double)OPS_LN_EPS);
    static const struct {
        const char *key;
        bool want;
        const char *why;
    } flags[] = {
        {"scale_attn_weights", true, "zinf's attention scales its scores by 1/sqrt(head size)"},
        {"scale_attn_by_inverse_layer_idx", false,
         "zinf's attention scales its scores by 1/sqrt(head size) alone, in every layer"},
        {"tie_word_embeddings", true, "zinf's head is tied to the embedding"},
        {"add_cross_attention", false, "zinf's blocks have no cross-attention"},
    };
    for (size_t k = 0; k < ARRAY_SIZE(flags); k++)
        if ((v = json_object_get(c, flags[k].key)) && !(json_is_boolean(v) &&
                                                        json_is_true(v) == flags[k].want))
            say(p, "%s %s: %s (only %s is taken)", flags[k].key,
                json_is_boolean(v) ? (json_is_true(v) ? "true" : "false") : "(not a boolean)",
                flags[k].why, flags[k].want ? "true" : "false");
    json_t *embd = json_object_get(c, "n_embd");
    if ((v = json_object_get(c, "n_inner")) && !json_is_null(v) &&
        !(json_is_integer(v) && json_is_integer(embd) &&
          json_integer_value(v) == 4 * json_integer_value(embd)))
        say(p, "n_inner %lld: zinf's MLP is 4 x n_embd wide (n_inner null or %lld)",
            json_is_integer(v) ? (long long)json_integer_value(v) : -1LL,
            json_is_integer(embd) ? 4 * (long long)json_integer_value(embd) : -1LL);
    p->path = was;
    /* Dropout changes training, not the function: the run goes on without it, and says so. */
    static const char *const drops[] = {"resid_pdrop", "embd_pdrop", "attn_pdrop"};
    size_t len = strlen(w->notes);
    for (size_t k = 0; k < ARRAY_SIZE(drops); k++)
        if ((v = json_object_get(c, drops[k])) && json_is_number(v) && json_number_value(v) != 0 &&
            len < sizeof(w->notes))
            len += (size_t)snprintf(w->notes + len, sizeof(w->notes) - len, "%s%s %g", len ? ", " : "",
                                    drops[k], json_number_value(v));
    if (len && len < sizeof(w->notes))
        snprintf(w->notes + len, sizeof(w->notes) - len,
                 " in %s: not applied, zinf trains without dropout", w->config_path);
}

/* The model's size as the file has it, against gc's: one problem when they differ. */
static void check_size(struct weights_file *w, const struct gpt_config *gc, struct problems *p)
{
    struct gpt_tensor_desc d0 = {.block = -1, .slot = GPT_WTE}, d1 = {.block = -1, .slot = GPT_WPE};
    char n0[96], n1[96];
    snprintf(d0.name, sizeof(d0.name), "wte");
    snprintf(d1.name, sizeof(d1.name), "wpe");
    weights_name(&d0, w->names, n0, sizeof(n0));
    weights_name(&d1, w->names, n1, sizeof(n1));
    const struct entry *wte = find(w, n0), *wpe = find(w, n1);
    long L = 0;
    const char *fmt = w->names == WEIGHTS_ZINF ? "h%d.%n" : w->names == WEIGHTS_HF ? "transformer.h.%d.%n" : "h.%d.%n";
    for (int i = 0; i < w->n; i++) {
        int b = -1, used = 0;
        if (sscanf(w->e[i].name, fmt, &b, &used) == 1 && used > 0 && b >= 0 && b + 1 > L)
            L = b + 1;
    }
    if (!wte || !wpe || wte->ndim != 2 || wpe->ndim != 2) return; /* said tensor by tensor */
    long V = (long)wte->shape[0], C = (long)wte->shape[1], T = (long)wpe->shape[0];
    const char *from = NULL;
    long NH = file_heads(w, &from);
    bool differ = L != gc->L || C != gc->C || T != gc->maxT || V != gc->V ||
                  (NH > 0 && NH != gc->NH);
    if (!differ) return;
    char heads[96] = "";
    if (NH > 0) snprintf(heads, sizeof(heads), ", %ld heads (as %s says)", NH, from);
    say(p,
        "a model of %ld layer%s, dim %ld%s, seq %ld, vocabulary %ld; this run's is --layers %d "
        "--dim %d --heads %d --seq %d (vocabulary %d): give the options of the file's model",
        L, L == 1 ? "" : "s", C, heads, T, V, gc->L, gc->C, gc->NH, gc->maxT, gc->V);
}

/* Tensor e's values as fp32 (numel of them) into dst, read through w->raw. */
static int read_entry(struct weights_file *w, const struct entry *e, float *dst, size_t numel)
{
    size_t bytes = (size_t)(e->end - e->begin);
    const struct shard *f = &w->files[e->file];
    int r = pread_full(f->fd, w->raw, bytes, f->data_start + e->begin);
    if (r < 0) return r;
    if (e->dtype == DT_F32)
        memcpy(dst, w->raw, numel * sizeof(float));
    else if (e->dtype == DT_BF16)
        ops_cast_bf16_to_f32(dst, w->raw, numel);
    else
        ops_cast_f16_to_f32(dst, w->raw, numel);
    return 0;
}

/* Buffers for a tensor of numel elements. */
static int reserve(struct weights_file *w, size_t numel)
{
    if (numel <= w->cap) return 0;
    free(w->raw);
    free(w->tmp);
    w->raw = malloc(numel * sizeof(float));
    w->tmp = malloc(numel * sizeof(float));
    w->cap = w->raw && w->tmp ? numel : 0;
    return w->cap ? 0 : -ENOMEM;
}

/* lm_head.weight, under GPT-2's names: allowed when it is the embedding (the head is tied).
 * 0 with a problem said where it is not; -errno with err written where it cannot be read. */
static int check_head(struct weights_file *w, struct entry *head, const struct entry *wte,
                      struct problems *p, char *err, size_t errlen)
{
    head->used = true;
    char s0[64], s1[64];
    if (!wte) return 0; /* the embedding's absence is said already */
    if (head->ndim != 2 || head->shape[0] != wte->shape[0] || head->shape[1] != wte->shape[1] ||
        head->dtype > DT_F16) {
        say(p, "tensor 'lm_head.weight' (%s %s): zinf's head is tied to the embedding, which is "
               "%s %s",
            dtypes[head->dtype].name, shape_text(head->ndim, head->shape, s0, sizeof(s0)),
            dtypes[wte->dtype].name, shape_text(wte->ndim, wte->shape, s1, sizeof(s1)));
        return 0;
    }
    size_t numel = (size_t)(wte->shape[0] * wte->shape[1]);
    float *a = malloc(numel * sizeof(float)), *b = malloc(numel * sizeof(float));
    int r = !a || !b ? -ENOMEM : reserve(w, numel);
    if (r == 0) r = read_entry(w, head, a, numel);
    if (r == 0) r = read_entry(w, wte, b, numel);
    if (r < 0)
        snprintf(err, errlen, "%s: reading lm_head.weight: %s", p->path, strerror(-r));
    else if (memcmp(a, b, numel * sizeof(float)) != 0)
        say(p, "tensor 'lm_head.weight' differs from '%s': zinf's head is tied to the embedding, "
               "so an untied head cannot be loaded",
            wte->name);
    free(a);
    free(b);
    return r;
}

int weights_open(const char *path, const struct gpt_config *gc, struct weights_file **out,
                 char *err, size_t errlen)
{
    if (err && errlen) err[0] = '\0';
    if (!path || !gc || !out || !err || !errlen) return -EINVAL;
    *out = NULL;
    struct weights_file *w = calloc(1, sizeof(*w));
    struct problems p = {.path = path, .buf = err, .cap = errlen};
    struct stat st;
    int r, dfd = -1;
    if (!w || !path[0] || !(w->path = strdup(path))) {
        free(w);
        snprintf(err, errlen, "%s: %s", path, path[0] ? "out of memory" : strerror(ENOENT));
        return path[0] ? -ENOMEM : -ENOENT;
    }
    /* A file, or a Hugging Face folder; anything else (a FIFO, a device) is refused without
     * waiting on it. */
    int fd = open_file(AT_FDCWD, path, &st);
    if (fd < 0) {
        r = fd;
        snprintf(err, errlen, "%s: %s", path, strerror(-fd));
        goto fail;
    }
    if (S_ISDIR(st.st_mode)) {
        dfd = fd;
        r = open_folder(w, dfd, &p, err, errlen);
    } else if (!S_ISREG(st.st_mode)) {
        close(fd);
        say(&p, "%s: --init reads a safetensors file, or a Hugging Face folder holding "
                "model.safetensors (or its shards) and config.json",
            kind_of(st.st_mode));
        r = problems_end(&p);
    } else if ((r = add_file(w, path, fd)) < 0) {
        snprintf(err, errlen, "%s: out of memory", path);
    } else {
        r = read_header(w, 0, &p, err, errlen);
    }
    if (r < 0) goto fail;
    if (w->n == 0) {
        say(&p, "holds no tensors");
        r = problems_end(&p);
        goto fail;
    }
    w->names = guess_names(w);
    /* The config.json that says what GPT-2 model the weights are of: the folder's, or the one
     * beside a file under GPT-2's names (zinf's names have their metadata). */
    if (dfd >= 0 || w->names != WEIGHTS_ZINF) {
        char cp[4200], beside[4200];
        bool absent;
        const char *slash = strrchr(path, '/');
        snprintf(beside, sizeof(beside), "%.*sconfig.json", slash ? (int)(slash - path + 1) : 0,
                 path);
        w->config = dfd >= 0 ? load_json(dfd, path, "config.json", &p, cp, sizeof(cp), &absent)
                             : load_json(AT_FDCWD, "", beside, &p, cp, sizeof(cp), &absent);
        if (!(w->config_path = strdup(cp))) {
            r = -ENOMEM;
            snprintf(err, errlen, "%s: out of memory", path);
            goto fail;
        }
        if (p.n) {
            r = problems_end(&p);
            goto fail;
        }
        if (w->config) check_config(w, &p);
        if (p.n) {
            r = problems_end(&p);
            goto fail;
        }
    }
    if ((r = gpt_layout(gc, NULL, 0)) < 0) {
        snprintf(err, errlen, "%s: the run's model is not valid", path);
        goto fail;
    }
    w->ntensors = r;
    w->desc = calloc((size_t)w->ntensors, sizeof(*w->desc));
    w->at = calloc((size_t)w->ntensors, sizeof(*w->at));
    if (!w->desc || !w->at) {
        r = -ENOMEM;
        snprintf(err, errlen, "%s: out of memory", path);
        goto fail;
    }
    gpt_layout(gc, w->desc, (size_t)w->ntensors);
    check_size(w, gc, &p);
    if (p.n) {
        r = problems_end(&p);
        goto fail;
    }
    size_t most = 0;
    for (int i = 0; i < w->ntensors; i++) {
        const struct gpt_tensor_desc *d = &w->desc[i];
        char name[96], s0[64], s1[64];
        uint64_t want[2];
        int nd = file_shape(d, w->names, want);
        weights_name(d, w->names, name, sizeof(name));
        struct entry *e = find(w, name);
        w->at[i] = e ? (int)(e - w->e) : -1;
        most = MAX(most, d->numel);
        if (!e) {
            say(&p, "tensor '%s' is missing (expected F32 %s)", name,
                shape_text(nd, want, s0, sizeof(s0)));
            continue;
        }
        e->used = true;
        if (e->dtype > DT_F16)
            say(&p, "tensor '%s': dtype %s; --init reads F32 (and BF16, F16, converted)", name,
                dtypes[e->dtype].name);
        if (e->ndim != nd || e->shape[0] != want[0] || (nd == 2 && e->shape[1] != want[1]))
            say(&p, "tensor '%s': shape %s, expected %s", name,
                shape_text(e->ndim, e->shape, s0, sizeof(s0)), shape_text(nd, want, s1, sizeof(s1)));
    }
    struct entry *head = w->names != WEIGHTS_ZINF ? find(w, "lm_head.weight") : NULL;
    if (head && !p.n) {
        const struct entry *wte = w->at[0] >= 0 ? &w->e[w->at[0]] : NULL;
        if ((r = check_head(w, head, wte, &p, err, errlen)) < 0) goto fail;
    } else if (head) {
        head->used = true; /* the problems above say enough */
    }
    for (int i = 0; i < w->n; i++) {
        char s0[64];
        if (!w->e[i].used)
            say(&p, "unexpected tensor '%s' (%s %s): not one of this model's (%d layer%s, %s)",
                w->e[i].name, dtypes[w->e[i].dtype].name,
                shape_text(w->e[i].ndim, w->e[i].shape, s0, sizeof(s0)), gc->L,
                gc->L == 1 ? "" : "s", names_said(w->names));
    }
    if ((r = problems_end(&p)) < 0) goto fail;
    if ((r = reserve(w, most)) < 0) {
        snprintf(err, errlen, "%s: out of memory", path);
        goto fail;
    }
    if (dfd >= 0) close(dfd);
    *out = w;
    return 0;
fail:
    if (dfd >= 0) close(dfd);
    weights_close(w);
    return r;
}

enum weights_names weights_file_names(const struct weights_file *w)
{
    return w->names;
}

const char *weights_file_notes(const struct weights_file *w)
{
    return w->notes;
}

int weights_read(struct weights_file *w, int idx, float *dst, char *err, size_t errlen)
{
    if (!w || idx < 0 || idx >= w->ntensors || !dst) return -EINVAL;
    const struct gpt_tensor_desc *d = &w->desc[idx];
    const struct entry *e = &w->e[w->at[idx]];
    bool tr = weights_transposed(d, w->names);
    int r = read_entry(w, e, tr ? w->tmp : dst, d->numel);
    if (r < 0) {
        snprintf(err, errlen, "%s: reading tensor '%s': %s", w->files[e->file].path, e->name,
                 r == -EIO ? "the file is shorter than when it was checked" : strerror(-r));
        return r;
    }
    if (tr) {
        /* The file's (cols, rows) back to zinf's (rows, cols). */
        size_t rows = d->shape[0], cols = d->shape[1];
        for (size_t c = 0; c < cols; c++)
            for (size_t k = 0; k < rows; k++)
                dst[k * cols + c] = w->tmp[c * rows + k];
    }
    return 0;
}

void weights_close(struct weights_file *w)
{
    if (!w) return;
    for (int k = 0; k < w->nfiles; k++) {
        close(w->files[k].fd);
        json_decref(w->files[k].header);
        free(w->files[k].path);
    }
    free(w->files);
    json_decref(w->config);
    free(w->config_path);
    json_decref(w->index);
    free(w->e);
    free(w->desc);
    free(w->at);
    free(w->raw);
    free(w->tmp);
    free(w->path);
    free(w);
}

/* ---- writing ----------------------------------------------------------------------------- */

/* fsync the directory that holds path, so that a rename in it is durable. */
static int sync_dir_of(const char *path)
{
    char dir[4200];
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, sizeof(dir), ".");
    else
        snprintf(dir, sizeof(dir), "%.*s", slash == path ? 1 : (int)(slash - path), path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -errno;
    int r = fsync(fd) < 0 && errno != EINVAL ? -errno : 0;
    close(fd);
    return r;
}

/* text (len bytes) to path, through path.tmp: written, synced, renamed. */
static int write_atomic(const char *path, const void *text, size_t len, char *err, size_t errlen)
{
    char tmp[4200];
    if ((size_t)snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= sizeof(tmp)) {
        snprintf(err, errlen, "%s: %s", path, strerror(ENAMETOOLONG));
        return -ENAMETOOLONG;
    }
    int r = 0, fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) r = -errno;
    for (size_t at = 0; r == 0 && at < len;) {
        ssize_t k = write(fd, (const char *)text + at, len - at);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) r = -errno;
        else at += (size_t)k;
    }
    if (r == 0 && fsync(fd) < 0) r = -errno;
    if (fd >= 0 && close(fd) < 0 && r == 0) r = -errno;
    if (r == 0 && rename(tmp, path) < 0) r = -errno;
    if (r == 0) r = sync_dir_of(path);
    if (r < 0) {
        if (fd >= 0) unlink(tmp);
        snprintf(err, errlen, "%s: %s", path, strerror(-r));
    }
    return r;
}

int weights_write(const char *path, const struct gpt_config *gc, int step,
                  enum weights_names names, weights_source get, void *ctx, char *err,
                  size_t errlen)
{
    if (err && errlen) err[0] = '\0';
    if (!path || !gc || !get || !err || !errlen) return -EINVAL;
    int n = gpt_layout(gc, NULL, 0), r = 0;
    if (n < 0) {
        snprintf(err, errlen, "%s: the model is not valid", path);
        return n;
    }
    struct gpt_tensor_desc *d = calloc((size_t)n, sizeof(*d));
    json_t *root = json_object(), *meta = json_object();
    char tmp[4200] = "", *hdr = NULL, v[32], name[96];
    float *buf = NULL, *out = NULL;
    FILE *f = NULL;
    if (!d || !root || !meta || gpt_layout(gc, d, (size_t)n) != n) {
        r = -ENOMEM;
        goto out;
    }
    size_t off = 0, most = 0;
    for (int i = 0; i < n; i++) {
        uint64_t shape[2];
        int nd = file_shape(&d[i], names, shape);
        json_t *e = json_pack("{s:s, s:[I, I], s:[I, I]}", "dtype", "F32", "shape",
                              (json_int_t)shape[0], (json_int_t)shape[1], "data_offsets",
                              (json_int_t)off, (json_int_t)(off + d[i].numel * sizeof(float)));
        if (e && nd == 1) json_array_remove(json_object_get(e, "shape"), 1);
        weights_name(&d[i], names, name, sizeof(name));
        if (!e || json_object_set_new(root, name, e) < 0) {
            r = -ENOMEM;
            goto out;
        }
        off += d[i].numel * sizeof(float);
        most = MAX(most, d[i].numel);
    }
    /* transformers' loader asks for "format" "pt"; the rest say what the model is. */
    const struct {
        const char *k;
        long long v;
    } m[] = {{"layers", gc->L}, {"dim", gc->C}, {"heads", gc->NH}, {"vocab", gc->V},
             {"seq", gc->maxT}, {"step", step}};
    if (names != WEIGHTS_ZINF) json_object_set_new(meta, "format", json_string("pt"));
    json_object_set_new(meta, "model", json_string("zinf-gpt"));
    for (size_t k = 0; k < ARRAY_SIZE(m); k++) {
        snprintf(v, sizeof(v), "%lld", m[k].v);
        json_object_set_new(meta, m[k].k, json_string(v));
    }
    json_object_set(root, "__metadata__", meta);
    hdr = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    buf = malloc(most * sizeof(float));
    out = names != WEIGHTS_ZINF ? malloc(most * sizeof(float)) : buf;
    if (!hdr || !buf || !out) {
        r = -ENOMEM;
        goto out;
    }
    /* The data starts 8-byte aligned: the header is padded with spaces. */
    size_t hlen = strlen(hdr), padded = align_up(hlen, 8);
    unsigned char len8[8];
    for (int k = 0; k < 8; k++)
        len8[k] = (unsigned char)((uint64_t)padded >> (8 * k));
    if ((size_t)snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= sizeof(tmp)) {
        tmp[0] = '\0';
        r = -ENAMETOOLONG;
        goto out;
    }
    errno = 0;
    if (!(f = fopen(tmp, "wbe")) || fwrite(len8, 1, 8, f) != 8 || fwrite(hdr, 1, hlen, f) != hlen ||
        fprintf(f, "%*s", (int)(padded - hlen), "") < 0) {
        r = errno ? -errno : -EIO;
        if (!f) tmp[0] = '\0';
        goto out;
    }
    for (int i = 0; i < n && r == 0; i++) {
        if ((r = get(ctx, i, buf)) < 0) {
            snprintf(err, errlen, "%s: reading %s of the run: %s", path, d[i].name,
                     zinf_strerror(r));
            goto out;
        }
        bool tr = weights_transposed(&d[i], names);
        if (tr) {
            /* zinf's (rows, cols) to Conv1D's (cols, rows). */
            size_t rows = d[i].shape[0], cols = d[i].shape[1];
            for (size_t k = 0; k < rows; k++)
                for (size_t c = 0; c < cols; c++)
                    out[c * rows + k] = buf[k * cols + c];
        }
        if (fwrite(tr ? out : buf, sizeof(float), d[i].numel, f) != d[i].numel)
            r = errno ? -errno : -EIO;
    }
    if (r == 0 && (fflush(f) != 0 || fsync(fileno(f)) != 0)) r = errno ? -errno : -EIO;
    if (fclose(f) != 0 && r == 0) r = errno ? -errno : -EIO;
    f = NULL;
    if (r == 0 && rename(tmp, path) != 0) r = -errno;
    if (r == 0) r = sync_dir_of(path);
out:
    if (f) fclose(f);
    if (r < 0) {
        if (tmp[0]) unlink(tmp);
        if (!err[0]) snprintf(err, errlen, "%s: %s", path, strerror(-r));
    }
    if (out != buf) free(out);
    free(buf);
    free(hdr);
    json_decref(meta);
    json_decref(root);
    free(d);
    return r;
}

int weights_write_hf(const char *dir, const struct gpt_config *gc, int step, weights_source get,
                     void *ctx, char *err, size_t errlen)
{
    if (err && errlen) err[0] = '\0';
    if (!dir || !gc || !get || !err || !errlen) return -EINVAL;
    char model[4200], config[4200];
    if ((size_t)snprintf(model, sizeof(model), "%s/model.safetensors", dir) >= sizeof(model) ||
        (size_t)snprintf(config, sizeof(config), "%s/config.json", dir) >= sizeof(config)) {
        snprintf(err, errlen, "%s: %s", dir, strerror(ENAMETOOLONG));
        return -ENAMETOOLONG;
    }
    struct stat st;
    int made = dirs_make(dir, 0777); /* durable: the export survives a power loss */
    if (made < 0 && made != -EEXIST) {
        snprintf(err, errlen, "%s: %s", dir, strerror(-made));
        return made;
    }
    int e = stat(dir, &st) < 0 ? errno : !S_ISDIR(st.st_mode) ? ENOTDIR : 0;
    if (e) {
        snprintf(err, errlen, "%s: %s", dir, strerror(e));
        return -e;
    }
    /* GPT2Config's keys that decide the function: each the value that is zinf's model.
     * n_ctx is the older name of n_positions; the token ids are left unset, bytes have none. */
    json_t *c = json_pack(
        "{s:[s], s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:s, s:f, s:f, s:f, s:f, s:f, s:b, s:b, "
        "s:b, s:b, s:b, s:n, s:n, s:s}",
        "architectures", "GPT2LMHeadModel", "model_type", "gpt2", "vocab_size", gc->V,
        "n_positions", gc->maxT, "n_ctx", gc->maxT, "n_embd", gc->C, "n_layer", gc->L, "n_head",
        gc->NH, "n_inner", 4 * gc->C, "activation_function", "gelu_new", "layer_norm_epsilon",
        1e-5, "resid_pdrop", 0.0, "embd_pdrop", 0.0, "attn_pdrop", 0.0, "initializer_range",
        0.02, "scale_attn_weights", 1, "scale_attn_by_inverse_layer_idx", 0,
        "reorder_and_upcast_attn", 0, "tie_word_embeddings", 1, "use_cache", 1, "bos_token_id",
        "eos_token_id", "dtype", "float32");
    char *text = c ? json_dumps(c, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(9))
                   : NULL;
    json_decref(c);
    if (!text) {
        snprintf(err, errlen, "%s: out of memory", config);
        return -ENOMEM;
    }
    size_t len = strlen(text);
    char *full = realloc(text, len + 2);
    if (!full) {
        free(text);
        snprintf(err, errlen, "%s: out of memory", config);
        return -ENOMEM;
    }
    full[len] = '\n';
    full[len + 1] = '\0';
    int r = weights_write(model, gc, step, WEIGHTS_HF, get, ctx, err, errlen);
    if (r == 0) r = write_atomic(config, full, len + 1, err, errlen);
    free(full);
    return r;
}

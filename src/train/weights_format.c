/*
 * weights_format.c - the safetensors format as zinf's weights use it (weights.h): each
 * tensor's name under zinf's names and GPT-2's, the dtypes, the list of problems a check
 * makes, and one file's header read and checked: its length, its JSON, every entry's dtype,
 * shape and byte range, the data the ranges cover exactly.
 *
 * The format: an 8-byte little-endian header length N, N bytes of JSON (an object: per
 * tensor its "dtype", "shape" and "data_offsets" [begin, end) into the data, and an optional
 * "__metadata__" of strings), then the data, which the ranges must cover exactly. GPT-2's
 * names and layout are transformers' GPT2LMHeadModel's: its Conv1D layers keep their weights
 * (in, out), the transpose of zinf's (out, in) (ops_linear_forward's W), so the blocks' four
 * matrices are transposed on the way in and out; every other tensor is the same.
 *
 * Not here: a Hugging Face folder, config.json and the checks against the model
 * (weights_load.c), the values read (weights_load.c) or written (weights_export.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "train/weights.h"
#include "train/weights_int.h"

#define MAX_HEADER_BYTES (100u * 1000 * 1000) /* safetensors' own limit on the header */
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
int weights_file_shape(const struct gpt_tensor_desc *d, enum weights_names names, uint64_t shape[2])
{
    bool tr = weights_transposed(d, names);
    shape[0] = d->shape[tr ? 1 : 0];
    shape[1] = d->shape[tr ? 0 : 1];
    return d->ndim;
}

const char *weights_names_said(enum weights_names names)
{
    return names == WEIGHTS_ZINF ? "zinf's names" : names == WEIGHTS_HF
                                                        ? "GPT-2's names (GPT2LMHeadModel)"
                                                        : "GPT-2's names (GPT2Model)";
}

/* ---- dtypes ------------------------------------------------------------------------------ */

const struct weights_dtype weights_dtypes[] = {
    {"F32", 4}, {"BF16", 2}, {"F16", 2},  {"F64", 8},     {"I64", 8},
    {"I32", 4}, {"I16", 2},  {"I8", 1},   {"U64", 8},     {"U32", 4},
    {"U16", 2}, {"U8", 1},   {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
};

/* ---- problems ---------------------------------------------------------------------------- */

void weights_say(struct problems *p, const char *fmt, ...)
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
int weights_problems_end(struct problems *p)
{
    if (p->n > MAX_PROBLEMS && p->buf && p->len + 1 < p->cap)
        snprintf(p->buf + p->len, p->cap - p->len, "\n%s: and %d more problems", p->path,
                 p->n - MAX_PROBLEMS);
    return p->n ? -EINVAL : 0;
}

const char *weights_shape_text(int ndim, const uint64_t *shape, char *buf, size_t len)
{
    size_t at = (size_t)snprintf(buf, len, "(");
    for (int k = 0; k < ndim && at < len; k++)
        at += (size_t)snprintf(buf + at, len - at, "%s%llu", k ? ", " : "",
                               (unsigned long long)shape[k]);
    if (at < len) snprintf(buf + at, len - at, ndim == 1 ? ",)" : ")");
    return buf;
}

/* ---- reading ----------------------------------------------------------------------------- */

int weights_pread_full(int fd, void *buf, size_t n, uint64_t off)
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

struct entry *weights_find(struct weights_file *w, const char *name)
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
        weights_say(
            p, "bad header: tensor '%s' lacks a dtype, a shape or data_offsets [begin, end]", key);
        return;
    }
    for (size_t k = 0; k < ARRAY_SIZE(weights_dtypes); k++)
        if (!strcmp(json_string_value(dt), weights_dtypes[k].name)) e->dtype = (int)k;
    if (e->dtype < 0) {
        weights_say(p, "bad header: tensor '%s': unknown dtype '%s'", key, json_string_value(dt));
        return;
    }
    if (json_array_size(sh) > MAX_DIMS) {
        weights_say(p, "bad header: tensor '%s' has %zu dimensions (a GPT's have 1 or 2)", key,
                    json_array_size(sh));
        return;
    }
    e->ndim = (int)json_array_size(sh);
    uint64_t numel = 1;
    for (int k = 0; k < e->ndim; k++) {
        json_t *d = json_array_get(sh, (size_t)k);
        if (!json_is_integer(d) || json_integer_value(d) < 0 ||
            (uint64_t)json_integer_value(d) > (1ull << 40)) {
            weights_say(p, "bad header: tensor '%s': its shape is not a list of sizes", key);
            e->dtype = -1;
            return;
        }
        e->shape[k] = (uint64_t)json_integer_value(d);
        numel =
            e->shape[k] && numel > (1ull << 44) / e->shape[k] ? (1ull << 44) : numel * e->shape[k];
    }
    json_t *b = json_array_get(of, 0), *n = json_array_get(of, 1);
    if (!json_is_integer(b) || !json_is_integer(n) || json_integer_value(b) < 0 ||
        json_integer_value(n) < json_integer_value(b)) {
        weights_say(
            p, "bad header: tensor '%s': data_offsets is not [begin, end] with begin <= end", key);
        e->dtype = -1;
        return;
    }
    e->begin = (uint64_t)json_integer_value(b);
    e->end = (uint64_t)json_integer_value(n);
    if (e->end - e->begin != numel * weights_dtypes[e->dtype].bytes) {
        char s0[96];
        weights_say(p,
                    "bad header: tensor '%s': data_offsets [%llu, %llu) span %llu bytes, but %s %s "
                    "takes %llu",
                    key, (unsigned long long)e->begin, (unsigned long long)e->end,
                    (unsigned long long)(e->end - e->begin), weights_dtypes[e->dtype].name,
                    weights_shape_text(e->ndim, e->shape, s0, sizeof(s0)),
                    (unsigned long long)(numel * weights_dtypes[e->dtype].bytes));
        e->dtype = -1;
    }
}

/* What a file that is not a regular one is, for the message that refuses it. */
const char *weights_kind_of(mode_t m)
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
int weights_open_file(int dfd, const char *name, struct stat *st)
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
int weights_read_header(struct weights_file *w, int k, struct problems *p, char *err, size_t errlen)
{
    struct shard *f = &w->files[k];
    struct stat st;
    if (fstat(f->fd, &st) < 0) {
        snprintf(err, errlen, "%s: %s", f->path, strerror(errno));
        return -errno;
    }
    if (!S_ISREG(st.st_mode)) {
        weights_say(p, "%s, not a safetensors file", weights_kind_of(st.st_mode));
        return weights_problems_end(p);
    }
    uint64_t size = (uint64_t)st.st_size;
    unsigned char len8[8];
    int r = weights_pread_full(f->fd, len8, (size_t)MIN(size, 8), 0);
    if (r < 0) {
        snprintf(err, errlen, "%s: %s", f->path, strerror(-r));
        return r;
    }
    /* torch.save's files: a zip archive of pickles (since PyTorch 1.6), or a pickle (its
     * protocol 2 to 5 opens with 0x80 and the protocol's number). */
    bool zip = size >= 4 && !memcmp(len8, "PK\x03\x04", 4);
    if (zip || (size >= 2 && len8[0] == 0x80 && len8[1] >= 2 && len8[1] <= 5)) {
        weights_say(
            p,
            "a PyTorch %s (as torch.save writes, pytorch_model.bin), not a safetensors file: "
            "convert it in Python, with transformers: "
            "GPT2LMHeadModel.from_pretrained(DIR).save_pretrained(OUT, safe_serialization=True) "
            "writes OUT/model.safetensors; or with safetensors: "
            "safetensors.torch.save_file(torch.load(FILE), \"model.safetensors\")",
            zip ? "zip archive of pickles" : "pickle");
        return weights_problems_end(p);
    }
    if (size < 8) {
        weights_say(p,
                    "not a safetensors file: %llu bytes, fewer than the 8 of the header's length",
                    (unsigned long long)size);
        return weights_problems_end(p);
    }
    uint64_t hlen = 0;
    for (int b = 7; b >= 0; b--)
        hlen = hlen << 8 | len8[b];
    if (hlen > size - 8 || hlen > MAX_HEADER_BYTES || hlen < 2) {
        weights_say(
            p,
            "not a safetensors file, or a truncated one: its first 8 bytes give a header of "
            "%llu bytes, and %llu follow them",
            (unsigned long long)hlen, (unsigned long long)(size - 8));
        return weights_problems_end(p);
    }
    char *text = malloc(hlen);
    if (!text) {
        snprintf(err, errlen, "%s: a header of %llu bytes: out of memory", f->path,
                 (unsigned long long)hlen);
        return -ENOMEM;
    }
    if ((r = weights_pread_full(f->fd, text, hlen, 8)) < 0) {
        free(text);
        snprintf(err, errlen, "%s: %s", f->path, strerror(-r));
        return r;
    }
    json_error_t je;
    bool brace = text[0] == '{';
    f->header = brace ? json_loadb(text, hlen, JSON_REJECT_DUPLICATES, &je) : NULL;
    free(text);
    if (!json_is_object(f->header)) {
        weights_say(p, "not a safetensors file: its header is not a JSON object (%s)",
                    !brace      ? "it does not start with '{'"
                    : f->header ? "another JSON value"
                                : je.text);
        return weights_problems_end(p);
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
            if (!ok) weights_say(p, "bad header: __metadata__ is not an object of strings");
            continue;
        }
        json_t *had = json_object_get(w->index, key);
        if (had) {
            weights_say(p, "tensor '%s' is in %s too", key,
                        w->files[w->e[json_integer_value(had)].file].path);
            continue;
        }
        json_object_set_new(w->index, key, json_integer(w->n));
        w->e[w->n] = (struct entry){.file = k};
        parse_entry(p, key, v, &w->e[w->n++]);
    }
    if (p->n) {
        free(by);
        return weights_problems_end(p);
    }
    /* The ranges cover the data exactly, in some order, without a gap or an overlap. */
    int n = w->n - first;
    for (int i = 0; i < n; i++)
        by[i] = &w->e[first + i];
    qsort(by, (size_t)n, sizeof(*by), entry_cmp);
    uint64_t at = 0;
    for (int i = 0; i < n && !p->n; i++) {
        if (by[i]->begin != at)
            weights_say(p, "bad header: tensor '%s' starts at byte %llu of the data, %s at %llu",
                        by[i]->name, (unsigned long long)by[i]->begin,
                        by[i]->begin > at ? "leaving a gap: the tensors before it end"
                                          : "inside the tensor before it, which ends",
                        (unsigned long long)at);
        at = by[i]->end;
    }
    free(by);
    if (p->n) return weights_problems_end(p);
    uint64_t have = size - f->data_start;
    if (have < at)
        weights_say(p, "truncated: the header gives %llu bytes of tensor data, the file holds %llu",
                    (unsigned long long)at, (unsigned long long)have);
    else if (have > at)
        weights_say(
            p,
            "%llu bytes after the last tensor's data (the header gives %llu bytes, the file "
            "holds %llu)",
            (unsigned long long)(have - at), (unsigned long long)at, (unsigned long long)have);
    return weights_problems_end(p);
}

/* A file of the model, open as fd, at path: added to w->files. 0 or -ENOMEM (fd closed). */
int weights_add_file(struct weights_file *w, const char *path, int fd)
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


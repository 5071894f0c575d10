/*
 * weights_load.c - zinf's GPT model's weights read from safetensors files (weights.h): a
 * file, or a Hugging Face folder (model.safetensors, or the shards its index maps the
 * tensors to, and config.json), checked whole against the run's model before a value is
 * used (the names, config.json's keys that change the function, the model's size, each
 * tensor's dtype and shape, a tied lm_head), then each tensor read as fp32 in zinf's layout.
 *
 * Not here: the format of one file, the names and the list of problems (weights_format.c),
 * the writing (weights_export.c), the engine and the trainer (the caller hands the values
 * on).
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "train/ops.h"
#include "train/weights.h"
#include "train/weights_int.h"

/* A JSON file of a Hugging Face folder (dfd), opened as weights_open_file opens: its object,
 * or NULL with a problem said under its path (also kept in *path_out, len bytes); *absent
 * where it does not exist (nothing said). */
static json_t *load_json(int dfd, const char *dir, const char *name, struct problems *p,
                         char *path_out, size_t len, bool *absent)
{
    struct stat st;
    json_error_t je;
    const char *was = p->path;
    snprintf(path_out, len, "%s%s%s", dir, dir[0] && dir[strlen(dir) - 1] != '/' ? "/" : "",
             name);
    *absent = false;
    int fd = weights_open_file(dfd, name, &st);
    if (fd == -ENOENT) {
        *absent = true;
        return NULL;
    }
    p->path = path_out;
    json_t *j = NULL;
    if (fd < 0)
        weights_say(p, "%s", strerror(-fd));
    else if (!S_ISREG(st.st_mode))
        weights_say(p, "%s, not a JSON file", weights_kind_of(st.st_mode));
    else if (!(j = json_loadfd(fd, JSON_REJECT_DUPLICATES, &je)))
        weights_say(p, "not JSON: line %d: %s", je.line, je.text);
    else if (!json_is_object(j)) {
        weights_say(p, "not a JSON object");
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
    int r, fd = weights_open_file(dfd, "model.safetensors", &st);
    snprintf(path, sizeof(path), "%s%smodel.safetensors", w->path,
             w->path[strlen(w->path) - 1] != '/' ? "/" : "");
    if (fd >= 0 || fd != -ENOENT) {
        if (fd < 0) {
            snprintf(err, errlen, "%s: %s", path, strerror(-fd));
            return fd;
        }
        if ((r = weights_add_file(w, path, fd)) < 0) {
            snprintf(err, errlen, "%s: out of memory", path);
            return r;
        }
        p->path = w->files[0].path;
        r = weights_read_header(w, 0, p, err, errlen);
        p->path = w->path;
        return r;
    }
    json_t *ix = load_json(dfd, w->path, "model.safetensors.index.json", p, path, sizeof(path),
                           &absent);
    if (absent) {
        weights_say(
            p, "a folder without model.safetensors or model.safetensors.index.json: --init "
               "reads a safetensors file, or a Hugging Face folder holding one (or its shards)");
        return weights_problems_end(p);
    }
    json_t *map = json_object_get(ix, "weight_map");
    if (ix && !json_is_object(map)) {
        const char *was = p->path;
        p->path = path;
        weights_say(p, "no \"weight_map\" object (tensor name -> shard file)");
        p->path = was;
    }
    if (p->n) {
        json_decref(ix);
        return weights_problems_end(p);
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
            weights_say(p, "weight_map: tensor '%s': the shard is not a file name in this folder",
                        key);
            p->path = was;
            break;
        }
        if (json_object_get(seen, shard)) continue;
        json_object_set_new(seen, shard, json_integer(w->nfiles));
        char sp[4200];
        snprintf(sp, sizeof(sp), "%s%s%s", w->path,
                 w->path[strlen(w->path) - 1] != '/' ? "/" : "", shard);
        fd = weights_open_file(dfd, shard, &st);
        if (fd < 0) {
            snprintf(err, errlen, "%s: %s (named by %s)", sp, strerror(-fd), path);
            r = fd == -ENOENT ? -EINVAL : fd;
            break;
        }
        if ((r = weights_add_file(w, sp, fd)) < 0) {
            snprintf(err, errlen, "%s: out of memory", sp);
            break;
        }
        p->path = w->files[w->nfiles - 1].path;
        r = weights_read_header(w, w->nfiles - 1, p, err, errlen);
        p->path = w->path;
    }
    /* The map and the shards agree, both ways. */
    for (int i = 0; r == 0 && !p->n && i < w->n; i++) {
        const char *in = json_string_value(json_object_get(map, w->e[i].name));
        json_t *at = in ? json_object_get(seen, in) : NULL;
        if (!at || json_integer_value(at) != w->e[i].file)
            weights_say(p, "tensor '%s' is in %s, but model.safetensors.index.json %s",
                        w->e[i].name, w->files[w->e[i].file].path,
                        in ? "puts it in another shard" : "does not list it");
    }
    json_object_foreach(map, key, v) {
        if (r < 0 || p->n) break;
        if (!json_object_get(w->index, key))
            weights_say(
                p, "model.safetensors.index.json puts tensor '%s' in %s, which does not hold it",
                key, json_string_value(v));
    }
    json_decref(seen);
    json_decref(ix);
    if (r < 0) return r;
    return weights_problems_end(p);
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
        weights_say(p, "model_type %s: zinf's model is GPT-2's (\"gpt2\")",
                    json_is_string(v) ? json_string_value(v) : "(not a string)");
    static const char *const gelus[] = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"};
    if ((v = json_object_get(c, "activation_function"))) {
        bool ok = false;
        for (size_t k = 0; k < ARRAY_SIZE(gelus); k++)
            ok |= json_is_string(v) && !strcmp(json_string_value(v), gelus[k]);
        if (!ok)
            weights_say(
                p,
                "activation_function \"%s\": zinf's MLP computes GELU's tanh approximation, "
                "\"gelu_new\" (also named \"gelu_pytorch_tanh\" and \"gelu_fast\"), and no "
                "other",
                json_is_string(v) ? json_string_value(v) : "(not a string)");
    }
    if ((v = json_object_get(c, "layer_norm_epsilon")) &&
        !(json_is_number(v) && (float)json_number_value(v) == OPS_LN_EPS))
        weights_say(p, "layer_norm_epsilon %.9g: zinf's LayerNorm adds %g, and no other epsilon",
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
            weights_say(p, "%s %s: %s (only %s is taken)", flags[k].key,
                        json_is_boolean(v) ? (json_is_true(v) ? "true" : "false")
                                           : "(not a boolean)",
                        flags[k].why, flags[k].want ? "true" : "false");
    json_t *embd = json_object_get(c, "n_embd");
    if ((v = json_object_get(c, "n_inner")) && !json_is_null(v) &&
        !(json_is_integer(v) && json_is_integer(embd) &&
          json_integer_value(v) == 4 * json_integer_value(embd)))
        weights_say(p, "n_inner %lld: zinf's MLP is 4 x n_embd wide (n_inner null or %lld)",
                    json_is_integer(v) ? (long long)json_integer_value(v) : -1LL,
                    json_is_integer(embd) ? 4 * (long long)json_integer_value(embd) : -1LL);
    p->path = was;
    /* Dropout changes training, not the function: the run goes on without it, and says so. */
    static const char *const drops[] = {"resid_pdrop", "embd_pdrop", "attn_pdrop"};
    size_t len = strlen(w->notes);
    for (size_t k = 0; k < ARRAY_SIZE(drops); k++)
        if ((v = json_object_get(c, drops[k])) && json_is_number(v) && json_number_value(v) != 0 &&
            len < sizeof(w->notes))
            len += (size_t)snprintf(w->notes + len, sizeof(w->notes) - len, "%s%s %g",
                                    len ? ", " : "", drops[k], json_number_value(v));
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
    const struct entry *wte = weights_find(w, n0), *wpe = weights_find(w, n1);
    long L = 0;
    const char *fmt = w->names == WEIGHTS_ZINF ? "h%d.%n"
                      : w->names == WEIGHTS_HF ? "transformer.h.%d.%n"
                                               : "h.%d.%n";
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
    weights_say(
        p,
        "a model of %ld layer%s, dim %ld%s, seq %ld, vocabulary %ld; this run's is --layers %d "
        "--dim %d --heads %d --seq %d (vocabulary %d): give the options of the file's model",
        L, L == 1 ? "" : "s", C, heads, T, V, gc->L, gc->C, gc->NH, gc->maxT, gc->V);
}

/* Tensor e's values as fp32 (numel of them) into dst, read through w->raw. */
static int read_entry(struct weights_file *w, const struct entry *e, float *dst, size_t numel)
{
    size_t bytes = (size_t)(e->end - e->begin);
    const struct shard *f = &w->files[e->file];
    int r = weights_pread_full(f->fd, w->raw, bytes, f->data_start + e->begin);
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
        weights_say(
            p,
            "tensor 'lm_head.weight' (%s %s): zinf's head is tied to the embedding, which is "
            "%s %s",
            weights_dtypes[head->dtype].name,
            weights_shape_text(head->ndim, head->shape, s0, sizeof(s0)),
            weights_dtypes[wte->dtype].name,
            weights_shape_text(wte->ndim, wte->shape, s1, sizeof(s1)));
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
        weights_say(
            p,
            "tensor 'lm_head.weight' differs from '%s': zinf's head is tied to the embedding, "
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
    int fd = weights_open_file(AT_FDCWD, path, &st);
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
        weights_say(&p,
                    "%s: --init reads a safetensors file, or a Hugging Face folder holding "
                    "model.safetensors (or its shards) and config.json",
                    weights_kind_of(st.st_mode));
        r = weights_problems_end(&p);
    } else if ((r = weights_add_file(w, path, fd)) < 0) {
        snprintf(err, errlen, "%s: out of memory", path);
    } else {
        r = weights_read_header(w, 0, &p, err, errlen);
    }
    if (r < 0) goto fail;
    if (w->n == 0) {
        weights_say(&p, "holds no tensors");
        r = weights_problems_end(&p);
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
            r = weights_problems_end(&p);
            goto fail;
        }
        if (w->config) check_config(w, &p);
        if (p.n) {
            r = weights_problems_end(&p);
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
        r = weights_problems_end(&p);
        goto fail;
    }
    size_t most = 0;
    for (int i = 0; i < w->ntensors; i++) {
        const struct gpt_tensor_desc *d = &w->desc[i];
        char name[96], s0[64], s1[64];
        uint64_t want[2];
        int nd = weights_file_shape(d, w->names, want);
        weights_name(d, w->names, name, sizeof(name));
        struct entry *e = weights_find(w, name);
        w->at[i] = e ? (int)(e - w->e) : -1;
        most = MAX(most, d->numel);
        if (!e) {
            weights_say(&p, "tensor '%s' is missing (expected F32 %s)", name,
                        weights_shape_text(nd, want, s0, sizeof(s0)));
            continue;
        }
        e->used = true;
        if (e->dtype > DT_F16)
            weights_say(&p, "tensor '%s': dtype %s; --init reads F32 (and BF16, F16, converted)",
                        name, weights_dtypes[e->dtype].name);
        if (e->ndim != nd || e->shape[0] != want[0] || (nd == 2 && e->shape[1] != want[1]))
            weights_say(&p, "tensor '%s': shape %s, expected %s", name,
                        weights_shape_text(e->ndim, e->shape, s0, sizeof(s0)),
                        weights_shape_text(nd, want, s1, sizeof(s1)));
    }
    struct entry *head = w->names != WEIGHTS_ZINF ? weights_find(w, "lm_head.weight") : NULL;
    if (head && !p.n) {
        const struct entry *wte = w->at[0] >= 0 ? &w->e[w->at[0]] : NULL;
        if ((r = check_head(w, head, wte, &p, err, errlen)) < 0) goto fail;
    } else if (head) {
        head->used = true; /* the problems above say enough */
    }
    for (int i = 0; i < w->n; i++) {
        char s0[64];
        if (!w->e[i].used)
            weights_say(&p,
                        "unexpected tensor '%s' (%s %s): not one of this model's (%d layer%s, %s)",
                        w->e[i].name, weights_dtypes[w->e[i].dtype].name,
                        weights_shape_text(w->e[i].ndim, w->e[i].shape, s0, sizeof(s0)), gc->L,
                        gc->L == 1 ? "" : "s", weights_names_said(w->names));
    }
    if ((r = weights_problems_end(&p)) < 0) goto fail;
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

/*
 * weights_export.c - zinf's GPT model's weights written as safetensors files (weights.h):
 * under zinf's names or GPT-2's, F32, through a temporary file that is synced and renamed;
 * and the Hugging Face folder (model.safetensors and config.json) that transformers'
 * GPT2LMHeadModel.from_pretrained loads as this model.
 *
 * Not here: reading and checking files (weights_format.c, weights_load.c), where the values
 * come from (the caller's source: the run's engine).
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "dirs.h"
#include "train/weights.h"
#include "train/weights_int.h"
#include "zinf.h"

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
        int nd = weights_file_shape(&d[i], names, shape);
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

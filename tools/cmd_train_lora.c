/*
 * cmd_train_lora.c - zinf train's exports of a LoRA run (--lora-rank): the adapters as PEFT
 * saves them (--export-lora DIR: adapter_model.safetensors and adapter_config.json, which
 * peft.PeftModel.from_pretrained loads onto transformers' GPT2LMHeadModel), and the merged
 * weights W + (alpha / r) B A that --export and --export-hf write.
 *
 * PEFT's LoRA on GPT-2's Conv1D (fan_in_fan_out true) keeps lora_A.weight (r, in) and
 * lora_B.weight (out, r) as nn.Linear's, and transposes only the product: the trainer's
 * adapters are stored as they are, under "base_model.model.transformer.h.K.attn.c_attn.
 * lora_A.weight" and the like.
 *
 * Not here: the training (src/train/trainer_lora.c), GPT-2's names of the base
 * (weights_export.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cmd_train.h"
#include "common.h"
#include "dirs.h"
#include "train/gpt_lora.h"
#include "train/trainer.h"
#include "zinf.h"

/* The fp32 parameters of the tensor named name (n floats) into dst. */
static int read_named(struct trainer *t, const char *name, float *dst, size_t n)
{
    zinf_engine *e = trainer_engine(t);
    char full[64];
    zinf_tensor h;
    snprintf(full, sizeof(full), "p.%s", name);
    int r = zinf_lookup(e, full, &h);
    return r < 0 ? r : zinf_read(e, h, 0, dst, n * sizeof(float));
}

/* The target whose base weight d is, or -1. */
static int target_of(const struct trainer_opts *o, const struct gpt_tensor_desc *d)
{
    for (int j = 0; d->block >= 0 && j < GPT_LORA_NTARGETS; j++)
        if ((o->lora.targets & (1u << j)) && d->slot == gpt_lora_slot(j)) return j;
    return -1;
}

int cmd_train_lora_merge(struct trainer *t, const struct trainer_opts *o,
                         const struct gpt_tensor_desc *d, float *w)
{
    int j = o->lora.r ? target_of(o, d) : -1;
    if (j < 0) return 0;
    struct gpt_config gc = o->model;
    size_t out, in, r = (size_t)o->lora.r;
    gpt_lora_dims(&gc, j, &out, &in);
    float *a = malloc(r * in * sizeof(float)), *b = malloc(out * r * sizeof(float));
    char na[32], nb[32];
    gpt_lora_name(d->block, j, 0, na, sizeof(na));
    gpt_lora_name(d->block, j, 1, nb, sizeof(nb));
    int x = a && b ? 0 : -ENOMEM;
    if (x == 0 && (x = read_named(t, na, a, r * in)) == 0 && (x = read_named(t, nb, b, out * r)) == 0) {
        /* W (out, in) += scale B A, in double per element: one rounding. */
        double s = trainer_lora_alpha(o) / (double)r;
        for (size_t p = 0; p < out; p++)
            for (size_t q = 0; q < in; q++) {
                double acc = 0;
                for (size_t k = 0; k < r; k++)
                    acc += (double)b[p * r + k] * a[k * in + q];
                w[p * in + q] = (float)(w[p * in + q] + s * acc);
            }
    }
    free(a);
    free(b);
    return x;
}

/* text (len bytes) to dir/name through a temporary name, synced, then renamed. */
static int write_file(const char *dir, const char *name, const void *head, size_t hlen,
                      const void *body, size_t blen)
{
    char path[4096], tmp[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return -errno;
    int r = 0;
    const struct {
        const void *p;
        size_t n;
    } parts[] = {{head, hlen}, {body, blen}};
    for (int i = 0; i < 2 && r == 0; i++) {
        const char *p = parts[i].p;
        size_t left = parts[i].n;
        while (left && r == 0) {
            ssize_t w = write(fd, p, left);
            if (w < 0)
                r = -errno;
            else {
                p += w;
                left -= (size_t)w;
            }
        }
    }
    if (r == 0 && fsync(fd) < 0) r = -errno;
    if (close(fd) < 0 && r == 0) r = -errno;
    if (r == 0 && rename(tmp, path) < 0) r = -errno;
    if (r < 0) unlink(tmp);
    return r;
}

int cmd_train_export_lora(struct trainer *t, const struct trainer_opts *o, int step,
                          const char *dir, const char *base)
{
    struct gpt_config gc = o->model;
    size_t r = (size_t)o->lora.r, total = 0;
    int L = gc.L, n = 0, x;
    if ((x = dirs_make(dir, 0777)) < 0 && x != -EEXIST) {
        fprintf(stderr, "zinf train: --export-lora %s: cannot make the directory: %s\n", dir,
                strerror(-x));
        return x;
    }
    x = 0;
    for (int k = 0; k < L; k++)
        for (int j = 0; j < GPT_LORA_NTARGETS; j++) {
            size_t out, in;
            gpt_lora_dims(&gc, j, &out, &in);
            if (o->lora.targets & (1u << j)) total += r * (in + out);
        }
    float *data = malloc(total * sizeof(float));
    json_t *h = json_object(), *meta = json_object();
    if (!data || !h || !meta) x = -ENOMEM;
    size_t at = 0;
    for (int k = 0; k < L && x == 0; k++)
        for (int j = 0; j < GPT_LORA_NTARGETS && x == 0; j++) {
            if (!(o->lora.targets & (1u << j))) continue;
            size_t out, in;
            gpt_lora_dims(&gc, j, &out, &in);
            for (int ab = 0; ab < 2 && x == 0; ab++) {
                size_t rows = ab ? out : r, cols = ab ? r : in;
                char zn[32], key[128];
                gpt_lora_name(k, j, ab, zn, sizeof(zn));
                if ((x = read_named(t, zn, data + at, rows * cols)) < 0) break;
                snprintf(key, sizeof(key), "base_model.model.transformer.h.%d.%s.lora_%c.weight", k,
                         gpt_lora_hf_module(j), ab ? 'B' : 'A');
                json_t *e = json_pack("{s:s, s:[I,I], s:[I,I]}", "dtype", "F32", "shape",
                                      (json_int_t)rows, (json_int_t)cols, "data_offsets",
                                      (json_int_t)(at * sizeof(float)),
                                      (json_int_t)((at + rows * cols) * sizeof(float)));
                if (!e || json_object_set_new(h, key, e) < 0) x = -ENOMEM;
                at += rows * cols;
                n++;
            }
        }
    char stepbuf[32];
    snprintf(stepbuf, sizeof(stepbuf), "%d", step);
    if (x == 0 && (json_object_set_new(meta, "format", json_string("pt")) < 0 ||
                   json_object_set_new(meta, "step", json_string(stepbuf)) < 0 ||
                   json_object_set(h, "__metadata__", meta) < 0))
        x = -ENOMEM;
    char *head = x == 0 ? json_dumps(h, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    if (x == 0 && !head) x = -ENOMEM;
    if (x == 0) {
        /* An 8-byte little-endian length, the header padded with spaces to 8 bytes. */
        size_t hl = strlen(head), padded = (hl + 7) / 8 * 8;
        unsigned char *buf = malloc(8 + padded);
        if (!buf) {
            x = -ENOMEM;
        } else {
            for (int i = 0; i < 8; i++)
                buf[i] = (unsigned char)((uint64_t)padded >> (8 * i));
            memcpy(buf + 8, head, hl);
            memset(buf + 8 + hl, ' ', padded - hl);
            x = write_file(dir, "adapter_model.safetensors", buf, 8 + padded, data,
                           total * sizeof(float));
            free(buf);
        }
    }
    free(head);
    if (x == 0) {
        char tg[32];
        json_t *targets = json_array(), *c;
        gpt_lora_targets_name(o->lora.targets, tg, sizeof(tg));
        for (char *s = tg, *e; s && *s; s = e ? e + 1 : NULL) {
            e = strchr(s, ',');
            if (e) *e = 0;
            json_array_append_new(targets, json_string(s));
        }
        c = json_pack("{s:s, s:s, s:s?, s:i, s:f, s:f, s:o, s:b, s:s, s:b, s:n, s:n}", "peft_type",
                      "LORA", "task_type", "CAUSAL_LM", "base_model_name_or_path", base, "r",
                      (int)r, "lora_alpha", (double)trainer_lora_alpha(o), "lora_dropout", 0.0,
                      "target_modules", targets, "fan_in_fan_out", 1, "bias", "none",
                      "inference_mode", 1, "modules_to_save", "layers_to_transform");
        char *text = c ? json_dumps(c, JSON_INDENT(2) | JSON_SORT_KEYS) : NULL;
        x = text ? write_file(dir, "adapter_config.json", text, strlen(text), "\n", 1) : -ENOMEM;
        free(text);
        json_decref(c);
    }
    json_decref(h);
    json_decref(meta);
    free(data);
    if (x < 0)
        fprintf(stderr, "zinf train: --export-lora %s: %s\n", dir, strerror(-x));
    else
        printf("# export-lora: step %d, %d adapter tensors under PEFT's names, "
               "%s/adapter_model.safetensors and %s/adapter_config.json\n",
               step, n, dir, dir);
    return x;
}

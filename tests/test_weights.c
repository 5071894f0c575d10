/*
 * test_weights.c - zinf train's weights in and out (src/train/weights.h, trainer_opts.init_source), as
 * a user runs them: --export and --export-hf files read back by --init give the same
 * parameters, bit for bit, in every copy the trainer keeps (fp32, bf16, ZeRO shards); a file
 * that does not fit the model is refused, naming the problem, before anything is touched;
 * the config.json that goes with --export-hf says GPT-2's architecture. The binary comes from
 * $ZINF_BIN (set by meson). What transformers makes of the export: bench/hf_check.py.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"

static char *dir;

static void setup(void)
{
    dir = test_tmpdir("weights");
    cr_assert_not_null(dir);
}

static void teardown(void)
{
    test_leak_check();
    test_rmtree(dir);
}

TestSuite(weights, .init = setup, .fini = teardown, .timeout = 120);

#define MODEL "--layers 1 --dim 32 --heads 2 --seq 16 --batch 2"

/* zinf ARGS, stdout and stderr in *out: the exit status (helpers.c). */
#define run test_run_zinf

/* A config keeping the run under dir/NAME (at ZeRO stage when stage > 0), and the data. */
static void files(const char *name, int stage, char *cfg, char *data)
{
    sprintf(cfg, "%s/%s.json", dir, name);
    sprintf(data, "%s/data.txt", dir);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    char st[64] = "";
    if (stage) snprintf(st, sizeof(st), "\"stage\": %d, ", stage);
    fprintf(f,
            "{\"zero_optimization\": {%s\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
            "\"%s/%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s/%s\"}}, "
            "\"aio\": {\"block_size\": 65536, \"queue_depth\": 4}, \"zinf\": {\"device\": "
            "\"emulated\", \"device_bytes\": \"8M\", \"host_bytes\": \"8M\"}}",
            st, dir, name, dir, name);
    fclose(f);
    if (access(data, F_OK) == 0) return;
    f = fopen(data, "w");
    cr_assert_not_null(f);
    for (int i = 0; i < 300; i++)
        fprintf(f, "line %d of the text the byte model learns from.\n", i);
    fclose(f);
}

/* A safetensors file in memory: its header (an object) and its data. */
struct st_file {
    json_t *h;
    unsigned char *data;
    size_t len;
};

static void st_load(const char *path, struct st_file *s)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    unsigned char len8[8];
    cr_assert_eq(fread(len8, 1, 8, f), 8);
    uint64_t hlen = 0;
    for (int k = 7; k >= 0; k--)
        hlen = hlen << 8 | len8[k];
    char *hdr = malloc(hlen);
    cr_assert_eq(fread(hdr, 1, hlen, f), hlen);
    json_error_t je;
    s->h = json_loadb(hdr, hlen, 0, &je);
    cr_assert_not_null(s->h, "%s: %s", path, je.text);
    free(hdr);
    long at = ftell(f);
    fseek(f, 0, SEEK_END);
    s->len = (size_t)(ftell(f) - at);
    fseek(f, at, SEEK_SET);
    s->data = malloc(s->len ? s->len : 1);
    cr_assert_eq(fread(s->data, 1, s->len, f), s->len);
    fclose(f);
}

static void st_save(const char *path, const struct st_file *s)
{
    char *hdr = json_dumps(s->h, JSON_COMPACT | JSON_PRESERVE_ORDER);
    size_t hlen = strlen(hdr), padded = (hlen + 7) / 8 * 8;
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    for (int k = 0; k < 8; k++)
        fputc((int)((padded >> (8 * k)) & 0xff), f);
    fwrite(hdr, 1, hlen, f);
    fprintf(f, "%*s", (int)(padded - hlen), "");
    fwrite(s->data, 1, s->len, f);
    fclose(f);
    free(hdr);
}

static void st_free(struct st_file *s)
{
    json_decref(s->h);
    free(s->data);
}

/* Tensor name's bytes in s (NULL when absent), and their count. */
static const unsigned char *st_tensor(const struct st_file *s, const char *name, size_t *n)
{
    json_t *e = json_object_get(s->h, name);
    if (!e) return NULL;
    json_t *o = json_object_get(e, "data_offsets");
    size_t b = (size_t)json_integer_value(json_array_get(o, 0)),
           x = (size_t)json_integer_value(json_array_get(o, 1));
    *n = x - b;
    return s->data + b;
}

/* Every tensor of a is in b with the same dtype, shape and bytes, and b has no other. */
static void same_tensors(const char *pa, const char *pb)
{
    struct st_file a, b;
    st_load(pa, &a);
    st_load(pb, &b);
    const char *k;
    json_t *v;
    size_t count = 0;
    json_object_foreach(a.h, k, v) {
        if (!strcmp(k, "__metadata__")) continue;
        count++;
        json_t *w = json_object_get(b.h, k);
        cr_assert_not_null(w, "%s: no %s", pb, k);
        cr_assert(json_equal(json_object_get(v, "dtype"), json_object_get(w, "dtype")), "%s", k);
        cr_assert(json_equal(json_object_get(v, "shape"), json_object_get(w, "shape")), "%s", k);
        size_t na, nb;
        const unsigned char *da = st_tensor(&a, k, &na), *db = st_tensor(&b, k, &nb);
        cr_assert_eq(na, nb, "%s", k);
        cr_assert(!memcmp(da, db, na), "%s differs between %s and %s", k, pa, pb);
    }
    cr_assert_eq(json_object_size(b.h) - (json_object_get(b.h, "__metadata__") ? 1 : 0), count);
    st_free(&a);
    st_free(&b);
}

/* A value of the last line of log that has key: its text, exactly as written. */
static void log_value(const char *log, const char *key, char *out, size_t len)
{
    FILE *f = fopen(log, "r");
    cr_assert_not_null(f, "%s", log);
    char line[8192], pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    out[0] = '\0';
    while (fgets(line, sizeof(line), f)) {
        char *at = strstr(line, pat);
        if (at) snprintf(out, len, "%.*s", (int)strcspn(at + strlen(pat), ",}"), at + strlen(pat));
    }
    fclose(f);
    cr_assert(out[0], "%s: no %s", log, key);
}

/* The bytes of every file under d, as one checksum line per file. */
static char *tree_sum(const char *d)
{
    char *o;
    FILE *p;
    char cmd[4200];
    snprintf(cmd, sizeof(cmd), "cd '%s' && find . -type f | sort | xargs cksum", d);
    p = popen(cmd, "r");
    cr_assert_not_null(p);
    o = calloc(1, 65536);
    size_t n = fread(o, 1, 65535, p);
    o[n] = '\0';
    pclose(p);
    return o;
}

/* --steps 0 --export, --init of it, --export again: the same tensors, bit for bit; and the
 * --export-hf of the same run, read back by --init, gives them too. */
Test(weights, export_init_export_gives_the_same_tensors)
{
    char cfg[4096], data[4096], a[4096], b[4096], c[4096], hf[4096], *o;
    files("rt", 0, cfg, data);
    snprintf(a, sizeof(a), "%s/a.safetensors", dir);
    snprintf(b, sizeof(b), "%s/b.safetensors", dir);
    snprintf(c, sizeof(c), "%s/c.safetensors", dir);
    snprintf(hf, sizeof(hf), "%s/hf", dir);
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 2 --export %s --export-hf %s",
                     cfg, data, a, hf),
                 0, "%s", o);
    cr_assert(strstr(o, "# export-hf: step 2, 16 tensors under GPT-2's names"), "%s", o);
    free(o);
    /* Another seed: the weights that come out are the file's, not the run's own. */
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --seed 7 --steps 0 --overwrite "
                         "--init %s --export %s",
                     cfg, data, a, b),
                 0, "%s", o);
    cr_assert(strstr(o, "# init: 16 tensors from") && strstr(o, "(zinf's names), saved as step 0"),
              "%s", o);
    free(o);
    same_tensors(a, b);
    char m[4200];
    snprintf(m, sizeof(m), "%s/model.safetensors", hf);
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --seed 7 --steps 0 --overwrite "
                         "--init %s --export %s",
                     cfg, data, m, c),
                 0, "%s", o);
    cr_assert(strstr(o, "(GPT-2's names)"), "%s", o);
    free(o);
    same_tensors(a, c);
    /* Saved as step 0: a resume continues from the file's weights. */
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --seed 7 --steps 0 --resume "
                         "--export %s",
                     cfg, data, b),
                 0, "%s", o);
    free(o);
    same_tensors(a, b);
}

/* The export under GPT-2's names: transformers' names and Conv1D's transposed matrices, no
 * lm_head (tied), "format": "pt"; and a config.json saying GPT-2's architecture. */
Test(weights, export_hf_writes_gpt2s_names_and_config)
{
    char cfg[4096], data[4096], a[4096], hf[4096], p[4200], *o;
    files("hf", 0, cfg, data);
    snprintf(a, sizeof(a), "%s/a.safetensors", dir);
    snprintf(hf, sizeof(hf), "%s/out", dir);
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 1 --export %s --export-hf %s",
                     cfg, data, a, hf),
                 0, "%s", o);
    free(o);
    snprintf(p, sizeof(p), "%s/config.json", hf);
    json_error_t je;
    json_t *c = json_load_file(p, 0, &je);
    cr_assert_not_null(c, "%s: %s", p, je.text);
    cr_expect_str_eq(json_string_value(json_object_get(c, "model_type")), "gpt2");
    cr_expect_str_eq(json_string_value(json_array_get(json_object_get(c, "architectures"), 0)),
                     "GPT2LMHeadModel");
    const struct {
        const char *k;
        long v;
    } ints[] = {{"vocab_size", 256}, {"n_positions", 16}, {"n_ctx", 16}, {"n_embd", 32},
                {"n_layer", 1},      {"n_head", 2},       {"n_inner", 128}};
    for (size_t i = 0; i < sizeof(ints) / sizeof(ints[0]); i++)
        cr_expect_eq(json_integer_value(json_object_get(c, ints[i].k)), ints[i].v, "%s", ints[i].k);
    cr_expect_str_eq(json_string_value(json_object_get(c, "activation_function")), "gelu_new");
    cr_expect_eq(json_number_value(json_object_get(c, "layer_norm_epsilon")), 1e-5);
    const char *zeros[] = {"resid_pdrop", "embd_pdrop", "attn_pdrop"};
    for (size_t i = 0; i < 3; i++) {
        json_t *z = json_object_get(c, zeros[i]);
        cr_expect(json_is_number(z) && json_number_value(z) == 0, "%s", zeros[i]);
    }
    cr_expect(json_is_true(json_object_get(c, "tie_word_embeddings")));
    cr_expect(json_is_true(json_object_get(c, "scale_attn_weights")));
    cr_expect(json_is_false(json_object_get(c, "scale_attn_by_inverse_layer_idx")));
    cr_expect(json_is_false(json_object_get(c, "reorder_and_upcast_attn")));
    json_decref(c);

    struct st_file z, h;
    st_load(a, &z);
    snprintf(p, sizeof(p), "%s/model.safetensors", hf);
    st_load(p, &h);
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(h.h, "__metadata__"),
                                                       "format")),
                     "pt");
    cr_expect_null(json_object_get(h.h, "lm_head.weight"));
    cr_expect_eq(json_object_size(h.h), json_object_size(z.h));
    /* Vectors and embeddings as zinf has them; the blocks' matrices transposed. */
    static const char *const same[][2] = {
        {"wte", "transformer.wte.weight"},       {"wpe", "transformer.wpe.weight"},
        {"h0.ln1.w", "transformer.h.0.ln_1.weight"}, {"h0.ln2.b", "transformer.h.0.ln_2.bias"},
        {"h0.attn.qkv.b", "transformer.h.0.attn.c_attn.bias"},
        {"h0.mlp.proj.b", "transformer.h.0.mlp.c_proj.bias"},
        {"lnf.w", "transformer.ln_f.weight"},    {"lnf.b", "transformer.ln_f.bias"}};
    for (size_t i = 0; i < sizeof(same) / sizeof(same[0]); i++) {
        size_t n0, n1;
        const unsigned char *d0 = st_tensor(&z, same[i][0], &n0), *d1 = st_tensor(&h, same[i][1], &n1);
        cr_assert(d0 && d1 && n0 == n1 && !memcmp(d0, d1, n0), "%s", same[i][1]);
    }
    static const struct {
        const char *zinf, *hf;
        size_t rows, cols; /* zinf's */
    } tr[] = {{"h0.attn.qkv.w", "transformer.h.0.attn.c_attn.weight", 96, 32},
              {"h0.attn.proj.w", "transformer.h.0.attn.c_proj.weight", 32, 32},
              {"h0.mlp.fc.w", "transformer.h.0.mlp.c_fc.weight", 128, 32},
              {"h0.mlp.proj.w", "transformer.h.0.mlp.c_proj.weight", 32, 128}};
    for (size_t i = 0; i < 4; i++) {
        json_t *sh = json_object_get(json_object_get(h.h, tr[i].hf), "shape");
        cr_assert_eq(json_integer_value(json_array_get(sh, 0)), (json_int_t)tr[i].cols, "%s",
                     tr[i].hf);
        cr_assert_eq(json_integer_value(json_array_get(sh, 1)), (json_int_t)tr[i].rows, "%s",
                     tr[i].hf);
        size_t n0, n1;
        const float *w = (const float *)st_tensor(&z, tr[i].zinf, &n0),
                    *t = (const float *)st_tensor(&h, tr[i].hf, &n1);
        cr_assert(w && t && n0 == n1);
        for (size_t r = 0; r < tr[i].rows; r++)
            for (size_t k = 0; k < tr[i].cols; k++)
                cr_assert_eq(w[r * tr[i].cols + k], t[k * tr[i].rows + r], "%s", tr[i].hf);
    }
    st_free(&z);
    st_free(&h);
}

/* A run started from an export computes with its weights in every copy: the held-out loss
 * after a step at learning rate 0 is the loss the exporting run measured, to the bit, in fp32
 * and in bf16 (whose 16-bit copies must be remade from the file's masters). */
Test(weights, init_then_training_sees_the_exported_weights)
{
    static const char *const prec[] = {"fp32", "bf16"};
    for (int k = 0; k < 2; k++) {
        char cfg[4096], data[4096], a[4096], la[4096], lb[4096], va[64], vb[64], *o;
        files(prec[k], 0, cfg, data);
        snprintf(a, sizeof(a), "%s/%s.safetensors", dir, prec[k]);
        snprintf(la, sizeof(la), "%s/%s-a.jsonl", dir, prec[k]);
        snprintf(lb, sizeof(lb), "%s/%s-b.jsonl", dir, prec[k]);
        cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --precision %s --steps 3 "
                             "--eval-every 3 --log %s --export %s",
                         cfg, data, prec[k], la, a),
                     0, "%s", o);
        free(o);
        cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --precision %s --steps 1 "
                             "--lr 0 --eval-every 1 --log %s --overwrite --init %s",
                         cfg, data, prec[k], lb, a),
                     0, "%s", o);
        free(o);
        log_value(la, "val_loss", va, sizeof(va));
        log_value(lb, "val_loss", vb, sizeof(vb));
        cr_expect_str_eq(va, vb, "%s: the exporting run's held-out loss %s, the --init run's %s",
                         prec[k], va, vb);
    }
}

/* Across ZeRO ranks (stage 3: each holds a shard of every weight) the same. */
Test(weights, init_across_zero_ranks, .timeout = 240)
{
    char cfg[4096], data[4096], a[4096], la[4096], lb[4096], va[64], vb[64], *o;
    files("one", 0, cfg, data);
    snprintf(a, sizeof(a), "%s/a.safetensors", dir);
    snprintf(la, sizeof(la), "%s/a.jsonl", dir);
    snprintf(lb, sizeof(lb), "%s/b.jsonl", dir);
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 3 --eval-every 3 --log %s "
                         "--export %s",
                     cfg, data, la, a),
                 0, "%s", o);
    free(o);
    files("z3", 3, cfg, data);
    cr_assert_eq(run(&o, "launch -n 2 -- %s train --config %s --data %s " MODEL " --steps 1 --lr 0 "
                         "--eval-every 1 --log %s --init %s",
                     getenv("ZINF_BIN"), cfg, data, lb, a),
                 0, "%s", o);
    free(o);
    log_value(la, "val_loss", va, sizeof(va));
    log_value(lb, "val_loss", vb, sizeof(vb));
    cr_expect_str_eq(va, vb, "one rank's held-out loss %s, two ranks' from its export %s", va, vb);
}

/* BF16 tensors are read too, converted: the run's weights are the file's values. */
Test(weights, init_reads_bf16)
{
    char cfg[4096], data[4096], a[4096], b[4096], c[4096], *o;
    files("bf", 0, cfg, data);
    snprintf(a, sizeof(a), "%s/a.safetensors", dir);
    snprintf(b, sizeof(b), "%s/b.safetensors", dir);
    snprintf(c, sizeof(c), "%s/c.safetensors", dir);
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 1 --export %s", cfg, data, a),
                 0, "%s", o);
    free(o);
    /* Each float cut to its top half (a bf16), and the same cut kept as F32 to compare. */
    struct st_file s, t;
    st_load(a, &s);
    st_load(a, &t);
    size_t out = 0;
    const char *k;
    json_t *v;
    json_object_foreach(s.h, k, v) {
        if (!strcmp(k, "__metadata__")) continue;
        size_t n;
        unsigned char *d = (unsigned char *)st_tensor(&s, k, &n);
        unsigned char *f32 = (unsigned char *)st_tensor(&t, k, &n);
        for (size_t i = 0; i < n / 4; i++) {
            uint32_t x;
            memcpy(&x, d + 4 * i, 4);
            x &= 0xffff0000u;
            memcpy(f32 + 4 * i, &x, 4);
            uint16_t h = (uint16_t)(x >> 16);
            memcpy(s.data + out + 2 * i, &h, 2);
        }
        json_object_set_new(v, "dtype", json_string("BF16"));
        json_object_set_new(v, "data_offsets", json_pack("[I, I]", (json_int_t)out,
                                                         (json_int_t)(out + n / 2)));
        out += n / 2;
    }
    s.len = out;
    st_save(b, &s);
    st_save(a, &t);
    st_free(&s);
    st_free(&t);
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 0 --overwrite --init %s "
                         "--export %s",
                     cfg, data, b, c),
                 0, "%s", o);
    free(o);
    same_tensors(a, c);
}

/* Each way a file can fail to fit: exit 2 before anything opens, naming the file and the
 * problem; the run saved under the config's path is left as it was (even with --overwrite). */
Test(weights, init_refuses_what_does_not_fit, .timeout = 240)
{
    char cfg[4096], data[4096], a[4096], bad[4096], swap[4200], *o;
    files("bad", 0, cfg, data);
    snprintf(a, sizeof(a), "%s/a.safetensors", dir);
    snprintf(bad, sizeof(bad), "%s/bad.safetensors", dir);
    snprintf(swap, sizeof(swap), "%s/bad", dir);
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 1 --export %s", cfg, data, a),
                 0, "%s", o);
    free(o);
    char *before = tree_sum(swap);

    struct {
        const char *what; /* the change to a's file */
        const char *says[2];
    } cases[] = {
        {"shape", {"tensor 'h0.attn.qkv.w': shape (32, 96), expected (96, 32)", NULL}},
        {"missing", {"tensor 'lnf.b' is missing (expected F32 (32,))", NULL}},
        {"extra", {"unexpected tensor 'junk' (F32 (4,))", NULL}},
        {"dtype", {"tensor 'lnf.b': dtype I32; --init reads F32", NULL}},
        {"truncated", {"truncated: the header gives", NULL}},
        {"text", {"not a safetensors file", NULL}},
        {"overlap", {"bad header: tensor", "inside the tensor before it"}},
        {"heads", {"a model of 1 layer, dim 32, 4 heads (as its metadata says), seq 16",
                   "this run's is --layers 1 --dim 32 --heads 2 --seq 16"}},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const char *w = cases[i].what;
        struct st_file s;
        st_load(a, &s);
        if (!strcmp(w, "shape")) {
            json_object_set_new(json_object_get(s.h, "h0.attn.qkv.w"), "shape", json_pack("[i, i]", 32, 96));
        } else if (!strcmp(w, "missing") || !strcmp(w, "dtype")) {
            /* lnf.b is the last tensor: its bytes go with it, or are read as I32. */
            if (w[0] == 'm') {
                json_object_del(s.h, "lnf.b");
                s.len -= 32 * 4;
            } else {
                json_object_set_new(json_object_get(s.h, "lnf.b"), "dtype", json_string("I32"));
            }
        } else if (!strcmp(w, "extra")) {
            s.data = realloc(s.data, s.len + 16);
            memset(s.data + s.len, 0, 16);
            json_object_set_new(s.h, "junk", json_pack("{s:s, s:[i], s:[I, I]}", "dtype", "F32",
                                                       "shape", 4, "data_offsets",
                                                       (json_int_t)s.len, (json_int_t)s.len + 16));
            s.len += 16;
        } else if (!strcmp(w, "truncated")) {
            s.len -= 100;
        } else if (!strcmp(w, "overlap")) {
            json_t *o2 = json_object_get(json_object_get(s.h, "wpe"), "data_offsets");
            json_array_set_new(o2, 0, json_integer(json_integer_value(json_array_get(o2, 0)) - 4));
            json_array_set_new(o2, 1, json_integer(json_integer_value(json_array_get(o2, 1)) - 4));
        } else if (!strcmp(w, "heads")) {
            json_object_set_new(json_object_get(s.h, "__metadata__"), "heads", json_string("4"));
        }
        if (!strcmp(w, "text")) {
            FILE *f = fopen(bad, "w");
            fputs("a file of text, not of tensors\n", f);
            fclose(f);
        } else {
            st_save(bad, &s);
        }
        st_free(&s);
        cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 1 --overwrite --init %s",
                         cfg, data, bad),
                     2, "%s: %s", w, o);
        for (int k = 0; k < 2 && cases[i].says[k]; k++)
            cr_expect(strstr(o, cases[i].says[k]), "%s: not said: %s\n%s", w, cases[i].says[k], o);
        cr_expect(strstr(o, "zinf train: --init ") && strstr(o, "bad.safetensors: "), "%s: %s", w, o);
        free(o);
        /* --dry-run checks it alike. */
        cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --dry-run --init %s", cfg, data,
                         bad),
                     2, "%s: %s", w, o);
        free(o);
    }
    /* Another model than the run's: said once, with both sizes. */
    cr_assert_eq(run(&o, "train --config %s --data %s --layers 2 --dim 32 --heads 2 --seq 16 "
                         "--steps 1 --overwrite --init %s",
                     cfg, data, a),
                 2, "%s", o);
    cr_expect(strstr(o, "a model of 1 layer, dim 32, 2 heads (as its metadata says), seq 16, "
                        "vocabulary 256; this run's is --layers 2 --dim 32"),
              "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 1 --init %s/none.safetensors",
                     cfg, data, dir),
                 2, "%s", o);
    cr_expect(strstr(o, "none.safetensors: No such file or directory"), "%s", o);
    free(o);
    /* --init with --resume: refused, the saved run left as it is. */
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 2 --resume --init %s", cfg,
                     data, a),
                 2, "%s", o);
    cr_expect(strstr(o, "--init and --resume") && strstr(o, "not both"), "%s", o);
    free(o);
    char *after = tree_sum(swap);
    cr_expect_str_eq(before, after, "the saved run changed");
    free(before);
    free(after);
}

/* GPT-2's lm_head.weight is tied to the embedding: accepted equal to it, refused otherwise. */
Test(weights, init_takes_a_tied_lm_head_only)
{
    char cfg[4096], data[4096], hf[4096], m[4200], b[4096], *o;
    files("head", 0, cfg, data);
    snprintf(hf, sizeof(hf), "%s/hf", dir);
    snprintf(m, sizeof(m), "%s/model.safetensors", hf);
    snprintf(b, sizeof(b), "%s/head.safetensors", dir);
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 1 --export-hf %s", cfg, data,
                     hf),
                 0, "%s", o);
    free(o);
    for (int differ = 0; differ < 2; differ++) {
        struct st_file s;
        st_load(m, &s);
        size_t n;
        const unsigned char *wte = st_tensor(&s, "transformer.wte.weight", &n);
        size_t at = s.len;
        unsigned char *nd = malloc(s.len + n);
        memcpy(nd, s.data, s.len);
        memcpy(nd + at, wte, n);
        if (differ) nd[at + 5] ^= 0x40;
        free(s.data);
        s.data = nd;
        s.len += n;
        json_object_set_new(s.h, "lm_head.weight",
                            json_pack("{s:s, s:[i, i], s:[I, I]}", "dtype", "F32", "shape", 256, 32,
                                      "data_offsets", (json_int_t)at, (json_int_t)(at + n)));
        st_save(b, &s);
        st_free(&s);
        int rc = run(&o, "train --config %s --data %s " MODEL " --steps 0 --overwrite --init %s",
                     cfg, data, b);
        if (differ) {
            cr_expect_eq(rc, 2, "%s", o);
            cr_expect(strstr(o, "tensor 'lm_head.weight' differs from 'transformer.wte.weight'"),
                      "%s", o);
        } else {
            cr_expect_eq(rc, 0, "%s", o);
        }
        free(o);
    }
}

/* The keys of a Hugging Face config.json that change what GPT-2 computes are held to what the
 * trainer computes: a value it cannot is refused naming the file, the key and the value
 * (beside a file as in a folder), not trained as another model; the other names of its GELU
 * are taken, and dropout, which it does not apply, is said. */
Test(weights, init_refuses_config_json_keys_the_trainer_does_not_compute, .timeout = 240)
{
    char cfg[4096], data[4096], hf[4096], cj[4200], m[4200], *o;
    files("cj", 0, cfg, data);
    snprintf(hf, sizeof(hf), "%s/hf", dir);
    snprintf(cj, sizeof(cj), "%s/config.json", hf);
    snprintf(m, sizeof(m), "%s/model.safetensors", hf);
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 0 --export-hf %s", cfg,
                     data, hf),
                 0, "%s", o);
    free(o);
    json_t *orig = json_load_file(cj, 0, NULL);
    cr_assert_not_null(orig);
    static const struct {
        const char *key, *json, *says;
    } cases[] = {
        {"activation_function", "\"relu\"", "config.json: activation_function \"relu\": "},
        {"activation_function", "\"gelu\"", "config.json: activation_function \"gelu\": "},
        {"layer_norm_epsilon", "1e-6", "config.json: layer_norm_epsilon 1e-06: zinf's LayerNorm "
                                       "adds 1e-05"},
        {"scale_attn_weights", "false", "config.json: scale_attn_weights false: "},
        {"scale_attn_by_inverse_layer_idx", "true",
         "config.json: scale_attn_by_inverse_layer_idx true: "},
        {"tie_word_embeddings", "false", "config.json: tie_word_embeddings false: "},
        {"model_type", "\"gpt_neo\"", "config.json: model_type gpt_neo: "},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        json_t *c = json_deep_copy(orig);
        json_object_set_new(c, cases[i].key, json_loads(cases[i].json, JSON_DECODE_ANY, NULL));
        cr_assert_eq(json_dump_file(c, cj, 0), 0);
        json_decref(c);
        const char *at[2] = {m, hf};
        for (int k = 0; k < 2; k++) {
            cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 1 --overwrite "
                                 "--init %s",
                             cfg, data, at[k]),
                         2, "%s = %s (--init %s): %s", cases[i].key, cases[i].json, at[k], o);
            cr_expect(strstr(o, cases[i].says) && strstr(o, cj), "%s = %s (--init %s): %s",
                      cases[i].key, cases[i].json, at[k], o);
            free(o);
        }
    }
    /* GELU's tanh approximation under its other name, and dropout: taken, dropout said. */
    json_t *c = json_deep_copy(orig);
    json_object_set_new(c, "activation_function", json_string("gelu_pytorch_tanh"));
    json_object_set_new(c, "resid_pdrop", json_real(0.1));
    cr_assert_eq(json_dump_file(c, cj, 0), 0);
    json_decref(c);
    json_decref(orig);
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 1 --overwrite --init %s",
                     cfg, data, hf),
                 0, "%s", o);
    cr_expect(strstr(o, "# init: resid_pdrop 0.1 in ") &&
                  strstr(o, "not applied, zinf trains without dropout"),
              "%s", o);
    free(o);
}

/* A FIFO (or another file that is not a regular one) is refused at once, not waited on. */
Test(weights, init_refuses_a_fifo_without_waiting, .timeout = 60)
{
    char cfg[4096], data[4096], fifo[4096], cmd[16384];
    files("fifo", 0, cfg, data);
    snprintf(fifo, sizeof(fifo), "%s/weights.safetensors", dir);
    cr_assert_eq(mkfifo(fifo, 0600), 0, "%s", strerror(errno));
    snprintf(cmd, sizeof(cmd),
             "timeout 20 %s train --config %s --data %s " MODEL " --steps 1 --init %s 2>&1",
             getenv("ZINF_BIN"), cfg, data, fifo);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    char out[4096] = "";
    size_t n = fread(out, 1, sizeof(out) - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2, "exit %d (124: it waited on the FIFO): %s",
              WIFEXITED(st) ? WEXITSTATUS(st) : -1, out);
    cr_expect(strstr(out, "weights.safetensors: a FIFO: --init reads a safetensors file"), "%s",
              out);
}

/* PyTorch's own files (torch.save: a zip of pickles, or a bare pickle) are said to be that,
 * with how to convert them, not taken for a broken safetensors file. */
Test(weights, init_says_a_pytorch_pickle_is_not_safetensors)
{
    char cfg[4096], data[4096], bin[4096], *o;
    files("pickle", 0, cfg, data);
    static const struct {
        const char *bytes;
        size_t len;
        const char *says;
    } cases[] = {{"PK\x03\x04\x14\x00\x00\x00\x08\x00junk of a zip", 23, "a PyTorch zip archive"},
                 {"\x80\x02}q\x00(X\x04\x00\x00\x00wte.q", 16, "a PyTorch pickle"},
                 {"\x80\x04\x95", 3, "a PyTorch pickle"}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(bin, sizeof(bin), "%s/pytorch_model%zu.bin", dir, i);
        FILE *f = fopen(bin, "wb");
        cr_assert_not_null(f);
        fwrite(cases[i].bytes, 1, cases[i].len, f);
        fclose(f);
        cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 1 --init %s", cfg,
                         data, bin),
                     2, "%s", o);
        cr_expect(strstr(o, cases[i].says) && strstr(o, "not a safetensors file") &&
                      strstr(o, "save_pretrained(OUT, safe_serialization=True)"),
                  "%s", o);
        cr_expect_null(strstr(o, "header of"), "%s", o);
        free(o);
    }
}

/* Split the safetensors file src into two shards in folder d, with the
 * model.safetensors.index.json that maps each tensor to its shard (leaving out the tensor
 * named drop, when not NULL), as save_pretrained writes a large model. */
static void shard_into(const char *src, const char *d, const char *drop)
{
    struct st_file s, part[2];
    st_load(src, &s);
    json_t *map = json_object();
    for (int k = 0; k < 2; k++) {
        part[k].h = json_object();
        part[k].data = malloc(s.len);
        part[k].len = 0;
    }
    const char *name;
    json_t *v;
    int i = 0;
    json_object_foreach(s.h, name, v) {
        if (!strcmp(name, "__metadata__")) continue;
        int k = i++ % 2;
        size_t n;
        const unsigned char *bytes = st_tensor(&s, name, &n);
        memcpy(part[k].data + part[k].len, bytes, n);
        json_t *e = json_deep_copy(v);
        json_object_set_new(e, "data_offsets", json_pack("[I, I]", (json_int_t)part[k].len,
                                                         (json_int_t)(part[k].len + n)));
        json_object_set_new(part[k].h, name, e);
        part[k].len += n;
        if (!drop || strcmp(drop, name))
            json_object_set_new(map, name, json_string(k ? "model-00002-of-00002.safetensors"
                                                          : "model-00001-of-00002.safetensors"));
    }
    char p[4200];
    for (int k = 0; k < 2; k++) {
        snprintf(p, sizeof(p), "%s/model-0000%d-of-00002.safetensors", d, k + 1);
        st_save(p, &part[k]);
        st_free(&part[k]);
    }
    snprintf(p, sizeof(p), "%s/model.safetensors.index.json", d);
    json_t *ix = json_pack("{s:{s:I}, s:o}", "metadata", "total_size", (json_int_t)s.len,
                           "weight_map", map);
    cr_assert_eq(json_dump_file(ix, p, JSON_INDENT(2)), 0);
    json_decref(ix);
    st_free(&s);
}

/* A Hugging Face folder is taken as its model.safetensors is, and so are its shards with
 * their index: the same first step's loss, to the bit. An index that leaves out a tensor a
 * shard holds is refused, naming it. */
Test(weights, init_takes_a_hugging_face_folder_as_its_file, .timeout = 240)
{
    char cfg[4096], data[4096], hf[4096], sh[4096], m[4200], cj[4200], log[4096], v0[64],
        v[64], *o;
    files("folder", 0, cfg, data);
    snprintf(hf, sizeof(hf), "%s/hf", dir);
    snprintf(sh, sizeof(sh), "%s/sharded", dir);
    snprintf(m, sizeof(m), "%s/model.safetensors", hf);
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 2 --export-hf %s", cfg,
                     data, hf),
                 0, "%s", o);
    free(o);
    cr_assert_eq(mkdir(sh, 0755), 0);
    shard_into(m, sh, NULL);
    char cmd[8400];
    snprintf(cj, sizeof(cj), "%s/config.json", sh);
    snprintf(cmd, sizeof(cmd), "cp %s/config.json %s", hf, cj);
    cr_assert_eq(system(cmd), 0);
    const char *from[3] = {m, hf, sh};
    for (int k = 0; k < 3; k++) {
        snprintf(log, sizeof(log), "%s/from%d.jsonl", dir, k);
        cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 1 --overwrite "
                             "--init %s --log %s",
                         cfg, data, from[k], log),
                     0, "--init %s: %s", from[k], o);
        free(o);
        log_value(log, "loss", k ? v : v0, sizeof(v));
        if (k) cr_expect_str_eq(v, v0, "--init %s: step 1's loss %s, the file's %s", from[k], v, v0);
    }
    /* A tensor in a shard that the index does not list. */
    shard_into(m, sh, "transformer.ln_f.bias");
    cr_assert_eq(run(&o, "train --config %s --data %s " MODEL " --steps 1 --overwrite --init %s",
                     cfg, data, sh),
                 2, "%s", o);
    cr_expect(strstr(o, "tensor 'transformer.ln_f.bias' is in ") &&
                  strstr(o, "model.safetensors.index.json does not list it"),
              "%s", o);
    free(o);
}

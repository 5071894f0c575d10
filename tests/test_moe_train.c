/*
 * test_moe_train.c - mixture of experts in zinf train, through the binary as a user runs it:
 * the settings from the command line and the config's moe section, and the refusals that
 * name the key or option a run cannot have with MoE blocks.
 *
 * The runs: the losses of a model with MoE blocks are the same bits whether its parameters
 * live in memory or on NVMe, and from run to run, and go down; the NVMe bytes its steps
 * read for experts follow the experts a step routes tokens to, not all of them.
 *
 * Not here: the MoE math (test_moe.c), the block halves it rests on (test_train_ops.c), the
 * config reader's own checks of the section (test_config.c).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "helpers.h"

static char *dir;
static int micro = 2; /* train_micro_batch_size_per_gpu in config() */

static void setup(void)
{
    dir = test_tmpdir("moe-train");
    cr_assert_not_null(dir);
}

static void teardown(void)
{
    test_leak_check();
    test_rmtree(dir);
}

TestSuite(moe_train, .init = setup, .fini = teardown, .timeout = 60);

#define run test_run_zinf
#define DATA "/usr/share/common-licenses/GPL-3"

/* A config with `extra` inside the top object: a small model on the emulated device. */
static void config(char *path, size_t len, const char *extra)
{
    snprintf(path, len, "%s/moe.json", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{%s \"train_micro_batch_size_per_gpu\": %d, \"zinf\": {\"device\": \"emulated\", "
            "\"train\": {\"layers\": 2, \"dim\": 32, \"heads\": 2, \"seq\": 8}}}",
            extra, micro);
    fclose(f);
}

/* Each case fails (exit status not 0) with `want` in what it printed. */
Test(moe_train, what_a_run_cannot_have_is_refused_naming_it)
{
    char cfg[4096], *o;
    static const struct {
        int n;
        const char *extra, *args, *want;
    } cases[] = {
        {1, "", "--experts 4 --top-k 3", "--top-k: "},
        {1, "", "--experts 4097", "--experts: "},
        {1, "", "--experts 1 --top-k 2", "moe.top_k (--top-k) 2: more than the 1 expert"},
        {1, "\"moe\": {\"num_experts\": 4, \"moe_every\": 3},", "",
         "moe.moe_every 3: expected 1 to the 2 blocks"},
        {1, "\"moe\": {\"num_experts\": 4, \"ep_size\": 2},", "",
         "moe.ep_size 2: the expert-parallel group is the data-parallel ranks, 1 here"},
        {1, "\"moe\": {\"num_experts\": 4, \"use_rts\": true},", "", "moe.use_rts: true is not built"},
        {1, "", "--experts 4 --precision bf16", "moe.num_experts 4 with --precision bf16 or fp16"},
        {1, "", "--experts 4 --top-k 2 --accumulate 2",
         "moe.num_experts 4 with --accumulate above 1"},
        {2, "\"moe\": {\"num_experts\": 4, \"ep_size\": 2},", "",
         "expert parallelism over the data-parallel ranks is not built yet"},
    };
    for (size_t c = 0; c < ARRAY_SIZE(cases); c++) {
        config(cfg, sizeof(cfg), cases[c].extra);
        int r = cases[c].n == 1
                    ? run(&o, "train --config %s --data " DATA " --steps 1 %s", cfg, cases[c].args)
                    : run(&o, "launch -n %d -- %s train --config %s --data " DATA " --steps 1 %s",
                          cases[c].n, getenv("ZINF_BIN"), cfg, cases[c].args);
        cr_expect_neq(r, 0, "case %zu: %s", c, o);
        cr_expect(strstr(o, cases[c].want), "case %zu: no '%s' in: %s", c, cases[c].want, o);
        free(o);
    }
    /* --experts 0 (and no moe section) is the dense GPT: it runs. */
    config(cfg, sizeof(cfg), "");
    int r = run(&o, "train --config %s --data " DATA " --steps 1 --experts 0", cfg);
    cr_expect_eq(r, 0, "%s", o);
    free(o);
}

/* One step's line of a --log file. */
struct step_line {
    char loss[40];
    double aux;
    int used, experts;
    unsigned long long read;
};

/* The step lines of the log at path into out (at most max); their count. */
static int read_log(const char *path, struct step_line *out, int max)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    char line[8192];
    int n = 0;
    while (fgets(line, sizeof(line), f) && n < max) {
        if (strncmp(line, "{\"step\":", 8)) continue;
        struct step_line *s = &out[n++];
        const char *l = strstr(line, "\"loss\":"), *a = strstr(line, "\"moe_aux_loss\":"),
                   *u = strstr(line, "\"experts_used\":"), *e = strstr(line, "\"experts\":"),
                   *r = strstr(line, "\"expert_bytes_read\":");
        cr_assert(l && a && u && e && r, "a step line without the MoE fields: %s", line);
        cr_assert_eq(sscanf(l + 7, "%39[^,]", s->loss), 1);
        s->aux = strtod(a + 15, NULL);
        s->used = atoi(u + 15);
        s->experts = atoi(e + 10);
        s->read = strtoull(r + 20, NULL, 10);
    }
    fclose(f);
    return n;
}

/* A run of `steps` with the MoE settings in args, the parameters on NVMe (under swap) or in
 * memory (swap NULL); its step lines into out. */
static int train_run(const char *name, const char *swap, const char *args, int steps,
                     struct step_line *out)
{
    char cfg[4096], log[4096], *o;
    char extra[2048] = "";
    if (swap)
        snprintf(extra, sizeof(extra),
                 "\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", "
                 "\"nvme_path\": \"%s\"}},",
                 swap);
    config(cfg, sizeof(cfg), extra);
    snprintf(log, sizeof(log), "%s/%s.jsonl", dir, name);
    int r = run(&o, "train --config %s --data " DATA " --steps %d --log %s %s", cfg, steps,
                log, args);
    cr_assert_eq(r, 0, "%s: %s", name, o);
    free(o);
    return read_log(log, out, steps);
}

Test(moe_train, the_losses_are_the_same_bits_in_memory_and_on_nvme_and_go_down)
{
    struct step_line mem[3], nv[3], again[3];
    char swap[4096];
    const char *args = "--experts 4 --top-k 2 --precision fp32 --lr 3e-3";
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    cr_assert_eq(train_run("mem", NULL, args, 3, mem), 3);
    cr_assert_eq(train_run("nvme", swap, args, 3, nv), 3);
    cr_assert_eq(train_run("again", NULL, args, 3, again), 3);
    for (int s = 0; s < 3; s++) {
        cr_expect_str_eq(mem[s].loss, nv[s].loss, "step %d: in memory %s, on NVMe %s", s + 1,
                         mem[s].loss, nv[s].loss);
        cr_expect_str_eq(mem[s].loss, again[s].loss, "step %d: run to run %s, %s", s + 1,
                         mem[s].loss, again[s].loss);
        cr_expect_eq(mem[s].experts, 8, "step %d: 4 experts x 2 blocks, not %d", s + 1,
                     mem[s].experts);
        cr_expect(mem[s].aux > 0, "step %d: no balancing loss", s + 1);
        cr_expect_eq(mem[s].read, 0, "in memory, nothing is read from NVMe");
    }
    cr_expect(strtod(mem[2].loss, NULL) < strtod(mem[0].loss, NULL), "the loss %s -> %s",
              mem[0].loss, mem[2].loss);
}

Test(moe_train, nvme_reads_follow_the_experts_a_step_routes_to)
{
    struct step_line st[4];
    char swap[4096];
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    micro = 1; /* batch 1 of seq 8: 8 tokens a block */
    int n = train_run("reads", swap, "--experts 8 --top-k 1 --precision fp32", 4, st);
    cr_assert_eq(n, 4);
    /* One expert of dim 32: fc (128,32)+(128), proj (32,128)+(32) fp32, each tensor read in
     * 4 KiB units: 40 KiB; 8 per block, 2 blocks. The first step reads the experts it uses
     * (the device tier keeps them for the next). */
    unsigned long long one = 40 * 1024, all = 16 * one;
    cr_expect(st[0].read > 0 && st[0].read <= (unsigned long long)st[0].used * one,
              "step 1: %d experts used, %llu bytes read", st[0].used, st[0].read);
    bool fewer = false;
    for (int s = 0; s < n; s++) {
        cr_expect_eq(st[s].experts, 16);
        cr_expect(st[s].used >= 2 && st[s].used <= 16, "step %d: %d used", s + 1, st[s].used);
        if (st[s].used < st[s].experts) {
            fewer = true;
            cr_expect_lt(st[s].read, all, "step %d: %d of 16 experts used, %llu bytes read",
                         s + 1, st[s].used, st[s].read);
        }
    }
    cr_expect(fewer, "8 tokens over 8 experts in each of 2 blocks: some expert had none");
}

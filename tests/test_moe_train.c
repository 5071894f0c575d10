/*
 * test_moe_train.c - mixture of experts in zinf train, through the binary as a user runs it:
 * the settings from the command line and the config's moe section, and the refusals that
 * name the key or option a run cannot have with MoE blocks.
 *
 * Not here: the MoE math (test_moe.c), the block halves it rests on (test_train_ops.c), the
 * config reader's own checks of the section (test_config.c). Training a model with MoE
 * blocks is refused for now, and so is tested as a refusal.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "helpers.h"

static char *dir;

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
            "{%s \"train_micro_batch_size_per_gpu\": 2, \"zinf\": {\"device\": \"emulated\", "
            "\"train\": {\"layers\": 2, \"dim\": 32, \"heads\": 2, \"seq\": 8}}}",
            extra);
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
        {1, "", "--experts 4 --top-k 2", "moe.num_experts 4: training MoE blocks is not built yet"},
        {1, "\"moe\": {\"num_experts\": 8},", "", "moe.num_experts 8: training MoE blocks"},
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

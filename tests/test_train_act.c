/*
 * test_train_act.c - the activation checkpoints offloaded (zinf.train.activation_offload,
 * activation_checkpointing.cpu_checkpointing): a run whose host budget cannot hold them is
 * refused without a swap directory, naming the way out, and with one trains with them on
 * NVMe, the same losses and digests bit for bit as with budgets that hold everything; a run
 * resumed with its checkpoints homed elsewhere goes on with the same bits; the keys act,
 * and disagreeing ones are refused by name.
 *
 * Not here: the engine's eviction and write-back themselves (test_engine.c), pipeline stages
 * and GPU ranks (tests/cuda_emu/ranks.sh runs them with the same code path).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common.h"
#include "helpers.h"
#include "train/trainer.h"

#define STEPS 4

static char *dir;
static char data_path[4096];

static void setup(void)
{
    dir = test_tmpdir("train_act");
    cr_assert_not_null(dir);
    test_write_training_text(dir, data_path, sizeof(data_path));
}

static void teardown(void)
{
    test_leak_check();
    test_rmtree(dir);
}

TestSuite(act, .init = setup, .fini = teardown, .timeout = 120);

/* dir/tag.json: everything homed on the device (stage 0, no offload) within device_bytes,
 * the host tier of host_bytes, a swap directory dir/tag-swap when swap, and extra keys
 * (", ..." inside zinf.train, then top-level ones after ";"). */
static void write_config(char *path, size_t n, const char *tag, const char *device_bytes,
                         const char *host_bytes, bool swap, const char *train, const char *top)
{
    char sw[4200] = "";
    snprintf(path, n, "%s/%s.json", dir, tag);
    if (swap) snprintf(sw, sizeof(sw), ", \"nvme_paths\": \"%s/%s-swap\"", dir, tag);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"stage\": 0},"
            " \"aio\": {\"block_size\": 65536, \"queue_depth\": 8},"
            " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"%s\","
            " \"host_bytes\": \"%s\"%s, \"train\": {\"checkpoint_start\": true%s}}%s}",
            device_bytes, host_bytes, sw, train ? train : "", top ? top : "");
    fclose(f);
}

/* 6 blocks of width 64 over (4, 128): seven checkpoints of 128 KiB, 896 KiB in all, beside
 * 5.66 MiB of model state homed on the device. */
static struct trainer_opts model(const char *config)
{
    struct trainer_opts o;
    trainer_opts_defaults(&o);
    o.config_path = config;
    o.data_path = data_path;
    o.model.L = 6;
    o.model.C = 64;
    o.model.NH = 4;
    o.seq = 128;
    o.batch = 4;
    o.steps = STEPS;
    o.lr = 3e-3f;
    o.seed = 7;
    o.digest = true;
    return o;
}

/* The smallest device budget of this model with its checkpoints off the device: the device
 * holds two of them at once, so the others are evicted and written back. */
#define TIGHT_DEVICE "6197248"

/* Steps [from, to] of o: losses and digests by step - 1; the NVMe bytes read, if asked. */
static void run(struct trainer_opts *o, int from, int to, float *loss, uint64_t *dg,
                double *nvme_read)
{
    struct trainer *t = NULL;
    char err[1024];
    int r = trainer_open(o, &t, err, sizeof(err));
    cr_assert_eq(r, 0, "trainer_open: %s (%s)", err, zinf_strerror(r));
    for (int s = from; s <= to; s++) {
        struct trainer_step_stats st;
        cr_assert_eq(trainer_next_step(t), s);
        cr_assert_eq(trainer_step(t, &st), 0, "step %d", s);
        cr_assert(st.have_digest && !st.update_pending, "step %d: no digest", s);
        loss[s - 1] = st.loss;
        dg[s - 1] = st.digest;
        if (nvme_read) *nvme_read += st.nvme_read_GBps * st.seconds;
    }
    cr_assert_eq(trainer_checkpoint(t), 0);
    trainer_close(t);
}

static void expect_same(const float *la, const uint64_t *da, const float *lb, const uint64_t *db,
                        const char *what)
{
    for (int i = 0; i < STEPS; i++) {
        cr_expect(memcmp(&la[i], &lb[i], sizeof(float)) == 0, "%s, step %d: loss %.9g, %.9g",
                  what, i + 1, la[i], lb[i]);
        cr_expect_eq(da[i], db[i], "%s, step %d: digest %016llx, %016llx", what, i + 1,
                     (unsigned long long)da[i], (unsigned long long)db[i]);
    }
}

/* Where trainer_plan puts the checkpoints for config (0 device, 1 host, 2 NVMe). */
static int planned_home(const char *config)
{
    struct trainer_opts o = model(config);
    struct trainer_plan p;
    char err[1024];
    int r = trainer_plan(&o, &p, err, sizeof(err));
    cr_assert_eq(r, 0, "trainer_plan: %s", err);
    return p.act_tier;
}

/* The in-memory run every other is compared with. */
static void reference(float *loss, uint64_t *dg)
{
    char cfg[4096];
    write_config(cfg, sizeof(cfg), "mem", "256M", "64M", false, NULL, NULL);
    struct trainer_opts o = model(cfg);
    run(&o, 1, STEPS, loss, dg, NULL);
}

Test(act, refused_without_nvme_offloaded_with_it_bitwise)
{
    char cfg[4096], err[1024];
    float la[STEPS], lb[STEPS];
    uint64_t da[STEPS], db[STEPS];
    struct trainer *t = NULL;
    reference(la, da);

    /* The host budget below the checkpoints, no swap directory: refused up front, the
     * checkpoints named with the way out. */
    write_config(cfg, sizeof(cfg), "nohost", TIGHT_DEVICE, "256K", false, NULL, NULL);
    struct trainer_opts o = model(cfg);
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -EINVAL);
    cr_expect(strstr(err, "zinf.host_bytes: 256 KiB is too small"), "%s", err);
    cr_expect(strstr(err, "the activation checkpoints take 896 KiB of the host tier"), "%s", err);
    cr_expect(strstr(err, "zinf.train.activation_offload \"auto\""), "%s", err);

    /* With one, the run trains with its checkpoints on NVMe, within device and host budgets
     * that cannot hold them, and reads them back. */
    write_config(cfg, sizeof(cfg), "off", TIGHT_DEVICE, "256K", true, NULL, NULL);
    cr_expect_eq(planned_home(cfg), 2);
    o = model(cfg);
    double read = 0;
    run(&o, 1, STEPS, lb, db, &read);
    expect_same(la, da, lb, db, "in memory, offloaded");
    cr_expect_gt(read, 0, "the checkpoints come back from NVMe");

    /* Asked for, with room to spare. */
    write_config(cfg, sizeof(cfg), "asked", "256M", "64M", true,
                 ", \"activation_offload\": \"nvme\"", NULL);
    cr_expect_eq(planned_home(cfg), 2);
    o = model(cfg);
    run(&o, 1, STEPS, lb, db, NULL);
    expect_same(la, da, lb, db, "in memory, \"nvme\"");
}

/* Resumed with the checkpoints homed elsewhere than the saved run's: re-registered there,
 * and the steps go on with the same bits (both ways). */
Test(act, resume_with_the_checkpoints_moved)
{
    char cfg[4096];
    float la[STEPS], lb[STEPS], lc[STEPS];
    uint64_t da[STEPS], db[STEPS], dc[STEPS];
    reference(la, da);

    write_config(cfg, sizeof(cfg), "r1", "256M", "64M", true,
                 ", \"activation_offload\": \"host\"", NULL);
    cr_expect_eq(planned_home(cfg), 1);
    struct trainer_opts o = model(cfg);
    run(&o, 1, STEPS / 2, lb, db, NULL);
    /* The same swap directory, the checkpoints now on NVMe. (The saved run's host-homed
     * tensors come back into the host tier at open, so its budget still holds them.) */
    write_config(cfg, sizeof(cfg), "r1", TIGHT_DEVICE, "64M", true,
                 ", \"activation_offload\": \"nvme\"", NULL);
    o = model(cfg);
    o.resume = true;
    run(&o, STEPS / 2 + 1, STEPS, lb, db, NULL);
    expect_same(la, da, lb, db, "uninterrupted, host then NVMe");

    write_config(cfg, sizeof(cfg), "r2", TIGHT_DEVICE, "256K", true, NULL, NULL);
    o = model(cfg);
    run(&o, 1, STEPS / 2, lc, dc, NULL);
    write_config(cfg, sizeof(cfg), "r2", "256M", "64M", true, ", \"activation_offload\": \"host\"",
                 NULL);
    o = model(cfg);
    o.resume = true;
    run(&o, STEPS / 2 + 1, STEPS, lc, dc, NULL);
    expect_same(la, da, lc, dc, "uninterrupted, NVMe then host");
}

Test(act, config_keys_act_and_disagreements_are_named)
{
    char cfg[4096], err[1024];
    float la[STEPS], lb[STEPS];
    uint64_t da[STEPS], db[STEPS];
    struct trainer *t = NULL;
    struct trainer_opts o;

    /* DeepSpeed's default place, asked for: the device; the rest read and named ignored. */
    write_config(cfg, sizeof(cfg), "dev", "256M", "64M", false, NULL,
                 ", \"activation_checkpointing\": {\"cpu_checkpointing\": false,"
                 " \"partition_activations\": true, \"contiguous_memory_optimization\": true,"
                 " \"number_checkpoints\": null, \"synchronize_checkpoint_boundary\": false,"
                 " \"profile\": true}");
    cr_expect_eq(planned_home(cfg), 0);
    reference(la, da);
    o = model(cfg);
    run(&o, 1, STEPS, lb, db, NULL);
    expect_same(la, da, lb, db, "in memory, on the device");

    /* cpu_checkpointing true: off the device, spilled to NVMe when the host cannot hold
     * them; with room, in the host tier. */
    write_config(cfg, sizeof(cfg), "cpu", TIGHT_DEVICE, "256K", true, NULL,
                 ", \"activation_checkpointing\": {\"cpu_checkpointing\": true}");
    cr_expect_eq(planned_home(cfg), 2);
    write_config(cfg, sizeof(cfg), "cpu2", "256M", "64M", true, NULL,
                 ", \"activation_checkpointing\": {\"cpu_checkpointing\": true}");
    cr_expect_eq(planned_home(cfg), 1);

    /* The device budget cannot hold them there: refused, naming the device budget. */
    write_config(cfg, sizeof(cfg), "devsmall", TIGHT_DEVICE, "64M", false,
                 ", \"activation_offload\": \"device\"", NULL);
    o = model(cfg);
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -EINVAL);
    cr_expect(strstr(err, "zinf.device_bytes"), "%s", err);

    /* The two keys disagree. */
    write_config(cfg, sizeof(cfg), "both", "256M", "64M", true, ", \"activation_offload\": \"nvme\"",
                 ", \"activation_checkpointing\": {\"cpu_checkpointing\": false}");
    o = model(cfg);
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -EINVAL);
    cr_expect(strstr(err, "activation_checkpointing.cpu_checkpointing false and "
                          "zinf.train.activation_offload \"nvme\" disagree"),
              "%s", err);

    /* "nvme" without a swap directory. */
    write_config(cfg, sizeof(cfg), "noswap", "256M", "64M", false,
                 ", \"activation_offload\": \"nvme\"", NULL);
    o = model(cfg);
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -EINVAL);
    cr_expect(strstr(err, "zinf.train.activation_offload is \"nvme\" but no nvme_path"), "%s",
              err);

    /* A value it does not know, named with its path. */
    write_config(cfg, sizeof(cfg), "bad", "256M", "64M", false,
                 ", \"activation_offload\": \"disk\"", NULL);
    o = model(cfg);
    cr_assert_lt(trainer_open(&o, &t, err, sizeof(err)), 0);
    cr_expect(strstr(err, "zinf.train.activation_offload"), "%s", err);
}

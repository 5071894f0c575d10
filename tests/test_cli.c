/*
 * test_cli.c - the zinf command line as a user runs it: exit codes, the bench rows and
 * their verification, JSON output, and the error messages for bad arguments. The binary
 * comes from $ZINF_BIN (set by meson).
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"
#include "tiers/cuda_probe.h"
#include "common.h"
#include "service/client.h"
#include "service/proto.h"
#include "zinf.h"
#include "zinf_build.h"
#include "train/digest.h"
#include "train/gpt.h"
#include "train/trainer.h"

static char *dir;

static void setup(void)
{
    dir = test_tmpdir("cli");
    cr_assert_not_null(dir);
}

static char mounted[4096]; /* a tmpfs a test mounted under dir, to unmount */

static void teardown(void)
{
    test_leak_check();
    if (mounted[0] && umount2(mounted, MNT_DETACH) != 0)
        cr_log_warn("umount %s: %s", mounted, strerror(errno));
    mounted[0] = '\0';
    test_rmtree(dir);
}

TestSuite(cli, .init = setup, .fini = teardown, .timeout = 120);

/* zinf ARGS, stdout and stderr in *out: the exit status (helpers.c). */
#define run test_run_zinf

Test(cli, help_version_unknown)
{
    char *o;
    cr_assert_eq(run(&o, "help"), 0);
    cr_assert(strstr(o, "bench") && strstr(o, "config"));
    free(o);
    cr_assert_eq(run(&o, "version"), 0);
    cr_assert(strstr(o, "zinf 0."), "%s", o);
    cr_assert(strstr(o, ZINF_HAVE_KERNELS ? "kernels: built" : "kernels: not built"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "frobnicate"), 2);
    cr_assert(strstr(o, "unknown command 'frobnicate'"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "%s", ""), 2); /* no command */
    free(o);
}

Test(cli, bench_rows_are_verified)
{
    char *o;
    cr_assert_eq(
        run(&o, "bench --path %s --size 8M --block-size 256K --queue-depth 4 --baseline", dir), 0,
        "%s", o);
    cr_assert(strstr(o, "# backend ") && strstr(o, "dev_reqs"), "%s", o);
    /* Four rows (zinf write/read, pread write/read), each verified. */
    int rows = 0;
    for (char *l = strtok(o, "\n"); l; l = strtok(NULL, "\n")) {
        if (l[0] == '#') continue;
        rows++;
        cr_assert(strstr(l, " 8388608 ") && strstr(l, " ok"), "row: %s", l);
    }
    cr_assert_eq(rows, 4);
    free(o);
    /* The buffers use huge pages unless asked not to, and the header says which. */
    cr_assert_eq(run(&o, "bench --path %s --size 4M --block-size 256K --no-huge-pages", dir), 0,
                 "%s", o);
    cr_assert(strstr(o, "huge pages no (--no-huge-pages)"), "%s", o);
    free(o);
    /* The file is removed afterwards unless --keep. */
    char path[4096];
    snprintf(path, sizeof(path), "%s/zinf-bench.dat", dir);
    cr_assert_neq(access(path, F_OK), 0);
}

Test(cli, bench_json_and_read_alone)
{
    char *o;
    /* --read alone writes the file it needs first, and reports only the read. */
    cr_assert_eq(run(&o, "bench --path %s --size 4M --block-size 128K --read --json --keep", dir),
                 0, "%s", o);
    cr_assert(strstr(o, "\"op\": \"read\"") && strstr(o, "\"verified\": true"), "%s", o);
    cr_assert_null(strstr(o, "\"op\": \"write\""), "%s", o);
    cr_assert(strstr(o, "\"block_size\": 131072") && strstr(o, "\"queue_depth\": 32"), "%s", o);
    cr_assert(strstr(o, "\"GBps\": ") && strstr(o, "\"bytes\": 4194304"), "%s", o);
    /* What reached the block device under the path: null where there is none (tmpfs). */
    cr_assert(strstr(o, "\"device\": null") || strstr(o, "\"avg_request_bytes\": "), "%s", o);
    free(o);
    /* A file that holds something else fails verification instead of passing silently. */
    char cmd[4096];
    snprintf(cmd, sizeof(cmd),
             "dd if=/dev/urandom of=%s/zinf-bench.dat bs=1M count=1 seek=1 "
             "conv=notrunc status=none",
             dir);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(run(&o, "bench --path %s --size 4M --block-size 128K --read --json --keep", dir),
                 1, "%s", o);
    cr_assert(strstr(o, "\"verified\": false") && strstr(o, "\"bad_blocks\": 8"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "bench --path %s --size 4M --block-size 128K --read", dir), 1, "%s", o);
    cr_assert(strstr(o, "FAIL"), "%s", o);
    free(o);
}

/* Every row has IOPS and latency percentiles, like fio's; --random (4K by default) moves
 * each block once in a shuffled order, every byte checked, with and without the engine. */
Test(cli, bench_random_rows_have_iops_and_latency_percentiles)
{
    char *o;
    cr_assert_eq(run(&o, "bench --path %s --size 2M --random --baseline --queue-depth 8 --json",
                     dir),
                 0, "%s", o);
    int rows = 0;
    for (char *line = strtok(o, "\n"); line; line = strtok(NULL, "\n")) {
        json_t *j = json_loads(line, 0, NULL);
        cr_assert_not_null(j, "%s", line);
        cr_expect(json_is_true(json_object_get(j, "random")), "%s", line);
        cr_expect(json_is_true(json_object_get(j, "verified")), "%s", line);
        cr_expect_eq(json_integer_value(json_object_get(j, "block_size")), 4096, "%s", line);
        cr_expect_eq(json_integer_value(json_object_get(j, "requests")), 512, "%s", line);
        cr_expect_gt(json_number_value(json_object_get(j, "iops")), 0, "%s", line);
        json_t *l = json_object_get(j, "lat_us");
        double p50 = json_number_value(json_object_get(l, "p50")),
               p90 = json_number_value(json_object_get(l, "p90")),
               p99 = json_number_value(json_object_get(l, "p99")),
               p999 = json_number_value(json_object_get(l, "p99.9"));
        cr_expect(p50 > 0 && p50 <= p90 && p90 <= p99 && p99 <= p999, "%s", line);
        json_decref(j);
        rows++;
    }
    cr_expect_eq(rows, 4); /* zinf and pread, write and read */
    free(o);
    cr_assert_eq(run(&o, "bench --path %s --size 1M --random --block-size 64K", dir), 0, "%s", o);
    cr_assert(strstr(o, "p99.9") && strstr(o, "--random: the blocks in a random order"), "%s", o);
    free(o);
}

Test(cli, bench_threads_backend)
{
    char *o;
    cr_assert_eq(run(&o, "bench --path %s --size 4M --backend threads", dir), 0, "%s", o);
    cr_assert(strstr(o, "backend threads"), "%s", o);
    free(o);
}

Test(cli, bench_bad_arguments)
{
    static const struct {
        const char *args;
        const char *msg;
    } bad[] = {
        {"bench", "--path DIR is required"},
        {"bench --path /nonexistent/zinf", "--path /nonexistent/zinf: No such file"},
        {"bench --path %s --size lots", "--size: expected a size like 4G, got 'lots'"},
        {"bench --path %s --block-size 1000", "--block-size: must be a multiple of 4096"},
        {"bench --path %s --queue-depth 0", "--queue-depth: must be 1..4096"},
        {"bench --path %s --backend spdk", "--backend: must be io_uring or threads"},
        {"bench --path %s --frob", "unknown or incomplete option '--frob'"},
        {"bench --path %s --size 1000T", "the test needs"},
        {"bench --path %s --random --block-size 2M", "--random: requests of 4K to 1M"},
        {"bench --path %s --random --sweep", "the sweep is sequential"},
        {"bench --path %s --seed x", "--seed: expected a number"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char *o, args[1024];
        snprintf(args, sizeof(args), bad[i].args, dir);
        cr_assert_eq(run(&o, "%s", args), 2, "zinf %s: %s", args, o);
        cr_assert(strstr(o, bad[i].msg), "zinf %s said: %s", args, o);
        free(o);
    }
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

Test(cli, config_check)
{
    char *o, path[4096];
    snprintf(path, sizeof(path), "%s/ds.json", dir);
    write_file(path, "{\"train_batch_size\": 8, \"zero_optimization\": {\"stage\": 3, "
                     "\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": \"/local_nvme\"}}, "
                     "\"aio\": {\"block_size\": 4194304, \"queue_depth\": 16}}");
    cr_assert_eq(run(&o, "config check %s", path), 0, "%s", o);
    cr_assert(strstr(o, "# NVMe: /local_nvme (4 MiB blocks, queue depth 16)"), "%s", o);
    /* The verdict leads, under the title. */
    cr_assert(strstr(o, "\n# verdict: valid for zinf train at 1 rank; zinf acts on every key\n# "
                        "zinf train would run: "), "%s", o);
    /* The stage acts for one rank too: said in the summary, not named as ignored. */
    cr_assert(strstr(o, "# ZeRO stage 3, one rank: it holds its whole partition"), "%s", o);
    cr_assert_null(strstr(o, "zero_optimization.stage ("), "%s", o);
    /* Without --all, no table of every setting, no engine options. */
    cr_assert_null(strstr(o, "# default"), "%s", o);
    cr_assert_null(strstr(o, "# engine options"), "%s", o);
    cr_assert_null(strstr(o, "aio.block_size = "), "%s", o);
    free(o);
    /* With it, the table follows the summary, whose lines all come before any setting. */
    cr_assert_eq(run(&o, "config check --all %s", path), 0, "%s", o);
    const char *table = strstr(o, "# every setting, defaults included (--all):\n");
    const char *dflt = strstr(o, "  # default\n");
    cr_assert(table && dflt && table < dflt, "%s", o);
    static const char *const summary[] = {
        "# zinf config check ", "# zinf train would run: ", "# ZeRO stage 3", "# precision: ",
        "# optimizer: AdamW", "# schedule: constant lr", "# parameters: on NVMe",
        "# optimizer states (Adam's moments", "# NVMe: /local_nvme", "# budgets: device ",
        "# batch: micro-batch "};
    for (size_t i = 0; i < ARRAY_SIZE(summary); i++) {
        const char *at = strstr(o, summary[i]);
        cr_assert(at && at < table, "'%s' is not in the summary before the settings:\n%s",
                  summary[i], o);
    }
    cr_assert(strstr(table, "\nzero_optimization.stage = 3\n") &&
                  strstr(table, "\naio.block_size = 4194304\n") &&
                  strstr(table, "\naio.intra_op_parallelism = 1  # default\n") &&
                  strstr(table, "\n# engine options\n") &&
                  strstr(table, "\nengine.block_size = 4194304  # 4 MiB\n"),
              "%s", o);
    free(o);

    write_file(path, "{\"aio\": {\"block_size\": 1000}}");
    cr_assert_eq(run(&o, "config check %s", path), 2, "%s", o);
    cr_assert(strstr(o, "aio.block_size: must be a multiple of 4096, got 1000"), "%s", o);
    free(o);

    write_file(path, "{\"aio\": {\"queue_depht\": 8}}");
    cr_assert_eq(run(&o, "config check %s", path), 0, "%s", o);
    cr_assert(strstr(o, "aio.queue_depht"), "an unknown key is named: %s", o);
    cr_assert(strstr(o, "# verdict: valid for zinf train at 1 rank; 0 keys ignored and 1 unknown, "
                        "listed below\n"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "config check --strict %s", path), 2, "%s", o);
    cr_assert(strstr(o, "# verdict: refused (--strict): 1 unknown key, listed below\n"), "%s", o);
    free(o);

    cr_assert_eq(run(&o, "config check %s/missing.json", dir), 2, "%s", o);
    cr_assert(strstr(o, "missing.json"), "%s", o);
    free(o);

    /* A config for 2 ranks (4 = 1 x 2 x 2): refused as one rank, with how to run and check
     * it; good with --ranks 2, or under zinf launch (WORLD_SIZE). */
    write_file(path, "{\"train_batch_size\": 4, \"train_micro_batch_size_per_gpu\": 1, "
                     "\"gradient_accumulation_steps\": 2}");
    cr_assert_eq(run(&o, "config check %s", path), 2, "%s", o);
    cr_assert(strstr(o, "train_batch_size 4 is not the micro batch 1 x 2 gradient accumulation "
                        "steps x 1 rank; a config for 2 ranks? (zinf launch -n 2 runs it; zinf "
                        "config check --ranks 2 checks it)"),
              "%s", o);
    free(o);
    cr_assert_eq(run(&o, "config check %s --ranks 2", path), 0, "%s", o);
    cr_assert(strstr(o, "batch 1 x 2 accumulated on each rank"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "config check --ranks 3 %s", path), 2, "%s", o);
    cr_assert(strstr(o, "x 3 ranks"), "%s", o);
    free(o);
    setenv("WORLD_SIZE", "2", 1);
    cr_assert_eq(run(&o, "config check %s", path), 0, "%s", o);
    free(o);
    setenv("WORLD_SIZE", "two", 1);
    cr_assert_eq(run(&o, "config check %s", path), 2, "%s", o);
    cr_assert(strstr(o, "WORLD_SIZE 'two' is not a number of ranks in 1..64"), "%s", o);
    free(o);
    /* --ranks says otherwise, and help is help whatever the environment holds. */
    cr_assert_eq(run(&o, "config check %s --ranks 2", path), 0, "%s", o);
    free(o);
    cr_assert_eq(run(&o, "config check --help"), 0, "%s", o);
    free(o);
    unsetenv("WORLD_SIZE");
    static const char *const bad[] = {"--ranks 0", "--ranks 65", "--ranks x", "--ranks 2x"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_assert_eq(run(&o, "config check %s %s", path, bad[i]), 2, "%s", o);
        cr_assert(strstr(o, "--ranks: a number of ranks in 1..64"), "%s: %s", bad[i], o);
        free(o);
    }
    cr_assert_eq(run(&o, "config check %s --ranks", path), 2, "%s", o);
    cr_assert(strstr(o, "--ranks: a number of ranks in 1..64, got ''"), "%s", o);
    free(o);
}

/* The text after "PATH: " on the line of out that holds it, for comparing two commands'
 * messages about one file. */
static char *message_about(const char *out, const char *path)
{
    char key[4200];
    snprintf(key, sizeof(key), "%s: ", path);
    const char *p = strstr(out, key);
    if (!p) return strdup("(no message)");
    p += strlen(key);
    return strndup(p, strcspn(p, "\n"));
}

/* One validator: what zinf train refuses for a config reason, zinf config check refuses
 * too, with the same message and exit status 2; --strict is the same in both; and train
 * warns of an unknown key once. */
Test(cli, config_check_and_train_agree)
{
    static const char *const cases[][2] = {
        {"{\"optimizer\": {\"type\": \"Lion\", \"params\": {\"lr\": 0.001}}}",
         "optimizer.type \"Lion\""},
        {"{\"scheduler\": {\"type\": \"OneCycle\"}}", "cycle_min_lr and cycle_max_lr"},
        {"{\"optimizer\": {\"type\": \"Lamb\", \"params\": {\"adam_w_mode\": false}}}",
         "adam_w_mode is Adam's"},
        {"{\"optimizer\": {\"type\": \"Adam\", \"params\": {\"max_coeff\": 0.3}}}",
         "max_coeff is Lamb's"},
        {"{\"optimizer\": {\"type\": \"Lamb\", \"params\": {\"max_coeff\": 0.001}}}",
         "Lamb's min_coeff 0.01 and max_coeff 0.001"},
        {"{\"scheduler\": {\"type\": \"OneCycle\", \"params\": {\"cycle_min_lr\": 0.1, "
         "\"cycle_max_lr\": 1, \"cycle_min_mom\": 1.2}}}",
         "OneCycle's momentum reaches 1.2 at step 1"},
        {"{\"train_batch_size\": 7, \"train_micro_batch_size_per_gpu\": 2}",
         "train_batch_size 7 is not the micro batch 2"},
        {"{\"zinf\": {\"train\": {\"dim\": 100, \"heads\": 3}}}",
         "zinf.train.heads 3 does not divide zinf.train.dim 100"},
        {"{\"scheduler\": {\"type\": \"WarmupDecayLR\"}}", "total_num_steps"},
        {"{\"train_micro_batch_size_per_gpu\": 2, \"zinf\": {\"train\": {\"batch\": 3}}}",
         "disagree"},
        {"{\"fp16\": {\"enabled\": true}, \"bf16\": {\"enabled\": true}}", "both true"},
    };
    char *o, path[4096];
    snprintf(path, sizeof(path), "%s/refused.json", dir);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        write_file(path, cases[i][0]);
        cr_assert_eq(run(&o, "config check %s", path), 2, "%s: %s", cases[i][0], o);
        cr_assert(strstr(o, cases[i][1]), "%s: %s", cases[i][0], o);
        char *said = message_about(o, path);
        free(o);
        cr_assert_eq(run(&o, "train --config %s --data %s --steps 1", path, path), 2, "%s: %s",
                     cases[i][0], o);
        char *train_said = message_about(o, path);
        cr_assert_str_eq(said, train_said, "config check and train differ on %s", cases[i][0]);
        free(said);
        free(train_said);
        free(o);
    }

    /* A typo: a warning once, in each; an error with --strict, in each. */
    snprintf(path, sizeof(path), "%s/typo.json", dir);
    write_file(path, "{\"zero_optimization\": {\"offload_parm\": {\"device\": \"cpu\"}}, "
                     "\"zinf\": {\"train\": {\"layers\": 1, \"dim\": 32, \"heads\": 2, "
                     "\"seq\": 16, \"batch\": 1}}}");
    cr_assert_eq(run(&o, "train --config %s --data %s --steps 1", path, path), 0, "%s", o);
    const char *w = strstr(o, "offload_parm: unknown key");
    cr_assert(w && !strstr(w + 1, "offload_parm: unknown key"), "one warning: %s", o);
    cr_assert(strstr(o, "did you mean \"offload_param\""), "%s", o);
    /* Nothing is offloaded to the host: pin_memory's default says nothing, no notice. */
    cr_assert_null(strstr(o, "runs unpinned"), "%s", o);
    free(o);
    /* The optimizer offloaded to an unpinned host beside an emulated device tier: pinning
     * would buy its memcpy nothing, so no notice either. */
    snprintf(path, sizeof(path), "%s/unpinned.json", dir);
    write_file(path, "{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"cpu\"}}, "
                     "\"zinf\": {\"device\": \"emulated\", \"train\": {\"layers\": 1, "
                     "\"dim\": 32, \"heads\": 2, \"seq\": 16, \"batch\": 1}}}");
    cr_assert_eq(run(&o, "train --config %s --data %s --steps 1", path, path), 0, "%s", o);
    cr_assert_null(strstr(o, "runs unpinned"), "%s", o);
    free(o);
    /* Beside a GPU, with pin_memory left unset, it applies, once; "pin_memory": false is the
     * user's choice and says nothing. */
    struct cuda_probe_info ci;
    if (ZINF_HAVE_CUDA && test_cuda_probe_forked(&ci) > 0) {
        static const char *const pins[] = {"", ", \"pin_memory\": false"};
        for (size_t k = 0; k < ARRAY_SIZE(pins); k++) {
            char text[1024];
            snprintf(text, sizeof(text),
                     "{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"cpu\"%s}}, "
                     "\"zinf\": {\"device\": \"cuda\", \"train\": {\"layers\": 1, "
                     "\"dim\": 32, \"heads\": 2, \"seq\": 16, \"batch\": 1}}}",
                     pins[k]);
            write_file(path, text);
            cr_assert_eq(run(&o, "train --config %s --data %s --steps 1", path, path), 0, "%s", o);
            const char *at = strstr(o, "the host tier runs unpinned (pin_memory is false, its "
                                       "default)");
            if (k == 0)
                cr_assert(at && !strstr(at + 1, "runs unpinned"), "once: %s", o);
            else
                cr_assert_null(strstr(o, "runs unpinned"), "%s", o);
            free(o);
        }
    }
    snprintf(path, sizeof(path), "%s/typo.json", dir);
    cr_assert_eq(run(&o, "train --config %s --data %s --steps 1 --strict", path, path), 2, "%s",
                 o);
    cr_assert(strstr(o, "1 unknown key (--strict)"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "config check --strict %s", path), 2, "%s", o);
    cr_assert(strstr(o, "1 unknown key (--strict)"), "%s", o);
    free(o);
}

/* The real configs of tests/data/configs (DeepSpeed's, DeepSpeedExamples', Hugging Face's
 * and Accelerate's; SOURCES.md names each): config check and train --dry-run agree on every
 * one, in exit status and message. */
Test(cli, config_check_and_train_agree_on_real_configs)
{
    char folder[4096];
    snprintf(folder, sizeof(folder), "%s/configs", getenv("ZINF_TEST_DATA"));
    DIR *d = opendir(folder);
    cr_assert_not_null(d, "%s: %s", folder, strerror(errno));
    int n = 0, refused = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len < 6 || strcmp(de->d_name + len - 5, ".json")) continue;
        char path[8192], *o;
        snprintf(path, sizeof(path), "%s/%s", folder, de->d_name);
        int a = run(&o, "config check %s", path);
        char *said = message_about(o, path);
        free(o);
        int b = run(&o, "train --dry-run --config %s --data %s", path, path);
        char *train_said = message_about(o, path);
        cr_expect_eq(a, b, "%s: config check %d, train %d: %s", de->d_name, a, b, o);
        cr_expect(a == 0 || a == 2, "%s: %d", de->d_name, a);
        cr_expect_str_eq(said, train_said, "%s", de->d_name);
        free(said);
        free(train_said);
        free(o);
        n++;
        refused += a != 0;
    }
    closedir(d);
    cr_expect_geq(n, 12, "%d configs", n);
    cr_expect_lt(refused, n);
}

/* "auto" as Hugging Face's Trainer resolves it: from the values the run uses (an explicit
 * optimizer.params.lr is what warmup_max_lr "auto" becomes), bucket sizes by transformers'
 * formulas, bf16 and fp16 only when asked for; and an explicit config value that an
 * explicit option contradicts is refused, as the Trainer refuses it. */
Test(cli, auto_as_hugging_face_resolves_it)
{
    char *o, path[4096];
    snprintf(path, sizeof(path), "%s/hf.json", dir);
    write_file(path, "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-4}}, "
                     "\"scheduler\": {\"type\": \"WarmupLR\", \"params\": {\"warmup_max_lr\": "
                     "\"auto\", \"warmup_num_steps\": 10}}, \"bf16\": {\"enabled\": \"auto\"}, "
                     "\"zero_optimization\": {\"stage\": 3, \"reduce_bucket_size\": \"auto\", "
                     "\"stage3_prefetch_bucket_size\": \"auto\", "
                     "\"stage3_param_persistence_threshold\": \"auto\"}}");
    cr_assert_eq(run(&o, "config check %s", path), 0, "%s", o);
    static const char *const want[] = {
        "#   scheduler.params.warmup_max_lr = 0.0003\n",
        "#   bf16.enabled = false\n",
        "#   zero_optimization.reduce_bucket_size = 16384\n", /* 128^2 */
        "#   zero_optimization.stage3_prefetch_bucket_size = 14745\n",
        "#   zero_optimization.stage3_param_persistence_threshold = 1280\n",
        "AdamW lr 0.0003 (WarmupLR schedule)"};
    for (size_t i = 0; i < ARRAY_SIZE(want); i++)
        cr_expect(strstr(o, want[i]), "missing %s in:\n%s", want[i], o);
    free(o);
    cr_assert_eq(run(&o, "train --dry-run --config %s --data %s --precision bf16 --dim 64", path,
                     path),
                 0, "%s", o);
    cr_expect(strstr(o, "bf16.enabled = true"), "%s", o);
    cr_expect(strstr(o, "zero_optimization.reduce_bucket_size = 4096"), "%s", o);
    cr_expect(strstr(o, "AdamW lr 0.0003"), "%s", o);
    free(o);
    /* Explicit on both sides and different: refused, naming both. */
    cr_assert_eq(run(&o, "train --dry-run --config %s --data %s --lr 0.001", path, path), 2,
                 "%s", o);
    cr_expect(strstr(o, "the config and the command line disagree: optimizer.params.lr=0.0003 vs "
                        "--lr 0.001 (set these to \"auto\" in the config, or leave the options "
                        "out)"),
              "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --dry-run --config %s --data %s --lr 0.0003", path, path), 0,
                 "%s", o);
    free(o);
    /* Hugging Face's own test configs: "auto" everywhere in the ZeRO-2 one, filled by the
     * options; the ZeRO-3 one gives lr 3e-5, which --lr 0.002 contradicts. */
    cr_assert_eq(run(&o, "train --dry-run --config %s/configs/hf__ds_config_zero3.json --data %s "
                         "--lr 0.002",
                     getenv("ZINF_TEST_DATA"), path),
                 2, "%s", o);
    cr_expect(strstr(o, "optimizer.params.lr=3e-05 vs --lr 0.002"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --dry-run --config %s/configs/hf__ds_config_zero2.json --data %s "
                         "--lr 0.002 --batch 3 --clip 0.5",
                     getenv("ZINF_TEST_DATA"), path),
                 0, "%s", o);
    static const char *const filled[] = {"optimizer.params.lr = 0.002",
                                         "train_micro_batch_size_per_gpu = 3",
                                         "gradient_clipping = 0.5", "fp16.enabled = false",
                                         "scheduler.params.warmup_max_lr = 0.002"};
    for (size_t i = 0; i < ARRAY_SIZE(filled); i++)
        cr_expect(strstr(o, filled[i]), "missing %s in:\n%s", filled[i], o);
    free(o);
}

/* An NVMe offload whose whole state fits the budgets moves nothing to NVMe between
 * checkpoints: train says so; with budgets below the state it does not. */
Test(cli, train_warns_when_an_nvme_offload_fits_in_memory)
{
    char *o, path[4096], swap[4096];
    snprintf(path, sizeof(path), "%s/fits.json", dir);
    snprintf(swap, sizeof(swap), "%s/fits-swap", dir);
    static const char model[] = "\"train\": {\"layers\": 1, \"dim\": 32, \"heads\": 2, "
                                "\"seq\": 16, \"batch\": 1}";
    char text[16384];
    snprintf(text, sizeof(text),
             "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", "
             "\"nvme_path\": \"%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", "
             "\"nvme_path\": \"%s\"}}, \"zinf\": {\"device\": \"emulated\", \"device_bytes\": "
             "\"1M\", \"host_bytes\": \"1M\", %s}}",
             swap, swap, model);
    write_file(path, text);
    cr_assert_eq(run(&o, "train --config %s --data %s --steps 1", path, path), 0, "%s", o);
    cr_assert(strstr(o, "zinf train: warning: the config offloads to NVMe, but the whole model "
                        "state"),
              "%s", o);
    cr_assert(strstr(o, "fits the device and host budgets (1 MiB + 1 MiB)"), "%s", o);
    free(o);
    snprintf(text, sizeof(text),
             "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", "
             "\"nvme_path\": \"%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", "
             "\"nvme_path\": \"%s\"}}, \"zinf\": {\"device\": \"emulated\", \"device_bytes\": "
             "167936, \"host_bytes\": 139264, %s}}",
             swap, swap, model);
    write_file(path, text);
    cr_assert_eq(run(&o, "train --config %s --data %s --steps 1 --overwrite", path, path), 0,
                 "%s", o);
    cr_assert_null(strstr(o, "nothing will move to NVMe"), "%s", o);
    free(o);
}

/* DeepSpeed's LRRangeTest, and --print-lr: min_lr (1 + rate x floor((step - 1) / size)) with
 * the staircase (scripts/check-deepspeed.sh compares every schedule with DeepSpeed's own
 * classes over 1000 steps, bit for bit). */
Test(cli, lr_range_test_schedule)
{
    char *o, path[4096];
    snprintf(path, sizeof(path), "%s/lrr.json", dir);
    write_file(path, "{\"scheduler\": {\"type\": \"LRRangeTest\", \"params\": "
                     "{\"lr_range_test_min_lr\": 0.0001, \"lr_range_test_step_size\": 3, "
                     "\"lr_range_test_step_rate\": 2.0, \"lr_range_test_staircase\": true}}}");
    cr_assert_eq(run(&o, "train --dry-run --config %s --data %s --print-lr 8", path, path), 0,
                 "%s", o);
    cr_expect(strstr(o, "(LRRangeTest schedule)"), "%s", o);
    cr_expect(strstr(o, "lr 1 0.0001\nlr 2 0.0001\nlr 3 0.0001\nlr 4 0.00030000000000000003\n"
                        "lr 5 0.00030000000000000003\nlr 6 0.00030000000000000003\n"
                        "lr 7 0.00050000000000000001\nlr 8 0.00050000000000000001\n"),
              "%s", o);
    free(o);
    /* Without the staircase, a step at a time. */
    write_file(path, "{\"scheduler\": {\"type\": \"LRRangeTest\", \"params\": "
                     "{\"lr_range_test_min_lr\": 0.001, \"lr_range_test_step_size\": 2, "
                     "\"lr_range_test_step_rate\": 1.0}}}");
    cr_assert_eq(run(&o, "train --dry-run --config %s --data %s --print-lr 3", path, path), 0,
                 "%s", o);
    cr_expect(strstr(o, "lr 1 0.001\nlr 2 0.0015\nlr 3 0.002\n"), "%s", o);
    free(o);
    /* Rates are printed by a dry run only: alone, --print-lr is bad usage. */
    cr_assert_eq(run(&o, "train --config %s --data %s --print-lr 3", path, path), 2, "%s", o);
    cr_expect(strstr(o, "--print-lr goes with --dry-run"), "%s", o);
    free(o);
    write_file(path, "{\"scheduler\": {\"type\": \"LRRangeTest\", \"params\": "
                     "{\"lr_range_test_step_size\": 0}}}");
    cr_assert_eq(run(&o, "config check %s", path), 2, "%s", o);
    cr_expect(strstr(o, "scheduler.params.lr_range_test_step_size"), "%s", o);
    free(o);
}

/* The sweep's closing snippet is a config that `zinf config check` takes as it is. */
Test(cli, sweep_snippet_is_a_valid_config)
{
    char *o, path[4096];
    cr_assert_eq(run(&o, "bench --path %s --size 8M --sweep", dir), 0, "%s", o);
    char *snip = strstr(o, "{\"aio\":");
    cr_assert_not_null(snip, "%s", o);
    char *end = strchr(snip, '\n');
    if (end) *end = '\0';
    snprintf(path, sizeof(path), "%s/tuned.json", dir);
    write_file(path, snip);
    free(o);
    cr_assert_eq(run(&o, "config check --strict %s", path), 0, "%s", o);
    free(o);
}

/* ---- zinf tune ------------------------------------------------------------------------ */

/* Runs `cmd` with its output in out_path, waits until that output holds `ready` (the command
 * has put its signal handlers in place), lets it run after_ms more and sends it sig; returns
 * its wait status. A fixed timer instead would, on a loaded machine, signal a command that
 * had not yet started, and find it killed rather than stopped. */
static int run_signalled(const char *cmd, const char *out_path, const char *ready, int sig,
                         int after_ms)
{
    unlink(out_path); /* an earlier run's "ready" must not count */
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || dup2(fd, STDOUT_FILENO) < 0 || dup2(fd, STDERR_FILENO) < 0) _exit(127);
        char line[16384];
        snprintf(line, sizeof(line), "exec %s", cmd);
        execl("/bin/sh", "sh", "-c", line, (char *)NULL);
        _exit(127);
    }
    char text[8192];
    int st = 0;
    for (int i = 0;; i++) {
        cr_assert_lt(i, 6000, "no \"%s\" in a minute from: %s", ready, cmd);
        if (waitpid(pid, &st, WNOHANG) == pid) return st; /* ended before it was ready */
        FILE *f = fopen(out_path, "r");
        size_t n = f ? fread(text, 1, sizeof(text) - 1, f) : 0;
        text[n] = '\0';
        if (f) fclose(f);
        if (strstr(text, ready)) break;
        usleep(10000);
    }
    usleep((useconds_t)after_ms * 1000);
    kill(pid, sig);
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    return st;
}

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    char *buf = calloc(1, 1 << 16);
    fread(buf, 1, (1 << 16) - 1, f);
    fclose(f);
    return buf;
}

/* The last bytes of a command's output file, for an assertion's message (the file goes
 * with the test's folder). */
static const char *tail_text(const char *path)
{
    static char buf[2048];
    buf[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return "(no output file)";
    if (fseek(f, 0, SEEK_END) == 0) {
        long end = ftell(f);
        fseek(f, end > (long)sizeof(buf) - 1 ? end - (long)sizeof(buf) + 1 : 0, SEEK_SET);
    }
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* Pinned buffer bytes of a point, as zinf tune counts them (its tie-break). */
static uint64_t tune_cost(json_t *p)
{
    uint64_t bs = json_integer_value(json_object_get(p, "block_size"));
    uint64_t qd = json_integer_value(json_object_get(p, "queue_depth"));
    uint64_t st = json_integer_value(json_object_get(p, "staging_bytes"));
    uint64_t slots = st ? MAX(4, st / bs) : MAX(4, 2 * qd);
    return slots * bs;
}

/* Runs `zinf tune ... --json`, checks the pick follows the stated rule, and returns the
 * fragment (owned) as the last line printed it. */
static json_t *tune_json(const char *args, const char *sub)
{
    char *o, path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, sub);
    cr_assert_eq(mkdir(path, 0755), 0);
    /* --json: results on stdout, one object a line; progress lines ("tune: ...") on
     * stderr, which run() mixes in. */
    cr_assert_eq(run(&o, "tune --path %s %s --json", path, args), 0, "%s", o);
    json_t *best = NULL, *picked = NULL, *last = NULL, *pts = json_array();
    for (char *save = NULL, *l = strtok_r(o, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        json_error_t je;
        if (l[0] != '{') continue; /* progress, and the engine's notices */
        json_t *j = json_loads(l, 0, &je);
        cr_assert_not_null(j, "not JSON: %s", l);
        if (json_object_get(j, "fragment")) {
            last = j;
            continue;
        }
        cr_assert(json_is_array(json_object_get(j, "scores_GBps")), "%s", l);
        cr_assert_eq(json_array_size(json_object_get(j, "scores_GBps")), 3, "%s", l);
        json_array_append_new(pts, j);
        double med = json_real_value(json_object_get(j, "median_GBps"));
        if (!best || med > json_real_value(json_object_get(best, "median_GBps"))) best = j;
        if (json_is_true(json_object_get(j, "picked"))) {
            cr_assert_null(picked, "two points picked");
            picked = j;
        }
    }
    free(o);
    cr_assert_not_null(last);
    cr_assert_not_null(picked);
    cr_assert_geq(json_array_size(pts), 2);
    /* The rule: a tie is a point whose median is within the best's min..max; the pick is a
     * tie and no tie is cheaper. */
    double best_lo = json_real_value(json_object_get(best, "min_GBps"));
    size_t i;
    json_t *p;
    json_array_foreach(pts, i, p)
    {
        bool tie = json_real_value(json_object_get(p, "median_GBps")) >= best_lo;
        cr_assert_eq(json_is_true(json_object_get(p, "tie")), tie);
        if (tie) cr_assert_geq(tune_cost(p), tune_cost(picked));
    }
    cr_assert(json_is_true(json_object_get(picked, "tie")));
    json_t *frag = json_incref(json_object_get(last, "fragment"));
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(frag, "aio"), "block_size")),
                 json_integer_value(json_object_get(picked, "block_size")));
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(frag, "zinf"), "submit_batch")),
                 json_integer_value(json_object_get(picked, "submit_batch")));
    cr_assert_eq(
        json_integer_value(json_object_get(json_object_get(frag, "aio"), "intra_op_parallelism")),
        json_integer_value(json_object_get(picked, "rings")));
    json_decref(last);
    json_decref(pts);
    return frag;
}

Test(cli, tune_writes_a_fragment_that_config_check_and_train_load_as_is)
{
    char *o, frag[4096], data[4096], a[4096], scratch[4200];
    snprintf(frag, sizeof(frag), "%s/tuned.json", dir);
    snprintf(data, sizeof(data), "%s/d.txt", dir);
    snprintf(a, sizeof(a), "%s/a", dir);
    cr_assert_eq(mkdir(a, 0755), 0);
    FILE *f = fopen(data, "w");
    for (int i = 0; i < 100; i++)
        fprintf(f, "some text %d\n", i);
    fclose(f);

    cr_assert_eq(run(&o, "tune --path %s --quick --size 8M --out %s", a, frag), 0, "%s", o);
    cr_assert(strstr(o, "# rule: best = highest median"), "%s", o);
    cr_assert(strstr(o, "<- picked") && strstr(o, "# picked: "), "%s", o);
    cr_assert(strstr(o, "tune: 24/24 round 3"), "progress lines off a tty: %s", o);
    free(o);
    snprintf(scratch, sizeof(scratch), "%s/zinf-bench.dat", a);
    cr_assert_neq(access(scratch, F_OK), 0, "the sweep's file is left behind");

    /* As it is: config check (strict: no unknown key; --all: every setting), zinf stat and
     * zinf train. */
    cr_assert_eq(run(&o, "config check --strict --all %s", frag), 0, "%s", o);
    cr_assert(strstr(o, "zinf.submit_batch") && strstr(o, "zinf.huge_pages"), "%s", o);
    free(o);
    cr_assert_eq(run(&o,
                     "train --config %s --data %s --layers 1 --dim 16 --heads 2 --seq 8 "
                     "--batch 2 --steps 2",
                     frag, data),
                 0, "%s", o);
    cr_assert(strstr(o, "# summary: 2 steps"), "%s", o);
    free(o);

    /* Not over an existing file without --force; the file is unchanged. */
    char *before = read_text(frag);
    cr_assert_eq(run(&o, "tune --path %s --quick --size 8M --out %s", a, frag), 2, "%s", o);
    cr_assert(strstr(o, "exists; --force to replace it"), "%s", o);
    free(o);
    char *after = read_text(frag);
    cr_assert_str_eq(before, after);
    free(before);
    free(after);
}

Test(cli, tune_picks_by_its_rule_in_both_modes)
{
    json_t *frag = tune_json("--quick --size 8M --rings 1,2 --submit-batches 1", "io");
    cr_assert_null(json_object_get(json_object_get(frag, "zinf"), "staging_bytes"));
    json_decref(frag);

    frag = tune_json("--mode swapin --quick --size 8M --tensor-size 512K --staging 2M,4M", "sw");
    json_t *z = json_object_get(frag, "zinf");
    uint64_t st = json_integer_value(json_object_get(z, "staging_bytes"));
    cr_assert(st == 2 * MiB || st == 4 * MiB);
    /* The swap space is the path itself, and the sweep's own directory is gone. */
    char sw[4096], scratch[4200];
    snprintf(sw, sizeof(sw), "%s/sw", dir);
    cr_assert_str_eq(json_string_value(json_array_get(json_object_get(z, "nvme_paths"), 0)), sw);
    snprintf(scratch, sizeof(scratch), "%s/zinf-tune.swap", sw);
    cr_assert_neq(access(scratch, F_OK), 0);
    char path[4096], *o;
    snprintf(path, sizeof(path), "%s/sw.json", dir);
    char *text = json_dumps(frag, JSON_INDENT(2));
    write_file(path, text);
    free(text);
    json_decref(frag);
    cr_assert_eq(run(&o, "config check --strict %s", path), 0, "%s", o);
    free(o);
}

/* SIGINT or SIGTERM in the middle of a sweep: it stops after the measurement in hand,
 * writes no fragment, removes what the sweep wrote in the path, and exits 130 or 143. */
Test(cli, tune_interrupted_writes_nothing_and_cleans_up)
{
    static const struct {
        const char *sig;
        int num, status;
    } sigs[] = {{"INT", SIGINT, 130}, {"TERM", SIGTERM, 143}};
    char cmd[16384], out[4096], scratch[4200], text[8192];
    snprintf(out, sizeof(out), "%s/frag.json", dir);
    for (int i = 0; i < 2; i++) {
        /* A sweep of a few hundred measurements: far longer than the second it is given. */
        snprintf(cmd, sizeof(cmd),
                 "%s tune --path %s --mode swapin --size 16M --tensor-size 1M --block-sizes "
                 "256K,1M --queue-depths 4,8,16 --staging 4M,8M --reps 5 --out %s",
                 getenv("ZINF_BIN"), dir, out);
        snprintf(scratch, sizeof(scratch), "%s/int.out", dir);
        int st = run_signalled(cmd, scratch, "# zinf tune", sigs[i].num, 1000);
        FILE *f = fopen(scratch, "r");
        size_t n = f ? fread(text, 1, sizeof(text) - 1, f) : 0;
        text[n] = '\0';
        if (f) fclose(f);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == sigs[i].status, "SIG%s: status %d: %s",
                  sigs[i].sig, WIFEXITED(st) ? WEXITSTATUS(st) : -1, text);
        cr_assert(strstr(text, "interrupted; no fragment written"), "%s", text);
        cr_assert_neq(access(out, F_OK), 0, "a fragment was written");
        snprintf(scratch, sizeof(scratch), "%s/zinf-tune.swap", dir);
        if (access(scratch, F_OK) == 0) {
            /* Seen once under load in a sanitizer build: say what was left, and what the
             * command said, so the cause can be found. */
            char ls[8192] = "", lcmd[4400];
            snprintf(lcmd, sizeof(lcmd), "ls -la '%s' 2>&1", scratch);
            FILE *p = popen(lcmd, "r");
            size_t m = p ? fread(ls, 1, sizeof(ls) - 1, p) : 0;
            ls[m] = '\0';
            if (p) pclose(p);
            cr_assert_fail("SIG%s: the sweep's swap directory is left behind:\n%s\nthe command "
                           "said:\n%s",
                           sigs[i].sig, ls, text);
        }
    }
}

/* ---- zinf tune --mode train ------------------------------------------------------------ */

#define TT_DATA "/usr/share/common-licenses/GPL-3"

/* A small model's config for tune --mode train (global batch 4). */
static void tt_base(char *path, size_t n, const char *extra)
{
    snprintf(path, n, "%s/tt-base.json", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"train_batch_size\": 4, \"optimizer\": {\"type\": \"AdamW\", \"params\": "
            "{\"lr\": 0.003}}, \"zinf\": {\"device\": \"emulated\", \"train\": {\"layers\": 2, "
            "\"dim\": 32, \"heads\": 2, \"seq\": 16, \"steps\": 7}%s}}",
            extra);
    fclose(f);
}

/* The search over micro-batches, ranks, stages, placements and budgets: what the budget check
 * refuses is never run and says why; every other point runs; the pick follows tune's rule;
 * its config is what config check and train take as they are, and trains; the scratch
 * directory is gone. */
Test(cli, tune_train_searches_prunes_and_writes_a_config_train_runs, .timeout = 300)
{
    char base[4096], out[4096], scratch[4200], *o;
    tt_base(base, sizeof(base), "");
    snprintf(out, sizeof(out), "%s/tt-pick.json", dir);
    cr_assert_eq(run(&o,
                     "tune --mode train --config %s --data " TT_DATA " --path %s "
                     "--micro-batches 1,4 --ranks 1,2 --stages 1,3 --offload none:none,cpu:nvme "
                     "--budgets 1,0.02 --warmup 1 --steps 1 --json --out %s",
                     base, dir, out),
                 0, "%s", o);
    json_t *best = NULL, *picked = NULL, *last = NULL, *pts = json_array();
    int pruned = 0, full = 0, two_ranks = 0;
    for (char *save = NULL, *l = strtok_r(o, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        if (l[0] != '{') continue; /* progress lines */
        json_t *j = json_loads(l, 0, NULL);
        cr_assert_not_null(j, "not JSON: %s", l);
        if (json_object_get(j, "config")) {
            last = j;
            continue;
        }
        json_array_append_new(pts, j);
        cr_assert_null(json_object_get(j, "failed"), "a point the check let through failed: %s",
                       l);
        cr_assert_eq(json_integer_value(json_object_get(j, "micro_batch")) *
                         json_integer_value(json_object_get(j, "accumulation")) *
                         json_integer_value(json_object_get(j, "ranks")),
                     4, "the global batch is fixed: %s", l);
        if (json_object_get(j, "pruned")) {
            pruned++;
            const char *why = json_string_value(json_object_get(j, "pruned"));
            cr_assert(strstr(why, "needs device"), "%s", l);
            /* Pruned exactly where a budget is under the trainer's smallest. */
            cr_assert(json_integer_value(json_object_get(j, "device_bytes")) <
                              json_integer_value(json_object_get(j, "min_device_bytes")) ||
                          json_integer_value(json_object_get(j, "host_bytes")) <
                              json_integer_value(json_object_get(j, "min_host_bytes")),
                      "%s", l);
            continue;
        }
        cr_assert_geq(json_integer_value(json_object_get(j, "device_bytes")),
                      json_integer_value(json_object_get(j, "min_device_bytes")), "%s", l);
        cr_assert_geq(json_integer_value(json_object_get(j, "host_bytes")),
                      json_integer_value(json_object_get(j, "min_host_bytes")), "%s", l);
        two_ranks += json_integer_value(json_object_get(j, "ranks")) == 2;
        if (json_array_size(json_object_get(j, "tokens_per_s")) != 3) continue;
        full++;
        double med = json_real_value(json_object_get(j, "median"));
        cr_assert_gt(med, 0);
        if (!best || med > json_real_value(json_object_get(best, "median"))) best = j;
        if (json_is_true(json_object_get(j, "picked"))) {
            cr_assert_null(picked, "two points picked");
            picked = j;
        }
    }
    free(o);
    cr_assert_gt(pruned, 0, "the 2%% budgets are under what runs");
    cr_assert_gt(two_ranks, 0);
    cr_assert_geq(full, 3, "the best quarter, at least three, runs three times");
    cr_assert_not_null(picked);
    cr_assert_not_null(last);
    /* tune's rule: the pick ties with the best (median within its min..max, and in train
     * mode at least 0.9 of it), and no tie has fewer ranks or budget bytes. */
    double lo = json_real_value(json_array_get(json_object_get(best, "tokens_per_s"), 0));
    for (size_t k = 1; k < 3; k++)
        lo = fmin(lo, json_real_value(json_array_get(json_object_get(best, "tokens_per_s"), k)));
    cr_assert_geq(json_real_value(json_object_get(picked, "median")), lo);
    cr_assert_geq(json_real_value(json_object_get(picked, "median")),
                  0.9 * json_real_value(json_object_get(best, "median")));
    size_t i;
    json_t *p;
    json_array_foreach(pts, i, p)
    {
        double med = json_real_value(json_object_get(p, "median"));
        bool tie = json_array_size(json_object_get(p, "tokens_per_s")) == 3 && med >= lo &&
                   med >= 0.9 * json_real_value(json_object_get(best, "median"));
        cr_assert_eq(json_is_true(json_object_get(p, "tie")), tie, "tie or not, by the rule");
        if (!tie) continue;
        json_int_t pr = json_integer_value(json_object_get(picked, "ranks")),
                   qr = json_integer_value(json_object_get(p, "ranks"));
        cr_assert_geq(qr, pr, "a tie with fewer ranks");
        if (qr == pr)
            cr_assert_geq(json_integer_value(json_object_get(p, "device_bytes")) +
                              json_integer_value(json_object_get(p, "host_bytes")),
                          json_integer_value(json_object_get(picked, "device_bytes")) +
                              json_integer_value(json_object_get(picked, "host_bytes")),
                          "a tie with fewer budget bytes");
    }
    /* The config written is the pick's, and the base's other keys are kept. */
    json_t *cfg = json_load_file(out, 0, NULL);
    cr_assert_not_null(cfg);
    cr_assert(json_equal(cfg, json_object_get(last, "config")));
    cr_assert_eq(json_integer_value(json_object_get(cfg, "train_micro_batch_size_per_gpu")),
                 json_integer_value(json_object_get(picked, "micro_batch")));
    json_t *z = json_object_get(cfg, "zinf");
    cr_assert_eq(json_integer_value(json_object_get(z, "device_bytes")),
                 json_integer_value(json_object_get(picked, "device_bytes")));
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(z, "train"), "steps")), 7);
    cr_assert_not_null(
        json_object_get(json_object_get(json_object_get(cfg, "optimizer"), "params"), "lr"));
    int ranks = (int)json_integer_value(json_object_get(picked, "ranks"));
    json_decref(cfg);
    json_decref(last);
    json_decref(pts);
    cr_assert_eq(run(&o, "config check %s --strict --ranks %d", out, ranks), 0, "%s", o);
    free(o);
    if (ranks > 1)
        cr_assert_eq(run(&o, "launch -n %d -- %s train --config %s --data " TT_DATA " --steps 2",
                         ranks, getenv("ZINF_BIN"), out),
                     0, "%s", o);
    else
        cr_assert_eq(run(&o, "train --config %s --data " TT_DATA " --steps 2", out), 0, "%s", o);
    free(o);
    snprintf(scratch, sizeof(scratch), "%s/zinf-tune.train", dir);
    cr_assert_neq(access(scratch, F_OK), 0, "the sweep's scratch directory is left behind");

    /* A pick of 2 ranks, whichever point wins above: its config holds the global batch of
     * the base (4 = 1 x 2 x 2), config check takes it for 2 ranks (and refuses it for one,
     * saying so), and zinf launch -n 2 trains it. */
    unlink(out);
    cr_assert_eq(run(&o,
                     "tune --mode train --config %s --data " TT_DATA " --path %s "
                     "--micro-batches 1 --ranks 2 --stages 1 --offload none:none --budgets 1 "
                     "--warmup 1 --steps 1 --out %s",
                     base, dir, out),
                 0, "%s", o);
    cr_assert(strstr(o, "run it: zinf launch -n 2 -- "), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "config check %s --strict", out), 2, "%s", o);
    cr_assert(strstr(o, "a config for 2 ranks?"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "config check %s --strict --ranks 2", out), 0, "%s", o);
    free(o);
    cr_assert_eq(run(&o,
                     "launch -n 2 -- %s train --config %s --data " TT_DATA
                     " --steps 2 --overwrite",
                     getenv("ZINF_BIN"), out),
                 0, "%s", o);
    free(o);
}

Test(cli, tune_train_bad_arguments_and_interruption, .timeout = 120)
{
    char base[4096], out[4096], scratch[4200], *o;
    tt_base(base, sizeof(base), "");
    snprintf(out, sizeof(out), "%s/tt-never.json", dir);
    static const struct {
        const char *args, *says;
    } cases[] = {
        {"--offload cpu", "--offload: 'cpu' is not PARAM:OPTIMIZER"},
        {"--offload cpu:disk", "--offload: 'cpu:disk' is not PARAM:OPTIMIZER"},
        {"--offload cpu:cpu,cpu:cpu", "--offload: cpu:cpu is given twice"},
        {"--budgets 0", "--budgets: '0' is not a fraction in (0, 1]"},
        {"--budgets 1.5", "--budgets: '1.5' is not a fraction in (0, 1]"},
        {"--reps 2", "--reps: '2' is not a whole number in [3, 20]"},
        {"--ranks 0", "--ranks: '0' is not a whole number in [1, 64]"},
        {"--stages 0", "--stages: '0' is not a whole number in [1, 3]"},
        {"--micro-batches 2,2", "--micro-batches: 2 is given twice"},
        {"--steps 1,2", "--steps: one whole number"},
        {"--global-batch 3 --micro-batches 2 --ranks 1",
         "the global batch 3 splits into none of the micro-batches x ranks given"},
        {"--bogus", "unknown or incomplete option '--bogus'"},
    };
    for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
        cr_assert_eq(run(&o, "tune --mode train --config %s --data " TT_DATA " --path %s --out %s %s",
                         base, dir, out, cases[i].args),
                     2, "%s: %s", cases[i].args, o);
        cr_assert(strstr(o, cases[i].says), "%s: %s", cases[i].args, o);
        free(o);
    }
    cr_assert_eq(run(&o, "tune --mode train --data " TT_DATA " --path %s", dir), 2, "%s", o);
    cr_assert(strstr(o, "needs --config FILE"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "tune --mode train --config %s --data %s/nothing --path %s", base, dir,
                     dir),
                 2, "%s", o);
    cr_assert(strstr(o, "nothing: No such file"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "tune --mode train --config %s --data " TT_DATA " --path %s/nowhere",
                     base, dir),
                 2, "%s", o);
    cr_assert(strstr(o, "not a writable directory"), "%s", o);
    free(o);
    /* A config zinf train refuses is refused in its words, before any point. */
    char bad[4096];
    snprintf(bad, sizeof(bad), "%s/tt-bad.json", dir);
    FILE *f = fopen(bad, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"optimizer\": {\"type\": \"SGD\"}}");
    fclose(f);
    cr_assert_eq(run(&o, "tune --mode train --config %s --data " TT_DATA " --path %s", bad, dir),
                 2, "%s", o);
    cr_assert(strstr(o, "optimizer.type \"SGD\""), "%s", o);
    free(o);
    tt_base(base, sizeof(base), ", \"connect\": \"/nonexistent.sock\"");
    cr_assert_eq(run(&o, "tune --mode train --config %s --data " TT_DATA " --path %s", base, dir),
                 2, "%s", o);
    cr_assert(strstr(o, "zinf.connect: a daemon's job"), "%s", o);
    free(o);
    tt_base(base, sizeof(base), "");
    /* --out that exists, without --force. */
    f = fopen(out, "w");
    cr_assert_not_null(f);
    fclose(f);
    cr_assert_eq(run(&o, "tune --mode train --config %s --data " TT_DATA " --path %s --out %s",
                     base, dir, out),
                 2, "%s", o);
    cr_assert(strstr(o, "exists; --force to replace it"), "%s", o);
    free(o);
    unlink(out);
    /* Interrupted: nothing written, the scratch directory removed, 130. */
    char cmd[16384];
    snprintf(cmd, sizeof(cmd),
             "%s tune --mode train --config %s --data " TT_DATA
             " --path %s --ranks 1 --steps 50 --out %s",
             getenv("ZINF_BIN"), base, dir, out);
    snprintf(scratch, sizeof(scratch), "%s/tt-int.out", dir);
    int st = run_signalled(cmd, scratch, "# zinf tune", SIGINT, 1500);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 130, "status %d",
              WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    cr_assert_neq(access(out, F_OK), 0, "a config was written");
    snprintf(scratch, sizeof(scratch), "%s/zinf-tune.train", dir);
    cr_assert_neq(access(scratch, F_OK), 0, "the sweep's scratch directory is left behind");
    /* A scratch directory already there (another sweep's) is refused, not removed. */
    cr_assert_eq(mkdir(scratch, 0700), 0);
    cr_assert_eq(run(&o, "tune --mode train --config %s --data " TT_DATA " --path %s", base, dir),
                 2, "%s", o);
    cr_assert(strstr(o, "exists (another sweep's"), "%s", o);
    free(o);
    cr_assert_eq(access(scratch, F_OK), 0);
    rmdir(scratch);
}

Test(cli, tune_bad_arguments)
{
    char *o, out[4096];
    snprintf(out, sizeof(out), "%s/never.json", dir);
    static const struct {
        const char *args, *says;
    } cases[] = {
        {"--reps 2", "--reps: must be 3..100 (a spread needs three rounds), got '2'"},
        {"--mode fast", "--mode: must be io, swapin or train, got 'fast'"},
        {"--block-sizes 1M,3000", "--block-sizes: '3000' is not a size that is a multiple of 4K"},
        {"--block-sizes 128M", "--block-sizes: at most 64M"},
        {"--queue-depths 0", "--queue-depths: '0' is not a positive number"},
        {"--queue-depths 2000", "--queue-depths: at most 1024"},
        {"--staging 4M", "--staging is for --mode swapin"},
        {"--mode swapin --staging 8G", "--staging: at most 4G"},
        {"--queue-depths 2 --submit-batches 4", "no point left in the grid"},
        {"--mode swapin --size 4M --tensor-size 1M", "swap-in needs at least 8"},
        {"--huge-pages maybe", "--huge-pages: must be on, off or both, got 'maybe'"},
        {"--rings 1,9", "--rings: at most 8, got 9"},
        {"--submit-batches 1,2000", "--submit-batches: at most 1024 (zinf.submit_batch), got 2000"},
        {"--bogus", "unknown or incomplete option '--bogus'"},
    };
    for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
        cr_assert_eq(
            run(&o, "tune --path %s --quick --size 8M --out %s %s", dir, out, cases[i].args), 2,
            "%s: %s", cases[i].args, o);
        cr_assert(strstr(o, cases[i].says), "%s: %s", cases[i].args, o);
        free(o);
    }
    cr_assert_eq(run(&o, "tune --quick"), 2, "%s", o);
    cr_assert(strstr(o, "--path DIR is required"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "tune --path %s/nowhere --quick", dir), 2, "%s", o);
    cr_assert(strstr(o, "nowhere: No such file or directory"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "tune --path %s --path %s --quick", dir, dir), 2, "%s", o);
    cr_assert(strstr(o, "is given twice"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "tune --path %s --quick --out %s/nodir/f.json", dir, dir), 2, "%s", o);
    cr_assert(strstr(o, "cannot write there"), "%s", o);
    free(o);
    cr_assert_neq(access(out, F_OK), 0, "a refused run wrote its --out");
}

Test(cli, topo_and_stat)
{
    char *o;
    cr_assert_eq(run(&o, "topo"), 0, "%s", o);
    cr_assert(strstr(o, "NUMA") || strstr(o, "node"), "%s", o);
    free(o);
    /* A directory without a saved run: nothing to inspect, and nothing created there. */
    cr_assert_eq(run(&o, "stat --path %s --json", dir), 1, "%s", o);
    cr_assert(strstr(o, "no saved run in "), "%s", o);
    free(o);
    char cfg[4096];
    snprintf(cfg, sizeof(cfg), "%s/s.json", dir);
    FILE *f = fopen(cfg, "w");
    fprintf(f,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
            "\"%s/swap\"}}, \"zinf\": {\"device\": \"emulated\", \"host_bytes\": \"4M\"}}",
            dir);
    fclose(f);
    cr_assert_eq(run(&o, "stat --config %s --json", cfg), 0, "%s", o);
    cr_assert(strstr(o, "\"saved_state\": false") && strstr(o, "\"tensors\": 0"), "%s", o);
    free(o);
    char swap[4096];
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    cr_assert_neq(access(swap, F_OK), 0, "zinf stat created the swap directory");
    cr_assert_eq(run(&o, "stat"), 2, "%s", o);
    cr_assert(strstr(o, "exactly one of --config FILE, --path DIR or --socket PATH"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "stat --config %s/nope.json", dir), 2, "%s", o);
    free(o);
}

Test(cli, train_runs_and_resumes_after_sigint)
{
    char *o, cfg[4096], data[4096], log[4096];
    snprintf(cfg, sizeof(cfg), "%s/t.json", dir);
    snprintf(data, sizeof(data), "%s/data.txt", dir);
    snprintf(log, sizeof(log), "%s/log.jsonl", dir);
    FILE *f = fopen(cfg, "w");
    fprintf(f,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
            "\"%s/swap\"}, \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": "
            "\"%s/swap\"}}, \"aio\": {\"block_size\": 65536},"
            " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"2M\", \"host_bytes\": "
            "\"2M\"}}",
            dir, dir);
    fclose(f);
    f = fopen(data, "w");
    for (int i = 0; i < 300; i++)
        fprintf(f, "a line of text number %d for the byte model.\n", i);
    fclose(f);
    const char *model = "--layers 2 --dim 32 --heads 2 --seq 16 --batch 2";

    cr_assert_eq(
        run(&o, "train --config %s --data %s %s --steps 3 --log %s", cfg, data, model, log), 0,
        "%s", o);
    cr_assert(strstr(o, "       3 ") && strstr(o, "# summary: 3 steps"), "%s", o);
    free(o);
    /* The log: one line per step, then the summary. */
    f = fopen(log, "r");
    char line[4096];
    int steps = 0, summary = 0;
    while (fgets(line, sizeof(line), f)) {
        steps += strncmp(line, "{\"step\":", 8) == 0;
        summary += strstr(line, "\"summary\"") && strstr(line, "\"model_state_bytes\"") &&
                   strstr(line, "\"peak_bytes\"") && strstr(line, "\"budget_bytes\"");
    }
    fclose(f);
    cr_assert_eq(steps, 3);
    cr_assert_eq(summary, 1);

    /* Continue to step 5 from the saved state. */
    cr_assert_eq(run(&o, "train --config %s --data %s %s --steps 5 --resume", cfg, data, model), 0,
                 "%s", o);
    cr_assert(strstr(o, "resumed") && strstr(o, "       4 ") && !strstr(o, "       1 "), "%s", o);
    free(o);

    /* SIGINT finishes the step and flushes: exit 130 (SIGTERM: 143), the summary says it
     * was interrupted, and --resume goes on from there. */
    char cmd[16384];
    static const struct {
        const char *name;
        int num, status;
    } sigs[] = {{"SIGINT", SIGINT, 130}, {"SIGTERM", SIGTERM, 143}};
    for (int i = 0; i < 2; i++) {
        char int_out[4200];
        snprintf(cmd, sizeof(cmd), "%s train --config %s --data %s %s --steps 100000 --resume "
                 "--log %s", getenv("ZINF_BIN"), cfg, data, model, log);
        snprintf(int_out, sizeof(int_out), "%s/int.out", dir);
        int st = run_signalled(cmd, int_out, "# compute:", sigs[i].num, 1000);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == sigs[i].status, "%s: status %#x",
                  sigs[i].name, st);
        snprintf(cmd, sizeof(cmd), "grep -q '%s: finishing here' %s/int.out", sigs[i].name, dir);
        cr_assert_eq(system(cmd), 0, "the run says it stopped on %s", sigs[i].name);
        snprintf(cmd, sizeof(cmd), "tail -n 1 %s | grep -q '\"interrupted\":true'", log);
        cr_assert_eq(system(cmd), 0, "the summary says the run was interrupted");
    }
    /* Where the signals left it (at least step 5, however loaded the machine). */
    snprintf(cmd, sizeof(cmd), "tail -n 1 %s", log);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    cr_assert_not_null(fgets(line, sizeof(line), p));
    pclose(p);
    const char *at = strstr(line, "\"steps\":");
    cr_assert_not_null(at, "%s", line);
    int done = atoi(at + 8);
    cr_assert_geq(done, 5);
    /* Past that step already: said, exit 2, nothing run. */
    cr_assert_eq(run(&o, "train --config %s --data %s %s --steps %d --resume --log %s", cfg, data,
                     model, done - 1, log),
                 2, "%s", o);
    char past[32];
    snprintf(past, sizeof(past), "past %d", done - 1);
    cr_assert(strstr(o, past), "%s", o);
    free(o);
    /* One more step from there. */
    cr_assert_eq(run(&o, "train --config %s --data %s %s --steps %d --resume --log %s", cfg, data,
                     model, done + 1, log),
                 0, "%s", o);
    free(o);
    snprintf(cmd, sizeof(cmd), "tail -n 1 %s | grep -q '\"interrupted\":false'", log);
    cr_assert_eq(system(cmd), 0, "a run that finished says so");
}

Test(cli, train_bad_arguments)
{
    char *o, cfg[4096];
    snprintf(cfg, sizeof(cfg), "%s/t.json", dir);
    FILE *f = fopen(cfg, "w");
    fprintf(f, "{\"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"64K\"}}");
    fclose(f);
    static const struct {
        const char *args;
        const char *msg;
    } bad[] = {
        {"train --config %s", "--config FILE and --data FILE are required"},
        {"train --config %s --data /nonexistent/data", "/nonexistent/data"},
        {"train --config %s --data /etc/hostname --dim 30 --heads 4",
         "--heads 4 does not divide --dim 30"},
        {"train --config %s --data /usr/share/common-licenses/GPL-3", "zinf.device_bytes"},
        {"train --config %s --data /usr/share/common-licenses/GPL-3 --layers x",
         "--layers: expected an integer"},
        {"train --config /nonexistent.json --data /usr/share/common-licenses/GPL-3%s",
         "/nonexistent.json"},
        {"train --config %s --data /usr/share/common-licenses/GPL-3 --precision fp8",
         "--precision: expected auto, fp32, bf16 or fp16, got 'fp8'"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char args[1024];
        snprintf(args, sizeof(args), bad[i].args, strstr(bad[i].args, "%s") ? cfg : "");
        cr_assert_eq(run(&o, "%s", args), 2, "zinf %s: %s", args, o);
        cr_assert(strstr(o, bad[i].msg), "zinf %s said: %s", args, o);
        free(o);
    }
}

Test(cli, train_takes_the_model_from_the_config)
{
    char *o, cfg[4096], data[4096];
    snprintf(cfg, sizeof(cfg), "%s/m.json", dir);
    snprintf(data, sizeof(data), "%s/d.txt", dir);
    FILE *f = fopen(data, "w");
    for (int i = 0; i < 100; i++)
        fprintf(f, "some text %d\n", i);
    fclose(f);
    f = fopen(cfg, "w");
    fprintf(f, "{\"zinf\": {\"device\": \"emulated\", \"train\": {\"layers\": 2, \"dim\": 24, "
               "\"heads\": 3, \"seq\": 16, \"batch\": 2, \"steps\": 2}}}");
    fclose(f);
    cr_assert_eq(run(&o, "train --config %s --data %s", cfg, data), 0, "%s", o);
    cr_assert(strstr(o, "2 layers, dim 24, 3 heads, seq 16, batch 2"), "%s", o);
    cr_assert(strstr(o, "# summary: 2 steps"), "%s", o);
    free(o);
    /* The command line wins. */
    cr_assert_eq(run(&o, "train --config %s --data %s --layers 1 --steps 1", cfg, data), 0, "%s",
                 o);
    cr_assert(strstr(o, "1 layers, dim 24") && strstr(o, "# summary: 1 steps"), "%s", o);
    free(o);
    f = fopen(cfg, "w");
    fprintf(f, "{\"zinf\": {\"train\": {\"heads\": 0}}}");
    fclose(f);
    cr_assert_eq(run(&o, "train --config %s --data %s", cfg, data), 2, "%s", o);
    cr_assert(strstr(o, "zinf.train.heads: must be between 1 and 1024, got 0"), "%s", o);
    free(o);
}

/* ---- the swap directory is the user's data ---------------------------------------------- */

/* A config whose parameters and optimizer states live in swap (under dir), and the text. */
/* train_files with more keys in the config's zinf section (zinf_more: "" or `, "k": v`). */
static void train_files_with(const char *swap, char *cfg, size_t cfglen, char *data,
                             size_t datalen, const char *zinf_more)
{
    static int n;
    snprintf(cfg, cfglen, "%s/c%d.json", dir, n++);
    snprintf(data, datalen, "%s/data.txt", dir);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
            "\"%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}}, "
            "\"aio\": {\"block_size\": 65536, \"queue_depth\": 4}, \"zinf\": {\"device\": "
            "\"emulated\", \"device_bytes\": \"1M\", \"host_bytes\": \"1M\"%s}}",
            swap, swap, zinf_more);
    fclose(f);
    if (access(data, F_OK) != 0) {
        f = fopen(data, "w");
        cr_assert_not_null(f);
        for (int i = 0; i < 300; i++)
            fprintf(f, "line %d of the text the byte model learns from.\n", i);
        fclose(f);
    }
}

static void train_files(const char *swap, char *cfg, size_t cfglen, char *data, size_t datalen)
{
    train_files_with(swap, cfg, cfglen, data, datalen, "");
}

/* The update at the end of each step, not in the next forward (the default here). */
#define AT_END ", \"train\": {\"update_in_forward\": false}"

#define TINY "--layers 1 --dim 16 --heads 2 --seq 8 --batch 1"

/* CRC and size of every file under d, sorted by name: equal text, equal bytes. */
static char *digest(const char *d)
{
    char *o;
    char cmd[8192];
    snprintf(cmd, sizeof(cmd),
             "cd '%s' && find . -type f -print0 | sort -z | xargs -0 -r "
             "cksum",
             d);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t cap = 1 << 16, len = 0, n;
    o = malloc(cap);
    while ((n = fread(o + len, 1, cap - len - 1, p)) > 0)
        len += n;
    o[len] = '\0';
    cr_assert_eq(pclose(p), 0, "%s", cmd);
    cr_assert_gt(len, 0, "no files under %s", d);
    return o;
}

/* It used to start over, deleting the saved run without a word. */
Test(cli, train_refuses_to_start_over_a_saved_run)
{
    char *o, cfg[4096], data[4096], swap[4096], log[4096];
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    snprintf(log, sizeof(log), "%s/log.jsonl", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 2 --log %s", cfg, data, log),
                 0, "%s", o);
    free(o);
    char *before = digest(dir); /* the swap directory, the config, the data and the log */

    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 4 --log %s", cfg, data, log),
                 2, "%s", o);
    cr_assert(strstr(o, swap) && strstr(o, "holds a saved run") && strstr(o, "--resume") &&
                  strstr(o, "--overwrite"),
              "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --resume --overwrite", cfg, data), 2,
                 "%s", o);
    free(o);
    char *after = digest(dir);
    cr_assert_str_eq(before, after, "a refused run changed a file");

    /* --overwrite starts over (step 1), --resume continues (step 3). */
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 1 --overwrite", cfg, data),
                 0, "%s", o);
    cr_assert(strstr(o, "\n       1 "), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 3 --resume", cfg, data), 0,
                 "%s", o);
    cr_assert(strstr(o, "\n       2 ") && strstr(o, "\n       3 ") && !strstr(o, "\n       1 "),
              "%s", o);
    free(o);
    free(before);
    free(after);
}

/* `zinf train --resume` on swap, where nothing is saved: exit 2, naming the directory. */
static void expect_no_saved_run(const char *swap)
{
    char *o, cfg[4096], data[4096], want[4200];
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --resume", cfg, data), 2, "%s", o);
    snprintf(want, sizeof(want), "no saved run in %s", swap);
    cr_assert(strstr(o, want), "%s", o);
    free(o);
}

/* It used to create an empty swap directory and fail later with a puzzling message. */
Test(cli, train_resume_without_a_saved_run_says_so)
{
    char *o, cfg[4096], data[4096], swap[4096];
    snprintf(swap, sizeof(swap), "%s/not/there", dir);
    expect_no_saved_run(swap);
    cr_assert_neq(access(swap, F_OK), 0, "--resume created %s", swap);
    /* An existing directory without a saved run: the same. */
    snprintf(swap, sizeof(swap), "%s/empty", dir);
    cr_assert_eq(mkdir(swap, 0755), 0);
    expect_no_saved_run(swap);
    /* A new run creates a missing nvme_path, parents included. */
    snprintf(swap, sizeof(swap), "%s/a/b/c", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 1", cfg, data), 0, "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 2 --resume", cfg, data), 0,
                 "%s", o);
    free(o);
}

/* `zinf stat --config` used to truncate the swap files and empty the manifest; `--path`
 * could not open a directory an engine held. */
Test(cli, stat_changes_no_byte_even_next_to_an_engine_that_holds_the_directory)
{
    char *o, cfg[4096], data[4096], swap[4096];
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 2", cfg, data), 0, "%s", o);
    free(o);
    char *before = digest(swap);

    for (int holder = 0; holder < 2; holder++) {
        zinf_engine *e = NULL;
        if (holder) {
            /* An engine that holds the swap files open and locked, as a running job. */
            struct zinf_options zo = {.nvme_path = swap,
                                      .block_size = 65536,
                                      .queue_depth = 4,
                                      .host_bytes = 4 * MiB,
                                      .device_kind = ZINF_DEVICE_EMULATED,
                                      .flags = ZINF_OPEN_RESUME | ZINF_OPEN_NO_PIN};
            int r = zinf_open(&zo, &e);
            cr_assert_eq(r, 0, "%s", zinf_strerror(r));
        }
        cr_assert_eq(run(&o, "stat --config %s --json", cfg), 0, "%s", o);
        cr_assert(strstr(o, "\"saved_state\": true") && strstr(o, "\"tensors\": 67") &&
                      strstr(o, "\"nvme_bytes_written\": 0"),
                  "%s", o);
        free(o);
        cr_assert_eq(run(&o, "stat --path %s", swap), 0, "%s", o);
        cr_assert(strstr(o, "# tensors 67") && strstr(o, "saved state opened read-only"), "%s", o);
        free(o);
        char *after = digest(swap);
        cr_assert_str_eq(before, after, "zinf stat changed the swap directory (holder %d)", holder);
        free(after);
        zinf_close(e);
    }
    /* The run goes on from its state. */
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 3 --resume", cfg, data), 0,
                 "%s", o);
    cr_assert(strstr(o, "\n       3 "), "%s", o);
    free(o);
    free(before);
}

/* ---- a crash loses at most the steps since the last checkpoint --------------------------- */

/* Start `zinf ARGS` with stdout and stderr to out_path; returns its pid (the shell execs). */
static pid_t spawn(const char *out_path, const char *fmt, ...)
{
    char args[2048], cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof(args), fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof(cmd), "exec %s %s > '%s' 2>&1", getenv("ZINF_BIN"), args, out_path);
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    return pid;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#define MAX_STEPS 400

/* Complete lines of path that start with prefix. */
static int count_lines(const char *path, const char *prefix)
{
    FILE *f = fopen(path, "r");
    char line[16384];
    int n = 0;
    if (!f) return 0;
    while (fgets(line, sizeof(line), f))
        n += strchr(line, '\n') && !strncmp(line, prefix, strlen(prefix));
    fclose(f);
    return n;
}

/* The losses a JSONL log holds, as printed (%.9g: the float's bits), by step, each followed
 * by "/" and the step's parameter digest, so that a comparison of two runs' losses
 * compares their parameters too; and the last checkpoint it logged (the state of that step
 * was durable by then). A line cut short by a kill is ignored. Returns the highest step
 * seen, or 0. */
static int read_losses(const char *path, char (*loss)[32], int *summary_steps, int *ckpt)
{
    FILE *f = fopen(path, "r");
    char line[16384];
    int last = 0;
    if (!f) return 0;
    while (fgets(line, sizeof(line), f)) {
        int step, n = 0;
        char val[32];
        if (!strchr(line, '\n')) continue;
        const char *dg = strstr(line, "\"digest\":");
        if (sscanf(line, "{\"step\":%d,\"loss\":%14[^,],%n", &step, val, &n) == 2 && n > 0 &&
            step >= 1 && step <= MAX_STEPS) {
            /* "loss/digest": 14 + 1 + 16 characters at most. */
            size_t vl = strlen(val);
            snprintf(val + vl, sizeof(val) - vl, "/%.16s",
                     !dg ? "none" : dg[9] == '"' ? dg + 10 : "null");
            if (loss[step][0])
                cr_assert_str_eq(loss[step], val, "%s: step %d logged twice, differently", path,
                                 step);
            snprintf(loss[step], sizeof(loss[step]), "%s", val);
            last = MAX(last, step);
        }
        if (summary_steps && sscanf(line, "{\"summary\":{\"steps\":%d", &step) == 1)
            *summary_steps = step;
        if (ckpt && sscanf(line, "{\"checkpoint\":%d", &step) == 1) *ckpt = MAX(*ckpt, step);
    }
    fclose(f);
    return last;
}

/* open_memstream failing (memory ran out) as zinf train makes step 3's log line: the run
 * stops, naming the error, saves the state of the step it ran, and --resume goes on with the
 * losses and parameters of a run that never failed. Step 3's line is the one lost: with the
 * update in the next forward (the default) too, where step 2's line waited for the digest
 * that step 3's forward gave. */
Test(cli, a_log_line_that_cannot_be_made_stops_the_run_with_its_state_saved)
{
    const char *lib = getenv("ZINF_TEST_FAIL_MEMSTREAM");
    cr_assert_not_null(lib, "ZINF_TEST_FAIL_MEMSTREAM is not set");
    static char ref[MAX_STEPS + 1][32], seen[MAX_STEPS + 1][32];
    for (int end = 0; end < 2; end++) {
        const char *mode = end ? AT_END : "", *what = end ? "at the step's end" : "in forward";
        memset(ref, 0, sizeof(ref));
        memset(seen, 0, sizeof(seen));
        char *o, cfg[4096], data[4096], swap[4096], log[4096];
        snprintf(swap, sizeof(swap), "%s/msref%d", dir, end);
        snprintf(log, sizeof(log), "%s/msref%d.jsonl", dir, end);
        train_files_with(swap, cfg, sizeof(cfg), data, sizeof(data), mode);
        cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 5 --log %s", cfg,
                         data, log),
                     0, "%s", o);
        free(o);
        cr_assert_eq(read_losses(log, ref, NULL, NULL), 5);

        snprintf(swap, sizeof(swap), "%s/msfail%d", dir, end);
        snprintf(log, sizeof(log), "%s/msfail%d.jsonl", dir, end);
        train_files_with(swap, cfg, sizeof(cfg), data, sizeof(data), mode);
        /* The shim comes before the sanitizers' runtime where there is one. */
        const char *asan = getenv("ASAN_OPTIONS");
        char *asan_was = asan ? strdup(asan) : NULL, asan_now[1024];
        snprintf(asan_now, sizeof(asan_now), "%s%sverify_asan_link_order=0", asan ? asan : "",
                 asan ? ":" : "");
        setenv("ASAN_OPTIONS", asan_now, 1);
        setenv("ZINF_TEST_MEMSTREAM_FAIL_AT", "3", 1);
        setenv("LD_PRELOAD", lib, 1);
        int st = run(&o, "train --config %s --data %s " TINY " --steps 5 --log %s", cfg, data,
                     log);
        unsetenv("LD_PRELOAD");
        unsetenv("ZINF_TEST_MEMSTREAM_FAIL_AT");
        if (asan_was)
            setenv("ASAN_OPTIONS", asan_was, 1);
        else
            unsetenv("ASAN_OPTIONS");
        free(asan_was);
        cr_assert_eq(st, 1, "%s: %s", what, o);
        cr_assert(strstr(o, "zinf train: --log: Cannot allocate memory"), "%s: %s", what, o);
        cr_assert(strstr(o, "the state of step 3 is saved; --resume continues"), "%s: %s", what,
                  o);
        free(o);
        cr_assert_eq(read_losses(log, seen, NULL, NULL), 2, "%s: steps 1 and 2 logged", what);

        snprintf(log, sizeof(log), "%s/msresume%d.jsonl", dir, end);
        cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 5 --resume --log %s",
                         cfg, data, log),
                     0, "%s: %s", what, o);
        free(o);
        cr_assert_eq(read_losses(log, seen, NULL, NULL), 5);
        for (int s = 1; s <= 5; s++)
            if (s == 3)
                cr_expect_eq(seen[s][0], 0, "%s: step 3 was logged: %s", what, seen[s]);
            else
                cr_expect_str_eq(seen[s], ref[s], "%s: step %d: %s, not %s", what, s, seen[s],
                                 ref[s]);
    }
}

/* kill -9 at >= 20 random moments of one run (during start-up, steps and checkpoints, with
 * checkpoints every 1, 2 or 3 steps): each restart resumes from the last checkpoint, and
 * every loss any attempt logged is bitwise the one of a run that never died. A few seconds
 * here; ZINF_TEST_KILLS=500 makes it a soak. */
Test(cli, train_killed_at_random_moments_resumes_with_the_same_losses)
{
    enum { STEPS = 60 };
    /* ZINF_TEST_KILLS=N makes it a soak. */
    const char *ks = getenv("ZINF_TEST_KILLS");
    const int KILLS = ks && atoi(ks) > 0 ? atoi(ks) : 20;
    static char ref[MAX_STEPS + 1][32], seen[MAX_STEPS + 1][32];
    char *o, cfg[4096], data[4096], swap[4096], out[4096], log[4096], manifest[4200];
    memset(ref, 0, sizeof(ref));
    memset(seen, 0, sizeof(seen));

    /* The run that never dies, timed to aim the kills. */
    snprintf(swap, sizeof(swap), "%s/ref", dir);
    snprintf(log, sizeof(log), "%s/ref.jsonl", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    double t0 = now_s();
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 0", cfg, data), 0, "%s", o);
    free(o);
    double start_s = now_s() - t0;
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps %d --log %s --overwrite",
                     cfg, data, STEPS, log),
                 0, "%s", o);
    free(o);
    /* The two start-ups differ (the first runs cold): never let that make a step's time
     * negative, which would aim a kill hours away. */
    double step_s = MAX((now_s() - t0 - 2 * start_s) / STEPS, 1e-3);
    int ref_summary = 0;
    cr_assert_eq(read_losses(log, ref, &ref_summary, NULL), STEPS);
    cr_assert_eq(ref_summary, STEPS);

    snprintf(swap, sizeof(swap), "%s/crash", dir);
    snprintf(manifest, sizeof(manifest), "%s/zinf-manifest.json", swap);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    uint64_t seed = (uint64_t)time(NULL);
    cr_log_info("seed %llu; start-up %.0f ms, a step %.1f ms", (unsigned long long)seed,
                start_s * 1e3, step_s * 1e3);
    int kills = 0, attempts = 0, done = 0, resumed_at_zero = 0, ckpt = 0, last = 0, mid_run = 0;
    bool done_once = false; /* a run finished before the kills were all made: start another */
    for (; !done; attempts++) {
        cr_assert_lt(attempts, 10 * KILLS, "the run never finished");
        bool resume = access(manifest, F_OK) == 0;
        int every = 1 + attempts % 3;
        snprintf(out, sizeof(out), "%s/a%d.out", dir, attempts);
        snprintf(log, sizeof(log), "%s/a%d.jsonl", dir, attempts);
        pid_t pid = spawn(out,
                          "train --config %s --data %s " TINY " --steps %d --log %s "
                          "--checkpoint-every %d%s",
                          cfg, data, STEPS, log, every, resume ? " --resume" : "");
        done_once = false;
        int status;
        if (kills < KILLS) {
            /* One kill in four anywhere in the start-up; the others once the attempt has
             * logged 1 to 6 steps, and then up to two steps' time later, so that they land
             * in steps and checkpoints whatever the machine's load. */
            bool reaped = false;
            if (test_rand(&seed) % 4 == 0) {
                usleep((useconds_t)((double)(test_rand(&seed) % 1000) / 1000.0 * start_s * 1e6));
            } else {
                int want = 1 + (int)(test_rand(&seed) % 6);
                while (!reaped && count_lines(log, "{\"step\":") < want) {
                    pid_t w = waitpid(pid, &status, WNOHANG);
                    cr_assert_geq(w, 0);
                    reaped = w == pid;
                    usleep(1000);
                }
                usleep((useconds_t)(test_rand(&seed) % (uint64_t)(2 * step_s * 1e6 + 1)));
            }
            if (!reaped) {
                kill(pid, SIGKILL);
                cr_assert_eq(waitpid(pid, &status, 0), pid);
            }
            if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
                kills++;
            } else {
                cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                          "attempt %d: status %#x; its output ends:\n%s", attempts, status,
                          tail_text(out));
                done_once = true;
            }
        } else {
            cr_assert_eq(waitpid(pid, &status, 0), pid);
            cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                      "attempt %d: status %#x; its output ends:\n%s", attempts, status,
                      tail_text(out));
            done = 1;
        }
        /* Whatever it logged is what a run that never died logs. */
        static char mine[MAX_STEPS + 1][32];
        memset(mine, 0, sizeof(mine));
        int summary = 0, ckpt_before = ckpt;
        int last_now = read_losses(log, mine, &summary, &ckpt);
        int first = 0;
        for (int s = 1; s <= STEPS; s++) {
            if (!mine[s][0]) continue;
            first = first ? first : s;
            cr_assert_str_eq(mine[s], ref[s], "attempt %d (after %d kills): step %d", attempts,
                             kills, s);
            memcpy(seen[s], mine[s], sizeof(seen[s]));
        }
        /* A restart goes on from the last durable checkpoint: not before one that was
         * logged, not after the last step done. */
        if (first && resume)
            cr_assert(first >= ckpt_before + 1 && first <= last + 1,
                      "attempt %d resumed at step %d; checkpoint %d was logged, step %d done",
                      attempts, first, ckpt_before, last);
        last = MAX(last, last_now);
        mid_run += !done && first;
        resumed_at_zero += resume && first == 1;
        if (done || done_once) {
            cr_assert_eq(summary, STEPS, "attempt %d finished the run", attempts);
            for (int s = 1; s <= STEPS; s++)
                cr_assert(seen[s][0], "step %d was never logged", s);
            memset(seen, 0, sizeof(seen));
            ckpt = last = 0;
            /* Another run from scratch for the kills still to make. */
            char cmd[4200];
            snprintf(cmd, sizeof(cmd), "rm -rf '%s'", swap);
            cr_assert_eq(system(cmd), 0);
        }
    }
    cr_log_info("%d kills over %d attempts, %d of them after the run had stepped (%d resumed from "
                "step 0)",
                kills, attempts, mid_run, resumed_at_zero);
    cr_assert_gt(mid_run, KILLS / 4, "too few kills landed in the steps and checkpoints");
    cr_assert_geq(kills, KILLS);
}

static int64_t swap_file_bytes(const char *swap)
{
    char p[4200];
    struct stat st;
    snprintf(p, sizeof(p), "%s/zinf-swap.0", swap);
    cr_assert_eq(stat(p, &st), 0, "%s", p);
    return (int64_t)st.st_size;
}

/* The swap filesystem fills up mid-run (a small tmpfs, mounted here when running as root):
 * the run stops with an error naming the swap file and the bytes it lacked, keeps the last
 * checkpoint, and once space is freed --resume finishes it with the losses of a run that
 * never stopped. */
Test(cli, train_on_a_full_filesystem_stops_cleanly_and_resumes_once_space_is_freed)
{
    enum { STEPS = 6 };
    static char ref[MAX_STEPS + 1][32], got[MAX_STEPS + 1][32];
    char *o, cfg[4096], data[4096], swap[4200], log[4096], filler[4200];
    if (geteuid() != 0) cr_skip_test("mounting a small tmpfs needs root");
    snprintf(mounted, sizeof(mounted), "%s/mnt", dir);
    cr_assert_eq(mkdir(mounted, 0755), 0);
    if (mount("tmpfs", mounted, "tmpfs", 0, "size=16m") != 0) {
        int err = errno;
        mounted[0] = '\0';
        cr_skip_test("cannot mount a tmpfs: %s", strerror(err));
    }

    /* The losses of a run that never stopped. */
    snprintf(swap, sizeof(swap), "%s/ref", dir);
    snprintf(log, sizeof(log), "%s/ref.jsonl", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(
        run(&o, "train --config %s --data %s " TINY " --steps %d --log %s", cfg, data, STEPS, log),
        0, "%s", o);
    free(o);
    memset(ref, 0, sizeof(ref));
    cr_assert_eq(read_losses(log, ref, NULL, NULL), STEPS);

    /* How large the swap file grows on this filesystem (where the usual 256 MiB step does
     * not fit, by what each allocation lacks): at the start, and over the run. */
    int64_t start_bytes, run_bytes;
    snprintf(swap, sizeof(swap), "%s/cal0", mounted);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 0", cfg, data), 0, "%s", o);
    free(o);
    start_bytes = swap_file_bytes(swap);
    snprintf(swap, sizeof(swap), "%s/cal1", mounted);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps %d --checkpoint-every 1",
                     cfg, data, STEPS),
                 0, "%s", o);
    free(o);
    run_bytes = swap_file_bytes(swap);
    cr_log_info("swap file: %lld bytes at the start, %lld over the run", (long long)start_bytes,
                (long long)run_bytes);
    cr_assert_gt(run_bytes, start_bytes, "the swap space grows during the run");
    char cmd[8400];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s/cal0' '%s/cal1'", mounted, mounted);
    cr_assert_eq(system(cmd), 0);

    /* Leave room for the start (and two manifests) but not for the whole run. */
    snprintf(swap, sizeof(swap), "%s/swap", mounted);
    snprintf(filler, sizeof(filler), "%s/filler", mounted);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    struct statvfs vfs;
    cr_assert_eq(statvfs(mounted, &vfs), 0);
    int64_t avail = (int64_t)vfs.f_bavail * (int64_t)vfs.f_frsize;
    int64_t room =
        align_up((uint64_t)(start_bytes + (run_bytes - start_bytes) / 2), 4096) + 64 * 1024;
    int fd = open(filler, O_CREAT | O_WRONLY, 0600);
    cr_assert_geq(fd, 0);
    cr_assert_eq(posix_fallocate(fd, 0, avail - room), 0);
    close(fd);

    snprintf(log, sizeof(log), "%s/a.jsonl", dir);
    cr_assert_eq(run(&o,
                     "train --config %s --data %s " TINY " --steps %d --checkpoint-every 1 "
                     "--log %s",
                     cfg, data, STEPS, log),
                 1, "%s", o);
    cr_assert(strstr(o, "# zinf train:"), "the run started before the disk filled: %s", o);
    cr_assert(strstr(o, "no space for") && strstr(o, "bytes) more of swap") && strstr(o, swap) &&
                  strstr(o, "zinf-swap.0"),
              "the error names the swap file and the bytes it lacked: %s", o);
    cr_assert(strstr(o, "(the last checkpoint) is kept") && strstr(o, "--resume"), "%s", o);
    free(o);
    memset(got, 0, sizeof(got));
    int last = read_losses(log, got, NULL, NULL);

    /* Space freed: the run resumes from its last checkpoint and finishes. */
    cr_assert_eq(unlink(filler), 0);
    snprintf(log, sizeof(log), "%s/b.jsonl", dir);
    cr_assert_eq(run(&o,
                     "train --config %s --data %s " TINY " --steps %d --checkpoint-every 1 "
                     "--log %s --resume",
                     cfg, data, STEPS, log),
                 0, "%s", o);
    free(o);
    int first = 0;
    static char more[MAX_STEPS + 1][32];
    memset(more, 0, sizeof(more));
    cr_assert_eq(read_losses(log, more, NULL, NULL), STEPS);
    for (int s = 1; s <= STEPS; s++) {
        first = first ? first : more[s][0] ? s : 0;
        if (more[s][0]) memcpy(got[s], more[s], sizeof(got[s]));
        cr_assert_str_eq(got[s], ref[s], "step %d", s);
    }
    cr_assert(first >= 1 && first <= last + 1, "resumed at step %d after %d", first, last);
}

/* ---- the conventions every command keeps ------------------------------------------------- */

/* zinf CMD --help lists the exit statuses, and zinf help CMD prints the command's page; bad
 * usage is 2 everywhere, bad input 2, a runtime failure 1. */
Test(cli, every_command_lists_its_exit_statuses_and_keeps_them)
{
    static const char *const cmds[] = {"train", "bench", "tune",    "config",
                                       "stat",  "topo",  "version", "serve", "launch"};
    char *o, *h;
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
        cr_assert_eq(run(&o, "%s --help", cmds[i]), 0, "%s --help: %s", cmds[i], o);
        cr_assert(strstr(o, "Exit status"), "zinf %s --help lists no exit status: %s", cmds[i], o);
        cr_assert_eq(run(&h, "help %s", cmds[i]), 0);
        char title[64];
        snprintf(title, sizeof(title), "# zinf %s\n", cmds[i]);
        cr_assert(!strncmp(h, title, strlen(title)), "zinf help %s is not its page: %s", cmds[i],
                  h);
        free(o);
        free(h);
        cr_assert_eq(run(&o, "%s --no-such-option", cmds[i]), 2, "zinf %s: %s", cmds[i], o);
        free(o);
    }
    cr_assert_eq(run(&o, "help no-such-command"), 2);
    cr_assert(strstr(o, "unknown command 'no-such-command'"), "%s", o);
    free(o);

    /* topo: a --gpu that is no bus id, an --xml that is missing: bad input. */
    cr_assert_eq(run(&o, "topo --gpu foo"), 2, "%s", o);
    cr_assert(strstr(o, "--gpu foo") && strstr(o, "PCI bus id"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "topo --gpu 0000:17:00.0"), 0, "%s", o);
    free(o);
    cr_assert_eq(run(&o, "topo --xml %s/missing.xml", dir), 2, "%s", o);
    free(o);
    /* bench: a --path that is not a directory. */
    cr_assert_eq(run(&o, "bench --path %s/missing", dir), 2, "%s", o);
    free(o);
    /* stat: nothing saved to inspect is a runtime failure, a bad config bad input. */
    cr_assert_eq(run(&o, "stat --path %s", dir), 1, "%s", o);
    free(o);
    char cfg[4096], data[4096], swap[4096];
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    /* train: --data that is a directory says so. */
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 1", cfg, dir), 2, "%s", o);
    cr_assert(strstr(o, "is a directory"), "%s", o);
    free(o);
}

/* ---- zinf help CMD: each command's page (docs/commands/CMD.md, built into the program) ---- */

/* The commands as `zinf help` lists them (the lines of its "commands:" block), "help" left
 * out; returns how many, at most max. */
static size_t listed_commands(char names[][16], size_t max)
{
    char *o;
    cr_assert_eq(run(&o, "help"), 0, "%s", o);
    char *p = strstr(o, "\ncommands:\n");
    cr_assert_not_null(p, "%s", o);
    size_t n = 0;
    for (p += strlen("\ncommands:\n"); *p == ' ' && n < max; p = strchr(p, '\n') + 1) {
        char name[16];
        /* "  NAME      what it does"; a continuation line starts with more spaces. */
        if (p[2] != ' ' && sscanf(p, " %15s", name) == 1 && strcmp(name, "help"))
            snprintf(names[n++], sizeof(names[0]), "%s", name);
        if (!strchr(p, '\n')) break;
    }
    free(o);
    return n;
}

/* The part of a page from its "## Exit status" heading to the next heading. */
static char *exit_section(char *page)
{
    char *s = strstr(page, "\n## Exit status\n");
    if (!s) return NULL;
    s += strlen("\n## Exit status\n");
    char *end = strstr(s, "\n## ");
    if (end) *end = '\0';
    return s;
}

/* Every command's page: its title first, an exit status section that says when it returns
 * 0, 1 and 2 (and 130/143 where a signal stops it: train, tune, launch; launch also 127),
 * printed by zinf help CMD with exit 0. */
Test(cli, help_prints_every_commands_page)
{
    char names[32][16];
    size_t n = listed_commands(names, 32);
    cr_assert_geq(n, 12, "zinf help lists %zu commands", n);
    for (size_t i = 0; i < n; i++) {
        char *o, title[64];
        cr_assert_eq(run(&o, "help %s", names[i]), 0, "zinf help %s: %s", names[i], o);
        snprintf(title, sizeof(title), "# zinf %s\n", names[i]);
        cr_assert(!strncmp(o, title, strlen(title)), "zinf help %s: no title: %s", names[i], o);
        cr_assert(strstr(o, "\n## Synopsis\n") && strstr(o, "\n## Options\n"),
                  "zinf help %s: %s", names[i], o);
        char *ex = exit_section(o);
        cr_assert_not_null(ex, "zinf help %s has no exit status section: %s", names[i], o);
        cr_assert(strstr(ex, "**0**") && strstr(ex, "**1**") && strstr(ex, "**2**"),
                  "zinf help %s: exit statuses: %s", names[i], ex);
        bool signals = !strcmp(names[i], "train") || !strcmp(names[i], "tune") ||
                       !strcmp(names[i], "launch");
        cr_assert(!signals || (strstr(ex, "**130**") && strstr(ex, "**143**")),
                  "zinf help %s: no 130/143: %s", names[i], ex);
        cr_assert(strcmp(names[i], "launch") || strstr(ex, "**127**"), "%s", ex);
        free(o);
    }
}

/* The pages in docs/commands are the commands: one per command zinf help lists, none
 * other, and what zinf help CMD prints is the page as the source tree holds it (the
 * program carries the current pages). */
Test(cli, help_pages_are_the_commands)
{
    char names[32][16], path[4096];
    size_t n = listed_commands(names, 32);
    bool paged[32] = {0};
    snprintf(path, sizeof(path), "%s/../../docs/commands", getenv("ZINF_TEST_DATA"));
    DIR *d = opendir(path);
    cr_assert_not_null(d, "%s: %s", path, strerror(errno));
    size_t pages = 0;
    for (struct dirent *e; (e = readdir(d));) {
        size_t len = strlen(e->d_name);
        if (e->d_name[0] == '.') continue;
        cr_assert(len > 3 && !strcmp(e->d_name + len - 3, ".md"), "docs/commands/%s: not a page",
                  e->d_name);
        char name[64];
        snprintf(name, sizeof(name), "%.*s", (int)(len - 3), e->d_name);
        size_t k = 0;
        while (k < n && strcmp(names[k], name))
            k++;
        cr_assert_lt(k, n, "docs/commands/%s is the page of no command zinf help lists",
                     e->d_name);
        paged[k] = true;
        pages++;

        char file[4400];
        snprintf(file, sizeof(file), "%s/%s", path, e->d_name);
        FILE *f = fopen(file, "r");
        cr_assert_not_null(f, "%s: %s", file, strerror(errno));
        static char want[1 << 17];
        size_t got = fread(want, 1, sizeof(want) - 1, f);
        cr_assert(feof(f), "%s is larger than the test reads", file);
        fclose(f);
        want[got] = '\0';
        char *o;
        cr_assert_eq(run(&o, "help %s", name), 0, "%s", o);
        cr_assert_str_eq(o, want, "zinf help %s is not docs/commands/%s as it is", name,
                         e->d_name);
        free(o);
    }
    closedir(d);
    for (size_t k = 0; k < n; k++)
        cr_assert(paged[k], "zinf %s has no page docs/commands/%s.md", names[k], names[k]);
    cr_assert_eq(pages, n);
}

/* A name that is no command: exit 2, the nearest command suggested, and the usage; zinf
 * help alone still prints the usage (0), and zinf CMD --help the short list of
 * the options, not the page. */
Test(cli, help_unknown_command_and_short_help)
{
    char *o;
    cr_assert_eq(run(&o, "help nosuch"), 2, "%s", o);
    cr_assert(strstr(o, "zinf: help: unknown command 'nosuch'"), "%s", o);
    cr_assert(strstr(o, "usage: zinf <command>"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "help tarin"), 2, "%s", o);
    cr_assert(strstr(o, "(did you mean 'train'?)"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "help"), 0, "%s", o);
    cr_assert(strstr(o, "usage: zinf <command>") && strstr(o, "'zinf help <command>' prints"),
              "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --help"), 0, "%s", o);
    cr_assert(!strncmp(o, "usage: zinf train", strlen("usage: zinf train")), "%s", o);
    cr_assert_null(strstr(o, "## Exit status"), "%s", o);
    free(o);
}

/* --steps N --resume on a run at step N says there is nothing to do (0), past N that it
 * cannot go back (2): never a silent exit. */
Test(cli, train_resume_at_or_past_its_steps_says_so)
{
    char cfg[4096], data[4096], swap[4096], *o;
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 3", cfg, data), 0, "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 3 --resume", cfg, data), 0,
                 "%s", o);
    cr_assert(strstr(o, "done its 3 steps already: nothing to do"), "%s", o);
    cr_assert(strstr(o, "# summary: 3 steps"), "the summary follows: %s", o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 2 --resume", cfg, data), 2,
                 "%s", o);
    cr_assert(strstr(o, "at step 3 already, past 2"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 4 --resume", cfg, data), 0,
                 "%s", o);
    cr_assert(strstr(o, "# summary: 4 steps"), "%s", o);
    cr_assert(strstr(o, "in swap files of"), "the NVMe line is the swap files' size: %s", o);
    free(o);
}

/* --json: topo and version give one JSON object. ZINF_LOG=error keeps the library's
 * notices off stderr. */
Test(cli, topo_and_version_json_and_zinf_log)
{
    char *o;
    json_error_t je;
    cr_assert_eq(run(&o, "topo --json"), 0, "%s", o);
    json_t *j = json_loads(o, 0, &je);
    cr_assert_not_null(j, "%s: %s", je.text, o);
    cr_assert(json_is_array(json_object_get(j, "numa_nodes")));
    cr_assert(json_is_array(json_object_get(j, "storage")));
    cr_assert(json_is_object(json_object_get(j, "placement")));
    json_decref(j);
    free(o);
    cr_assert_eq(run(&o, "version --json"), 0, "%s", o);
    j = json_loads(o, 0, &je);
    cr_assert_not_null(j, "%s: %s", je.text, o);
    cr_assert_str_eq(json_string_value(json_object_get(j, "version")), zinf_version());
    cr_assert(json_is_boolean(json_object_get(j, "cuda_built")));
    cr_assert(json_is_boolean(json_object_get(j, "gpu_usable")));
    if (!json_is_true(json_object_get(j, "gpu_usable")))
        cr_assert(json_string_value(json_object_get(j, "gpu_unusable_reason")), "%s", o);
    /* NCCL: its version where libnccl loads, else null and why. */
    cr_assert_eq(json_is_true(json_object_get(j, "nccl_built")), (bool)ZINF_HAVE_NCCL);
    if (json_is_null(json_object_get(j, "nccl_version")))
        cr_assert(json_string_value(json_object_get(j, "nccl_unloadable_reason")), "%s", o);
    else
        cr_assert(json_integer_value(json_object_get(j, "nccl_version")) >= 20000, "%s", o);
    json_decref(j);
    free(o);
    cr_assert_eq(run(&o, "version"), 0);
    cr_assert(strstr(o, ZINF_HAVE_CUDA ? "cuda: built; GPU: " : "cuda: not built"), "%s", o);
    free(o);

    /* A notice of the library (more io_uring rings than it drives): said, unless
     * ZINF_LOG=error. */
    char cfg[4096];
    snprintf(cfg, sizeof(cfg), "%s/rings.json", dir);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"aio\": {\"intra_op_parallelism\": 16}, \"zinf\": {\"device\": "
               "\"emulated\", \"device_bytes\": \"1M\", \"host_bytes\": \"1M\"}}");
    fclose(f);
    cr_assert_eq(run(&o, "stat --config %s", cfg), 0, "%s", o);
    cr_assert(strstr(o, "zinf: aio.intra_op_parallelism 16: zinf drives at most"), "%s", o);
    free(o);
    setenv("ZINF_LOG", "error", 1);
    cr_assert_eq(run(&o, "stat --config %s", cfg), 0, "%s", o);
    unsetenv("ZINF_LOG");
    cr_assert_null(strstr(o, "zinf: "), "ZINF_LOG=error: %s", o);
    free(o);
}

/* ---- DeepSpeed's keys: every one acts or is named as ignored ------------------------------ */

/* Hugging Face's ZeRO-3 NVMe config: accepted with its "auto"s, each resolved as zinf train
 * would and said; every key zinf does not act on named once, with why, and none of them
 * printed as an effective setting. */
Test(cli, config_check_of_a_hugging_face_zero3_nvme_config)
{
    char *o;
    cr_assert_eq(run(&o, "config check --all %s/hf_zero3_nvme.json", getenv("ZINF_TEST_DATA")), 0,
                 "%s", o);
    static const char *const autos[] = {
        "stage3_prefetch_bucket_size = \"auto\"",
        "#   zero_optimization.stage3_prefetch_bucket_"
        "size = 14745",
        "#   optimizer.params.lr = 0.001",
        "#   train_micro_batch_size_per_gpu = 4",
        "#   gradient_accumulation_steps = 1",
        "#   bf16.enabled = false",
        "#   zero_optimization.stage3_param_persistence_threshold = 1280",
        "#   zero_optimization.reduce_bucket_size = 16384"};
    for (size_t i = 0; i < ARRAY_SIZE(autos); i++)
        cr_expect(strstr(o, autos[i]), "missing '%s':\n%s", autos[i], o);
    static const char *const ignored[] = {"zero_optimization.sub_group_size (",
                                          "zero_optimization.stage3_max_live_parameters (",
                                          "zero_optimization.stage3_max_reuse_distance (",
                                          "zero_optimization.offload_param.max_in_cpu (",
                                          "aio.single_submit (",
                                          "aio.overlap_events (",
                                          "zero_optimization.overlap_comm (",
                                          "zero_optimization.reduce_bucket_size ("};
    for (size_t i = 0; i < ARRAY_SIZE(ignored); i++) {
        char *at = strstr(o, ignored[i]);
        cr_expect(at, "not named as ignored: %s\n%s", ignored[i], o);
        if (at) cr_expect_null(strstr(at + 1, ignored[i]), "named twice: %s", ignored[i]);
        char setting[128];
        snprintf(setting, sizeof(setting), "\n%.*s = ", (int)strcspn(ignored[i], " \n"),
                 ignored[i]);
        cr_expect_null(strstr(o, setting), "printed as a setting: %s", setting);
    }
    cr_expect_null(strstr(o, "unknown key"), "%s", o);
    /* The ignored keys come after the summary (the "auto"s last in it) and before the
     * settings. */
    const char *autos_at = strstr(o, "# \"auto\" as zinf train resolves it"),
               *ignored_at = strstr(o, "# ignored by zinf"),
               *table = strstr(o, "# every setting, defaults included (--all):");
    cr_expect(autos_at && ignored_at && table && autos_at < ignored_at && ignored_at < table,
              "%s", o);
    cr_expect(strstr(o, "# batch: micro-batch 4 x 1 accumulation step x 1 rank = 4 sequences of "
                        "64 tokens a step (train_batch_size \"auto\")"),
              "%s", o);
    free(o);
}

/* The quick start's config (examples/offload-nvme.json) asks for nothing zinf ignores:
 * config check names no key as ignored, nor does zinf train at its start. */
Test(cli, config_of_the_quick_start_asks_for_nothing_ignored)
{
    char example[4096], cfg[4096], data[4096], *o;
    snprintf(example, sizeof(example), "%s/../../examples/offload-nvme.json",
             getenv("ZINF_TEST_DATA"));
    cr_assert_eq(run(&o, "config check --strict %s", example), 0, "%s", o);
    cr_expect_null(strstr(o, "ignored"), "%s", o);
    cr_expect(strstr(o, "# ZeRO stage 3, one rank"), "%s", o);
    cr_expect(strstr(o, "# verdict: valid for zinf train at 1 rank; zinf acts on every key\n"), "%s", o);
    free(o);
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    /* Its nvme_path is relative, as the quick start runs it: from a directory of its own. */
    cr_assert_eq(chdir(dir), 0, "%s", strerror(errno));
    cr_assert_eq(run(&o, "train --config %s --data %s --steps 2", example, data), 0, "%s", o);
    cr_assert_eq(chdir("/"), 0);
    cr_expect_null(strstr(o, "# ignored"), "%s", o);
    /* Its "pin_memory": false is its choice: no notice that the host tier runs unpinned. */
    cr_expect_null(strstr(o, "runs unpinned"), "%s", o);
    free(o);
}

static void ds_config(char *cfg, size_t len, const char *swap, const char *keys)
{
    static int n;
    snprintf(cfg, len, "%s/ds%d.json", dir, n++);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{%s%s\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s\"}}, \"aio\": {\"block_size\": 65536, \"queue_depth\": 4}, "
            "\"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"1M\", \"host_bytes\": "
            "\"1M\"}}",
            keys, keys[0] ? ", " : "", swap, swap);
    fclose(f);
}

/* zinf train honours DeepSpeed's training keys: the micro batch, accumulation, clipping,
 * the optimizer's and scheduler's parameters; the command line overrides them; the
 * effective settings are said at the start and are the log's first line. What it cannot
 * do is refused before anything runs. */
Test(cli, train_honours_deepspeeds_training_keys)
{
    char cfg[4096], data[4096], swap[4096], log[4096], *o;
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    snprintf(log, sizeof(log), "%s/ds.jsonl", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    ds_config(cfg, sizeof(cfg), swap,
              "\"train_micro_batch_size_per_gpu\": 1, \"gradient_accumulation_steps\": 3, "
              "\"gradient_clipping\": 0.25, \"steps_per_print\": 2, "
              "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.004, \"betas\": [0.8, "
              "0.99], \"eps\": 1e-6, \"weight_decay\": 0.1}}, "
              "\"scheduler\": {\"type\": \"WarmupDecayLR\", \"params\": {\"total_num_steps\": 4, "
              "\"warmup_num_steps\": 2, \"warmup_max_lr\": 0.004}}");
    cr_assert_eq(run(&o,
                     "train --config %s --data %s --layers 1 --dim 16 --heads 2 --seq 8 "
                     "--steps 4 --log %s",
                     cfg, data, log),
                 0, "%s", o);
    cr_assert(strstr(o, "# settings: 3 micro-batches of 1 x 8 tokens per step"), "%s", o);
    cr_assert(strstr(o, "AdamW lr 0.004 (WarmupDecayLR schedule), betas 0.8 0.99, eps 1e-06, "
                        "weight decay 0.1, clip 0.25"),
              "%s", o);
    cr_assert(strstr(o, "print every 2"), "%s", o);
    cr_assert(strstr(o, "\n       2 ") && strstr(o, "\n       4 ") && !strstr(o, "\n       1 ") &&
                  !strstr(o, "\n       3 "),
              "steps_per_print 2: %s", o);
    free(o);
    FILE *f = fopen(log, "r");
    char line[8192];
    cr_assert_not_null(fgets(line, sizeof(line), f));
    fclose(f);
    json_error_t je;
    json_t *j = json_loads(line, 0, &je), *s = json_object_get(j, "settings");
    cr_assert(json_is_object(s), "the log's first line: %s", line);
    cr_expect_eq(json_integer_value(json_object_get(s, "batch")), 1);
    cr_expect_eq(json_integer_value(json_object_get(s, "grad_accum")), 3);
    cr_expect_str_eq(json_string_value(json_object_get(s, "scheduler")), "WarmupDecayLR");
    cr_expect_eq(json_integer_value(json_object_get(s, "total_steps")), 4);
    json_decref(j);

    /* fp16 with DeepSpeed's loss scaling (on the CPU backend): the scale is said. */
    snprintf(swap, sizeof(swap), "%s/swap16", dir);
    ds_config(cfg, sizeof(cfg), swap,
              "\"fp16\": {\"enabled\": true, \"initial_scale_power\": 8, "
              "\"loss_scale_window\": 2}");
    cr_assert_eq(run(&o,
                     "train --config %s --data %s --layers 1 --dim 16 --heads 2 --seq 8 "
                     "--steps 4",
                     cfg, data),
                 0, "%s", o);
    /* Doubled once 2 steps went by without an overflow (DeepSpeed's window): from step 4. */
    cr_assert(strstr(o, "       3 ") && strstr(o, "(loss scale 256)\n       4 "), "%s", o);
    cr_assert(strstr(o, "(loss scale 512)"), "%s", o);
    cr_assert(strstr(o, "#   fp16: 0 steps skipped for overflowed gradients; loss scale now 512"),
              "%s", o);
    free(o);

    /* The command line and the file giving different values explicitly: refused, both
     * named, as Hugging Face's Trainer refuses them; "auto" in the file takes the option's. */
    snprintf(swap, sizeof(swap), "%s/swap2", dir);
    ds_config(cfg, sizeof(cfg), swap,
              "\"train_micro_batch_size_per_gpu\": 1, "
              "\"gradient_accumulation_steps\": 3");
    cr_assert_eq(run(&o,
                     "train --config %s --data %s --layers 1 --dim 16 --heads 2 --seq 8 "
                     "--steps 1 --batch 2 --accumulate 1",
                     cfg, data),
                 2, "%s", o);
    cr_assert(strstr(o, "the config and the command line disagree: "
                        "train_micro_batch_size_per_gpu=1 vs --batch 2; "
                        "gradient_accumulation_steps=3 vs --accumulate 1"),
              "%s", o);
    free(o);
    /* The weight decay and the clipping, likewise; equal values are no disagreement. */
    ds_config(cfg, sizeof(cfg), swap,
              "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"weight_decay\": 0.1}}, "
              "\"gradient_clipping\": 2.0");
    cr_assert_eq(run(&o,
                     "train --config %s --data %s --layers 1 --dim 16 --heads 2 --seq 8 "
                     "--steps 1 --weight-decay 0.2 --clip 1",
                     cfg, data),
                 2, "%s", o);
    cr_assert(strstr(o, "the config and the command line disagree: "
                        "optimizer.params.weight_decay=0.1 vs --weight-decay 0.2; "
                        "gradient_clipping=2 vs --clip 1"),
              "%s", o);
    cr_expect(access(swap, F_OK) != 0, "the run started");
    free(o);
    cr_assert_eq(run(&o,
                     "train --config %s --data %s --layers 1 --dim 16 --heads 2 --seq 8 "
                     "--steps 1 --weight-decay 0.1 --clip 2 --dry-run",
                     cfg, data),
                 0, "%s", o);
    cr_expect(strstr(o, "weight decay 0.1, clip 2"), "%s", o);
    free(o);
    ds_config(cfg, sizeof(cfg), swap,
              "\"train_micro_batch_size_per_gpu\": \"auto\", "
              "\"gradient_accumulation_steps\": \"auto\"");
    cr_assert_eq(run(&o,
                     "train --config %s --data %s --layers 1 --dim 16 --heads 2 --seq 8 "
                     "--steps 1 --batch 2 --accumulate 1",
                     cfg, data),
                 0, "%s", o);
    cr_assert(strstr(o, "# settings: 1 micro-batch of 2 x 8 tokens"), "%s", o);
    free(o);

    /* Refused before anything runs: exit 2, the key named. */
    static const struct {
        const char *keys, *says;
    } bad[] = {
        {"\"fp16\": {\"enabled\": true}, \"bf16\": {\"enabled\": true}",
         "fp16.enabled and bf16.enabled are both true"},
        {"\"optimizer\": {\"type\": \"SGD\"}", "optimizer.type \"SGD\""},
        {"\"scheduler\": {\"type\": \"OneCycle\"}", "cycle_min_lr and cycle_max_lr"},
        {"\"scheduler\": {\"type\": \"WarmupCosineLR\"}", "total_num_steps"},
        {"\"train_batch_size\": 5, \"train_micro_batch_size_per_gpu\": 2", "train_batch_size 5"},
        {"\"optimizer\": {\"type\": \"Lamb\", \"params\": {\"eps_inside_sqrt\": true, "
         "\"adam_w_mode\": true}}",
         "adam_w_mode is Adam's"},
        {"\"aio\": {\"block_size\": \"auto\"}", "aio.block_size"},
    };
    for (size_t i = 0; i < ARRAY_SIZE(bad); i++) {
        snprintf(swap, sizeof(swap), "%s/bad%zu", dir, i);
        if (strstr(bad[i].keys, "\"aio\"")) {
            snprintf(cfg, sizeof(cfg), "%s/bad%zu.json", dir, i);
            f = fopen(cfg, "w");
            fprintf(f, "{%s}", bad[i].keys);
            fclose(f);
        } else {
            ds_config(cfg, sizeof(cfg), swap, bad[i].keys);
        }
        cr_assert_eq(run(&o,
                         "train --config %s --data %s --layers 1 --dim 16 --heads 2 --seq 8 "
                         "--steps 1",
                         cfg, data),
                     2, "%s: %s", bad[i].keys, o);
        cr_expect(strstr(o, bad[i].says), "%s: should name %s: %s", bad[i].keys, bad[i].says, o);
        cr_expect(access(swap, F_OK) != 0, "%s: the run started", bad[i].keys);
        free(o);
    }
}

/* llm.c's habits: validation loss every --eval-every steps, sampled text every
 * --sample-every, an ETA on each step, the run's time and mean tokens/s at the end; all of
 * it in the log too. */
Test(cli, train_evaluates_samples_and_says_how_long)
{
    char cfg[4096], data[4096], swap[4096], log[4096], *o;
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    snprintf(log, sizeof(log), "%s/ev.jsonl", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o,
                     "train --config %s --data %s " TINY " --steps 4 --eval-every 2 "
                     "--eval-batches 3 --sample-every 3 --sample-bytes 5 --log %s",
                     cfg, data, log),
                 0, "%s", o);
    cr_assert(strstr(o, "# eval: step 2, val loss ") && strstr(o, "# eval: step 4, val loss "),
              "%s", o);
    cr_assert(strstr(o, "# sample: step 3: \"") && strstr(o, "# sample: step 4: \""), "%s", o);
    cr_assert(strstr(o, " eta\n"), "%s", o);
    cr_assert(strstr(o, "#   ran 4 steps in ") && strstr(o, " tokens/s on average"), "%s", o);
    free(o);
    FILE *f = fopen(log, "r");
    char line[8192];
    int evals = 0, samples = 0, steps = 0;
    bool summary = false;
    while (fgets(line, sizeof(line), f)) {
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        cr_assert_not_null(j, "not JSON: %s", line);
        if (json_object_get(j, "eval")) {
            evals++;
            cr_assert(json_real_value(json_object_get(j, "val_loss")) > 0, "%s", line);
        }
        if (json_object_get(j, "sample")) {
            samples++;
            cr_assert_eq(json_integer_value(json_object_get(j, "bytes")), 5, "%s", line);
            cr_assert(json_string_value(json_object_get(j, "text")), "%s", line);
        }
        if (json_object_get(j, "step")) {
            steps++;
            cr_assert(json_is_number(json_object_get(j, "eta_s")), "%s", line);
        }
        json_t *s = json_object_get(j, "summary");
        if (s) {
            summary = true;
            cr_assert(json_real_value(json_object_get(s, "mean_tokens_per_s")) > 0, "%s", line);
            cr_assert_eq(json_integer_value(json_object_get(s, "steps_run")), 4, "%s", line);
        }
        json_decref(j);
    }
    fclose(f);
    cr_assert_eq(evals, 2);
    cr_assert_eq(samples, 2);
    cr_assert_eq(steps, 4);
    cr_assert(summary);
    /* --sample-bytes is bounded by the context. */
    cr_assert_eq(run(&o,
                     "train --config %s --data %s " TINY " --steps 1 --sample-every 1 "
                     "--sample-bytes 8",
                     cfg, data),
                 2, "%s", o);
    cr_assert(strstr(o, "--sample-bytes 8: at most --seq - 1 = 7"), "%s", o);
    free(o);
}

/* zinf stat next to an engine that has saved nothing yet: it says the directory is in use,
 * not that the tensor is busy, nor that nothing was ever there. */
Test(cli, stat_on_a_directory_in_use_says_so)
{
    char swap[4096], *o;
    snprintf(swap, sizeof(swap), "%s/busy", dir);
    struct zinf_options opt = {.nvme_path = swap,
                               .device_bytes = MiB,
                               .host_bytes = MiB,
                               .device_kind = ZINF_DEVICE_EMULATED,
                               .flags = ZINF_OPEN_NO_PIN};
    zinf_engine *e = NULL;
    cr_assert_eq(zinf_open(&opt, &e), 0);
    cr_assert_eq(run(&o, "stat --path %s", swap), 1, "%s", o);
    cr_assert(strstr(o, "is in use by another engine"), "%s", o);
    free(o);
    /* zinf train over it says the same, not that a tensor is busy. */
    char cfg[4096], data[4096];
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 1", cfg, data), 1, "%s", o);
    cr_assert(strstr(o, "is in use by another engine") && !strstr(o, "tensor is pinned"), "%s", o);
    free(o);
    zinf_close(e);
}

/* ---- zinf serve ------------------------------------------------------------------------ */

/* Connects to the daemon on sock, waiting up to 10 s for it to listen. */
static zinf_engine *connect_when_up(const char *sock, const char *job)
{
    zinf_engine *e = NULL;
    int r = -ENOENT;
    for (int i = 0; i < 1000 && (r == -ENOENT || r == -ECONNREFUSED); i++) {
        r = zinf_connect(sock, job, &e);
        if (r) usleep(10000);
    }
    cr_assert_eq(r, 0, "zinf_connect %s: %s", sock, zinf_strerror(r));
    return e;
}

static void wait_gone(const char *path)
{
    struct stat st;
    for (int i = 0; i < 1000 && stat(path, &st) == 0; i++)
        usleep(10000);
    cr_assert_neq(stat(path, &st), 0, "%s is still there", path);
}

/* Waits until process pid (not a child of this one) has exited: gone, or a zombie. */
static void wait_exited(pid_t pid)
{
    for (int i = 0; i < 2000; i++) {
        char path[64], buf[256];
        snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
        FILE *f = fopen(path, "r");
        if (!f) return;
        size_t n = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[n] = 0;
        const char *close_paren = strrchr(buf, ')');
        if (!close_paren || close_paren[1] == 0 || close_paren[2] == 'Z') return;
        usleep(10000);
    }
    cr_assert_fail("process %d did not exit", (int)pid);
}

/* dir/serve.json (small emulated tiers, swap in dir/swap), and the socket's and the daemon's
 * output's paths; each buffer holds 4096 bytes. */
static void serve_files(char *cfg, char *sock, char *out)
{
    char text[8192];
    snprintf(cfg, 4096, "%s/serve.json", dir);
    snprintf(sock, 4096, "%s/zinf.sock", dir);
    snprintf(out, 4096, "%s/serve.out", dir);
    snprintf(text, sizeof(text),
             "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
             "\"%s/swap\"}}, \"aio\": {\"block_size\": 65536},"
             " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"4M\", \"host_bytes\": "
             "\"4M\"}}",
             dir);
    write_file(cfg, text);
}

Test(cli, serve_keeps_jobs_across_restarts_and_stops_cleanly)
{
    char cfg[4096], sock[4096], out[4096], *o;
    serve_files(cfg, sock, out);

    /* Bad usage and bad input: 2. */
    cr_assert_eq(run(&o, "serve"), 2, "%s", o);
    cr_assert(strstr(o, "--socket and --config are required"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "serve --socket %s --config %s/missing.json", sock, dir), 2, "%s", o);
    free(o);
    char cuda[4200];
    snprintf(cuda, sizeof(cuda), "%s/cuda.json", dir);
    write_file(cuda, "{\"zinf\": {\"device\": \"cuda\"}}");
    /* A GPU is asked for and (on a machine without one) refused at once, not when a job
     * opens. */
    struct cuda_probe_info pi;
    if (cuda_probe(&pi) == 0) {
        cr_assert_eq(run(&o, "serve --socket %s --config %s", sock, cuda), 2, "%s", o);
        cr_assert(strstr(o, "zinf.device \"cuda\" (GPU 0), but "), "%s", o);
        free(o);
    }
    cr_assert_eq(run(&o, "serve --socket %s --config %s --group no-such-group-zinf", sock, cfg), 2,
                 "%s", o);
    cr_assert(strstr(o, "no such group"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "serve --socket %s --config %s --foreground --log %s/l", sock, cfg, dir),
                 2, "%s", o);
    free(o);
    struct stat sst;
    cr_assert_neq(stat(sock, &sst), 0, "a refused serve left a socket file");

    pid_t pid = spawn(out, "serve --socket %s --config %s --foreground", sock, cfg);
    zinf_engine *e = connect_when_up(sock, "job1");
    zinf_tensor t;
    cr_assert_eq(zinf_register(e, "t", 100000, ZINF_TIER_NVME, &t), 0);
    unsigned char *want = test_rand_buf(100000, 5);
    cr_assert_eq(zinf_write(e, t, 0, want, 100000), 0);
    /* zinf stat --socket: the live job, its session and the pin this client holds. */
    void *pin;
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &pin), 0);
    cr_assert_eq(run(&o, "stat --socket %s --json", sock), 0, "%s", o);
    json_error_t je;
    json_t *js = json_loads(o, 0, &je);
    cr_assert_not_null(js, "%s: %s", je.text, o);
    json_t *job = json_array_get(json_object_get(js, "jobs"), 0);
    cr_assert_str_eq(json_string_value(json_object_get(job, "job")), "job1");
    cr_assert_eq(json_integer_value(json_object_get(job, "sessions")), 1);
    cr_assert(json_is_true(json_object_get(job, "open")));
    cr_assert_eq(json_integer_value(json_object_get(job, "pins")), 1);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(job, "stats"), "tensors")), 1);
    json_decref(js);
    free(o);
    cr_assert_eq(run(&o, "stat --socket %s --prometheus", sock), 0, "%s", o);
    cr_assert(strstr(o, "# TYPE zinf_tier_used_bytes gauge") &&
                  strstr(o, "zinf_job_sessions{zinf_job=\"job1\"} 1") &&
                  strstr(o, "zinf_job_pins{zinf_job=\"job1\"} 1") &&
                  strstr(o, "zinf_tier_capacity_bytes{zinf_job=\"job1\",tier=\"host\"} 4194304"),
              "%s", o);
    char build_info[128];
    snprintf(build_info, sizeof(build_info), "zinf_build_info{version=\"%s\",cuda=\"%d\"} 1\n",
             zinf_version(), ZINF_HAVE_CUDA);
    cr_assert(strstr(o, build_info) && strstr(o, "# TYPE zinf_steps_total counter") &&
                  strstr(o, "zinf_steps_total{zinf_job=\"job1\"} 0") &&
                  strstr(o, "zinf_tier_writebacks_total{zinf_job=\"job1\",tier=\"host\"} ") &&
                  strstr(o, "zinf_prefetch_late_total{zinf_job=\"job1\"} ") && !strstr(o, "{job="),
              "%s", o);
    free(o);
    cr_assert_eq(run(&o, "stat --socket %s --config %s", sock, cfg), 2, "%s", o);
    free(o);
    cr_assert_eq(run(&o, "stat --config %s --prometheus", cfg), 2, "%s", o);
    free(o);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    zinf_close(e); /* flushes the job, as an embedded engine's close does */
    /* A second daemon on the socket: a runtime failure, naming the first. */
    cr_assert_eq(run(&o, "serve --socket %s --config %s --foreground", sock, cfg), 1, "%s", o);
    cr_assert(strstr(o, "already answers"), "%s", o);
    free(o);
    kill(pid, SIGTERM);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "serve exited %#x", st);
    wait_gone(sock);

    /* In the background: the command returns once the socket answers. */
    cr_assert_eq(run(&o, "serve --socket %s --config %s --log %s/serve.log", sock, cfg, dir), 0,
                 "%s", o);
    int bg = 0;
    const char *at = strstr(o, "(pid ");
    cr_assert(at && sscanf(at, "(pid %d)", &bg) == 1 && bg > 0, "%s", o);
    free(o);
    /* Nobody attached yet: the job is listed from its folder, saved and not open. */
    cr_assert_eq(run(&o, "stat --socket %s", sock), 0, "%s", o);
    cr_assert(strstr(o, "## job job1 (owner uid ") && strstr(o, "saved, not open (1 tensors)"),
              "%s", o);
    free(o);
    cr_assert_eq(run(&o, "stat --socket %s --prometheus", sock), 0, "%s", o);
    cr_assert(strstr(o, "zinf_job_open{zinf_job=\"job1\"} 0"), "%s", o);
    free(o);
    e = connect_when_up(sock, "job1");
    cr_assert_eq(zinf_lookup(e, "t", &t), 0);
    unsigned char *got = malloc(100000);
    cr_assert_eq(zinf_read(e, t, 0, got, 100000), 0);
    cr_assert_eq(memcmp(got, want, 100000), 0, "the job's tensor after a restart");
    zinf_close(e);
    kill(bg, SIGTERM);
    wait_gone(sock);
    wait_exited(bg); /* it flushes after the socket is gone */
    cr_assert_eq(run(&o, "stat --socket %s", sock), 1, "%s", o);
    cr_assert(strstr(o, "no zinf daemon listens there"), "%s", o);
    free(o);
    char lp[4200];
    snprintf(lp, sizeof(lp), "%s/serve.log", dir);
    char *log = read_text(lp);
    cr_assert(strstr(log, "job job1 opened") && strstr(log, "stopped"), "%s", log);
    free(log);
    free(got);
    free(want);
}

/* The README's training through `zinf serve --connect`: bitwise the losses of the
 * embedded run; the daemon restarted in between, --resume continues the job as an
 * embedded --resume continues its swap directory; the refusals say the job's name. */
Test(cli, train_through_the_daemon_equals_embedded)
{
    char cfg[4096], data[4096], swap[4096], dcfg[4096], ddata[4096], dswap[4096], sock[4096];
    char out[4096], *o;
    snprintf(swap, sizeof(swap), "%s/swap-emb", dir);
    snprintf(dswap, sizeof(dswap), "%s/swap-daemon", dir);
    snprintf(sock, sizeof(sock), "%s/zinf.sock", dir);
    snprintf(out, sizeof(out), "%s/serve.out", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    train_files(dswap, dcfg, sizeof(dcfg), ddata, sizeof(ddata));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 4 --log %s/emb.jsonl", cfg,
                     data, dir),
                 0, "%s", o);
    free(o);
    cr_assert_eq(run(&o,
                     "train --config %s --data %s " TINY " --steps 7 --resume --log "
                     "%s/emb.jsonl",
                     cfg, data, dir),
                 0, "%s", o);
    free(o);

    /* Nobody listens yet: said, exit 1. */
    cr_assert_eq(
        run(&o, "train --config %s --data %s " TINY " --steps 4 --connect %s", cfg, data, sock), 1,
        "%s", o);
    cr_assert(strstr(o, "nobody listens there"), "%s", o);
    free(o);

    pid_t pid = spawn(out, "serve --socket %s --config %s --foreground", sock, dcfg);
    zinf_engine *probe = connect_when_up(sock, "probe");
    zinf_close(probe);
    /* The trainer's own config names the socket (zinf.connect) and the job. */
    char ccfg[4200];
    snprintf(ccfg, sizeof(ccfg), "%s/connect.json", dir);
    char text[8192];
    snprintf(text, sizeof(text),
             "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\"}, "
             "\"offload_optimizer\": {\"device\": \"nvme\"}}, \"zinf\": {\"connect\": \"%s\", "
             "\"job\": \"tiny\"}}",
             sock);
    write_file(ccfg, text);
    cr_assert_eq(
        run(&o, "train --config %s --data %s " TINY " --steps 4 --log %s/d.jsonl", ccfg, data, dir),
        0, "%s", o);
    free(o);
    /* A second start over it is refused, naming the job. */
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 4", ccfg, data), 2, "%s", o);
    cr_assert(strstr(o, "job tiny") && strstr(o, "--resume"), "%s", o);
    free(o);
    kill(pid, SIGTERM);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "serve exited %#x", st);

    /* A new daemon: the job comes back from its swap folder and the run resumes. */
    pid = spawn(out, "serve --socket %s --config %s --foreground", sock, dcfg);
    probe = connect_when_up(sock, "probe");
    zinf_close(probe);
    cr_assert_eq(run(&o,
                     "train --config %s --data %s " TINY " --steps 7 --resume --log "
                     "%s/d.jsonl",
                     ccfg, data, dir),
                 0, "%s", o);
    free(o);
    /* --overwrite starts the job over: its first losses are the first run's again. */
    cr_assert_eq(run(&o,
                     "train --config %s --data %s " TINY " --steps 2 --overwrite --log "
                     "%s/d2.jsonl",
                     ccfg, data, dir),
                 0, "%s", o);
    free(o);
    kill(pid, SIGTERM);
    cr_assert_eq(waitpid(pid, &st, 0), pid);

    char emb[MAX_STEPS + 1][32] = {{0}}, dmn[MAX_STEPS + 1][32] = {{0}},
                         again[MAX_STEPS + 1][32] = {{0}};
    char p1[4200], p2[4200], p3[4200];
    snprintf(p1, sizeof(p1), "%s/emb.jsonl", dir);
    snprintf(p2, sizeof(p2), "%s/d.jsonl", dir);
    snprintf(p3, sizeof(p3), "%s/d2.jsonl", dir);
    cr_assert_eq(read_losses(p1, emb, NULL, NULL), 7);
    cr_assert_eq(read_losses(p2, dmn, NULL, NULL), 7);
    cr_assert_eq(read_losses(p3, again, NULL, NULL), 2);
    for (int s = 1; s <= 7; s++)
        cr_assert_str_eq(dmn[s], emb[s], "step %d: through the daemon %s, embedded %s", s, dmn[s],
                         emb[s]);
    for (int s = 1; s <= 2; s++)
        cr_assert_str_eq(again[s], emb[s], "step %d after --overwrite", s);
}

/* The daemon killed with SIGKILL: a client's next call fails with a connection error and
 * the client stays usable for zinf_close; a new daemon brings back every tensor as it was
 * last flushed (what came after the flush is gone, as after any crash). */
Test(cli, serve_killed_brings_back_what_was_flushed)
{
    char cfg[4096], sock[4096], out[4096];
    serve_files(cfg, sock, out);
    pid_t pid = spawn(out, "serve --socket %s --config %s --foreground", sock, cfg);
    zinf_engine *e = connect_when_up(sock, "crash");
    zinf_tensor t, late;
    unsigned char *want = test_rand_buf(200000, 21), *after = test_rand_buf(200000, 22);
    cr_assert_eq(zinf_register(e, "t", 200000, ZINF_TIER_NVME, &t), 0);
    cr_assert_eq(zinf_write(e, t, 0, want, 200000), 0);
    cr_assert_eq(zinf_flush(e), 0);
    /* After the flush: a new tensor and new bytes, never flushed. */
    cr_assert_eq(zinf_register(e, "late", 4096, ZINF_TIER_NVME, &late), 0);
    cr_assert_eq(zinf_write(e, t, 0, after, 200000), 0);
    kill(pid, SIGKILL);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    int r = zinf_flush(e);
    cr_assert(r == -ECONNRESET || r == -ECONNREFUSED || r == -ENOENT || r == -EPIPE,
              "a call to a dead daemon: %d (%s)", r, zinf_strerror(r));
    zinf_close(e); /* its flush fails too; the handle is freed all the same */

    /* The socket file of the dead daemon is replaced by the new one. */
    pid = spawn(out, "serve --socket %s --config %s --foreground", sock, cfg);
    e = connect_when_up(sock, "crash");
    cr_assert_eq(zinf_lookup(e, "t", &t), 0);
    unsigned char *got = malloc(200000);
    cr_assert_eq(zinf_read(e, t, 0, got, 200000), 0);
    cr_assert_eq(memcmp(got, want, 200000), 0, "the flushed content after a SIGKILL");
    cr_assert_eq(zinf_lookup(e, "late", &late), -ENOENT, "a tensor never flushed came back");
    zinf_close(e);
    kill(pid, SIGTERM);
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "serve exited %#x", st);
    free(got);
    free(want);
    free(after);
}

/* ---- zinf launch ------------------------------------------------------------------- */

static const char *comm_rank_bin(void)
{
    const char *p = getenv("ZINF_COMM_RANK");
    cr_assert_not_null(p, "ZINF_COMM_RANK is not set");
    return p;
}

Test(cli, launch_gives_each_rank_its_environment_and_prefixes_its_lines)
{
    char *o;
    cr_assert_eq(run(&o, "launch -n 3 --name envtest -- sh -c "
                         "'echo out $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $ZINF_COMM_NAME; "
                         "echo err $RANK >&2'"),
                 0, "%s", o);
    for (int r = 0; r < 3; r++) {
        char want[128];
        snprintf(want, sizeof(want), "[%d] out %d 3 %d 3 envtest\n", r, r, r);
        cr_assert(strstr(o, want), "no '%s' in: %s", want, o);
        snprintf(want, sizeof(want), "[%d] err %d\n", r, r);
        cr_assert(strstr(o, want), "no '%s' in: %s", want, o);
    }
    free(o);
    /* A line without its newline is printed all the same. */
    cr_assert_eq(run(&o, "launch -n 1 -- printf 'no newline'"), 0);
    cr_assert(strstr(o, "[0] no newline\n"), "%s", o);
    free(o);
}

/* Where each rank goes, on a two-node machine described in XML with its GPU on node 1. */
Test(cli, launch_places_ranks_near_their_gpu)
{
    char *o;
    const char *data = getenv("ZINF_TEST_DATA");
    cr_assert_not_null(data);
    cr_assert_eq(run(&o, "launch -n 2 --xml %s/two_nodes.xml -- true", data), 0, "%s", o);
    cr_assert(strstr(o, "rank 0 on NUMA node 1 (near GPU 0000:98:00.0): not bound"), "%s", o);
    cr_assert(strstr(o, "rank 1 on NUMA node 1 (near GPU 0000:98:00.0): not bound"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "launch -n 2 --no-bind --xml %s/two_nodes.xml -- true", data), 0, "%s", o);
    cr_assert_null(strstr(o, "NUMA node"), "--no-bind places nothing: %s", o);
    free(o);
    cr_assert_eq(run(&o, "launch -n 2 --xml %s/missing.xml -- true", dir), 2, "%s", o);
    cr_assert(strstr(o, "--xml"), "%s", o);
    free(o);
}

Test(cli, launch_ranks_meet_through_the_communicator)
{
    char *o;
    cr_assert_eq(run(&o, "launch -n 3 -- %s", comm_rank_bin()), 0, "%s", o);
    for (int r = 0; r < 3; r++) {
        char want[64];
        snprintf(want, sizeof(want), "[%d] rank %d ok", r, r);
        cr_assert(strstr(o, want), "no '%s' in: %s", want, o);
    }
    free(o);
}

/* A rank killed mid-job: the others are stopped within seconds and the launcher names it. */
Test(cli, launch_stops_every_rank_when_one_dies)
{
    char *o;
    double t0 = now_s();
    cr_assert_eq(run(&o, "launch -n 3 --grace 5 -- %s die 1", comm_rank_bin()), 1, "%s", o);
    cr_assert_lt(now_s() - t0, 15.0, "the others were not stopped in time: %s", o);
    cr_assert(strstr(o, "failed: rank 1 was killed by signal 9"), "%s", o);
    cr_assert_null(strstr(o, "rank 0 ok"), "%s", o);
    free(o);
    /* A rank that exits non-zero, while the others would run for a minute. */
    t0 = now_s();
    cr_assert_eq(run(&o, "launch -n 2 --grace 5 -- sh -c '[ $RANK = 1 ] && exit 7; exec sleep 60'"), 1,
                 "%s", o);
    cr_assert_lt(now_s() - t0, 15.0, "%s", o);
    cr_assert(strstr(o, "failed: rank 1 exited with status 7"), "%s", o);
    free(o);
}

Test(cli, launch_passes_sigterm_on_and_ranks_exit_cleanly)
{
    char out[4096];
    snprintf(out, sizeof(out), "%s/launch.out", dir);
    pid_t pid = spawn(out, "launch -n 2 -- %s wait", comm_rank_bin());
    double t0 = now_s();
    while (count_lines(out, "[") < 2 && now_s() - t0 < 30) /* both ranks past their checks */
        usleep(20000);
    cr_assert_eq(count_lines(out, "["), 2, "the ranks did not start: %s", read_text(out));
    kill(pid, SIGTERM);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    char *text = read_text(out);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 143, "status %#x: %s", st, text);
    cr_assert(strstr(text, "[0] rank 0 stopped") && strstr(text, "[1] rank 1 stopped"), "%s", text);
    cr_assert(strstr(text, "stopped by SIGTERM; 2 of 2 ranks exited 0"), "%s", text);
    free(text);
}

/* A rank that ignores SIGTERM is killed once --grace ends, and the launcher names it. */
Test(cli, launch_names_the_rank_it_kills_after_the_grace)
{
    char *o, ready[4096];
    snprintf(ready, sizeof(ready), "%s/straggler.ready", dir);
    unlink(ready);
    double t0 = now_s();
    cr_assert_eq(run(&o, "launch -n 2 --grace 1 -- sh -c 'if [ $RANK = 1 ]; then "
                         "while [ ! -e %s ]; do sleep 0.05; done; exit 7; fi; "
                         "trap \"\" TERM; touch %s; exec sleep 60'", ready, ready), 1, "%s", o);
    cr_assert_lt(now_s() - t0, 30.0, "%s", o);
    const char *k = strstr(o, "still running 1 s after SIGTERM: killed");
    cr_assert(k && strstr(o, "zinf launch: rank 0 (pid "), "%s", o);
    cr_assert_null(strstr(k + 1, "still running"), "only rank 0 was left: %s", o);
    cr_assert(strstr(o, "failed: rank 1 exited with status 7"), "%s", o);
    free(o);
    unlink(ready);
}

Test(cli, launch_bad_arguments)
{
    char *o;
    cr_assert_eq(run(&o, "launch -n 0 -- true"), 2);
    cr_assert(strstr(o, "-n 0: a number of ranks from 1 to 64"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "launch -n 65 -- true"), 2);
    free(o);
    cr_assert_eq(run(&o, "launch -- true"), 2);
    cr_assert(strstr(o, "-n N is required"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "launch -n 2"), 2);
    cr_assert(strstr(o, "no COMMAND to run"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "launch -n 2 --name 'a b' -- true"), 2);
    free(o);
    cr_assert_eq(run(&o, "launch -n 2 --grace -1 -- true"), 2);
    free(o);
    /* Numbers past an int's range are refused, not wrapped (4294967298 would be 2 ranks);
     * names are checked by the ranks' own rule, at the launcher. */
    cr_assert_eq(run(&o, "launch -n 4294967298 -- true"), 2, "%s", o);
    cr_assert(strstr(o, "-n 4294967298: a number of ranks from 1 to 64"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "launch -n 2 --grace -4294967295 -- true"), 2, "%s", o);
    cr_assert(strstr(o, "--grace -4294967295: whole seconds from 0 to 3600"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "launch -n 2 --grace 3601 -- true"), 2, "%s", o);
    free(o);
    const char *bad_names[] = {"'a*b'", ".hidden", "''", "a/b",
                               "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"};
    for (size_t i = 0; i < sizeof(bad_names) / sizeof(bad_names[0]); i++) {
        cr_assert_eq(run(&o, "launch -n 2 --name %s -- true", bad_names[i]), 2, "%s: %s",
                     bad_names[i], o);
        cr_assert(strstr(o, "1-63 characters of [A-Za-z0-9._-]"), "%s", o);
        free(o);
    }
    cr_assert_eq(run(&o, "launch -n 2 -- %s/no-such-program", dir), 127);
    cr_assert(strstr(o, "cannot run") && strstr(o, "No such file"), "%s", o);
    free(o);
    /* A wrong world in one rank: every rank fails fast with the reason, not a timeout. */
    double t0 = now_s();
    cr_assert_eq(run(&o, "launch -n 2 -- sh -c '[ $RANK = 1 ] && export WORLD_SIZE=3; exec %s'",
                     comm_rank_bin()),
                 1, "%s", o);
    cr_assert_lt(now_s() - t0, 15.0, "%s", o);
    cr_assert(strstr(o, "rank 1 has a world of 3, rank 0 of 2"), "%s", o);
    free(o);
}

#define LAYOUT_MODEL " --layers 2 --dim 64 --heads 4 --seq 16 --batch 2"

/* A config of a parallel layout (keys inside the top object) whose state lives in swap. */
static void layout_cfg(char *cfg, size_t len, const char *keys, const char *swap)
{
    static int n;
    snprintf(cfg, len, "%s/layout%d.json", dir, n++);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{%s \"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": {\"device\": "
            "\"nvme\", \"nvme_path\": \"%s\"}}, \"aio\": {\"block_size\": 65536, "
            "\"queue_depth\": 4}, \"zinf\": {\"device\": \"emulated\", \"device_bytes\": "
            "\"32M\", \"host_bytes\": \"32M\"}}",
            keys, swap);
    fclose(f);
}

/* zinf launch -n N -- zinf train checks N against the config's layout before any rank
 * starts: a wrong N is refused in one line naming the file, the keys and the N that fit,
 * and nothing of the run is made; a right one is said as copies x stages x ranks. */
Test(cli, launch_checks_ranks_against_the_configs_layout)
{
    char cfg[4096], swap[4096], *o;
    const char *bin = getenv("ZINF_BIN");
    snprintf(swap, sizeof(swap), "%s/layout-swap", dir);
    layout_cfg(cfg, sizeof(cfg),
               "\"pipeline\": {\"stages\": 2}, \"tensor_parallel\": {\"autotp_size\": 2},",
               swap);
    char want[8192];
    snprintf(want, sizeof(want),
             "zinf launch: -n 6 does not fit %s: pipeline.stages 2 x tensor_parallel.autotp_size "
             "2 = 4 ranks per copy of the model; use -n 4, 8, 12...\n",
             cfg);
    /* Both spellings of --config, and the binary under another name (a link to it). */
    char link[4096];
    snprintf(link, sizeof(link), "%s/zinf-renamed", dir);
    cr_assert_eq(symlink(bin, link), 0);
    const char *forms[][2] = {{bin, "--config "}, {bin, "--config="}, {link, "--config "}};
    for (size_t i = 0; i < ARRAY_SIZE(forms); i++) {
        cr_assert_eq(run(&o, "launch -n 6 -- %s train %s%s --data " TT_DATA LAYOUT_MODEL
                             " --steps 1",
                         forms[i][0], forms[i][1], cfg),
                     2, "%zu: %s", i, o);
        cr_assert_str_eq(o, want, "%zu", i);
        free(o);
        cr_assert_neq(access(swap, F_OK), 0, "a rank started: %s is there", swap);
    }
    /* The same N as some other command's: not zinf train's, not checked. */
    cr_assert_eq(run(&o, "launch -n 3 -- sh -c 'exit 0' train --config %s", cfg), 0, "%s", o);
    free(o);

    /* -n 4 fits: 1 copy of 2 stages of 2 tensor-parallel ranks, said, and it trains. */
    cr_assert_eq(run(&o, "launch -n 4 -- %s train --config %s --data " TT_DATA LAYOUT_MODEL
                         " --steps 1",
                     bin, cfg),
                 0, "%s", o);
    cr_assert(strstr(o, "zinf launch: 4 ranks = 1 copy x 2 stages x 2 tensor-parallel ranks\n"),
              "%s", o);
    free(o);
    cr_assert_eq(access(swap, F_OK), 0);

    /* Stages alone, with the N that fit running past what a job may have. */
    layout_cfg(cfg, sizeof(cfg), "\"pipeline\": {\"stages\": 24},", swap);
    cr_assert_eq(run(&o, "launch -n 5 -- %s train --config=%s --data " TT_DATA, bin, cfg), 2,
                 "%s", o);
    cr_assert(strstr(o, "-n 5 does not fit") && strstr(o, ": pipeline.stages 24 = 24 ranks per "
                                                          "copy of the model; use -n 24, 48\n"),
              "%s", o);
    free(o);
    layout_cfg(cfg, sizeof(cfg), "\"sequence_parallel_size\": 64, \"pipeline\": {\"stages\": 2},",
               swap);
    cr_assert_eq(run(&o, "launch -n 2 -- %s train --config %s --data " TT_DATA, bin, cfg), 2,
                 "%s", o);
    cr_assert(strstr(o, "pipeline.stages 2 x sequence_parallel_size 64 = 128 ranks per copy of "
                        "the model; no -n fits (a job has at most 64 ranks)"),
              "%s", o);
    free(o);

    /* Tensor and sequence parallel together cannot be, whatever N. */
    layout_cfg(cfg, sizeof(cfg),
               "\"sequence_parallel_size\": 2, \"tensor_parallel\": {\"autotp_size\": 2},",
               swap);
    cr_assert_eq(run(&o, "launch -n 4 -- %s train --config %s --data " TT_DATA, bin, cfg), 2,
                 "%s", o);
    snprintf(want, sizeof(want),
             "zinf launch: %s: tensor_parallel.autotp_size 2 with sequence_parallel_size 2: both "
             "cut the heads; use one of them\n",
             cfg);
    cr_assert_str_eq(o, want);
    free(o);

    /* A config that does not parse is the ranks' to refuse: the launcher starts them. */
    snprintf(cfg, sizeof(cfg), "%s/broken.json", dir);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    fputs("{\"pipeline\": {\"stages\": 2}, ", f);
    fclose(f);
    cr_assert_eq(run(&o, "launch -n 3 -- %s train --config %s --data " TT_DATA, bin, cfg), 1,
                 "%s", o);
    /* Whichever rank says it first: the launcher stops the others then. */
    cr_assert(strstr(o, "] zinf train: ") && strstr(o, "broken.json") &&
                  !strstr(o, "does not fit"),
              "%s", o);
    free(o);
}

/* ---- zinf launch --hostfile: the ranks under mpirun ---------------------------------- */

static bool have_mpirun(void)
{
    return system("command -v mpirun >/dev/null 2>&1") == 0;
}

/* A hostfile of dir's with this text: its path. */
static const char *hostfile(const char *name, const char *text)
{
    static char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
    return path;
}

/* The ranks get Open MPI's rank and world and the job's name and secret, their lines come
 * back "[R] "-prefixed as a job's on one node, -n takes fewer than the slots, a failed rank
 * fails the job, and the hostfile made for mpirun is removed. */
Test(cli, launch_hostfile_runs_the_ranks_under_mpirun)
{
    if (!have_mpirun()) cr_skip_test("no mpirun (openmpi-bin)");
    char *o, tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s/mpitmp", dir);
    mkdir(tmp, 0700);
    setenv("TMPDIR", tmp, 1);
    setenv("ZINF_TEST_PASSED", "yes", 1);
    const char *hf = hostfile("hosts", "# one node\n\nlocalhost slots=3 # three ranks\n");
    cr_assert_eq(run(&o, "launch --hostfile %s --name mpitest -- sh -c 'echo out "
                         "$OMPI_COMM_WORLD_RANK $OMPI_COMM_WORLD_SIZE $ZINF_COMM_NAME "
                         "${#ZINF_COMM_SECRET} $ZINF_TEST_PASSED; echo err $OMPI_COMM_WORLD_RANK >&2'",
                     hf),
                 0, "%s", o);
    for (int r = 0; r < 3; r++) {
        char want[128];
        snprintf(want, sizeof(want), "[%d] out %d 3 mpitest 32 yes\n", r, r);
        cr_assert(strstr(o, want), "no '%s' in: %s", want, o);
        snprintf(want, sizeof(want), "[%d] err %d\n", r, r);
        cr_assert(strstr(o, want), "no '%s' in: %s", want, o);
    }
    cr_assert_null(strstr(o, "<stdout>"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "launch --hostfile %s -n 2 -- sh -c 'echo rank $OMPI_COMM_WORLD_RANK'", hf),
                 0, "%s", o);
    cr_assert(strstr(o, "[1] rank 1") && !strstr(o, "[2] rank 2"), "%s", o);
    free(o);
    cr_assert_neq(run(&o, "launch --hostfile %s -- sh -c '[ $OMPI_COMM_WORLD_RANK = 1 ] && exit 3; "
                          "exit 0'", hf),
                  0, "%s", o);
    cr_assert(strstr(o, "zinf launch: failed: mpirun exited with status"), "%s", o);
    free(o);
    unsetenv("TMPDIR");
    unsetenv("ZINF_TEST_PASSED");
    DIR *d = opendir(tmp);
    struct dirent *de;
    while ((de = readdir(d)))
        cr_assert(de->d_name[0] == '.', "left behind: %s/%s", tmp, de->d_name);
    closedir(d);
}

/* SIGTERM reaches mpirun once, which stops the ranks; the launcher says so and exits 143. */
Test(cli, launch_hostfile_passes_sigterm_to_mpirun)
{
    if (!have_mpirun()) cr_skip_test("no mpirun (openmpi-bin)");
    char out[4096];
    snprintf(out, sizeof(out), "%s/mpilaunch.out", dir);
    const char *hf = hostfile("hosts2", "localhost slots=2\n");
    pid_t pid = spawn(out, "launch --hostfile %s -- sh -c 'echo ready; exec sleep 60'", hf);
    double t0 = now_s();
    while (count_lines(out, "[") < 2 && now_s() - t0 < 30) /* "[R] ready" from both */
        usleep(20000);
    cr_assert_eq(count_lines(out, "["), 2, "the ranks did not start: %s", read_text(out));
    t0 = now_s();
    kill(pid, SIGTERM);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    char *text = read_text(out);
    cr_assert_lt(now_s() - t0, 15.0, "%s", text);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 143, "status %#x: %s", st, text);
    cr_assert(strstr(text, "passed on to mpirun"), "%s", text);
    free(text);
    /* pgrep's status, not a shell's "not found": 1 is no such process. */
    int left = system("pgrep -f 'sh -c echo [r]eady; exec sleep 60' >/dev/null");
    cr_assert(WIFEXITED(left) && WEXITSTATUS(left) == 1, "ranks left running (pgrep: %#x)", left);
}

/* Each hostfile mistake is named with the file and its line; -n above the slots, --mpi-arg
 * without --hostfile and a missing mpirun are refused before anything runs. */
Test(cli, launch_hostfile_bad_files)
{
    static const struct {
        const char *text, *want;
    } bad[] = {
        {"a slots=2\nb slots=0\n", ":2: 'slots=0': expected slots=N with N from 1 to 64"},
        {"a slots=x\n", ":1: 'slots=x': expected slots=N"},
        {"a slots=65\n", ":1: 'slots=65'"},
        {"a slot=2\n", ":1: 'slot=2': expected slots=N"},
        {"a slots=2\n# b\na slots=1\n", ":3: host a is given twice (first on line 1)"},
        {"a slots=2 extra\n", ":1: 'extra': expected 'HOST' or 'HOST slots=N'"},
        {"node_1 slots=2\n", ":1: 'node_1' is not a host name"},
        {"-a\n", ":1: '-a' is not a host name"},
        {"a..b\n", ":1: 'a..b' is not a host name"},
        {"# nothing\n\n", ": no hosts"},
        {"a slots=40\nb slots=30\n", ":2: more than 64 slots in all"},
    };
    char *o;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const char *hf = hostfile("badhosts", bad[i].text);
        char want[4300];
        snprintf(want, sizeof(want), "%s%s", hf, bad[i].want);
        cr_assert_eq(run(&o, "launch --hostfile %s -- true", hf), 2, "%s", o);
        cr_assert(strstr(o, want), "no '%s' in: %s", want, o);
        free(o);
    }
    cr_assert_eq(run(&o, "launch --hostfile %s/no-such-hostfile -- true", dir), 2, "%s", o);
    cr_assert(strstr(o, "no-such-hostfile: No such file"), "%s", o);
    free(o);
    const char *hf = hostfile("hosts3", "a slots=2\nb\n");
    cr_assert_eq(run(&o, "launch --hostfile %s -n 4 -- true", hf), 2, "%s", o);
    cr_assert(strstr(o, "-n 4: more ranks than the 3 slots of"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "launch -n 2 --mpi-arg --oversubscribe -- true"), 2, "%s", o);
    cr_assert(strstr(o, "--mpi-arg goes with --hostfile"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "launch --hostfile %s", hf), 2, "%s", o);
    cr_assert(strstr(o, "no COMMAND to run"), "%s", o);
    free(o);
    char *path = strdup(getenv("PATH"));
    setenv("PATH", dir, 1);
    int rc = run(&o, "launch --hostfile %s -- true", hf);
    setenv("PATH", path, 1);
    free(path);
    cr_assert_eq(rc, 127, "%s", o);
    cr_assert(strstr(o, "mpirun, which is not on PATH: install openmpi-bin"), "%s", o);
    free(o);
}

/* Under mpirun zinf train takes its place from Open MPI's variables, with their names in
 * its errors; WORLD_SIZE, where set, wins. */
Test(cli, train_under_mpirun_reads_open_mpis_rank)
{
    char *o, cfg[4096], data[4096];
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    unsetenv("WORLD_SIZE");
    setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
    setenv("OMPI_COMM_WORLD_RANK", "5", 1);
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 1", cfg, data), 2, "%s", o);
    cr_assert(strstr(o, "OMPI_COMM_WORLD_SIZE '2' and OMPI_COMM_WORLD_RANK '5'") &&
                  strstr(o, "mpirun sets them"), "%s", o);
    free(o);
    setenv("OMPI_COMM_WORLD_RANK", "1", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "x", 1);
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 1", cfg, data), 2, "%s", o);
    cr_assert(strstr(o, "OMPI_COMM_WORLD_LOCAL_RANK 'x'"), "%s", o);
    free(o);
    /* A launcher of its own inside an MPI job: its WORLD_SIZE of one rank wins. */
    setenv("WORLD_SIZE", "1", 1);
    setenv("RANK", "0", 1);
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 1", cfg, data), 0, "%s", o);
    free(o);
    unsetenv("WORLD_SIZE");
    unsetenv("RANK");
    unsetenv("OMPI_COMM_WORLD_SIZE");
    unsetenv("OMPI_COMM_WORLD_RANK");
    unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
}

/* ---- ZeRO: zinf train across ranks ----------------------------------------------------- */

#define ZMODEL "--layers 2 --dim 64 --heads 4 --seq 16 --batch 2"

/* A config for ranks: parameters and optimizer states on NVMe under swap, at stage (4:
 * stage 3 with a persistence threshold that keeps the vectors whole on every rank; 5: stage 3
 * gathering no block ahead; 6: the same for lack of stage3_max_live_parameters; 7: stage 2
 * with overlap_comm; 8: stage 3 without; 9: stage 1 with overlap_comm; 10: stage 2 with
 * overlap_comm but a reduce_bucket_size below a block's gradients). */
static void zero_config(char *cfg, size_t len, const char *swap, int stage)
{
    const char *persist = stage == 4    ? "\"stage3_param_persistence_threshold\": 1000, "
                          : stage == 5  ? "\"stage3_prefetch_bucket_size\": 0, "
                          : stage == 6  ? "\"stage3_max_live_parameters\": 1000, "
                          : stage == 7  ? "\"overlap_comm\": true, "
                          : stage == 8  ? "\"overlap_comm\": false, "
                          : stage == 9  ? "\"overlap_comm\": true, "
                          : stage == 10 ? "\"overlap_comm\": true, \"reduce_bucket_size\": 1000, "
                                        : "";
    stage = stage == 9 ? 1 : stage == 7 || stage == 10 ? 2 : MIN(stage, 3);
    static int n;
    snprintf(cfg, len, "%s/zero%d.json", dir, n++);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {%s\"stage\": %d, \"offload_param\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s\"}}, \"aio\": {\"block_size\": 65536, \"queue_depth\": 4}, "
            "\"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"32M\", \"host_bytes\": "
            "\"32M\"}}",
            persist, stage, swap, swap);
    fclose(f);
}

/* Run `zinf launch -n ranks -- zinf train --config cfg ARGS` (ranks 0: zinf train alone).
 * The thread counts differ on purpose: the lone trainer runs 3 OpenMP threads, the launcher
 * gives each rank its share of the CPUs (one on a 2-CPU machine), and the bits must not
 * care. */
static int train_ranks(char **out, int ranks, const char *cfg, const char *data, const char *args)
{
    if (ranks)
        unsetenv("OMP_NUM_THREADS");
    else
        setenv("OMP_NUM_THREADS", "3", 1);
    if (!ranks) return run(out, "train --config %s --data %s %s", cfg, data, args);
    return run(out, "launch -n %d -- %s train --config %s --data %s %s", ranks, getenv("ZINF_BIN"),
               cfg, data, args);
}

/* A figure of the summary in a --log file: key's value, or with tier ("device", "host",
 * "nvme") that tier's key. */
static uint64_t summary_value(const char *log, const char *tier, const char *key)
{
    FILE *f = fopen(log, "r");
    char line[4096];
    uint64_t v = 0;
    cr_assert_not_null(f, "%s", log);
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, "{\"summary\"", 10)) continue;
        json_t *j = json_loads(line, 0, NULL);
        cr_assert_not_null(j, "%s", line);
        json_t *sum = json_object_get(j, "summary");
        v = json_integer_value(json_object_get(tier ? json_object_get(sum, tier) : sum, key));
        json_decref(j);
    }
    fclose(f);
    cr_assert_gt(v, 0, "%s: no %s %s", log, tier ? tier : "", key);
    return v;
}

static uint64_t summary_peak(const char *log, const char *tier)
{
    return summary_value(log, tier, "peak_bytes");
}

/* A whole run under dir/NAME: `ranks` ranks (0: zinf train alone) at stage, ZMODEL and
 * extra, for `steps` steps, logged to dir/NAME.jsonl; its losses into loss. */
static void zero_run(const char *name, int ranks, int stage, const char *extra, int steps,
                     char (*loss)[32])
{
    char cfg[4096], data[4096], swap[4096], log[4096], args[8192], *o;
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    snprintf(swap, sizeof(swap), "%s/%s", dir, name);
    snprintf(log, sizeof(log), "%s/%s.jsonl", dir, name);
    zero_config(cfg, sizeof(cfg), swap, stage);
    snprintf(args, sizeof(args), ZMODEL " --steps %d --log %s %s", steps, log, extra);
    cr_assert_eq(train_ranks(&o, ranks, cfg, data, args), 0, "%s: %s", name, o);
    free(o);
    memset(loss, 0, (MAX_STEPS + 1) * sizeof(*loss));
    cr_assert_eq(read_losses(log, loss, NULL, NULL), steps, "%s", name);
}

/* A config without budgets: config check and train both say the budgets train derives and
 * how, the same figures for the same model; a config that gives them says nothing of it. */
Test(cli, derived_budgets_are_said_in_config_check_and_train)
{
    char cfg[4096], data[4096], *o;
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    snprintf(cfg, sizeof(cfg), "%s/nobudget.json", dir);
    write_file(cfg, "{\"zinf\": {\"train\": {\"layers\": 1, \"dim\": 32, \"heads\": 2, "
                    "\"seq\": 16, \"batch\": 2}}}");
    cr_assert_eq(run(&o, "config check %s", cfg), 0, "%s", o);
    char dev[64] = "", host[64] = "";
    const char *d = strstr(o, "#   device "), *h = strstr(o, "#   host ");
    cr_assert(strstr(o, "zinf train's budgets where the config gives none") && d && h, "%s", o);
    cr_assert(strstr(d, "a quarter of the") && strstr(h, "half of the"), "%s", o);
    sscanf(d, "#   device %63[^:]", dev);
    sscanf(h, "#   host %63[^:]", host);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s --steps 1", cfg, data), 0, "%s", o);
    char want[160];
    snprintf(want, sizeof(want), "# budgets: device %s, host %s (", dev, host);
    cr_expect(strstr(o, want), "no '%s' in: %s", want, o);
    cr_expect(strstr(o, "#   device budget: a quarter of the") &&
                  strstr(o, "#   host budget: half of the"),
              "%s", o);
    free(o);
    write_file(cfg, "{\"zinf\": {\"device_bytes\": \"64M\", \"host_bytes\": \"32M\", "
                    "\"train\": {\"layers\": 1, \"dim\": 32, \"heads\": 2, \"seq\": 16}}}");
    cr_assert_eq(run(&o, "config check %s", cfg), 0, "%s", o);
    cr_expect_null(strstr(o, "budgets where the config gives none"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s --steps 1", cfg, data), 0, "%s", o);
    cr_expect(strstr(o, "# budgets: device 64 MiB, host 32 MiB") && !strstr(o, "device budget:"),
              "%s", o);
    free(o);
}

/* DeepSpeed's other optimizers and OneCycle across ranks: LAMB's trust ratios are summed by
 * fixed chunks whoever owns them, Adam's L2 decay and OneCycle's betas are per element and per
 * step, so 2 ranks of one micro-batch log bitwise the losses and digests of one rank
 * accumulating 2, at stage 1 and stage 3. */
Test(cli, lamb_adam_l2_and_one_cycle_across_ranks_equal_one_rank, .timeout = 300)
{
    static const char *const optim[] = {
        "\"optimizer\": {\"type\": \"Lamb\", \"params\": {\"lr\": 0.002, \"weight_decay\": 0.01, "
        "\"max_coeff\": 0.3, \"min_coeff\": 0.001}}",
        "\"optimizer\": {\"type\": \"Adam\", \"params\": {\"lr\": 0.002, \"weight_decay\": 0.1, "
        "\"adam_w_mode\": false, \"bias_correction\": false}}"};
    char cfg[4200], data[4096], swap[4096], log[4200], args[8192], *o;
    static char ref[MAX_STEPS + 1][32], got[MAX_STEPS + 1][32];
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    for (size_t k = 0; k < ARRAY_SIZE(optim); k++)
        for (int stage = 1; stage <= 3; stage += 2)
            for (int n = 0; n <= 2; n += 2) {
                snprintf(swap, sizeof(swap), "%s/opt%zus%dn%d", dir, k, stage, n);
                snprintf(log, sizeof(log), "%s.jsonl", swap);
                snprintf(cfg, sizeof(cfg), "%s.json", swap);
                FILE *f = fopen(cfg, "w");
                cr_assert_not_null(f);
                fprintf(f,
                        "{%s, \"scheduler\": {\"type\": \"OneCycle\", \"params\": {"
                        "\"cycle_min_lr\": 0.0005, \"cycle_max_lr\": 0.003, "
                        "\"cycle_first_step_size\": 2}}, \"zero_optimization\": {\"stage\": %d, "
                        "\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}, "
                        "\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}}, "
                        "\"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"32M\", "
                        "\"host_bytes\": \"32M\"}}",
                        optim[k], stage, swap, swap);
                fclose(f);
                snprintf(args, sizeof(args), ZMODEL " --steps 4 --log %s%s", log,
                         n ? "" : " --accumulate 2");
                cr_assert_eq(train_ranks(&o, n, cfg, data, args), 0, "%s", o);
                free(o);
                memset(got, 0, sizeof(got));
                cr_assert_eq(read_losses(log, got, NULL, NULL), 4);
                for (int step = 1; step <= 4; step++) {
                    if (!n && stage == 1) snprintf(ref[step], sizeof(ref[step]), "%s", got[step]);
                    cr_assert_str_eq(got[step], ref[step], "%s, stage %d, %d ranks, step %d",
                                     k ? "Adam L2" : "Lamb", stage, n, step);
                }
            }
}

/* N ranks of one micro-batch each log bitwise the losses of one rank accumulating N
 * micro-batches, at every stage (stage 3 also with persistent vectors, and without gathering
 * ahead, by setting or for lack of room; stages 1 and 2 with overlap_comm and stage 3
 * without), with everything on NVMe: the shm backend sums in rank order and the one rank
 * adds its micro-batches' gradients in the same order. Without test_soak() each setting runs
 * on one number of ranks (4 where its device memory is compared, else 2), stage 3 on all. */
Test(cli, zero_ranks_give_the_losses_of_one_rank_accumulating_their_micro_batches,
     .timeout = 300)
{
    char cfg[4096], data[4096], swap[4096], log[4096], args[8192], *o;
    static char ref[5][MAX_STEPS + 1][32], got[MAX_STEPS + 1][32];
    const int ns[] = {1, 2, 4};
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    for (int k = 0; k < 3; k++) {
        char name[32], acc[32];
        snprintf(name, sizeof(name), "ref%d", ns[k]);
        snprintf(acc, sizeof(acc), "--accumulate %d", ns[k]);
        zero_run(name, 0, 3, acc, 3, ref[ns[k]]);
    }
    uint64_t min_dev[11] = {0};
    for (int stage = 1; stage <= 10; stage++)
        for (int k = 0; k < 3; k++) {
            int n = ns[k];
            if (n == 1 && stage != 3) continue; /* one rank partitions nothing at any stage */
            bool four = stage != 1 && stage != 4 && stage != 9; /* min_dev[] compares these */
            if (!test_soak() && stage != 3 && n != (four ? 4 : 2)) continue;
            snprintf(swap, sizeof(swap), "%s/s%dn%d", dir, stage, n);
            snprintf(log, sizeof(log), "%s/s%dn%d.jsonl", dir, stage, n);
            zero_config(cfg, sizeof(cfg), swap, stage);
            snprintf(args, sizeof(args), ZMODEL " --steps 3 --log %s", log);
            cr_assert_eq(train_ranks(&o, n, cfg, data, args), 0, "%s", o);
            if (n > 1) {
                char want[96];
                snprintf(want, sizeof(want), "[%d] #   ZeRO stage %d: rank %d of %d", n - 1,
                         stage == 9 ? 1 : stage == 7 || stage == 10 ? 2 : MIN(stage, 3), n - 1, n);
                cr_assert(strstr(o, want), "no '%s' in: %s", want, o);
                /* overlap_comm: given, or by default at stage 3; not when a block's
                 * gradients exceed reduce_bucket_size, which is said. */
                bool ov = stage == 7 || stage == 9 || (stage >= 3 && stage <= 6);
                cr_assert(strstr(o, ov ? "(overlap_comm: each behind" : "(each after its block"),
                          "stage %d: %s", stage, o);
                cr_assert(stage != 10 || strstr(o, "exceed reduce_bucket_size (1000)"), "%s", o);
                cr_assert_null(strstr(o, "[1]   "), "only rank 0 prints the steps: %s", o);
            }
            free(o);
            memset(got, 0, sizeof(got));
            cr_assert_eq(read_losses(log, got, NULL, NULL), 3);
            for (int step = 1; step <= 3; step++)
                cr_assert_str_eq(got[step], ref[n][step], "stage %d, %d ranks, step %d", stage, n,
                                 step);
            if (n == 4) min_dev[stage] = summary_value(log, NULL, "min_device_bytes");
        }
    /* Gathering a block ahead takes a second block's gather buffers; without it, one. */
    cr_assert_gt(min_dev[3], min_dev[5], "%llu, %llu", (unsigned long long)min_dev[3],
                 (unsigned long long)min_dev[5]);
    cr_assert_eq(min_dev[6], min_dev[5]);
    /* Reducing behind the next block takes a second block's local gradients. */
    cr_assert_gt(min_dev[7], min_dev[2]);
    cr_assert_gt(min_dev[3], min_dev[8]);
    cr_assert_eq(min_dev[10], min_dev[2]);

    /* Several micro-batches per rank: the later ones add onto g in the reduction, on the
     * comm's thread with overlap_comm, bitwise what they add without it and what one rank
     * of 4 adds. Three blocks at stage 3: the middle one's backward gathers ahead and
     * reduces behind at once. */
    static char a[MAX_STEPS + 1][32], b[MAX_STEPS + 1][32];
    for (int stage = 1; stage <= 4; stage++) {
        char na[32], nb[32];
        const char *extra = stage == 4 ? "--accumulate 2 --layers 3" : "--accumulate 2";
        snprintf(na, sizeof(na), "acc%d", stage);
        snprintf(nb, sizeof(nb), "acc%dov", stage);
        zero_run(na, 2, stage >= 3 ? 8 : stage, extra, 3, a);
        zero_run(nb, 2, stage == 1 ? 9 : stage == 2 ? 7 : 3, extra, 3, b);
        for (int step = 1; step <= 3; step++) {
            cr_assert_str_eq(a[step], b[step], "stage %d, step %d", stage, step);
            if (stage < 4) cr_assert_str_eq(a[step], ref[4][step], "stage %d, step %d", stage, step);
        }
    }
}

/* The summary's comm_ops and comm_pooled_ops of a --log file (0 where absent). */
static void comm_ops_of(const char *log, uint64_t *ops, uint64_t *pooled)
{
    FILE *f = fopen(log, "r");
    char line[4096];
    *ops = *pooled = 0;
    cr_assert_not_null(f, "%s", log);
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, "{\"summary\"", 10)) continue;
        json_t *j = json_loads(line, 0, NULL);
        cr_assert_not_null(j, "%s", line);
        json_t *sum = json_object_get(j, "summary");
        *ops = (uint64_t)json_integer_value(json_object_get(sum, "comm_ops"));
        *pooled = (uint64_t)json_integer_value(json_object_get(sum, "comm_pooled_ops"));
        json_decref(j);
    }
    fclose(f);
}

/* CPU ranks lend their device tiers the communicator's pool (zinf.comm_pool, on by default):
 * the collectives on device buffers (gradient reductions, stage 3's gathers) and the
 * optimizer's exchange read the peers' buffers in place, one copy. Off, every collective
 * goes through the staging areas. The losses are bitwise the same either way, at stages 1
 * to 3, with 2 and 3 ranks. */
Test(cli, zero_ranks_collectives_copy_once_in_the_pool, .timeout = 300)
{
    char cfg[4096], data[4096], swap[2048], log[4096], args[8192], *o;
    static char on[MAX_STEPS + 1][32], off[MAX_STEPS + 1][32];
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    for (int stage = 1; stage <= 3; stage++)
        for (int n = 2; n <= 3; n++) {
            if (n == 3 && stage != 3) continue;
            for (int pool = 1; pool >= 0; pool--) {
                snprintf(swap, sizeof(swap), "%s/pool%d-s%d-n%d", dir, pool, stage, n);
                snprintf(log, sizeof(log), "%s.jsonl", swap);
                snprintf(cfg, sizeof(cfg), "%s.json", swap);
                FILE *f = fopen(cfg, "w");
                cr_assert_not_null(f);
                fprintf(f,
                        "{\"zero_optimization\": {\"stage\": %d, \"offload_param\": {\"device\": "
                        "\"nvme\"}, \"offload_optimizer\": {\"device\": \"nvme\"}}, \"aio\": "
                        "{\"block_size\": 65536, \"queue_depth\": 4}, \"zinf\": {\"device\": "
                        "\"emulated\", \"nvme_paths\": [\"%s\"], \"device_bytes\": \"32M\", "
                        "\"host_bytes\": \"32M\", \"comm_pool\": %s}}",
                        stage, swap, pool ? "true" : "false");
                fclose(f);
                snprintf(args, sizeof(args), ZMODEL " --steps 3 --log %s", log);
                cr_assert_eq(train_ranks(&o, n, cfg, data, args), 0, "%s", o);
                free(o);
                char(*loss)[32] = pool ? on : off;
                memset(loss, 0, (MAX_STEPS + 1) * sizeof(*loss));
                cr_assert_eq(read_losses(log, loss, NULL, NULL), 3);
                uint64_t ops, pooled;
                comm_ops_of(log, &ops, &pooled);
                cr_assert_gt(ops, 0);
                if (pool)
                    /* All but the small host exchanges (losses, norms, agreements), which
                     * are many at this size. */
                    cr_assert_gt(pooled * 2, ops, "stage %d, %d ranks: %llu of %llu pooled",
                                 stage, n, (unsigned long long)pooled, (unsigned long long)ops);
                else
                    cr_assert_eq(pooled, 0, "comm_pool false, yet %llu pooled",
                                 (unsigned long long)pooled);
            }
            for (int step = 1; step <= 3; step++)
                cr_assert_str_eq(on[step], off[step], "stage %d, %d ranks, step %d", stage, n,
                                 step);
        }
}

/* At odd shapes (B*T not a multiple of 8, 12, 48 or 64; dims 48 to 160), 2 and 3 ranks of
 * one micro-batch each log bitwise the losses and digests of one rank accumulating 2 and 3
 * micro-batches, which runs another number of threads. Stage 1 and stage 3. Without
 * test_soak() each shape runs on one number of ranks, 2 and 3 by turns. */
Test(cli, zero_ranks_equal_accumulation_at_odd_shapes, .timeout = 300)
{
    const char *shapes[] = {
        "--layers 2 --dim 48 --heads 2 --seq 17 --batch 3",
        "--layers 2 --dim 160 --heads 4 --seq 61 --batch 2",
        "--layers 2 --dim 80 --heads 10 --seq 31 --batch 5",
    };
    char cfg[4096], data[4096], swap[4096], log[4096], args[8192], *o;
    static char ref[MAX_STEPS + 1][32], got[MAX_STEPS + 1][32];
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    for (int k = 0; k < 3; k++)
        for (int n = 2; n <= 3; n++)
            for (int stage = 1; stage <= 3; stage += 2) {
                if (!test_soak() && n != 2 + k % 2) continue;
                for (int ranks = 0; ranks <= n; ranks += n) {
                    snprintf(swap, sizeof(swap), "%s/odd%d-%d-%d-%d", dir, k, n, stage, ranks);
                    snprintf(log, sizeof(log), "%s/odd%d-%d-%d-%d.jsonl", dir, k, n, stage, ranks);
                    zero_config(cfg, sizeof(cfg), swap, stage);
                    snprintf(args, sizeof(args), "%s --steps 2 --log %s --accumulate %d", shapes[k],
                             log, ranks ? 1 : n);
                    cr_assert_eq(train_ranks(&o, ranks, cfg, data, args), 0, "%s", o);
                    free(o);
                    char (*into)[32] = ranks ? got : ref;
                    memset(into, 0, sizeof(got));
                    cr_assert_eq(read_losses(log, into, NULL, NULL), 2, "%s", log);
                }
                for (int step = 1; step <= 2; step++)
                    cr_expect_str_eq(got[step], ref[step], "%s, stage %d, %d ranks, step %d",
                                     shapes[k], stage, n, step);
            }
}

/* Each of 4 ranks holds about a quarter of what ZeRO's stage partitions: the Adam states
 * from stage 1, the gradients too from stage 2, the parameters too in stage 3. On NVMe
 * (where all of it lives) and in the host tier (which stages it) that is a share of the
 * one-rank run; the device computes with whole blocks, gathered in stage 3. */
Test(cli, zero_ranks_each_hold_a_share_of_the_state, .timeout = 300)
{
    char cfg[4096], data[4096], swap[4096], log[4096], rlog[4200], args[8192], *o;
    /* p, g, m, v of 4 bytes each: the share of one rank of 4 at stages 1, 2, 3 (+ slack for
     * the step's state and the shards' padding). */
    const double share[] = {0, (2 + 2 / 4.0) / 4 + 0.03, (1 + 3 / 4.0) / 4 + 0.03, 0.25 + 0.03};
    /* The host tier's peak (the final flush stages the state) holds p, m and v alone: each
     * gradient is spent (ZINF_RELEASE_ZERO) once its update has read it, in one rank's run
     * as in the ranks'. So a rank stages its p whole (below stage 3) and a quarter of m and
     * v, of the one rank's three. */
    const double host_share[] = {0, (1 + 2 / 4.0) / 3 + 0.04, (1 + 2 / 4.0) / 3 + 0.04,
                                 0.25 + 0.04};
    const char *model = "--layers 2 --dim 256 --heads 4 --seq 16 --batch 1 --steps 1";
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    snprintf(swap, sizeof(swap), "%s/one", dir);
    snprintf(log, sizeof(log), "%s/one.jsonl", dir);
    zero_config(cfg, sizeof(cfg), swap, 3);
    snprintf(args, sizeof(args), "%s --accumulate 4 --log %s", model, log);
    cr_assert_eq(train_ranks(&o, 0, cfg, data, args), 0, "%s", o);
    free(o);
    uint64_t one_nvme = summary_peak(log, "nvme"), one_host = summary_peak(log, "host");
    uint64_t one_dev = summary_peak(log, "device");
    for (int stage = 1; stage <= 3; stage++) {
        snprintf(swap, sizeof(swap), "%s/four%d", dir, stage);
        snprintf(log, sizeof(log), "%s/four%d.jsonl", dir, stage);
        zero_config(cfg, sizeof(cfg), swap, stage);
        snprintf(args, sizeof(args), "%s --log %s", model, log);
        cr_assert_eq(train_ranks(&o, 4, cfg, data, args), 0, "%s", o);
        free(o);
        for (int r = 0; r < 4; r++) {
            if (r)
                snprintf(rlog, sizeof(rlog), "%s.rank-%d", log, r);
            else
                snprintf(rlog, sizeof(rlog), "%s", log);
            uint64_t nv = summary_peak(rlog, "nvme"), ho = summary_peak(rlog, "host");
            uint64_t dv = summary_peak(rlog, "device");
            cr_assert_leq(nv, share[stage] * one_nvme, "stage %d rank %d: %llu bytes on NVMe, one "
                          "rank %llu", stage, r, (unsigned long long)nv,
                          (unsigned long long)one_nvme);
            cr_assert_leq(ho, host_share[stage] * one_host, "stage %d rank %d: host peak %llu, one "
                          "rank %llu", stage, r, (unsigned long long)ho,
                          (unsigned long long)one_host);
            /* The device computes with whole blocks: no share, but no more (the buffers of
             * whole tensors are padded to world x shard). */
            cr_assert_leq(dv, 1.05 * one_dev, "stage %d rank %d: device peak %llu, one rank %llu",
                          stage, r, (unsigned long long)dv, (unsigned long long)one_dev);
        }
    }
}

/* Adam's moments in bf16 and in 8 bits (zinf.optimizer_state_dtype): 2 ZeRO ranks log
 * bitwise the losses of one rank accumulating their 2 micro-batches, at stages 1 and 3 (the
 * random bits and the 8-bit blocks hang on each element's place in the whole tensor, and
 * the shards start on block boundaries). Resuming the 2 ranks' run on one is refused,
 * naming the key: a re-cut copies fp32 states only. */
Test(cli, zero_ranks_compressed_states_give_the_bits_of_one_rank, .timeout = 300)
{
    char cfg[4200], data[4096], swap[4096], log[4200], args[8192], *o;
    static char ref[MAX_STEPS + 1][32], got[MAX_STEPS + 1][32];
    const char *dts[] = {"bf16", "int8"};
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    for (int d = 0; d < 2; d++)
        for (int stage = 1; stage <= 3; stage += 2)
            for (int n = 0; n <= 2; n += 2) {
                snprintf(swap, sizeof(swap), "%s/st%s%d%d", dir, dts[d], stage, n);
                snprintf(log, sizeof(log), "%s.jsonl", swap);
                snprintf(cfg, sizeof(cfg), "%s.json", swap);
                FILE *f = fopen(cfg, "w");
                cr_assert_not_null(f);
                fprintf(f,
                        "{\"zero_optimization\": {\"stage\": %d, \"offload_param\": {\"device\": "
                        "\"nvme\", \"nvme_path\": \"%s\"}, \"offload_optimizer\": {\"device\": "
                        "\"nvme\", \"nvme_path\": \"%s\"}}, \"zinf\": {\"device\": \"emulated\", "
                        "\"device_bytes\": \"32M\", \"host_bytes\": \"32M\", "
                        "\"optimizer_state_dtype\": \"%s\"}}",
                        stage, swap, swap, dts[d]);
                fclose(f);
                snprintf(args, sizeof(args), ZMODEL " --steps 4 --log %s%s", log,
                         n ? "" : " --accumulate 2");
                cr_assert_eq(train_ranks(&o, n, cfg, data, args), 0, "%s", o);
                free(o);
                memset(got, 0, sizeof(got));
                cr_assert_eq(read_losses(log, got, NULL, NULL), 4);
                for (int step = 1; step <= 4; step++) {
                    if (!n && stage == 1) snprintf(ref[step], sizeof(ref[step]), "%s", got[step]);
                    cr_assert_str_eq(got[step], ref[step], "%s, stage %d, %d ranks, step %d",
                                     dts[d], stage, n, step);
                }
                if (n != 2 || stage != 3) continue;
                snprintf(args, sizeof(args), ZMODEL " --steps 6 --resume --accumulate 2");
                cr_assert_eq(train_ranks(&o, 0, cfg, data, args), 2, "%s", o);
                cr_assert(strstr(o, "zinf.optimizer_state_dtype"), "%s", o);
                free(o);
            }
}

/* Resumes on another number of ranks re-cut the newest saved run: 4 ranks, then one (which
 * accumulates 4 micro-batches, bitwise as 4 ranks), then 4, then 2 of 2, then one again.
 * Every loss and parameter digest is the uninterrupted run's. */
Test(cli, zero_resume_on_another_number_of_ranks_re_cuts_the_shards, .timeout = 300)
{
    char cfg[4096], data[4096], swap[4096], log[4096], args[8192], *o;
    static char ref[MAX_STEPS + 1][32], got[MAX_STEPS + 1][32];
    zero_run("whole", 4, 3, "", 8, ref);
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));

    const struct {
        int ranks, accum, steps;
    } legs[] = {{4, 1, 2}, {0, 4, 4}, {4, 1, 6}, {2, 2, 7}, {0, 4, 8}};
    snprintf(swap, sizeof(swap), "%s/legs", dir);
    snprintf(log, sizeof(log), "%s/legs.jsonl", dir);
    zero_config(cfg, sizeof(cfg), swap, 3);
    for (size_t i = 0; i < sizeof(legs) / sizeof(legs[0]); i++) {
        snprintf(args, sizeof(args), ZMODEL " --steps %d --accumulate %d --log %s%s",
                 legs[i].steps, legs[i].accum, log, i ? " --resume" : "");
        cr_assert_eq(train_ranks(&o, legs[i].ranks, cfg, data, args), 0, "leg %zu: %s", i, o);
        /* Each process's engine says once that it runs unpinned; the saved ranks it reads
         * from do not each say it again. */
        int said = 0;
        for (const char *p = o; (p = strstr(p, "runs unpinned")); p++)
            said++;
        cr_assert_leq(said, MAX(1, legs[i].ranks), "leg %zu: %s", i, o);
        free(o);
    }
    cr_assert_eq(read_losses(log, got, NULL, NULL), 8);
    for (int step = 1; step <= 8; step++)
        cr_assert_str_eq(got[step], ref[step], "step %d", step);

    /* A number of ranks that cannot run the saved run's global batch: refused, nothing
     * written for it. */
    snprintf(args, sizeof(args), ZMODEL " --steps 9 --resume");
    cr_assert_eq(train_ranks(&o, 3, cfg, data, args), 1, "%s", o);
    cr_assert(strstr(o, "which 3 ranks run as --accumulate 1, not a whole number"), "%s", o);
    free(o);
    char three[4200];
    snprintf(three, sizeof(three), "%s/rank-0-of-3", swap);
    cr_assert_neq(access(three, F_OK), 0, "a refused resume made %s", three);
    /* A new run over the saved one of another number of ranks is refused too. */
    snprintf(args, sizeof(args), ZMODEL " --steps 9");
    cr_assert_eq(train_ranks(&o, 2, cfg, data, args), 1, "%s", o);
    cr_assert(strstr(o, "holds a saved run (by one rank)"), "%s", o);
    free(o);
}

/* A re-cut is the same run: every step's gradient adds the step's micro-batches in the
 * order of their number, whatever the split between ranks and --accumulate, so 2 ranks of
 * --accumulate 2 and 4 ranks of one log bitwise the losses and digests of one rank
 * accumulating 4, at stages 1 to 3 (stage 2 with overlap_comm, stage 3 with and without it,
 * in bf16 and fp16 too) and at an odd shape; 2 x 3 and 3 x 2 equal one rank of 6; and a run
 * of 2 x 2 resumed on one rank of 4 continues bitwise as the run of 2 x 2 that never moved. */
Test(cli, zero_recut_is_bitwise_across_ranks_and_accumulation, .timeout = 300)
{
    static const struct {
        int stage; /* zero_config()'s */
        const char *extra;
        bool four; /* 4 ranks of one too */
    } runs[] = {
        {1, ZMODEL, true},
        {7, ZMODEL, false},
        {3, ZMODEL, true},
        {8, ZMODEL " --precision bf16", false},
        {3, ZMODEL " --precision fp16", false},
        {3, "--layers 2 --dim 80 --heads 10 --seq 31 --batch 5", false},
    };
    char cfg[4096], data[4096], swap[4096], log[4200], args[8192], *o;
    static char ref[MAX_STEPS + 1][32], got[MAX_STEPS + 1][32];
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    for (size_t k = 0; k < ARRAY_SIZE(runs); k++) {
        const int ranks[] = {0, 2, 4}, accum[] = {4, 2, 1};
        for (int j = 0; j < (runs[k].four ? 3 : 2); j++) {
            snprintf(swap, sizeof(swap), "%s/cut%zu-%d", dir, k, ranks[j]);
            snprintf(log, sizeof(log), "%s.jsonl", swap);
            zero_config(cfg, sizeof(cfg), swap, runs[k].stage);
            snprintf(args, sizeof(args), "%s --steps 3 --accumulate %d --log %s", runs[k].extra,
                     accum[j], log);
            cr_assert_eq(train_ranks(&o, ranks[j], cfg, data, args), 0, "%s", o);
            free(o);
            char(*into)[32] = j ? got : ref;
            memset(into, 0, sizeof(got));
            cr_assert_eq(read_losses(log, into, NULL, NULL), 3, "%s", log);
            for (int step = 1; step <= 3 && j; step++)
                cr_assert_str_eq(got[step], ref[step],
                                 "%s at stage %d: %d ranks x --accumulate %d, step %d",
                                 runs[k].extra, runs[k].stage, ranks[j], accum[j], step);
        }
    }

    /* Numbers of ranks that are no power of two: 3 x 2 and 2 x 3 are one rank of 6. */
    const int ranks6[] = {0, 2, 3};
    for (int j = 0; j < 3; j++) {
        snprintf(swap, sizeof(swap), "%s/six-%d", dir, ranks6[j]);
        snprintf(log, sizeof(log), "%s.jsonl", swap);
        zero_config(cfg, sizeof(cfg), swap, 2);
        snprintf(args, sizeof(args), ZMODEL " --steps 2 --accumulate %d --log %s",
                 6 / MAX(1, ranks6[j]), log);
        cr_assert_eq(train_ranks(&o, ranks6[j], cfg, data, args), 0, "%s", o);
        free(o);
        char(*into)[32] = j ? got : ref;
        memset(into, 0, sizeof(got));
        cr_assert_eq(read_losses(log, into, NULL, NULL), 2, "%s", log);
        for (int step = 1; step <= 2 && j; step++)
            cr_assert_str_eq(got[step], ref[step], "%d ranks of 6 / %d, step %d", ranks6[j],
                             ranks6[j], step);
    }

    /* 2 x 2 to step 2, then one rank of 4 to step 4: the run of 2 x 2 that never moved. */
    zero_run("cut-whole", 2, 3, "--accumulate 2", 4, ref);
    snprintf(swap, sizeof(swap), "%s/cut-moved", dir);
    snprintf(log, sizeof(log), "%s.jsonl", swap);
    zero_config(cfg, sizeof(cfg), swap, 3);
    snprintf(args, sizeof(args), ZMODEL " --steps 2 --accumulate 2 --log %s", log);
    cr_assert_eq(train_ranks(&o, 2, cfg, data, args), 0, "%s", o);
    free(o);
    snprintf(args, sizeof(args), ZMODEL " --steps 4 --accumulate 4 --resume --log %s", log);
    cr_assert_eq(train_ranks(&o, 0, cfg, data, args), 0, "%s", o);
    free(o);
    memset(got, 0, sizeof(got));
    cr_assert_eq(read_losses(log, got, NULL, NULL), 4);
    for (int step = 1; step <= 4; step++)
        cr_assert_str_eq(got[step], ref[step], "step %d", step);
}

/* A re-cut from sharded ranks onto another number of sharded ranks, 4 -> 2 -> 4, with the
 * Adam states homed on the device tier, whose arena CPU ranks take from their shared pool:
 * the losses and digests of one rank accumulating 4 (which 2 x 2 and 4 x 1 are, bitwise),
 * the two steps after each resume too. (The saved ranks' engines that a re-cut reads shared this rank's arena: they
 * loaded their states over the ones it had re-cut, and read its writes back as their own;
 * the step after the resume had the wrong digest, the next a NaN loss.) */
Test(cli, zero_recut_between_sharded_rank_counts_keeps_device_homed_states, .timeout = 120)
{
    static const struct {
        int ranks, steps;
    } legs[] = {{0, 6}, {4, 2}, {2, 4}, {4, 6}}; /* the first: one rank, that never moved */
    char cfg[4200], data[4096], swap[4096], log[4200], args[8192], *o;
    static char ref[MAX_STEPS + 1][32], got[MAX_STEPS + 1][32];
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    for (size_t l = 0; l < ARRAY_SIZE(legs); l++) {
        snprintf(swap, sizeof(swap), "%s/devstates-%s", dir, l ? "moved" : "whole");
        snprintf(log, sizeof(log), "%s.jsonl", swap);
        snprintf(cfg, sizeof(cfg), "%s.json", swap);
        FILE *f = fopen(cfg, "w");
        cr_assert_not_null(f);
        fprintf(f,
                "{\"zero_optimization\": {\"stage\": 1, \"offload_param\": {\"device\": "
                "\"nvme\", \"nvme_path\": \"%s\"}}, \"aio\": {\"block_size\": 65536, "
                "\"queue_depth\": 4}, \"zinf\": {\"device\": \"emulated\", \"device_bytes\": "
                "\"8M\", \"host_bytes\": \"8M\"}}",
                swap);
        fclose(f);
        snprintf(args, sizeof(args),
                 "--layers 2 --dim 32 --heads 2 --seq 8 --batch 1 --steps %d --accumulate %d "
                 "--checkpoint-every 2 --log %s%s",
                 legs[l].steps, 4 / MAX(1, legs[l].ranks), log, l > 1 ? " --resume" : "");
        cr_assert_eq(train_ranks(&o, legs[l].ranks, cfg, data, args), 0, "leg %zu: %s", l, o);
        free(o);
    }
    memset(got, 0, sizeof(got));
    cr_assert_eq(read_losses(log, got, NULL, NULL), 6, "%s", log);
    snprintf(log, sizeof(log), "%s/devstates-whole.jsonl", dir);
    memset(ref, 0, sizeof(ref));
    cr_assert_eq(read_losses(log, ref, NULL, NULL), 6, "%s", log);
    for (int step = 1; step <= 6; step++)
        cr_assert_str_eq(got[step], ref[step], "step %d (4 ranks to 2, 2 to 4, 4 to 6)", step);
}

/* The children of pid (the launcher's ranks). */
static int children_of(pid_t pid, pid_t *out, int cap)
{
    char path[64], buf[512];
    int n = 0;
    snprintf(path, sizeof(path), "/proc/%d/task/%d/children", (int)pid, (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    if (fgets(buf, sizeof(buf), f)) {
        char *p = buf, *end;
        long v;
        while (n < cap && (v = strtol(p, &end, 10)) > 0 && end != p) {
            out[n++] = (pid_t)v;
            p = end;
        }
    }
    fclose(f);
    return n;
}

/* A rank killed mid-run: the launcher stops the other within seconds and names it; the
 * job resumes from its last checkpoint with the losses of a run that never died. */
Test(cli, zero_rank_killed_mid_run_stops_the_job_and_the_last_checkpoint_resumes,
     .timeout = 300)
{
    char cfg[4096], data[4096], swap[4096], log[4096], args[8192], out[4096], *o;
    static char ref[MAX_STEPS + 1][32], got[MAX_STEPS + 1][32];
    zero_run("whole", 2, 2, "", 12, ref);
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));

    snprintf(swap, sizeof(swap), "%s/killed", dir);
    snprintf(log, sizeof(log), "%s/killed.jsonl", dir);
    snprintf(out, sizeof(out), "%s/killed.out", dir);
    zero_config(cfg, sizeof(cfg), swap, 2);
    pid_t pid = spawn(out, "launch -n 2 --grace 5 -- %s train --config %s --data %s " ZMODEL
                      " --steps 12 --checkpoint-every 2 --log %s", getenv("ZINF_BIN"), cfg, data,
                      log);
    double t0 = now_s();
    while (count_lines(log, "{\"step\":") < 3 && now_s() - t0 < 60)
        usleep(2000);
    pid_t kids[4];
    int nk = children_of(pid, kids, 4);
    cr_assert_eq(nk, 2, "the launcher's ranks: %s", read_text(out));
    cr_assert_eq(kill(kids[1], SIGKILL), 0);
    t0 = now_s();
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert_lt(now_s() - t0, 15.0, "the other rank was not stopped in time");
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "%s", read_text(out));
    char *said = read_text(out);
    cr_assert(strstr(said, "was killed by signal 9"), "%s", said);
    free(said);
    int ckpt = 0;
    int last = read_losses(log, got, NULL, &ckpt);
    cr_assert_lt(last, 12, "the run ended before the kill");

    snprintf(args, sizeof(args), ZMODEL " --steps 12 --resume --log %s", log);
    cr_assert_eq(train_ranks(&o, 2, cfg, data, args), 0, "%s", o);
    free(o);
    /* read_losses checks that a step logged twice has the same loss both times. */
    cr_assert_eq(read_losses(log, got, NULL, NULL), 12);
    for (int step = 1; step <= 12; step++)
        cr_assert_str_eq(got[step], ref[step], "step %d", step);
}

/* Rank settings that cannot work are named, and ranks that cannot meet say why. */
Test(cli, zero_bad_rank_settings_are_refused_clearly)
{
    char cfg[4096], data[4096], swap[4096], args[8192], *o;
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    snprintf(swap, sizeof(swap), "%s/bad", dir);
    zero_config(cfg, sizeof(cfg), swap, 2);
    snprintf(args, sizeof(args), ZMODEL " --steps 1");
    setenv("WORLD_SIZE", "2", 1);
    setenv("RANK", "2", 1);
    cr_assert_eq(train_ranks(&o, 0, cfg, data, args), 2, "%s", o);
    cr_assert(strstr(o, "WORLD_SIZE '2' and RANK '2'"), "%s", o);
    free(o);
    setenv("WORLD_SIZE", "two", 1);
    cr_assert_eq(train_ranks(&o, 0, cfg, data, args), 2, "%s", o);
    free(o);
    /* One rank of two, alone: it waits for the other as long as it is told, then says. */
    setenv("WORLD_SIZE", "2", 1);
    setenv("RANK", "0", 1);
    setenv("ZINF_COMM_NAME", "lonely", 1);
    setenv("ZINF_COMM_TIMEOUT_MS", "300", 1);
    double t0 = now_s();
    cr_assert_eq(train_ranks(&o, 0, cfg, data, args), 1, "%s", o);
    cr_assert_lt(now_s() - t0, 30.0);
    cr_assert(strstr(o, "could not meet as 'lonely'") && strstr(o, "did not start"), "%s", o);
    free(o);
    setenv("ZINF_COMM_TIMEOUT_MS", "0", 1);
    cr_assert_eq(train_ranks(&o, 0, cfg, data, args), 2, "%s", o);
    cr_assert(strstr(o, "ZINF_COMM_TIMEOUT_MS '0'"), "%s", o);
    free(o);
    unsetenv("WORLD_SIZE");
    unsetenv("RANK");
    unsetenv("ZINF_COMM_NAME");
    unsetenv("ZINF_COMM_TIMEOUT_MS");
    /* A LOCAL_RANK that is no GPU's. */
    setenv("WORLD_SIZE", "2", 1);
    setenv("RANK", "0", 1);
    setenv("LOCAL_RANK", "gpu0", 1);
    snprintf(args, sizeof(args), ZMODEL " --steps 1");
    cr_assert_eq(train_ranks(&o, 0, cfg, data, args), 2, "%s", o);
    cr_assert(strstr(o, "LOCAL_RANK 'gpu0'"), "%s", o);
    free(o);
    unsetenv("WORLD_SIZE");
    unsetenv("RANK");
    unsetenv("LOCAL_RANK");
    /* Nothing was saved by the refused runs. */
    char r0[4200];
    snprintf(r0, sizeof(r0), "%s/rank-0-of-2/zinf-manifest.json", swap);
    cr_assert_neq(access(r0, F_OK), 0);
}

/* Ranks in bf16 and fp16 (16-bit weights; the fp32 masters, gradients and Adam states
 * partitioned; fp16 with its loss scale): bitwise the losses of one rank accumulating their
 * micro-batches at stages 1 to 3 (stage 3 also with whole vectors below the persistence
 * threshold), the 16-bit weights' shards gathered at stage 3 and the updated parts of the
 * masters and of their 16-bit copies gathered below it. */
Test(cli, zero_ranks_in_bf16_and_fp16_give_the_losses_of_one_rank_accumulating, .timeout = 300)
{
    static char ref[MAX_STEPS + 1][32], got[MAX_STEPS + 1][32];
    const char *precs[] = {"bf16", "fp16"};
    for (int p = 0; p < 2; p++) {
        char name[32], extra[64];
        snprintf(name, sizeof(name), "ref-%s", precs[p]);
        snprintf(extra, sizeof(extra), "--accumulate 2 --precision %s", precs[p]);
        zero_run(name, 0, 3, extra, 3, ref);
        for (int stage = 1; stage <= 4; stage++) {
            snprintf(name, sizeof(name), "%s-s%d", precs[p], stage);
            snprintf(extra, sizeof(extra), "--precision %s", precs[p]);
            zero_run(name, 2, stage, extra, 3, got);
            for (int step = 1; step <= 3; step++)
                cr_assert_str_eq(got[step], ref[step], "%s, stage %d, step %d", precs[p], stage,
                                 step);
        }
    }
}

/* The "sample" line of a --log file (the first), into buf. */
static void sample_line(const char *log, char *buf, size_t len)
{
    FILE *f = fopen(log, "r");
    cr_assert_not_null(f, "%s", log);
    buf[0] = 0;
    while (fgets(buf, (int)len, f) && !strstr(buf, "\"sample\""))
        buf[0] = 0;
    fclose(f);
    cr_assert(buf[0], "no sample in %s", log);
}

/* Sampling at stage 3 gathers the weights it needs from the ranks' shards: two ranks sample
 * what one rank accumulating their micro-batches samples. */
Test(cli, zero_ranks_sample_at_stage_3, .timeout = 120)
{
    char data[4096], cfg[4096], swap[4096], log[4096], args[8192], a[4096], b[4096], *o;
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    for (int k = 0; k < 2; k++) {
        snprintf(swap, sizeof(swap), "%s/sample%d", dir, k);
        snprintf(log, sizeof(log), "%s/sample%d.jsonl", dir, k);
        zero_config(cfg, sizeof(cfg), swap, 3);
        snprintf(args, sizeof(args), ZMODEL " --steps 2 --sample-every 2 --log %s%s", log,
                 k ? "" : " --accumulate 2");
        cr_assert_eq(train_ranks(&o, k ? 2 : 0, cfg, data, args), 0, "%s", o);
        free(o);
        sample_line(log, k ? b : a, sizeof(a));
    }
    cr_assert_str_eq(b, a);
}

/* zinf launch --connect: every rank keeps its state in one daemon, as job JOB-rank-R-of-N,
 * and logs bitwise what ranks with engines of their own log. */
Test(cli, zero_ranks_through_the_daemon_equal_ranks_with_their_own_engines, .timeout = 300)
{
    char cfg[4096], data[4096], swap[4096], log[4096], sock[4096], out[4096];
    char scfg[4200], ccfg[4200], text[8192], *o;
    static char emb[MAX_STEPS + 1][32], got[MAX_STEPS + 1][32];
    zero_run("emb", 2, 2, "", 3, emb);
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    snprintf(swap, sizeof(swap), "%s/emb", dir);

    snprintf(sock, sizeof(sock), "%s/zinf.sock", dir);
    snprintf(out, sizeof(out), "%s/serve.out", dir);
    snprintf(scfg, sizeof(scfg), "%s/serve.json", dir);
    snprintf(text, sizeof(text),
             "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
             "\"%s/dswap\"}}, \"aio\": {\"block_size\": 65536}, \"zinf\": {\"device\": "
             "\"emulated\", \"device_bytes\": \"32M\", \"host_bytes\": \"32M\"}}",
             dir);
    write_file(scfg, text);
    cr_assert_eq(run(&o, "launch -n 2 --connect %s -- true", sock), 2, "%s", o);
    cr_assert(strstr(o, "no daemon's socket there"), "%s", o);
    free(o);
    pid_t pid = spawn(out, "serve --socket %s --config %s --foreground", sock, scfg);
    zinf_close(connect_when_up(sock, "probe"));
    snprintf(ccfg, sizeof(ccfg), "%s/connect.json", dir);
    /* The ranks' own config: the partition; the daemon's says where the swap files go. */
    zero_config(ccfg, sizeof(ccfg), swap, 2);
    snprintf(log, sizeof(log), "%s/d.jsonl", dir);
    setenv("OMP_NUM_THREADS", "1", 1);
    cr_assert_eq(run(&o, "launch -n 2 --connect %s -- %s train --config %s --data %s " ZMODEL
                         " --steps 3 --log %s",
                     sock, getenv("ZINF_BIN"), ccfg, data, log),
                 0, "%s", o);
    free(o);
    cr_assert_eq(read_losses(log, got, NULL, NULL), 3);
    for (int step = 1; step <= 3; step++)
        cr_assert_str_eq(got[step], emb[step], "step %d", step);
    /* Each rank's state is the daemon's job of its own. */
    for (int r = 0; r < 2; r++) {
        char job[64];
        zinf_tensor h;
        snprintf(job, sizeof(job), "zinf-train-rank-%d-of-2", r);
        zinf_engine *e = connect_when_up(sock, job);
        cr_assert_eq(zinf_lookup(e, "train.state", &h), 0, "%s", job);
        zinf_close(e);
    }
    kill(pid, SIGTERM);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "serve exited %#x: %s", st, read_text(out));
}

/* SIGTERM to the launcher reaches every rank at its own moment; the ranks agree on the step
 * to stop after, each checkpoints that step, and the job exits 143. */
Test(cli, zero_ranks_stopped_by_sigterm_all_save_the_same_step, .timeout = 300)
{
    char cfg[4096], data[4096], swap[4096], log[4096], log1[4200], out[4096];
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    snprintf(swap, sizeof(swap), "%s/term", dir);
    snprintf(log, sizeof(log), "%s/term.jsonl", dir);
    snprintf(log1, sizeof(log1), "%s.rank-1", log);
    snprintf(out, sizeof(out), "%s/term.out", dir);
    zero_config(cfg, sizeof(cfg), swap, 3);
    pid_t pid = spawn(out, "launch -n 2 -- %s train --config %s --data %s " ZMODEL
                      " --steps 100000 --log %s", getenv("ZINF_BIN"), cfg, data, log);
    double t0 = now_s();
    while (count_lines(log, "{\"step\":") < 3 && now_s() - t0 < 60)
        usleep(2000);
    cr_assert_eq(kill(pid, SIGTERM), 0);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 143, "%#x", st);
    uint64_t s0 = summary_value(log, NULL, "steps"), s1 = summary_value(log1, NULL, "steps");
    cr_assert_eq(s0, s1, "rank 0 stopped after step %llu, rank 1 after %llu",
                 (unsigned long long)s0, (unsigned long long)s1);
    cr_assert_eq(summary_value(log, NULL, "checkpoint_step"), s0);
    cr_assert_eq(summary_value(log1, NULL, "checkpoint_step"), s0);
}

/* A resume refuses ranks whose saved runs are at different steps (one rank's checkpoint is
 * older: here, put back from a copy) and a partition cut otherwise (another persistence
 * threshold), saying which, and writes nothing. */
Test(cli, zero_resume_refuses_ranks_at_different_steps_or_cut_otherwise, .timeout = 300)
{
    char cfg[4096], cfg4[4096], data[4096], swap[4096], args[8192], sh[16384], *o;
    static char loss[MAX_STEPS + 1][32];
    zero_run("apart", 2, 3, "", 2, loss);
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    snprintf(swap, sizeof(swap), "%s/apart", dir);
    zero_config(cfg, sizeof(cfg), swap, 3);
    snprintf(sh, sizeof(sh), "cp -a %s/rank-1-of-2 %s/old", swap, swap);
    cr_assert_eq(system(sh), 0);
    snprintf(args, sizeof(args), ZMODEL " --steps 4 --resume");
    cr_assert_eq(train_ranks(&o, 2, cfg, data, args), 0, "%s", o);
    free(o);
    snprintf(sh, sizeof(sh), "rm -rf %s/rank-1-of-2 && mv %s/old %s/rank-1-of-2", swap, swap,
             swap);
    cr_assert_eq(system(sh), 0);
    snprintf(args, sizeof(args), ZMODEL " --steps 6 --resume");
    cr_assert_eq(train_ranks(&o, 2, cfg, data, args), 1, "%s", o);
    cr_assert(strstr(o, "no step is saved by every one of the 2 ranks") &&
                  strstr(o, "rank 0 holds step 4, rank 1 holds step 2"),
              "%s", o);
    free(o);

    /* The same ranks and stage, but small weights kept whole: the shards would not match. */
    zero_run("cut", 2, 3, "", 1, loss);
    snprintf(swap, sizeof(swap), "%s/cut", dir);
    zero_config(cfg4, sizeof(cfg4), swap, 4);
    snprintf(args, sizeof(args), ZMODEL " --steps 2 --resume");
    cr_assert_eq(train_ranks(&o, 2, cfg4, data, args), 1, "%s", o);
    cr_assert(strstr(o, "the saved run keeps 'p.h0.ln1.w' on NVMe, this config on the device") &&
                  strstr(o, "stage3_param_persistence_threshold"),
              "%s", o);
    free(o);
    /* Refused runs saved nothing: the run resumes as it was cut. */
    snprintf(args, sizeof(args), ZMODEL " --steps 2 --resume");
    zero_config(cfg, sizeof(cfg), swap, 3);
    cr_assert_eq(train_ranks(&o, 2, cfg, data, args), 0, "%s", o);
    free(o);
}

/* --trace writes a timeline a viewer opens: the file parses, spans nest on every thread,
 * async transfers end, and it shows each step, each block's forward and backward, the
 * optimizer's tensors, the checkpoints and the engine's fetches, NVMe reads and writes,
 * copies and evictions, with the tiers' and NVMe's counters. ZINF_TRACE does the same
 * without the option; a path that cannot be written is refused before anything runs. */
Test(cli, train_trace_shows_steps_phases_and_the_engines_work, .timeout = 300)
{
    char cfg[4096], data[4096], swap[4096], path[4096], *o;
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    snprintf(path, sizeof(path), "%s/t.json", dir);
    char log[4096];
    snprintf(log, sizeof(log), "%s/t.jsonl", dir);
    cr_assert_eq(run(&o,
                     "train --config %s --data %s --layers 2 --dim 64 --heads 2 --seq 16 "
                     "--batch 2 --steps 3 --checkpoint-every 1 --trace %s --log %s",
                     cfg, data, path, log),
                 0, "%s", o);
    char said[4400];
    snprintf(said, sizeof(said), "# trace: %s", path);
    cr_assert(strstr(o, said), "%s", o);
    /* Where the blocked time went: per step, and the largest named in the summary. */
    cr_assert(strstr(o, "nvme/copy/room/pin %"), "%s", o);
    cr_assert(strstr(o, "#   blocked in fetch "), "%s", o);
    cr_assert(strstr(o, ": mostly waiting for "), "%s", o);
    free(o);
    FILE *lf = fopen(log, "r");
    cr_assert_not_null(lf);
    char line[8192], badline[8400] = "";
    int steps = 0;
    bool largest = false;
    /* The lines are checked here and the first bad one reported once after the loop. */
    while (fgets(line, sizeof(line), lf)) {
        json_t *j = json_loads(line, 0, NULL);
        if (!j) {
            snprintf(badline, sizeof(badline), "not JSON: %s", line);
            break;
        }
        if (json_object_get(j, "step")) {
            double parts = 0;
            static const char *const k[] = {"blocked_nvme", "blocked_copy", "blocked_room",
                                            "blocked_pin"};
            for (int i = 0; i < 4; i++) {
                if (!json_is_number(json_object_get(j, k[i])) && !badline[0])
                    snprintf(badline, sizeof(badline), "no %s: %s", k[i], line);
                parts += json_number_value(json_object_get(j, k[i]));
            }
            if (parts > json_number_value(json_object_get(j, "blocked")) + 4e-4 && !badline[0])
                snprintf(badline, sizeof(badline), "the parts exceed the whole: %s", line);
            steps++;
        }
        json_t *sum = json_object_get(j, "summary");
        if (sum) {
            const char *ls = json_string_value(json_object_get(sum, "largest_stall"));
            largest = ls && (!strcmp(ls, "nvme") || !strcmp(ls, "copy") || !strcmp(ls, "room") ||
                             !strcmp(ls, "pin"));
        }
        json_decref(j);
    }
    fclose(lf);
    cr_expect_str_empty(badline);
    cr_expect_eq(steps, 3);
    cr_expect(largest);
    struct test_trace tr;
    test_trace_load(path, &tr);
    cr_expect_eq(tr.dropped, 0);
    cr_expect_eq(test_trace_count(&tr, "X", "step *", NULL), 3);
    cr_expect_eq(test_trace_count(&tr, "X", "block forward *", NULL), 6);
    cr_expect_eq(test_trace_count(&tr, "X", "block backward *", NULL), 6);
    cr_expect_eq(test_trace_count(&tr, "X", "embeddings forward", NULL), 3);
    cr_expect_eq(test_trace_count(&tr, "X", "head*", NULL), 3);
    /* 2 blocks of 12 tensors, wte, wpe and the final norm's 2: 28 per step, each updated in
     * the next step's forward (the default), or before a checkpoint or the run's end. */
    cr_expect_eq(test_trace_count(&tr, "X", "update before its forward", NULL), 3 * 28);
    cr_expect_eq(test_trace_count(&tr, "X", "optimizer", NULL), 0);
    cr_expect_eq(test_trace_count(&tr, "X", "checkpoint", NULL), 4); /* steps 0, 1, 2, 3 */
    cr_expect_geq(test_trace_count(&tr, "X", "flush", NULL), 4);
    cr_expect_gt(test_trace_count(&tr, "X", "fetch to device", "load"), 0);
    cr_expect_gt(test_trace_count(&tr, "X", "fetch to device", "hit"), 0);
    cr_expect_gt(test_trace_count(&tr, "b", "nvme read", NULL), 0);
    cr_expect_gt(test_trace_count(&tr, "b", "nvme write", NULL), 0);
    cr_expect_gt(test_trace_count(&tr, "b", "host to device copy", NULL), 0);
    cr_expect_gt(test_trace_count(&tr, "i", "evict from *", NULL), 0);
    cr_expect_gt(test_trace_counter(&tr, "device bytes in use (engine 1)"), 0);
    cr_expect_gt(test_trace_counter(&tr, "nvme bytes written (engine 1)"), 0);
    test_trace_free(&tr);

    /* ZINF_TRACE: the first engine the program opens starts it; it ends at exit. */
    char envp[4096];
    snprintf(envp, sizeof(envp), "%s/env.json", dir);
    setenv("ZINF_TRACE", envp, 1);
    int rc = run(&o,
                 "train --config %s --data %s --layers 2 --dim 64 --heads 2 --seq 16 "
                 "--batch 2 --steps 4 --resume",
                 cfg, data);
    unsetenv("ZINF_TRACE");
    cr_assert_eq(rc, 0, "%s", o);
    free(o);
    test_trace_load(envp, &tr);
    cr_expect_eq(test_trace_count(&tr, "X", "step 4", NULL), 1);
    test_trace_free(&tr);

    /* A trace that cannot be written: refused by name, the saved run untouched. */
    char bad[4200];
    snprintf(bad, sizeof(bad), "%s/no/such/dir/t.json", dir);
    cr_assert_eq(run(&o,
                     "train --config %s --data %s --layers 2 --dim 64 --heads 2 --seq 16 "
                     "--batch 2 --steps 5 --resume --trace %s",
                     cfg, data, bad),
                 2, "%s", o);
    snprintf(said, sizeof(said), "--trace %s: No such file or directory", bad);
    cr_assert(strstr(o, said), "%s", o);
    free(o);
    cr_assert_eq(run(&o,
                     "train --config %s --data %s --layers 2 --dim 64 --heads 2 --seq 16 "
                     "--batch 2 --steps 5 --resume",
                     cfg, data),
                 0, "%s", o);
    cr_assert(strstr(o, "resumed"), "%s", o);
    free(o);
}

/* The PNG's width and height from its IHDR chunk; false when path is not a PNG. */
static bool png_size(const char *path, unsigned *w, unsigned *h)
{
    unsigned char b[24];
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    size_t n = fread(b, 1, sizeof(b), f);
    fclose(f);
    static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    if (n < 24 || memcmp(b, sig, 8) || memcmp(b + 12, "IHDR", 4)) return false;
    *w = (unsigned)b[16] << 24 | (unsigned)b[17] << 16 | (unsigned)b[18] << 8 | b[19];
    *h = (unsigned)b[20] << 24 | (unsigned)b[21] << 16 | (unsigned)b[22] << 8 | b[23];
    return true;
}

/* zinf plot draws a training log as a PNG of the size asked (the default beside the log),
 * with other logs' losses beside its own; a missing log, a line that is not JSON and a log without steps are refused by name. */
Test(cli, plot_draws_a_training_log_as_a_png, .timeout = 120)
{
    char cfg[4096], data[4096], swap[4096], log[4096], png[4200], *o;
    if (system("gnuplot --version > /dev/null 2>&1") != 0)
        cr_skip_test("gnuplot is not installed (scripts/setup.sh installs gnuplot-nox)");
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    snprintf(log, sizeof(log), "%s/run.jsonl", dir);
    cr_assert_eq(run(&o,
                     "train --config %s --data %s --layers 1 --dim 32 --heads 2 --seq 16 "
                     "--batch 2 --steps 6 --eval-every 3 --log %s",
                     cfg, data, log),
                 0, "%s", o);
    free(o);
    cr_assert_eq(run(&o, "plot %s", log), 0, "%s", o);
    cr_assert(strstr(o, "loss (train and validation), tokens/s, NVMe GB/s, tier occupancy over "
                        "6 steps"),
              "%s", o);
    free(o);
    unsigned w = 0, h = 0;
    snprintf(png, sizeof(png), "%s/run.png", dir);
    cr_assert(png_size(png, &w, &h), "%s is not a PNG", png);
    cr_expect_eq(w, 1200);
    cr_expect_eq(h, 900);
    snprintf(png, sizeof(png), "%s/small.png", dir);
    cr_assert_eq(run(&o, "plot %s -o %s --size 640x480", log, png), 0, "%s", o);
    free(o);
    cr_assert(png_size(png, &w, &h), "%s is not a PNG", png);
    cr_expect_eq(w, 640);
    cr_expect_eq(h, 480);
    /* Several logs: the others' loss and tokens/s beside the first's. */
    snprintf(png, sizeof(png), "%s/both.png", dir);
    cr_assert_eq(run(&o, "plot %s %s -o %s", log, log, png), 0, "%s", o);
    cr_assert(strstr(o, "the loss and tokens/s of 1 more log beside"), "%s", o);
    free(o);
    cr_assert(png_size(png, &w, &h), "%s is not a PNG", png);

    /* Refused, by name. */
    cr_assert_eq(run(&o, "plot %s/none.jsonl", dir), 2, "%s", o);
    cr_assert(strstr(o, "none.jsonl: No such file or directory"), "%s", o);
    free(o);
    char bad[4200];
    snprintf(bad, sizeof(bad), "%s/bad.jsonl", dir);
    FILE *f = fopen(bad, "w");
    cr_assert_not_null(f);
    fputs("{\"step\":1,\"loss\":5.5}\nnot json\n", f);
    fclose(f);
    cr_assert_eq(run(&o, "plot %s", bad), 2, "%s", o);
    cr_assert(strstr(o, "bad.jsonl:2: not a JSON object"), "%s", o);
    free(o);
    f = fopen(bad, "w");
    cr_assert_not_null(f);
    fputs("{\"eval\":3,\"val_loss\":4.0}\n", f);
    fclose(f);
    cr_assert_eq(run(&o, "plot %s", bad), 2, "%s", o);
    cr_assert(strstr(o, "holds no step lines"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "plot %s --size 10x10", log), 2, "%s", o);
    cr_assert(strstr(o, "--size 10x10"), "%s", o);
    free(o);
}

/* On a terminal zinf bench draws a progress bar (bytes, rate, ETA) on stderr and erases it;
 * through a pipe, or with --json, there is none: the rows are all there is. */
Test(cli, bench_draws_progress_on_a_terminal_only)
{
    char *o;
    cr_assert_eq(run(&o, "bench --path %s --size 4M", dir), 0, "%s", o);
    cr_assert_null(strstr(o, "ETA "), "no bar through a pipe: %s", o);
    free(o);
    /* script(1) gives the command a terminal where the machine can make one (a container
     * without /dev/pts cannot; there only the pipe is checked: Criterion's skip leaks under
     * LeakSanitizer). */
    if (system("script -qec true /dev/null > /dev/null 2>&1") != 0) {
        fprintf(stderr, "cli: no terminal to give zinf bench (script(1) missing, or no "
                        "pseudo-terminal): the bar itself is not checked here\n");
        return;
    }
    const char *bin = getenv("ZINF_BIN");
    char cmd[8192];
    snprintf(cmd, sizeof(cmd), "script -qec '%s bench --path %s --size 32M --block-size 64K' "
                               "/dev/null",
             bin, dir);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof(buf) - 1, p);
    buf[n] = '\0';
    cr_assert_eq(pclose(p), 0, "%s", buf);
    cr_assert(strstr(buf, "write [") && strstr(buf, " of 32 MiB, ") && strstr(buf, "ETA "), "%s",
              buf);
    cr_assert(strstr(buf, "\r\033[K"), "the bar is erased: %s", buf);
    cr_assert(strstr(buf, "all rows verified"), "%s", buf);
}

/* zinf tune --plot draws the block size x queue depth heatmap beside its table. One ring
 * and no huge pages: the heatmap's cells are the block sizes and depths, the best over the
 * other axes, which need not be swept to draw it (12 measurements, not 48). */
Test(cli, tune_plot_draws_the_heatmap, .timeout = 120)
{
    char *o, png[4200];
    if (system("gnuplot --version > /dev/null 2>&1") != 0)
        cr_skip_test("gnuplot is not installed (scripts/setup.sh installs gnuplot-nox)");
    snprintf(png, sizeof(png), "%s/heat.png", dir);
    cr_assert_eq(run(&o,
                     "tune --path %s --size 2M --block-sizes 64K,128K --queue-depths 1,2 "
                     "--rings 1 --huge-pages off --plot %s",
                     dir, png),
                 0, "%s", o);
    cr_assert(strstr(o, "# heatmap written to "), "%s", o);
    free(o);
    unsigned w = 0, h = 0;
    cr_assert(png_size(png, &w, &h), "%s is not a PNG", png);
    cr_expect_eq(w, 640);
    cr_expect_eq(h, 480);
}

/* The text of key's value in a JSON line (up to the next ',' or '}'), or NULL. */
static const char *json_value_text(const char *line, const char *key, char *buf, size_t len)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    const char *p = strstr(line, pat);
    if (!p) return NULL;
    p += strlen(pat);
    size_t n = strcspn(p, ",}");
    snprintf(buf, len, "%.*s", (int)n, p);
    return buf;
}

/* Every number `zinf train --log` writes reads back as the value the trainer computed:
 * the same run in this process gives, step by step, bitwise the logged loss, gradient norm,
 * clip scale, learning rate and parameter digest; and every line is valid JSON. The command
 * defers each update to the next forward (zinf.train.update_in_forward), so that its lines
 * wait for their digests; this process updates at the end of each step. */
Test(cli, train_log_holds_the_trainers_exact_values)
{
    char cfg[4096], data[4096], swap[4096], log[4096], err[512], *o;
    snprintf(swap, sizeof(swap), "%s/exact-cli", dir);
    snprintf(log, sizeof(log), "%s/exact.jsonl", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    FILE *cf = fopen(cfg, "w");
    cr_assert_not_null(cf);
    fprintf(cf,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
            "\"%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}}, "
            "\"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"1M\", \"host_bytes\": "
            "\"1M\", \"train\": {\"update_in_forward\": true}}}",
            swap, swap);
    fclose(cf);
    /* A checkpoint after step 2 finishes its update: its line comes before the checkpoint's. */
    cr_assert_eq(run(&o,
                     "train --config %s --data %s " TINY " --steps 4 --checkpoint-every 2 --log %s",
                     cfg, data, log),
                 0, "%s", o);
    free(o);

    snprintf(swap, sizeof(swap), "%s/exact-lib", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    struct trainer_opts opts;
    trainer_opts_defaults(&opts);
    opts.config_path = cfg;
    opts.data_path = data;
    opts.model.L = 1;
    opts.model.C = 16;
    opts.model.NH = 2;
    opts.seq = 8;
    opts.batch = 1;
    opts.steps = 4;
    opts.digest = true;
    struct trainer *t = NULL;
    cr_assert_eq(trainer_open(&opts, &t, err, sizeof(err)), 0, "%s", err);

    FILE *f = fopen(log, "r");
    cr_assert_not_null(f);
    char line[4096], v[64];
    int steps = 0;
    bool deferred = false;
    while (fgets(line, sizeof(line), f)) {
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        cr_assert_not_null(j, "not JSON (%s): %s", je.text, line);
        json_t *s = json_object_get(j, "summary"), *c = json_object_get(j, "checkpoint");
        if (s) deferred = json_is_true(json_object_get(s, "update_in_forward"));
        if (c) cr_assert_geq(steps, json_integer_value(c), "checkpoint %lld before its step's line",
                             (long long)json_integer_value(c));
        json_decref(j);
        if (strncmp(line, "{\"step\":", 8) != 0) continue;
        struct trainer_step_stats st;
        cr_assert_eq(trainer_step(t, &st), 0);
        cr_assert_eq(st.step, steps + 1, "the log's lines are in step order");
        steps++;
        float loss = strtof(json_value_text(line, "loss", v, sizeof(v)), NULL);
        cr_expect(memcmp(&loss, &st.loss, sizeof(float)) == 0, "step %d loss: logged %s, %.9g",
                  st.step, v, st.loss);
        double norm = strtod(json_value_text(line, "grad_norm", v, sizeof(v)), NULL);
        cr_expect(memcmp(&norm, &st.grad_norm, sizeof(double)) == 0,
                  "step %d grad_norm: logged %s, %.17g", st.step, v, st.grad_norm);
        float clip = strtof(json_value_text(line, "clip_scale", v, sizeof(v)), NULL);
        cr_expect(memcmp(&clip, &st.clip_scale, sizeof(float)) == 0,
                  "step %d clip_scale: logged %s, %.9g", st.step, v, st.clip_scale);
        float lr = strtof(json_value_text(line, "lr", v, sizeof(v)), NULL);
        cr_expect(memcmp(&lr, &st.lr, sizeof(float)) == 0, "step %d lr: logged %s, %.9g", st.step,
                  v, st.lr);
        /* With the update deferred to the next forward, the digest comes a step later. */
        struct trainer_summary sum;
        if (st.update_pending) cr_assert_eq(trainer_finish_update(t), 0);
        trainer_get_summary(t, &sum);
        cr_assert(sum.have_digest);
        cr_assert_eq(sum.digest_step, st.step);
        char want[32];
        snprintf(want, sizeof(want), "\"%016llx\"", (unsigned long long)sum.digest);
        cr_expect_str_eq(json_value_text(line, "digest", v, sizeof(v)), want, "step %d digest",
                         st.step);
    }
    fclose(f);
    trainer_close(t);
    cr_assert_eq(steps, 4);
    cr_assert(deferred, "the command did not defer its updates to the next forward");
}

/* zinf compare: a run and its resumed twin (interrupted at step 2, the log appended to, step
 * 2 logged twice) are the same; a run with another learning rate differs from step 1 on,
 * where the loss is still equal and the digest is not; bad input names the file (and line). */
Test(cli, compare_tells_runs_apart_by_loss_and_digest)
{
    char cfg[4096], data[4096], swap[4096], a[4096], b[4096], c[4096], bad[4096], *o;
    snprintf(swap, sizeof(swap), "%s/cmp-a", dir);
    snprintf(a, sizeof(a), "%s/cmp-a.jsonl", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 4 --log %s", cfg, data, a),
                 0, "%s", o);
    free(o);
    snprintf(swap, sizeof(swap), "%s/cmp-b", dir);
    snprintf(b, sizeof(b), "%s/cmp-b.jsonl", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 2 --log %s", cfg, data, b),
                 0, "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 4 --log %s --resume", cfg,
                     data, b),
                 0, "%s", o);
    free(o);
    cr_assert_eq(run(&o, "compare %s %s", a, b), 0, "%s", o);
    cr_assert(strstr(o, "# same: all 4 common steps (losses and parameter digests bitwise equal)"),
              "%s", o);
    free(o);

    snprintf(swap, sizeof(swap), "%s/cmp-c", dir);
    snprintf(c, sizeof(c), "%s/cmp-c.jsonl", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 3 --lr 0.002 --log %s", cfg,
                     data, c),
                 0, "%s", o);
    free(o);
    cr_assert_eq(run(&o, "compare %s %s", a, c), 1, "%s", o);
    cr_assert(strstr(o, "NO (digest)"), "step 1's loss is equal, its digest not: %s", o);
    cr_assert(strstr(o, "# differ: 3 of 3 common steps; the first is step 1"), "%s", o);
    cr_assert(strstr(o, "not compared: 1 in"), "%s", o);
    free(o);

    cr_assert_eq(run(&o, "compare %s %s/none.jsonl", a, dir), 2, "%s", o);
    cr_assert(strstr(o, "none.jsonl: No such file or directory"), "%s", o);
    free(o);
    snprintf(bad, sizeof(bad), "%s/cmp-bad.jsonl", dir);
    FILE *f = fopen(bad, "w");
    cr_assert_not_null(f);
    fputs("{\"step\":1,\"loss\":5.5}\n[1,2]\n", f);
    fclose(f);
    cr_assert_eq(run(&o, "compare %s %s", a, bad), 2, "%s", o);
    cr_assert(strstr(o, "cmp-bad.jsonl:2: not a JSON object"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "compare %s", a), 2, "%s", o);
    cr_assert(strstr(o, "two log files are needed"), "%s", o);
    free(o);
    /* Logs with no step in common: nothing compared is not "the same". */
    snprintf(bad, sizeof(bad), "%s/cmp-late.jsonl", dir);
    f = fopen(bad, "w");
    cr_assert_not_null(f);
    fputs("{\"step\":9,\"loss\":1.5}\n", f);
    fclose(f);
    cr_assert_eq(run(&o, "compare %s %s", a, bad), 2, "%s", o);
    cr_assert(strstr(o, "no step is in both logs"), "%s", o);
    free(o);
    /* A run killed mid-line leaves its last line cut short: skipped, not an error. */
    char cut[4096], cmd[16384];
    snprintf(cut, sizeof(cut), "%s/cmp-cut.jsonl", dir);
    snprintf(cmd, sizeof(cmd), "cp '%s' '%s' && printf '{\"step\":5,\"lo' >> '%s'", a, cut, cut);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(run(&o, "compare %s %s", a, cut), 0, "%s", o);
    free(o);
}

/* --export writes the parameters as a safetensors file: the header names every tensor of
 * the layout with its shape and byte range, the data is the parameters of the last step
 * (their digest, computed over the file, is the one the log gave that step), and the
 * metadata says the model and step. Refused across ranks at stage 3 (shards); a path that
 * cannot be written fails the command, naming it, after the state is saved. */
Test(cli, train_export_writes_the_parameters_as_safetensors, .timeout = 120)
{
    char cfg[4096], data[4096], swap[4096], log[4096], out[4096], *o;
    snprintf(swap, sizeof(swap), "%s/exp", dir);
    snprintf(log, sizeof(log), "%s/exp.jsonl", dir);
    snprintf(out, sizeof(out), "%s/model.safetensors", dir);
    train_files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 3 --log %s --export %s", cfg,
                     data, log, out),
                 0, "%s", o);
    cr_assert(strstr(o, "# export: step 3, 16 tensors"), "%s", o);
    free(o);

    FILE *f = fopen(out, "rb");
    cr_assert_not_null(f);
    unsigned char len8[8];
    cr_assert_eq(fread(len8, 1, 8, f), 8);
    uint64_t hlen = 0;
    for (int k = 7; k >= 0; k--)
        hlen = hlen << 8 | len8[k];
    cr_assert(hlen > 0 && hlen % 8 == 0 && hlen < 65536, "header of %llu bytes",
              (unsigned long long)hlen);
    char *hdr = calloc(1, hlen + 1);
    cr_assert_eq(fread(hdr, 1, hlen, f), hlen);
    json_error_t je;
    json_t *h = json_loads(hdr, 0, &je);
    cr_assert_not_null(h, "header: %s", je.text);
    json_t *meta = json_object_get(h, "__metadata__");
    cr_expect_str_eq(json_string_value(json_object_get(meta, "step")), "3");
    cr_expect_str_eq(json_string_value(json_object_get(meta, "dim")), "16");
    json_t *qkv = json_object_get(h, "h0.attn.qkv.w");
    cr_assert_not_null(qkv);
    cr_expect_eq(json_integer_value(json_array_get(json_object_get(qkv, "shape"), 0)), 48);
    cr_expect_eq(json_integer_value(json_array_get(json_object_get(qkv, "shape"), 1)), 16);
    cr_expect_eq(json_array_size(json_object_get(json_object_get(h, "lnf.b"), "shape")), 1);

    /* The data, tensor by tensor in the layout's order, digested as the trainer does. */
    struct gpt_config gc = {.V = 256, .maxT = 8, .L = 1, .C = 16, .NH = 2};
    int n = gpt_layout(&gc, NULL, 0);
    struct gpt_tensor_desc *d = calloc((size_t)n, sizeof(*d));
    cr_assert_eq(gpt_layout(&gc, d, (size_t)n), n);
    cr_assert_eq(json_object_size(h), (size_t)n + 1);
    uint64_t sum = 0, at = 0;
    for (int i = 0; i < n; i++) {
        json_t *e = json_object_get(h, d[i].name);
        cr_assert_not_null(e, "%s is not in the file", d[i].name);
        cr_assert_str_eq(json_string_value(json_object_get(e, "dtype")), "F32");
        json_t *offs = json_object_get(e, "data_offsets");
        cr_assert_eq(json_integer_value(json_array_get(offs, 0)), (json_int_t)at, "%s", d[i].name);
        at += d[i].numel * sizeof(float);
        cr_assert_eq(json_integer_value(json_array_get(offs, 1)), (json_int_t)at, "%s", d[i].name);
        float *p = malloc(d[i].numel * sizeof(float));
        cr_assert_eq(fread(p, sizeof(float), d[i].numel, f), d[i].numel, "%s", d[i].name);
        sum += digest_floats(p, d[i].numel, (uint32_t)i, 0);
        free(p);
    }
    char extra;
    cr_assert_eq(fread(&extra, 1, 1, f), 0, "bytes after the last tensor");
    fclose(f);
    json_decref(h);
    free(hdr);
    free(d);
    char want[32], line[4096], v[64];
    snprintf(want, sizeof(want), "\"%016llx\"", (unsigned long long)sum);
    FILE *lf = fopen(log, "r");
    cr_assert_not_null(lf);
    bool found = false;
    while (fgets(line, sizeof(line), lf))
        if (!strncmp(line, "{\"step\":3,", 10)) {
            cr_expect_str_eq(json_value_text(line, "digest", v, sizeof(v)), want,
                             "the file's digest is not step 3's");
            found = true;
        }
    fclose(lf);
    cr_assert(found);

    /* A path that cannot be written: exit 1 naming it; the run's state is saved. */
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 4 --resume --export %s/no/such/dir/m.safetensors",
                     cfg, data, dir),
                 1, "%s", o);
    cr_assert(strstr(o, "--export") && strstr(o, "no/such/dir/m.safetensors: No such file or directory"),
              "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s " TINY " --steps 4 --resume", cfg, data), 0,
                 "%s", o);
    cr_assert(strstr(o, "# checkpoint: step 4"), "step 4 was saved before the export failed: %s", o);
    free(o);

    /* Across ranks at stage 3: refused before any step. */
    snprintf(swap, sizeof(swap), "%s/exp3", dir);
    zero_config(cfg, sizeof(cfg), swap, 3);
    cr_assert_neq(train_ranks(&o, 2, cfg, data, ZMODEL " --steps 1 --export /dev/null"), 0, "%s", o);
    cr_assert(strstr(o, "each of the 2 ranks holds a shard of every weight"), "%s", o);
    free(o);
}

/* ---- the launcher and the rendezvous under faults --------------------------------------- */

/* Like run(), a shell command line of its own. */
static int sh_run(char **out, const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof(cmd) - 8, fmt, ap);
    va_end(ap);
    strcat(cmd, " 2>&1");
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t cap = 1 << 16, len = 0, n;
    char *buf = malloc(cap);
    while ((n = fread(buf + len, 1, cap - len - 1, p)) > 0)
        len += n;
    buf[len] = '\0';
    int st = pclose(p);
    *out = buf;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* Whether pid is a process that has not exited (a zombie has). */
static bool pid_running(pid_t pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && p[2] != 'Z' && p[2] != 'X';
}

/* A launcher killed with SIGKILL takes its ranks with it: each gets SIGTERM (the
 * parent-death signal) and exits, instead of running on under PID 1. */
Test(cli, launch_killed_takes_its_ranks_with_it)
{
    char out[4096];
    snprintf(out, sizeof(out), "%s/orphans.out", dir);
    pid_t pid = spawn(out, "launch -n 2 -- %s wait", comm_rank_bin());
    double t0 = now_s();
    while (count_lines(out, "[") < 2 && now_s() - t0 < 30)
        usleep(20000);
    cr_assert_eq(count_lines(out, "["), 2, "the ranks did not start: %s", tail_text(out));
    pid_t kids[4];
    int n = children_of(pid, kids, 4);
    cr_assert_eq(n, 2, "the launcher has %d children", n);
    /* Each rank leads a process group of its own. */
    for (int k = 0; k < n; k++)
        cr_assert_eq(getpgid(kids[k]), kids[k], "rank pid %d is in group %d", (int)kids[k],
                     (int)getpgid(kids[k]));
    kill(pid, SIGKILL);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    t0 = now_s();
    for (int k = 0; k < n; k++)
        while (pid_running(kids[k]) && now_s() - t0 < 10)
            usleep(20000);
    for (int k = 0; k < n; k++)
        cr_expect_not(pid_running(kids[k]), "rank pid %d outlived its launcher", (int)kids[k]);
    cr_assert_lt(now_s() - t0, 5.0, "the ranks took %.1f s to go", now_s() - t0);
}

/* Whether /dev/shm holds an object whose name starts with prefix. */
static bool shm_has(const char *prefix)
{
    DIR *d = opendir("/dev/shm");
    struct dirent *e;
    bool found = false;
    cr_assert_not_null(d);
    while (!found && (e = readdir(d)))
        found = !strncmp(e->d_name, prefix, strlen(prefix));
    closedir(d);
    return found;
}

/* A rank waiting for the others in the rendezvous answers SIGTERM at once (exit 143) and
 * leaves no segment behind; so does a launcher's rank. */
Test(cli, rank_waiting_to_meet_answers_sigterm_and_cleans_up)
{
    char cfg[4096], data[4096], swap[4096], out[4096], name[64];
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    snprintf(swap, sizeof(swap), "%s/rdvterm", dir);
    zero_config(cfg, sizeof(cfg), swap, 3);
    snprintf(out, sizeof(out), "%s/rdvterm.out", dir);
    snprintf(name, sizeof(name), "rdvterm-%d", (int)getpid());
    char seg[128];
    snprintf(seg, sizeof(seg), "zinf-comm-%s", name);
    /* Rank 0 of 2, alone: it waits for rank 1. */
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "2", 1);
    setenv("ZINF_COMM_NAME", name, 1);
    setenv("ZINF_COMM_TIMEOUT_MS", "60000", 1);
    pid_t pid = spawn(out, "train --config %s --data %s " ZMODEL " --steps 2", cfg, data);
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    unsetenv("ZINF_COMM_NAME");
    unsetenv("ZINF_COMM_TIMEOUT_MS");
    double t0 = now_s();
    while (!shm_has(seg) && now_s() - t0 < 30)
        usleep(10000);
    cr_assert(shm_has(seg), "rank 0 never waited: %s", tail_text(out));
    usleep(200000);
    kill(pid, SIGTERM);
    t0 = now_s();
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert_lt(now_s() - t0, 2.0, "SIGTERM took %.1f s: %s", now_s() - t0, tail_text(out));
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 143, "status %#x: %s", st, tail_text(out));
    cr_assert_not(shm_has(seg), "the segment /dev/shm/%s was left behind", seg);
    cr_assert(strstr(tail_text(out), "stopped by a signal while the ranks met"), "%s",
              tail_text(out));
}

/* A rank that stops (SIGSTOP) in the middle of training: the others give up at the
 * collectives' deadline (ZINF_COMM_OP_TIMEOUT_MS here, zinf.comm_timeout in a config), the
 * message names the stopped rank and what it was doing, and the launcher stops the job
 * and exits 1. The same deadline from the config. */
Test(cli, stopped_rank_fails_the_job_within_the_deadline, .timeout = 120)
{
    char cfg[4096], data[4096], swap[4096], out[4096];
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    for (int how = 0; how < 2; how++) {
        snprintf(swap, sizeof(swap), "%s/stopped%d", dir, how);
        snprintf(out, sizeof(out), "%s/stopped%d.out", dir, how);
        zero_config(cfg, sizeof(cfg), swap, 1);
        if (how == 0) {
            setenv("ZINF_COMM_OP_TIMEOUT_MS", "3000", 1);
        } else {
            /* The config's key: a whole number of seconds. */
            char *text = read_text(cfg);
            char *z = strstr(text, "\"zinf\": {");
            cr_assert_not_null(z);
            FILE *f = fopen(cfg, "w");
            cr_assert_not_null(f);
            fprintf(f, "%.*s\"zinf\": {\"comm_timeout\": 4, %s", (int)(z - text), text,
                    z + strlen("\"zinf\": {"));
            fclose(f);
            free(text);
        }
        unsetenv("OMP_NUM_THREADS");
        pid_t pid = spawn(out, "launch -n 2 --grace 3 -- %s train --config %s --data %s " ZMODEL
                          " --steps 100000", getenv("ZINF_BIN"), cfg, data);
        unsetenv("ZINF_COMM_OP_TIMEOUT_MS");
        double t0 = now_s();
        while (count_lines(out, "[0]     ") < 2 && now_s() - t0 < 60)
            usleep(20000);
        cr_assert_geq(count_lines(out, "[0]     "), 2, "no steps: %s", tail_text(out));
        pid_t kids[4];
        int n = children_of(pid, kids, 4), victim = -1;
        for (int k = 0; k < n; k++) {
            char path[64], env[8192];
            snprintf(path, sizeof(path), "/proc/%d/environ", (int)kids[k]);
            FILE *f = fopen(path, "r");
            size_t len = f ? fread(env, 1, sizeof(env) - 1, f) : 0;
            if (f) fclose(f);
            for (size_t i = 0; i < len; i += strlen(env + i) + 1)
                if (!strcmp(env + i, "RANK=1")) victim = kids[k];
        }
        cr_assert_gt(victim, 0, "no rank 1 among %d children", n);
        kill(victim, SIGSTOP);
        t0 = now_s();
        int st;
        cr_assert_eq(waitpid(pid, &st, 0), pid);
        double took = now_s() - t0;
        char *text = read_text(out);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %#x: %s", st, text);
        /* The deadline, then the others' exit, then at most --grace for the stopped one. */
        cr_assert_lt(took, 20.0, "the job took %.1f s to fail: %s", took, text);
        char want[96];
        snprintf(want, sizeof(want), "rank 1 (pid %d, stopped) did not come to", victim);
        cr_assert(strstr(text, want), "no '%s' in: %s", want, text);
        cr_assert(strstr(text, how ? "within 4 s" : "within 3 s"), "%s", text);
        cr_assert(strstr(text, "zinf launch: failed: rank 0"), "%s", text);
        free(text);
    }
}

/* One live job per name: a second launcher of a running job's name is refused, naming the
 * first; once the first is gone (even killed), the name is free again. */
Test(cli, a_second_job_of_a_live_jobs_name_is_refused)
{
    char out[4096], *o, name[64];
    snprintf(name, sizeof(name), "samename-%d", (int)getpid());
    snprintf(out, sizeof(out), "%s/samename.out", dir);
    pid_t pid = spawn(out, "launch -n 2 --name %s -- %s wait", name, comm_rank_bin());
    double t0 = now_s();
    while (count_lines(out, "[") < 2 && now_s() - t0 < 30)
        usleep(20000);
    cr_assert_eq(count_lines(out, "["), 2, "%s", tail_text(out));
    cr_assert_eq(run(&o, "launch -n 2 --name %s -- %s", name, comm_rank_bin()), 2, "%s", o);
    char want[128];
    snprintf(want, sizeof(want), "a job named '%s' is running (its launcher is pid %d)", name,
             (int)pid);
    cr_assert(strstr(o, want), "no '%s' in: %s", want, o);
    cr_assert_null(strstr(o, "rank 0 ok"), "the second job ran: %s", o);
    free(o);
    kill(pid, SIGKILL); /* leaves its name file; its lock goes with it */
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    t0 = now_s();
    int r;
    while ((r = run(&o, "launch -n 2 --name %s -- %s", name, comm_rank_bin())) != 0 &&
           now_s() - t0 < 10) { /* the killed job's ranks may still be leaving */
        free(o);
        usleep(100000);
    }
    cr_assert_eq(r, 0, "%s", o);
    cr_assert(strstr(o, "[1] rank 1 ok"), "%s", o);
    free(o);
    char path[128];
    snprintf(path, sizeof(path), "/dev/shm/zinf-job-%s", name);
    cr_assert_neq(access(path, F_OK), 0, "%s was left behind", path);
}

/* As root: another user (uid 65534) cannot get between the ranks. An object it made under
 * the job's name (mode 0666) is refused by rank 0 and by the joining ranks, naming it and
 * its owner, at once rather than at a timeout; the name a launcher's job meets under is
 * not predictable, and a name seen in /dev/shm cannot be opened by it. Without root, the
 * same with an object of this user whose mode is not 0600. */
Test(cli, a_rendezvous_object_of_another_user_is_refused)
{
    char name[64], obj[128], *o;
    snprintf(name, sizeof(name), "squat-%d", (int)getpid());
    snprintf(obj, sizeof(obj), "/zinf-comm-%s", name);
    bool root = geteuid() == 0;
    pid_t c = fork();
    cr_assert_geq(c, 0);
    if (c == 0) {
        if (root && setresuid(65534, 65534, 65534) != 0) _exit(3);
        int fd = shm_open(obj, O_RDWR | O_CREAT | O_EXCL, 0666);
        if (fd < 0 || fchmod(fd, 0666) != 0 || ftruncate(fd, 1 << 20) != 0) _exit(4);
        _exit(0);
    }
    int st;
    cr_assert_eq(waitpid(c, &st, 0), c);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the squatter could not make %s: %#x", obj,
              st);
    const char *owner = root ? "belongs to uid 65534" : "has mode 0666, not 0600";
    for (int rank = 0; rank < 2; rank++) {
        double t0 = now_s();
        cr_assert_eq(sh_run(&o, "RANK=%d WORLD_SIZE=2 ZINF_COMM_NAME=%s %s", rank, name,
                            comm_rank_bin()),
                     1, "%s", o);
        cr_assert_lt(now_s() - t0, 5.0, "rank %d waited: %s", rank, o);
        cr_assert(strstr(o, obj) && strstr(o, owner), "rank %d: %s", rank, o);
        free(o);
    }
    char path[160];
    snprintf(path, sizeof(path), "/dev/shm%s", obj);
    cr_assert_eq(access(path, F_OK), 0, "the other user's object was removed");
    unlink(path);
    if (!root) return;
    /* A launcher's job: its segment has a random tag, and another user cannot open it. */
    char out[4096];
    snprintf(out, sizeof(out), "%s/tagged.out", dir);
    setenv("ZINF_COMM_TIMEOUT_MS", "20000", 1);
    pid_t pid = spawn(out, "launch -n 2 --name %s -- sh -c '[ $RANK = 1 ] && sleep 3; exec %s'",
                      name, comm_rank_bin());
    unsetenv("ZINF_COMM_TIMEOUT_MS");
    char prefix[128];
    snprintf(prefix, sizeof(prefix), "zinf-comm-%s.", name);
    double t0 = now_s();
    while (!shm_has(prefix) && now_s() - t0 < 10)
        usleep(10000);
    cr_assert(shm_has(prefix), "no tagged segment: %s", tail_text(out));
    c = fork();
    if (c == 0) {
        if (setresuid(65534, 65534, 65534) != 0) _exit(3);
        DIR *d = opendir("/dev/shm");
        struct dirent *e;
        while (d && (e = readdir(d)))
            if (!strncmp(e->d_name, prefix, strlen(prefix))) {
                char n2[300];
                snprintf(n2, sizeof(n2), "/%s", e->d_name);
                int fd = shm_open(n2, O_RDONLY, 0);
                _exit(fd >= 0 ? 5 : errno == EACCES ? 0 : 6);
            }
        _exit(7);
    }
    cr_assert_eq(waitpid(c, &st, 0), c);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "uid 65534 and the segment: %#x", st);
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s", tail_text(out));
}

/* As root, another user (setpriv --reuid=65534) against the launcher's job names: an
 * object of its own under the name a job will use (mode 0666), and a FIFO among the names
 * the launcher sweeps. The job is refused at once, naming the object's owner, and the
 * object stays; a job of another name starts and ends as usual, the sweep neither hangs on
 * nor removes what is not this user's. */
Test(cli, a_job_name_held_by_another_user_is_refused)
{
    if (geteuid() != 0) {
        /* Without root there is no second user to be: the same object of this user with
         * another mode is refused all the same. */
        char name[64], path[128], *o;
        snprintf(name, sizeof(name), "modejob-%d", (int)getpid());
        snprintf(path, sizeof(path), "/dev/shm/zinf-job-%s", name);
        int fd = open(path, O_RDWR | O_CREAT | O_EXCL, 0644);
        cr_assert_geq(fd, 0);
        fchmod(fd, 0644);
        close(fd);
        cr_assert_eq(run(&o, "launch -n 1 --name %s -- true", name), 2, "%s", o);
        cr_assert(strstr(o, "with mode 0644"), "%s", o);
        free(o);
        unlink(path);
        return;
    }
    char name[64], obj[128], fifo[128], *o;
    snprintf(name, sizeof(name), "heldjob-%d", (int)getpid());
    snprintf(obj, sizeof(obj), "/dev/shm/zinf-job-%s", name);
    snprintf(fifo, sizeof(fifo), "/dev/shm/zinf-job-fifo-%d", (int)getpid());
    cr_assert_eq(sh_run(&o, "setpriv --reuid=65534 --regid=65534 --clear-groups sh -c "
                            "'umask 0; : > %s && chmod 0666 %s && mkfifo -m 0666 %s'",
                        obj, obj, fifo),
                 0, "%s", o);
    free(o);
    double t0 = now_s();
    cr_assert_eq(run(&o, "launch -n 1 --name %s -- true", name), 2, "%s", o);
    cr_assert_lt(now_s() - t0, 5.0, "%s", o);
    cr_assert(strstr(o, "belongs to uid 65534") && strstr(o, "another --name"), "%s", o);
    free(o);
    t0 = now_s();
    cr_assert_eq(run(&o, "launch -n 2 -- %s", comm_rank_bin()), 0, "%s", o);
    cr_assert_lt(now_s() - t0, 20.0, "%s", o);
    cr_assert(strstr(o, "[1] rank 1 ok"), "%s", o);
    free(o);
    struct stat st;
    cr_assert(stat(obj, &st) == 0 && st.st_uid == 65534, "the other user's %s was removed", obj);
    cr_assert(stat(fifo, &st) == 0 && S_ISFIFO(st.st_mode), "the other user's %s was removed",
              fifo);
    unlink(obj);
    unlink(fifo);
}

/* ---- checkpoints across ranks under kills ------------------------------------------------ */

static const char *const ckpt_points[] = {"before-barrier", "after-barrier", "after-rename",
                                          "after-commit"};

/* `ranks` ranks (0: one trainer) at stage 3 under swap, ZMODEL and extra, to `steps`,
 * checkpointing every 2 steps, logging to log (appended on --resume); the exit status, the
 * output in *out. kill: ZINF_TEST_KILL_AT for the ranks, or NULL. */
static int ckpt_run(char **out, const char *swap, const char *log, int ranks, int steps,
                    const char *extra, const char *kill)
{
    char cfg[4096], data[4096], args[8192];
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    zero_config(cfg, sizeof(cfg), swap, 3);
    snprintf(args, sizeof(args), ZMODEL " --steps %d --checkpoint-every 2 --log %s %s", steps, log,
             extra);
    if (kill) setenv("ZINF_TEST_KILL_AT", kill, 1);
    int r = train_ranks(out, ranks, cfg, data, args);
    unsetenv("ZINF_TEST_KILL_AT");
    return r;
}

static void expect_steps(const char *log, char (*want)[32], int from, int to, const char *what)
{
    static char got[MAX_STEPS + 1][32];
    memset(got, 0, sizeof(got));
    read_losses(log, got, NULL, NULL); /* a step logged twice must be logged the same */
    for (int s = from; s <= to; s++)
        cr_assert_str_eq(got[s], want[s], "%s, step %d", what, s);
}

/* Each rank killed (SIGKILL) at every point of a checkpoint: before its first barrier,
 * between the barrier and its manifest's rename, after its rename and before the others',
 * after the commit and before its previous version goes. The next --resume goes to the
 * newest step every rank holds, says so where that rolls back, and continues bitwise (loss
 * and digest) as the run that never stopped; so does a resume on another number of ranks
 * from such a checkpoint, from one step all the source's ranks hold. Without test_soak()
 * each point is hit on one rank, the ranks taking turns: 4 of the 8 kills. Under the
 * sanitizers (test_sanitized()) rank 1's two of them: between the barrier and the rename
 * (the roll-back, and the re-cut from it) and after the commit (a resume at step 4); the
 * normal build kills rank 0 before the barrier and after its rename too. */
Test(cli, zero_checkpoint_killed_anywhere_resumes_from_a_whole_step, .timeout = 300)
{
    static char ref[MAX_STEPS + 1][32], ref1[MAX_STEPS + 1][32];
    char swap[4096], log[4096], *o;
    snprintf(swap, sizeof(swap), "%s/kref", dir);
    snprintf(log, sizeof(log), "%s/kref.jsonl", dir);
    cr_assert_eq(ckpt_run(&o, swap, log, 2, 6, "", NULL), 0, "%s", o);
    free(o);
    cr_assert_eq(read_losses(log, ref, NULL, NULL), 6);
    /* The reference of a re-cut at step 2: two ranks to step 2, one rank of 2 micro-batches
     * on. */
    snprintf(swap, sizeof(swap), "%s/kref1", dir);
    snprintf(log, sizeof(log), "%s/kref1.jsonl", dir);
    cr_assert_eq(ckpt_run(&o, swap, log, 2, 2, "", NULL), 0, "%s", o);
    free(o);
    cr_assert_eq(ckpt_run(&o, swap, log, 0, 6, "--resume --accumulate 2", NULL), 0, "%s", o);
    free(o);
    cr_assert_eq(read_losses(log, ref1, NULL, NULL), 6);

    for (int p = 0; p < 4; p++)
        for (int rank = 0; rank < 2; rank++) {
            if (!test_soak() && rank != p % 2) continue; /* (1, 1) stays: the re-cut below */
            if (test_sanitized() && rank != 1) continue;
            char kill[64], what[96];
            snprintf(kill, sizeof(kill), "%s:%d:3", ckpt_points[p], rank); /* step 4's */
            snprintf(what, sizeof(what), "rank %d killed %s step 4's checkpoint", rank,
                     ckpt_points[p]);
            snprintf(swap, sizeof(swap), "%s/k%d%d", dir, p, rank);
            snprintf(log, sizeof(log), "%s/k%d%d.jsonl", dir, p, rank);
            cr_assert_eq(ckpt_run(&o, swap, log, 2, 6, "", kill), 1, "%s: %s", what, o);
            cr_assert(strstr(o, "was killed by signal 9"), "%s: %s", what, o);
            free(o);
            char sh[8300];
            snprintf(sh, sizeof(sh), "cp -a %s %s-copy", swap, swap);
            cr_assert_eq(system(sh), 0);
            cr_assert_eq(ckpt_run(&o, swap, log, 2, 6, "--resume", NULL), 0, "%s: %s", what, o);
            bool said = strstr(o, "rolling back 2 steps to step 2") != NULL;
            cr_assert(said == (p == 1), "%s: %s", what, o);
            free(o);
            /* Every step either attempt logged: steps logged twice, before the kill and
             * after the roll-back, logged the same. */
            expect_steps(log, ref, 1, 6, what);
            if (p != 1 || rank != 1) continue;
            /* Rank 0 at step 4 and rank 1 at step 2, resumed on one rank: the re-cut goes
             * to step 2, which both hold, not to a mix of the two. */
            char copy[4200], log1[4200];
            snprintf(copy, sizeof(copy), "%s-copy", swap);
            snprintf(log1, sizeof(log1), "%s-one.jsonl", swap);
            cr_assert_eq(ckpt_run(&o, copy, log1, 0, 6, "--resume --accumulate 2", NULL), 0,
                         "%s: %s", what, o);
            free(o);
            expect_steps(log1, ref1, 3, 6, "re-cut onto one rank");
        }
}

/* A re-cut (a resume on another number of ranks) killed at every point of its checkpoint,
 * each time on another rank: the run it came from is never hidden (a resume on its own
 * number of ranks continues it bitwise), and a resume on the new number re-cuts again and
 * continues bitwise as a re-cut that never stopped. Without test_soak(), the two points
 * inside the commit (between the barrier and the rename, after the commit); under the
 * sanitizers (test_sanitized()) the first of them, the normal build both. */
Test(cli, zero_recut_killed_anywhere_never_hides_its_source, .timeout = 300)
{
    static char ref2[MAX_STEPS + 1][32], ref4[MAX_STEPS + 1][32];
    char src[4096], swap[4096], log[4096], sh[16384], *o;
    snprintf(src, sizeof(src), "%s/rsrc", dir);
    snprintf(log, sizeof(log), "%s/rsrc.jsonl", dir);
    cr_assert_eq(ckpt_run(&o, src, log, 2, 4, "--accumulate 2", NULL), 0, "%s", o);
    free(o);
    /* References: the source on two ranks to step 5; re-cut onto four to step 6. */
    for (int k = 0; k < 2; k++) {
        snprintf(swap, sizeof(swap), "%s/rref%d", dir, k);
        snprintf(log, sizeof(log), "%s/rref%d.jsonl", dir, k);
        snprintf(sh, sizeof(sh), "cp -a %s %s", src, swap);
        cr_assert_eq(system(sh), 0);
        cr_assert_eq(ckpt_run(&o, swap, log, k ? 4 : 2, k ? 6 : 5,
                              k ? "--resume" : "--resume --accumulate 2", NULL),
                     0, "%s", o);
        free(o);
        cr_assert_eq(read_losses(log, k ? ref4 : ref2, NULL, NULL), k ? 6 : 5);
    }
    for (int p = 0; p < 4; p++) {
        if (!test_soak() && p % 2 == 0) continue;
        if (test_sanitized() && p != 1) continue;
        char kill[64], what[96];
        int rank = (p + 1) % 4;
        snprintf(kill, sizeof(kill), "%s:%d:1", ckpt_points[p], rank); /* the re-cut's */
        snprintf(what, sizeof(what), "rank %d killed %s the re-cut's checkpoint", rank,
                 ckpt_points[p]);
        snprintf(swap, sizeof(swap), "%s/r%d", dir, p);
        snprintf(sh, sizeof(sh), "cp -a %s %s", src, swap);
        cr_assert_eq(system(sh), 0);
        snprintf(log, sizeof(log), "%s/r%d.jsonl", dir, p);
        cr_assert_eq(ckpt_run(&o, swap, log, 4, 6, "--resume", kill), 1, "%s: %s", what, o);
        free(o);
        snprintf(sh, sizeof(sh), "cp -a %s %s-copy", swap, swap);
        cr_assert_eq(system(sh), 0);
        /* The source, on its own number of ranks: step 5 as it would have been. */
        cr_assert_eq(ckpt_run(&o, swap, log, 2, 5, "--resume --accumulate 2", NULL), 0, "%s: %s",
                     what, o);
        free(o);
        expect_steps(log, ref2, 5, 5, what);
        /* On four ranks again: re-cut from step 4 (or the re-cut's own step 4, the same
         * state), bitwise the re-cut that never stopped. */
        char copy[4200], log4[4200];
        snprintf(copy, sizeof(copy), "%s-copy", swap);
        snprintf(log4, sizeof(log4), "%s-four.jsonl", swap);
        cr_assert_eq(ckpt_run(&o, copy, log4, 4, 6, "--resume", NULL), 0, "%s: %s", what, o);
        free(o);
        expect_steps(log4, ref4, 5, 6, what);
    }
}

/* zinf job list|close|rm and zinf serve --stop manage jobs and the daemon without a signal:
 * a job with a client attached is neither closed nor removed; a closed job is listed as
 * saved and comes back as flushed; a removed one is gone with its folder; another user may
 * do none of it to root's job, nor stop the daemon. */
Test(cli, jobs_and_the_daemon_are_managed_through_the_socket)
{
    char cfg[4096], sock[4096], out[4096], *o;
    serve_files(cfg, sock, out);
    bool root = geteuid() == 0;
    /* The socket where uid 65534 reaches it, wherever the test's folder lies. */
    char sdir[] = "/tmp/zinf-jobs-XXXXXX";
    cr_assert_not_null(mkdtemp(sdir));
    cr_assert_eq(chmod(sdir, 0711), 0);
    snprintf(sock, sizeof(sock), "%s/zinf.sock", sdir);
    pid_t pid = spawn(out, "serve --socket %s --config %s --foreground%s", sock, cfg,
                      root ? " --group nogroup" : "");
    zinf_engine *e = connect_when_up(sock, "keep");
    zinf_tensor t;
    cr_assert_eq(zinf_register(e, "t", 5000, ZINF_TIER_NVME, &t), 0);
    cr_assert_eq(zinf_write(e, t, 0, "kept through a close", 20), 0);
    zinf_engine *g = connect_when_up(sock, "gone");
    cr_assert_eq(zinf_register(g, "t", 5000, ZINF_TIER_NVME, &t), 0);
    zinf_close(g);

    cr_assert_eq(run(&o, "job list --socket %s", sock), 0, "%s", o);
    cr_assert(strstr(o, "keep") && strstr(o, "gone") && strstr(o, "yes"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "job close keep --socket %s", sock), 1, "%s", o);
    cr_assert(strstr(o, "a client is attached"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "job rm keep --socket %s", sock), 1, "%s", o);
    free(o);
    zinf_close(e);
    cr_assert_eq(run(&o, "job close keep --socket %s", sock), 0, "%s", o);
    free(o);
    cr_assert_eq(run(&o, "job close keep --socket %s", sock), 1, "%s", o);
    cr_assert(strstr(o, "not open"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "job list --socket %s", sock), 0, "%s", o);
    cr_assert(strstr(o, "saved"), "%s", o);
    free(o);
    if (root) {
        /* As uid 65534 (a member of the daemon's --group): neither another's job nor the
         * daemon. In a child of this process: the zinf binary may lie where that uid
         * cannot reach it. */
        pid_t c = fork();
        cr_assert_geq(c, 0);
        if (c == 0) {
            if (setgroups(0, NULL) || setresgid(65534, 65534, 65534) ||
                setresuid(65534, 65534, 65534))
                _exit(90);
            _exit(service_manage(sock, PROTO_JOB_REMOVE, "gone") != -EACCES     ? 1
                  : service_manage(sock, PROTO_JOB_CLOSE, "keep") != -ENOENT    ? 2
                  : service_manage(sock, PROTO_SHUTDOWN, NULL) != -EPERM        ? 3
                                                                                : 0);
        }
        int cst;
        cr_assert_eq(waitpid(c, &cst, 0), c);
        cr_assert(WIFEXITED(cst) && WEXITSTATUS(cst) == 0, "uid 65534 managed root's: %#x", cst);
    }
    cr_assert_eq(run(&o, "job rm gone --socket %s", sock), 0, "%s", o);
    free(o);
    char gone[4200];
    snprintf(gone, sizeof(gone), "%s/swap/gone", dir);
    struct stat st;
    cr_assert_neq(stat(gone, &st), 0, "the removed job's folder is still there");
    cr_assert_eq(run(&o, "job rm gone --socket %s", sock), 1, "%s", o);
    cr_assert(strstr(o, "no such job"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "job rm ../x --socket %s", sock), 2, "%s", o);
    free(o);
    cr_assert_eq(run(&o, "job frob --socket %s", sock), 2, "%s", o);
    free(o);
    e = connect_when_up(sock, "keep");
    cr_assert_eq(zinf_lookup(e, "t", &t), 0);
    test_expect_content(e, t, (const unsigned char *)"kept through a close", 20, "reopened");
    zinf_close(e);
    cr_assert_eq(run(&o, "serve --stop --socket %s --config %s", sock, cfg), 2, "%s", o);
    free(o);
    cr_assert_eq(run(&o, "serve --stop --socket %s", sock), 0, "%s", o);
    cr_assert(strstr(o, "stopped"), "%s", o);
    free(o);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the daemon: %#x", status);
    cr_assert_neq(stat(sock, &st), 0, "the socket outlived the daemon");
    cr_assert_eq(run(&o, "serve --stop --socket %s", sock), 1, "%s", o);
    cr_assert(strstr(o, "no zinf daemon"), "%s", o);
    free(o);
    rmdir(sdir);
}

/* ---- a mistyped command, and gnuplot's failures in one line ----------------------------- */

/* How many '\n' s holds: its lines, when each ends in one. */
static int newlines_in(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

/* An unknown command names the command it most likely misspells (two letters swapped, a
 * letter missing, a beginning only one command has), whether run or asked for help; a word
 * near no command, or the beginning of two, gets no guess. Bad usage all the same: 2. */
Test(cli, unknown_command_suggests_the_nearest)
{
    char *o;
    cr_assert_eq(run(&o, "trian"), 2, "%s", o);
    cr_assert(strstr(o, "zinf: unknown command 'trian' (did you mean 'train'?)\n"), "%s", o);
    cr_assert(strstr(o, "usage: zinf <command>"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "help trian"), 2, "%s", o);
    cr_assert(strstr(o, "zinf: help: unknown command 'trian' (did you mean 'train'?)\n"), "%s",
              o);
    free(o);
    cr_assert_eq(run(&o, "tpo"), 2, "%s", o);
    cr_assert(strstr(o, "(did you mean 'topo'?)"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "tra"), 2, "%s", o);
    cr_assert(strstr(o, "(did you mean 'train'?)"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "frobnicate"), 2, "%s", o);
    cr_assert(strstr(o, "zinf: unknown command 'frobnicate'\n"), "%s", o);
    cr_assert_null(strstr(o, "did you mean"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "help frobnicate"), 2, "%s", o);
    cr_assert(strstr(o, "zinf: help: unknown command 'frobnicate'\n"), "%s", o);
    free(o);
    cr_assert_eq(run(&o, "co"), 2, "%s", o); /* config or compare */
    cr_assert_null(strstr(o, "did you mean"), "%s", o);
    free(o);
}

/* zinf plot refuses an OUT.png in a directory that does not exist before gnuplot runs, naming
 * both (2); when gnuplot itself fails, one line says so with its exit status and the first
 * line of its message, and nothing else of gnuplot's reaches the terminal (1); when it
 * succeeds, the one line is what was written. */
Test(cli, plot_says_why_gnuplot_failed_in_one_line, .timeout = 120)
{
    char log[4096], out[4200], *o;
    if (system("gnuplot --version > /dev/null 2>&1") != 0)
        cr_skip_test("gnuplot is not installed (scripts/setup.sh installs gnuplot-nox)");
    snprintf(log, sizeof(log), "%s/run.jsonl", dir);
    FILE *f = fopen(log, "w");
    cr_assert_not_null(f);
    for (int k = 1; k <= 3; k++)
        fprintf(f, "{\"step\":%d,\"loss\":%.1f,\"tokens_per_s\":1000,\"nvme_read_GBps\":0.5,"
                   "\"nvme_write_GBps\":0.25,\"device_used_bytes\":1048576,"
                   "\"host_used_bytes\":2097152}\n",
                k, 6.0 - k);
    cr_assert_eq(fclose(f), 0);

    cr_assert_eq(run(&o, "plot %s -o /nonexistent/dir/x.png", log), 2, "%s", o);
    cr_assert_str_eq(o, "zinf plot: cannot write /nonexistent/dir/x.png: the directory "
                        "/nonexistent/dir does not exist\n");
    free(o);

    /* The directory is there, but OUT.png is a directory: gnuplot cannot open it. */
    snprintf(out, sizeof(out), "%s/out.png", dir);
    cr_assert_eq(mkdir(out, 0755), 0, "%s", strerror(errno));
    cr_assert_eq(run(&o, "plot %s -o %s", log, out), 1, "%s", o);
    static const char failed[] = "zinf plot: gnuplot failed (exit 1): ";
    cr_assert(!strncmp(o, failed, strlen(failed)), "%s", o);
    cr_assert(strstr(o, "cannot open file"), "%s", o);
    cr_assert_eq(newlines_in(o), 1, "%s", o);
    free(o);

    snprintf(out, sizeof(out), "%s/run.png", dir);
    cr_assert_eq(run(&o, "plot %s -o %s", log, out), 0, "%s", o);
    static const char wrote[] = "zinf plot: wrote ";
    cr_assert(!strncmp(o, wrote, strlen(wrote)), "%s", o);
    cr_assert_eq(newlines_in(o), 1, "%s", o);
    free(o);

    /* A log without tier occupancy (an older zinf's) draws, saying so in that panel. */
    f = fopen(log, "w");
    cr_assert_not_null(f);
    for (int k = 1; k <= 3; k++)
        fprintf(f, "{\"step\":%d,\"loss\":%.1f,\"tokens_per_s\":1000,\"nvme_read_GBps\":0.5,"
                   "\"nvme_write_GBps\":0.25}\n",
                k, 6.0 - k);
    cr_assert_eq(fclose(f), 0);
    cr_assert_eq(run(&o, "plot %s -o %s", log, out), 0, "%s", o);
    cr_assert(!strncmp(o, wrote, strlen(wrote)), "%s", o);
    free(o);
}

/* Budgets zinf train refuses when it opens ("zinf.device_bytes: 700 KiB is too small") are
 * refused by zinf config check, for the model its options name, and by train --dry-run: in
 * train's words, exit 2. Budgets that run pass all three; the same config passes check for a
 * model small enough, so the options are what it judges. */
Test(cli, config_check_and_dry_run_refuse_the_budgets_train_refuses, .timeout = 180)
{
    static const char model[] = "--layers 2 --dim 64 --heads 2 --seq 32 --batch 2";
    char cfg[4096], data[4096], said[2048], *o;
    train_files(dir, cfg, sizeof(cfg), data, sizeof(data));
    snprintf(cfg, sizeof(cfg), "%s/small.json", dir);
    write_file(cfg, "{\"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"700K\", "
                    "\"host_bytes\": \"64M\"}}");
    cr_assert_eq(run(&o, "train --config %s --data %s %s --steps 1", cfg, data, model), 2, "%s",
                 o);
    const char *at = strstr(o, "zinf train: zinf.device_bytes: 700 KiB is too small: ");
    cr_assert_not_null(at, "%s", o);
    at += strlen("zinf train: ");
    snprintf(said, sizeof(said), "%.*s", (int)strcspn(at, "\n"), at);
    free(o);
    cr_assert_eq(run(&o, "config check %s %s", cfg, model), 2, "%s", o);
    cr_expect(strstr(o, said), "config check did not say \"%s\":\n%s", said, o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s %s --dry-run", cfg, data, model), 2, "%s",
                 o);
    cr_expect(strstr(o, said), "--dry-run did not say \"%s\":\n%s", said, o);
    free(o);
    cr_assert_eq(run(&o, "config check %s " TINY, cfg), 0, "%s", o);
    free(o);

    snprintf(cfg, sizeof(cfg), "%s/enough.json", dir);
    write_file(cfg, "{\"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"64M\", "
                    "\"host_bytes\": \"64M\"}}");
    cr_assert_eq(run(&o, "config check %s %s", cfg, model), 0, "%s", o);
    cr_expect(strstr(o, "# zinf train would run: 2 layers, dim 64, 2 heads, seq 32, batch 2"),
              "%s", o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s %s --dry-run", cfg, data, model), 0, "%s",
                 o);
    free(o);
    cr_assert_eq(run(&o, "train --config %s --data %s %s --steps 1", cfg, data, model), 0, "%s",
                 o);
    free(o);
}

/* zinf train --help and its page name every optimizer and scheduler the config parser takes,
 * say --lr is the optimizer's (not AdamW's alone), that on the CPU 16-bit runs keep their
 * activations and gradients in fp32, and that an option contradicting an explicit DeepSpeed
 * value is refused, not taken over it. */
Test(cli, config_help_names_every_optimizer_and_scheduler)
{
    static const char *const says[] = {"Adam", "AdamW", "Lamb", "WarmupLR", "WarmupDecayLR",
                                       "WarmupCosineLR", "OneCycle", "LRRangeTest",
                                       "the optimizer's learning rate",
                                       "activations and gradients stay fp32", "is refused"};
    static const char *const cmds[] = {"train --help", "help train"};
    for (size_t c = 0; c < ARRAY_SIZE(cmds); c++) {
        char *o;
        cr_assert_eq(run(&o, "%s", cmds[c]), 0, "%s", o);
        for (size_t k = 0; k < ARRAY_SIZE(says); k++)
            cr_expect(strstr(o, says[k]), "zinf %s does not say '%s'", cmds[c], says[k]);
        cr_expect_null(strstr(o, "AdamW learning rate"), "zinf %s: %s", cmds[c], o);
        cr_expect_null(strstr(o, "The options above take precedence."), "zinf %s: %s", cmds[c],
                       o);
        free(o);
    }
}

/*
 * test_pipeline.c - `zinf train` with pipeline stages (pipeline.stages), tensor-parallel
 * ranks (tensor_parallel.autotp_size) and sequence-parallel ranks (sequence_parallel_size),
 * started by `zinf launch` as a user would: every cut and schedule of a pipeline gives
 * bitwise the losses, gradient norms and parameter digests of one rank accumulating the same
 * micro-batches, in fp32, bf16 and fp16, offloaded to NVMe; tensor- and sequence-parallel
 * ranks (alone, with stages, with ZeRO copies: 2 x 2 x 2 on 8 ranks) give one rank's losses
 * within 1e-6 and the same bits run to run; a pipeline's saved run resumes where it stopped,
 * and in another layout (stages, copies, none) bitwise as the run that never moved; runs of
 * tensor- and sequence-parallel ranks re-cut into other such layouts, their tensors exactly;
 * the summary reports the stage and the bubble; wrong layouts are refused naming the key.
 *
 * Not here: the communicator's links (test_comm.c), ZeRO ranks (test_cli.c).
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "helpers.h"

static char *dir;

static void setup(void)
{
    dir = test_tmpdir("pipeline");
    cr_assert_not_null(dir);
}

static void teardown(void)
{
    test_leak_check();
    test_rmtree(dir);
}

TestSuite(pipeline, .init = setup, .fini = teardown, .timeout = 170);

#define run test_run_zinf

/* Under AddressSanitizer (the sanitizers' leg), the tensor- and sequence-parallel test runs
 * fewer layouts; every one runs in the normal build. */
#if defined(__SANITIZE_ADDRESS__)
#define SANITIZED 1
#else
#define SANITIZED 0
#endif
#define DATA "/usr/share/common-licenses/GPL-3"
#define STEPS 3

/* A config: `extra` inside the top object (the pipeline, ZeRO, offload), the model odd
 * (5 blocks of width 48, 6 heads), micro-batches of 2 sequences of 13 (unless train_extra,
 * added to zinf.train, says otherwise). */
static void config(char *path, size_t len, const char *name, int accum, const char *extra,
                   const char *train_extra)
{
    snprintf(path, len, "%s/%s.json", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"train_micro_batch_size_per_gpu\": 2, \"gradient_accumulation_steps\": %d, %s"
            " \"zinf\": {\"device\": \"emulated\", \"train\": {\"layers\": 5, \"dim\": 48, "
            "\"heads\": 6, %s\"seed\": 11%s}}}",
            accum, extra, strstr(train_extra, "\"seq\"") ? "" : "\"seq\": 13, ", train_extra);
    fclose(f);
}

/* Each step's loss, grad_norm and digest as the log wrote them (text: bits, not values). */
struct steps {
    char v[STEPS + 1][96];
    int n;
};

static void read_steps(const char *log, struct steps *s)
{
    FILE *f = fopen(log, "r");
    char line[1 << 14];
    cr_assert_not_null(f, "%s", log);
    memset(s, 0, sizeof(*s));
    while (fgets(line, sizeof(line), f)) {
        json_t *j = json_loads(line, 0, NULL);
        cr_assert_not_null(j, "%s: %s", log, line);
        json_t *st = json_object_get(j, "step");
        if (st && json_integer_value(st) >= 1 && json_integer_value(st) <= STEPS) {
            int k = (int)json_integer_value(st);
            char *loss = json_dumps(json_object_get(j, "loss"), JSON_ENCODE_ANY);
            char *norm = json_dumps(json_object_get(j, "grad_norm"), JSON_ENCODE_ANY);
            const char *dg = json_string_value(json_object_get(j, "digest"));
            snprintf(s->v[k], sizeof(s->v[k]), "%s %s %s", loss, norm, dg ? dg : "-");
            free(loss);
            free(norm);
            s->n = MAX(s->n, k);
        }
        json_decref(j);
    }
    fclose(f);
}

/* The summary line of a log, parsed (json_decref it). */
static json_t *summary_of(const char *log)
{
    FILE *f = fopen(log, "r");
    char line[1 << 14];
    json_t *out = NULL;
    cr_assert_not_null(f, "%s", log);
    while (fgets(line, sizeof(line), f))
        if (!strncmp(line, "{\"summary\"", 10)) {
            json_decref(out);
            out = json_loads(line, 0, NULL);
        }
    fclose(f);
    cr_assert_not_null(out, "no summary in %s", log);
    return out;
}

/* One rank (n 1) or a launch of n, STEPS steps, its log read. */
static void train(int n, const char *cfg, const char *name, const char *args, struct steps *s)
{
    char log[4096], *o;
    snprintf(log, sizeof(log), "%s/%s.jsonl", dir, name);
    int r = n == 1 ? run(&o, "train --config %s --data " DATA " --steps %d --log %s %s", cfg,
                         STEPS, log, args)
                   : run(&o, "launch -n %d -- %s train --config %s --data " DATA
                             " --steps %d --log %s %s",
                         n, getenv("ZINF_BIN"), cfg, STEPS, log, args);
    cr_assert_eq(r, 0, "%s: %s", name, o);
    free(o);
    read_steps(log, s);
    cr_assert_eq(s->n, STEPS, "%s", name);
}

static void same(const struct steps *a, const struct steps *b, const char *what)
{
    for (int k = 1; k <= STEPS; k++)
        cr_assert_str_eq(a->v[k], b->v[k], "%s, step %d", what, k);
}

/* 2 and 3 stages, balanced by parameters, uniformly and by a given cut, with 2 to 4
 * micro-batches (fewer than the stages too), and two copies of a pipeline, against one rank
 * accumulating as many. */
Test(pipeline, stages_give_one_ranks_bits_for_every_cut_and_schedule)
{
    char cfg[4096];
    struct steps one[5], got;
    for (int m = 2; m <= 4; m++) {
        char name[32];
        snprintf(name, sizeof(name), "one%d", m);
        config(cfg, sizeof(cfg), name, m, "", "");
        train(1, cfg, name, "", &one[m]);
    }
    static const struct {
        int n, M; /* ranks, micro-batches per copy */
        const char *extra, *train;
    } cases[] = {
        {2, 4, "\"pipeline\": {\"stages\": 2},", ""},
        {3, 4, "\"pipeline\": {\"stages\": 3, \"partition\": \"uniform\"},", ""},
        {3, 2, "\"pipeline\": {\"stages\": 3},", ""},
        {3, 3, "\"pipeline\": {\"stages\": 3},", ", \"pipeline_cut\": \"1,4\""},
        /* Two copies of a pipeline, ZeRO-1 over each stage's copies: 2 x 2 micro-batches. */
        {4, 2, "\"pipeline\": {\"stages\": 2}, \"zero_optimization\": {\"stage\": 1},", ""},
    };
    for (size_t c = 0; c < ARRAY_SIZE(cases); c++) {
        char name[32];
        snprintf(name, sizeof(name), "pp%zu", c);
        config(cfg, sizeof(cfg), name, cases[c].M, cases[c].extra, cases[c].train);
        train(cases[c].n, cfg, name, "", &got);
        same(&one[cases[c].n == 4 ? 4 : cases[c].M], &got, name);
    }
    /* The cut as said: stage 1 of "1,4" holds blocks 1-3, and reports its bubble. */
    char log[4096];
    snprintf(log, sizeof(log), "%s/pp3.jsonl.rank-1", dir);
    json_t *j = summary_of(log), *s = json_object_get(j, "summary");
    cr_assert_eq(json_integer_value(json_object_get(s, "pp")), 3);
    cr_assert_eq(json_integer_value(json_object_get(s, "pp_stage")), 1);
    cr_assert_eq(json_integer_value(json_object_get(s, "first_block")), 1);
    cr_assert_eq(json_integer_value(json_object_get(s, "blocks")), 3);
    double ideal = json_number_value(json_object_get(s, "pipeline_bubble_ideal"));
    cr_assert_float_eq(ideal, 2.0 / 5.0, 1e-12);
    double bubble = json_number_value(json_object_get(s, "pipeline_bubble"));
    cr_assert(bubble > 0 && bubble < 1, "bubble %g", bubble);
    cr_assert_gt(json_integer_value(json_object_get(s, "pipeline_bytes")), 0);
    json_decref(j);
}

/* Mixed precision and NVMe offload (each stage its own folder), and a resume: a pipeline
 * run saved at step 2 and resumed to STEPS gives the uninterrupted run's bits. */
Test(pipeline, bf16_fp16_offloaded_and_resumed_give_one_ranks_bits)
{
    char cfg[4096], extra[1024];
    struct steps one, got;
    static const char *const prec[] = {"bf16", "fp16"};
    for (int k = 0; k < 2; k++) {
        char name[32], tr[64];
        snprintf(tr, sizeof(tr), ", \"precision\": \"%s\"", prec[k]);
        snprintf(extra, sizeof(extra),
                 "\"zero_optimization\": {\"stage\": 1, \"offload_param\": {\"device\": "
                 "\"nvme\", \"nvme_path\": \"%s/nv1%d\"}, \"offload_optimizer\": {\"device\": "
                 "\"nvme\", \"nvme_path\": \"%s/nv1%d\"}},",
                 dir, k, dir, k);
        snprintf(name, sizeof(name), "one_%s", prec[k]);
        config(cfg, sizeof(cfg), name, 3, extra, tr);
        train(1, cfg, name, "", &one);
        snprintf(extra, sizeof(extra),
                 "\"pipeline\": {\"stages\": 3}, \"zero_optimization\": {\"stage\": 1, "
                 "\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": \"%s/nv3%d\"}, "
                 "\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s/nv3%d\"}},",
                 dir, k, dir, k);
        snprintf(name, sizeof(name), "pp_%s", prec[k]);
        config(cfg, sizeof(cfg), name, 3, extra, tr);
        train(3, cfg, name, "", &got);
        same(&one, &got, name);
        if (k) continue;
        /* Each stage keeps its own folder; a run of 2 steps, resumed to 3. */
        char path[4096], *o;
        for (int s = 0; s < 3; s++) {
            snprintf(path, sizeof(path), "%s/nv30/stage-%d-of-3", dir, s);
            cr_assert_eq(access(path, F_OK), 0, "%s", path);
        }
        struct steps a, b;
        cr_assert_eq(run(&o, "launch -n 3 -- %s train --config %s --data " DATA
                             " --steps 2 --overwrite --log %s/r1.jsonl",
                         getenv("ZINF_BIN"), cfg, dir),
                     0, "%s", o);
        free(o);
        cr_assert_eq(run(&o, "launch -n 3 -- %s train --config %s --data " DATA
                             " --steps %d --resume --log %s/r2.jsonl",
                         getenv("ZINF_BIN"), cfg, STEPS, dir),
                     0, "%s", o);
        free(o);
        snprintf(path, sizeof(path), "%s/r1.jsonl", dir);
        read_steps(path, &a);
        snprintf(path, sizeof(path), "%s/r2.jsonl", dir);
        read_steps(path, &b);
        for (int s = 1; s <= 2; s++)
            cr_assert_str_eq(a.v[s], got.v[s], "step %d", s);
        cr_assert_str_eq(b.v[STEPS], got.v[STEPS]);
        /* Stage 1 dies in the checkpoint of step 2, its step saved and the others' not yet
         * committed: the stages' checkpoints are all or none, and the resume goes to a step
         * every stage holds, then on with the uninterrupted run's bits. */
        static const char *const points[] = {"after-rename", "before-barrier"};
        for (int k2 = 0; k2 < 2; k2++) {
            char kill[64];
            snprintf(kill, sizeof(kill), "%s:1:3", points[k2]);
            setenv("ZINF_TEST_KILL_AT", kill, 1);
            int rk = run(&o, "launch -n 3 -- %s train --config %s --data " DATA
                             " --steps %d --overwrite --checkpoint-every 1",
                         getenv("ZINF_BIN"), cfg, STEPS);
            unsetenv("ZINF_TEST_KILL_AT");
            cr_assert_neq(rk, 0, "%s: %s", points[k2], o);
            free(o);
            cr_assert_eq(run(&o, "launch -n 3 -- %s train --config %s --data " DATA
                                 " --steps %d --resume --log %s/k%d.jsonl",
                             getenv("ZINF_BIN"), cfg, STEPS, dir, k2),
                         0, "%s: %s", points[k2], o);
            free(o);
            snprintf(path, sizeof(path), "%s/k%d.jsonl", dir, k2);
            read_steps(path, &b);
            cr_assert_str_eq(b.v[STEPS], got.v[STEPS], "%s", points[k2]);
        }
    }
}

/* The loss of each step of a log. */
static void losses_of(const char *name, double *loss)
{
    char log[4096];
    snprintf(log, sizeof(log), "%s/%s.jsonl", dir, name);
    FILE *f = fopen(log, "r");
    char line[1 << 14];
    cr_assert_not_null(f, "%s", log);
    while (fgets(line, sizeof(line), f)) {
        json_t *j = json_loads(line, 0, NULL);
        json_t *st = json_object_get(j, "step");
        if (st && json_integer_value(st) >= 1 && json_integer_value(st) <= STEPS)
            loss[json_integer_value(st)] = json_number_value(json_object_get(j, "loss"));
        json_decref(j);
    }
    fclose(f);
}

/* Tensor-parallel ranks: 2 and 3 (V = 256 cut unevenly), with 2 stages, and 2 copies x 2
 * stages x 2 ranks (8 ranks, ZeRO-1 over the copies), bf16 too; sequence-parallel ranks: 2
 * and 3, with 2 stages, with 2 ZeRO-2 copies: one rank's losses within 1e-6 (the sums across
 * ranks reassociate), and each layout's own bits run to run. */
Test(pipeline, tensor_and_sequence_parallel_ranks_give_one_ranks_losses_and_their_own_bits_again)
{
    char cfg[4096];
    struct steps a, b;
    double one[5][STEPS + 1], got[STEPS + 1];
    static const char *const prec[] = {"", ", \"precision\": \"bf16\""};
    for (int k = 0; k < 2; k++) {
        char name[32];
        snprintf(name, sizeof(name), "tone2_%d", k);
        config(cfg, sizeof(cfg), name, 2, "", prec[k]);
        train(1, cfg, name, "", &a);
        losses_of(name, one[k]);
    }
    config(cfg, sizeof(cfg), "tone4", 4, "", "");
    train(1, cfg, "tone4", "", &a);
    losses_of("tone4", one[2]);
    config(cfg, sizeof(cfg), "sone2", 2, "", ", \"seq\": 12");
    train(1, cfg, "sone2", "", &a);
    losses_of("sone2", one[3]);
    config(cfg, sizeof(cfg), "sone4", 4, "", ", \"seq\": 12");
    train(1, cfg, "sone4", "", &a);
    losses_of("sone4", one[4]);
    static const struct {
        int n, M, ref;
        const char *extra, *train;
    } cases[] = {
        {2, 2, 0, "\"tensor_parallel\": {\"autotp_size\": 2},", ""},
        {3, 2, 0, "\"tensor_parallel\": {\"autotp_size\": 3},", ""},
        {2, 2, 1, "\"tensor_parallel\": {\"autotp_size\": 2},", ", \"precision\": \"bf16\""},
        {4, 4, 2, "\"tensor_parallel\": {\"autotp_size\": 2}, \"pipeline\": {\"stages\": 2},", ""},
        {8, 2, 2,
         "\"tensor_parallel\": {\"autotp_size\": 2}, \"pipeline\": {\"stages\": 2}, "
         "\"zero_optimization\": {\"stage\": 1},",
         ""},
        /* Sequence-parallel ranks (Ulysses): 13 positions do not split, so 12. */
        {2, 2, 3, "\"sequence_parallel_size\": 2,", ", \"seq\": 12"},
        {3, 2, 3, "\"sequence_parallel_size\": 3,", ", \"seq\": 12"},
        {4, 4, 4, "\"sequence_parallel_size\": 2, \"pipeline\": {\"stages\": 2},", ", \"seq\": 12"},
        {4, 2, 4, "\"sequence_parallel_size\": 2, \"zero_optimization\": {\"stage\": 2},",
         ", \"seq\": 12"},
    };
    for (size_t c = 0; c < ARRAY_SIZE(cases); c++) {
        char name[32];
        if (SANITIZED && c != 0 && c != 4 && c != 5) continue; /* tp 2, 2 x 2 x 2, sp 2 */
        snprintf(name, sizeof(name), "tp%zu", c);
        config(cfg, sizeof(cfg), name, cases[c].M, cases[c].extra, cases[c].train);
        train(cases[c].n, cfg, name, "", &a);
        losses_of(name, got);
        for (int s = 1; s <= STEPS; s++)
            cr_assert(fabs(got[s] - one[cases[c].ref][s]) <= 1e-6 * fabs(one[cases[c].ref][s]),
                      "%s, step %d: %.9g against one rank's %.9g", name, s, got[s],
                      one[cases[c].ref][s]);
        if ((c != 1 && c != 4 && c != 6) || SANITIZED) continue;
        snprintf(name, sizeof(name), "tp%zu_again", c);
        train(cases[c].n, cfg, name, "", &b);
        same(&a, &b, name);
    }
}

/* A layout that cannot be is refused before anything runs, naming what to change. */
Test(pipeline, wrong_layouts_are_refused_naming_the_key)
{
    char cfg[4096], *o;
    static const struct {
        int n;
        const char *extra, *train, *want;
    } cases[] = {
        {2, "\"pipeline\": {\"stages\": 3},", "",
         "pipeline.stages 3 = 3 ranks per copy of the model; use -n 3, 6, 9..."},
        {2, "\"pipeline\": {\"stages\": 2}, \"zero_optimization\": {\"stage\": 2},", "",
         "zero_optimization.stage 2 with pipeline.stages 2"},
        {2, "\"pipeline\": {\"stages\": 2},", ", \"pipeline_cut\": \"5\"",
         "zinf.train.pipeline_cut \"5\""},
        {3, "\"pipeline\": {\"stages\": 3},", ", \"pipeline_cut\": \"2\"",
         "3 stages need 2 block numbers"},
        {2, "\"pipeline\": {\"stages\": 2, \"partition\": \"type:Block\"},", "",
         "pipeline.partition"},
        {4, "\"tensor_parallel\": {\"autotp_size\": 4},", "",
         "tensor_parallel.autotp_size 4: "},
        {3, "\"tensor_parallel\": {\"autotp_size\": 2},", "",
         "tensor_parallel.autotp_size 2 = 2 ranks per copy of the model; use -n 2, 4, 6..."},
        {2, "\"sequence_parallel_size\": 2,", "", "sequence_parallel_size 2: "},
        {4, "\"sequence_parallel_size\": 2, \"tensor_parallel\": {\"autotp_size\": 2},", "",
         "both cut the heads"},
    };
    for (size_t c = 0; c < ARRAY_SIZE(cases); c++) {
        config(cfg, sizeof(cfg), "bad", 2, cases[c].extra, cases[c].train);
        int r = run(&o, "launch -n %d -- %s train --config %s --data " DATA " --steps 1",
                    cases[c].n, getenv("ZINF_BIN"), cfg);
        cr_assert_neq(r, 0, "case %zu: %s", c, o);
        cr_assert(strstr(o, cases[c].want), "case %zu: no '%s' in: %s", c, cases[c].want, o);
        free(o);
    }
    /* The ranks' own check, where no launcher checked first (zinf train behind a shell). */
    config(cfg, sizeof(cfg), "bad", 2, "\"pipeline\": {\"stages\": 3},", "");
    cr_assert_neq(run(&o, "launch -n 2 -- sh -c 'exec \"$0\" \"$@\"' %s train --config %s --data "
                          DATA " --steps 1",
                      getenv("ZINF_BIN"), cfg),
                  0);
    cr_assert(strstr(o, "start a multiple of 3 ranks") && !strstr(o, "does not fit"), "%s", o);
    free(o);
    /* More stages than blocks. */
    config(cfg, sizeof(cfg), "bad", 2, "\"pipeline\": {\"stages\": 6},", "");
    cr_assert_neq(run(&o, "launch -n 6 -- %s train --config %s --data " DATA " --steps 1",
                      getenv("ZINF_BIN"), cfg),
                  0);
    cr_assert(strstr(o, "the model has 5 blocks, and each stage needs one"), "%s", o);
    free(o);
    /* What needs the whole model on one rank says so. */
    config(cfg, sizeof(cfg), "bad", 2, "\"pipeline\": {\"stages\": 2},", "");
    cr_assert_neq(run(&o, "launch -n 2 -- %s train --config %s --data " DATA
                          " --steps 1 --eval-every 1",
                     getenv("ZINF_BIN"), cfg),
                 0, "%s", o);
    cr_assert(strstr(o, "--eval-every: each of the 2 pipeline stages holds its own part"), "%s",
              o);
    free(o);
}

/* ---- another user against a running pipeline ----------------------------------------- */

/* Every step's loss in a log, in order, as text (the bits): how many. */
static int all_losses(const char *log, char (*loss)[64], int max)
{
    FILE *f = fopen(log, "r");
    char line[1 << 14];
    int n = 0;
    cr_assert_not_null(f, "%s", log);
    while (n < max && fgets(line, sizeof(line), f)) {
        json_t *j = json_loads(line, 0, NULL);
        if (j && json_object_get(j, "step") && json_object_get(j, "loss")) {
            char *v = json_dumps(json_object_get(j, "loss"), JSON_ENCODE_ANY);
            snprintf(loss[n++], 64, "%s", v);
            free(v);
        }
        json_decref(j);
    }
    fclose(f);
    return n;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    char *buf = calloc(1, 1 << 16);
    cr_assert_not_null(buf);
    if (f) {
        size_t n = fread(buf, 1, (1 << 16) - 1, f);
        buf[n] = 0;
        fclose(f);
    }
    return buf;
}

/* A 2-stage pipeline run as root while uid 65534 (setpriv) watches /dev/shm: it opens
 * every entry of the job to read and to write, creates the names the job takes next (the
 * pipeline's links under the tag it saw), reads the ranks' environment (the job's secret),
 * memory and files through /proc, and connects to any socket naming the job. Each is
 * refused, and the run ends with the bits of one nobody disturbed. */
Test(pipeline, second_user_reaches_nothing_of_a_running_pipeline)
{
    const char *intruder = getenv("ZINF_SHM_INTRUDER");
    if (geteuid() != 0) cr_skip_test("needs root, to run a job another user can be kept from");
    if (system("command -v setpriv >/dev/null 2>&1") != 0) cr_skip_test("no setpriv");
    cr_assert_not_null(intruder);
    char cfg[4096], a[4096], b[4096], out[4096], name[64], *o;
    config(cfg, sizeof(cfg), "guard", 2, "\"pipeline\": {\"stages\": 2},", "");
    snprintf(a, sizeof(a), "%s/alone.jsonl", dir);
    snprintf(b, sizeof(b), "%s/watched.jsonl", dir);
    snprintf(out, sizeof(out), "%s/intruder.out", dir);
    snprintf(name, sizeof(name), "guard-%d", (int)getpid());
#define GUARD_STEPS 40
    cr_assert_eq(run(&o, "launch -n 2 -- %s train --config %s --data " DATA " --steps %d --log %s",
                     getenv("ZINF_BIN"), cfg, GUARD_STEPS, a),
                 0, "%s", o);
    free(o);

    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0) _exit(127);
        execlp("setpriv", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
               intruder, name, "2", "8", (char *)NULL);
        _exit(127);
    }
    char *said = NULL;
    for (int i = 0; i < 500; i++) { /* until it watches /dev/shm */
        free(said);
        said = slurp(out);
        if (strstr(said, "watching")) break;
        usleep(10000);
    }
    cr_assert(strstr(said, "watching /dev/shm as uid 65534"), "%s", said);
    free(said);
    int r = run(&o, "launch -n 2 --name %s -- %s train --config %s --data " DATA
                    " --steps %d --log %s",
                name, getenv("ZINF_BIN"), cfg, GUARD_STEPS, b);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    said = slurp(out);
    cr_assert_eq(r, 0, "the job failed beside another user: %s\nthe other user: %s", o, said);
    free(o);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 127)
        cr_skip_test("uid 65534 cannot run %s (its folders are closed to others)", intruder);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %#x: %s", st, said);
    /* It tried what it says it tried: the job's lock and at least one segment, the ranks. */
    char want[128];
    snprintf(want, sizeof(want), "refused read-write /dev/shm/zinf-job-%s: ", name);
    cr_assert(strstr(said, want), "%s", said);
    snprintf(want, sizeof(want), "refused read-write /dev/shm/zinf-comm-%s.", name);
    cr_assert(strstr(said, want), "%s", said);
    cr_assert(strstr(said, "/environ: Permission denied") && strstr(said, "/mem: ") &&
                  strstr(said, "list /proc/") && !strstr(said, "OPENED"),
              "%s", said);
    free(said);

    static char la[GUARD_STEPS + 1][64], lb[GUARD_STEPS + 1][64];
    int na = all_losses(a, la, GUARD_STEPS + 1), nb = all_losses(b, lb, GUARD_STEPS + 1);
    cr_assert_eq(na, GUARD_STEPS);
    cr_assert_eq(nb, na);
    for (int k = 0; k < na; k++)
        cr_assert_str_eq(la[k], lb[k], "step %d", k + 1);
    /* Nothing of the job's, nor of the other user's, is left in /dev/shm. */
    DIR *d = opendir("/dev/shm");
    struct dirent *de;
    while (d && (de = readdir(d)))
        cr_assert(!strstr(de->d_name, name), "/dev/shm/%s is left", de->d_name);
    if (d) closedir(d);
}

/* ---- resuming in another layout ------------------------------------------------------ */

/* A config of `stages` pipeline stages (1: none), ZeRO-1, offloaded to NVMe under swap. */
static void layout_config(char *cfg, size_t len, const char *name, int stages, int accum,
                          const char *swap, const char *prec)
{
    char extra[9000], pipe[64] = "", tr[64] = "";
    if (stages > 1) snprintf(pipe, sizeof(pipe), "\"pipeline\": {\"stages\": %d}, ", stages);
    if (prec) snprintf(tr, sizeof(tr), ", \"precision\": \"%s\"", prec);
    snprintf(extra, sizeof(extra),
             "%s\"zero_optimization\": {\"stage\": 1, \"offload_param\": {\"device\": "
             "\"nvme\", \"nvme_path\": \"%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", "
             "\"nvme_path\": \"%s\"}},",
             pipe, swap, swap);
    config(cfg, len, name, accum, extra, tr);
}

/* n ranks (1: no launch) of cfg to `steps`, args after; its exit status, output in *o. */
static int leg(char **o, int n, const char *cfg, int steps, const char *log, const char *args)
{
    return n == 1 ? run(o, "train --config %s --data " DATA " --steps %d --log %s %s", cfg, steps,
                        log, args)
                  : run(o, "launch -n %d -- %s train --config %s --data " DATA
                           " --steps %d --log %s %s",
                        n, getenv("ZINF_BIN"), cfg, steps, log, args);
}

/* A run saved at step 2 in one layout and resumed to step 3 in another re-cuts the saved
 * tensors (each stage's by its names, each ZeRO rank's shards) and gives the uninterrupted
 * run's bits: the global batch is 2 micro-batches in every layout. */
Test(pipeline, resumed_in_another_layout_gives_the_uninterrupted_runs_bits)
{
    static const struct {
        int an, ap, am; /* saved by: ranks, stages, micro-batches per copy */
        int bn, bp, bm; /* resumed by */
        const char *prec;
    } cases[] = {
        {3, 3, 2, 2, 2, 2, NULL},   /* 3 stages -> 2 */
        {4, 2, 1, 1, 1, 2, NULL},   /* 2 stages x 2 copies (ZeRO-1) -> one rank */
        {1, 1, 2, 2, 2, 2, "bf16"}, /* one rank -> 2 stages */
        {4, 2, 1, 3, 3, 2, NULL},   /* 2 stages x 2 copies -> 3 stages */
        {3, 3, 2, 4, 2, 1, NULL},   /* 3 stages -> 2 stages x 2 copies (into shards) */
    };
    char cfg[4096], swap[4096], log[4096], *o;
    struct steps ref[2], a, b;
    for (int k = 0; k < 2; k++) { /* the uninterrupted runs: one rank of 2, fp32 and bf16 */
        snprintf(swap, sizeof(swap), "%s/ref%d", dir, k);
        snprintf(log, sizeof(log), "%s/ref%d.jsonl", dir, k);
        layout_config(cfg, sizeof(cfg), "ref", 1, 2, swap, k ? "bf16" : NULL);
        cr_assert_eq(leg(&o, 1, cfg, STEPS, log, ""), 0, "%s", o);
        free(o);
        read_steps(log, &ref[k]);
        cr_assert_eq(ref[k].n, STEPS);
    }
    for (size_t c = 0; c < ARRAY_SIZE(cases); c++) {
        const struct steps *want = &ref[cases[c].prec != NULL];
        snprintf(swap, sizeof(swap), "%s/cut%zu", dir, c);
        snprintf(log, sizeof(log), "%s/cut%zu-a.jsonl", dir, c);
        layout_config(cfg, sizeof(cfg), "a", cases[c].ap, cases[c].am, swap, cases[c].prec);
        cr_assert_eq(leg(&o, cases[c].an, cfg, 2, log, ""), 0, "case %zu: %s", c, o);
        free(o);
        read_steps(log, &a);
        for (int s = 1; s <= 2; s++)
            cr_assert_str_eq(a.v[s], want->v[s], "case %zu, step %d", c, s);
        snprintf(log, sizeof(log), "%s/cut%zu-b.jsonl", dir, c);
        layout_config(cfg, sizeof(cfg), "b", cases[c].bp, cases[c].bm, swap, cases[c].prec);
        cr_assert_eq(leg(&o, cases[c].bn, cfg, STEPS, log, "--resume"), 0, "case %zu: %s", c, o);
        free(o);
        read_steps(log, &b);
        cr_assert_eq(b.n, STEPS, "case %zu", c);
        cr_assert_str_eq(b.v[STEPS], want->v[STEPS], "case %zu: %d ranks of %d stages resumed by "
                         "%d of %d", c, cases[c].an, cases[c].ap, cases[c].bn, cases[c].bp);
    }
}

/* A saved pipeline run is a saved run: a new run over it in any layout is refused, naming
 * it; with a stage's folder gone it is named as not whole; --overwrite clears it. */
Test(pipeline, a_saved_pipeline_run_is_refused_named_when_partial_and_overwritten)
{
    char cfg1[4096], cfg2[4096], swap[4096], log[4096], path[4200], *o;
    snprintf(swap, sizeof(swap), "%s/saved", dir);
    snprintf(log, sizeof(log), "%s/saved.jsonl", dir);
    layout_config(cfg1, sizeof(cfg1), "one", 1, 2, swap, NULL);
    layout_config(cfg2, sizeof(cfg2), "two", 2, 2, swap, NULL);
    cr_assert_eq(leg(&o, 2, cfg2, 1, log, ""), 0, "%s", o);
    free(o);
    /* A new run of one rank over it. */
    cr_assert_neq(leg(&o, 1, cfg1, 1, log, ""), 0, "%s", o);
    cr_assert(strstr(o, "holds a saved run (by 2 pipeline stages)") && strstr(o, swap) &&
                  strstr(o, "--overwrite"),
              "%s", o);
    free(o);
    /* Stage 1's folder gone: a resume, in any layout, names what is missing. */
    snprintf(path, sizeof(path), "%s/stage-1-of-2", swap);
    test_rmtree(strdup(path));
    char want[9000];
    snprintf(want, sizeof(want),
             "the saved run of 2 pipeline stages in %s is not whole: stage 1 (%s) holds no "
             "saved run",
             swap, path);
    for (int n = 1; n <= 2; n++) {
        cr_assert_neq(leg(&o, n, n == 1 ? cfg1 : cfg2, 2, log, "--resume"), 0, "%s", o);
        cr_assert(strstr(o, want), "%d rank%s: no '%s' in: %s", n, n > 1 ? "s" : "", want, o);
        free(o);
    }
    cr_assert_neq(leg(&o, 1, cfg1, 1, log, ""), 0, "%s", o);
    cr_assert(strstr(o, "holds a saved run (by 2 pipeline stages, not whole)"), "%s", o);
    free(o);
    /* --overwrite removes it, folders and all, and says so. */
    cr_assert_eq(leg(&o, 1, cfg1, 1, log, "--overwrite"), 0, "%s", o);
    snprintf(want, sizeof(want), "--overwrite: removed the run saved by 2 pipeline stages in "
                                 "%s/stage-*-of-2", swap);
    cr_assert(strstr(o, want), "no '%s' in: %s", want, o);
    free(o);
    snprintf(path, sizeof(path), "%s/stage-0-of-2", swap);
    cr_assert_neq(access(path, F_OK), 0, "--overwrite left %s", path);
    /* And the other way: 2 stages over one rank's run, refused, then started over. */
    cr_assert_neq(leg(&o, 2, cfg2, 1, log, ""), 0, "%s", o);
    cr_assert(strstr(o, "holds a saved run (by one rank)"), "%s", o);
    free(o);
    cr_assert_eq(leg(&o, 2, cfg2, 1, log, "--overwrite"), 0, "%s", o);
    cr_assert(strstr(o, "--overwrite: removed the run saved by one rank in "), "%s", o);
    free(o);
    snprintf(path, sizeof(path), "%s/zinf-manifest.json", swap);
    cr_assert_neq(access(path, F_OK), 0, "--overwrite left %s", path);
}

/* Each tensor-parallel rank's engine holds its slices only: with budgets (no NVMe) below
 * what one rank's model needs, one rank is refused naming the budget, and 2 tensor-parallel
 * ranks with the same budgets each train it. */
Test(pipeline, tensor_parallel_ranks_train_a_model_one_ranks_budgets_cannot_hold)
{
    char one[4096], two[4096], log[4096], *o;
    const char *body = "\"train_micro_batch_size_per_gpu\": 2, \"zinf\": {\"device\": "
                       "\"emulated\", \"device_bytes\": \"4600K\", \"host_bytes\": \"4600K\", "
                       "\"train\": {\"layers\": 2, \"dim\": 128, \"heads\": 4, \"seq\": 16}}}";
    snprintf(one, sizeof(one), "%s/budget1.json", dir);
    snprintf(two, sizeof(two), "%s/budget2.json", dir);
    FILE *f = fopen(one, "w");
    cr_assert_not_null(f);
    fprintf(f, "{%s", body);
    fclose(f);
    f = fopen(two, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"tensor_parallel\": {\"autotp_size\": 2}, %s", body);
    fclose(f);
    int r = run(&o, "train --config %s --data " DATA " --steps 1 --precision fp32", one);
    cr_expect_eq(r, 2, "%s", o);
    cr_expect(strstr(o, "zinf.device_bytes: 4.49 MiB is too small"), "%s", o);
    free(o);
    snprintf(log, sizeof(log), "%s/budget2.jsonl", dir);
    r = run(&o, "launch -n 2 -- %s train --config %s --data " DATA
                " --steps 2 --precision fp32 --log %s",
            getenv("ZINF_BIN"), two, log);
    cr_assert_eq(r, 0, "%s", o);
    free(o);
    json_t *all = summary_of(log), *s = json_object_get(all, "summary");
    cr_assert_not_null(s);
    json_int_t need = json_integer_value(json_object_get(s, "min_device_bytes"));
    json_int_t peak = json_integer_value(json_object_get(json_object_get(s, "device"),
                                                        "peak_bytes"));
    cr_expect(need > 0 && need <= 4600 * 1024, "a rank needs %lld bytes", (long long)need);
    cr_expect(peak > 0 && peak <= 4600 * 1024, "a rank's device peak %lld", (long long)peak);
    json_decref(all);
}

/* ---- resuming across tensor- and sequence-parallel layouts -------------------------- */

/* A config of layout `par` (the keys, "" for none), ZeRO-1 offloaded to NVMe under swap,
 * sequences of 12 (sequence parallel splits them). */
static void par_config(char *cfg, size_t len, const char *name, const char *par, int accum,
                       const char *swap)
{
    char extra[9000];
    snprintf(extra, sizeof(extra),
             "%s\"zero_optimization\": {\"stage\": 1, \"offload_param\": {\"device\": "
             "\"nvme\", \"nvme_path\": \"%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", "
             "\"nvme_path\": \"%s\"}},",
             par, swap, swap);
    config(cfg, len, name, accum, extra, ", \"seq\": 12");
}

#define TP2 "\"tensor_parallel\": {\"autotp_size\": 2}, "
#define SP2 "\"sequence_parallel_size\": 2, "
#define PP2 "\"pipeline\": {\"stages\": 2}, "

/* leg() of layout par under dir/swap, its log dir/name.jsonl read into s; must succeed, its
 * last step `steps` (a resume to the step it re-cuts at runs none). */
static void par_leg(const char *name, int n, const char *par, int accum, const char *swap,
                    int steps, const char *args, struct steps *s)
{
    char cfg[4096], sw[4096], log[4096], *o;
    snprintf(sw, sizeof(sw), "%s/%s", dir, swap);
    snprintf(log, sizeof(log), "%s/%s.jsonl", dir, name);
    par_config(cfg, sizeof(cfg), name, par, accum, sw);
    cr_assert_eq(leg(&o, n, cfg, steps, log, args), 0, "%s: %s", name, o);
    free(o);
    read_steps(log, s);
    cr_assert(s->n == steps || (s->n == 0 && strstr(args, "--resume")), "%s: %d steps", name,
              s->n);
}

/* Step STEPS's loss of log `name` within 1e-6 of ref's (read_steps' text: loss first). */
static void near(const struct steps *got, const struct steps *ref, const char *what)
{
    double a = strtod(got->v[STEPS], NULL), b = strtod(ref->v[STEPS], NULL);
    cr_assert(b > 0 && fabs(a - b) <= 1e-6 * fabs(b), "%s: loss %.9g against %.9g", what, a, b);
}

/* Runs saved at step 2 by tensor- or sequence-parallel ranks resume in another layout. A
 * re-cut alone (a resume to the step it re-cuts at) is checkpointed, so chains of them run
 * few steps: tp 2 -> sp 2 -> one rank (the newest of the runs saved at step 2) -> tp 2 again
 * gives the bits of the tp 2 run that never moved (every parameter, m and v put back whole
 * and cut again exactly); tp 2 -> one rank and 2 stages x tp 2 -> 2 copies x 2 stages (into
 * ZeRO-1 shards) give the loss of the run that kept tp 2 within 1e-6 (the sums across ranks
 * reassociate). The global batch is 2 micro-batches throughout. Then the refusals: a layout
 * that cannot cut the model (6 heads over 4 tp ranks) is refused naming the key, a tp run
 * missing a tp rank's folder is named as not whole, and neither deletes anything saved. */
Test(pipeline, recut_across_tensor_and_sequence_parallel_layouts_and_its_refusals)
{
    struct steps tp, a, b;
    char cfg[4096], sw[4096], log[4096], path[4200], want[9000], *o;
    par_leg("ref_tp", 2, TP2, 2, "ref_tp", STEPS, "", &tp);
    par_leg("x_tp", 2, TP2, 2, "x", 2, "", &a);
    for (int s = 1; s <= 2; s++)
        cr_assert_str_eq(a.v[s], tp.v[s], "step %d", s);
    par_leg("x_sp", 2, SP2, 2, "x", 2, "--resume", &a);
    par_leg("x_one", 1, "", 2, "x", 2, "--resume", &a);
    for (int r = 0; r < 2; r++) {
        snprintf(path, sizeof(path), "%s/x/tp-%d-of-2", dir, r);
        test_rmtree(strdup(path));
        snprintf(path, sizeof(path), "%s/x/sp-%d-of-2", dir, r);
        test_rmtree(strdup(path));
    }
    par_leg("x_tp_again", 2, TP2, 2, "x", STEPS, "--resume", &b);
    cr_assert_str_eq(b.v[STEPS], tp.v[STEPS], "tp 2 -> sp 2 -> one rank -> tp 2");
    par_leg("y_tp", 2, TP2, 2, "y", 2, "", &a);
    par_leg("y_one", 1, "", 2, "y", STEPS, "--resume", &b);
    near(&b, &tp, "tp 2 -> one rank");
    /* The 1 copy x 2 stages x tp 2 -> 2 copies x 2 stages, 4 ranks each. Stages
     * give the bits of the ranks without them: tp 2's run is the one that kept the layout. */
    par_leg("w_pt", 4, TP2 PP2, 2, "w", 2, "", &a);
    for (int s = 1; s <= 2; s++)
        cr_assert_str_eq(a.v[s], tp.v[s], "2 stages x tp 2, step %d", s);
    par_leg("w_pp", 4, PP2, 1, "w", STEPS, "--resume", &b);
    near(&b, &tp, "2 stages x tp 2 -> 2 copies x 2 stages");
    /* The refusals, on a tp 2 run of one step. */
    par_leg("z_tp", 2, TP2, 2, "z", 1, "", &a);
    snprintf(sw, sizeof(sw), "%s/z", dir);
    snprintf(log, sizeof(log), "%s/bad.jsonl", dir);
    par_config(cfg, sizeof(cfg), "tp4", "\"tensor_parallel\": {\"autotp_size\": 4}, ", 2, sw);
    cr_assert_neq(leg(&o, 4, cfg, STEPS, log, "--resume"), 0, "%s", o);
    cr_assert(strstr(o, "tensor_parallel.autotp_size 4: "), "%s", o);
    free(o);
    snprintf(path, sizeof(path), "%s/z/tp-1-of-2", dir);
    test_rmtree(strdup(path));
    snprintf(want, sizeof(want),
             "the saved run of 2 tensor-parallel ranks in %s is not whole: tp rank 1 (%s) "
             "holds no saved run",
             sw, path);
    par_config(cfg, sizeof(cfg), "one", "", 2, sw);
    cr_assert_neq(leg(&o, 1, cfg, STEPS, log, "--resume"), 0, "%s", o);
    cr_assert(strstr(o, want), "no '%s' in: %s", want, o);
    free(o);
    snprintf(path, sizeof(path), "%s/z/tp-0-of-2/zinf-manifest.json", dir);
    cr_assert_eq(access(path, F_OK), 0, "the refusals removed %s", path);
}

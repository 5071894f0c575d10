/*
 * test_serve_base.c - LoRA fine-tunes of two users on one read-only base through `zinf
 * serve` (zinf.base_job, zinf job share, zinf_connect_readonly): three jobs, two of root's
 * and one of uid 65534's, train on one shared base; each trains (its loss falls) with the
 * losses of the same run on a base of its own, the base's bytes are as they were, and the
 * daemon reads the shared base from NVMe less than it reads three separate bases (one copy
 * in its memory for all). Uid 65534 can neither change the base (every write, flush,
 * unregister, zero and dirty release is -EROFS), nor attach to it read-write, nor reach
 * root's adapter job; a base not shared is refused naming the job and the key.
 *
 * The daemon and the trainers are `$ZINF_BIN` processes; uid 65534's through setpriv, and
 * its calls on the base from a forked child of this process. Needs root (skipped otherwise).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "service/client.h"
#include "service/proto.h"
#include "train/gpt.h"
#include "train/trainer.h"
#include "zinf.h"

#define NOBODY 65534
/* A model whose base (238 KiB of fp32 weights) the small daemon's device tier holds beside the
 * sets the three jobs pin: one copy read from NVMe for all, against a copy each (bench/
 * lora_base.sh measures a base that does not fit). */
#define MODEL "--layers 4 --dim 32 --heads 2 --seq 16 --batch 4"
#define LORA "--lora-rank 4 --lora-alpha 8 --lora-targets c_attn,c_proj,c_fc --lr 1e-2"
#define STEPS 20

static char dir[64], sock[128];

static void setup(void)
{
    strcpy(dir, "/tmp/zinf-base-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    cr_assert_eq(chmod(dir, 0711), 0); /* uid 65534 reaches the socket and the data */
    snprintf(sock, sizeof(sock), "%s/zinf.sock", dir);
}

static void teardown(void)
{
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "%s serve --stop --socket %s >/dev/null 2>&1", getenv("ZINF_BIN"),
             sock);
    if (system(cmd) != 0) { /* not running */
    }
    test_rmtree(strdup(dir));
}

TestSuite(serve_base, .init = setup, .fini = teardown, .timeout = 240);

static void put(const char *name, const char *text)
{
    char p[256];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    cr_assert_not_null(f, "%s", p);
    fputs(text, f);
    fclose(f);
    cr_assert_eq(chmod(p, 0644), 0);
}

/* The daemon's config: device and host budgets, swap in dir/swap. */
static void serve_cfg(const char *name, const char *device, const char *host)
{
    char text[1024];
    snprintf(text, sizeof(text),
             "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
             "\"%s/swap\"}}, \"aio\": {\"block_size\": 65536}, \"zinf\": {\"device\": "
             "\"emulated\", \"device_bytes\": \"%s\", \"host_bytes\": \"%s\"}}",
             dir, device, host);
    put(name, text);
}

/* A trainer's config: through the daemon, with the base job base ("": none). */
static void train_cfg(const char *name, const char *base)
{
    char text[1024];
    snprintf(text, sizeof(text),
             "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\"}, "
             "\"offload_optimizer\": {\"device\": \"nvme\"}}, \"zinf\": {\"connect\": \"%s\"%s%s%s}}",
             sock, base[0] ? ", \"base_job\": \"" : "", base, base[0] ? "\"" : "");
    put(name, text);
}

static void zinf_ok(const char *fmt, const char *a, const char *b)
{
    char *o;
    char args[1024];
    snprintf(args, sizeof(args), fmt, a, b);
    int rc = test_run_zinf(&o, "%s", args);
    cr_assert_eq(rc, 0, "zinf %s: %s", args, o);
    free(o);
}

/* NVMe bytes the daemon read for the jobs whose names start with "base". */
static uint64_t base_reads(void)
{
    struct service_job_status *js;
    size_t n;
    cr_assert_eq(service_status(sock, &js, &n), 0);
    uint64_t sum = 0;
    for (size_t i = 0; i < n; i++)
        if (!strncmp(js[i].name, "base", 4)) sum += js[i].stats.nvme_bytes_read;
    free(js);
    return sum;
}

/* Three fine-tunes at once, on bases b[0..2]: root's jobs j[0] and j[1], uid 65534's j[2],
 * each with seed k + 1; losses[k][s] their step s + 1's. */
static void three(const char *const j[3], const char *const cfg[3], float losses[3][STEPS])
{
    char script[4096];
    const char *z = getenv("ZINF_BIN");
    int n = 0;
    for (int k = 0; k < 3; k++)
        n += snprintf(script + n, sizeof(script) - (size_t)n,
                      "(%s %s train --config %s/%s --job %s --data %s/data.txt " MODEL " " LORA
                      " --steps %d --seed %d > %s/%s.out 2>&1; echo $? > %s/%s.rc) & ",
                      k == 2 ? "setpriv --reuid=65534 --regid=65534 --clear-groups" : "", z, dir,
                      cfg[k], j[k], dir, STEPS, k + 1, dir, j[k], dir, j[k]);
    snprintf(script + n, sizeof(script) - (size_t)n, "wait");
    cr_assert_eq(system(script), 0);
    for (int k = 0; k < 3; k++) {
        char p[256], line[512];
        snprintf(p, sizeof(p), "%s/%s.rc", dir, j[k]);
        FILE *f = fopen(p, "r");
        int rc = -1;
        cr_assert(f && fscanf(f, "%d", &rc) == 1);
        fclose(f);
        snprintf(p, sizeof(p), "%s/%s.out", dir, j[k]);
        f = fopen(p, "r");
        cr_assert_not_null(f);
        int s = 0;
        char all[16384] = "";
        while (fgets(line, sizeof(line), f)) {
            int step;
            float loss;
            if (strlen(all) + strlen(line) < sizeof(all)) strcat(all, line);
            if (sscanf(line, " %d %f", &step, &loss) == 2 && step == s + 1 && s < STEPS)
                losses[k][s++] = loss;
        }
        fclose(f);
        cr_assert_eq(rc, 0, "job %s exited %d:\n%s", j[k], rc, all);
        cr_assert_eq(s, STEPS, "job %s: %d steps printed:\n%s", j[k], s, all);
    }
}

/* A hash of the base's fp32 weights, read through a read-only session. */
static uint64_t base_hash(void)
{
    struct trainer_opts o;
    trainer_opts_defaults(&o);
    struct gpt_config gc = o.model;
    gc.L = 4;
    gc.C = 32;
    gc.NH = 2;
    gc.maxT = 16;
    int n = gpt_layout(&gc, NULL, 0);
    struct gpt_tensor_desc *d = calloc((size_t)n, sizeof(*d));
    cr_assert_not_null(d);
    gpt_layout(&gc, d, (size_t)n);
    zinf_engine *e;
    cr_assert_eq(zinf_connect_readonly(sock, "base", &e), 0);
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) {
        char name[96];
        zinf_tensor t;
        snprintf(name, sizeof(name), "p.%s", d[i].name);
        cr_assert_eq(zinf_lookup(e, name, &t), 0, "%s", name);
        unsigned char *b = malloc(d[i].numel * 4);
        cr_assert_eq(zinf_read(e, t, 0, b, d[i].numel * 4), 0, "%s", name);
        for (size_t k = 0; k < d[i].numel * 4; k++)
            h = (h ^ b[k]) * 1099511628211ull;
        free(b);
    }
    zinf_close(e);
    free(d);
    return h;
}

/* What uid 65534 may and may not do to the base and to root's adapter job; the exit status
 * is the first check that failed (0: none). */
static int as_nobody(void)
{
    if (setgroups(0, NULL) != 0 || setresgid(NOBODY, NOBODY, NOBODY) != 0 ||
        setresuid(NOBODY, NOBODY, NOBODY) != 0)
        return 90;
    zinf_engine *e;
    zinf_tensor t, u;
    void *p;
    if (zinf_connect(sock, "base", &e) != -EACCES) return 1; /* read-write: never */
    if (zinf_connect(sock, "sa", &e) != -EACCES) return 2;   /* root's adapters */
    if (zinf_connect_readonly(sock, "sa", &e) != -EACCES) return 3; /* not shared */
    if (zinf_connect_readonly(sock, "base", &e) != 0) return 4;
    if (zinf_lookup(e, "p.wpe", &t) != 0) return 5;
    float x = 1.0f;
    if (zinf_write(e, t, 0, &x, sizeof(x)) != -EROFS) return 6;
    if (zinf_zero(e, t) != -EROFS) return 7;
    if (zinf_unregister(e, t) != -EROFS) return 8;
    if (zinf_register(e, "mine", 64, ZINF_TIER_HOST, &u) != -EROFS) return 9;
    if (zinf_flush(e) != -EROFS) return 10;
    int r = zinf_fetch(e, t, ZINF_TIER_HOST, &p);
    if (r != 0) {
        fprintf(stderr, "fetch: %s\n", zinf_strerror(r));
        return 11;
    }
    if (zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY) != -EROFS) return 12;
    if (zinf_release(e, t, ZINF_TIER_HOST, 0) != 0) return 13;
    if (zinf_read(e, t, 0, &x, sizeof(x)) != 0) return 14;
    zinf_close(e);
    /* Nor can it take the grant back. */
    if (service_manage_flags(sock, PROTO_JOB_SHARE, "base", 0) != -EACCES) return 15;
    return 0;
}

Test(serve_base, three_fine_tunes_of_two_users_on_one_read_only_base)
{
    struct group *g = getgrgid(NOBODY);
    if (geteuid() != 0 || !g || system("command -v setpriv >/dev/null 2>&1") != 0)
        cr_skip_test("needs root, group %d and setpriv to act as a second user", NOBODY);
    char text[32768];
    int n = 0;
    for (int i = 0; i < 300; i++)
        n += snprintf(text + n, sizeof(text) - (size_t)n,
                      "line %d of the text the byte model learns from.\n", i);
    put("data.txt", text);
    /* The bases are pretrained with room for their optimizer; the fine-tunes run in less. */
    serve_cfg("big.json", "1M", "1M");
    serve_cfg("small.json", "512K", "64K");
    train_cfg("plain.json", "");
    train_cfg("shared.json", "base");
    train_cfg("own1.json", "base1");
    train_cfg("own2.json", "base2");
    train_cfg("own3.json", "base3");
    char a[512], b[512];
    snprintf(a, sizeof(a), "%s/zinf.sock --config %s/big.json --group %s --log %s/serve.log", dir,
             dir, g->gr_name, dir);
    zinf_ok("serve --socket %s%s", a, "");
    static const char *const bases[] = {"base", "base1", "base2", "base3"};
    for (int i = 0; i < 4; i++) {
        snprintf(a, sizeof(a), "%s/plain.json --job %s", dir, bases[i]);
        snprintf(b, sizeof(b), "%s/data.txt " MODEL " --steps 2", dir);
        zinf_ok("train --config %s --data %s", a, b);
    }
    zinf_ok("serve --stop --socket %s%s", sock, "");
    snprintf(a, sizeof(a), "%s/zinf.sock --config %s/small.json --group %s --log %s/serve.log",
             dir, dir, g->gr_name, dir);
    zinf_ok("serve --socket %s%s", a, "");

    /* Not shared yet: uid 65534's run is refused, naming the key and the job. */
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             "setpriv --reuid=65534 --regid=65534 --clear-groups %s train --config "
             "%s/shared.json --job early --data %s/data.txt " MODEL " " LORA
             " --steps 1 > %s/early.out 2>&1",
             getenv("ZINF_BIN"), dir, dir, dir);
    int rc = system(cmd);
    cr_assert(WIFEXITED(rc) && WEXITSTATUS(rc) != 0, "an ungranted base was used");
    char p[256];
    snprintf(p, sizeof(p), "%s/early.out", dir);
    FILE *f = fopen(p, "r");
    cr_assert_not_null(f);
    size_t got = fread(text, 1, sizeof(text) - 1, f);
    text[got] = 0;
    fclose(f);
    cr_assert(strstr(text, "zinf.base_job \"base\"") && strstr(text, "not shared") &&
                  strstr(text, "zinf job share"),
              "%s", text);

    for (int i = 0; i < 4; i++)
        zinf_ok("job share %s --socket %s", bases[i], sock);
    uint64_t before = base_hash();

    float shared[3][STEPS], own[3][STEPS];
    static const char *const sj[] = {"sa", "sb", "sc"}, *const oj[] = {"oa", "ob", "oc"};
    static const char *const sc[] = {"shared.json", "shared.json", "shared.json"};
    static const char *const oc[] = {"own1.json", "own2.json", "own3.json"};
    uint64_t r0 = base_reads();
    three(sj, sc, shared);
    uint64_t r1 = base_reads();
    three(oj, oc, own);
    uint64_t r2 = base_reads();

    for (int k = 0; k < 3; k++) {
        float first = 0, last = 0;
        for (int s = 0; s < 5; s++) {
            first += shared[k][s] / 5;
            last += shared[k][STEPS - 1 - s] / 5;
        }
        cr_expect_lt(last, first - 0.02f, "job %s: the loss went from %g to %g", sj[k], first,
                     last);
        for (int s = 0; s < STEPS; s++)
            cr_expect_eq(shared[k][s], own[k][s],
                         "job %s step %d: %.4f on the shared base, %.4f on its own", sj[k],
                         s + 1, shared[k][s], own[k][s]);
    }
    cr_expect_eq(base_hash(), before, "the base changed");
    uint64_t one = r1 - r0, sep = r2 - r1;
    cr_log_info("NVMe bytes read per step: %.0f from the shared base, %.0f from three bases",
                (double)one / STEPS, (double)sep / STEPS);
    cr_expect(sep > 0 && one * 2 < sep,
              "NVMe reads of the bases: %llu shared, %llu separate",
              (unsigned long long)one, (unsigned long long)sep);

    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) _exit(as_nobody());
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "uid 65534's check %d failed",
              WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    cr_expect_eq(base_hash(), before, "the base changed");
}

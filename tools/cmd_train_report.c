/*
 * cmd_train_report.c - what `zinf train` prints and logs (cmd_train.h): the dry run's
 * decision, the start of a run (the model, the budgets, the compute, the effective settings),
 * a line per step on stdout and in the log (with its CPU time by thread, and its digest once
 * known), and the summary with the run's time and each tier's peak next to its budget. The
 * log's numbers are written so that they read back as the values the trainer had.
 *
 * Not here: the command line (cmd_train_opts.c), the run itself and the lines of its
 * checkpoints, held-out losses and samples (cmd_train.c).
 */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "cmd_train.h"
#include "common.h"
#include "train/gpt.h"
#include "train/gpt_lora.h"
#include "train/trainer.h"
#include "train/weights.h"

/* communication_data_type as DeepSpeed spells it. */
static const char *comm_wire_name(int w)
{
    return w == 1 ? "fp16" : w == 2 ? "bf16" : "fp32";
}

static const char *const tier_names[] = {"device", "host", "nvme"};

/* Each line of an error text (weights_open's "PATH: what" lines), said after prefix. */
void cmd_train_say_lines(const char *prefix, const char *text)
{
    for (const char *p = text, *nl; *p; p = nl + 1) {
        nl = strchr(p, '\n');
        fprintf(stderr, "zinf train: %s%.*s\n", prefix, nl ? (int)(nl - p) : (int)strlen(p), p);
        if (!nl) break;
    }
}

/* ,"key":v in the log, written so that it reads back as the same value: %.9g for a float,
 * %.17g for a double; null where it is not finite (JSON has no NaN or infinity). */
void cmd_train_json_num(FILE *f, const char *key, double v, bool is_float)
{
    fprintf(f, ",\"%s\":", key);
    if (!isfinite(v))
        fputs("null", f);
    else
        fprintf(f, is_float ? "%.9g" : "%.17g", v);
}

/* What a failure leaves saved: the last checkpoint, or nothing before the first. */
void cmd_train_say_kept(const struct trainer_summary *sum, const char *when)
{
    if (sum->checkpoint_step < 0)
        fprintf(stderr, "zinf train: nothing of this run is saved (zinf.train.checkpoint_start "
                        "is false, and no checkpoint was made)\n");
    else
        fprintf(stderr,
                "zinf train: the state of step %d (the last checkpoint) is kept; "
                "--resume continues from there%s\n",
                sum->checkpoint_step, when);
}

void cmd_train_held_put(FILE *log, struct held_line *h, bool have, uint64_t digest)
{
    if (!h->line) return;
    fputs(h->line, log);
    if (have)
        fprintf(log, ",\"digest\":\"%016llx\"}\n", (unsigned long long)digest);
    else
        fprintf(log, ",\"digest\":null}\n");
    fflush(log);
    free(h->line);
    h->line = NULL;
}

void cmd_train_held_put_summary(struct trainer *t, FILE *log, struct held_line *h)
{
    struct trainer_summary s;
    if (!h->line) return;
    trainer_get_summary(t, &s);
    cmd_train_held_put(log, h, s.have_digest && s.digest_step == h->step, s.digest);
}

/* Each line of text ("a\nb") as a JSON list of strings; with split, "path = value" lines as
 * an object. */
static void json_lines(FILE *f, const char *text, bool split)
{
    fputc(split ? '{' : '[', f);
    for (const char *p = text, *nl; p && *p; p = nl ? nl + 1 : NULL) {
        char line[512];
        nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) : strlen(p);
        snprintf(line, sizeof(line), "%.*s", (int)n, p);
        if (p != text) fputc(',', f);
        char *eq = split ? strstr(line, " = ") : NULL;
        if (eq) {
            *eq = '\0';
            json_print_string(f, line);
            fputc(':', f);
            json_print_string(f, eq + 3);
        } else {
            json_print_string(f, line);
        }
    }
    fputc(split ? '}' : ']', f);
}

/* Each line of text ("a\nb"), after prefix. */
static void print_lines(const char *prefix, const char *text)
{
    for (const char *p = text, *nl; *p; p = nl + 1) {
        nl = strchr(p, '\n');
        printf("%s%.*s\n", prefix, nl ? (int)(nl - p) : (int)strlen(p), p);
        if (!nl) break;
    }
}

/* The effective settings, once: a few lines here, the first JSON line of the log. */
static void print_settings(const struct trainer_opts *o, const struct train_config_applied *ds,
                           const struct trainer_summary *sum, long ckpt_every, int every, FILE *log)
{
    printf("# settings: %d micro-batch%s of %d x %d tokens per step, %d steps, %s lr %g (%s "
           "schedule), betas %g %g, eps %g, weight decay %g, clip %g, seed %llu, checkpoint "
           "every %ld, print every %d\n",
           o->grad_accum, o->grad_accum == 1 ? "" : "es", o->batch, o->seq, o->steps, ds->optimizer,
           o->lr, ds->scheduler, o->beta1, o->beta2, o->eps, o->weight_decay, o->grad_clip,
           (unsigned long long)o->seed, ckpt_every, every);
    print_lines("# \"auto\": ", ds->autos);
    if (ds->ignored[0]) {
        printf("# ignored (in the config, but zinf does not act on these):\n");
        print_lines("#   ", ds->ignored);
    }
    if (!log) return;
    fprintf(log,
            "{\"settings\":{\"layers\":%d,\"dim\":%d,\"heads\":%d,\"seq\":%d,"
            "\"batch\":%d,\"grad_accum\":%d,\"steps\":%d,\"optimizer\":",
            o->model.L, o->model.C, o->model.NH, o->seq, o->batch, o->grad_accum, o->steps);
    json_print_string(log, ds->optimizer);
    fprintf(log, ",\"communication_data_type\":\"%s\"", comm_wire_name(o->comm_wire));
    if (o->optimizer == TRAINER_OPT_ONEBIT) fprintf(log, ",\"freeze_step\":%d", o->freeze_step);
    fprintf(log, ",\"lr\":%.9g,\"scheduler\":", o->lr);
    json_print_string(log, ds->scheduler);
    cmd_train_json_num(log, "warmup_min_lr", o->sched.min_lr, false);
    cmd_train_json_num(log, "warmup_max_lr", o->sched.max_lr, false);
    fprintf(log,
            ",\"warmup_steps\":%d,"
            "\"total_steps\":%d,\"warmup_type\":\"%s\",\"betas\":[%.9g,%.9g],\"eps\":%.9g,"
            "\"weight_decay\":%.9g,\"clip\":%.9g,\"seed\":%llu,\"precision\":\"%s\","
            "\"backend\":\"%s\",\"checkpoint_every\":%ld,\"steps_per_print\":%d,"
            "\"device_bytes\":%llu,\"host_bytes\":%llu,\"min_device_bytes\":%llu,"
            "\"min_host_bytes\":%llu,\"staging_bytes\":%llu,\"optimizer_state_dtype\":\"%s\","
            "\"auto\":",
            o->sched.warmup_steps, o->sched.total_steps,
            o->sched.linear ? "linear" : "log", o->beta1, o->beta2, o->eps, o->weight_decay,
            o->grad_clip, (unsigned long long)o->seed, sum->precision, sum->backend, ckpt_every,
            every, (unsigned long long)sum->tier[0].budget_bytes,
            (unsigned long long)sum->tier[1].budget_bytes, (unsigned long long)sum->min_budget[0],
            (unsigned long long)sum->min_budget[1], (unsigned long long)sum->staging_bytes,
            sum->optimizer_state_dtype);
    json_lines(log, ds->autos, true);
    fprintf(log, ",\"ignored\":");
    json_lines(log, ds->ignored, false);
    fprintf(log, "}}\n");
    fflush(log);
}

/* b - a in seconds: the CPU time a step took, for the log. */
static double timeval_diff_s(const struct timeval *a, const struct timeval *b)
{
    return (double)(b->tv_sec - a->tv_sec) + (double)(b->tv_usec - a->tv_usec) * 1e-6;
}

void cmd_train_cpu_by_thread(struct cpu_names *c)
{
    static long tck;
    if (!tck) tck = sysconf(_SC_CLK_TCK);
    for (int k = 0; k < c->n; k++)
        c->s[k] = 0;
    DIR *d = opendir("/proc/self/task");
    if (!d || tck <= 0) {
        if (d) closedir(d);
        return;
    }
    struct dirent *de;
    while ((de = readdir(d))) {
        char path[300], buf[512];
        if (de->d_name[0] == '.') continue;
        snprintf(path, sizeof(path), "/proc/self/task/%s/stat", de->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue; /* ended meanwhile */
        size_t len = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[len] = 0;
        char *open = strchr(buf, '('), *close = strrchr(buf, ')');
        unsigned long long ut, st;
        if (!open || !close || close < open ||
            sscanf(close + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut,
                   &st) != 2)
            continue;
        /* The engine's threads by their names; io_uring's kernel workers (iou-*) as one; the
         * rest (the main thread and the compute threads) as "compute". */
        char name[16];
        size_t nl = (size_t)(close - open - 1);
        if (nl > 5 && !strncmp(open + 1, "zinf-", 5))
            snprintf(name, sizeof(name), "%.*s", (int)MIN(nl, sizeof(name) - 1), open + 1);
        else
            snprintf(name, sizeof(name), "%s",
                     !strncmp(open + 1, "iou-", 4) ? "io_uring" : "compute");
        int k = 0;
        while (k < c->n && strcmp(c->name[k], name)) k++;
        if (k == c->n) {
            if (c->n < CPU_NAMES) {
                snprintf(c->name[c->n], sizeof(c->name[0]), "%s", name);
                c->s[c->n++] = 0;
            } else {
                k = CPU_NAMES - 1; /* more names than slots: the last one takes the rest */
            }
        }
        c->s[k] += (double)(ut + st) / (double)tck;
    }
    closedir(d);
}

static const char *format_eta(double s, char *buf, size_t len)
{
    long n = (long)(s + 0.5);
    if (n < 60)
        snprintf(buf, len, "%lds", n);
    else if (n < 3600)
        snprintf(buf, len, "%ldm%02lds", n / 60, n % 60);
    else
        snprintf(buf, len, "%ldh%02ldm", n / 3600, n % 3600 / 60);
    return buf;
}

/* ---- the run's lines --------------------------------------------------------------- */

void cmd_train_print_dry_run(const struct trainer_opts *o, const struct train_config_applied *ds,
                             long print_lr, const struct weights_file *init, const char *init_path)
{
    printf("# zinf train --dry-run: %d layers, dim %d, %d heads, seq %d, %d micro-batch%s "
           "of %d per step, %d steps, %s lr %g (%s schedule), betas %g %g, eps %g, "
           "weight decay %g, clip %g, seed %llu\n",
           o->model.L, o->model.C, o->model.NH, o->seq, o->grad_accum,
           o->grad_accum == 1 ? "" : "es", o->batch, o->steps, ds->optimizer, o->lr,
           ds->scheduler, o->beta1, o->beta2, o->eps, o->weight_decay, o->grad_clip,
           (unsigned long long)o->seed);
    print_lines("# \"auto\": ", ds->autos);
    if (ds->ignored[0]) {
        printf("# ignored (in the config, but zinf does not act on these):\n");
        print_lines("#   ", ds->ignored);
    }
    /* OneCycle's cycled betas too, where it sets them. */
    bool betas = o->sched.type == TRAINER_SCHED_ONE_CYCLE && o->sched.cycle_momentum;
    for (long s = 1; s <= print_lr; s++) {
        double b1, b2;
        trainer_betas_at(&o->sched, o->beta1, o->beta2, (int)s, &b1, &b2);
        printf("lr %ld %.17g", s, trainer_lr_at(&o->sched, o->lr, (int)s));
        if (betas) printf(" betas %.17g %.17g", b1, b2);
        putchar('\n');
    }
    if (init)
        printf("# --init %s: %d tensors under %s, as this model has them\n", init_path,
               4 + GPT_BLOCK_NSLOTS * o->model.L, weights_file_names(init) == WEIGHTS_ZINF
                                                    ? "zinf's names"
                                                    : "GPT-2's names");
    if (init && weights_file_notes(init)[0])
        printf("# --init: %s\n", weights_file_notes(init));
}

void cmd_train_print_start(const struct trainer_opts *o, const struct trainer_summary *sum,
                           bool nvme_offload)
{
    char a[32], b[32], c[32];
    char d[32], f[32], g[32];
    printf("# zinf train: %d layers, dim %d, %d heads, seq %d, batch %d: %llu parameters, "
           "model state %s (Adam's m and v %s in %s)\n",
           o->model.L, o->model.C, o->model.NH, o->seq, o->batch,
           (unsigned long long)sum->param_count, format_size(sum->model_state_bytes, a, sizeof(a)),
           format_size(sum->optimizer_state_bytes, d, sizeof(d)), sum->optimizer_state_dtype);
    if (o->lora.r) {
        char tg[32];
        printf("# lora: rank %d, alpha %g, targets %s: %llu of the parameters train, the model's "
               "own are frozen (no gradient, no optimizer state)\n",
               o->lora.r, (double)trainer_lora_alpha(o),
               gpt_lora_targets_name(o->lora.targets, tg, sizeof(tg)),
               (unsigned long long)sum->trainable_count);
    }
    printf("# budgets: device %s, host %s (the least that runs: %s, %s); beside the host "
           "budget, %s of staging buffers%s%s\n",
           format_size(sum->tier[0].budget_bytes, b, sizeof(b)),
           format_size(sum->tier[1].budget_bytes, c, sizeof(c)),
           format_size(sum->min_budget[0], d, sizeof(d)),
           format_size(sum->min_budget[1], f, sizeof(f)),
           format_size(sum->staging_bytes, g, sizeof(g)), sum->host_pinned ? ", pinned too" : "",
           o->resume ? "; resumed" : "");
    /* The budgets the config did not give, and how they were derived. */
    if (sum->budgets.device_how[0]) printf("#   device budget: %s\n", sum->budgets.device_how);
    if (sum->budgets.host_how[0]) printf("#   host budget: %s\n", sum->budgets.host_how);
    /* An NVMe offload whose whole state fits in memory: NVMe will see the checkpoints only. */
    if (nvme_offload && sum->world <= 1 &&
        sum->model_state_bytes <= sum->tier[0].budget_bytes + sum->tier[1].budget_bytes) {
        char s1[32];
        fprintf(stderr,
                "zinf train: warning: the config offloads to NVMe, but the whole model state "
                "(%s) fits the device and host budgets (%s + %s): nothing will move to NVMe "
                "between checkpoints; lower zinf.device_bytes and zinf.host_bytes to offload\n",
                format_size(sum->model_state_bytes, s1, sizeof(s1)), b, c);
    }
}

void cmd_train_print_head(const struct trainer_opts *o, const struct train_config_applied *ds,
                          const struct trainer_summary *sum, long ckpt_every, int every, FILE *log)
{
    char a[32];
    printf("# compute: %s, %s weights on the device%s%s\n", sum->backend, sum->precision,
           sum->backend_work_bytes ? "; backend working memory " : "",
           sum->backend_work_bytes ? format_size(sum->backend_work_bytes, a, sizeof(a)) : "");
    print_settings(o, ds, sum, ckpt_every, every, log);
    printf("# %6s %9s %10s %9s %9s %9s %8s %20s %8s\n", "step", "loss", "tokens/s", "ms",
           "rd GB/s", "wr GB/s", "blocked", "nvme/copy/room/pin %", "eta");
    fflush(stdout);
}

void cmd_train_print_step(const struct trainer_step_stats *st, double eta,
                          const struct trainer_summary *sum)
{
    char e[32];
    char why[48];
    snprintf(why, sizeof(why), "%.0f/%.0f/%.0f/%.0f", st->blocked_nvme * 100,
             st->blocked_copy * 100, st->blocked_room * 100, st->blocked_pin * 100);
    printf("  %6d %9.4f %10.0f %9.1f %9.3f %9.3f %7.1f%% %20s %8s%s", st->step, st->loss,
           st->tokens_per_s, st->seconds * 1e3, st->nvme_read_GBps, st->nvme_write_GBps,
           st->blocked_fraction * 100, why, format_eta(eta, e, sizeof(e)),
           st->skipped ? "  skipped: the gradients overflowed" : "");
    if (st->skipped || (sum->precision[0] == 'f' && sum->precision[2] == '1'))
        printf("  (loss scale %.9g)", st->loss_scale);
    printf("\n");
    fflush(stdout);
}

void cmd_train_log_step(FILE *ln, const struct trainer_step_stats *st, double eta,
                        const struct rusage *ru0, const struct rusage *ru1,
                        const struct cpu_names *c0, const struct cpu_names *c1)
{
    /* Every number reads back as the value the trainer had (json_num), so runs can be
     * compared exactly from their logs; the digest compares their parameters. */
    fprintf(ln, "{\"step\":%d", st->step);
    cmd_train_json_num(ln, "loss", st->loss, true);
    cmd_train_json_num(ln, "tokens_per_s", st->tokens_per_s, false);
    cmd_train_json_num(ln, "ms", st->seconds * 1e3, false);
    cmd_train_json_num(ln, "nvme_read_GBps", st->nvme_read_GBps, false);
    cmd_train_json_num(ln, "nvme_write_GBps", st->nvme_write_GBps, false);
    fprintf(ln, ",\"nvme_read_bytes\":%llu,\"nvme_write_bytes\":%llu",
            (unsigned long long)st->nvme_read_bytes, (unsigned long long)st->nvme_write_bytes);
    cmd_train_json_num(ln, "blocked", st->blocked_fraction, false);
    cmd_train_json_num(ln, "blocked_nvme", st->blocked_nvme, false);
    cmd_train_json_num(ln, "blocked_copy", st->blocked_copy, false);
    cmd_train_json_num(ln, "blocked_room", st->blocked_room, false);
    cmd_train_json_num(ln, "blocked_pin", st->blocked_pin, false);
    fprintf(ln, ",\"device_used_bytes\":%llu,\"host_used_bytes\":%llu",
            (unsigned long long)st->device_used, (unsigned long long)st->host_used);
    cmd_train_json_num(ln, "eta_s", eta, false);
    cmd_train_json_num(ln, "loss_scale", st->loss_scale, false);
    fprintf(ln, ",\"skipped\":%s", st->skipped ? "true" : "false");
    cmd_train_json_num(ln, "grad_norm", st->grad_norm, false);
    cmd_train_json_num(ln, "clip_scale", st->clip_scale, true);
    cmd_train_json_num(ln, "lr", st->lr, true);
    fprintf(ln, ",\"comm_bytes\":%llu,\"grad_comm_bytes\":%llu",
            (unsigned long long)st->comm_bytes, (unsigned long long)st->grad_comm_bytes);
    if (st->experts) { /* mixture of experts: the loss's balancing term, the experts read */
        cmd_train_json_num(ln, "moe_aux_loss", st->moe_aux_loss, true);
        fprintf(ln,
                ",\"experts_used\":%d,\"experts\":%d,\"expert_bytes_read\":%llu,"
                "\"expert_fetches\":%llu,\"expert_hits\":%llu",
                st->experts_used, st->experts, (unsigned long long)st->expert_bytes_read,
                (unsigned long long)st->expert_fetches, (unsigned long long)st->expert_hits);
    }
    cmd_train_json_num(ln, "cpu_user_s", timeval_diff_s(&ru0->ru_utime, &ru1->ru_utime), false);
    cmd_train_json_num(ln, "cpu_sys_s", timeval_diff_s(&ru0->ru_stime, &ru1->ru_stime), false);
    fprintf(ln, ",\"cpu_by_thread\":{");
    for (int k = 0; k < c1->n; k++) {
        fprintf(ln, "%s\"%s\":", k ? "," : "", c1->name[k]);
        /* a name first seen after the step began started from nothing */
        fprintf(ln, "%.3f", c1->s[k] - (k < c0->n ? c0->s[k] : 0));
    }
    fprintf(ln, "}");
}

void cmd_train_print_summary(const struct trainer_opts *o, const struct trainer_summary *sum,
                             int ran, double ran_seconds, const double blocked_s[5],
                             bool interrupted, int status, FILE *log)
{
    char a[32], b[32];
    double mean_tps =
        ran_seconds > 0 ? (double)ran * o->batch * o->seq * o->grad_accum * sum->world / ran_seconds
                        : 0;
    printf("# summary: %d steps, model state %s; a tier was emptied %llu times to place a set "
           "it held room for\n",
           sum->steps_done, format_size(sum->model_state_bytes, a, sizeof(a)),
           (unsigned long long)sum->compactions);
    if (sum->pipeline_ahead)
        printf("#   the optimizer read %llu sets ahead (%llu of its sets were read again alone, "
               "finding no room beside the others)\n",
               (unsigned long long)sum->pipeline_ahead,
               (unsigned long long)sum->pipeline_refetched);
    /* Where the time blocked in fetch went: the largest of the four, named. */
    static const char *const stall_names[4] = {"NVMe reads", "copies between host and device",
                                               "room (write-backs before evictions)",
                                               "pins (a copy held or read by another)"};
    static const char *const stall_keys[4] = {"nvme", "copy", "room", "pin"};
    int most = 0;
    for (int k = 1; k < 4; k++)
        if (blocked_s[1 + k] > blocked_s[1 + most]) most = k;
    if (ran)
        printf("#   ran %d steps in %.1f s: %.0f tokens/s on average\n", ran, ran_seconds,
               mean_tps);
    if (ran && blocked_s[0] > 0)
        printf("#   blocked in fetch %.3f s (%.1f%%): mostly waiting for %s, %.3f s (nvme %.3f, "
               "copy %.3f, room %.3f, pin %.3f)\n",
               blocked_s[0], blocked_s[0] / ran_seconds * 100, stall_names[most],
               blocked_s[1 + most], blocked_s[1], blocked_s[2], blocked_s[3], blocked_s[4]);
    if (sum->experts && ran)
        printf("#   experts: %.2f of %d had tokens per step on average; fetching them read "
               "%s from NVMe; %.1f%% of their tensors' fetches found them on the device "
               "(hit rate)\n",
               (double)sum->experts_used / ran, sum->experts,
               format_size(sum->expert_bytes_read, a, sizeof(a)),
               sum->expert_fetches
                   ? 100.0 * (double)sum->expert_hits / (double)sum->expert_fetches
                   : 0.0);
    if (!strcmp(sum->precision, "fp16"))
        printf("#   fp16: %lld steps skipped for overflowed gradients; loss scale now %.9g\n",
               (long long)sum->skipped_steps, sum->loss_scale);
    for (int i = 0; i < 2; i++)
        printf("#   %-6s peak %12s of budget %12s\n", tier_names[i],
               format_size(sum->tier[i].peak_bytes, a, sizeof(a)),
               format_size(sum->tier[i].budget_bytes, b, sizeof(b)));
    printf("#   %-6s peak %12s in swap files of %12s\n", tier_names[2],
           format_size(sum->tier[2].peak_bytes, a, sizeof(a)),
           format_size(sum->tier[2].budget_bytes, b, sizeof(b)));
    if (sum->world > 1)
        printf("#   ZeRO stage %d: rank %d of %d holds the tiers above; %s came in through "
               "%llu collectives (%llu of them one copy, in the ranks' pool); the steps waited "
               "%.3f s for gradient reductions (%s)\n",
               sum->stage, sum->rank, sum->world, format_size(sum->comm_bytes, a, sizeof(a)),
               (unsigned long long)sum->comm_ops, (unsigned long long)sum->comm_pooled_ops,
               sum->reduce_seconds,
               sum->overlap_comm ? "overlap_comm: each behind the next block's backward"
                                : "each after its block's backward");
    if (sum->world > 1 && ran > 0)
        printf("#   gradients: %s sent to their reductions in %s%s, %s a step\n",
               format_size(sum->grad_comm_bytes, a, sizeof(a)), comm_wire_name(o->comm_wire),
               o->optimizer == TRAINER_OPT_ONEBIT
                   ? " and, past freeze_step, to 1-bit Adam's compressed exchange"
                   : "",
               format_size(sum->grad_comm_bytes / (uint64_t)ran, b, sizeof(b)));
    if (sum->pp > 1)
        printf("#   pipeline stage %d of %d: blocks %d-%d; the bubble (time outside its forwards "
               "and backwards) %.1f%% of the micro-batches' phase, 1F1B's at equal stages "
               "%.1f%%; %.3f s waiting for a neighbour, %s sent to the other stages\n",
               sum->pp_stage, sum->pp, sum->first_block, sum->first_block + sum->blocks - 1,
               100 * sum->pipeline_bubble, 100 * sum->pipeline_bubble_ideal,
               sum->pipeline_wait_seconds, format_size(sum->pipeline_bytes, a, sizeof(a)));
    if (sum->tp > 1)
        printf("#   tensor-parallel rank %d of %d: this rank's heads, hidden units and vocabulary "
               "rows of every block (the tiers above hold those slices)\n",
               sum->tp_rank, sum->tp);
    if (sum->sp > 1)
        printf("#   sequence-parallel rank %d of %d: positions %d-%d of every sequence, the "
               "attention's heads exchanged by all-to-all\n",
               sum->sp_rank, sum->sp, sum->sp_rank * sum->seq_local,
               (sum->sp_rank + 1) * sum->seq_local - 1);
    if (sum->world > 1 && sum->nodes > 1)
        printf("#   across %d nodes (this rank in node %d): %s out and %s in between machines, "
               "in %llu of the collectives\n",
               sum->nodes, sum->node, format_size(sum->net_bytes_out, a, sizeof(a)),
               format_size(sum->net_bytes_in, b, sizeof(b)), (unsigned long long)sum->net_ops);
    if (log) {
        fprintf(log,
                "{\"summary\":{\"steps\":%d,\"model_state_bytes\":%llu,\"params\":%llu,"
                "\"backend\":\"%s\",\"precision\":\"%s\",\"backend_work_bytes\":%llu,"
                "\"device_scratch_bytes\":%llu,"
                "\"checkpoint_step\":%d,\"interrupted\":%s,\"failed\":%s,\"compactions\":%llu,"
                "\"min_device_bytes\":%llu,\"min_host_bytes\":%llu,\"steps_run\":%d,"
                "\"skipped_steps\":%lld,\"pipeline_ahead\":%llu,\"pipeline_refetched\":%llu",
                sum->steps_done, (unsigned long long)sum->model_state_bytes,
                (unsigned long long)sum->param_count, sum->backend, sum->precision,
                (unsigned long long)sum->backend_work_bytes,
                (unsigned long long)sum->device_scratch_bytes, sum->checkpoint_step,
                interrupted ? "true" : "false", status != 0 && status < 128 ? "true" : "false",
                (unsigned long long)sum->compactions, (unsigned long long)sum->min_budget[0],
                (unsigned long long)sum->min_budget[1], ran, (long long)sum->skipped_steps,
                (unsigned long long)sum->pipeline_ahead,
                (unsigned long long)sum->pipeline_refetched);
        fprintf(log, ",\"update_in_forward\":%s", sum->update_in_forward ? "true" : "false");
        fprintf(log, ",\"optimizer_state_bytes\":%llu,\"optimizer_state_dtype\":\"%s\"",
                (unsigned long long)sum->optimizer_state_bytes, sum->optimizer_state_dtype);
        if (sum->experts)
            fprintf(log,
                    ",\"experts\":%d,\"experts_used\":%llu,\"expert_bytes_read\":%llu,"
                    "\"expert_fetches\":%llu,\"expert_hits\":%llu",
                    sum->experts, (unsigned long long)sum->experts_used,
                    (unsigned long long)sum->expert_bytes_read,
                    (unsigned long long)sum->expert_fetches,
                    (unsigned long long)sum->expert_hits);
        cmd_train_json_num(log, "train_seconds", ran_seconds, false);
        cmd_train_json_num(log, "mean_tokens_per_s", mean_tps, false);
        cmd_train_json_num(log, "loss_scale", sum->loss_scale, false);
        for (int i = 0; i < 3; i++)
            fprintf(log, ",\"%s\":{\"peak_bytes\":%llu,\"%s\":%llu}", tier_names[i],
                    (unsigned long long)sum->tier[i].peak_bytes,
                    i == 2 ? "swap_file_bytes" : "budget_bytes",
                    (unsigned long long)sum->tier[i].budget_bytes);
        fprintf(log, ",\"staging_bytes\":%llu", (unsigned long long)sum->staging_bytes);
        fprintf(log, ",\"rank\":%d,\"world\":%d,\"zero_stage\":%d,\"comm_bytes\":%llu", sum->rank,
                sum->world, sum->stage, (unsigned long long)sum->comm_bytes);
        fprintf(log, ",\"grad_comm_bytes\":%llu,\"communication_data_type\":\"%s\"",
                (unsigned long long)sum->grad_comm_bytes, comm_wire_name(o->comm_wire));
        fprintf(log, ",\"comm_ops\":%llu,\"comm_pooled_ops\":%llu",
                (unsigned long long)sum->comm_ops, (unsigned long long)sum->comm_pooled_ops);
        fprintf(log, ",\"nodes\":%d,\"node\":%d,\"net_bytes_out\":%llu,\"net_bytes_in\":%llu"
                ",\"net_ops\":%llu",
                sum->nodes, sum->node, (unsigned long long)sum->net_bytes_out,
                (unsigned long long)sum->net_bytes_in, (unsigned long long)sum->net_ops);
        fprintf(log, ",\"overlap_comm\":%s", sum->overlap_comm ? "true" : "false");
        fprintf(log, ",\"pp\":%d,\"pp_stage\":%d,\"first_block\":%d,\"blocks\":%d,"
                "\"pipeline_bytes\":%llu,\"tp\":%d,\"tp_rank\":%d,\"sp\":%d,\"sp_rank\":%d",
                sum->pp, sum->pp_stage, sum->first_block, sum->blocks,
                (unsigned long long)sum->pipeline_bytes, sum->tp, sum->tp_rank, sum->sp,
                sum->sp_rank);
        cmd_train_json_num(log, "pipeline_bubble", sum->pipeline_bubble, false);
        cmd_train_json_num(log, "pipeline_bubble_ideal", sum->pipeline_bubble_ideal, false);
        cmd_train_json_num(log, "pipeline_wait_seconds", sum->pipeline_wait_seconds, false);
        cmd_train_json_num(log, "reduce_seconds", sum->reduce_seconds, false);
        static const char *const blocked_keys[5] = {
            "blocked_seconds", "blocked_nvme_seconds", "blocked_copy_seconds",
            "blocked_room_seconds", "blocked_pin_seconds"};
        for (int i = 0; i < 5; i++)
            cmd_train_json_num(log, blocked_keys[i], blocked_s[i], false);
        fprintf(log, ",\"largest_stall\":%s", blocked_s[0] > 0 ? "\"" : "null");
        if (blocked_s[0] > 0) fprintf(log, "%s\"", stall_keys[most]);
        fprintf(log, "}}\n");
    }
}

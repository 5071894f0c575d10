/*
 * cmd_compare.c - `zinf compare A.jsonl B.jsonl`: are two training runs the same, step by
 * step, from their `zinf train --log` files alone? Each step's loss is compared as the float it
 * was (the log writes it so that it reads back exactly) and its parameter digest as written;
 * the first step where either differs is named, with the values.
 *
 * A log a resumed run appended to holds some steps twice: the last line of a step counts, as
 * in `zinf plot`. Steps only one log has are counted, not compared. Logs written before the
 * digest existed are compared by loss only, and say so.
 *
 * Not here: comparing anything but losses and digests (timings differ run to run).
 */
#include <getopt.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd.h"
#include "trainlog.h"

#define SHOW_MAX 10 /* differing steps listed before the rest are only counted */

struct entry {
    bool set, have_loss, have_digest;
    double loss;    /* the %.9g float, read as a double: equal exactly when the floats are */
    char digest[17];
};

struct log {
    const char *path;
    struct trainlog_steps steps_at; /* struct entry by step */
    struct entry *e;                /* steps_at's entries, once read */
    int last, steps;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: zinf compare A.jsonl B.jsonl [--all]\n"
               "Compares two `zinf train --log` files step by step: each step's loss as the float\n"
               "it was, and its parameter digest (a hash of every parameter after the step). Says\n"
               "the first step where they differ, with both values, and how many steps agree.\n"
               "--all: a row for every step, not only for those that differ.\n"
               "Exit status: 0 every step both logs hold is the same, 1 some step differs, 2 bad\n"
               "usage, a log it cannot read or without a step, or no step in both.\n");
}

static int take_line(json_t *j, int line, void *arg)
{
    struct log *l = arg;
    json_t *step = json_object_get(j, "step");
    if (!json_is_integer(step)) return 0;
    json_int_t k = json_integer_value(step);
    struct entry *e =
        k >= 1 && k <= TRAINLOG_MAX_STEP ? trainlog_at(&l->steps_at, (int)k, sizeof(*e)) : NULL;
    if (!e) {
        fprintf(stderr, "zinf compare: %s:%d: step %lld is out of range\n", l->path, line,
                (long long)k);
        return 2;
    }
    json_t *loss = json_object_get(j, "loss"), *dg = json_object_get(j, "digest");
    *e = (struct entry){.set = true, .have_loss = json_is_number(loss)};
    e->loss = json_number_value(loss);
    if (json_is_string(dg) && strlen(json_string_value(dg)) == 16) {
        e->have_digest = true;
        memcpy(e->digest, json_string_value(dg), 17);
    }
    return 0;
}

/* 0, or 2 with the reason said (the file and line). */
static int read_log(struct log *l)
{
    int rc = trainlog_each("compare", l->path, take_line, l);
    l->e = l->steps_at.v;
    l->last = l->steps_at.last;
    if (rc) return rc;
    for (int k = 1; k <= l->last; k++)
        l->steps += l->e[k].set;
    if (!l->steps) {
        fprintf(stderr, "zinf compare: %s: no step lines: is it a zinf train --log file?\n",
                l->path);
        return 2;
    }
    return 0;
}

static void loss_text(const struct entry *e, char *buf, size_t len)
{
    if (!e->have_loss)
        snprintf(buf, len, "null");
    else
        snprintf(buf, len, "%.9g", e->loss);
}

int cmd_compare(int argc, char **argv)
{
    static const struct option opts[] = {
        {"all", no_argument, NULL, 'a'}, {"help", no_argument, NULL, 'h'}, {0, 0, 0, 0}};
    bool all = false;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'a':
            all = true;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (argc - optind != 2) {
        fprintf(stderr, "zinf compare: two log files are needed\n");
        usage(stderr);
        return 2;
    }
    struct log a = {.path = argv[optind]}, b = {.path = argv[optind + 1]};
    int rc = read_log(&a);
    if (rc == 0) rc = read_log(&b);
    if (rc) {
        free(a.e);
        free(b.e);
        return rc;
    }

    int common = 0, differ = 0, first = 0, shown = 0, loss_only = 0;
    printf("# compare: %s (%d steps) and %s (%d steps)\n", a.path, a.steps, b.path, b.steps);
    printf("# %8s %16s %16s %18s %18s %s\n", "step", "loss_a", "loss_b", "digest_a", "digest_b",
           "same");
    int last = a.last < b.last ? a.last : b.last;
    for (int k = 1; k <= last; k++) {
        const struct entry *x = &a.e[k], *y = &b.e[k];
        if (!x->set || !y->set) continue;
        common++;
        bool digests = x->have_digest && y->have_digest;
        loss_only += !digests;
        bool same_loss = x->have_loss == y->have_loss && (!x->have_loss || x->loss == y->loss);
        bool same = same_loss && (!digests || !strcmp(x->digest, y->digest));
        if (!same) {
            differ++;
            if (!first) first = k;
        }
        if (all || (!same && shown < SHOW_MAX)) {
            char la[32], lb[32];
            loss_text(x, la, sizeof(la));
            loss_text(y, lb, sizeof(lb));
            printf("  %8d %16s %16s %18s %18s %s\n", k, la, lb,
                   x->have_digest ? x->digest : "-", y->have_digest ? y->digest : "-",
                   same ? "yes" : !same_loss ? "NO (loss)" : "NO (digest)");
            shown += !same;
        }
    }
    if (differ > shown && !all)
        printf("# ... %d more differing steps not listed (--all lists every step)\n",
               differ - shown);
    if (a.steps != common || b.steps != common)
        printf("# steps in only one log, not compared: %d in %s, %d in %s\n", a.steps - common,
               a.path, b.steps - common, b.path);
    if (loss_only)
        printf("# %d compared steps have no digest in one log or both: their losses only were "
               "compared\n",
               loss_only);
    if (!common) {
        printf("# no step is in both logs: nothing compared\n");
        rc = 2;
    } else if (differ) {
        printf("# differ: %d of %d common steps; the first is step %d\n", differ, common, first);
        rc = 1;
    } else {
        printf("# same: all %d common steps (losses%s bitwise equal)\n", common,
               loss_only == common ? "" : " and parameter digests");
    }
    free(a.e);
    free(b.e);
    return rc;
}

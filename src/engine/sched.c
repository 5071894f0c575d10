/*
 * sched.c - the learned access schedule of a training step.
 *
 * The fetches between two zinf_step() marks are recorded on the first step that starts at
 * a mark; from the next step on they are replayed: each fetch is checked against the
 * schedule, the tensors that come next are prefetched (within the prefetch byte budget),
 * and eviction asks how far away each copy's next use is (Belady's rule). A fetch that
 * does not match drops the schedule, and the next whole step is learned again.
 *
 * Distances are counted in fetches and wrap around the step, since steps repeat.
 * Not here: what a prefetch does (fetch.c).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

#define SCHED_MAX_ENTRIES (1u << 22) /* longer steps are not learned */

static void sched_drop(struct sched *s)
{
    free(s->sch);
    free(s->occ);
    free(s->occ_start);
    s->sch = NULL;
    s->occ = s->occ_start = NULL;
    s->len = s->pos = s->nkeys = s->ahead = 0;
    s->replaying = false;
}

void sched_free(struct sched *s)
{
    sched_drop(s);
    free(s->rec);
    s->rec = NULL;
    s->nrec = s->caprec = 0;
}

static void record(struct sched *s, uint32_t tidx, int tier)
{
    if (!s->rec_from_start)
        return;
    if (s->nrec == s->caprec) {
        size_t cap = s->caprec ? s->caprec * 2 : 256;
        struct sched_entry *n;
        if (cap > SCHED_MAX_ENTRIES || !(n = realloc(s->rec, cap * sizeof(*n)))) {
            s->rec_from_start = false; /* too long (or no memory): do not learn this step */
            return;
        }
        s->rec = n;
        s->caprec = cap;
    }
    s->rec[s->nrec++] = (struct sched_entry){.tidx = tidx, .tier = (uint8_t)tier};
}

void sched_on_fetch(struct zinf_engine *e, struct tensor *t, int tier)
{
    struct sched *s = &e->sched;

    if (s->replaying) {
        if (s->pos < s->len && s->sch[s->pos].tidx == t->index && s->sch[s->pos].tier == tier) {
            s->pos++;
            if (s->ahead)
                s->ahead--;
            return;
        }
        /* Diverged: forget the schedule; this step's record is partial, so the next
         * whole step is the one learned. */
        sched_drop(s);
        e->st.schedule_resets++;
        e->st.schedule_length = 0;
        s->nrec = 0;
        s->rec_from_start = false;
        return;
    }
    record(s, t->index, tier);
}

/* Index the occurrences of each (tensor, tier) in the schedule: a counting sort. */
static int build_occ(struct sched *s)
{
    uint32_t maxidx = 0;
    for (size_t i = 0; i < s->len; i++)
        maxidx = MAX(maxidx, s->sch[i].tidx);
    s->nkeys = ((size_t)maxidx + 1) * MEM_TIERS;
    s->occ_start = calloc(s->nkeys + 1, sizeof(uint32_t));
    s->occ = malloc(s->len * sizeof(uint32_t));
    if (!s->occ_start || !s->occ)
        return -ENOMEM;
    for (size_t i = 0; i < s->len; i++)
        s->occ_start[s->sch[i].tidx * MEM_TIERS + s->sch[i].tier + 1]++;
    for (size_t k = 0; k < s->nkeys; k++)
        s->occ_start[k + 1] += s->occ_start[k];
    uint32_t *fill = calloc(s->nkeys, sizeof(uint32_t));
    if (!fill)
        return -ENOMEM;
    for (size_t i = 0; i < s->len; i++) {
        size_t k = s->sch[i].tidx * MEM_TIERS + s->sch[i].tier;
        s->occ[s->occ_start[k] + fill[k]++] = (uint32_t)i;
    }
    free(fill);
    return 0;
}

void sched_on_step(struct zinf_engine *e)
{
    struct sched *s = &e->sched;

    if (s->replaying) {
        if (s->pos == s->len) {
            s->pos = 0;
            return;
        }
        sched_drop(s); /* the step ended early: it diverged */
        e->st.schedule_resets++;
        e->st.schedule_length = 0;
    } else if (s->rec_from_start && s->nrec > 0) {
        s->sch = s->rec;
        s->len = s->nrec;
        s->rec = NULL;
        s->nrec = s->caprec = 0;
        if (build_occ(s) < 0) {
            sched_drop(s);
        } else {
            s->replaying = true;
            s->pos = 0;
            s->ahead = 0;
            e->st.schedule_length = s->len;
        }
    }
    s->nrec = 0;
    s->rec_from_start = true;
}

void sched_forget_tensor(struct zinf_engine *e, uint32_t tidx)
{
    struct sched *s = &e->sched;
    /* Its index may be reused by another tensor: whatever mentions it is void. */
    if (s->replaying && (size_t)tidx * MEM_TIERS < s->nkeys) {
        sched_drop(s);
        e->st.schedule_length = 0;
    }
    for (size_t i = 0; i < s->nrec; i++) {
        if (s->rec[i].tidx == tidx) {
            s->nrec = 0;
            s->rec_from_start = false;
            break;
        }
    }
}

uint64_t sched_distance(struct zinf_engine *e, uint32_t tidx, int tier)
{
    struct sched *s = &e->sched;
    size_t k = (size_t)tidx * MEM_TIERS + (size_t)tier;

    if (!s->replaying || k >= s->nkeys)
        return UINT64_MAX;
    uint32_t lo = s->occ_start[k], hi = s->occ_start[k + 1];
    if (lo == hi)
        return UINT64_MAX;
    /* First occurrence at or after pos, else the first one of the next step. */
    uint32_t a = lo, b = hi;
    while (a < b) {
        uint32_t m = a + (b - a) / 2;
        if (s->occ[m] < s->pos)
            a = m + 1;
        else
            b = m;
    }
    if (a < hi)
        return s->occ[a] - s->pos;
    return s->occ[lo] + s->len - s->pos;
}

/* Should tensor t's copy in tier, just made newest by a DIRTY release, start its write-back
 * now rather than when it is evicted? When the step is learned, the tensor is not fetched
 * to this tier again in the step, and its copy there was evicted in this step or the one
 * before: it will most likely be evicted again before it is used, and its write-back then
 * would block the fetch that needs its room. (A copy the tier keeps from step to step is
 * never evicted, and is not written at every step for nothing.) */
bool sched_write_behind(struct zinf_engine *e, const struct tensor *t, int tier)
{
    struct sched *s = &e->sched;
    uint64_t ev = t->evicted_step[tier];
    if (!e->write_behind || !s->replaying || s->len == 0 || !ev || ev < e->st.steps)
        return false; /* off, not learned, or not evicted in this step or the last */
    uint64_t d = sched_distance(e, t->index, tier);
    return d == UINT64_MAX || d >= s->len - MIN(s->pos, s->len);
}

void sched_prefetch(struct zinf_engine *e)
{
    struct sched *s = &e->sched;

    if (!s->replaying || s->len == 0)
        return;
    /* Entries [pos, pos + ahead) were looked at already: continue after them. */
    for (size_t i = s->ahead; i < s->len; i++) {
        struct sched_entry *en = &s->sch[(s->pos + i) % s->len];
        struct tensor *t = en->tidx < e->ntensors ? e->tensors[en->tidx] : NULL;
        if (!t) {
            s->ahead = i + 1;
            continue;
        }
        struct copy *c = &t->c[en->tier];
        if (c->state == COPY_LOADING || (c->state == COPY_READY && c->version == t->version)) {
            s->ahead = i + 1;
            continue;
        }
        if (!prefetch_fits(e, t->alloc_bytes))
            return; /* budget spent: resume here later */
        fetch_locked(e, t, en->tier, true, NULL);
        if (c->state != COPY_LOADING && !(c->state == COPY_READY && c->version == t->version))
            return; /* no room without evicting something needed sooner: stop, keep order */
        s->ahead = i + 1;
    }
}

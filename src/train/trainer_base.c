/*
 * trainer_base.c - a LoRA run's frozen base read from a job of the daemon's (zinf.base_job):
 * the model's weights ("p." and "w." of every tensor but the adapters) are looked up, read-only,
 * in that job, which its owner shared (`zinf job share`); the adapters, their gradients, Adam
 * states and everything else of the run are registered in the run's own job, private to its
 * uid as every job is.
 *
 * Several runs naming one base read one copy of it: the daemon's engine of the base job
 * caches each tensor once for all of them, so runs stepping together read it from NVMe about
 * once a step between them, not once each. The base is only ever fetched and released clean:
 * the daemon refuses anything else of a read-only session (-EROFS).
 *
 * What holds: t->base_e is a zinf_connect_readonly handle; a frozen tensor's R_P and R_W
 * handles are that engine's, every other handle t->e's (train_engine_of), and a set that
 * holds both is fetched as two sets, the base's first (train_fetch_set). The base's tensors
 * are never written: a new run writes only the adapters' initial values.
 *
 * Not here: the LoRA math and layout (trainer_lora.c, gpt_lora.c), the daemon's side
 * (src/service/: JOB_SHARE, read-only sessions).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common.h"
#include "train/trainer_impl.h"

/* How long a set of the base waits for the other jobs' sets to leave it room. */
#define BASE_WAIT_NS (120ull * 1000000000ull)

int train_base_open(struct trainer *t, char *err, size_t errlen)
{
    const char *job = t->zc.zinf.base_job;
    if (!job[0]) return 0;
    const char *no = !t->o.lora.r       ? "a run without adapters (--lora-rank)"
                     : !t->remote       ? "a run without the daemon (--connect, zinf.connect)"
                     : t->o.init_source ? "--init (the base's weights are the base job's)"
                     : !strcmp(job, t->job) ? "the run's own job as its base"
                                           : NULL;
    if (no) {
        snprintf(err, errlen, "zinf.base_job \"%s\" with %s: not supported; a LoRA run through "
                 "the daemon reads its frozen base from another job",
                 job, no);
        return -EINVAL;
    }
    int r = zinf_connect_readonly(t->o.connect, job, &t->base_e);
    if (r < 0) {
        t->base_e = NULL;
        snprintf(err, errlen, "zinf.base_job \"%s\": job %s on %s %s", job, job, t->o.connect,
                 r == -EACCES   ? "is another user's, not shared (its owner shares it: zinf "
                                  "job share)"
                 : r == -ENOENT ? "does not exist (make it with a zinf train run as that job, "
                                  "then zinf job share it)"
                                : zinf_strerror(r));
        return r;
    }
    return 0;
}

void train_base_close(struct trainer *t)
{
    zinf_close(t->base_e); /* read-only: nothing is flushed */
    t->base_e = NULL;
}

zinf_engine *train_engine_of(const struct trainer *t, int role, int idx)
{
    return t->base_e && (role == R_P || role == R_W) && train_frozen(t, idx) ? t->base_e : t->e;
}

zinf_engine *trainer_param_engine(struct trainer *t, int idx)
{
    return train_engine_of(t, R_P, idx);
}

int train_base_lookup(struct trainer *t, const char *prefix, int i, size_t bytes,
                      zinf_tensor *out, char *err, size_t errlen)
{
    char full[96];
    struct zinf_tensor_info ti;
    snprintf(full, sizeof(full), "%s%s", prefix, t->desc[i].name);
    int r = zinf_lookup(t->base_e, full, out);
    if (r == 0) r = zinf_tensor_info(t->base_e, *out, &ti);
    if (r < 0) {
        snprintf(err, errlen, "zinf.base_job \"%s\": tensor '%s': %s", t->zc.zinf.base_job,
                 full, r == -ENOENT ? "not in the base job (is it a run of this model, "
                                      "in this precision?)"
                                    : zinf_strerror(r));
        return r;
    }
    if (ti.bytes != bytes) {
        snprintf(err, errlen, "zinf.base_job \"%s\": tensor '%s' holds %zu bytes, this model's "
                 "%zu: the base is another model's (layers, width, heads, vocabulary)",
                 t->zc.zinf.base_job, full, ti.bytes, bytes);
        return -EINVAL;
    }
    return 0;
}

/* Whether other jobs hold pins in the base's tier: a set that does not fit while nothing
 * is pinned never will. */
static bool others_hold(struct trainer *t, enum zinf_tier tier)
{
    struct zinf_stats st;
    return zinf_stats(t->base_e, &st) == 0 && st.tier[tier].pinned_bytes > 0;
}

int train_fetch_set(struct trainer *t, const struct wave *w, const zinf_tensor *hs,
                    enum zinf_tier tier, void **m)
{
    if (!t->base_e) return zinf_fetch_all(t->e, hs, (size_t)w->n, tier, m);
    zinf_tensor h[2][WAVE_MAX];
    void *p[2][WAVE_MAX];
    int at[WAVE_MAX], n[2] = {0, 0};
    for (int i = 0; i < w->n; i++) {
        int k = train_engine_of(t, w->role[i], w->idx[i]) == t->base_e;
        at[i] = n[k];
        h[k][n[k]++] = hs[i];
    }
    /* Each engine's part whole or not at all, the base's first: nothing is left pinned by a
     * set that failed. The base's tier is shared with the other jobs on it, whose sets may
     * hold it full for a while: with none of ours pinned there, -ENOMEM means theirs, and
     * the set is asked again once they released some (each holds one set at a time, so one
     * of them always can go on), for up to BASE_WAIT_NS. */
    int r = 0;
    uint64_t t0 = now_ns();
    while (n[1] && (r = zinf_fetch_all(t->base_e, h[1], (size_t)n[1], tier, p[1])) == -ENOMEM &&
           now_ns() - t0 < BASE_WAIT_NS && others_hold(t, tier))
        nanosleep(&(struct timespec){0, 200000}, NULL);
    if (r == 0 && n[0] && (r = zinf_fetch_all(t->e, h[0], (size_t)n[0], tier, p[0])) < 0)
        for (int j = 0; j < n[1]; j++)
            zinf_release(t->base_e, h[1][j], tier, 0);
    if (r < 0) return r;
    for (int i = 0; i < w->n; i++)
        m[i] = p[train_engine_of(t, w->role[i], w->idx[i]) == t->base_e][at[i]];
    return 0;
}

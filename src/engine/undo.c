/*
 * undo.c - undo images: the content a pinned copy held when it was pinned, kept while a
 * caller that may die holding it (a client of the service) holds it.
 *
 * A caller writes through its pin and publishes what it wrote with a DIRTY release. One
 * that dies first may leave the copy half-written. Where the engine holds the same content
 * elsewhere, the copy is dropped and the tensor reads as last released (abandon_locked).
 * Where it does not (the copy is the tensor's home in memory, or the home is stale and the
 * newest content is only in memory), the engine
 * keeps an image of it while it is pinned, and puts that back when the pin is abandoned.
 *
 * Only engines that serve other processes keep images (e->undo: the service's), in host
 * memory, copied with the lock held: with memcpy from the host tier or an emulated device
 * tier, with a synchronous copy of its own from a CUDA arena (device_copy_now: it waits for
 * no other copy and no completion, which take the lock). An image
 * is kept while its copy is pinned or leased (a client may pin a leased copy again without
 * a message, so it must exist before the slot opens), and taken again when a DIRTY
 * release or zinf_write makes a new version of a copy that still needs one. So a tensor
 * whose newest content lives only in memory costs one copy of it per new version and the
 * memory of that copy while clients use it; one whose content is also on its NVMe home
 * costs nothing.
 *
 * Lock held in every function here.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

bool undo_needed(const struct zinf_engine *e, const struct tensor *t, int tier)
{
    const struct copy *c = &t->c[tier];
    if (!(e->undo & (1u << tier)) || c->state != COPY_READY || c->version != t->version)
        return false;
    /* A home copy is always its tensor's only copy in memory of that role: its swap
     * extent, when there is one, is read back only at a resume. */
    if (tier == (int)t->home) return true;
    return !engine_home_valid(t);
}

void undo_free(struct copy *c)
{
    free(c->undo);
    c->undo = NULL;
    c->undo_version = 0;
}

/* Copies between a copy and its image, in direction dir (D2H: into the image). */
static int image_copy(struct zinf_engine *e, struct tensor *t, int tier, enum device_dir dir)
{
    struct copy *c = &t->c[tier];
    if (t->nbytes == 0) return 0;
    if (tier == ZINF_TIER_DEVICE)
        return device_copy_now(e->dev, dir, c->off, c->undo, t->nbytes);
    if (dir == DEVICE_D2H)
        memcpy(c->undo, c->ptr, t->nbytes);
    else
        memcpy(c->ptr, c->undo, t->nbytes);
    return 0;
}

static int image_take(struct zinf_engine *e, struct tensor *t, int tier)
{
    struct copy *c = &t->c[tier];
    if (c->undo && c->undo_version == t->version) return 0;
    if (!c->undo && !(c->undo = malloc(t->nbytes ? t->nbytes : 1))) return -ENOMEM;
    int r = image_copy(e, t, tier, DEVICE_D2H);
    if (r < 0) {
        undo_free(c);
        return r;
    }
    c->undo_version = t->version;
    return 0;
}

void undo_settle(struct zinf_engine *e, struct tensor *t)
{
    if (!e->undo) return;
    for (int k = 0; k < MEM_TIERS; k++) {
        struct copy *c = &t->c[k];
        if (!undo_needed(e, t, k)) {
            if (c->undo) undo_free(c);
            continue;
        }
        if (c->pins == 0) { /* neither pinned nor leased */
            if (c->undo) undo_free(c);
            continue;
        }
        int r = image_take(e, t, k);
        if (r < 0)
            log_warn("engine: tensor '%s': no undo image (%s): if its client dies holding "
                     "it, what it wrote stays",
                     t->name, zinf_strerror(r));
    }
}

bool undo_restore(struct zinf_engine *e, struct tensor *t, int tier)
{
    struct copy *c = &t->c[tier];
    if (!c->undo || c->undo_version != t->version || c->state != COPY_READY ||
        c->version != t->version)
        return false;
    int r = image_copy(e, t, tier, DEVICE_H2D);
    if (r < 0) {
        log_warn("engine: tensor '%s': its undo image could not be put back (%s): what its "
                 "dead client wrote stays",
                 t->name, zinf_strerror(r));
        return false;
    }
    lease_publish(e);
    return true;
}

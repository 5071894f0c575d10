/*
 * api.c - the public calls of zinf.h that act on a zinf_engine *: each goes to the engine
 * of this process (engine_api_*, src/engine/) or, for a handle zinf_connect() returned, to
 * the client of a zinf daemon (client_*, src/service/client.c), which answers them exactly
 * as the engine would (same results, same errors, pointers into the same kind of memory),
 * but for the versioned flushes (zinf_flush_step, zinf_drop_previous): a daemon's job keeps
 * one version of its state, and they answer -ENOTSUP there.
 *
 * Not here: opening either kind of handle (zinf_open* in engine.c, zinf_connect in
 * client.c), the calls that read a swap directory without an engine (zinf_saved_*, in
 * manifest.c), or any work of its own.
 */
#include <errno.h>

#include "api.h"
#include "common.h"
#include "engine/engine.h"
#include "handle.h"
#include "service/client.h"

static inline struct client *remote(zinf_engine *e)
{
    return e && ((const struct handle *)e)->kind == HANDLE_CLIENT ? (struct client *)e : NULL;
}

ZINF_API void zinf_close(zinf_engine *e)
{
    struct client *c = remote(e);
    if (c)
        client_close(c);
    else
        engine_api_close(e);
}

ZINF_API int zinf_register(zinf_engine *e, const char *name, size_t nbytes, enum zinf_tier home,
                           zinf_tensor *out)
{
    struct client *c = remote(e);
    return c ? client_register(c, name, nbytes, home, out)
             : engine_api_register(e, name, nbytes, home, out);
}

ZINF_API int zinf_lookup(zinf_engine *e, const char *name, zinf_tensor *out)
{
    struct client *c = remote(e);
    return c ? client_lookup(c, name, out) : engine_api_lookup(e, name, out);
}

ZINF_API int zinf_unregister(zinf_engine *e, zinf_tensor t)
{
    struct client *c = remote(e);
    return c ? client_unregister(c, t) : engine_api_unregister(e, t);
}

ZINF_API int zinf_tensor_info(zinf_engine *e, zinf_tensor t, struct zinf_tensor_info *out)
{
    struct client *c = remote(e);
    return c ? client_tensor_info(c, t, out) : engine_api_tensor_info(e, t, out);
}

ZINF_API int zinf_fetch(zinf_engine *e, zinf_tensor t, enum zinf_tier tier, void **ptr)
{
    struct client *c = remote(e);
    return c ? client_fetch(c, t, tier, ptr) : engine_api_fetch(e, t, tier, ptr);
}

ZINF_API int zinf_fetch_async(zinf_engine *e, zinf_tensor t, enum zinf_tier tier, uint64_t *ticket)
{
    struct client *c = remote(e);
    return c ? client_fetch_async(c, t, tier, ticket) : engine_api_fetch_async(e, t, tier, ticket);
}

ZINF_API int zinf_wait(zinf_engine *e, uint64_t ticket, void **ptr)
{
    struct client *c = remote(e);
    return c ? client_wait(c, ticket, ptr) : engine_api_wait(e, ticket, ptr);
}

ZINF_API int zinf_fetch_all(zinf_engine *e, const zinf_tensor *ts, size_t n, enum zinf_tier tier,
                            void **ptrs)
{
    struct client *c = remote(e);
    return c ? client_fetch_all(c, ts, n, tier, ptrs) : engine_api_fetch_all(e, ts, n, tier, ptrs);
}

ZINF_API int zinf_release(zinf_engine *e, zinf_tensor t, enum zinf_tier tier, unsigned flags)
{
    struct client *c = remote(e);
    return c ? client_release(c, t, tier, flags) : engine_api_release(e, t, tier, flags);
}

ZINF_API int zinf_zero(zinf_engine *e, zinf_tensor t)
{
    struct client *c = remote(e);
    return c ? client_zero(c, t) : engine_api_zero(e, t);
}

ZINF_API int zinf_prefetch(zinf_engine *e, zinf_tensor t, enum zinf_tier tier)
{
    struct client *c = remote(e);
    return c ? client_prefetch(c, t, tier) : engine_api_prefetch(e, t, tier);
}

ZINF_API int zinf_step(zinf_engine *e)
{
    struct client *c = remote(e);
    return c ? client_step(c) : engine_api_step(e);
}

ZINF_API int zinf_write(zinf_engine *e, zinf_tensor t, size_t off, const void *src, size_t n)
{
    struct client *c = remote(e);
    return c ? client_write(c, t, off, src, n) : engine_api_write(e, t, off, src, n);
}

ZINF_API int zinf_read(zinf_engine *e, zinf_tensor t, size_t off, void *dst, size_t n)
{
    struct client *c = remote(e);
    return c ? client_read(c, t, off, dst, n) : engine_api_read(e, t, off, dst, n);
}

ZINF_API int zinf_flush(zinf_engine *e)
{
    struct client *c = remote(e);
    return c ? client_flush(c) : engine_api_flush(e);
}

ZINF_API int zinf_flush_step(zinf_engine *e, int64_t step, unsigned flags)
{
    if (!e || step < -1 || (flags & ~ZINF_FLUSH_KEEP_PREVIOUS)) return -EINVAL;
    /* A daemon's job keeps one version of its state; tags and kept versions are not in
     * its protocol. */
    if (remote(e)) return -ENOTSUP;
    return engine_flush_tagged(e, step, (flags & ZINF_FLUSH_KEEP_PREVIOUS) != 0);
}

ZINF_API int zinf_drop_previous(zinf_engine *e)
{
    if (!e) return -EINVAL;
    if (remote(e)) return -ENOTSUP;
    return engine_drop_previous(e);
}

ZINF_API int zinf_stats(zinf_engine *e, struct zinf_stats *out)
{
    struct client *c = remote(e);
    return c ? client_stats(c, out) : engine_api_stats(e, out);
}

bool api_is_remote(zinf_engine *e)
{
    return remote(e) != NULL;
}

ZINF_API void zinf_close_unflushed(zinf_engine *e)
{
    struct client *c = remote(e);
    if (c)
        client_close_unflushed(c);
    else
        engine_close_unflushed(e);
}

void api_close_unflushed(zinf_engine *e)
{
    zinf_close_unflushed(e);
}

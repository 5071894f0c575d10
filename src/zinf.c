/*
 * zinf.c - the library-wide public functions that belong to no layer: version and
 * error strings.
 */
#include <errno.h>
#include <limits.h>
#include <string.h>

#include "common.h"

ZINF_API const char *zinf_version(void)
{
    return ZINF_VERSION;
}

ZINF_API const char *zinf_strerror(int err)
{
    /* -INT_MIN does not exist: no errno is that large, so it is simply unknown. */
    if (err == INT_MIN)
        return "unknown error";
    if (err > 0)
        err = -err;
    switch (err) {
    case 0: return "success";
    case -EINVAL: return "invalid argument (bad handle, unaligned or out-of-range request)";
    case -ENOMEM: return "out of memory in the tier (every unpinned copy evicted, still no room)";
    case -ENOSPC: return "no space left (tier capacity or swap directory full)";
    case -EEXIST: return "already exists (a tensor of this name, or a saved state in the swap "
                         "directory: resume it, open it read-only, or overwrite it)";
    case -EROFS: return "the engine was opened read-only";
    case -ENOENT: return "no such tensor or file";
    case -EBUSY: return "busy: the tensor is pinned or writable in another tier, or (opening "
                        "an engine) the swap directory or the device arena lent to it is in "
                        "use by another one";
    case -EIO: return "input/output error on the swap device";
    case -EBADMSG: return "corrupted data: checksum mismatch in a swap file";
    case -EUSERS: return "refused: a limit of the daemon (zinf.serve: jobs, sessions or "
                         "connections per uid, or in all; the line logged names it)";
    case -ESTALE: return "stale: the saved state was replaced since this read-only engine "
                         "opened it; reopen it";
    case -ENODATA: return "read past the end of the file";
    case -ESHUTDOWN: return "the engine is closing";
    case -ENOSYS: return "not supported by this kernel";
    case -ENOTSUP: return "not supported by this backend";
    case -EPERM: return "not permitted (opening an engine: the host tier could not be locked "
                        "in memory, RLIMIT_MEMLOCK is below it; see the line logged above)";
    default: return strerror(-err);
    }
}

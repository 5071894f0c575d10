/*
 * fail_memstream.c - preloaded into a zinf process by the cli tests: open_memstream fails
 * with ENOMEM from its ZINF_TEST_MEMSTREAM_FAIL_AT-th call on (1: the first), as it would
 * where memory ran out. Without that variable every call goes to the C library's.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

__attribute__((visibility("default"))) FILE *open_memstream(char **ptr, size_t *size)
{
    static atomic_int calls;
    const char *at = getenv("ZINF_TEST_MEMSTREAM_FAIL_AT");
    if (at && atoi(at) > 0 && atomic_fetch_add(&calls, 1) + 1 >= atoi(at)) {
        errno = ENOMEM;
        return NULL;
    }
    typedef FILE *(*open_fn)(char **, size_t *);
    open_fn real = (open_fn)dlsym(RTLD_NEXT, "open_memstream");
    if (!real) {
        errno = ENOSYS;
        return NULL;
    }
    return real(ptr, size);
}

/*
 * hugemem.c - see hugemem.h.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"
#include "hugemem.h"

void *hugemem_map(size_t bytes, bool huge, bool *huge_ok, int *err)
{
    size_t len = align_up(bytes, ZINF_ALIGN);
    size_t span = len + (huge ? HUGEMEM_PAGE_BYTES : 0);
    char *p, *base;

    if (huge_ok) *huge_ok = false;
    if (bytes == 0 || bytes > SIZE_MAX / 2) {
        *err = -EINVAL;
        return NULL;
    }
    p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        *err = -errno;
        return NULL;
    }
    if (!huge) return p;
    /* Keep the 2 MiB aligned part of a mapping one huge page larger, and give back the
     * rest: huge pages only back aligned 2 MiB ranges. */
    base = (char *)align_up((uint64_t)(uintptr_t)p, HUGEMEM_PAGE_BYTES);
    if (base > p) munmap(p, (size_t)(base - p));
    if (p + span > base + len) munmap(base + len, (size_t)(p + span - (base + len)));
    int r = madvise(base, len, MADV_HUGEPAGE);
    if (huge_ok) *huge_ok = r == 0;
    return base;
}

/* Does the kernel back shared memory advised MADV_HUGEPAGE with huge pages? Only where
 * transparent huge pages for shmem are "always", "within_size", "advise" or "force". */
static bool shmem_huge_advised(void)
{
    char buf[128];
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "re");
    if (!f) return false;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *sel = strchr(buf, '[');
    return sel && strncmp(sel, "[never]", 7) != 0 && strncmp(sel, "[deny]", 6) != 0;
}

void *hugemem_map_shared(size_t bytes, bool huge, const char *name, bool *huge_ok, int *fd,
                         int *err)
{
    size_t len = align_up(bytes, ZINF_ALIGN);
    size_t span = len + (huge ? HUGEMEM_PAGE_BYTES : 0);

    *fd = -1;
    if (huge_ok) *huge_ok = false;
    if (bytes == 0 || bytes > SIZE_MAX / 2) {
        *err = -EINVAL;
        return NULL;
    }
    int f = hugemem_memfd(name, len, NULL);
    if (f < 0) {
        *err = f;
        return NULL;
    }
    /* Reserve a span, then map the file at its 2 MiB aligned start over it. */
    char *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        *err = -errno;
        close(f);
        return NULL;
    }
    char *base = huge ? (char *)align_up((uint64_t)(uintptr_t)p, HUGEMEM_PAGE_BYTES) : p;
    if (mmap(base, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, f, 0) == MAP_FAILED) {
        *err = -errno;
        munmap(p, span);
        close(f);
        return NULL;
    }
    if (base > p) munmap(p, (size_t)(base - p));
    if (p + span > base + len) munmap(base + len, (size_t)(p + span - (base + len)));
    if (huge) {
        int r = madvise(base, len, MADV_HUGEPAGE);
        if (huge_ok) *huge_ok = r == 0 && shmem_huge_advised();
    }
    *fd = f;
    return base;
}

int hugemem_memfd(const char *name, size_t bytes, void **map)
{
    int f = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (f < 0) return -errno;
    int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
    void *p = MAP_FAILED;
    int r = ftruncate(f, (off_t)bytes) == 0 ? 0 : -errno;
    if (r == 0 && map) {
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
        if (p == MAP_FAILED) r = -errno;
        seals |= F_SEAL_FUTURE_WRITE;
    }
    if (r == 0 && fcntl(f, F_ADD_SEALS, seals) != 0) r = -errno;
    if (r < 0) {
        if (p != MAP_FAILED) munmap(p, bytes);
        close(f);
        return r;
    }
    if (map) *map = p;
    return f;
}

void hugemem_unmap(void *p, size_t bytes)
{
    if (p) munmap(p, align_up(bytes, ZINF_ALIGN));
}

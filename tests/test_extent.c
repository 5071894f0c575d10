/*
 * test_extent.c - the extent allocator, alone and against a reference model: a map of
 * granules that records which allocation owns each, where best fit is a plain scan.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "helpers.h"
#include "tiers/extent.h"

#define G 4096u

static void stats(const struct extent_alloc *a, struct extent_stats *s)
{
    extent_get_stats(a, s);
}

TestSuite(extent, .fini = test_leak_check);

Test(extent, init_and_fini)
{
    struct extent_alloc a;
    struct extent_stats s;

    cr_assert_eq(extent_init(&a, 64 * G, G), 0);
    stats(&a, &s);
    cr_expect_eq(s.capacity_bytes, 64 * G);
    cr_expect_eq(s.free_bytes, 64 * G);
    cr_expect_eq(s.used_bytes, 0);
    cr_expect_eq(s.largest_free_bytes, 64 * G);
    cr_expect_eq(s.tail_free_bytes, 64 * G);
    cr_expect_eq(s.free_extents, 1);
    cr_expect_eq(s.used_extents, 0);
    cr_expect_eq(extent_validate(&a), 0);
    extent_fini(&a);
    extent_fini(&a); /* twice is harmless */

    struct extent_alloc z = {0};
    extent_fini(&z);
    extent_fini(NULL);
}

Test(extent, init_bad_args)
{
    struct extent_alloc a;

    cr_expect_eq(extent_init(NULL, G, G), -EINVAL);
    cr_expect_eq(extent_init(&a, G, 0), -EINVAL);
    extent_fini(&a);
    cr_expect_eq(extent_init(&a, 3 * G, 3 * G), -EINVAL); /* not a power of two */
    extent_fini(&a);
    cr_expect_eq(extent_init(&a, G + 512, G), -EINVAL); /* capacity not a multiple */
    extent_fini(&a);
}

Test(extent, empty_then_grow)
{
    struct extent_alloc a;
    struct extent_stats s;
    uint64_t off;

    cr_assert_eq(extent_init(&a, 0, G), 0);
    cr_expect_eq(extent_alloc(&a, G, &off), -ENOSPC);
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 0);
    cr_expect_eq(s.largest_free_bytes, 0);
    cr_assert_eq(extent_grow(&a, 4 * G), 0);
    cr_expect_eq(extent_alloc(&a, 4 * G, &off), 0);
    cr_expect_eq(off, 0);
    cr_expect_eq(extent_validate(&a), 0);
    extent_fini(&a);
}

Test(extent, alloc_rounds_up_to_granularity)
{
    struct extent_alloc a;
    uint64_t off, start, len;

    cr_assert_eq(extent_init(&a, 16 * G, G), 0);
    cr_assert_eq(extent_alloc(&a, 1, &off), 0);
    cr_expect_eq(off, 0);
    cr_assert_eq(extent_alloc(&a, G + 1, &off), 0);
    cr_expect_eq(off, G);
    cr_assert_eq(extent_find(&a, off + G + 17, &start, &len), 0);
    cr_expect_eq(start, G);
    cr_expect_eq(len, 2 * G);
    struct extent_stats s;
    stats(&a, &s);
    cr_expect_eq(s.used_bytes, 3 * G);
    cr_expect_eq(s.free_bytes, 13 * G);
    extent_fini(&a);
}

Test(extent, alloc_bad_args)
{
    struct extent_alloc a;
    uint64_t off;

    cr_assert_eq(extent_init(&a, 16 * G, G), 0);
    cr_expect_eq(extent_alloc(&a, 0, &off), -EINVAL);
    cr_expect_eq(extent_alloc(&a, G, NULL), -EINVAL);
    cr_expect_eq(extent_alloc(NULL, G, &off), -EINVAL);
    cr_expect_eq(extent_alloc(&a, 17 * G, &off), -ENOSPC);
    cr_expect_eq(extent_alloc(&a, UINT64_MAX, &off), -ENOSPC); /* no overflow in rounding */
    cr_expect_eq(extent_validate(&a), 0);
    extent_fini(&a);
}

Test(extent, best_fit_picks_smallest_then_lowest)
{
    struct extent_alloc a;
    uint64_t o[8], off;

    /* Lay out [A:1][B:4][C:1][D:2][E:1][F:2][G:1][tail:4] in granules, then free B, D, F:
     * holes of 4 at 1, 2 at 6, 2 at 9, and the tail of 4 at 12. */
    static const unsigned sizes[] = {1, 4, 1, 2, 1, 2, 1};
    cr_assert_eq(extent_init(&a, 16 * G, G), 0);
    for (unsigned i = 0; i < ARRAY_SIZE(sizes); i++)
        cr_assert_eq(extent_alloc(&a, sizes[i] * G, &o[i]), 0);
    cr_assert_eq(extent_free(&a, o[1]), 0);
    cr_assert_eq(extent_free(&a, o[3]), 0);
    cr_assert_eq(extent_free(&a, o[5]), 0);
    cr_assert_eq(extent_validate(&a), 0);

    cr_assert_eq(extent_alloc(&a, 2 * G, &off), 0); /* a 2-hole, the lower one */
    cr_expect_eq(off, 6 * G);
    cr_assert_eq(extent_alloc(&a, 1 * G, &off), 0); /* the other 2-hole beats the 4s */
    cr_expect_eq(off, 9 * G);
    cr_assert_eq(extent_alloc(&a, 3 * G, &off), 0); /* two 4s: the lower one */
    cr_expect_eq(off, 1 * G);
    cr_assert_eq(extent_alloc(&a, 2 * G, &off), 0); /* 1 left at 4 is too small: tail */
    cr_expect_eq(off, 12 * G);
    cr_expect_eq(extent_validate(&a), 0);
    extent_fini(&a);
}

Test(extent, frees_coalesce_to_one_extent)
{
    struct extent_alloc a;
    struct extent_stats s;
    enum { N = 512 };
    uint64_t off[N], seed = 7;
    unsigned order[N];

    cr_assert_eq(extent_init(&a, N * 3 * G, G), 0);
    for (unsigned i = 0; i < N; i++) {
        cr_assert_eq(extent_alloc(&a, (1 + i % 3) * G, &off[i]), 0);
        order[i] = i;
    }
    for (unsigned i = N - 1; i > 0; i--) {
        unsigned j = test_rand(&seed) % (i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    for (unsigned i = 0; i < N; i++) {
        cr_assert_eq(extent_free(&a, off[order[i]]), 0);
        if (i % 64 == 0) cr_assert_eq(extent_validate(&a), 0);
    }
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 1);
    cr_expect_eq(s.used_extents, 0);
    cr_expect_eq(s.largest_free_bytes, N * 3 * G);
    cr_expect_eq(s.free_bytes, N * 3 * G);
    cr_expect_eq(s.used_bytes, 0);
    cr_expect_eq(extent_validate(&a), 0);
    extent_fini(&a);
}

Test(extent, coalesce_each_neighbour_case)
{
    struct extent_alloc a;
    struct extent_stats s;
    uint64_t o[5];

    cr_assert_eq(extent_init(&a, 5 * G, G), 0);
    for (int i = 0; i < 5; i++)
        cr_assert_eq(extent_alloc(&a, G, &o[i]), 0);
    cr_assert_eq(extent_free(&a, o[1]), 0); /* no free neighbour */
    cr_assert_eq(extent_free(&a, o[3]), 0);
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 2);
    cr_assert_eq(extent_free(&a, o[2]), 0); /* both neighbours free */
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 1);
    cr_expect_eq(s.largest_free_bytes, 3 * G);
    cr_assert_eq(extent_free(&a, o[0]), 0); /* only the next one free */
    cr_assert_eq(extent_free(&a, o[4]), 0); /* only the previous one free */
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 1);
    cr_expect_eq(s.largest_free_bytes, 5 * G);
    cr_expect_eq(extent_validate(&a), 0);
    extent_fini(&a);
}

Test(extent, enospc_when_fragmented)
{
    struct extent_alloc a;
    struct extent_stats before, after;
    uint64_t o[8], off;

    cr_assert_eq(extent_init(&a, 8 * G, G), 0);
    for (int i = 0; i < 8; i++)
        cr_assert_eq(extent_alloc(&a, G, &o[i]), 0);
    for (int i = 0; i < 8; i += 2)
        cr_assert_eq(extent_free(&a, o[i]), 0);
    stats(&a, &before);
    cr_expect_eq(before.free_bytes, 4 * G);
    cr_expect_eq(before.largest_free_bytes, G);
    cr_expect_eq(extent_alloc(&a, 2 * G, &off), -ENOSPC);
    stats(&a, &after);
    cr_expect_eq(memcmp(&before, &after, sizeof(before)), 0);
    cr_expect_eq(extent_validate(&a), 0);
    cr_expect_eq(extent_alloc(&a, G, &off), 0);
    extent_fini(&a);
}

Test(extent, double_free_and_stray_offsets_are_einval)
{
    struct extent_alloc a;
    struct extent_stats before, after;
    uint64_t x, y;

    cr_assert_eq(extent_init(&a, 16 * G, G), 0);
    cr_assert_eq(extent_alloc(&a, 2 * G, &x), 0);
    cr_assert_eq(extent_alloc(&a, 2 * G, &y), 0);
    cr_assert_eq(extent_free(&a, x), 0);
    stats(&a, &before);
    cr_expect_eq(extent_free(&a, x), -EINVAL);        /* double free */
    cr_expect_eq(extent_free(&a, y + G), -EINVAL);    /* inside a live extent */
    cr_expect_eq(extent_free(&a, 8 * G), -EINVAL);    /* inside free space */
    cr_expect_eq(extent_free(&a, 1000 * G), -EINVAL); /* beyond capacity */
    cr_expect_eq(extent_free(&a, y + 1), -EINVAL);    /* unaligned */
    cr_expect_eq(extent_free(NULL, y), -EINVAL);
    stats(&a, &after);
    cr_expect_eq(memcmp(&before, &after, sizeof(before)), 0);
    cr_expect_eq(extent_validate(&a), 0);
    cr_expect_eq(extent_free(&a, y), 0);
    cr_expect_eq(extent_free(&a, y), -EINVAL);
    extent_fini(&a);
}

Test(extent, find)
{
    struct extent_alloc a;
    uint64_t x, start = 0, len = 0;

    cr_assert_eq(extent_init(&a, 16 * G, G), 0);
    cr_assert_eq(extent_alloc(&a, G, &x), 0);
    cr_assert_eq(extent_alloc(&a, 3 * G, &x), 0);
    cr_expect_eq(extent_find(&a, x, &start, &len), 0);
    cr_expect_eq(start, x);
    cr_expect_eq(len, 3 * G);
    cr_expect_eq(extent_find(&a, x + 3 * G - 1, &start, NULL), 0);
    cr_expect_eq(start, x);
    cr_expect_eq(extent_find(&a, x + 3 * G, NULL, NULL), -ENOENT);
    cr_expect_eq(extent_find(&a, 100 * G, NULL, NULL), -ENOENT);
    cr_expect_eq(extent_free(&a, x), 0);
    cr_expect_eq(extent_find(&a, x, NULL, NULL), -ENOENT);
    extent_fini(&a);
}

Test(extent, grow)
{
    struct extent_alloc a;
    struct extent_stats s;
    uint64_t x, y;

    cr_assert_eq(extent_init(&a, 4 * G, G), 0);
    cr_assert_eq(extent_alloc(&a, 2 * G, &x), 0);
    /* Free tail [2, 4): growing extends it. */
    cr_assert_eq(extent_grow(&a, 8 * G), 0);
    stats(&a, &s);
    cr_expect_eq(s.capacity_bytes, 8 * G);
    cr_expect_eq(s.free_extents, 1);
    cr_expect_eq(s.largest_free_bytes, 6 * G);
    cr_expect_eq(s.tail_free_bytes, 6 * G);
    /* Used tail: growing adds a new extent. */
    cr_assert_eq(extent_alloc(&a, 6 * G, &y), 0);
    stats(&a, &s);
    cr_expect_eq(s.tail_free_bytes, 0);
    cr_assert_eq(extent_grow(&a, 10 * G), 0);
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 1);
    cr_expect_eq(s.free_bytes, 2 * G);
    cr_expect_eq(s.tail_free_bytes, 2 * G);
    /* Freeing the last allocation merges it with the grown tail. */
    cr_assert_eq(extent_free(&a, y), 0);
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 1);
    cr_expect_eq(s.largest_free_bytes, 8 * G);

    cr_expect_eq(extent_grow(&a, 10 * G), 0);      /* same size: nothing to do */
    cr_expect_eq(extent_grow(&a, 9 * G), -EINVAL); /* shrinking */
    cr_expect_eq(extent_grow(&a, 11 * G + 1), -EINVAL);
    cr_expect_eq(extent_grow(NULL, 11 * G), -EINVAL);
    stats(&a, &s);
    cr_expect_eq(s.capacity_bytes, 10 * G);
    cr_expect_eq(extent_validate(&a), 0);
    extent_fini(&a);
}

/* Reserve the start, the middle, the end and then the whole of a free extent: each split
 * leaves the expected remainders, and a reserved range frees like an allocation. */
Test(extent, reserve_splits_free_extent)
{
    struct extent_alloc a;
    struct extent_stats s;
    uint64_t x, off, start, len;

    /* [x:2][free:14]: the free extent is [2, 16). */
    cr_assert_eq(extent_init(&a, 16 * G, G), 0);
    cr_assert_eq(extent_alloc(&a, 2 * G, &x), 0);

    cr_assert_eq(extent_reserve(&a, 2 * G, G), 0); /* start: one remainder after */
    cr_assert_eq(extent_validate(&a), 0);
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 1);
    cr_expect_eq(s.largest_free_bytes, 13 * G);
    cr_expect_eq(s.used_extents, 2);

    cr_assert_eq(extent_reserve(&a, 15 * G, 1), 0); /* end, rounded up: one remainder before */
    cr_assert_eq(extent_validate(&a), 0);
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 1);
    cr_expect_eq(s.tail_free_bytes, 0);
    cr_expect_eq(s.largest_free_bytes, 12 * G);

    cr_assert_eq(extent_reserve(&a, 6 * G, 3 * G - 100), 0); /* middle: two remainders */
    cr_assert_eq(extent_validate(&a), 0);
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 2); /* [3, 6) and [9, 15) */
    cr_expect_eq(s.largest_free_bytes, 6 * G);
    cr_expect_eq(s.used_bytes, 2 * G + G + G + 3 * G);
    cr_expect_eq(s.free_bytes, 9 * G);
    cr_assert_eq(extent_find(&a, 8 * G + 5, &start, &len), 0);
    cr_expect_eq(start, 6 * G);
    cr_expect_eq(len, 3 * G);

    cr_assert_eq(extent_reserve(&a, 3 * G, 3 * G), 0); /* the whole extent: none left */
    cr_assert_eq(extent_validate(&a), 0);
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 1);
    cr_expect_eq(s.largest_free_bytes, 6 * G);

    /* Best fit now sees only [9, 15). */
    cr_assert_eq(extent_alloc(&a, G, &off), 0);
    cr_expect_eq(off, 9 * G);

    /* Reserved ranges free like allocations and coalesce with their neighbours. */
    cr_assert_eq(extent_free(&a, 6 * G), 0);
    cr_expect_eq(extent_free(&a, 6 * G), -EINVAL);
    cr_assert_eq(extent_free(&a, 3 * G), 0);
    cr_assert_eq(extent_free(&a, 2 * G), 0);
    cr_assert_eq(extent_free(&a, 15 * G), 0);
    cr_assert_eq(extent_free(&a, off), 0);
    cr_assert_eq(extent_free(&a, x), 0);
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 1);
    cr_expect_eq(s.used_extents, 0);
    cr_expect_eq(s.largest_free_bytes, 16 * G);
    cr_expect_eq(extent_validate(&a), 0);
    extent_fini(&a);
}

/* Rebuilding a full layout by reserving every range, in any order, before any alloc. */
Test(extent, reserve_rebuilds_layout_in_any_order)
{
    static const unsigned at[] = {9, 0, 14, 3, 6}; /* granule offsets */
    static const unsigned len[] = {2, 1, 2, 3, 2}; /* granules */
    struct extent_alloc a;
    struct extent_stats s;
    uint64_t off;

    cr_assert_eq(extent_init(&a, 16 * G, G), 0);
    for (unsigned i = 0; i < ARRAY_SIZE(at); i++) {
        cr_assert_eq(extent_reserve(&a, at[i] * G, len[i] * G), 0, "range %u", i);
        cr_assert_eq(extent_validate(&a), 0);
    }
    /* Free: [1, 3), [8, 9), [11, 14). */
    stats(&a, &s);
    cr_expect_eq(s.free_extents, 3);
    cr_expect_eq(s.free_bytes, 6 * G);
    cr_expect_eq(s.used_extents, 5);
    cr_expect_eq(s.tail_free_bytes, 0);
    cr_assert_eq(extent_alloc(&a, 3 * G, &off), 0);
    cr_expect_eq(off, 11 * G);
    cr_assert_eq(extent_alloc(&a, G, &off), 0);
    cr_expect_eq(off, 8 * G);
    cr_expect_eq(extent_validate(&a), 0);
    extent_fini(&a);
}

Test(extent, reserve_bad_args_and_overlap)
{
    struct extent_alloc a;
    struct extent_stats before, after;
    uint64_t x, y;

    /* [x:2 at 4][free][y:2 at 10][free]: x and y are reserved, the rest is free. */
    cr_assert_eq(extent_init(&a, 16 * G, G), 0);
    cr_assert_eq(extent_reserve(&a, 4 * G, 2 * G), 0);
    cr_assert_eq(extent_reserve(&a, 10 * G, 2 * G), 0);
    x = 4 * G;
    y = 10 * G;
    stats(&a, &before);

    cr_expect_eq(extent_reserve(&a, 0, 0), -EINVAL);
    cr_expect_eq(extent_reserve(NULL, 0, G), -EINVAL);
    cr_expect_eq(extent_reserve(&a, 512, G), -EINVAL);        /* unaligned */
    cr_expect_eq(extent_reserve(&a, 16 * G, G), -EINVAL);     /* at the capacity */
    cr_expect_eq(extent_reserve(&a, 15 * G, G + 1), -EINVAL); /* runs past it */
    cr_expect_eq(extent_reserve(&a, 100 * G, G), -EINVAL);    /* far beyond */
    cr_expect_eq(extent_reserve(&a, 0, UINT64_MAX), -EINVAL); /* no overflow in rounding */
    cr_expect_eq(extent_reserve(&a, 14 * G, UINT64_MAX), -EINVAL);
    cr_expect_eq(extent_reserve(&a, UINT64_MAX & ~(uint64_t)(G - 1), G), -EINVAL);

    cr_expect_eq(extent_reserve(&a, x, 2 * G), -EEXIST);      /* exactly an allocation */
    cr_expect_eq(extent_reserve(&a, x + G, G), -EEXIST);      /* inside one */
    cr_expect_eq(extent_reserve(&a, 3 * G, 2 * G), -EEXIST);  /* free, then into x */
    cr_expect_eq(extent_reserve(&a, 3 * G, G + 1), -EEXIST);  /* rounding reaches x */
    cr_expect_eq(extent_reserve(&a, x + G, 2 * G), -EEXIST);  /* out of x into free */
    cr_expect_eq(extent_reserve(&a, 2 * G, 10 * G), -EEXIST); /* across x and y */
    cr_expect_eq(extent_reserve(&a, y + G, G), -EEXIST);      /* inside y */
    cr_expect_eq(extent_reserve(&a, 6 * G, 6 * G), -EEXIST);  /* a whole gap and into y */
    cr_expect_eq(extent_reserve(&a, y + G, 4 * G), -EEXIST);  /* out of y to the end */
    cr_expect_eq(extent_reserve(&a, 0, 16 * G), -EEXIST);     /* everything */
    stats(&a, &after);
    cr_expect_eq(memcmp(&before, &after, sizeof(before)), 0);
    cr_expect_eq(extent_validate(&a), 0);

    /* The gaps themselves can be taken exactly. */
    cr_expect_eq(extent_reserve(&a, 6 * G, 4 * G), 0);
    cr_expect_eq(extent_reserve(&a, 0, 4 * G), 0);
    cr_expect_eq(extent_reserve(&a, 12 * G, 4 * G), 0);
    stats(&a, &after);
    cr_expect_eq(after.free_extents, 0);
    cr_expect_eq(after.used_bytes, 16 * G);
    cr_expect_eq(extent_validate(&a), 0);

    /* With no capacity at all (grow later) every reserve is out of range. */
    struct extent_alloc z;
    cr_assert_eq(extent_init(&z, 0, G), 0);
    cr_expect_eq(extent_reserve(&z, 0, G), -EINVAL);
    cr_assert_eq(extent_grow(&z, 2 * G), 0);
    cr_expect_eq(extent_reserve(&z, G, G), 0);
    cr_expect_eq(extent_validate(&z), 0);
    extent_fini(&z);
    extent_fini(&a);
}

/* The reference model: owner[i] is 0 for a free granule, else the allocation's id. */
struct model {
    uint32_t *owner;
    uint64_t granules;
};

/* Best fit by scanning: the shortest free run that holds need granules, lowest first. */
static int64_t model_best_fit(const struct model *m, uint64_t need)
{
    int64_t best = -1;
    uint64_t best_len = UINT64_MAX;
    for (uint64_t i = 0; i < m->granules;) {
        if (m->owner[i]) {
            i++;
            continue;
        }
        uint64_t j = i;
        while (j < m->granules && !m->owner[j])
            j++;
        if (j - i >= need && j - i < best_len) {
            best = (int64_t)i;
            best_len = j - i;
        }
        i = j;
    }
    return best;
}

static void model_expect_stats(const struct model *m, const struct extent_alloc *a, uint64_t g)
{
    struct extent_stats s;
    uint64_t free_g = 0, runs = 0, largest = 0, used_ext = 0, tail = 0;
    for (uint64_t i = 0; i < m->granules;) {
        uint64_t j = i;
        while (j < m->granules && m->owner[j] == m->owner[i])
            j++;
        if (!m->owner[i]) {
            free_g += j - i;
            runs++;
            largest = MAX(largest, j - i);
            if (j == m->granules) tail = j - i;
        } else {
            /* Adjacent allocations have different ids, so each run is one extent. */
            used_ext++;
        }
        i = j;
    }
    extent_get_stats(a, &s);
    cr_assert_eq(s.capacity_bytes, m->granules * g);
    cr_assert_eq(s.free_bytes, free_g * g);
    cr_assert_eq(s.used_bytes, (m->granules - free_g) * g);
    cr_assert_eq(s.largest_free_bytes, largest * g);
    cr_assert_eq(s.tail_free_bytes, tail * g);
    cr_assert_eq(s.free_extents, runs);
    cr_assert_eq(s.used_extents, used_ext);
}

struct live {
    uint64_t off, granules;
    uint32_t id;
};

/* One random extent_reserve() against the model. Most requests aim at the start, the
 * middle or the end of a free run, so that they succeed and split it; the rest go
 * anywhere, so that they overlap allocations, pass the capacity or (with a granularity
 * above 1) start unaligned. */
static void model_reserve(struct extent_alloc *a, struct model *m, uint64_t g, uint64_t *s,
                          struct live *lv, size_t *nlive, uint32_t *next_id, unsigned op)
{
    uint64_t runs = 0, pick, first = 0, end = 0;

    for (uint64_t i = 0; i < m->granules; i++)
        runs += !m->owner[i] && (i == 0 || m->owner[i - 1]);
    uint64_t kind = test_rand(s) % 4;
    if (kind && runs) {
        pick = test_rand(s) % runs;
        for (uint64_t i = 0, k = 0; i < m->granules; i++) {
            if (m->owner[i] || (i && !m->owner[i - 1])) continue;
            if (k++ != pick) continue;
            first = i;
            for (end = i; end < m->granules && !m->owner[end];)
                end++;
            break;
        }
    }

    uint64_t at, need;
    if (kind && runs) {
        need = 1 + test_rand(s) % (end - first);
        if (kind == 1)
            at = first;
        else if (kind == 2)
            at = end - need;
        else
            at = first + test_rand(s) % (end - first - need + 1);
    } else {
        at = test_rand(s) % (m->granules + 4);
        need = 1 + test_rand(s) % 8;
    }
    /* Bytes that round up to need granules, not always a multiple of g. */
    uint64_t bytes = (need - 1) * g + 1 + test_rand(s) % g, off = at * g;
    bool unaligned = g > 1 && test_rand(s) % 8 == 0;
    if (unaligned) off += 1 + test_rand(s) % (g - 1);

    int expect = 0;
    if (unaligned || at > m->granules || need > m->granules - at) {
        expect = -EINVAL;
    } else {
        for (uint64_t i = at; i < at + need; i++)
            if (m->owner[i]) expect = -EEXIST;
    }
    int ret = extent_reserve(a, off, bytes);
    cr_assert_eq(ret, expect, "op %u: reserve %llu+%llu gave %d, model says %d", op,
                 (unsigned long long)off, (unsigned long long)bytes, ret, expect);
    cr_assert_eq(extent_validate(a), 0, "op %u: after reserve", op);
    if (ret < 0) return;
    for (uint64_t i = at; i < at + need; i++)
        m->owner[i] = *next_id;
    lv[(*nlive)++] = (struct live){off, need, (*next_id)++};
}

/* With reserves, a quarter of the operations are extent_reserve(). */
static void run_model(uint64_t seed, uint64_t g, uint64_t granules, unsigned ops, bool reserves)
{
    struct extent_alloc a;
    struct model m = {.granules = granules};
    struct live *lv = calloc(granules * 2 + 1, sizeof(*lv));
    size_t nlive = 0;
    uint32_t next_id = 1;
    uint64_t s = seed;

    cr_assert_not_null(lv);
    m.owner = calloc(granules * 2, sizeof(*m.owner)); /* room to grow to twice */
    cr_assert_not_null(m.owner);
    cr_assert_eq(extent_init(&a, granules * g, g), 0);

    for (unsigned op = 0; op < ops; op++) {
        if (reserves && test_rand(&s) % 4 == 0) {
            model_reserve(&a, &m, g, &s, lv, &nlive, &next_id, op);
            model_expect_stats(&m, &a, g);
            continue;
        }
        uint64_t r = test_rand(&s) % 100;
        if (r < 55 || nlive == 0) {
            /* Mostly small requests, sometimes large ones; sizes in bytes, not always
             * multiples of the granularity. */
            uint64_t span = test_rand(&s) % 10 == 0 ? 64 : 8;
            uint64_t bytes = 1 + test_rand(&s) % (span * g);
            uint64_t need = (bytes + g - 1) / g, off = 0;
            int64_t expect = model_best_fit(&m, need);
            int ret = extent_alloc(&a, bytes, &off);
            if (expect < 0) {
                cr_assert_eq(ret, -ENOSPC, "op %u: alloc %llu gave %d, model says ENOSPC", op,
                             (unsigned long long)bytes, ret);
                continue;
            }
            cr_assert_eq(ret, 0, "op %u: alloc %llu failed (%d)", op, (unsigned long long)bytes,
                         ret);
            cr_assert_eq(off, (uint64_t)expect * g, "op %u: best fit at %llu, model says %lld", op,
                         (unsigned long long)(off / g), (long long)expect);
            for (uint64_t i = 0; i < need; i++) {
                cr_assert_eq(m.owner[off / g + i], 0, "overlap at granule %llu",
                             (unsigned long long)(off / g + i));
                m.owner[off / g + i] = next_id;
            }
            lv[nlive++] = (struct live){off, need, next_id++};
        } else if (r < 95) {
            size_t k = test_rand(&s) % nlive;
            cr_assert_eq(extent_free(&a, lv[k].off), 0);
            cr_assert_eq(extent_free(&a, lv[k].off), -EINVAL); /* at once a double free */
            for (uint64_t i = 0; i < lv[k].granules; i++)
                m.owner[lv[k].off / g + i] = 0;
            lv[k] = lv[--nlive];
        } else if (r < 97 && m.granules < granules * 2) {
            uint64_t more = 1 + test_rand(&s) % 16;
            more = MIN(more, granules * 2 - m.granules);
            cr_assert_eq(extent_grow(&a, (m.granules + more) * g), 0);
            m.granules += more;
        } else {
            /* Look up a random granule: find() must name the owner's extent. */
            uint64_t i = test_rand(&s) % m.granules, start, len;
            int ret = extent_find(&a, i * g + test_rand(&s) % g, &start, &len);
            if (!m.owner[i]) {
                cr_assert_eq(ret, -ENOENT);
            } else {
                cr_assert_eq(ret, 0);
                cr_assert_eq(m.owner[start / g], m.owner[i]);
                cr_assert(start / g <= i && i < (start + len) / g);
            }
        }
        model_expect_stats(&m, &a, g);
        if (op % 256 == 0) cr_assert_eq(extent_validate(&a), 0);
    }
    cr_assert_eq(extent_validate(&a), 0);
    /* Free everything: one free extent of the whole capacity remains. */
    while (nlive)
        cr_assert_eq(extent_free(&a, lv[--nlive].off), 0);
    struct extent_stats st;
    extent_get_stats(&a, &st);
    cr_expect_eq(st.free_extents, 1);
    cr_expect_eq(st.largest_free_bytes, m.granules * g);
    cr_expect_eq(extent_validate(&a), 0);
    extent_fini(&a);
    free(m.owner);
    free(lv);
}

Test(extent, random_ops_match_model_4k)
{
    run_model(1, 4096, 2048, 6000, false);
}

Test(extent, random_ops_match_model_other_granularities)
{
    run_model(2, 512, 1024, 3000, false);
    run_model(3, 64 * KiB, 1024, 3000, false);
    run_model(4, 1, 256, 3000, false); /* granularity 1: byte-exact */
}

Test(extent, random_ops_match_model_tight)
{
    /* A small space keeps the allocator near full, where ENOSPC and best fit matter. */
    run_model(5, 4096, 200, 8000, false);
}

Test(extent, random_ops_with_reserves_match_model)
{
    run_model(6, 4096, 2048, 6000, true);
    run_model(7, 512, 512, 3000, true);
    run_model(8, 1, 256, 3000, true);
    run_model(9, 4096, 200, 8000, true); /* near full: most stray reserves overlap */
}

/* Tens of thousands of live extents: must stay fast (a linear scan per call would make
 * this take minutes under the sanitizers) and consistent. */
Test(extent, many_extents)
{
    enum { N = 40000 };
    struct extent_alloc a;
    struct extent_stats st;
    uint64_t *off = calloc(N, sizeof(*off)), s = 11;

    cr_assert_not_null(off);
    cr_assert_eq(extent_init(&a, (uint64_t)N * 8 * G, G), 0);
    for (unsigned i = 0; i < N; i++)
        cr_assert_eq(extent_alloc(&a, (1 + test_rand(&s) % 8) * G, &off[i]), 0);
    /* Free every other one: N/2 holes of mixed sizes, then churn through them. */
    for (unsigned i = 0; i < N; i += 2)
        cr_assert_eq(extent_free(&a, off[i]), 0);
    extent_get_stats(&a, &st);
    cr_expect_geq(st.free_extents, N / 2);
    for (unsigned round = 0; round < 4; round++) {
        for (unsigned i = 0; i < N; i += 2)
            cr_assert_eq(extent_alloc(&a, (1 + test_rand(&s) % 4) * G, &off[i]), 0);
        for (unsigned i = 0; i < N; i += 2)
            cr_assert_eq(extent_free(&a, off[i]), 0);
    }
    cr_assert_eq(extent_validate(&a), 0);
    for (unsigned i = 1; i < N; i += 2)
        cr_assert_eq(extent_free(&a, off[i]), 0);
    extent_get_stats(&a, &st);
    cr_expect_eq(st.free_extents, 1);
    cr_expect_eq(st.used_bytes, 0);
    cr_assert_eq(extent_validate(&a), 0);
    extent_fini(&a);
    free(off);
}

/* Tearing down with live allocations frees every node (checked by the sanitizers). */
Test(extent, fini_with_live_allocations)
{
    struct extent_alloc a;
    uint64_t off;

    cr_assert_eq(extent_init(&a, 64 * G, G), 0);
    for (int i = 0; i < 20; i++)
        cr_assert_eq(extent_alloc(&a, (1 + i % 3) * G, &off), 0);
    cr_assert_eq(extent_free(&a, 0), 0);
    extent_fini(&a);
}

Test(extent, next_fit_allocates_side_by_side_and_wraps)
{
    struct extent_alloc a;
    uint64_t x, y, z, w;

    cr_assert_eq(extent_init(&a, 16 * 4096, 4096), 0);
    /* Holes at [0,2) and [6,16) pages: next fit from page 1 skips the small hole. */
    cr_assert_eq(extent_reserve(&a, 2 * 4096, 4 * 4096), 0);
    cr_assert_eq(extent_alloc_from(&a, 3 * 4096, 4096, &x), 0);
    cr_assert_eq(x, 6 * 4096, "the first hole at or after the hint that fits");
    cr_assert_eq(extent_alloc_from(&a, 4096, x + 3 * 4096, &y), 0);
    cr_assert_eq(y, 9 * 4096, "right after the previous allocation");
    /* From inside a free extent: start at the hint itself. */
    cr_assert_eq(extent_alloc_from(&a, 4096, 12 * 4096, &z), 0);
    cr_assert_eq(z, 12 * 4096);
    /* Nothing fits after the hint: wrap to the start. */
    cr_assert_eq(extent_alloc_from(&a, 2 * 4096, 15 * 4096, &w), 0);
    cr_assert_eq(w, 0);
    cr_assert_eq(extent_validate(&a), 0);
    /* Too big for any hole: -ENOSPC, state unchanged. */
    struct extent_stats before, after;
    extent_get_stats(&a, &before);
    cr_assert_eq(extent_alloc_from(&a, 5 * 4096, 0, &w), -ENOSPC);
    extent_get_stats(&a, &after);
    cr_assert_eq(before.free_bytes, after.free_bytes);
    cr_assert_eq(extent_alloc_from(&a, 0, 0, &w), -EINVAL);
    cr_assert_eq(extent_alloc_from(&a, 4096, 1ull << 40, &w), 0, "a hint past the end wraps");
    cr_assert_eq(extent_validate(&a), 0);
    extent_fini(&a);
}

/* Under a mark: room freed below it is taken again, next fit wrapping at the mark, before
 * any page past it; where nothing below holds the request, the lowest room that does. */
Test(extent, alloc_under_reuses_room_below_the_mark_first)
{
    const uint64_t P = 4096;
    struct extent_alloc a;
    uint64_t o[4], x, mark = 0;

    cr_assert_eq(extent_init(&a, 64 * P, P), 0);
    for (int i = 0; i < 4; i++) { /* [0,4) [4,8) [8,12) [12,16): the mark at 16 */
        cr_assert_eq(extent_alloc_under(&a, 4 * P, mark, mark, &o[i]), 0);
        cr_assert_eq(o[i], (uint64_t)i * 4 * P, "side by side from an empty arena");
        mark = o[i] + 4 * P;
    }
    /* Freed and taken again, as a step's sets are: next fit (from 16, wrapping at the
     * mark) finds [0,4), not the untouched [16,64). */
    cr_assert_eq(extent_free(&a, o[0]), 0);
    cr_assert_eq(extent_alloc_under(&a, 4 * P, mark, mark, &x), 0);
    cr_assert_eq(x, 0, "room below the mark first");
    /* Two holes under the mark: next fit from the hint takes the one at or after it. */
    cr_assert_eq(extent_free(&a, o[1]), 0);
    cr_assert_eq(extent_free(&a, o[3]), 0);
    cr_assert_eq(extent_alloc_under(&a, 2 * P, 10 * P, mark, &x), 0);
    cr_assert_eq(x, 12 * P, "next fit from the hint");
    cr_assert_eq(extent_alloc_under(&a, 2 * P, 14 * P, mark, &x), 0);
    cr_assert_eq(x, 14 * P);
    cr_assert_eq(extent_alloc_under(&a, 2 * P, 16 * P, mark, &x), 0);
    cr_assert_eq(x, 4 * P, "a hint at the mark wraps to the start");
    /* [6,8) is free below the mark and [16,64) above: 4 pages fit only across the mark,
     * so the lowest room that holds them, [16,20): the mark moves by 4 pages. */
    cr_assert_eq(extent_alloc_under(&a, 4 * P, 6 * P, mark, &x), 0);
    cr_assert_eq(x, 16 * P);
    /* A free extent that straddles the mark: the lowest room is taken from its start. */
    cr_assert_eq(extent_free(&a, x), 0);
    cr_assert_eq(extent_free(&a, 12 * P), 0);
    cr_assert_eq(extent_free(&a, 14 * P), 0); /* [12,64) free, the mark still at 16 */
    cr_assert_eq(extent_alloc_under(&a, 8 * P, 0, mark, &x), 0);
    cr_assert_eq(x, 12 * P, "across the mark from the lowest room");
    cr_assert_eq(extent_validate(&a), 0);
    /* The errors of extent_alloc_from. */
    cr_assert_eq(extent_alloc_under(&a, 0, 0, mark, &x), -EINVAL);
    cr_assert_eq(extent_alloc_under(&a, 65 * P, 0, mark, &x), -ENOSPC);
    cr_assert_eq(extent_alloc_under(&a, 60 * P, 0, mark, &x), -ENOSPC);
    cr_assert_eq(extent_alloc_under(&a, P, 0, 1ull << 50, &x), 0, "a mark past the end");
    cr_assert_eq(extent_validate(&a), 0);
    extent_fini(&a);
}

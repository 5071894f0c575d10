/*
 * extent.c - the extent allocator behind extent.h.
 *
 * Every extent, free or allocated, is one struct extent with two treap links. A free
 * extent sits in the offset treap through by_off and in the size treap through by_size;
 * an allocated one sits in the used treap through by_off only. Freeing therefore moves a
 * node between treaps and merges neighbours into it without allocating, so a free cannot
 * fail for want of memory. A treap (a binary search tree that is also a heap on random
 * priorities) keeps its expected depth logarithmic with a few lines of split and merge;
 * keys are unique in every treap (offsets, or (length, offset) pairs), so a node's path
 * is determined by its key.
 *
 * It deliberately has no free-list caching or size classes: callers hold few extents that
 * are large (tensors), and best fit over the whole free set is what keeps them packed.
 */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>

#include "common.h"
#include "tiers/extent.h"

struct extent_node {
    struct extent_node *kid[2];
    uint32_t prio;
};

struct extent {
    uint64_t off, len;
    struct extent_node by_off;  /* free: offset treap; allocated: used treap */
    struct extent_node by_size; /* free only: size treap */
};

/* The extent that holds a treap link. */
static inline struct extent *off_ext(const struct extent_node *n)
{
    return (struct extent *)((const char *)n - offsetof(struct extent, by_off));
}
static inline struct extent *size_ext(const struct extent_node *n)
{
    return (struct extent *)((const char *)n - offsetof(struct extent, by_size));
}

typedef int (*node_cmp_fn)(const struct extent_node *a, const struct extent_node *b);

static int cmp_u64(uint64_t a, uint64_t b)
{
    return (a > b) - (a < b);
}

static int off_cmp(const struct extent_node *a, const struct extent_node *b)
{
    return cmp_u64(off_ext(a)->off, off_ext(b)->off);
}

static int size_cmp(const struct extent_node *a, const struct extent_node *b)
{
    const struct extent *x = size_ext(a), *y = size_ext(b);
    int c = cmp_u64(x->len, y->len);
    return c ? c : cmp_u64(x->off, y->off);
}

/* Treap primitives. Recursion depth is the treap's depth, O(log n) expected. */

/* Split t into keys below key (*l) and keys at or above it (*r). */
static void treap_split(struct extent_node *t, const struct extent_node *key, node_cmp_fn cmp,
                        struct extent_node **l, struct extent_node **r)
{
    if (!t) {
        *l = *r = NULL;
    } else if (cmp(t, key) < 0) {
        treap_split(t->kid[1], key, cmp, &t->kid[1], r);
        *l = t;
    } else {
        treap_split(t->kid[0], key, cmp, l, &t->kid[0]);
        *r = t;
    }
}

/* Join two treaps where every key of l is below every key of r. */
static struct extent_node *treap_merge(struct extent_node *l, struct extent_node *r)
{
    if (!l) return r;
    if (!r) return l;
    if (l->prio > r->prio) {
        l->kid[1] = treap_merge(l->kid[1], r);
        return l;
    }
    r->kid[0] = treap_merge(l, r->kid[0]);
    return r;
}

static struct extent_node *treap_insert(struct extent_node *t, struct extent_node *n,
                                        node_cmp_fn cmp)
{
    if (!t) {
        n->kid[0] = n->kid[1] = NULL;
        return n;
    }
    if (n->prio > t->prio) {
        treap_split(t, n, cmp, &n->kid[0], &n->kid[1]);
        return n;
    }
    int d = cmp(n, t) > 0;
    t->kid[d] = treap_insert(t->kid[d], n, cmp);
    return t;
}

/* Remove n, which must be in t. */
static struct extent_node *treap_remove(struct extent_node *t, struct extent_node *n,
                                        node_cmp_fn cmp)
{
    if (t == n) return treap_merge(n->kid[0], n->kid[1]);
    int d = cmp(n, t) > 0;
    t->kid[d] = treap_remove(t->kid[d], n, cmp);
    return t;
}

/* The extent with the largest offset <= off (strict: < off) in an offset-keyed treap. */
static struct extent *find_le(struct extent_node *t, uint64_t off, int strict)
{
    struct extent *best = NULL;
    while (t) {
        struct extent *e = off_ext(t);
        if (e->off < off || (!strict && e->off == off)) {
            best = e;
            t = t->kid[1];
        } else {
            t = t->kid[0];
        }
    }
    return best;
}

/* The extent with the smallest offset > off in an offset-keyed treap. */
static struct extent *find_gt(struct extent_node *t, uint64_t off)
{
    struct extent *best = NULL;
    while (t) {
        struct extent *e = off_ext(t);
        if (e->off > off) {
            best = e;
            t = t->kid[0];
        } else {
            t = t->kid[1];
        }
    }
    return best;
}

static struct extent_node *rightmost(struct extent_node *t)
{
    while (t && t->kid[1])
        t = t->kid[1];
    return t;
}

static struct extent *new_extent(struct extent_alloc *a, uint64_t off, uint64_t len)
{
    struct extent *e = malloc(sizeof(*e));
    if (!e) return NULL;
    /* xorshift64: priorities only need to be independent of the keys. */
    uint64_t x = a->rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    a->rng = x;
    e->off = off;
    e->len = len;
    e->by_off.prio = (uint32_t)x;
    e->by_size.prio = (uint32_t)(x >> 32);
    return e;
}

static void free_tree(struct extent_node *t)
{
    if (!t) return;
    free_tree(t->kid[0]);
    free_tree(t->kid[1]);
    free(off_ext(t));
}

static void free_insert(struct extent_alloc *a, struct extent *e)
{
    a->free_by_off = treap_insert(a->free_by_off, &e->by_off, off_cmp);
    a->free_by_size = treap_insert(a->free_by_size, &e->by_size, size_cmp);
    a->free_extents++;
}

static void free_remove(struct extent_alloc *a, struct extent *e)
{
    a->free_by_off = treap_remove(a->free_by_off, &e->by_off, off_cmp);
    a->free_by_size = treap_remove(a->free_by_size, &e->by_size, size_cmp);
    a->free_extents--;
}

int extent_init(struct extent_alloc *a, uint64_t capacity_bytes, uint64_t granularity)
{
    if (!a) return -EINVAL;
    *a = (struct extent_alloc){0};
    if (!granularity || (granularity & (granularity - 1)) ||
        !is_aligned(capacity_bytes, granularity))
        return -EINVAL;
    a->granularity = granularity;
    a->rng = 0x9e3779b97f4a7c15ull;
    return extent_grow(a, capacity_bytes);
}

void extent_fini(struct extent_alloc *a)
{
    if (!a) return;
    /* Free extents are reachable through either free treap; walk only one. */
    free_tree(a->free_by_off);
    free_tree(a->used_by_off);
    *a = (struct extent_alloc){0};
}

int extent_alloc(struct extent_alloc *a, uint64_t bytes, uint64_t *off)
{
    if (!a || !off || !bytes) return -EINVAL;
    if (bytes > a->capacity_bytes) /* also keeps align_up() below from overflowing */
        return -ENOSPC;
    uint64_t need = align_up(bytes, a->granularity);

    /* Best fit: the leftmost node whose length is at least need is the shortest such
     * extent, and the lowest offset among those of that length. */
    struct extent *fit = NULL;
    for (struct extent_node *t = a->free_by_size; t;) {
        struct extent *e = size_ext(t);
        if (e->len >= need) {
            fit = e;
            t = t->kid[0];
        } else {
            t = t->kid[1];
        }
    }
    if (!fit) return -ENOSPC;

    struct extent *u;
    if (fit->len == need) {
        free_remove(a, fit);
        u = fit;
    } else {
        u = new_extent(a, fit->off, need);
        if (!u) return -ENOMEM;
        /* Carve from the start: the remainder keeps its place in offset order, but its
         * size key changes. */
        a->free_by_size = treap_remove(a->free_by_size, &fit->by_size, size_cmp);
        fit->off += need;
        fit->len -= need;
        a->free_by_size = treap_insert(a->free_by_size, &fit->by_size, size_cmp);
    }
    a->used_by_off = treap_insert(a->used_by_off, &u->by_off, off_cmp);
    a->used_extents++;
    a->free_bytes -= need;
    a->used_bytes += need;
    *off = u->off;
    return 0;
}

/* The free extent that contains x, else the first one after it. */
static struct extent *free_at_or_after(const struct extent_alloc *a, uint64_t x)
{
    struct extent *e = find_le(a->free_by_off, x, 0);
    if (e && e->off + e->len > x) return e;
    return find_gt(a->free_by_off, x);
}

/* Next fit in [0, end): the first free room at or after `from` that holds need bytes and
 * ends by `end`, else the first such room from the start. -ENOSPC when there is none. */
static int next_fit(struct extent_alloc *a, uint64_t need, uint64_t from, uint64_t end,
                    uint64_t *off)
{
    if (need > end) return -ENOSPC;
    if (from >= end) from = 0;
    from = align_down(from, a->granularity);
    uint64_t start = UINT64_MAX;
    struct extent *e = free_at_or_after(a, from);
    for (; e && e->off < end && start == UINT64_MAX; e = find_gt(a->free_by_off, e->off))
        if (MIN(e->off + e->len, end) - MAX(e->off, from) >= need) start = MAX(e->off, from);
    e = free_at_or_after(a, 0);
    for (; e && e->off < from && start == UINT64_MAX; e = find_gt(a->free_by_off, e->off))
        if (MIN(e->off + e->len, end) - e->off >= need) start = e->off;
    if (start == UINT64_MAX) return -ENOSPC;
    int r = extent_reserve(a, start, need); /* the extent may shrink from the front */
    if (r == 0) *off = start;
    return r;
}

int extent_alloc_from(struct extent_alloc *a, uint64_t bytes, uint64_t from, uint64_t *off)
{
    if (!a || !off || !bytes) return -EINVAL;
    if (bytes > a->capacity_bytes) return -ENOSPC;
    return next_fit(a, align_up(bytes, a->granularity), from, a->capacity_bytes, off);
}

int extent_alloc_under(struct extent_alloc *a, uint64_t bytes, uint64_t from, uint64_t mark,
                       uint64_t *off)
{
    if (!a || !off || !bytes) return -EINVAL;
    if (bytes > a->capacity_bytes) return -ENOSPC;
    uint64_t need = align_up(bytes, a->granularity);
    mark = align_down(MIN(mark, a->capacity_bytes), a->granularity);
    int r = next_fit(a, need, from, mark, off);
    /* Nothing under the mark holds it: the lowest room that does moves the mark the least. */
    return r == -ENOSPC ? next_fit(a, need, 0, a->capacity_bytes, off) : r;
}

int extent_reserve(struct extent_alloc *a, uint64_t off, uint64_t bytes)
{
    if (!a || !bytes || !is_aligned(off, a->granularity) || off > a->capacity_bytes ||
        bytes > a->capacity_bytes - off) /* also keeps align_up() below from overflowing */
        return -EINVAL;
    uint64_t need = align_up(bytes, a->granularity);

    /* Free extents are maximal runs, so a range that is not inside the one free extent
     * where it starts overlaps an allocation. */
    struct extent *f = find_le(a->free_by_off, off, 0);
    if (!f || off + need > f->off + f->len) return -EEXIST;
    uint64_t before = off - f->off, after = f->off + f->len - (off + need);

    /* Every node this needs is allocated before anything is changed. */
    struct extent *u = f, *rest = NULL;
    if (before || after) {
        u = new_extent(a, off, need);
        if (!u) return -ENOMEM;
    }
    if (before && after) {
        rest = new_extent(a, off + need, after);
        if (!rest) {
            free(u);
            return -ENOMEM;
        }
    }

    if (!before && !after) {
        free_remove(a, f);
    } else {
        /* f keeps the part before the range, or else the part after it: either way its
         * place in offset order is unchanged, but its size key is not. */
        a->free_by_size = treap_remove(a->free_by_size, &f->by_size, size_cmp);
        if (before) {
            f->len = before;
        } else {
            f->off += need;
            f->len = after;
        }
        a->free_by_size = treap_insert(a->free_by_size, &f->by_size, size_cmp);
        if (rest) free_insert(a, rest);
    }
    a->used_by_off = treap_insert(a->used_by_off, &u->by_off, off_cmp);
    a->used_extents++;
    a->free_bytes -= need;
    a->used_bytes += need;
    return 0;
}

int extent_free(struct extent_alloc *a, uint64_t off)
{
    if (!a) return -EINVAL;
    struct extent *u = find_le(a->used_by_off, off, 0);
    if (!u || u->off != off) return -EINVAL;
    a->used_by_off = treap_remove(a->used_by_off, &u->by_off, off_cmp);
    a->used_extents--;
    a->used_bytes -= u->len;
    a->free_bytes += u->len;

    struct extent *prev = find_le(a->free_by_off, off, 1);
    struct extent *next = find_gt(a->free_by_off, off);
    bool join_prev = prev && prev->off + prev->len == u->off;
    bool join_next = next && u->off + u->len == next->off;

    if (join_next) {
        /* u takes next's place: same neighbours in offset order. */
        free_remove(a, next);
        u->len += next->len;
        free(next);
    }
    if (join_prev) {
        a->free_by_size = treap_remove(a->free_by_size, &prev->by_size, size_cmp);
        prev->len += u->len;
        a->free_by_size = treap_insert(a->free_by_size, &prev->by_size, size_cmp);
        free(u);
    } else {
        free_insert(a, u);
    }
    return 0;
}

int extent_grow(struct extent_alloc *a, uint64_t new_capacity)
{
    if (!a || !a->granularity || new_capacity < a->capacity_bytes ||
        !is_aligned(new_capacity, a->granularity))
        return -EINVAL;
    uint64_t add = new_capacity - a->capacity_bytes;
    if (!add) return 0;
    struct extent_node *last = rightmost(a->free_by_off);
    struct extent *tail = last ? off_ext(last) : NULL;
    if (tail && tail->off + tail->len == a->capacity_bytes) {
        a->free_by_size = treap_remove(a->free_by_size, &tail->by_size, size_cmp);
        tail->len += add;
        a->free_by_size = treap_insert(a->free_by_size, &tail->by_size, size_cmp);
    } else {
        struct extent *e = new_extent(a, a->capacity_bytes, add);
        if (!e) return -ENOMEM;
        free_insert(a, e);
    }
    a->capacity_bytes = new_capacity;
    a->free_bytes += add;
    return 0;
}

int extent_find(const struct extent_alloc *a, uint64_t off, uint64_t *start, uint64_t *len)
{
    if (!a) return -EINVAL;
    struct extent *u = find_le(a->used_by_off, off, 0);
    if (!u || off - u->off >= u->len) return -ENOENT;
    if (start) *start = u->off;
    if (len) *len = u->len;
    return 0;
}

void extent_get_stats(const struct extent_alloc *a, struct extent_stats *out)
{
    struct extent_node *big = rightmost(a->free_by_size);
    struct extent_node *last = rightmost(a->free_by_off);

    *out = (struct extent_stats){
        .capacity_bytes = a->capacity_bytes,
        .free_bytes = a->free_bytes,
        .used_bytes = a->used_bytes,
        .largest_free_bytes = big ? size_ext(big)->len : 0,
        .free_extents = a->free_extents,
        .used_extents = a->used_extents,
    };
    if (last && off_ext(last)->off + off_ext(last)->len == a->capacity_bytes)
        out->tail_free_bytes = off_ext(last)->len;
}

/* Validation: flatten each treap in order, checking the heap property on the way. */

struct flat {
    struct extent **v;
    size_t n, cap;
    bool bad_heap;
};

static int flatten(struct extent_node *t, struct flat *f, bool by_size)
{
    if (!t) return 0;
    for (int d = 0; d < 2; d++)
        if (t->kid[d] && t->kid[d]->prio > t->prio) f->bad_heap = true;
    if (flatten(t->kid[0], f, by_size)) return -ENOMEM;
    if (f->n == f->cap) {
        size_t cap = f->cap ? 2 * f->cap : 64;
        struct extent **v = realloc(f->v, cap * sizeof(*v));
        if (!v) return -ENOMEM;
        f->v = v;
        f->cap = cap;
    }
    f->v[f->n++] = by_size ? size_ext(t) : off_ext(t);
    return flatten(t->kid[1], f, by_size);
}

#define BAD(...)                                                                                   \
    do {                                                                                           \
        log_error("extent: " __VA_ARGS__);                                                         \
        ret = -EFAULT;                                                                             \
        goto out;                                                                                  \
    } while (0)

int extent_validate(const struct extent_alloc *a)
{
    struct flat fr = {0}, us = {0}, sz = {0};
    int ret = 0;

    if (flatten(a->free_by_off, &fr, false) || flatten(a->used_by_off, &us, false) ||
        flatten(a->free_by_size, &sz, true)) {
        ret = -ENOMEM;
        goto out;
    }
    if (fr.bad_heap || us.bad_heap || sz.bad_heap) BAD("treap heap order broken");
    if (fr.n != a->free_extents || sz.n != a->free_extents || us.n != a->used_extents)
        BAD("counts disagree: %zu free by offset, %zu by size, %zu used; recorded %llu, "
            "%llu",
            fr.n, sz.n, us.n, (unsigned long long)a->free_extents,
            (unsigned long long)a->used_extents);

    /* Merge the two offset-ordered lists: they must tile [0, capacity) with no gaps,
     * and no two free extents may touch. */
    uint64_t pos = 0, free_sum = 0, used_sum = 0;
    bool last_free = false;
    for (size_t i = 0, j = 0; i < fr.n || j < us.n;) {
        bool take_free = j == us.n || (i < fr.n && fr.v[i]->off < us.v[j]->off);
        struct extent *e = take_free ? fr.v[i++] : us.v[j++];
        if (e->off != pos)
            BAD("extent at %llu, expected one at %llu", (unsigned long long)e->off,
                (unsigned long long)pos);
        if (!e->len || !is_aligned(e->len, a->granularity))
            BAD("extent at %llu has length %llu", (unsigned long long)e->off,
                (unsigned long long)e->len);
        if (take_free && last_free)
            BAD("free extents at offset %llu are not coalesced", (unsigned long long)e->off);
        last_free = take_free;
        pos += e->len;
        *(take_free ? &free_sum : &used_sum) += e->len;
    }
    if (pos != a->capacity_bytes)
        BAD("extents cover %llu of %llu bytes", (unsigned long long)pos,
            (unsigned long long)a->capacity_bytes);
    if (free_sum != a->free_bytes || used_sum != a->used_bytes) BAD("byte counts disagree");

    /* The size treap holds the same nodes as the offset treap, in (length, offset) order. */
    for (size_t i = 0; i < sz.n; i++) {
        if (i && size_cmp(&sz.v[i - 1]->by_size, &sz.v[i]->by_size) >= 0)
            BAD("size index out of order");
        if (find_le(a->free_by_off, sz.v[i]->off, 0) != sz.v[i])
            BAD("size index holds an extent the offset index lacks");
    }
out:
    free(fr.v);
    free(us.v);
    free(sz.v);
    return ret;
}

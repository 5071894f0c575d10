/*
 * test_trace.c - the trace writer (src/trace.c) and what the engine writes into it: the
 * file parses as JSON, spans nest per thread, async spans end, every kind of engine span
 * appears when its work happens, the counters end at zinf_stats' figures; off costs
 * nothing and writes nothing; a full ring drops and says so; bad paths are refused by name.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "engine/engine.h"
#include "helpers.h"
#include "trace.h"
#include "zinf.h"

static char *dir;

static void setup(void)
{
    dir = test_tmpdir("trace");
    cr_assert_not_null(dir);
}

static void teardown(void)
{
    trace_stop();
    test_log_capture_stop();
    if (!getenv("KEEP")) test_rmtree(dir);
    dir = NULL;
}

TestSuite(trace, .init = setup, .fini = teardown, .timeout = 120);

static void path_of(char *out, size_t len, const char *name)
{
    snprintf(out, len, "%s/%s", dir, name);
}

/* Budgets small enough that every fetch of a few 96 KiB tensors moves something. */
static struct zinf_options tiny(const char *swap)
{
    return (struct zinf_options){.nvme_path = swap,
                                 .device_bytes = 256 * KiB,
                                 .host_bytes = 256 * KiB,
                                 .block_size = 64 * KiB,
                                 .queue_depth = 4,
                                 .device_kind = ZINF_DEVICE_EMULATED,
                                 .flags = ZINF_OPEN_NO_PIN};
}

/* An engine with tiny budgets moves everything: NVMe-homed tensors load to the device and
 * are evicted with write-backs, a host-homed one is copied to the device and written back. */
Test(trace, engine_work_shows_as_nested_spans_and_counters_that_end_at_its_stats)
{
    char path[4096], swap[4096];
    path_of(path, sizeof(path), "engine.json");
    path_of(swap, sizeof(swap), "swap");
    cr_assert_eq(trace_start(path), 0);
    cr_assert(trace_on());
    struct zinf_options o = tiny(swap);
    zinf_engine *e;
    cr_assert_eq(zinf_open(&o, &e), 0);
    zinf_tensor t[4], h;
    char name[32];
    for (int i = 0; i < 4; i++) {
        snprintf(name, sizeof(name), "weights \"%d\"", i); /* a name the JSON must escape */
        t[i] = test_register(e, name, 96 * KiB, ZINF_TIER_NVME);
    }
    h = test_register(e, "on the host", 64 * KiB, ZINF_TIER_HOST);
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < 4; i++) {
            void *p;
            cr_assert_eq(zinf_fetch(e, t[i], ZINF_TIER_DEVICE, &p), 0);
            memset(p, i + round, 96 * KiB);
            cr_assert_eq(zinf_release(e, t[i], ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
            /* At once again: a hit. */
            cr_assert_eq(zinf_fetch(e, t[i], ZINF_TIER_DEVICE, &p), 0);
            cr_assert_eq(zinf_release(e, t[i], ZINF_TIER_DEVICE, 0), 0);
            cr_assert_eq(zinf_fetch(e, h, ZINF_TIER_DEVICE, &p), 0);
            memset(p, 7, 64 * KiB);
            cr_assert_eq(zinf_release(e, h, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
            /* The host copy is loaded from the newer device copy. */
            cr_assert_eq(zinf_fetch(e, h, ZINF_TIER_HOST, &p), 0);
            cr_assert_eq(zinf_release(e, h, ZINF_TIER_HOST, 0), 0);
        }
    cr_assert_eq(zinf_flush(e), 0);
    struct zinf_stats st;
    zinf_stats(e, &st);
    cr_assert_eq(trace_stop(), 0);
    cr_assert_not(trace_on());
    int id = e->trace_id;
    zinf_close(e);

    struct test_trace tr;
    test_trace_load(path, &tr);
    cr_expect_eq(tr.dropped, 0);
    cr_expect_gt(test_trace_count(&tr, "X", "fetch to device", "hit"), 0);
    cr_expect_gt(test_trace_count(&tr, "X", "fetch to device", "load"), 0);
    cr_expect_gt(test_trace_count(&tr, "b", "nvme read", "load"), 0);
    cr_expect_gt(test_trace_count(&tr, "b", "nvme write", "write-back to evict"), 0);
    cr_expect_gt(test_trace_count(&tr, "b", "host to device copy", "load"), 0);
    cr_expect_gt(test_trace_count(&tr, "b", "device to host copy", "load"), 0);
    cr_expect_gt(test_trace_count(&tr, "i", "evict from device", "after its write-back"), 0);
    cr_expect_eq(test_trace_count(&tr, "X", "flush", NULL), 1);
    cr_expect_gt(test_trace_count(&tr, "b", "nvme write", "flush"), 0);
    /* Every blocking fetch is one span. */
    cr_expect_eq(test_trace_count(&tr, "X", "fetch to device", NULL), 8 * 3);
    cr_expect_eq(test_trace_count(&tr, "X", "fetch to host", NULL), 8);
    char cn[96];
    snprintf(cn, sizeof(cn), "device bytes in use (engine %d)", id);
    cr_expect_eq(test_trace_counter(&tr, cn), (long long)st.tier[ZINF_TIER_DEVICE].used_bytes);
    snprintf(cn, sizeof(cn), "host bytes in use (engine %d)", id);
    cr_expect_eq(test_trace_counter(&tr, cn), (long long)st.tier[ZINF_TIER_HOST].used_bytes);
    snprintf(cn, sizeof(cn), "nvme bytes read (engine %d)", id);
    cr_expect_eq(test_trace_counter(&tr, cn), (long long)st.nvme_bytes_read);
    snprintf(cn, sizeof(cn), "nvme bytes written (engine %d)", id);
    cr_expect_eq(test_trace_counter(&tr, cn), (long long)st.nvme_bytes_written);
    cr_expect_gt(st.nvme_bytes_written, 0);
    /* The tensor's name, escaped, reads back as it was. */
    size_t i;
    json_t *ev;
    bool named = false;
    json_array_foreach((json_t *)tr.root, i, ev)
    {
        const char *tn = json_string_value(json_object_get(json_object_get(ev, "args"), "tensor"));
        named |= tn && !strcmp(tn, "weights \"2\"");
    }
    cr_expect(named);
    test_trace_free(&tr);
}

/* Off (the default): nothing is recorded, no file is written, stop is a no-op. */
Test(trace, off_writes_nothing)
{
    cr_assert_not(trace_on());
    trace_span("test", "never", now_ns(), NULL, NULL, -1);
    trace_counter("never", -1, 1);
    cr_assert_eq(trace_stop(), 0);
    cr_assert_eq(trace_dropped(), 0);
}

/* A path that cannot be written is refused, named; a second trace while one runs is refused;
 * the first one is unharmed. */
Test(trace, a_bad_path_is_refused_by_name_and_a_second_trace_is_refused)
{
    char bad[4096], good[4096];
    path_of(bad, sizeof(bad), "no/such/dir/t.json");
    test_log_capture_start();
    cr_assert_eq(trace_start(bad), -ENOENT);
    cr_assert(strstr(test_log_text(), bad), "%s", test_log_text());
    test_log_capture_stop();
    cr_assert_not(trace_on());
    path_of(good, sizeof(good), "good.json");
    cr_assert_eq(trace_start(good), 0);
    cr_assert_eq(trace_start(good), -EALREADY);
    trace_span("test", "one", now_ns(), NULL, NULL, -1);
    cr_assert_eq(trace_stop(), 0);
    struct test_trace tr;
    test_trace_load(good, &tr);
    cr_expect_eq(test_trace_count(&tr, "X", "one", NULL), 1);
    test_trace_free(&tr);
}

struct worker_arg {
    int id, spans;
};

/* Nested spans from a thread of its own, named. */
static void *worker(void *p)
{
    struct worker_arg *a = p;
    char name[32];
    snprintf(name, sizeof(name), "worker %d", a->id);
    trace_thread_name(name);
    for (int i = 0; i < a->spans; i++) {
        uint64_t t0 = now_ns();
        uint64_t t1 = now_ns();
        trace_span("test", "inner", t1, "x", NULL, 1);
        trace_span_n("test", "outer", i, t0);
    }
    return NULL;
}

/* Several threads at once, each well under its ring: every event arrives, with the
 * threads' names, and spans nest per thread. Then one thread far over its ring: the
 * excess is dropped and counted, the file stays valid. */
Test(trace, threads_write_through_their_own_rings_and_a_full_ring_drops_and_says_so)
{
    char path[4096];
    path_of(path, sizeof(path), "threads.json");
    cr_assert_eq(trace_start(path), 0);
    pthread_t th[8];
    struct worker_arg a[8];
    for (int i = 0; i < 8; i++) {
        a[i] = (struct worker_arg){.id = i, .spans = 1000};
        cr_assert_eq(pthread_create(&th[i], NULL, worker, &a[i]), 0);
    }
    for (int i = 0; i < 8; i++)
        pthread_join(th[i], NULL);
    cr_assert_eq(trace_stop(), 0);
    struct test_trace tr;
    test_trace_load(path, &tr);
    cr_expect_eq(tr.dropped, 0);
    cr_expect_eq(test_trace_count(&tr, "X", "inner", NULL), 8000);
    cr_expect_eq(test_trace_count(&tr, "X", "outer *", NULL), 8000);
    cr_expect_eq(test_trace_count(&tr, "M", "thread_name", NULL), 8);
    test_trace_free(&tr);

    /* Far more than a ring holds, faster than the writer drains. */
    cr_assert_eq(trace_start(path), 0);
    struct worker_arg big = {.id = 9, .spans = 200000};
    test_log_capture_start();
    worker(&big);
    uint64_t dropped = trace_dropped();
    cr_assert_eq(trace_stop(), 0);
    cr_expect(strstr(test_log_text(), "events were dropped"), "%s", test_log_text());
    test_log_capture_stop();
    test_trace_load(path, &tr);
    cr_expect_gt(tr.dropped, 0);
    cr_expect_geq(tr.dropped, dropped);
    cr_expect_eq(test_trace_count(&tr, "X", "inner", NULL) +
                     test_trace_count(&tr, "X", "outer *", NULL) + tr.dropped,
                 400000);
    test_trace_free(&tr);
}

/* zinf_stats splits the time blocked in fetch by what it waited for: a cold NVMe-homed
 * tensor waits for NVMe, a host-homed one for a copy, a fetch into a device full of dirty
 * copies for room (their write-backs); the parts never add up to more than the whole. */
Test(trace, blocked_time_is_split_into_nvme_copy_and_room)
{
    char swap[4096];
    path_of(swap, sizeof(swap), "swap");
    struct zinf_options o = tiny(swap);
    zinf_engine *e;
    struct zinf_stats s0, s1;
    void *p;
    /* a written and saved, then resumed: its first fetch reads it from NVMe. */
    cr_assert_eq(zinf_open(&o, &e), 0);
    zinf_tensor a = test_register(e, "a", 96 * KiB, ZINF_TIER_NVME);
    unsigned char *buf = test_rand_buf(96 * KiB, 1);
    cr_assert_eq(zinf_write(e, a, 0, buf, 96 * KiB), 0);
    zinf_close(e);
    o.flags |= ZINF_OPEN_RESUME;
    cr_assert_eq(zinf_open(&o, &e), 0);
    cr_assert_eq(zinf_lookup(e, "a", &a), 0);
    zinf_tensor b = test_register(e, "b", 96 * KiB, ZINF_TIER_NVME);
    zinf_tensor c = test_register(e, "c", 96 * KiB, ZINF_TIER_NVME);
    zinf_tensor h = test_register(e, "h", 32 * KiB, ZINF_TIER_HOST);

    zinf_stats(e, &s0);
    cr_assert_eq(zinf_fetch(e, a, ZINF_TIER_DEVICE, &p), 0);
    zinf_stats(e, &s1);
    cr_expect_gt(s1.blocked_nvme_ns, s0.blocked_nvme_ns);
    memset(p, 1, 96 * KiB);
    cr_assert_eq(zinf_release(e, a, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);

    zinf_stats(e, &s0);
    cr_assert_eq(zinf_fetch(e, h, ZINF_TIER_DEVICE, &p), 0);
    zinf_stats(e, &s1);
    cr_expect_gt(s1.blocked_copy_ns, s0.blocked_copy_ns);
    cr_assert_eq(zinf_release(e, h, ZINF_TIER_DEVICE, 0), 0);

    cr_assert_eq(zinf_fetch(e, b, ZINF_TIER_DEVICE, &p), 0);
    memset(p, 2, 96 * KiB);
    cr_assert_eq(zinf_release(e, b, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    /* a and b dirty on the device: c's room comes from a write-back. */
    zinf_stats(e, &s0);
    cr_assert_eq(zinf_fetch(e, c, ZINF_TIER_DEVICE, &p), 0);
    zinf_stats(e, &s1);
    cr_expect_gt(s1.blocked_room_ns, s0.blocked_room_ns);
    cr_assert_eq(zinf_release(e, c, ZINF_TIER_DEVICE, 0), 0);

    cr_expect_leq(s1.blocked_nvme_ns + s1.blocked_copy_ns + s1.blocked_room_ns +
                      s1.blocked_pin_ns,
                  s1.blocked_ns);
    free(buf);
    zinf_close(e);
}

/*
 * test_common.c - the shared helpers: size parsing and formatting, the log sink.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "common.h"
#include "hugemem.h"
#include "helpers.h"

TestSuite(common, .fini = test_leak_check);

Test(common, parse_size_accepts_units_and_exponents)
{
    static const struct { const char *s; uint64_t v; } ok[] = {
        {"0", 0}, {"4096", 4096}, {"4k", 4096}, {"4K", 4096}, {"512M", 512 * MiB},
        {"4G", 4 * GiB}, {"1T", 1024 * GiB}, {"2GiB", 2 * GiB}, {"1e8", 100000000},
        {"1.5G", 3 * GiB / 2}, {"64KB", 64 * KiB}, {"1048576", MiB},
    };
    for (size_t i = 0; i < ARRAY_SIZE(ok); i++) {
        uint64_t v = 1;
        cr_assert_eq(parse_size(ok[i].s, &v), 0, "%s", ok[i].s);
        cr_assert_eq(v, ok[i].v, "%s gave %llu", ok[i].s, (unsigned long long)v);
    }
}

Test(common, parse_size_refuses_junk)
{
    static const char *const bad[] = {"", "G", "-1", "+5", "4X", "4GG", "1.5", "abc", "4 G",
                                      "0x10"};
    uint64_t v = 77;
    for (size_t i = 0; i < ARRAY_SIZE(bad); i++)
        cr_assert_eq(parse_size(bad[i], &v), -EINVAL, "'%s' accepted", bad[i]);
    cr_assert_eq(v, 77, "the output is untouched on error");
    cr_assert_eq(parse_size("1e30", &v), -ERANGE);
    cr_assert_eq(parse_size("99999999999T", &v), -ERANGE);
    cr_assert_eq(parse_size(NULL, &v), -EINVAL);
}

Test(common, format_size)
{
    char b[32];
    cr_assert_str_eq(format_size(512, b, sizeof(b)), "512 B");
    cr_assert_str_eq(format_size(4 * GiB, b, sizeof(b)), "4 GiB");
    cr_assert_str_eq(format_size(3 * MiB / 2, b, sizeof(b)), "1.50 MiB");
}

Test(common, log_sink_captures_and_restores)
{
    test_log_capture_start();
    log_error("disk %s is full", "/x");
    log_debug("hidden unless ZINF_LOG=debug");
    cr_assert(strstr(test_log_text(), "disk /x is full") != NULL);
    test_log_capture_stop();
}

Test(common, alignment)
{
    cr_assert_eq(align_up(1, 4096), 4096);
    cr_assert_eq(align_up(4096, 4096), 4096);
    cr_assert_eq(align_down(8191, 4096), 4096);
    cr_assert(is_aligned(8192, 4096));
    cr_assert(!is_aligned(8193, 4096));
}

/* IO buffers: 2 MiB aligned when huge pages are asked for, zero-filled, usable to the last
 * byte; 0 bytes (or absurd sizes) refused with -EINVAL. */
Test(common, hugemem_map_is_aligned_zeroed_and_refuses_nonsense)
{
    for (int huge = 0; huge < 2; huge++) {
        bool ok;
        int err = 0;
        size_t n = 5 * HUGEMEM_PAGE_BYTES + 12345;
        unsigned char *p = hugemem_map(n, huge, &ok, &err);
        cr_assert_not_null(p, "huge %d: %s", huge, strerror(-err));
        cr_assert_eq((uintptr_t)p % (huge ? HUGEMEM_PAGE_BYTES : 4096), 0);
        for (size_t i = 0; i < n; i += 4096)
            cr_assert_eq(p[i], 0);
        cr_assert_eq(p[n - 1], 0);
        memset(p, 0xab, n);
        if (!huge)
            cr_assert(!ok, "no advice was asked for");
        hugemem_unmap(p, n);
    }
    int err = 0;
    cr_assert_null(hugemem_map(0, true, NULL, &err));
    cr_assert_eq(err, -EINVAL);
    cr_assert_null(hugemem_map(SIZE_MAX, true, NULL, &err));
    cr_assert_eq(err, -EINVAL);
    hugemem_unmap(NULL, 0);
}

/*
 * test_header.c - the public header compiles alone (nothing before it) and the
 * library-wide functions behave: version, strerror.
 */
#include "zinf.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "helpers.h"

TestSuite(header, .fini = test_leak_check);

Test(header, version_matches_macros)
{
    char want[32];
    snprintf(want, sizeof(want), "%d.%d.%d", ZINF_VERSION_MAJOR, ZINF_VERSION_MINOR,
             ZINF_VERSION_PATCH);
    cr_assert_str_eq(zinf_version(), want);
}

Test(header, strerror_names_every_contract_error)
{
    static const int errs[] = {EINVAL, ENOMEM, ENOSPC, EEXIST, ENOENT, EBUSY, EIO, EBADMSG};
    for (size_t i = 0; i < sizeof(errs) / sizeof(errs[0]); i++) {
        const char *m = zinf_strerror(-errs[i]);
        cr_assert_not_null(m);
        cr_assert_gt(strlen(m), 3);
        cr_assert_str_eq(m, zinf_strerror(errs[i]), "sign does not matter");
    }
    cr_assert_str_eq(zinf_strerror(0), "success");
    cr_assert_not_null(zinf_strerror(-123456), "unknown codes still get a message");
}

Test(header, options_zero_initialised_are_defaults)
{
    struct zinf_options o = {0};
    cr_assert_null(o.nvme_path);
    cr_assert_eq(o.device_kind, ZINF_DEVICE_AUTO);
    cr_assert_eq(ZINF_TIER_DEVICE, 0);
}

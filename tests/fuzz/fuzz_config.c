/*
 * fuzz_config.c - the config reader's fuzz entry point: any bytes go through
 * config_parse_buffer(), then config_to_options() and config_print(), then config_free().
 * Besides crashes and sanitizer reports it aborts when a promise of config.h is broken:
 * an error is one non-empty line and leaves the defaults; a success gives engine options
 * that agree with the NVMe path list.
 *
 * Linked into the libFuzzer target fuzz_config and into fuzz_config_replay (fuzz_driver.c).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void quiet_sink(enum log_level level, const char *msg, void *arg)
{
    /* Unknown-key warnings are expected by the thousand here; one line is all a promise
     * asks of them. */
    if (strchr(msg, '\n'))
        abort();
}

static void check_options(const struct zinf_config *c)
{
    struct zinf_options o;

    config_to_options(c, &o);
    if ((o.nvme_path != NULL) != (c->nvme_paths.count > 0))
        abort();
    if (c->nvme_paths.count > CONFIG_MAX_NVME_PATHS)
        abort();
    for (unsigned i = 0; i < c->nvme_paths.count; i++)
        if (!c->nvme_paths.path[i] || !c->nvme_paths.path[i][0])
            abort();
    if (c->nvme_paths.count > 1) {
        unsigned n = 0;
        while (o.nvme_paths_extra[n])
            n++;
        if (n + 1 != c->nvme_paths.count)
            abort();
    } else if (o.nvme_paths_extra) {
        abort();
    }
    if (o.block_size % 4096 || !o.block_size || o.queue_depth < 1 || o.queue_depth > 1024)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static FILE *devnull;
    struct zinf_config c, d;
    char err[256];

    if (!devnull) {
        devnull = fopen("/dev/null", "w");
        log_set_sink(quiet_sink, NULL, NULL);
    }
    int ret = config_parse_buffer((const char *)data, size, "fuzz", &c, err, sizeof(err));
    if (ret == 0) {
        check_options(&c);
        if (devnull)
            config_print(&c, devnull);
    } else {
        config_defaults(&d);
        if (ret != -EINVAL || !err[0] || strchr(err, '\n') || memcmp(&c, &d, sizeof(c)))
            abort();
    }
    config_free(&c);
    return 0;
}

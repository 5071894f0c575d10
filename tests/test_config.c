/*
 * test_config.c - the DeepSpeed-style config reader: every key read back, DeepSpeed's
 * defaults, reals, path lists, aliases, ignored and unknown keys, and one test per class
 * of bad input with the exact message a user sees.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "common.h"
#include "config.h"
#include "engine/engine.h"
#include "io/uring.h"
#include "tiers/host.h"
#include "helpers.h"

#define ERRLEN 512

static int parse(const char *json, struct zinf_config *c, char *err)
{
    return config_parse_buffer(json, strlen(json), "t.json", c, err, ERRLEN);
}

/* Parse json, which must fail with -EINVAL and exactly msg, leaving c at the defaults. */
static void expect_error(const char *json, const char *msg)
{
    struct zinf_config c, d;
    char err[ERRLEN];

    int ret = parse(json, &c, err);
    cr_expect_eq(ret, -EINVAL, "%s: returned %d", json, ret);
    cr_expect_str_eq(err, msg, "%s\n  got: %s", json, err);
    config_defaults(&d);
    cr_expect_eq(memcmp(&c, &d, sizeof(c)), 0, "%s: config not reset to the defaults", json);
    config_free(&c);
}

static void expect_ok(const char *json, struct zinf_config *c)
{
    char err[ERRLEN];
    int ret = parse(json, c, err);
    cr_assert_eq(ret, 0, "%s: %d %s", json, ret, err);
}

static bool listed(char **list, size_t n, const char *s)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(list[i], s))
            return true;
    return false;
}

static bool listed_prefix(char **list, size_t n, const char *s)
{
    for (size_t i = 0; i < n; i++)
        if (!strncmp(list[i], s, strlen(s)))
            return true;
    return false;
}

static char *write_file(const char *dir, const char *name, const char *text)
{
    char *path;
    cr_assert(asprintf(&path, "%s/%s", dir, name) > 0);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fputs(text, f);
    fclose(f);
    return path;
}

/* ---- defaults ---------------------------------------------------------------------- */

static void check_defaults(const struct zinf_config *c)
{
    cr_expect_eq(c->zero.stage, 0);
    cr_expect_eq(c->zero.sub_group_size, 1000000000);
    cr_expect_eq(c->zero.offload_param.device, CONFIG_OFFLOAD_NONE);
    cr_expect_eq(c->zero.offload_param.nvme_path.count, 0);
    cr_expect_eq(c->zero.offload_param.pin_memory, false);
    cr_expect_eq(c->zero.offload_param.buffer_count, 5);
    cr_expect_eq(c->zero.offload_param.buffer_size, 100000000);
    cr_expect_eq(c->zero.offload_param.max_in_cpu, 1000000000);
    cr_expect_eq(c->zero.offload_optimizer.device, CONFIG_OFFLOAD_NONE);
    cr_expect_eq(c->zero.offload_optimizer.nvme_path.count, 0);
    cr_expect_eq(c->zero.offload_optimizer.pin_memory, false);
    cr_expect_eq(c->zero.offload_optimizer.buffer_count, 4);
    cr_expect_eq(c->zero.offload_optimizer.pipeline_read, true);
    cr_expect_eq(c->zero.offload_optimizer.pipeline_write, true);
    cr_expect_eq(c->zero.offload_optimizer.fast_init, false);
    cr_expect_eq(c->zero.stage3_prefetch_bucket_size, 50000000);
    cr_expect_eq(c->zero.stage3_max_live_parameters, 1000000000);
    cr_expect_eq(c->zero.stage3_max_reuse_distance, 1000000000);
    cr_expect_eq(c->zero.stage3_param_persistence_threshold, 100000);
    cr_expect_eq(c->aio.block_size, 1048576);
    cr_expect_eq(c->aio.queue_depth, 8);
    cr_expect_eq(c->aio.intra_op_parallelism, 1);
    cr_expect_eq(c->aio.single_submit, false);
    cr_expect_eq(c->aio.overlap_events, true);
    cr_expect_eq(c->aio.use_gds, false);
    cr_expect_eq(c->zinf.device_bytes, 0);
    cr_expect_eq(c->zinf.host_bytes, 0);
    cr_expect_eq(c->zinf.nvme_paths.count, 0);
    cr_expect_eq(c->zinf.device, ZINF_DEVICE_AUTO);
    cr_expect_eq(c->zinf.cuda_device, 0);
    cr_expect_eq(c->zinf.sqpoll, false);
    cr_expect_eq(c->zinf.io_backend, CONFIG_IO_AUTO);
    cr_expect_eq(c->nvme_paths.count, 0);
    cr_expect_eq(c->n_unknown, 0);
    cr_expect_eq(c->n_ignored, 0);
}

TestSuite(config, .fini = test_leak_check);

Test(config, defaults_are_deepspeeds)
{
    struct zinf_config c;
    config_defaults(&c);
    check_defaults(&c);
    cr_expect_eq(c.given[0] | c.given[1], 0);
    config_free(&c);
}

Test(config, empty_object_gives_the_defaults)
{
    struct zinf_config c;
    struct zinf_options o;

    expect_ok("{}", &c);
    check_defaults(&c);
    cr_expect_eq(c.given[0] | c.given[1], 0);
    config_to_options(&c, &o);
    cr_expect_null(o.nvme_path);
    cr_expect_null(o.nvme_paths_extra);
    cr_expect_eq(o.block_size, 1048576);
    cr_expect_eq(o.queue_depth, 8);
    cr_expect_eq(o.device_bytes, 0);
    cr_expect_eq(o.host_bytes, 0);
    cr_expect_eq(o.device_kind, ZINF_DEVICE_AUTO);
    cr_expect_eq(o.cuda_device, 0);
    cr_expect_eq(o.flags, 0);
    config_free(&c);
}

Test(config, empty_sections_and_nulls_give_the_defaults)
{
    struct zinf_config c;

    expect_ok("{\"zero_optimization\": {\"offload_param\": null, \"offload_optimizer\": {}},"
              " \"aio\": {}, \"zinf\": null}",
              &c);
    check_defaults(&c);
    config_free(&c);
    expect_ok("{\"zero_optimization\": {\"offload_param\": {\"nvme_path\": null}}}", &c);
    check_defaults(&c);
    config_free(&c);
}

/* ---- every key read back ------------------------------------------------------------ */

static const char full_config[] =
    "{\n"
    "  \"zero_optimization\": {\n"
    "    \"stage\": 3, \"overlap_comm\": true, \"reduce_bucket_size\": 15,\n"
    "    \"sub_group_size\": 2000000,\n"
    "    \"offload_param\": {\n"
    "      \"device\": \"nvme\", \"nvme_path\": \"/mnt/nvme0\", \"pin_memory\": true,\n"
    "      \"buffer_count\": 7, \"buffer_size\": 3000000, \"max_in_cpu\": 4000000\n"
    "    },\n"
    "    \"offload_optimizer\": {\n"
    "      \"device\": \"nvme\", \"nvme_path\": [\"/mnt/nvme1\", \"/mnt/nvme2\"],\n"
    "      \"pin_memory\": true, \"buffer_count\": 9, \"pipeline_read\": true,\n"
    "      \"pipeline_write\": true, \"fast_init\": true\n"
    "    },\n"
    "    \"stage3_prefetch_bucket_size\": 11,\n"
    "    \"stage3_max_live_parameters\": 12,\n"
    "    \"stage3_max_reuse_distance\": 13,\n"
    "    \"stage3_param_persistence_threshold\": 14\n"
    "  },\n"
    "  \"aio\": {\n"
    "    \"block_size\": 2097152, \"queue_depth\": 64, \"intra_op_parallelism\": 4,\n"
    "    \"single_submit\": true, \"overlap_events\": false, \"use_gds\": true\n"
    "  },\n"
    "  \"zinf\": {\n"
    "    \"device_bytes\": \"2G\", \"host_bytes\": 268435456,\n"
    "    \"nvme_paths\": [\"/mnt/nvme3\"], \"device\": \"emulated\", \"cuda_device\": 2,\n"
    "    \"sqpoll\": true, \"io_backend\": \"threads\"\n"
    "  }\n"
    "}\n";

Test(config, every_key_read_back_from_a_file)
{
    char *dir = test_tmpdir("config");
    char *path = write_file(dir, "ds.json", full_config);
    struct zinf_config c;
    char err[ERRLEN];

    int ret = config_parse_file(path, &c, err, sizeof(err));
    cr_assert_eq(ret, 0, "%s", err);
    cr_expect_eq(c.zero.stage, 3);
    cr_expect_eq(c.zero.sub_group_size, 2000000);
    cr_expect_eq(c.zero.offload_param.device, CONFIG_OFFLOAD_NVME);
    cr_assert_eq(c.zero.offload_param.nvme_path.count, 1);
    cr_expect_str_eq(c.zero.offload_param.nvme_path.path[0], "/mnt/nvme0");
    cr_expect_eq(c.zero.offload_param.pin_memory, true);
    cr_expect_eq(c.zero.offload_param.buffer_count, 7);
    cr_expect_eq(c.zero.offload_param.buffer_size, 3000000);
    cr_expect_eq(c.zero.offload_param.max_in_cpu, 4000000);
    cr_expect_eq(c.zero.offload_optimizer.device, CONFIG_OFFLOAD_NVME);
    cr_assert_eq(c.zero.offload_optimizer.nvme_path.count, 2);
    cr_expect_str_eq(c.zero.offload_optimizer.nvme_path.path[0], "/mnt/nvme1");
    cr_expect_str_eq(c.zero.offload_optimizer.nvme_path.path[1], "/mnt/nvme2");
    cr_expect_eq(c.zero.offload_optimizer.pin_memory, true);
    cr_expect_eq(c.zero.offload_optimizer.buffer_count, 9);
    cr_expect_eq(c.zero.offload_optimizer.pipeline_read, true);
    cr_expect_eq(c.zero.offload_optimizer.pipeline_write, true);
    cr_expect_eq(c.zero.offload_optimizer.fast_init, true);
    cr_expect_eq(c.zero.stage3_prefetch_bucket_size, 11);
    cr_expect_eq(c.zero.stage3_max_live_parameters, 12);
    cr_expect_eq(c.zero.stage3_max_reuse_distance, 13);
    cr_expect_eq(c.zero.stage3_param_persistence_threshold, 14);
    cr_expect_eq(c.aio.block_size, 2097152);
    cr_expect_eq(c.aio.queue_depth, 64);
    cr_expect_eq(c.aio.intra_op_parallelism, 4);
    cr_expect_eq(c.aio.single_submit, true);
    cr_expect_eq(c.aio.overlap_events, false);
    cr_expect_eq(c.aio.use_gds, true);
    cr_expect_eq(c.zinf.device_bytes, 2 * GiB);
    cr_expect_eq(c.zinf.host_bytes, 256 * MiB);
    cr_assert_eq(c.zinf.nvme_paths.count, 1);
    cr_expect_str_eq(c.zinf.nvme_paths.path[0], "/mnt/nvme3");
    cr_expect_eq(c.zinf.device, ZINF_DEVICE_EMULATED);
    cr_expect_eq(c.zinf.cuda_device, 2);
    cr_expect_eq(c.zinf.sqpoll, true);
    cr_expect_eq(c.zinf.io_backend, CONFIG_IO_THREADS);
    cr_expect_eq(c.n_unknown, 0);
    cr_expect_eq(c.zero.overlap_comm, true);
    cr_expect_eq(c.zero.reduce_bucket_size, 15);
    /* 34 settings, every one given; those zinf does not act on are named, with why. */
    cr_expect_eq(c.given[0], 0x3ffffffffull);
    static const char *const named[] = {
        "zero_optimization.overlap_comm",
        "zero_optimization.reduce_bucket_size", "zero_optimization.sub_group_size", "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_optimizer.fast_init",
        "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
        "aio.single_submit",
        "aio.overlap_events", "aio.use_gds"};
    cr_expect_eq(c.n_ignored, ARRAY_SIZE(named), "%zu ignored", c.n_ignored);
    for (size_t i = 0; i < ARRAY_SIZE(named); i++) {
        bool found = false;
        for (size_t j = 0; j < c.n_ignored; j++)
            found |= !strncmp(c.ignored[j], named[i], strlen(named[i])) &&
                     !strncmp(c.ignored[j] + strlen(named[i]), " (", 2) &&
                     c.ignored[j][strlen(c.ignored[j]) - 1] == ')';
        cr_expect(found, "%s is not named as ignored, with why", named[i]);
    }

    /* The engine options: zinf.nvme_paths first, then offload_param, offload_optimizer. */
    struct zinf_options o;
    config_to_options(&c, &o);
    cr_expect_str_eq(o.nvme_path, "/mnt/nvme3");
    cr_assert_not_null(o.nvme_paths_extra);
    cr_expect_str_eq(o.nvme_paths_extra[0], "/mnt/nvme0");
    cr_expect_str_eq(o.nvme_paths_extra[1], "/mnt/nvme1");
    cr_expect_str_eq(o.nvme_paths_extra[2], "/mnt/nvme2");
    cr_expect_null(o.nvme_paths_extra[3]);
    cr_expect_eq(o.block_size, 2097152);
    cr_expect_eq(o.queue_depth, 64);
    cr_expect_eq(o.device_bytes, 2 * GiB);
    cr_expect_eq(o.host_bytes, 256 * MiB);
    cr_expect_eq(o.device_kind, ZINF_DEVICE_EMULATED);
    cr_expect_eq(o.cuda_device, 2);
    cr_expect_eq(o.flags, 0);
    cr_expect_eq(o.reserved[0], 0);

    config_free(&c);
    free(path);
    test_rmtree(dir);
}

Test(config, each_enum_value)
{
    static const struct {
        const char *json;
        size_t off;
        int want;
    } cases[] = {
        {"{\"zero_optimization\": {\"offload_param\": {\"device\": \"none\"}}}",
         offsetof(struct zinf_config, zero.offload_param.device), CONFIG_OFFLOAD_NONE},
        {"{\"zero_optimization\": {\"offload_param\": {\"device\": \"cpu\"}}}",
         offsetof(struct zinf_config, zero.offload_param.device), CONFIG_OFFLOAD_CPU},
        {"{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"cpu\"}}}",
         offsetof(struct zinf_config, zero.offload_optimizer.device), CONFIG_OFFLOAD_CPU},
        {"{\"zinf\": {\"device\": \"auto\"}}", offsetof(struct zinf_config, zinf.device),
         ZINF_DEVICE_AUTO},
        {"{\"zinf\": {\"device\": \"cuda\"}}", offsetof(struct zinf_config, zinf.device),
         ZINF_DEVICE_CUDA},
        {"{\"zinf\": {\"io_backend\": \"io_uring\"}}",
         offsetof(struct zinf_config, zinf.io_backend), CONFIG_IO_URING},
        {"{\"zinf\": {\"io_backend\": \"auto\"}}",
         offsetof(struct zinf_config, zinf.io_backend), CONFIG_IO_AUTO},
    };
    for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
        struct zinf_config c;
        expect_ok(cases[i].json, &c);
        int got;
        memcpy(&got, (char *)&c + cases[i].off, sizeof(got));
        cr_expect_eq(got, cases[i].want, "%s", cases[i].json);
        config_free(&c);
    }
}

/* ---- numbers ------------------------------------------------------------------------ */

Test(config, integral_reals_are_integers)
{
    struct zinf_config c;

    expect_ok("{\"zero_optimization\": {\"stage\": 2.0, \"sub_group_size\": 1e9,"
              " \"stage3_prefetch_bucket_size\": 5e7, \"stage3_param_persistence_threshold\": 1e5,"
              " \"offload_param\": {\"buffer_size\": 1e8, \"max_in_cpu\": 1.5e9}},"
              " \"aio\": {\"block_size\": 1.048576e6, \"queue_depth\": 3.2e1},"
              " \"zinf\": {\"host_bytes\": 4e9, \"cuda_device\": 1e0}}",
              &c);
    cr_expect_eq(c.zero.stage, 2);
    cr_expect_eq(c.zero.sub_group_size, 1000000000);
    cr_expect_eq(c.zero.stage3_prefetch_bucket_size, 50000000);
    cr_expect_eq(c.zero.stage3_param_persistence_threshold, 100000);
    cr_expect_eq(c.zero.offload_param.buffer_size, 100000000);
    cr_expect_eq(c.zero.offload_param.max_in_cpu, 1500000000);
    cr_expect_eq(c.aio.block_size, 1048576);
    cr_expect_eq(c.aio.queue_depth, 32);
    cr_expect_eq(c.zinf.host_bytes, 4000000000ull);
    cr_expect_eq(c.zinf.cuda_device, 1);
    config_free(&c);
}

Test(config, size_strings_in_the_zinf_section)
{
    static const struct {
        const char *text;
        uint64_t bytes;
    } cases[] = {
        {"4G", 4 * GiB}, {"512M", 512 * MiB}, {"64k", 64 * KiB}, {"1e8", 100000000},
        {"1048576", 1048576}, {"2GiB", 2 * GiB}, {"0", 0},
    };
    for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
        char json[128];
        struct zinf_config c;
        snprintf(json, sizeof(json), "{\"zinf\": {\"device_bytes\": \"%s\", \"host_bytes\": \"%s\"}}",
                 cases[i].text, cases[i].text);
        expect_ok(json, &c);
        cr_expect_eq(c.zinf.device_bytes, cases[i].bytes, "%s", cases[i].text);
        cr_expect_eq(c.zinf.host_bytes, cases[i].bytes, "%s", cases[i].text);
        config_free(&c);
    }
}

Test(config, the_bench_tuners_aio_snippet_is_accepted_as_is)
{
    struct zinf_config c;
    struct zinf_options o;

    expect_ok("{\"aio\": {\"block_size\": 1048576, \"queue_depth\": 32, "
              "\"intra_op_parallelism\": 1, \"single_submit\": false, \"overlap_events\": true}}",
              &c);
    cr_expect_eq(c.aio.block_size, 1048576);
    cr_expect_eq(c.aio.queue_depth, 32);
    cr_expect_eq(c.n_unknown, 0);
    config_to_options(&c, &o);
    cr_expect_eq(o.block_size, 1048576);
    cr_expect_eq(o.queue_depth, 32);
    config_free(&c);
}

Test(config, limits_are_inclusive)
{
    struct zinf_config c;

    expect_ok("{\"aio\": {\"block_size\": 4096, \"queue_depth\": 1}}", &c);
    cr_expect_eq(c.aio.block_size, 4096);
    cr_expect_eq(c.aio.queue_depth, 1);
    config_free(&c);
    expect_ok("{\"aio\": {\"block_size\": 67108864, \"queue_depth\": 1024},"
              " \"zero_optimization\": {\"sub_group_size\": 9223372036854775807,"
              " \"offload_param\": {\"buffer_count\": 0}}}",
              &c);
    cr_expect_eq(c.aio.block_size, 64 * MiB);
    cr_expect_eq(c.aio.queue_depth, 1024);
    cr_expect_eq(c.zero.offload_param.buffer_count, 0);
    config_free(&c);
}

/* ---- paths -------------------------------------------------------------------------- */

Test(config, nvme_path_as_a_string)
{
    struct zinf_config c;
    struct zinf_options o;

    expect_ok("{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\","
              " \"nvme_path\": \"/local_nvme\"}}}",
              &c);
    cr_assert_eq(c.nvme_paths.count, 1);
    cr_expect_str_eq(c.nvme_paths.path[0], "/local_nvme");
    config_to_options(&c, &o);
    cr_expect_str_eq(o.nvme_path, "/local_nvme");
    cr_expect_null(o.nvme_paths_extra);
    config_free(&c);
}

Test(config, nvme_path_as_a_list)
{
    struct zinf_config c;
    struct zinf_options o;

    expect_ok("{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"nvme\","
              " \"nvme_path\": [\"/nvme0\", \"/nvme1\", \"/nvme2\"]}}}",
              &c);
    cr_assert_eq(c.nvme_paths.count, 3);
    config_to_options(&c, &o);
    cr_expect_str_eq(o.nvme_path, "/nvme0");
    cr_expect_str_eq(o.nvme_paths_extra[0], "/nvme1");
    cr_expect_str_eq(o.nvme_paths_extra[1], "/nvme2");
    cr_expect_null(o.nvme_paths_extra[2]);
    config_free(&c);
}

Test(config, nvme_paths_are_deduplicated_in_order)
{
    struct zinf_config c;

    /* The usual DeepSpeed config names one drive twice; "/a/" and "/a" are one drive. */
    expect_ok("{\"zinf\": {\"nvme_paths\": [\"/z\", \"/a/\"]},"
              " \"zero_optimization\": {"
              "  \"offload_param\": {\"device\": \"nvme\", \"nvme_path\": [\"/a\", \"/b//\"]},"
              "  \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": [\"/b\", \"/z\", \"/\"]}}}",
              &c);
    cr_assert_eq(c.nvme_paths.count, 4);
    cr_expect_str_eq(c.nvme_paths.path[0], "/z");
    cr_expect_str_eq(c.nvme_paths.path[1], "/a");
    cr_expect_str_eq(c.nvme_paths.path[2], "/b");
    cr_expect_str_eq(c.nvme_paths.path[3], "/");
    /* The sections keep what was written. */
    cr_expect_str_eq(c.zinf.nvme_paths.path[1], "/a/");
    cr_expect_str_eq(c.zero.offload_param.nvme_path.path[1], "/b//");
    config_free(&c);
}

Test(config, offload_paths_count_only_with_the_nvme_device)
{
    struct zinf_config c;
    struct zinf_options o;

    expect_ok("{\"zero_optimization\": {"
              " \"offload_param\": {\"device\": \"cpu\", \"nvme_path\": \"/unused\"},"
              " \"offload_optimizer\": {\"device\": \"none\", \"nvme_path\": \"/unused2\"}}}",
              &c);
    cr_expect_eq(c.zero.offload_param.nvme_path.count, 1);
    cr_expect_eq(c.nvme_paths.count, 0);
    config_to_options(&c, &o);
    cr_expect_null(o.nvme_path);
    config_free(&c);
}

Test(config, zinf_nvme_paths_stand_in_for_a_missing_nvme_path)
{
    struct zinf_config c;

    expect_ok("{\"zinf\": {\"nvme_paths\": \"/fast\"},"
              " \"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\"}}}",
              &c);
    cr_assert_eq(c.nvme_paths.count, 1);
    cr_expect_str_eq(c.nvme_paths.path[0], "/fast");
    config_free(&c);
}

Test(config, sixteen_paths_are_allowed)
{
    char json[2048];
    size_t len = 0;
    struct zinf_config c;
    struct zinf_options o;

    len += (size_t)snprintf(json + len, sizeof(json) - len, "{\"zinf\": {\"nvme_paths\": [");
    for (int i = 0; i < 16; i++)
        len += (size_t)snprintf(json + len, sizeof(json) - len, "%s\"/n%d\"", i ? "," : "", i);
    snprintf(json + len, sizeof(json) - len, "]}}");
    expect_ok(json, &c);
    cr_expect_eq(c.nvme_paths.count, 16);
    config_to_options(&c, &o);
    cr_expect_str_eq(o.nvme_path, "/n0");
    cr_expect_str_eq(o.nvme_paths_extra[14], "/n15");
    cr_expect_null(o.nvme_paths_extra[15]);
    config_free(&c);
}

/* ---- aliases and DeepSpeed's older forms -------------------------------------------- */

Test(config, aliases)
{
    struct zinf_config c;

    expect_ok("{\"aio\": {\"thread_count\": 6},"
              " \"zero_optimization\": {\"prefetch_bucket_size\": 21, \"max_live_parameters\": 22,"
              " \"max_reuse_distance\": 23, \"param_persistence_threshold\": 24}}",
              &c);
    cr_expect_eq(c.aio.intra_op_parallelism, 6);
    cr_expect_eq(c.zero.stage3_prefetch_bucket_size, 21);
    cr_expect_eq(c.zero.stage3_max_live_parameters, 22);
    cr_expect_eq(c.zero.stage3_max_reuse_distance, 23);
    cr_expect_eq(c.zero.stage3_param_persistence_threshold, 24);
    cr_expect_eq(c.n_unknown, 0);
    config_free(&c);
}

Test(config, a_setting_and_its_alias_together_is_an_error)
{
    expect_error("{\"aio\": {\"intra_op_parallelism\": 2, \"thread_count\": 3}}",
                 "aio.thread_count: given twice, also as intra_op_parallelism");
    expect_error("{\"zero_optimization\": {\"prefetch_bucket_size\": 1,"
                 " \"stage3_prefetch_bucket_size\": 2}}",
                 "zero_optimization.stage3_prefetch_bucket_size: given twice, also as "
                 "prefetch_bucket_size");
}

Test(config, zero_optimization_as_a_boolean_is_the_old_stage_1)
{
    struct zinf_config c;

    expect_ok("{\"zero_optimization\": true}", &c);
    cr_expect_eq(c.zero.stage, 1);
    config_free(&c);
    expect_ok("{\"zero_optimization\": false}", &c);
    cr_expect_eq(c.zero.stage, 0);
    config_free(&c);
}

/* ---- ignored and unknown keys ------------------------------------------------------- */

static const char deepspeed_config[] =
    "{\n"
    "  \"train_batch_size\": 32, \"train_micro_batch_size_per_gpu\": 4,\n"
    "  \"gradient_accumulation_steps\": 8,\n"
    "  \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-5, \"betas\": [0.9, 0.999]}},\n"
    "  \"scheduler\": {\"type\": \"WarmupLR\", \"params\": {\"warmup_num_steps\": 100}},\n"
    "  \"fp16\": {\"enabled\": \"auto\", \"loss_scale\": 0}, \"bf16\": {\"enabled\": false},\n"
    "  \"amp\": {\"enabled\": false}, \"gradient_clipping\": 1.0, \"steps_per_print\": 2000,\n"
    "  \"wall_clock_breakdown\": false, \"zero_allow_untested_optimizer\": true,\n"
    "  \"activation_checkpointing\": {\"partition_activations\": true},\n"
    "  \"flops_profiler\": {\"enabled\": false}, \"tensorboard\": {\"enabled\": false},\n"
    "  \"wandb\": {\"enabled\": false}, \"comms_logger\": {\"enabled\": false},\n"
    "  \"zero_optimization\": {\n"
    "    \"stage\": 3, \"contiguous_gradients\": true, \"overlap_comm\": true,\n"
    "    \"reduce_scatter\": true, \"reduce_bucket_size\": 5e8, \"allgather_partitions\": true,\n"
    "    \"allgather_bucket_size\": 5e8, \"round_robin_gradients\": true,\n"
    "    \"stage3_gather_16bit_weights_on_model_save\": true,\n"
    "    \"stage3_gather_fp16_weights_on_model_save\": false, \"elastic_checkpoint\": false,\n"
    "    \"ignore_unused_parameters\": true, \"cpu_offload\": false,\n"
    "    \"memory_efficient_linear\": true, \"zero_hpz_partition_size\": 1,\n"
    "    \"zero_quantized_weights\": false, \"zero_quantized_gradients\": false,\n"
    "    \"mics_shard_size\": -1,\n"
    "    \"offload_param\": {\"device\": \"cpu\", \"pin_memory\": true, \"ratio\": 1.0},\n"
    "    \"offload_optimizer\": {\"device\": \"cpu\", \"pin_memory\": true, \"pipeline\": false,\n"
    "                          \"ratio\": 0.3}\n"
    "  }\n"
    "}\n";

Test(config, deepspeed_keys_zinf_does_not_use_are_not_warned)
{
    struct zinf_config c;

    test_log_capture_start();
    expect_ok(deepspeed_config, &c);
    cr_expect_str_eq(test_log_text(), "");
    test_log_capture_stop();
    cr_expect_eq(c.n_unknown, 0);
    /* The training keys are read now (zinf train honours them): not ignored; nor is the
     * stage, which one rank acts on too (it holds its whole partition). */
    cr_expect_eq(c.n_ignored, 27, "%zu ignored", c.n_ignored);
    cr_expect_not(listed_prefix(c.ignored, c.n_ignored, "zero_optimization.stage ("));
    /* Each with why. */
    for (size_t i = 0; i < c.n_ignored; i++)
        cr_expect(strstr(c.ignored[i], " (") && c.ignored[i][strlen(c.ignored[i]) - 1] == ')',
                  "no reason: %s", c.ignored[i]);
    /* The section acts (cpu_checkpointing); partition_activations is named, with why. */
    cr_expect(listed_prefix(c.ignored, c.n_ignored,
                            "activation_checkpointing.partition_activations (each rank keeps"));
    cr_expect_not(listed(c.ignored, c.n_ignored, "optimizer"));
    cr_expect_eq(c.train.train_batch_size, 32);
    cr_expect_eq(c.train.micro_batch, 4);
    cr_expect_eq(c.train.grad_accum, 8);
    cr_expect_str_eq(c.train.optimizer.type, "AdamW");
    cr_expect_eq(c.train.optimizer.lr, 3e-5);
    cr_expect_eq(c.train.scheduler.warmup_num_steps, 100);
    cr_expect(config_is_auto(&c, "fp16.enabled"));
    cr_expect_eq(c.train.grad_clip, 1.0);
    cr_expect_eq(c.train.steps_per_print, 2000);
    /* Read (across ranks the trainer uses it), but named for one rank, with why. */
    cr_expect(listed_prefix(c.ignored, c.n_ignored, "zero_optimization.overlap_comm ("));
    cr_expect(listed_prefix(c.ignored, c.n_ignored, "zero_optimization.offload_optimizer.ratio ("));
    cr_expect(listed_prefix(c.ignored, c.n_ignored, "zero_optimization.offload_optimizer.pipeline ("));
    cr_expect(listed_prefix(c.ignored, c.n_ignored, "zero_optimization.offload_param.ratio ("));
    cr_expect_eq(c.zero.stage, 3);
    cr_expect_eq(c.zero.offload_param.device, CONFIG_OFFLOAD_CPU);
    config_free(&c);
}

Test(config, unknown_keys_are_warned_with_their_full_path)
{
    struct zinf_config c;

    test_log_capture_start();
    expect_ok("{\"trian_batch_size\": 1,"
              " \"zero_optimization\": {\"offload_parm\": {\"device\": \"nvme\"},"
              "   \"offload_param\": {\"devcie\": \"cpu\"}, \"offload_optimizer\": {\"x\": 1}},"
              " \"aio\": {\"blocksize\": 4096}, \"zinf\": {\"hostbytes\": 1},"
              " \"offload_param\": {}}",
              &c);
    const char *log = test_log_text();
    static const char *const want[] = {
        "trian_batch_size",
        "zero_optimization.offload_parm",
        "zero_optimization.offload_param.devcie",
        "zero_optimization.offload_optimizer.x",
        "aio.blocksize",
        "zinf.hostbytes",
        "offload_param",
    };
    cr_expect_eq(c.n_unknown, ARRAY_SIZE(want));
    for (size_t i = 0; i < ARRAY_SIZE(want); i++) {
        char line[256];
        cr_expect(listed(c.unknown, c.n_unknown, want[i]), "%s not listed", want[i]);
        snprintf(line, sizeof(line), "t.json: %s: unknown key, ignored", want[i]);
        cr_expect(strstr(log, line), "no warning for %s in:\n%s", want[i], log);
    }
    cr_expect(strstr(log, "zero_optimization.offload_parm: unknown key, ignored (did you mean "
                          "\"offload_param\"?)"),
              "%s", log);
    cr_expect(strstr(log, "aio.blocksize: unknown key, ignored (did you mean \"block_size\"?)"),
              "%s", log);
    cr_expect(strstr(log, "t.json: offload_param: unknown key, ignored: offload_param belongs in "
                          "zero_optimization; move it there"),
              "%s", log);
    /* The unknown keys did not stop the known ones. */
    cr_expect_eq(c.zero.offload_param.device, CONFIG_OFFLOAD_NONE);
    test_log_capture_stop();
    config_free(&c);
}

Test(config, odd_unknown_keys_stay_on_one_line)
{
    struct zinf_config c;
    char json[512], longkey[301];

    memset(longkey, 'k', 300);
    longkey[300] = '\0';
    snprintf(json, sizeof(json), "{\"a\\nb\\\"c\": 1, \"zinf\": {\"%s\": 2}}", longkey);
    test_log_capture_start();
    expect_ok(json, &c);
    cr_assert_eq(c.n_unknown, 2);
    cr_expect_str_eq(c.unknown[0], "a\\x0ab\\x22c");
    cr_expect_eq(strlen(c.unknown[1]), strlen("zinf.") + 128 + 3);
    cr_expect_eq(strncmp(c.unknown[1] + strlen(c.unknown[1]) - 3, "...", 3), 0);
    const char *log = test_log_text();
    size_t lines = 0;
    for (const char *s = log; *s; s++)
        lines += *s == '\n';
    cr_expect_eq(lines, 2, "%s", log);
    test_log_capture_stop();
    config_free(&c);
}

/* ---- bad input: one class per test, the exact message ------------------------------- */

Test(config, wrong_types)
{
    expect_error("{\"aio\": {\"queue_depth\": \"32\"}}",
                 "aio.queue_depth: must be an integer, got a string");
    expect_error("{\"aio\": {\"block_size\": [4096]}}",
                 "aio.block_size: must be an integer, got a list");
    expect_error("{\"zero_optimization\": {\"stage\": true}}",
                 "zero_optimization.stage: must be an integer, got a boolean");
    expect_error("{\"zero_optimization\": {\"sub_group_size\": null}}",
                 "zero_optimization.sub_group_size: must be an integer, got null");
    expect_error("{\"zero_optimization\": {\"offload_param\": {\"buffer_size\": \"1e8\"}}}",
                 "zero_optimization.offload_param.buffer_size: must be an integer, got a string");
    expect_error("{\"aio\": {\"single_submit\": 1}}",
                 "aio.single_submit: must be true or false, got an integer");
    expect_error("{\"zero_optimization\": {\"offload_optimizer\": {\"pin_memory\": \"true\"}}}",
                 "zero_optimization.offload_optimizer.pin_memory: must be true or false, got a "
                 "string");
    expect_error("{\"zinf\": {\"sqpoll\": {}}}", "zinf.sqpoll: must be true or false, got an object");
    expect_error("{\"zinf\": {\"host_bytes\": true}}",
                 "zinf.host_bytes: must be an integer or a size string like \"4G\", got a boolean");
    expect_error("{\"zinf\": {\"cuda_device\": \"1\"}}",
                 "zinf.cuda_device: must be an integer, got a string");
}

Test(config, wrong_types_for_sections)
{
    expect_error("[]", "top level: must be an object, got a list");
    expect_error("{\"aio\": []}", "aio: must be an object, got a list");
    expect_error("{\"aio\": 1}", "aio: must be an object, got an integer");
    expect_error("{\"zinf\": \"fast\"}", "zinf: must be an object, got a string");
    expect_error("{\"zero_optimization\": 3}",
                 "zero_optimization: must be an object, got an integer");
    expect_error("{\"zero_optimization\": {\"offload_param\": \"cpu\"}}",
                 "zero_optimization.offload_param: must be an object, got a string");
    expect_error("{\"zero_optimization\": {\"offload_optimizer\": [1]}}",
                 "zero_optimization.offload_optimizer: must be an object, got a list");
}

Test(config, out_of_range)
{
    expect_error("{\"zero_optimization\": {\"stage\": 4}}",
                 "zero_optimization.stage: must be between 0 and 3, got 4");
    expect_error("{\"zero_optimization\": {\"stage\": -1}}",
                 "zero_optimization.stage: must be between 0 and 3, got -1");
    expect_error("{\"aio\": {\"queue_depth\": 0}}",
                 "aio.queue_depth: must be between 1 and 1024, got 0");
    expect_error("{\"aio\": {\"queue_depth\": 1025}}",
                 "aio.queue_depth: must be between 1 and 1024, got 1025");
    expect_error("{\"aio\": {\"block_size\": 0}}",
                 "aio.block_size: must be between 4096 and 67108864, got 0");
    expect_error("{\"aio\": {\"block_size\": 134217728}}",
                 "aio.block_size: must be between 4096 and 67108864, got 134217728");
    expect_error("{\"aio\": {\"intra_op_parallelism\": 0}}",
                 "aio.intra_op_parallelism: must be at least 1, got 0");
    expect_error("{\"aio\": {\"thread_count\": -2}}",
                 "aio.thread_count: must be at least 1, got -2");
}

Test(config, negative_numbers)
{
    expect_error("{\"zero_optimization\": {\"offload_param\": {\"buffer_count\": -1}}}",
                 "zero_optimization.offload_param.buffer_count: must be non-negative, got -1");
    expect_error("{\"zero_optimization\": {\"sub_group_size\": -1e3}}",
                 "zero_optimization.sub_group_size: must be non-negative, got -1000");
    expect_error("{\"zinf\": {\"cuda_device\": -1}}",
                 "zinf.cuda_device: must be non-negative, got -1");
    expect_error("{\"zinf\": {\"device_bytes\": -4096}}",
                 "zinf.device_bytes: must be non-negative, got -4096");
    expect_error("{\"zinf\": {\"host_bytes\": \"-4G\"}}",
                 "zinf.host_bytes: must be a size like \"4G\", \"512M\" or a number of bytes, "
                 "got \"-4G\"");
}

Test(config, numbers_that_overflow)
{
    expect_error("{\"zero_optimization\": {\"sub_group_size\": 1e30}}",
                 "zero_optimization.sub_group_size: is too large, got 1e+30");
    expect_error("{\"zero_optimization\": {\"sub_group_size\": 18446744073709551616.0}}",
                 "zero_optimization.sub_group_size: is too large, got 1.84467e+19");
    expect_error("{\"zero_optimization\": {\"sub_group_size\": 1e19}}",
                 "zero_optimization.sub_group_size: is too large, got 1e+19");
    expect_error("{\"zinf\": {\"cuda_device\": 2147483648}}",
                 "zinf.cuda_device: is too large, got 2147483648");
    expect_error("{\"aio\": {\"intra_op_parallelism\": 4294967296}}",
                 "aio.intra_op_parallelism: is too large, got 4294967296");
    expect_error("{\"zinf\": {\"host_bytes\": \"99999999T\"}}",
                 "zinf.host_bytes: is too large, got \"99999999T\"");
    /* Integers past int64 and reals past double are refused by the JSON reader itself. */
    expect_error("{\"zero_optimization\": {\"sub_group_size\": 99999999999999999999}}",
                 "t.json:1:61: too big integer near '99999999999999999999'");
    expect_error("{\"aio\": {\"queue_depth\": 1e999}}",
                 "t.json:1:29: real number overflow near '1e999'");
}

Test(config, fractions)
{
    expect_error("{\"aio\": {\"queue_depth\": 3.5}}", "aio.queue_depth: must be an integer, got 3.5");
    expect_error("{\"zero_optimization\": {\"stage\": 0.5}}",
                 "zero_optimization.stage: must be an integer, got 0.5");
    expect_error("{\"zinf\": {\"host_bytes\": \"1.5\"}}",
                 "zinf.host_bytes: must be a size like \"4G\", \"512M\" or a number of bytes, "
                 "got \"1.5\"");
    expect_error("{\"zinf\": {\"device_bytes\": \"4Q\"}}",
                 "zinf.device_bytes: must be a size like \"4G\", \"512M\" or a number of bytes, "
                 "got \"4Q\"");
}

Test(config, unaligned_block_size)
{
    expect_error("{\"aio\": {\"block_size\": 1000}}",
                 "aio.block_size: must be a multiple of 4096, got 1000");
    expect_error("{\"aio\": {\"block_size\": 1048577}}",
                 "aio.block_size: must be a multiple of 4096, got 1048577");
    expect_error("{\"aio\": {\"block_size\": 1e6}}",
                 "aio.block_size: must be a multiple of 4096, got 1e+06");
}

Test(config, bad_enums)
{
    expect_error("{\"zero_optimization\": {\"offload_param\": {\"device\": \"gpu\"}}}",
                 "zero_optimization.offload_param.device: must be one of \"none\", \"cpu\", "
                 "\"nvme\", got \"gpu\"");
    expect_error("{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"NVME\"}}}",
                 "zero_optimization.offload_optimizer.device: must be one of \"none\", \"cpu\", "
                 "\"nvme\", got \"NVME\"");
    expect_error("{\"zero_optimization\": {\"offload_param\": {\"device\": 2}}}",
                 "zero_optimization.offload_param.device: must be one of \"none\", \"cpu\", "
                 "\"nvme\", got an integer");
    expect_error("{\"zinf\": {\"device\": \"tpu\"}}",
                 "zinf.device: must be one of \"auto\", \"cuda\", \"emulated\", got \"tpu\"");
    expect_error("{\"zinf\": {\"io_backend\": \"aio\"}}",
                 "zinf.io_backend: must be one of \"auto\", \"io_uring\", \"threads\", got \"aio\"");
    /* A value with odd bytes is escaped and cut short, so the message stays one line. */
    expect_error("{\"zinf\": {\"device\": \"a\\nb\"}}",
                 "zinf.device: must be one of \"auto\", \"cuda\", \"emulated\", got \"a\\x0ab\"");
    expect_error("{\"zinf\": {\"device\": \"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
                 "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}}",
                 "zinf.device: must be one of \"auto\", \"cuda\", \"emulated\", got "
                 "\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...\"");
}

Test(config, syntax_errors_name_line_and_column)
{
    expect_error("{\n  \"aio\": {,}\n}", "t.json:2:11: string or '}' expected near ','");
    expect_error("", "t.json:1:0: '[' or '{' expected near end of file");
    expect_error("{} x", "t.json:1:4: end of file expected near 'x'");
    expect_error("{\"aio\": {\"block_size\": 4096,}}", "t.json:1:29: string or '}' expected near '}'");
    expect_error("{\"zero_optimization\": {\"stage\": 1, \"stage\": 2}}",
                 "t.json:1:42: duplicate object key near '\"stage\"'");
    expect_error("{\"a\": \"x\x01\"}", "t.json:1:8: control character 0x1 near '\"x'");
    /* A comment (DeepSpeed reads hjson) is a syntax error here. */
    expect_error("{\n// zero\n}", "t.json:2:1: string or '}' expected near '/'");
}

Test(config, missing_and_unreadable_files)
{
    struct zinf_config c;
    char err[ERRLEN];
    char *dir = test_tmpdir("config");
    char *missing;

    cr_assert(asprintf(&missing, "%s/nope.json", dir) > 0);
    cr_expect_eq(config_parse_file(missing, &c, err, sizeof(err)), -ENOENT);
    char want[ERRLEN];
    snprintf(want, sizeof(want), "%s: No such file or directory", missing);
    cr_expect_str_eq(err, want);
    config_free(&c);

    cr_expect_eq(config_parse_file(dir, &c, err, sizeof(err)), -EISDIR);
    snprintf(want, sizeof(want), "%s: Is a directory", dir);
    cr_expect_str_eq(err, want);
    config_free(&c);

    /* A syntax error in a file names the file. */
    char *bad = write_file(dir, "bad.json", "{\n  \"aio\": {\"queue_depth\": 8\n}\n");
    cr_expect_eq(config_parse_file(bad, &c, err, sizeof(err)), -EINVAL);
    snprintf(want, sizeof(want), "%s:4:0: '}' expected near end of file", bad);
    cr_expect_str_eq(err, want);
    config_free(&c);

    free(bad);
    free(missing);
    test_rmtree(dir);
}

Test(config, nvme_without_a_path)
{
    expect_error("{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\"}}}",
                 "zero_optimization.offload_param.nvme_path: required when device is \"nvme\"");
    expect_error("{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"nvme\","
                 " \"nvme_path\": null}}}",
                 "zero_optimization.offload_optimizer.nvme_path: required when device is "
                 "\"nvme\"");
    expect_error("{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"nvme\","
                 " \"nvme_path\": []}}}",
                 "zero_optimization.offload_optimizer.nvme_path: required when device is "
                 "\"nvme\"");
}

Test(config, bad_paths)
{
    expect_error("{\"zero_optimization\": {\"offload_param\": {\"nvme_path\": \"\"}}}",
                 "zero_optimization.offload_param.nvme_path: must not be empty");
    expect_error("{\"zinf\": {\"nvme_paths\": [\"/a\", \"\"]}}",
                 "zinf.nvme_paths[1]: must not be empty");
    expect_error("{\"zinf\": {\"nvme_paths\": [\"/a\", 7]}}",
                 "zinf.nvme_paths[1]: must be a string, got an integer");
    expect_error("{\"zero_optimization\": {\"offload_param\": {\"nvme_path\": 5}}}",
                 "zero_optimization.offload_param.nvme_path: must be a string or a list of "
                 "strings, got an integer");
    expect_error("{\"zinf\": {\"nvme_paths\": {}}}",
                 "zinf.nvme_paths: must be a string or a list of strings, got an object");

    char *json = malloc(8192);
    cr_assert(json);
    int n = snprintf(json, 8192, "{\"zinf\": {\"nvme_paths\": \"/");
    memset(json + n, 'p', 4095);
    snprintf(json + n + 4095, 8192 - (size_t)n - 4095, "\"}}");
    expect_error(json, "zinf.nvme_paths: is too long, 4096 bytes (at most 4095)");
    free(json);
}

Test(config, too_many_paths)
{
    char json[4096];
    size_t len = 0;

    len += (size_t)snprintf(json + len, sizeof(json) - len, "{\"zinf\": {\"nvme_paths\": [");
    for (int i = 0; i < 17; i++)
        len += (size_t)snprintf(json + len, sizeof(json) - len, "%s\"/n%d\"", i ? "," : "", i);
    snprintf(json + len, sizeof(json) - len, "]}}");
    expect_error(json, "zinf.nvme_paths: too many paths, got 17 (at most 16)");

    /* 10 + 10 distinct over two sections is too many in all. */
    len = (size_t)snprintf(json, sizeof(json), "{\"zinf\": {\"nvme_paths\": [");
    for (int i = 0; i < 10; i++)
        len += (size_t)snprintf(json + len, sizeof(json) - len, "%s\"/z%d\"", i ? "," : "", i);
    len += (size_t)snprintf(json + len, sizeof(json) - len,
                            "]}, \"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\","
                            " \"nvme_path\": [");
    for (int i = 0; i < 10; i++)
        len += (size_t)snprintf(json + len, sizeof(json) - len, "%s\"/p%d\"", i ? "," : "", i);
    snprintf(json + len, sizeof(json) - len, "]}}}");
    expect_error(json, "zero_optimization.offload_param.nvme_path: too many NVMe paths: more than "
                       "16 distinct directories over zinf.nvme_paths and the offload sections");
}

Test(config, unknown_keys_before_an_error_are_not_kept)
{
    struct zinf_config c;
    char err[ERRLEN];

    test_log_capture_start();
    cr_expect_eq(parse("{\"foo\": 1, \"aio\": {\"queue_depth\": -1}}", &c, err), -EINVAL);
    cr_expect_eq(c.n_unknown, 0);
    cr_expect_null(c.unknown);
    test_log_capture_stop();
    config_free(&c);
}

/* ---- the interface itself ----------------------------------------------------------- */

Test(config, free_is_safe_on_defaults_and_twice)
{
    struct zinf_config c;

    config_defaults(&c);
    config_free(&c);
    config_free(&c);
    expect_ok(full_config, &c);
    config_free(&c);
    check_defaults(&c);
    config_free(&c);
    config_free(NULL);
}

Test(config, bad_arguments)
{
    struct zinf_config c;
    char err[ERRLEN];

    cr_expect_eq(config_parse_buffer("{}", 2, "x", NULL, err, sizeof(err)), -EINVAL);
    cr_expect_eq(config_parse_buffer(NULL, 5, "x", &c, err, sizeof(err)), -EINVAL);
    cr_expect_str_eq(err, "x: no buffer");
    config_free(&c);
    cr_expect_eq(config_parse_file(NULL, &c, err, sizeof(err)), -EINVAL);
    config_free(&c);
    /* No error buffer, or a tiny one: still the right code, never an overflow. */
    cr_expect_eq(config_parse_buffer("{\"aio\": 1}", 10, "x", &c, NULL, 0), -EINVAL);
    config_free(&c);
    char tiny[8];
    cr_expect_eq(config_parse_buffer("{\"aio\": 1}", 10, "x", &c, tiny, sizeof(tiny)), -EINVAL);
    cr_expect_str_eq(tiny, "aio: mu");
    config_free(&c);
    /* The buffer need not be NUL-terminated: only len bytes are read. */
    cr_expect_eq(config_parse_buffer("{}garbage", 2, "x", &c, err, sizeof(err)), 0);
    config_free(&c);
}

Test(config, a_second_parse_starts_from_the_defaults)
{
    struct zinf_config c;

    expect_ok("{\"aio\": {\"queue_depth\": 16}}", &c);
    config_free(&c);
    expect_ok("{}", &c);
    cr_expect_eq(c.aio.queue_depth, 8);
    config_free(&c);
}

static char *print_to_string(const struct zinf_config *c)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    cr_assert(f);
    cr_expect_eq(config_print(c, f), 0);
    fclose(f);
    return text;
}

Test(config, print_lists_every_setting_and_the_engine_options)
{
    struct zinf_config c;

    config_defaults(&c);
    char *text = print_to_string(&c);
    static const char *const want[] = {
        "zero_optimization.stage = 0  # default\n",
        "zero_optimization.offload_param.device = \"none\"  # default\n",
        "zero_optimization.offload_param.nvme_path = []  # default\n",
        "zero_optimization.offload_param.buffer_size = 100000000  # default\n",
        "aio.block_size = 1048576  # default\n",
        "aio.queue_depth = 8  # default\n",
        "aio.intra_op_parallelism = 1  # default\n",
        "train_micro_batch_size_per_gpu = none  # not set: the command's own default\n",
        "optimizer.params.betas = [0.9, 0.999]  # default\n",
        "scheduler.params.warmup_type = \"log\"  # default\n",
        "bf16.enabled = false  # default\n",
        "pipeline.stages = 1  # default\n",
        "pipeline.partition = \"parameters\"  # default\n",
        "zinf.host_bytes = 0  # default\n",
        "zinf.device = \"auto\"  # default\n",
        "zinf.io_backend = \"auto\"  # default\n",
        "zinf.submit_batch = 0  # default\n",
        "zinf.staging_bytes = 0  # default\n",
        "zinf.huge_pages = true  # default\n",
        "zinf.connect = []  # default\n",
        "zinf.job = \"\"  # default\n",
        "zinf.comm_pool = true  # default\n",
        "zinf.train.checkpoint_every = 0  # default\n",
        "zinf.train.checkpoint_start = true  # default\n",
        "zinf.train.update_in_forward = true  # default\n",
        "zinf.train.activation_offload = \"auto\"  # default\n",
        "activation_checkpointing.cpu_checkpointing = none  # not set: the command's own "
        "default\n",
        "engine.nvme_path = none  # no NVMe tier\n",
        "engine.nvme_paths_extra = []\n",
        "engine.block_size = 1048576  # 1 MiB\n",
        "engine.queue_depth = 8\n",
        "engine.host_bytes = 0  # engine default: 1 GiB\n",
        "engine.device_bytes = 0  # engine default: on a GPU its free memory less a reserve, "
        "emulated 1 GiB\n",
        "engine.device_kind = auto\n",
        "engine.cuda_device = 0\n",
        "zinf.optimizer_state_dtype = \"fp32\"  # default\n",
        "communication_data_type = \"\"  # default\n",
        "optimizer.params.freeze_step = 100000  # default\n",
    };
    for (size_t i = 0; i < ARRAY_SIZE(want); i++)
        cr_expect(strstr(text, want[i]), "missing %s in:\n%s", want[i], text);
    /* What zinf does not act on is not an effective setting: not printed as one. */
    static const char *const not_settings[] = {
        "sub_group_size", "max_in_cpu", "offload_optimizer.buffer_count",
        "fast_init", "max_live_parameters", "max_reuse_distance",
        "single_submit", "overlap_events", "use_gds"};
    for (size_t i = 0; i < ARRAY_SIZE(not_settings); i++)
        cr_expect_null(strstr(text, not_settings[i]), "%s printed as a setting:\n%s",
                       not_settings[i], text);
    size_t lines = 0;
    for (const char *s = text; *s; s++)
        lines += *s == '\n';
    /* settings (zinf.base_job among them), zinf.train, zinf.serve, the training keys, the
     * model-parallel ones (pipeline.stages, pipeline.partition, zinf.train.pipeline_cut,
     * tensor_parallel.autotp_size, sequence_parallel_size), the moe section (its
     * eval_capacity_factor is ignored), activation_checkpointing.cpu_checkpointing and
     * zinf.train.activation_offload (the section's others are ignored), DeepSpeed's
     * deprecated cpu_offload and cpu_offload_param, zinf.optimizer_state_dtype, header, engine */
    cr_expect_eq(lines, 30 + 11 + 13 + 52 + 5 + 10 + 2 + 2 + 1 + 1 + 8, "%zu lines: %s", lines,
                 text);
    free(text);
    config_free(&c);
}

Test(config, print_shows_given_values_and_ignored_and_unknown_keys)
{
    struct zinf_config c;

    test_log_capture_start();
    expect_ok("{\"amp\": {}, \"zinf\": {\"host_bytes\": \"4G\", \"nvme_paths\": [\"/a\", \"/b\\\"\"],"
              " \"bogus\": 1}, \"aio\": {\"queue_depth\": 32}}",
              &c);
    test_log_capture_stop();
    char *text = print_to_string(&c);
    static const char *const want[] = {
        "zinf.host_bytes = 4294967296\n",
        "zinf.nvme_paths = [\"/a\", \"/b\\\"\"]\n",
        "aio.queue_depth = 32\n",
        "engine.nvme_path = \"/a\"\n",
        "engine.nvme_paths_extra = [\"/b\\\"\"]\n",
        "engine.queue_depth = 32\n",
        "engine.host_bytes = 4294967296  # 4 GiB\n",
        "# ignored by zinf (DeepSpeed keys zinf does not act on):\n#   amp (mixed precision is "
        "fp16, bf16 or zinf.train.precision)\n",
        "# unknown keys (ignored):\n#   zinf.bogus\n",
    };
    for (size_t i = 0; i < ARRAY_SIZE(want); i++)
        cr_expect(strstr(text, want[i]), "missing %s in:\n%s", want[i], text);
    free(text);
    config_free(&c);
}

/* config_print_settings: the settings and the engine options, not the ignored or unknown
 * keys (zinf config check names those itself, before the settings); /dev/full: -EIO. */
Test(config, print_settings_leaves_out_the_ignored_and_unknown_keys)
{
    struct zinf_config c;

    test_log_capture_start();
    expect_ok("{\"amp\": {}, \"zinf\": {\"bogus\": 1}, \"aio\": {\"queue_depth\": 32}}", &c);
    test_log_capture_stop();
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    cr_assert(f);
    cr_expect_eq(config_print_settings(&c, f), 0);
    fclose(f);
    cr_expect(strstr(text, "aio.queue_depth = 32\n") && strstr(text, "engine.queue_depth = 32\n"),
              "%s", text);
    cr_expect_null(strstr(text, "amp"), "%s", text);
    cr_expect_null(strstr(text, "bogus"), "%s", text);
    cr_expect_null(strstr(text, "# ignored"), "%s", text);
    free(text);
    f = fopen("/dev/full", "w");
    if (f) {
        cr_expect_eq(config_print_settings(&c, f), -EIO);
        fclose(f);
    }
    config_free(&c);
}

Test(config, print_reports_a_failed_write)
{
    struct zinf_config c;
    FILE *f = fopen("/dev/full", "w");

    if (!f)
        cr_skip_test("no /dev/full");
    config_defaults(&c);
    cr_expect_eq(config_print(&c, f), -EIO);
    fclose(f);
    config_free(&c);
}

Test(config, zinf_train_section)
{
    struct zinf_config c;
    char err[256];
    const char *ok = "{\"zinf\": {\"train\": {\"layers\": 6, \"dim\": 96, \"heads\": 6, \"seq\": 128,"
                     " \"batch\": 8, \"steps\": 1e3, \"seed\": 42}}}";
    cr_assert_eq(config_parse_buffer(ok, strlen(ok), "t.json", &c, err, sizeof(err)), 0, "%s", err);
    cr_expect_eq(c.zinf.train.layers, 6);
    cr_expect_eq(c.zinf.train.dim, 96);
    cr_expect_eq(c.zinf.train.heads, 6);
    cr_expect_eq(c.zinf.train.seq, 128);
    cr_expect_eq(c.zinf.train.batch, 8);
    cr_expect_eq(c.zinf.train.steps, 1000);
    cr_expect_eq(c.zinf.train.seed, 42);
    config_free(&c);

    const char *bad = "{\"zinf\": {\"train\": {\"dim\": \"wide\"}}}";
    cr_assert_eq(config_parse_buffer(bad, strlen(bad), "t.json", &c, err, sizeof(err)), -EINVAL);
    cr_expect(strstr(err, "zinf.train.dim"), "%s", err);
    config_free(&c);
}

/* zinf.submit_batch, zinf.staging_bytes and zinf.huge_pages (what `zinf tune` writes):
 * their defaults, their limits, and that an engine opened from them uses them. */
Test(config, io_settings_of_the_zinf_section_reach_the_engine)
{
    struct zinf_config c;
    char err[ERRLEN];
    cr_assert_eq(parse("{}", &c, err), 0, "%s", err);
    cr_expect_eq(c.zinf.submit_batch, 0);
    cr_expect_eq(c.zinf.staging_bytes, 0);
    cr_expect(c.zinf.huge_pages);
    config_free(&c);
    expect_error("{\"zinf\": {\"submit_batch\": 1025}}",
                 "zinf.submit_batch: must be between 0 and 1024, got 1025");
    expect_error("{\"zinf\": {\"staging_bytes\": \"5G\"}}",
                 "zinf.staging_bytes: must be between 0 and 4294967296, got \"5G\"");
    expect_error("{\"zinf\": {\"huge_pages\": 1}}",
                 "zinf.huge_pages: must be true or false, got an integer");

    char *dir = test_tmpdir("config");
    char json[1024];
    snprintf(json, sizeof(json),
             "{\"aio\": {\"block_size\": 262144, \"queue_depth\": 16, \"intra_op_parallelism\": 2}, "
             "\"zinf\": {\"nvme_paths\": "
             "[\"%s\"], \"device\": \"emulated\", \"host_bytes\": \"8M\", \"device_bytes\": \"8M\", "
             "\"submit_batch\": 4, \"staging_bytes\": \"3M\", \"huge_pages\": false}}", dir);
    cr_assert_eq(parse(json, &c, err), 0, "%s", err);
    zinf_engine *e = NULL;
    int r = engine_open_config(&c, 0, &e);
    cr_assert_eq(r, 0, "%s", zinf_strerror(r));
    struct host_stats hs;
    host_get_stats(e->host, &hs);
    cr_expect_eq(hs.staging_bytes, 12 * 256 * KiB, "3M of 256K blocks: 12 slots, got %zu",
                 hs.staging_bytes);
    cr_expect(!hs.huge_pages, "huge_pages false: the arena was advised to use them");
    struct uring_stats us;
    uring_get_stats(e->io, &us);
    cr_expect_eq(us.submit_batch, 4);
    if (us.backend == URING_BACKEND_IO_URING) /* aio.intra_op_parallelism: rings */
        cr_expect_eq(us.rings, 2);
    zinf_close(e);
    config_free(&c);
    /* The defaults: huge pages on, the ring 2 x queue depth blocks, one chunk a completion. */
    snprintf(json, sizeof(json),
             "{\"aio\": {\"block_size\": 262144, \"queue_depth\": 16}, \"zinf\": {\"nvme_paths\": "
             "[\"%s\"], \"device\": \"emulated\", \"host_bytes\": \"8M\", \"device_bytes\": \"8M\"}}",
             dir);
    cr_assert_eq(parse(json, &c, err), 0, "%s", err);
    cr_assert_eq(engine_open_config(&c, ZINF_OPEN_OVERWRITE, &e), 0);
    host_get_stats(e->host, &hs);
    cr_expect_eq(hs.staging_bytes, 32 * 256 * KiB);
    uring_get_stats(e->io, &us);
    cr_expect_eq(us.submit_batch, 1);
    zinf_close(e);
    config_free(&c);
    /* DeepSpeed configs may ask for more threads than zinf drives rings: the most it
     * drives, not an error. */
    snprintf(json, sizeof(json),
             "{\"aio\": {\"thread_count\": 16}, \"zinf\": {\"nvme_paths\": [\"%s\"], "
             "\"device\": \"emulated\", \"host_bytes\": \"8M\", \"device_bytes\": \"8M\"}}",
             dir);
    cr_assert_eq(parse(json, &c, err), 0, "%s", err);
    cr_assert_eq(engine_open_config(&c, ZINF_OPEN_OVERWRITE, &e), 0);
    uring_get_stats(e->io, &us);
    if (us.backend == URING_BACKEND_IO_URING)
        cr_expect_eq(us.rings, URING_MAX_RINGS);
    zinf_close(e);
    config_free(&c);
    test_rmtree(dir);
}

/* zinf_open_parsed opens a parsed config as engine_open_config does (its staging area and
 * pinning show in zinf_stats), with the flags of zinf_open_config_flags, and refuses bad
 * input: no config, no out, an unknown flag, PREVIOUS without RESUME or READONLY, and
 * READONLY where nothing is saved. */
Test(config, a_parsed_config_opens_through_the_public_call)
{
    struct zinf_config c;
    char err[ERRLEN], json[1024];
    char *dir = test_tmpdir("parsed");
    snprintf(json, sizeof(json),
             "{\"aio\": {\"block_size\": 262144, \"queue_depth\": 16}, \"zinf\": {\"nvme_paths\": "
             "[\"%s\"], \"device\": \"emulated\", \"host_bytes\": \"8M\", \"device_bytes\": \"8M\", "
             "\"staging_bytes\": \"3M\"}}",
             dir);
    cr_assert_eq(parse(json, &c, err), 0, "%s", err);
    zinf_engine *e = (zinf_engine *)1;
    cr_assert_eq(zinf_open_parsed(NULL, 0, &e), -EINVAL);
    cr_assert_eq(zinf_open_parsed(&c, 0, NULL), -EINVAL);
    cr_assert_eq(zinf_open_parsed(&c, 1u << 9, &e), -EINVAL, "unknown flag");
    cr_assert_null(e);
    cr_assert_eq(zinf_open_parsed(&c, ZINF_OPEN_PREVIOUS, &e), -EINVAL, "PREVIOUS alone");
    cr_assert_eq(zinf_open_parsed(&c, ZINF_OPEN_PREVIOUS | ZINF_OPEN_OVERWRITE, &e), -EINVAL);
    cr_assert_eq(zinf_open_parsed(&c, ZINF_OPEN_READONLY, &e), -ENOENT, "nothing saved");
    int r = zinf_open_parsed(&c, ZINF_OPEN_NO_PIN, &e);
    cr_assert_eq(r, 0, "%s", zinf_strerror(r));
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_expect_eq(st.host_staging_bytes, 12 * 256 * KiB, "3M of 256K blocks: 12 slots, got %llu",
                 (unsigned long long)st.host_staging_bytes);
    cr_expect_eq(st.host_pinned, 0, "NO_PIN: the host tier runs unpinned");
    zinf_tensor t;
    cr_assert_eq(zinf_register(e, "t", 4096, ZINF_TIER_NVME, &t), 0);
    zinf_close(e);
    /* Saved now: READONLY opens it, and the config may be freed after the open. */
    cr_assert_eq(zinf_open_parsed(&c, ZINF_OPEN_READONLY | ZINF_OPEN_NO_PIN, &e), 0);
    config_free(&c);
    cr_assert_eq(zinf_lookup(e, "t", &t), 0);
    zinf_close(e);
    test_rmtree(dir);
}

/* "auto", as Hugging Face's Trainer writes it: taken where its DeepSpeed integration fills
 * the value in, resolved as it does (from the model's width for the bucket sizes), and
 * refused elsewhere with the JSON path. */
Test(config, auto_is_taken_where_hugging_face_fills_it_in)
{
    struct zinf_config c;
    expect_ok("{\"train_micro_batch_size_per_gpu\": \"auto\", \"train_batch_size\": \"auto\","
              " \"gradient_accumulation_steps\": \"auto\", \"gradient_clipping\": \"auto\","
              " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\", \"betas\":"
              " \"auto\", \"eps\": \"auto\", \"weight_decay\": \"auto\"}},"
              " \"scheduler\": {\"type\": \"WarmupDecayLR\", \"params\": {\"warmup_min_lr\":"
              " \"auto\", \"warmup_max_lr\": \"auto\", \"warmup_num_steps\": \"auto\","
              " \"total_num_steps\": \"auto\"}}, \"fp16\": {\"enabled\": \"auto\"},"
              " \"bf16\": {\"enabled\": \"auto\"}, \"zero_optimization\": {\"stage\": 3,"
              " \"stage3_prefetch_bucket_size\": \"auto\", \"stage3_param_persistence_threshold\":"
              " \"auto\", \"reduce_bucket_size\": \"auto\"}}",
              &c);
    cr_expect(config_is_auto(&c, "optimizer.params.lr"));
    cr_expect(config_is_auto(&c, "zero_optimization.stage3_prefetch_bucket_size"));
    cr_expect(config_given(&c, "optimizer.type"));
    cr_expect_not(config_given(&c, "scheduler.params.cos_min_ratio"));
    struct config_auto_inputs in = {.hidden_size = 1024, .micro_batch = 8, .grad_accum = 4,
                                    .steps = 500, .lr = 3e-4, .weight_decay = 0.01,
                                    .grad_clip = 1.0, .bf16 = 1};
    char said[1024];
    config_resolve_auto(&c, &in, said, sizeof(said));
    cr_expect_eq(c.zero.stage3_prefetch_bucket_size, 943718); /* 0.9 x 1024^2, rounded down */
    cr_expect_eq(c.zero.stage3_param_persistence_threshold, 10240);
    cr_expect_eq(c.train.micro_batch, 8);
    cr_expect_eq(c.train.grad_accum, 4);
    cr_expect_eq(c.train.train_batch_size, 32);
    cr_expect_eq(c.train.grad_clip, 1.0);
    cr_expect_eq(c.train.optimizer.lr, 3e-4);
    cr_expect_eq(c.train.optimizer.betas[0], 0.9);
    cr_expect_eq(c.train.optimizer.betas[1], 0.999);
    cr_expect_eq(c.train.optimizer.eps, 1e-8);
    cr_expect_eq(c.train.optimizer.weight_decay, 0.01);
    cr_expect_eq(c.train.scheduler.warmup_max_lr, 3e-4);
    cr_expect_eq(c.train.scheduler.total_num_steps, 500);
    cr_expect_eq(c.train.fp16.enabled, false);
    cr_expect_eq(c.train.bf16.enabled, true);
    cr_expect_not(config_is_auto(&c, "optimizer.params.lr"), "resolved");
    cr_expect(strstr(said, "zero_optimization.stage3_prefetch_bucket_size = 943718"), "%s", said);
    cr_expect(strstr(said, "optimizer.params.lr = 0.0003"), "%s", said);
    cr_expect(strstr(said, "train_batch_size = 32"), "%s", said);
    config_free(&c);

    /* Where "auto" means nothing, the path says where. */
    expect_error("{\"aio\": {\"queue_depth\": \"auto\"}}",
                "aio.queue_depth: must be an integer, got \"auto\" (taken only where Hugging "
                "Face's DeepSpeed integration fills the value in)");
    expect_error("{\"optimizer\": {\"params\": {\"betas\": [0.9]}}}",
                "optimizer.params.betas: must be a list of two numbers (or \"auto\"), got a list "
                "of another length");
    expect_error("{\"optimizer\": {\"params\": {\"betas\": [0.9, 1.5]}}}",
                "optimizer.params.betas[1]: must be in [0, 1), got 1.5");
    expect_error("{\"optimizer\": {\"params\": {\"lr\": -1}}}",
                "optimizer.params.lr: must be a number >= 0, got -1");
    expect_error("{\"scheduler\": {\"params\": {\"warmup_type\": \"cubic\"}}}",
                "scheduler.params.warmup_type: must be one of \"log\", \"linear\", got \"cubic\"");
    /* DeepSpeed's older name of the bf16 section is the same section. */
    expect_ok("{\"bfloat16\": {\"enabled\": true}}", &c);
    cr_expect(c.train.bf16.enabled);
    config_free(&c);
    expect_error("{\"bfloat16\": {\"enabled\": true}, \"bf16\": {\"enabled\": false}}",
                "bf16.enabled: given twice: \"bf16\" and \"bfloat16\" are one section");
}

/* DeepSpeed's deprecated ZeRO-Offload switches, as DeepSpeed maps them; a section one level
 * off named with where it belongs; a reduce bucket of 0 (Hugging Face's ZeRO-3 test config)
 * taken as DeepSpeed takes it. */
Test(config, deprecated_offload_switches_and_misplaced_sections)
{
    struct zinf_config c;
    char err[ERRLEN];

    expect_ok("{\"zero_optimization\": {\"stage\": 2, \"cpu_offload\": true}}", &c);
    cr_expect_eq(c.zero.offload_optimizer.device, CONFIG_OFFLOAD_CPU);
    cr_expect_eq(c.zero.offload_param.device, CONFIG_OFFLOAD_NONE);
    cr_expect(config_given(&c, "zero_optimization.offload_optimizer.device"));
    config_free(&c);
    /* The older plural spelling is the same switch; use_pin_memory is named, with why. */
    expect_ok("{\"zero_optimization\": {\"cpu_offload\": true, \"cpu_offload_params\": true, "
              "\"cpu_offload_use_pin_memory\": true}}",
              &c);
    cr_expect_eq(c.zero.offload_optimizer.device, CONFIG_OFFLOAD_CPU);
    cr_expect_eq(c.zero.offload_param.device, CONFIG_OFFLOAD_CPU);
    cr_expect_eq(c.n_unknown, 0);
    cr_expect(listed_prefix(c.ignored, c.n_ignored,
                            "zero_optimization.cpu_offload_use_pin_memory (DeepSpeed reads"));
    config_free(&c);
    /* false changes nothing. */
    expect_ok("{\"zero_optimization\": {\"cpu_offload\": false, \"offload_optimizer\": "
              "{\"device\": \"nvme\", \"nvme_path\": \"/x\"}}}",
              &c);
    cr_expect_eq(c.zero.offload_optimizer.device, CONFIG_OFFLOAD_NVME);
    config_free(&c);
    /* With the section it replaces: refused, as DeepSpeed refuses it. */
    expect_error("{\"zero_optimization\": {\"cpu_offload\": true, \"offload_optimizer\": "
                 "{\"device\": \"cpu\"}}}",
                 "zero_optimization.cpu_offload: deprecated, and zero_optimization."
                 "offload_optimizer is given too (DeepSpeed refuses both): keep "
                 "zero_optimization.offload_optimizer");
    expect_error("{\"zero_optimization\": {\"cpu_offload_param\": true, \"offload_param\": "
                 "{\"device\": \"nvme\", \"nvme_path\": \"/x\"}}}",
                 "zero_optimization.cpu_offload_param: deprecated, and zero_optimization."
                 "offload_param is given too (DeepSpeed refuses both): keep "
                 "zero_optimization.offload_param");

    /* aio inside zero_optimization, as some guides write it. */
    test_log_capture_start();
    expect_ok("{\"zero_optimization\": {\"aio\": {\"block_size\": 4096}}}", &c);
    cr_expect(strstr(test_log_text(), "t.json: zero_optimization.aio: unknown key, ignored: aio "
                                      "belongs at the top level of the config (DeepSpeed reads "
                                      "it only there); move it there"),
              "%s", test_log_text());
    test_log_capture_stop();
    cr_expect_eq(c.n_unknown, 1);
    cr_expect_eq(c.aio.block_size, 1u << 20, "not applied from there");
    config_free(&c);

    cr_expect_eq(parse("{\"zero_optimization\": {\"reduce_bucket_size\": 0}}", &c, err), 0,
                 "%s", err);
    cr_expect_eq(c.zero.reduce_bucket_size, 0);
    config_free(&c);
}

/* The moe section: DeepSpeed's MoE layer arguments, their defaults, and the refusals of
 * what would make the route random. */
Test(config, moe_section_defaults_and_values)
{
    struct zinf_config c;
    expect_ok("{}", &c);
    cr_expect_eq(c.moe.num_experts, 0);
    cr_expect_eq(c.moe.ep_size, 1);
    cr_expect_eq(c.moe.top_k, 1);
    cr_expect_float_eq(c.moe.capacity_factor, 1.0, 1e-12);
    cr_expect_eq(c.moe.min_capacity, 4);
    cr_expect(c.moe.drop_tokens);
    cr_expect_not(c.moe.use_rts);
    cr_expect_float_eq(c.moe.loss_coef, 0.01, 1e-12);
    cr_expect_eq(c.moe.moe_every, 1);
    config_free(&c);
    test_log_capture_start();
    expect_ok("{\"moe\": {\"num_experts\": 8, \"k\": 2, \"capacity_factor\": 1.25, "
              "\"eval_capacity_factor\": 2.0, \"min_capacity\": 2, \"drop_tokens\": false, "
              "\"use_rts\": false, \"noisy_gate_policy\": null, \"loss_coef\": 0.1, "
              "\"moe_every\": 2, \"ep_size\": 2}}",
              &c);
    test_log_capture_stop();
    cr_expect_eq(c.moe.num_experts, 8);
    cr_expect_eq(c.moe.top_k, 2);
    cr_expect_float_eq(c.moe.capacity_factor, 1.25, 1e-12);
    cr_expect_eq(c.moe.min_capacity, 2);
    cr_expect_not(c.moe.drop_tokens);
    cr_expect_eq(c.moe.noisy_gate_policy[0], 0);
    cr_expect_float_eq(c.moe.loss_coef, 0.1, 1e-12);
    cr_expect_eq(c.moe.moe_every, 2);
    cr_expect_eq(c.moe.ep_size, 2);
    char *text = print_to_string(&c);
    cr_expect(strstr(text, "moe.noisy_gate_policy = null\n"), "%s", text);
    cr_expect(strstr(text, "moe.num_experts = 8\n"), "%s", text);
    cr_expect(strstr(text, "#   moe.eval_capacity_factor (the held-out loss is taken with "
                           "capacity_factor)"),
              "%s", text);
    free(text);
    config_free(&c);
}

Test(config, moe_random_routes_are_refused)
{
    expect_error("{\"moe\": {\"use_rts\": true}}",
                 "moe.use_rts: true is not built: random token selection makes the route depend "
                 "on a random draw, and zinf train's steps are deterministic (set it to false)");
    expect_error("{\"moe\": {\"noisy_gate_policy\": \"RSample\"}}",
                 "moe.noisy_gate_policy: only null is built: a noisy gate (\"RSample\") makes the "
                 "route depend on a random draw, and zinf train's steps are deterministic");
    expect_error("{\"moe\": {\"capacity_factor\": 0}}",
                 "moe.capacity_factor: must be above 0, got 0");
    expect_error("{\"moe\": {\"top_k\": 3}}", "moe.top_k: must be between 1 and 2, got 3");
    expect_error("{\"moe\": {\"noisy_gate_policy\": 1}}",
                 "moe.noisy_gate_policy: must be a string, got an integer");
}

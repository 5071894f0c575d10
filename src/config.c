/*
 * config.c - reads a DeepSpeed-style JSON config (jansson) into struct zinf_config: the walk.
 *
 * Sections are walked key by key, by config_keys.c's tables: a key is a setting (read,
 * checked against its type and range, and marked given), a subsection, a DeepSpeed key zinf
 * does not use (accepted without looking at its value, named as ignored with why) or
 * unknown (collected and warned about, with a likely meant name). The first bad value stops
 * the parse with one line, "json.path: what is wrong". Then what the settings imply:
 * DeepSpeed's deprecated cpu_offload switches mapped as it maps them, and the distinct NVMe
 * directories over all sections.
 *
 * What it is not: the tables of keys and their defaults (config_keys.c), "auto"
 * (config_auto.c), config_print (config_print.c), a DeepSpeed validator for the keys zinf
 * ignores, nor an hjson reader (DeepSpeed reads hjson; comments in a config are a syntax
 * error here).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "common.h"
#include "config.h"
#include "config_int.h"

#define MAX_FILE_BYTES (64 * MiB) /* a config larger than this is a mistake, not a config */
#define MAX_PATH_BYTES 4095       /* longest directory name accepted (PATH_MAX less NUL) */
#define KEY_SHOWN_BYTES 128       /* longer keys are cut in messages */
#define JSON_PATH_CHARS 512       /* room for section.path + one shown key + "[index]" */

struct parser {
    struct zinf_config *c;
    const char *name; /* the file or buffer name, for warnings */
    bool quiet;       /* CONFIG_PARSE_QUIET: unknown keys are listed, not logged */
    char *err;
    size_t errlen;
};

/* ---- small helpers ---------------------------------------------------------------- */

static void *field_ptr(struct zinf_config *c, const struct field *f)
{
    return (char *)c + f->off;
}

static uint64_t type_max(const struct field *f)
{
    if (f->max)
        return f->max;
    switch (f->type) {
    case F_INT: return INT_MAX;
    case F_UINT: return UINT_MAX;
    case F_U64: return INT64_MAX; /* what a JSON integer can say; 1e19 says more */
    default: return UINT64_MAX;
    }
}

/* Append s to dst (size n, NUL-terminated, length *len), escaping control bytes, quotes
 * and backslashes as \xNN so that whatever the input, a message stays one line. At most
 * max bytes of s are shown; a longer s ends in "...". */
static void append_escaped(char *dst, size_t n, size_t *len, const char *s, size_t slen,
                           size_t max)
{
    static const char hex[] = "0123456789abcdef";
    size_t shown = slen > max ? max : slen;

    for (size_t i = 0; i < shown && *len + 5 < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch < 0x20 || ch == 0x7f || ch == '"' || ch == '\\') {
            dst[(*len)++] = '\\';
            dst[(*len)++] = 'x';
            dst[(*len)++] = hex[ch >> 4];
            dst[(*len)++] = hex[ch & 15];
        } else {
            dst[(*len)++] = (char)ch;
        }
    }
    if (shown < slen && *len + 4 < n) {
        memcpy(dst + *len, "...", 3);
        *len += 3;
    }
    dst[*len] = '\0';
}

/* dst = parent "." key (or key alone at the top), with the key escaped and cut short. */
static void join_path(char *dst, size_t n, const char *parent, const char *key)
{
    size_t len = 0;

    dst[0] = '\0';
    if (parent) {
        len = strlen(parent);
        if (len + 2 > n)
            len = n - 2;
        memcpy(dst, parent, len);
        dst[len++] = '.';
        dst[len] = '\0';
    }
    append_escaped(dst, n, &len, key, strlen(key), KEY_SHOWN_BYTES);
}

static const char *type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "a list";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

/* A JSON string for a message: quoted, escaped, at most 64 bytes shown. */
static const char *quoted(const json_t *v, char *buf, size_t n)
{
    size_t len = 1;

    buf[0] = '"';
    buf[1] = '\0';
    append_escaped(buf, n - 1, &len, json_string_value(v), json_string_length(v), 64);
    buf[len++] = '"';
    buf[len] = '\0';
    return buf;
}

/* Make every byte of a message printable, so that it is one line whatever produced it. */
static void one_line(char *s)
{
    for (; s && *s; s++)
        if ((unsigned char)*s < 0x20 || *s == 0x7f)
            *s = '?';
}

__attribute__((format(printf, 3, 4))) static int fail(struct parser *p, const char *path,
                                                      const char *fmt, ...)
{
    va_list ap;
    int n = 0;

    if (!p->err || !p->errlen)
        return -EINVAL;
    if (path)
        n = snprintf(p->err, p->errlen, "%s: ", path);
    if (n >= 0 && (size_t)n < p->errlen) {
        va_start(ap, fmt);
        vsnprintf(p->err + n, p->errlen - (size_t)n, fmt, ap);
        va_end(ap);
    }
    return -EINVAL;
}

static int fail_nomem(struct parser *p)
{
    if (p->err && p->errlen)
        snprintf(p->err, p->errlen, "%s: out of memory", p->name ? p->name : "config");
    return -ENOMEM;
}

/* Append an owned copy of s to a growing list (capacity doubles at powers of two). */
static int list_push(char ***list, size_t *n, const char *s)
{
    if ((*n & (*n - 1)) == 0) {
        size_t cap = *n < 4 ? 4 : *n * 2;
        char **l = realloc(*list, cap * sizeof(*l));
        if (!l)
            return -ENOMEM;
        *list = l;
    }
    char *d = strdup(s);
    if (!d)
        return -ENOMEM;
    (*list)[(*n)++] = d;
    return 0;
}

static void list_free(char ***list, size_t *n)
{
    for (size_t i = 0; i < *n; i++)
        free((*list)[i]);
    free(*list);
    *list = NULL;
    *n = 0;
}

static void paths_free(struct config_paths *ps)
{
    for (unsigned i = 0; i < ps->count; i++)
        free(ps->path[i]);
    memset(ps, 0, sizeof(*ps));
}

/* ---- numbers ------------------------------------------------------------------------ */

static int range_error(struct parser *p, const char *path, const struct field *f,
                       const char *got, bool negative, bool too_big)
{
    bool bounded = f->max != 0 && !(f->type == F_SIZE && f->max == SIZE_MAX);

    if (bounded)
        return fail(p, path, "must be between %llu and %llu, got %s",
                    (unsigned long long)f->min, (unsigned long long)f->max, got);
    if (too_big)
        return fail(p, path, "is too large, got %s", got);
    if (negative && f->min == 0)
        return fail(p, path, "must be non-negative, got %s", got);
    return fail(p, path, "must be at least %llu, got %s", (unsigned long long)f->min, got);
}

/* Read a non-negative integer setting: a JSON integer, an integral real (1e8), or for
 * F_SIZE a size string ("4G"); then its range and multiple. */
static int read_uint(struct parser *p, const char *path, const struct field *f, json_t *v,
                     uint64_t *out)
{
    char got[96];
    uint64_t u;
    bool negative = false;

    if (json_is_integer(v)) {
        json_int_t i = json_integer_value(v);
        snprintf(got, sizeof(got), "%" JSON_INTEGER_FORMAT, i);
        negative = i < 0;
        u = negative ? 0 : (uint64_t)i;
    } else if (json_is_real(v)) {
        double d = json_real_value(v);
        snprintf(got, sizeof(got), "%g", d);
        if (d != floor(d))
            return fail(p, path, "must be an integer, got %s", got);
        negative = d < 0;
        if (d >= 18446744073709551616.0)
            return range_error(p, path, f, got, false, true);
        u = negative ? 0 : (uint64_t)d;
    } else if (json_is_string(v) && f->type == F_SIZE) {
        quoted(v, got, sizeof(got));
        int ret = strlen(json_string_value(v)) == json_string_length(v)
                      ? parse_size(json_string_value(v), &u)
                      : -EINVAL;
        if (ret == -ERANGE)
            return range_error(p, path, f, got, false, true);
        if (ret < 0)
            return fail(p, path, "must be a size like \"4G\", \"512M\" or a number of bytes, got %s",
                        got);
    } else if (f->type == F_SIZE) {
        return fail(p, path, "must be an integer or a size string like \"4G\", got %s",
                    type_name(v));
    } else if (json_is_string(v) && !strcmp(json_string_value(v), "auto")) {
        return fail(p, path, "must be an integer, got \"auto\" (taken only where Hugging Face's "
                    "DeepSpeed integration fills the value in)");
    } else {
        return fail(p, path, "must be an integer, got %s", type_name(v));
    }
    if (!negative && f->multiple && u % f->multiple)
        return fail(p, path, "must be a multiple of %llu, got %s",
                    (unsigned long long)f->multiple, got);
    if (negative || u < f->min || u > type_max(f))
        return range_error(p, path, f, got, negative, !negative && u > type_max(f));
    *out = u;
    return 0;
}

/* A finite number >= 0 (and at most max, when it has one). */
static int read_float(struct parser *p, const char *path, const struct field *f, json_t *v,
                      double *out)
{
    if (!json_is_number(v))
        return fail(p, path, "must be a number%s, got %s",
                    f->flags & FL_AUTO ? " (or \"auto\")" : "", type_name(v));
    double d = json_number_value(v);
    if (!isfinite(d) || d < 0)
        return fail(p, path, "must be a number >= 0, got %g", d);
    if (f->max && d > (double)f->max)
        return fail(p, path, "must be at most %llu, got %g", (unsigned long long)f->max, d);
    *out = d;
    return 0;
}

/* ---- paths -------------------------------------------------------------------------- */

static int add_path(struct parser *p, const char *path, json_t *v, struct config_paths *dst)
{
    size_t len = json_string_length(v);
    const char *s = json_string_value(v);

    if (len == 0)
        return fail(p, path, "must not be empty");
    if (strlen(s) != len)
        return fail(p, path, "must not contain a NUL byte");
    if (len > MAX_PATH_BYTES)
        return fail(p, path, "is too long, %zu bytes (at most %d)", len, MAX_PATH_BYTES);
    if (dst->count >= CONFIG_MAX_NVME_PATHS)
        return fail(p, path, "too many paths (at most %d)", CONFIG_MAX_NVME_PATHS);
    char *d = strdup(s);
    if (!d)
        return fail_nomem(p);
    dst->path[dst->count++] = d;
    return 0;
}

static int read_paths(struct parser *p, const char *path, json_t *v, struct config_paths *dst)
{
    char elem[JSON_PATH_CHARS + 32];
    size_t i;
    json_t *e;

    if (json_is_string(v))
        return add_path(p, path, v, dst);
    if (!json_is_array(v))
        return fail(p, path, "must be a string or a list of strings, got %s", type_name(v));
    if (json_array_size(v) > CONFIG_MAX_NVME_PATHS)
        return fail(p, path, "too many paths, got %zu (at most %d)", json_array_size(v),
                    CONFIG_MAX_NVME_PATHS);
    json_array_foreach(v, i, e) {
        snprintf(elem, sizeof(elem), "%s[%zu]", path, i);
        if (!json_is_string(e))
            return fail(p, elem, "must be a string, got %s", type_name(e));
        int ret = add_path(p, elem, e, dst);
        if (ret)
            return ret;
    }
    return 0;
}

/* ---- settings and sections ---------------------------------------------------------- */

static int read_field(struct parser *p, const struct field *f, const char *path,
                      const char *key, json_t *v)
{
    struct zinf_config *c = p->c;
    void *dst = field_ptr(c, f);
    uint64_t u = 0;
    int ret;

    if (config_bit_get(c->given, f)) {
        /* Only an alias can get here: jansson refuses a key given twice. */
        const char *other = strcmp(key, f->key) ? f->key : f->alias;
        if (!other) /* the same key in a section given under two names */
            return fail(p, path, "given twice: \"bf16\" and \"bfloat16\" are one section");
        return fail(p, path, "given twice, also as %s", other);
    }
    if ((f->flags & FL_AUTO) && json_is_string(v) && !strcmp(json_string_value(v), "auto")) {
        /* Hugging Face's Trainer fills these in; config_resolve_auto() does here. */
        config_bit_set(c->autos, f);
        goto given;
    }
    switch (f->type) {
    case F_INT:
        if (json_is_null(v) && (f->flags & FL_NULL)) { /* DeepSpeed's "none given" */
            *(int *)dst = 0;
            break;
        }
        /* fall through */
    case F_UINT:
    case F_U64:
    case F_SIZE:
        ret = read_uint(p, path, f, v, &u);
        if (ret)
            return ret;
        if (f->type == F_INT)
            *(int *)dst = (int)u;
        else if (f->type == F_UINT)
            *(unsigned *)dst = (unsigned)u;
        else
            *(uint64_t *)dst = u;
        break;
    case F_BOOL:
        if (!json_is_boolean(v))
            return fail(p, path, "must be true or false, got %s", type_name(v));
        *(bool *)dst = json_is_true(v);
        break;
    case F_ENUM: {
        char list[128], got[96];
        size_t len = 0;
        int i;

        list[0] = '\0';
        for (i = 0; f->names[i]; i++)
            len += (size_t)snprintf(list + len, sizeof(list) - len, "%s\"%s\"", i ? ", " : "",
                                    f->names[i]);
        if (!json_is_string(v))
            return fail(p, path, "must be one of %s, got %s", list, type_name(v));
        for (i = 0; f->names[i]; i++)
            if (!strcmp(json_string_value(v), f->names[i]) &&
                strlen(f->names[i]) == json_string_length(v))
                break;
        if (!f->names[i])
            return fail(p, path, "must be one of %s, got %s", list, quoted(v, got, sizeof(got)));
        /* Each enum here is int-sized and its values are 0..n-1. */
        *(int *)dst = i;
        break;
    }
    case F_PATHS:
        if (json_is_null(v))
            return 0; /* DeepSpeed's "nvme_path": null, the same as leaving it out */
        ret = read_paths(p, path, v, dst);
        if (ret)
            return ret;
        break;
    case F_FLOAT:
        if ((ret = read_float(p, path, f, v, dst)) != 0)
            return ret;
        break;
    case F_PAIR: {
        double pair[2];
        char elem[JSON_PATH_CHARS + 8];
        if (!json_is_array(v) || json_array_size(v) != 2)
            return fail(p, path, "must be a list of two numbers%s, got %s",
                        f->flags & FL_AUTO ? " (or \"auto\")" : "",
                        json_is_array(v) ? "a list of another length" : type_name(v));
        for (size_t i = 0; i < 2; i++) {
            snprintf(elem, sizeof(elem), "%s[%zu]", path, i);
            json_t *e = json_array_get(v, i);
            if (!json_is_number(e))
                return fail(p, elem, "must be a number, got %s", type_name(e));
            pair[i] = json_number_value(e);
            if (!(pair[i] >= 0 && pair[i] < 1))
                return fail(p, elem, "must be in [0, 1), got %g", pair[i]);
        }
        memcpy(dst, pair, sizeof(pair));
        break;
    }
    case F_STR: {
        char got[96];
        if (json_is_null(v) && (f->flags & FL_NULL)) {
            *(char *)dst = '\0';
            break;
        }
        if (!json_is_string(v))
            return fail(p, path, "must be a string, got %s", type_name(v));
        size_t len = json_string_length(v);
        if (len == 0 || len >= 32 || strlen(json_string_value(v)) != len)
            return fail(p, path, "must be a name of 1 to 31 characters, got %s",
                        quoted(v, got, sizeof(got)));
        memcpy(dst, json_string_value(v), len + 1);
        break;
    }
    }
given:
    config_bit_set(c->given, f);
    if (f->ignored) {
        /* Read and checked, but zinf does not act on it: named, with why. */
        char line[JSON_PATH_CHARS + 160];
        snprintf(line, sizeof(line), "%s (%s)", path, f->ignored);
        if (list_push(&c->ignored, &c->n_ignored, line))
            return fail_nomem(p);
    }
    return 0;
}

static const struct field *find_field(int s, const char *key)
{
    for (size_t i = 0; i < config_nfields; i++)
        if (config_fields[i].sect == s &&
            (!strcmp(config_fields[i].key, key) || (config_fields[i].alias && !strcmp(config_fields[i].alias, key))))
            return &config_fields[i];
    return NULL;
}

static int find_sub(int s, const char *key)
{
    for (int i = 0; i < S_COUNT; i++)
        if (config_sects[i].parent == s && !strcmp(config_sects[i].key, key))
            return i;
    /* DeepSpeed's older name for its bf16 section. */
    if (s == S_TOP && !strcmp(key, "bfloat16"))
        return S_BF16;
    return -1;
}

static int parse_section(struct parser *p, int s, json_t *obj);

static int parse_subsection(struct parser *p, int sub, const char *path, json_t *v)
{
    if (json_is_null(v))
        return 0; /* "offload_param": null is DeepSpeed's way of saying "none" */
    if (sub == S_ZERO && json_is_boolean(v)) {
        /* DeepSpeed's deprecated form: true is stage 1, false is stage 0. */
        p->c->zero.stage = json_is_true(v) ? 1 : 0;
        config_bit_set(p->c->given, &config_fields[FIELD_STAGE]);
        return 0;
    }
    if (!json_is_object(v))
        return fail(p, path, "must be an object, got %s", type_name(v));
    return parse_section(p, sub, v);
}

/* Why key is in an ignored list (NULL: it is not). */
static const char *ignored_why(const struct ignored_key *list, const char *key)
{
    for (; list && list->key; list++)
        if (!strcmp(list->key, key))
            return list->why;
    return NULL;
}

static int note_unknown(struct parser *p, int s, const char *path, const char *key)
{
    struct zinf_config *c = p->c;
    char hint[JSON_PATH_CHARS];

    if (list_push(&c->unknown, &c->n_unknown, path))
        return fail_nomem(p);
    if (p->quiet)
        return 0;
    /* A section one level off (aio inside zero_optimization, as some guides have it): say
     * where it belongs. DeepSpeed ignores it there too. */
    for (int i = 1; i < S_COUNT; i++) {
        if (config_sects[i].parent != s && !strcmp(config_sects[i].key, key) && config_sects[i].parent >= 0) {
            int up = config_sects[i].parent;
            log_warn("%s%s%s: unknown key, ignored: %s belongs %s%s%s; move it there",
                     p->name ? p->name : "",
                     p->name ? ": " : "", path, key, up == S_TOP ? "at the top level" : "in ",
                     up == S_TOP ? "" : config_sects[up].path,
                     up == S_TOP ? " of the config (DeepSpeed reads it only there)" : "");
            return 0;
        }
    }
    const char *sug = config_suggest(s, key, hint, sizeof(hint));
    log_warn("%s%s%s: unknown key, ignored%s%s%s", p->name ? p->name : "", p->name ? ": " : "",
             path, sug ? " (did you mean \"" : "", sug ? sug : "", sug ? "\"?)" : "");
    return 0;
}

static int parse_section(struct parser *p, int s, json_t *obj)
{
    struct zinf_config *c = p->c;
    const char *key;
    json_t *v;
    int ret = 0;

    json_object_foreach(obj, key, v) {
        char path[JSON_PATH_CHARS];
        const struct field *f;
        const char *why;
        int sub;

        join_path(path, sizeof(path), config_sects[s].path, key);
        if ((f = find_field(s, key)))
            ret = read_field(p, f, path, key, v);
        else if ((sub = find_sub(s, key)) >= 0)
            ret = parse_subsection(p, sub, path, v);
        else if ((why = ignored_why(config_sects[s].ignored, key))) {
            char line[JSON_PATH_CHARS + 160];
            snprintf(line, sizeof(line), "%s (%s)", path, why);
            ret = list_push(&c->ignored, &c->n_ignored, line) ? fail_nomem(p) : 0;
        }
        else
            ret = note_unknown(p, s, path, key);
        if (ret)
            return ret;
    }
    return 0;
}

/* ---- what the settings imply -------------------------------------------------------- */

/* A directory without its trailing slashes, so "/mnt/a/" and "/mnt/a" are one drive. */
static size_t trimmed_len(const char *s)
{
    size_t len = strlen(s);
    while (len > 1 && s[len - 1] == '/')
        len--;
    return len;
}

static int merge_paths(struct parser *p, const char *path, const struct config_paths *src)
{
    struct config_paths *all = &p->c->nvme_paths;

    for (unsigned i = 0; i < src->count; i++) {
        size_t len = trimmed_len(src->path[i]);
        bool dup = false;
        for (unsigned j = 0; j < all->count && !dup; j++)
            dup = strlen(all->path[j]) == len && !memcmp(all->path[j], src->path[i], len);
        if (dup)
            continue;
        if (all->count >= CONFIG_MAX_NVME_PATHS)
            return fail(p, path,
                        "too many NVMe paths: more than %d distinct directories over "
                        "zinf.nvme_paths and the offload sections",
                        CONFIG_MAX_NVME_PATHS);
        char *d = strndup(src->path[i], len);
        if (!d)
            return fail_nomem(p);
        all->path[all->count++] = d;
    }
    return 0;
}
/* Was any setting of section s given? */
static bool sect_given(const struct zinf_config *c, int s)
{
    for (size_t i = 0; i < config_nfields; i++)
        if (config_fields[i].sect == s && config_bit_get(c->given, &config_fields[i]))
            return true;
    return false;
}

/* The MoE settings that no run can use: refused here, naming the key. */
static int finish_moe(struct parser *p)
{
    const struct zinf_config *c = p->c;
    if (c->moe.use_rts)
        return fail(p, "moe.use_rts",
                    "true is not built: random token selection makes the route depend on a "
                    "random draw, and zinf train's steps are deterministic (set it to false)");
    if (c->moe.noisy_gate_policy[0])
        return fail(p, "moe.noisy_gate_policy",
                    "only null is built: a noisy gate (\"%s\") makes the route depend on a "
                    "random draw, and zinf train's steps are deterministic",
                    c->moe.noisy_gate_policy);
    if (!(c->moe.capacity_factor > 0))
        return fail(p, "moe.capacity_factor", "must be above 0, got %g", c->moe.capacity_factor);
    return 0;
}

static int finish(struct parser *p)
{
    struct zinf_config *c = p->c;
    /* DeepSpeed's deprecated cpu_offload and cpu_offload_param, as it maps them: each is
     * its section with device "cpu", and refused beside that section. */
    const struct {
        bool on;
        const char *key;
        int sect;
        enum config_offload_device *dst;
    } legacy[] = {
        {c->zero.cpu_offload, "cpu_offload", S_OPTIM, &c->zero.offload_optimizer.device},
        {c->zero.cpu_offload_param, "cpu_offload_param", S_PARAM, &c->zero.offload_param.device},
    };
    for (size_t i = 0; i < ARRAY_SIZE(legacy); i++) {
        if (!legacy[i].on)
            continue;
        if (sect_given(c, legacy[i].sect)) {
            char key[64];
            snprintf(key, sizeof(key), "zero_optimization.%s", legacy[i].key);
            return fail(p, key,
                        "deprecated, and %s is given too (DeepSpeed refuses both): keep %s",
                        config_sects[legacy[i].sect].path, config_sects[legacy[i].sect].path);
        }
        *legacy[i].dst = CONFIG_OFFLOAD_CPU;
        char dev[64];
        snprintf(dev, sizeof(dev), "%s.device", config_sects[legacy[i].sect].path);
        config_bit_set(c->given, config_field_by_path(dev)); /* the config's, not a default */
    }

    const struct {
        int sect;
        enum config_offload_device device;
        const struct config_paths *paths;
    } offload[] = {
        {S_PARAM, c->zero.offload_param.device, &c->zero.offload_param.nvme_path},
        {S_OPTIM, c->zero.offload_optimizer.device, &c->zero.offload_optimizer.nvme_path},
    };
    char path[JSON_PATH_CHARS];
    int ret;

    /* DeepSpeed needs nvme_path with device "nvme"; zinf.nvme_paths can stand in for it,
     * and through a daemon (zinf.connect) the swap directories are the daemon's. */
    for (size_t i = 0; i < ARRAY_SIZE(offload); i++) {
        snprintf(path, sizeof(path), "%s.nvme_path", config_sects[offload[i].sect].path);
        if (offload[i].device == CONFIG_OFFLOAD_NVME && !offload[i].paths->count &&
            !c->zinf.nvme_paths.count && !c->zinf.connect.count)
            return fail(p, path, "required when device is \"nvme\"");
    }
    ret = merge_paths(p, "zinf.nvme_paths", &c->zinf.nvme_paths);
    /* An offload section's directories are used only when it offloads to NVMe, as in
     * DeepSpeed, which ignores nvme_path for the other devices. */
    for (size_t i = 0; i < ARRAY_SIZE(offload) && !ret; i++) {
        snprintf(path, sizeof(path), "%s.nvme_path", config_sects[offload[i].sect].path);
        if (offload[i].device == CONFIG_OFFLOAD_NVME)
            ret = merge_paths(p, path, offload[i].paths);
    }
    if (ret)
        return ret;
    for (unsigned i = 1; i < c->nvme_paths.count; i++)
        c->nvme_paths_extra[i - 1] = c->nvme_paths.path[i];
    return finish_moe(p);
}

/* ---- the interface ------------------------------------------------------------------ */
void config_free(struct zinf_config *c)
{
    if (!c)
        return;
    paths_free(&c->zero.offload_param.nvme_path);
    paths_free(&c->zero.offload_optimizer.nvme_path);
    paths_free(&c->zinf.nvme_paths);
    paths_free(&c->zinf.connect);
    paths_free(&c->nvme_paths);
    list_free(&c->unknown, &c->n_unknown);
    list_free(&c->ignored, &c->n_ignored);
    config_defaults(c);
}

int config_parse_buffer(const char *buf, size_t len, const char *name, struct zinf_config *c,
                        char *err, size_t errlen)
{
    return config_parse_buffer_flags(buf, len, name, c, 0, err, errlen);
}

int config_parse_buffer_flags(const char *buf, size_t len, const char *name,
                              struct zinf_config *c, unsigned flags, char *err, size_t errlen)
{
    struct parser p = {.c = c, .name = name, .quiet = flags & CONFIG_PARSE_QUIET, .err = err,
                       .errlen = errlen};
    json_error_t je;
    json_t *root;
    int ret;

    if (err && errlen)
        err[0] = '\0';
    if (!c)
        return -EINVAL;
    config_defaults(c);
    if (!buf && len)
        return fail(&p, name ? name : "config", "no buffer");
    root = json_loadb(buf ? buf : "", len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        if (err && errlen) {
            if (je.line > 0)
                snprintf(err, errlen, "%s:%d:%d: %s", name ? name : "config", je.line, je.column,
                         je.text);
            else
                snprintf(err, errlen, "%s: %s", name ? name : "config", je.text);
            one_line(err);
        }
        return -EINVAL;
    }
    if (!json_is_object(root))
        ret = fail(&p, "top level", "must be an object, got %s", type_name(root));
    else
        ret = parse_section(&p, S_TOP, root);
    if (!ret)
        ret = finish(&p);
    json_decref(root);
    if (ret) {
        config_free(c);
        if (err && errlen)
            one_line(err);
    }
    return ret;
}

int config_parse_file(const char *path, struct zinf_config *c, char *err, size_t errlen)
{
    return config_parse_file_flags(path, c, 0, err, errlen);
}

int config_parse_file_flags(const char *path, struct zinf_config *c, unsigned flags, char *err,
                            size_t errlen)
{
    struct stat st;
    char *buf = NULL;
    size_t len = 0, cap = 0;
    int fd, ret;

    if (err && errlen)
        err[0] = '\0';
    if (!c)
        return -EINVAL;
    config_defaults(c);
    if (!path) {
        ret = -EINVAL;
        goto err;
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        ret = -errno;
        goto err;
    }
    if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
        ret = -EISDIR;
        goto err_close;
    }
    /* Read to the end rather than trust st_size, so that pipes (/dev/stdin) work too. */
    for (;;) {
        if (len == cap) {
            if (cap >= MAX_FILE_BYTES) {
                ret = -EFBIG;
                goto err_close;
            }
            size_t ncap = cap ? cap * 2 : 64 * KiB;
            char *nbuf = realloc(buf, ncap);
            if (!nbuf) {
                ret = -ENOMEM;
                goto err_close;
            }
            buf = nbuf;
            cap = ncap;
        }
        ssize_t n = read(fd, buf + len, cap - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            ret = -errno;
            goto err_close;
        }
        if (n == 0)
            break;
        len += (size_t)n;
    }
    close(fd);
    ret = config_parse_buffer_flags(buf, len, path, c, flags, err, errlen);
    free(buf);
    return ret;

err_close:
    close(fd);
    free(buf);
err:
    if (err && errlen) {
        snprintf(err, errlen, "%s: %s", path ? path : "(null)",
                 ret == -EFBIG ? "file too large for a config (more than 64 MiB)" : strerror(-ret));
        one_line(err);
    }
    return ret;
}

void config_to_options(const struct zinf_config *c, struct zinf_options *o)
{
    memset(o, 0, sizeof(*o));
    o->nvme_path = c->nvme_paths.count ? c->nvme_paths.path[0] : NULL;
    o->nvme_paths_extra = c->nvme_paths.count > 1 ? c->nvme_paths_extra : NULL;
    o->device_bytes = (size_t)c->zinf.device_bytes;
    o->host_bytes = (size_t)c->zinf.host_bytes;
    o->block_size = (size_t)c->aio.block_size;
    o->queue_depth = c->aio.queue_depth;
    o->device_kind = c->zinf.device;
    o->cuda_device = c->zinf.cuda_device;
}

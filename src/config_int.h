/*
 * config_int.h - what the files of the config reader share, and nothing outside them:
 * the sections and settings tables (config_keys.c), the types of their rows, and the
 * bookkeeping of which settings a file gave (struct zinf_config's given and autos masks,
 * one bit per row of config_fields).
 *
 * Not here: the walk that reads a file (config.c), "auto" (config_auto.c) or printing
 * (config_print.c); the interface is config.h.
 */
#ifndef ZINF_CONFIG_INT_H
#define ZINF_CONFIG_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"

enum sect { S_TOP, S_ZERO, S_PARAM, S_OPTIM, S_AIO, S_ZINF, S_TRAIN, S_SERVE, S_OPT, S_OPT_PARAMS,
            S_SCHED, S_SCHED_PARAMS, S_FP16, S_BF16, S_PIPE, S_TP, S_MOE, S_ACT,
            S_COUNT };

/* A DeepSpeed key zinf has no use for, with why (config_keys.c lists them per section). */
struct ignored_key {
    const char *key, *why;
};

struct sectdef {
    const char *key;  /* name inside the parent section */
    const char *path; /* full JSON path */
    int parent;
    const struct ignored_key *ignored;
};
extern const struct sectdef config_sects[S_COUNT];

enum ftype {
    F_INT,   /* int, non-negative integer */
    F_UINT,  /* unsigned, non-negative integer */
    F_U64,   /* uint64_t, non-negative integer */
    F_SIZE,  /* uint64_t bytes: an integer or a size string ("4G") */
    F_BOOL,  /* bool */
    F_ENUM,  /* an enum stored as int, from one of names[] */
    F_PATHS, /* struct config_paths: a string or a list of strings */
    F_FLOAT, /* double, a finite number >= 0 (max, when set, bounds it) */
    F_PAIR,  /* double[2], a list of two numbers in [0, 1) (Adam's betas) */
    F_STR,   /* char[32], a short string */
};

/* field.flags */
#define FL_AUTO 1u /* "auto" is accepted, as Hugging Face's Trainer writes it */
#define FL_CMD 2u  /* not given: the command's own default applies (no DeepSpeed default) */
#define FL_NULL 4u /* F_STR, F_INT: null is accepted, as the empty string or 0 (printed as
                    * null) */

struct field {
    int sect;
    const char *key;
    const char *alias; /* another name for the same setting, or NULL */
    enum ftype type;
    size_t off;        /* where it is stored in struct zinf_config */
    uint64_t min, max; /* max 0: the storage type's own limit */
    uint64_t multiple; /* 0, or the value must be a multiple of this */
    const char *const *names;
    unsigned flags;    /* FL_* */
    const char *ignored; /* NULL: it acts; else why zinf does not act on it (it is read,
                          * checked and named as ignored, with this) */
};

/* Every setting, in print order; a setting's bit in given and autos is its index here. */
extern const struct field config_fields[];
extern const size_t config_nfields;
/* config_fields[0], zero_optimization.stage, is set by the deprecated
 * "zero_optimization": true|false too. */
#define FIELD_STAGE 0

/* The names of zinf.device's values, for the engine options config_print writes. */
extern const char *const config_device_kinds[];

static inline size_t config_field_index(const struct field *f)
{
    return (size_t)(f - config_fields);
}

static inline bool config_bit_get(const uint64_t *mask, const struct field *f)
{
    return mask[config_field_index(f) / 64] >> (config_field_index(f) % 64) & 1;
}

static inline void config_bit_set(uint64_t *mask, const struct field *f)
{
    mask[config_field_index(f) / 64] |= 1ull << (config_field_index(f) % 64);
}

/* The setting at a JSON path ("optimizer.params.lr"), or NULL. */
const struct field *config_field_by_path(const char *json_path);
/* A likely meant name for key, unknown in section s, into buf (n bytes): NULL when none. */
const char *config_suggest(int s, const char *key, char *buf, size_t n);

#endif

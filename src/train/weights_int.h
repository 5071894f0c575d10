/*
 * weights_int.h - what the files of weights.h share, for them alone: the safetensors dtypes,
 * the list of problems that err becomes, and an open file's shards and entries.
 * weights_format.c holds the names, the dtypes, the problems and the reading of one header;
 * weights_load.c the folders, the checks against the model and the values read;
 * weights_export.c the writing.
 */
#ifndef ZINF_TRAIN_WEIGHTS_INT_H
#define ZINF_TRAIN_WEIGHTS_INT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#include "train/gpt.h"
#include "train/weights.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian, and so are the floats these files copy as they are"
#endif

#define MAX_DIMS 8

/* ---- dtypes ------------------------------------------------------------------------------ */

/* Indices into weights_dtypes[]: the three --init reads, then the others it names. */
enum { DT_F32, DT_BF16, DT_F16, DT_OTHER };

struct weights_dtype {
    const char *name;
    unsigned bytes;
};
extern const struct weights_dtype weights_dtypes[15];

/* ---- problems ---------------------------------------------------------------------------- */

/* The lines of err: each "PATH: what", at most MAX_PROBLEMS, then how many more. */
struct problems {
    const char *path;
    char *buf;
    size_t cap, len;
    int n;
};

/* One problem more, said under p->path (counted, past the first dozen, and not said). */
__attribute__((format(printf, 2, 3))) void weights_say(struct problems *p, const char *fmt,
                                                       ...);
/* Close the list: how many were left out. -EINVAL when there was any. */
int weights_problems_end(struct problems *p);
/* "(a, b)", or "(a,)" for one dimension, into buf. */
const char *weights_shape_text(int ndim, const uint64_t *shape, char *buf, size_t len);

/* ---- an open file ------------------------------------------------------------------------ */

struct entry {
    const char *name; /* the header's, alive as long as it */
    int file;         /* the shard that holds it: index into weights_file.files */
    int dtype;        /* index into weights_dtypes[] */
    int ndim;
    uint64_t shape[MAX_DIMS];
    uint64_t begin, end; /* of the data */
    bool used;
};

/* One safetensors file: the whole model, or one shard of a Hugging Face folder's. */
struct shard {
    char *path;
    int fd;
    json_t *header;
    uint64_t data_start; /* 8 + the header's length */
};

struct weights_file {
    char *path;  /* as given: a file, or a folder */
    struct shard *files;
    int nfiles;
    json_t *index; /* name -> entry, for weights_find() */
    int n;
    struct entry *e;
    json_t *config;    /* the config.json that goes with it, or NULL */
    char *config_path; /* where that is */
    char notes[512];   /* what the run leaves out of what the files say: weights_file_notes() */
    enum weights_names names;
    int ntensors;
    struct gpt_tensor_desc *desc;
    int *at; /* layout index -> entry */
    void *raw;
    float *tmp;
    size_t cap; /* elements of raw (4 bytes each) and tmp */
};

/* The shape of tensor d in a file under names: zinf's, or transposed. */
int weights_file_shape(const struct gpt_tensor_desc *d, enum weights_names names,
                       uint64_t shape[2]);
/* The names, as a message says them ("GPT-2's names (GPT2LMHeadModel)"). */
const char *weights_names_said(enum weights_names names);

/* n bytes at off of fd, whole: 0, or -errno (-EIO where the file ends first). */
int weights_pread_full(int fd, void *buf, size_t n, uint64_t off);
/* The entry of that name, in any shard, or NULL. */
struct entry *weights_find(struct weights_file *w, const char *name);
/* What a file that is not a regular one is, for the message that refuses it. */
const char *weights_kind_of(mode_t m);
/* name, relative to the folder dfd (AT_FDCWD: as it is), opened for reading without waiting
 * for a writer, and its type: the fd, or -errno. */
int weights_open_file(int dfd, const char *name, struct stat *st);
/* Shard k's header and the data's extent: its entries appended to w->e, everything but the
 * names checked. */
int weights_read_header(struct weights_file *w, int k, struct problems *p, char *err,
                        size_t errlen);
/* A file of the model, open as fd, at path: added to w->files. 0 or -ENOMEM (fd closed). */
int weights_add_file(struct weights_file *w, const char *path, int fd);

#endif

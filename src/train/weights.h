/*
 * weights.h - a model's parameters in and out of safetensors files, for zinf train's
 * --init, --export and --export-hf: under zinf's names and layout ("wte", "h0.attn.qkv.w",
 * as gpt_layout() has them), or under GPT-2's as transformers' GPT2LMHeadModel has them
 * ("transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", ..., the blocks' matrices
 * stored transposed, as its Conv1D keeps them), with the config.json from_pretrained reads.
 *
 * Files are read and checked whole before a value is used: every problem is named with the
 * file and the tensor, so that a run refuses bad weights before it starts. Values are handed
 * over one tensor at a time, as fp32 in zinf's layout, so that no step holds a whole model.
 *
 * Not here: where the values go or come from (the trainer, through the caller's source),
 * other formats (PyTorch's pickles are recognised, to say how to convert them), dtypes other
 * than F32, BF16 and F16.
 *
 * weights_format.c holds the names and one file's header, weights_load.c the checks and the
 * reading, weights_export.c the writing (weights_int.h is what they share).
 */
#ifndef ZINF_TRAIN_WEIGHTS_H
#define ZINF_TRAIN_WEIGHTS_H

#include <stdbool.h>
#include <stddef.h>

#include "train/gpt.h"

/* The tensors' names in a file. */
enum weights_names {
    WEIGHTS_ZINF,     /* zinf's layout: "wte", "h0.ln1.w", "lnf.b" */
    WEIGHTS_HF,       /* GPT2LMHeadModel's: "transformer.wte.weight", "transformer.h.0.ln_1.weight" */
    WEIGHTS_HF_MODEL, /* GPT2Model's (the same without "transformer."): "wte.weight" */
};

/* Tensor d's name under names (into name, len bytes), and whether that file stores it
 * transposed: the blocks' matrices under GPT-2's names, (in, out) where zinf's are (out, in). */
void weights_name(const struct gpt_tensor_desc *d, enum weights_names names, char *name,
                  size_t len);
bool weights_transposed(const struct gpt_tensor_desc *d, enum weights_names names);

struct weights_file;

/* Open path and check it against the model gc (gc->maxT: the run's sequence length). path is
 * a safetensors file, or a Hugging Face folder holding model.safetensors, or the shards its
 * model.safetensors.index.json maps the tensors to (each tensor in the shard the map names),
 * and config.json; anything else (a FIFO, a device, a PyTorch pickle, said as such) is
 * refused without waiting on it. Checked: each safetensors header (its length, its JSON, every
 * entry's dtype, shape and byte range, the data the ranges cover exactly, the file neither
 * shorter nor longer), the names (zinf's or GPT-2's, the one most of them follow), the
 * config.json that goes with GPT-2's names (the folder's, or the one beside the file): each
 * key that changes the function (activation_function, layer_norm_epsilon, scale_attn_*, ...)
 * one the trainer computes, the model's size (layers, width, sequence, vocabulary from the
 * shapes, the heads from the metadata or config.json), and each tensor of gc's layout:
 * present, of dtype F32, BF16 or F16, of its shape; nothing else there but an lm_head.weight
 * equal to the embedding (GPT-2's head is tied). 0, or -EINVAL with one line per problem in
 * err ("PATH: ...", at most a dozen, then how many more), or -errno with a line when a file
 * cannot be read. */
int weights_open(const char *path, const struct gpt_config *gc, struct weights_file **out,
                 char *err, size_t errlen);
enum weights_names weights_file_names(const struct weights_file *w);
/* What the run leaves out of what the files say (the dropout of a config.json: zinf trains
 * without it), as one sentence; "" where nothing is. */
const char *weights_file_notes(const struct weights_file *w);
/* Tensor idx of gc's layout as fp32 in zinf's shape, numel floats into dst: converted from
 * BF16 or F16, transposed back from GPT-2's Conv1D layout. 0, or -errno with a line in err
 * (-EIO where the file changed since weights_open and is now shorter). */
int weights_read(struct weights_file *w, int idx, float *dst, char *err, size_t errlen);
void weights_close(struct weights_file *w);

/* Writes tensor idx of the layout (numel fp32 values, zinf's shape) to dst: 0 or -errno. */
typedef int (*weights_source)(void *ctx, int idx, float *dst);

/* A safetensors file of model gc at step, the tensors from get in the layout's order under
 * names, F32; the metadata says the model's shape and the step (and "format": "pt", which
 * transformers asks for, under GPT-2's names). Written to PATH.tmp, synced, renamed over
 * path, and the directory synced. 0, or -errno with a line in err ("PATH: ..."); a failure
 * leaves path as it was. */
int weights_write(const char *path, const struct gpt_config *gc, int step,
                  enum weights_names names, weights_source get, void *ctx, char *err,
                  size_t errlen);
/* What GPT2LMHeadModel.from_pretrained(dir) loads as this model: dir/model.safetensors under
 * GPT-2's names (lm_head.weight left out: it is tied to the embedding) and dir/config.json
 * (model_type gpt2, the shape, gelu_new, LayerNorm's epsilon 1e-5, no dropout, attention
 * scaled by 1/sqrt(head size) alone), each written as weights_write() writes. dir is made
 * when it does not exist. 0, or -errno with a line in err. */
int weights_write_hf(const char *dir, const struct gpt_config *gc, int step, weights_source get,
                     void *ctx, char *err, size_t errlen);

#endif

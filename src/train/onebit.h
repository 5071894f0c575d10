/*
 * onebit.h - 1-bit Adam (DeepSpeed's OneBitAdam) and the config keys of the gradients'
 * communication.
 *
 * 1-bit Adam: the first freeze_step updates are Adam's without bias correction (the
 * gradients reduced across ranks in full: communication_data_type's), m and v as
 * DeepSpeed's OneBitAdam keeps them. From the next one on, v is frozen, the gradients are
 * not reduced any more, and each rank's momentum of its own gradient, m = b1 m + (1 - b1) g
 * (g the mean over the rank's micro-batches), is exchanged compressed to one bit an element
 * as DeepSpeed's compressed_allreduce does (deepspeed/runtime/comm/nccl.py), the arithmetic
 * below: padded with zeros to N (a multiple of world x lcm(world, 8)), each rank adds its
 * worker error, sends the signs (bit set: >= 0) and one scale |x| / sqrt(N); the rank that
 * serves chunk r (N / world elements) adds every rank's sign x scale / world in rank order
 * and its server error, and sends that compressed the same way; every rank then holds the
 * same m, the servers' signs x scales, and updates the whole parameter with it,
 * p -= lr (m / (sqrt(v) + eps) + wd p). Both errors keep what the compression dropped and
 * add it back the next step. Every loop is one thread's, in index order: the bits do not
 * depend on the threads.
 *
 * zinf's differences, said where they matter: DeepSpeed's first optimizer call only sets up
 * its buffers (it discards that step's gradient and counts the step), so zinf's update s is
 * DeepSpeed's call s + 1; the full m and v, and the two errors, live in host memory outside
 * the tiers' budgets (3 floats a parameter, and 1/world of one for the server error; on
 * one rank the registered m and v serve) and are not in checkpoints: a resumed run gathers m and v from its shards and
 * starts the errors from zero, as DeepSpeed's load_state_dict drops them.
 *
 * Not here: the reductions (trainer_shards.c), the collectives (comm/).
 */
#ifndef ZINF_TRAIN_ONEBIT_H
#define ZINF_TRAIN_ONEBIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "train/trainer.h"

/* o->comm_wire from communication_data_type ("fp32" or unset, "fp16", "bf16"), and 1-bit
 * Adam's keys (onebit: optimizer.type is "OneBitAdam"): 0, or -EINVAL with err naming the
 * key. */
int train_config_onebit(const struct zinf_config *zc, struct trainer_opts *o, bool onebit,
                        char *err, size_t errlen);

/* ---- the compression, without the collectives (bench/onebit_ref runs them so) ---- */

/* N: n padded to a multiple of world x lcm(world, 8), as DeepSpeed pads. */
size_t onebit_padded(size_t n, int world);
/* A worker's side: x = m (n, then zeros to N) + werr (N); returns the scale |x| / sqrt(N)
 * (the sum of squares in double, in order); bits (N / 8 bytes, the first element in the
 * top bit of byte 0, as numpy's packbits) set where x >= 0; werr = x - scale x sign. */
float onebit_compress(const float *m, size_t n, float *werr, size_t N, uint8_t *bits);
/* A server's side of one chunk (chunk elements): c = ((s_0 sc_0 / W + s_1 sc_1 / W) + ...)
 * + serr, rank w's signs from bits[w] (chunk / 8 bytes) and scale sc_w; returns c's scale,
 * out its signs, serr = c - scale x sign. */
float onebit_server(const uint8_t *const *bits, const float *scales, int world, float *serr,
                    size_t chunk, uint8_t *out);
/* m (the first n of N) = server r's sign x scale over chunk r, for every r. */
void onebit_expand(const uint8_t *bits, const float *scales, int world, size_t chunk, float *m,
                   size_t n);
/* m = b1 m + (1 - b1) (g gs), as Adam's kernels do it (fmaf). */
void onebit_momentum(float *m, const float *g, size_t n, float b1, float gs);
/* p -= lr (m / (sqrt(v) + eps) + wd p), as Adam's kernels do it. */
void onebit_apply(float *p, const float *m, const float *v, size_t n, float lr, float eps,
                  float wd);

struct trainer;
struct adamw_hparams;
/* The refusals of what 1-bit Adam does not run with (GPU ranks, ZeRO stage 2 and 3,
 * pipeline, tensor- and sequence-parallel ranks, MoE): 0 or -EINVAL naming the key. */
int train_onebit_check(struct trainer *t, bool cuda, char *err, size_t errlen);
/* This step's gradients stay on their rank (the compressed phase). */
bool train_onebit_local(const struct trainer *t);
/* Update `step` (> freeze_step) of tensor i (p as opt_run's), gs the scale of the rank's
 * local gradient to its micro-batches' mean. */
int train_onebit_update(struct trainer *t, int i, void **p, const struct adamw_hparams *h,
                        float gs);
void train_onebit_free(struct trainer *t);

#endif

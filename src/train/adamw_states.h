/*
 * adamw_states.h - AdamW with its moments m and v kept in fewer bytes than fp32: bf16 with
 * stochastic rounding, or 8 bits a value, blockwise, as bitsandbytes' 8-bit Adam keeps them.
 * Each update widens a block of the stored moments to fp32, runs adamw.c's kernel on it (the
 * same arithmetic as with fp32 states), and stores the new moments back:
 *
 *   bf16  the fp32 value plus 16 random bits in its low half, truncated: rounded up with the
 *         probability of the remainder (unbiased). The bits are a counter hash of (seed,
 *         tensor, step, element's index in the whole tensor), so they are the same for any
 *         thread count, rank count or shard boundary. Truncation never crosses zero, so v
 *         stays >= 0; a value that would round to infinity is truncated instead.
 *   q8    blocks of ADAMW_Q8_BLOCK elements (256, bitsandbytes' blockwise optimizers'
 *         block since 0.44; 2048 before) counted from the tensor's first element; each
 *         block keeps its absmax in fp32 and each value the code of bitsandbytes' dynamic
 *         map (create_dynamic_map: signed for m, unsigned for v) nearest to value / absmax
 *         (the lower code on a tie). A block of zeros has absmax 0 and decodes to zeros, so
 *         a zero-filled buffer is a zero state.
 *
 * The new parameters are computed from the fp32 moments before they are stored (as
 * bitsandbytes does): what compression loses shows from the next step on.
 *
 * A q8 buffer laid out for cap elements holds cap codes, padded to 4 bytes, then
 * ceil(cap / ADAMW_Q8_BLOCK) fp32 scales. A part of a tensor (a ZeRO shard) must start on
 * a block boundary, so that its blocks are the whole tensor's.
 *
 * Not here: where the buffers live, LAMB (its states stay fp32), the GPU's twin
 * (kernels/adamw_states.cu, the same bits).
 */
#ifndef ZINF_TRAIN_ADAMW_STATES_H
#define ZINF_TRAIN_ADAMW_STATES_H

#include <stddef.h>
#include <stdint.h>

#include "train/adamw.h"

enum adamw_state_dtype { ADAMW_STATE_FP32, ADAMW_STATE_BF16, ADAMW_STATE_Q8 };

#define ADAMW_Q8_BLOCK 256

/* "fp32", "bf16", "int8" (the setting's names); NULL for another value. */
const char *adamw_state_dtype_name(enum adamw_state_dtype dt);

/* Bytes of one moment's buffer laid out for cap elements. */
size_t adamw_state_bytes(enum adamw_state_dtype dt, size_t cap);

/* Where the buffers are in the whole tensor, and what the random bits hang on. */
struct adamw_state_at {
    uint64_t seed;   /* the run's */
    uint32_t tensor; /* the tensor's number in the model */
    uint64_t first;  /* the whole tensor's index of element 0 (q8: a multiple of the block) */
    size_t cap;      /* elements the moments' buffers are laid out for, >= n */
};

/* One AdamW step over n elements (adamw_update's arithmetic and arguments), m and v stored
 * as dt; the new parameters' bf16 copy too when param_bf16 is not NULL. fp32 is
 * adamw_update / adamw_update_bf16 themselves. -EINVAL as adamw_update, and for an unknown
 * dt, n > cap, or a q8 part that starts off a block boundary. */
int adamw_update_states(enum adamw_state_dtype dt, float *param, const float *grad, void *m,
                        void *v, uint16_t *param_bf16, size_t n, const struct adamw_state_at *at,
                        const struct adamw_hparams *h, int step, float grad_scale);

/* The pieces, for tests and tools. */
/* bitsandbytes' dynamic map (8 bits, 7 exponent bits at most), its float32 arithmetic
 * transcribed, sorted ascending: signed (m) or not (v). */
const float *adamw_q8_map(int is_signed);
/* The index of the code nearest x in the sorted map (the lower one on a tie). */
uint8_t adamw_q8_nearest(const float *map, float x);
/* n values quantized in blocks of ADAMW_Q8_BLOCK from x[0]: codes[n], absmax[blocks]; and
 * back. */
void adamw_q8_quantize(const float *x, size_t n, int is_signed, uint8_t *codes, float *absmax);
void adamw_q8_dequantize(const uint8_t *codes, const float *absmax, size_t n, int is_signed,
                         float *x);
/* x to bf16, rounded up in magnitude when the low 16 bits plus r16 carry (NaN and infinity
 * as the nearest cast, a finite value never to infinity). */
uint16_t adamw_bf16_stochastic(float x, uint32_t r16);
/* The 32 random bits of element `index` of a tensor at a step: m takes the low 16, v the
 * high 16. */
uint32_t adamw_state_bits(uint64_t seed, uint32_t tensor, int step, uint64_t index);

#endif

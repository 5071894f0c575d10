/*
 * digest.h - a 64-bit digest of the parameters, for the training log: two runs whose
 * parameters differ in any one value have different digests, so runs can be compared
 * exactly without reading their swap files.
 *
 * The digest of a set of fp32 tensors is the sum, modulo 2^64, of one term per block of
 * DIGEST_BLOCK_FLOATS values of each tensor: a bijective mix of the block's hash and of
 * (tensor index, block index). Being a sum, it can be computed in pieces, by any number of
 * threads and by each rank over its own shards (shards are whole blocks), and the pieces
 * added: the result does not depend on how the work was cut. Changing one value changes its
 * block's hash (each step of the hash is a bijection of the word it takes in), so its term,
 * so the sum. Not a cryptographic hash.
 *
 * Not here: where the tensors live (the trainer hashes what its optimizer just wrote).
 */
#ifndef ZINF_TRAIN_DIGEST_H
#define ZINF_TRAIN_DIGEST_H

#include <stddef.h>
#include <stdint.h>

#define DIGEST_BLOCK_FLOATS 1024 /* 4 KiB: shards are multiples of it */

/* The digest terms of p (n floats), which start at block first_block of tensor `tensor`
 * (p is block-aligned within the tensor; n may end with a short block), summed. */
uint64_t digest_floats(const float *p, size_t n, uint32_t tensor, size_t first_block);

#endif

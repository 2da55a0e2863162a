/* Decode attention of one sequence, every KV head in one pass, bf16 on AVX512-BF16
 * (attention_decode_bf16.c). */
#ifndef PREFIXSERVE_ATTENTION_DECODE_BF16_H
#define PREFIXSERVE_ATTENTION_DECODE_BF16_H

#include <stdint.h>

#include "attention_tile_bf16.h"

/* 1 when the library was built with AVX512-BF16. */
int bf16_decode_available(void);

/* 1 when the library was built with AVX512-BF16 and the shapes fit: head_dim a multiple of 64 up
 * to BF16_TILE_MAX_DIM, block_size a multiple of 16. */
int bf16_decode_supported(int head_dim, int block_size);

/* The single query token at row tok of one sequence (a->table its block table from the first
 * key on) attends to its ctx >= 1 keys, for every query head; out and lse as in
 * paged_attention.c. Returns 0, or -1 when the score buffer cannot be allocated. */
int bf16_attend_decode(const bf16_tile_args *a, int64_t tok, int64_t ctx);

#endif

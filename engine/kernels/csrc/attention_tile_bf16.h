/* One tile of prefill attention rows in bf16 on AVX512-BF16 (attention_tile_bf16.c). */
#ifndef PREFIXSERVE_ATTENTION_TILE_BF16_H
#define PREFIXSERVE_ATTENTION_TILE_BF16_H

#include <stdint.h>

#define BF16_TILE_MAX_DIM 256

/* Layouts as in paged_attention.c; every pointer is bf16 except the tables and lse. */
typedef struct {
    const uint16_t *q, *k_cache, *v_cache;
    const int64_t *table; /* the sequence's block table */
    uint16_t *out;
    float *lse; /* NULL, or float32 [num_tokens, num_heads] */
    int num_heads, group, head_dim, block_size;
    int64_t q_stride, out_stride, row; /* row: elements per cache slot */
    float scale;
} bf16_tile_args;

/* 1 when the library was built with AVX512-BF16 (bf16_attend_tile does nothing otherwise). */
int bf16_tile_available(void);

/* Query tokens [qtok, qtok + ntok) of one sequence, the first at position first_pos, for KV head
 * kvh: each attends to the keys from kv_start up to its own position. Needs ntok * group <= 16,
 * head_dim % 32 == 0 and head_dim <= BF16_TILE_MAX_DIM. A row that sees no key gets out = 0 and
 * lse = -inf. */
void bf16_attend_tile(const bf16_tile_args *a, int64_t qtok, int64_t first_pos, int ntok, int kvh,
                      int64_t kv_start);

#endif

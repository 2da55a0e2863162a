/* Prefill attention of runs of query tiles in bf16 on AMX (attention_amx.c). */
#ifndef PREFIXSERVE_ATTENTION_AMX_H
#define PREFIXSERVE_ATTENTION_AMX_H

#include <stdint.h>

#include "attention_tile_bf16.h"

/* Query tokens of one tile. */
#define AMX_TILE_TOKENS 16

/* 1 when the library was built with AMX and the process may use the tile state. */
int amx_prefill_available(void);

/* Query tokens [t_begin, t_end) of one sequence, whose query token 0 is row qtok of q and out
 * and sits at position first_pos, for every query head of KV head kvh: each attends to the keys
 * from kv_start up to its own position. The keys of the run are packed once and shared by its
 * tiles of AMX_TILE_TOKENS tokens (t_begin a multiple of it). Needs head_dim % 32 == 0,
 * head_dim <= BF16_TILE_MAX_DIM, block_size % 16 == 0 and kv_start % 16 == 0. A row that sees
 * no key gets out = 0 and lse = -inf. Returns 0, or -1 without AMX or memory. */
int amx_attend_tiles(const bf16_tile_args *a, int64_t qtok, int64_t first_pos, int64_t t_begin,
                     int64_t t_end, int kvh, int64_t kv_start);

#endif

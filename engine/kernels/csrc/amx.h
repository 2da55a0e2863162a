/* AMX pieces shared by the kernels. HAVE_AMX is defined where the build targets a Linux CPU with
 * AMX for bf16 (and AVX512-BF16, which every such CPU has); tile_config is the 64-byte operand of
 * ldtilecfg. Whether the process may use the tile state is asked of Linux once, by
 * amx_linear_available (amx_linear.c); without permission, or without HAVE_AMX, it returns 0 and
 * callers take their vector loops. */
#ifndef PREFIXSERVE_AMX_H
#define PREFIXSERVE_AMX_H

#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#define HAVE_AMX 1

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* All eight tiles 16 rows x 64 bytes (16 x 32 bf16 or 16 x 16 float32), for this thread. */
static inline void amx_configure_16x64(void) {
    tile_config cfg = {.palette_id = 1};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
#endif

int amx_linear_available(void);
/* amx_linear's product for batches of more than a decode step's rows (amx_prefill_linear.c). */
int amx_prefill_linear(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                       const uint16_t *wp, int64_t n, int gated, uint16_t *y, int64_t y_stride,
                       int num_threads);

#endif

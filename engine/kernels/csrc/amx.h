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
#endif

int amx_linear_available(void);

#endif

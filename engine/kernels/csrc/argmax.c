/* Row-wise argmax for greedy sampling. */
#include <stdint.h>

#include "bf16.h"

/* out[r] = index of the first maximum of row r of x [rows, cols >= 1] (row stride `stride`),
 * like torch.argmax for rows without NaN (this file is built with -ffast-math, so NaN rows are
 * not defined here; callers keep torch.argmax where NaN matters). dtype as above. */
void argmax_rows(const void *x, int64_t rows, int64_t cols, int64_t stride, int dtype,
                 int64_t *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if(rows * cols >= (1 << 18))
    for (int64_t r = 0; r < rows; r++) {
        int64_t best = 0;
        if (dtype == 1) {
            const uint16_t *p = (const uint16_t *)x + r * stride;
            float mx = bf16_to_f32(p[0]);
            for (int64_t c = 1; c < cols; c++) {
                const float v = bf16_to_f32(p[c]);
                mx = v > mx ? v : mx;
            }
            for (int64_t c = 0; c < cols; c++) {
                if (bf16_to_f32(p[c]) == mx) {
                    best = c;
                    break;
                }
            }
        } else {
            const float *p = (const float *)x + r * stride;
            float mx = p[0];
            for (int64_t c = 1; c < cols; c++) mx = p[c] > mx ? p[c] : mx;
            for (int64_t c = 0; c < cols; c++) {
                if (p[c] == mx) {
                    best = c;
                    break;
                }
            }
        }
        out[r] = best;
    }
}

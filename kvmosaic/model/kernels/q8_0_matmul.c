/* y = x @ W^T where W is a GGUF file's Q8_0 blocks: the shipped model's embedding, which is its tied
 * LM head (quantization="gguf", kvmosaic/model/quant_gguf.py; docs/ARCHITECTURE.md).
 *
 * A Q8_0 block holds 32 consecutive weights of one output channel: a float16 scale d and 32 int8
 * q; a weight is w = d * q, exact in float32 (an 11-bit by 8-bit product). The kernel reads the
 * blocks split at load (kernels/__init__.py, exactly): qs [out, in] int8, d [out, in / 32] float32.
 * A decode step's head reads 1.06 bytes a weight instead of 4 (float32): 31 MB for the shipped model.
 *
 * Numerics: float32 x, float32 sums, regrouped per block as y = sum_b d_b (x_b . q_b):
 *   - with AVX2 and FMA, x_b . q_b in 8 lanes, lane j holding weights j, 8 + j, 16 + j, 24 + j (a
 *     product and three fused multiply-adds in that order), scaled into the lane's accumulator by
 *     a fused multiply-add with d_b, block after block; the 8 lanes summed last (as q4_1_avx2.h);
 *   - otherwise w = d * q first and y = sum over blocks and lanes of x * w, 32 lanes, added last.
 * Every (row, channel) is computed by one thread in the same order whatever the number of rows
 * (batch invariance); rows are taken in tiles so that a block, read once from memory, serves all.
 */
#include <stdint.h>
#include <stdlib.h>

#include "q4_1_avx2.h" /* INLINE, q4_1_sum8, the tile sizes, WITH_CONSTANT_TILE */

#define Q8_0_BLOCK 32
#ifndef INLINE
#define INLINE static inline __attribute__((always_inline))
#endif

#if defined(Q4_1_AVX2)
#define Q8_0_ROWS Q4_1_TILE_ROWS
#define Q8_0_CHANNELS Q4_1_TILE_CHANNELS

/* out[r][c] = x_r . w_c for nc channels at qs, d (channel stride in) and nr rows of x (stride in). */
INLINE void q8_0_tile(const int8_t *qs, const float *d, int64_t in, const float *x, const int nr, const int nc,
                      float out[Q8_0_ROWS][Q8_0_CHANNELS]) {
    const int64_t nblocks = in / Q8_0_BLOCK;
    __m256 acc[Q8_0_ROWS][Q8_0_CHANNELS];
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < nc; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; ++b) {
        for (int c = 0; c < nc; ++c) {
            const int8_t *q = qs + c * in + b * Q8_0_BLOCK;
            if ((b & 1) == 0) _mm_prefetch((const char *)(q + 4 * nc * in), _MM_HINT_T0); /* 4 tiles on */
            __m256 w[4];
            for (int k = 0; k < 4; ++k)
                w[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * k))));
            const __m256 scale = _mm256_broadcast_ss(d + c * nblocks + b);
            for (int r = 0; r < nr; ++r) {
                const float *xb = x + r * in + b * Q8_0_BLOCK;
                __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xb), w[0]);
                for (int k = 1; k < 4; ++k) t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * k), w[k], t);
                acc[r][c] = _mm256_fmadd_ps(t, scale, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < nc; ++c) out[r][c] = q4_1_sum8(acc[r][c]);
}

static void q8_0_tile_const(const int8_t *qs, const float *d, int64_t in, const float *x, int nr, int nc,
                            float out[Q8_0_ROWS][Q8_0_CHANNELS]) {
#define Q8_0_TILE(R, C) q8_0_tile(qs, d, in, x, R, C, out)
    WITH_CONSTANT_TILE(Q8_0_TILE, nr, nc);
#undef Q8_0_TILE
}
#else
#define Q8_0_ROWS 2
#define Q8_0_CHANNELS 1

static void q8_0_tile_const(const int8_t *qs, const float *d, int64_t in, const float *x, int nr, int nc,
                            float out[Q8_0_ROWS][Q8_0_CHANNELS]) {
    (void)nc;
    const int64_t nblocks = in / Q8_0_BLOCK;
    for (int r = 0; r < nr; ++r) {
        float acc[Q8_0_BLOCK] = {0};
        for (int64_t b = 0; b < nblocks; ++b)
            for (int j = 0; j < Q8_0_BLOCK; ++j)
                acc[j] += x[r * in + b * Q8_0_BLOCK + j] * (d[b] * (float)qs[b * Q8_0_BLOCK + j]);
        float s = 0.0f;
        for (int j = 0; j < Q8_0_BLOCK; ++j) s += acc[j];
        out[r][0] = s;
    }
}
#endif

/* y [rows, out] = x [rows, in] @ W^T (float32, contiguous), W given as qs [out, in], d [out, in / 32].
 * Returns 0, or -1 when in is not a multiple of 32. */
int q8_0_matmul(const int8_t *qs, const float *d, const float *x, int64_t rows, int64_t in, int64_t out, float *y,
                int threads) {
    if (in % Q8_0_BLOCK != 0 || rows < 0) return -1;
    const int64_t nblocks = in / Q8_0_BLOCK, tiles = (out + Q8_0_CHANNELS - 1) / Q8_0_CHANNELS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && out >= 64)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t o = t * Q8_0_CHANNELS;
        const int nc = out - o < Q8_0_CHANNELS ? (int)(out - o) : Q8_0_CHANNELS;
        for (int64_t r0 = 0; r0 < rows; r0 += Q8_0_ROWS) {
            const int nr = rows - r0 < Q8_0_ROWS ? (int)(rows - r0) : Q8_0_ROWS;
            float dots[Q8_0_ROWS][Q8_0_CHANNELS];
            q8_0_tile_const(qs + o * in, d + o * nblocks, in, x + r0 * in, nr, nc, dots);
            for (int r = 0; r < nr; ++r)
                for (int c = 0; c < nc; ++c) y[(r0 + r) * out + o + c] = dots[r][c];
        }
    }
    return 0;
}

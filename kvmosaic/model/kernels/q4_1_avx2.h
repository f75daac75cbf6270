/* Q4_1 dot products for float32 activations on AVX2 with FMA, shared by q4_1_matmul.c (the
 * layer path) and decode_step.c (the fused decode step), so that a (row, channel) gets the same
 * bits from either. Blocks as q4_1_matmul.c describes them: per channel qs [nblocks * 16] (low
 * nibbles weights 0..15, high nibbles 16..31), d and m [nblocks] float32.
 *
 * Regrouped per block as the bfloat16 kernel is (w = d q + m):
 *     y = sum_b d_b (x_b . q_b)  +  sum_b m_b xsum_b
 * - x_b . q_b in 8 lanes, lane j holding weights j, 8 + j, 16 + j, 24 + j: a product and three
 *   fused multiply-adds in that order (q <= 15 is exact as a float); it is scaled into the lane's
 *   accumulator by a fused multiply-add with d_b, block after block;
 * - xsum_b, the sum of the block's 32 x (q4_1_block_sums: four vectors added in order, then the
 *   8 lanes as sum8 adds them), and the m terms in 8 lanes of blocks b = 8k + j, fused
 *   multiply-adds in k order, masked past the last block;
 * - y = sum8(the d terms' lanes) + sum8(the m terms' lanes).
 * Every (row, channel) runs these instructions in this order whatever the tile it is computed in,
 * so a row's result does not depend on the other rows (batch invariance). Per block ~11
 * instructions unpack and convert the 32 nibbles, shared by the tile's rows, and 5 a row: about
 * a third fewer than dequantizing w first (4 products and 4 sums more a block and channel).
 */
#ifndef KVMOSAIC_Q4_1_AVX2_H
#define KVMOSAIC_Q4_1_AVX2_H
#if defined(__AVX2__) && defined(__FMA__)
#define Q4_1_AVX2 1
#include <immintrin.h>
#include <stdint.h>

#ifndef INLINE
#define INLINE static inline __attribute__((always_inline))
#endif

#define Q4_1_TILE_ROWS 2     /* rows of x per tile (accumulators, q and x vectors fit 16 registers) */
#define Q4_1_TILE_CHANNELS 4 /* output channels per tile */

INLINE float q4_1_sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* xsum [rows, in / 32]: each block's sum of x [rows, in] (row stride x_stride). */
static inline void q4_1_block_sums(const float *x, int64_t x_stride, int64_t rows, int64_t in, float *xsum) {
    const int64_t nblocks = in / 32;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nblocks; ++b) {
            const float *xb = x + r * x_stride + b * 32;
            const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                                         _mm256_loadu_ps(xb + 16)),
                                           _mm256_loadu_ps(xb + 24));
            xsum[r * nblocks + b] = q4_1_sum8(s);
        }
}

/* The mask of the first n (< 8) lanes, for the last m terms. */
INLINE __m256i q4_1_first_lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* out[r][c] = x_r . w_c for nc (<= Q4_1_TILE_CHANNELS) channels starting at qs, d, m (channel
 * stride nblocks blocks) and nr (<= Q4_1_TILE_ROWS) rows of x (stride x_stride) with their block
 * sums xsum (stride nblocks). Call with constant nc and nr so the accumulators stay in registers. */
INLINE void q4_1_tile_avx2(const uint8_t *qs, const float *d, const float *m, int64_t nblocks, const float *x,
                           int64_t x_stride, const float *xsum, const int nr, const int nc,
                           float out[Q4_1_TILE_ROWS][Q4_1_TILE_CHANNELS]) {
    __m256 acc[Q4_1_TILE_ROWS][Q4_1_TILE_CHANNELS];
    const __m256i low = _mm256_set1_epi32(0x0f);
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < nc; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; ++b) {
        for (int c = 0; c < nc; ++c) {
            const uint8_t *q = qs + (c * nblocks + b) * 16;
            if ((b & 3) == 0) _mm_prefetch((const char *)(q + 4 * nc * nblocks * 16), _MM_HINT_T0); /* 4 tiles on */
            const __m256i q0_7 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
            const __m256i q8_15 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
            const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(q0_7, low));
            const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(q8_15, low));
            const __m256 w2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(q0_7, 4));
            const __m256 w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(q8_15, 4));
            const __m256 scale = _mm256_broadcast_ss(d + c * nblocks + b);
            for (int r = 0; r < nr; ++r) {
                const float *xb = x + r * x_stride + b * 32;
                __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xb), w0);
                t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), w1, t);
                t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), w2, t);
                t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), w3, t);
                acc[r][c] = _mm256_fmadd_ps(t, scale, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < nc; ++c) {
            const float *mc = m + c * nblocks, *sr = xsum + r * nblocks;
            __m256 ms = _mm256_setzero_ps();
            int64_t b = 0;
            for (; b + 8 <= nblocks; b += 8) ms = _mm256_fmadd_ps(_mm256_loadu_ps(mc + b), _mm256_loadu_ps(sr + b), ms);
            if (b < nblocks) {
                const __m256i k = q4_1_first_lanes(nblocks - b);
                ms = _mm256_fmadd_ps(_mm256_maskload_ps(mc + b, k), _mm256_maskload_ps(sr + b, k), ms);
            }
            out[r][c] = q4_1_sum8(acc[r][c]) + q4_1_sum8(ms);
        }
}

/* CALL(R, C) with R = nr (1 or 2) and C = nc (1 to 4) as constants: a tile's accumulators stay in
 * registers only when its shape is known at compile time. */
#define WITH_CONSTANT_TILE(CALL, nr, nc)                                                         \
    do {                                                                                         \
        if ((nr) == 1) {                                                                         \
            if ((nc) == 4) CALL(1, 4); else if ((nc) == 3) CALL(1, 3); else if ((nc) == 2) CALL(1, 2); else CALL(1, 1); \
        } else {                                                                                 \
            if ((nc) == 4) CALL(2, 4); else if ((nc) == 3) CALL(2, 3); else if ((nc) == 2) CALL(2, 2); else CALL(2, 1); \
        }                                                                                        \
    } while (0)

/* q4_1_tile_avx2 for any nr, nc. */
static inline void q4_1_tile(const uint8_t *qs, const float *d, const float *m, int64_t nblocks, const float *x,
                             int64_t x_stride, const float *xsum, int nr, int nc,
                             float out[Q4_1_TILE_ROWS][Q4_1_TILE_CHANNELS]) {
#define Q4_1_TILE(R, C) q4_1_tile_avx2(qs, d, m, nblocks, x, x_stride, xsum, R, C, out)
    WITH_CONSTANT_TILE(Q4_1_TILE, nr, nc);
#undef Q4_1_TILE
}

#endif
#endif

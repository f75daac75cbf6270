/* Q4_1 dot products for bfloat16 activations on AVX512-BF16, shared by q4_1_matmul.c (the layer
 * path) and decode_step.c (the fused decode step), so that a (row, channel) gets the same bits from
 * either. Blocks as q4_1_matmul.c describes them: per channel qs [nblocks * 16] (low nibbles weights
 * 0..15, high nibbles 16..31), d and m [nblocks] float32.
 *
 * Regrouped per block (w = d q + m):
 *     y = sum_b d_b (x_b . q_b)  +  sum_b m_b xsum_b
 * - x_b . q_b by one VDPBF16PS (q <= 15 is exact in bfloat16, its products exact in float32), scaled
 *   into the row's accumulator by a fused multiply-add with d_b; even and odd blocks accumulate apart;
 * - xsum_b, the sum of the block's 32 x widened, added one by one in order (q4_1_block_sums_bf16), and
 *   the m terms as one dot product over the blocks, 16 lanes at a time;
 * - y = (the d terms' lanes, even + odd, reduced) + (the m terms' lanes reduced).
 * Every (row, channel) runs these instructions in this order whatever the rows it is computed with,
 * so a row's result does not depend on the other rows (batch invariance).
 */
#ifndef KVMOSAIC_Q4_1_BF16_H
#define KVMOSAIC_Q4_1_BF16_H
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define Q4_1_BF16_DOT 1
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

#define Q4_1_BF16_ROWS 4 /* rows of x a channel's blocks serve per pass */

/* bfloat16 bits of 0..15: the lookup that turns nibbles into bfloat16 values. */
static const uint16_t Q4_1_NIBBLE_BF16[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                              0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* xsum [rows, in / 32]: each block's sum of x [rows, in] (row stride x_stride), widened and added in order. */
static inline void q4_1_block_sums_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t in, float *xsum) {
    const int64_t nblocks = in / 32;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nblocks; ++b) {
            const uint16_t *xb = x + r * x_stride + b * 32;
            float s = 0.0f;
            for (int j = 0; j < 32; ++j) s += bf16_to_float(xb[j]);
            xsum[r * nblocks + b] = s;
        }
}

/* Block b into the accumulators of rows 0..nr of x (row stride x_stride). */
static inline __attribute__((always_inline)) void q4_1_block_bf16(const uint8_t *qs, const float *d, const uint16_t *x,
                                                                  int64_t x_stride, int64_t b, int nr, __m512i table,
                                                                  __m512 *acc) {
    const __m256i q16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + b * 16)));
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q16, _mm256_set1_epi16(0x0f))),
                                           _mm256_srli_epi16(q16, 4), 1);
    const __m512bh q = (__m512bh)_mm512_permutexvar_epi16(idx, table);
    const __m512 vd = _mm512_set1_ps(d[b]);
    for (int r = 0; r < Q4_1_BF16_ROWS; ++r) {
        if (r < nr) {
            const __m512bh xb = (__m512bh)_mm512_loadu_si512((const void *)(x + r * x_stride + b * 32));
            acc[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xb, q), vd, acc[r]);
        }
    }
}

/* q4_1_channel_bf16 for a constant nr: inlined, its accumulators in registers (a call per channel with nr
 * at run time kept them on the stack and cost about as much as an 18-block channel's products). */
static inline __attribute__((always_inline)) void q4_1_channel_rows(const uint8_t *qs, const float *d, const float *m,
                                                                    int64_t nblocks, const uint16_t *x, int64_t x_stride,
                                                                    const float *xsum, const int nr, float *dots) {
    const __m512i table = _mm512_loadu_si512((const void *)Q4_1_NIBBLE_BF16);
    __m512 even[Q4_1_BF16_ROWS], odd[Q4_1_BF16_ROWS];
    for (int r = 0; r < Q4_1_BF16_ROWS; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nblocks; b += 2) {
        q4_1_block_bf16(qs, d, x, x_stride, b, nr, table, even);
        q4_1_block_bf16(qs, d, x, x_stride, b + 1, nr, table, odd);
    }
    if (b < nblocks) q4_1_block_bf16(qs, d, x, x_stride, b, nr, table, even);
    for (int r = 0; r < nr; ++r) {
        __m512 ms = _mm512_setzero_ps();
        for (int64_t c = 0; c < nblocks; c += 16) {
            const __mmask16 k = first_lanes(nblocks - c);
            ms = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + c), _mm512_maskz_loadu_ps(k, xsum + r * nblocks + c), ms);
        }
        dots[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) + _mm512_reduce_add_ps(ms);
    }
}

/* dots[r] = x_r . w for one channel (its qs, d, m) and nr (<= Q4_1_BF16_ROWS) rows of x (row stride
 * x_stride) with their block sums xsum (row stride nblocks). */
static inline __attribute__((always_inline)) void q4_1_channel_bf16(const uint8_t *qs, const float *d, const float *m,
                                                                    int64_t nblocks, const uint16_t *x, int64_t x_stride,
                                                                    const float *xsum, int nr, float *dots) {
    switch (nr) {
    case 1: q4_1_channel_rows(qs, d, m, nblocks, x, x_stride, xsum, 1, dots); break;
    case 2: q4_1_channel_rows(qs, d, m, nblocks, x, x_stride, xsum, 2, dots); break;
    case 3: q4_1_channel_rows(qs, d, m, nblocks, x, x_stride, xsum, 3, dots); break;
    default: q4_1_channel_rows(qs, d, m, nblocks, x, x_stride, xsum, Q4_1_BF16_ROWS, dots); break;
    }
}
#endif
#endif

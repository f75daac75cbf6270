/* y = x @ W^T where W is a GGUF file's Q4_1 blocks, the shipped model's own 4-bit format
 * (quantization="gguf", kvmosaic/model/quant_gguf.py; docs/ARCHITECTURE.md).
 *
 * A Q4_1 block holds 32 consecutive weights of one output channel: float16 scale d, float16
 * minimum m and 16 bytes whose low nibbles are weights 0..15 and high nibbles 16..31; a weight
 * is w = d * q + m. The kernels read the blocks split at load (kernels/__init__.py, exactly):
 * qs [out, nb * 16] the nibble bytes as stored, d and m [out, nb] widened to float32 (so the
 * scales are plain loads, not conversions).
 *
 * Numerics (the torch reference, kernels.q4_1_reference, agrees up to summation order):
 *   - a weight is d * q + m, product and sum each rounded to float32 (no FMA): exactly what
 *     gguf-py's dequantize, and so the float model, computes;
 *   - x is read as given (float32, or bfloat16 widened exactly), sums are float32, and a result
 *     is stored as float32 or rounded to bfloat16 (nearest even);
 *   - float32 x under AVX-512: y = sum over blocks and lanes of x * w (lane j: element j of every
 *     block, even and odd blocks apart, with fused multiply-add; lanes added at the end); under
 *     AVX2 with FMA the regrouped sums of q4_1_avx2.h (the fused decode step's, bit for bit);
 *   - bfloat16 x on a CPU with AVX512-BF16: regrouped per block as
 *       y = sum_b d_b * (x_b . q_b) + sum_b m_b * (sum of x_b),
 *     x_b . q_b by VDPBF16PS (q <= 15 is exact in bfloat16, its products exact in float32): the sums
 *     of q4_1_bf16.h (the fused decode step's, bit for bit).
 * Every (row, channel) output is computed by one thread in the same order whatever the number
 * of rows, so a row's result does not depend on the other rows (batch invariance). Rows are
 * taken in tiles so that a block, read once from memory, serves all of them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "q4_1_avx2.h"
#include "q4_1_bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define Q4_1_BLOCK 32
#define QS_BYTES 16
#define ROW_TILE 4
#define INLINE static inline __attribute__((always_inline))

INLINE void store(void *y, int y_bf16, int64_t i, float v) {
    if (y_bf16)
        ((uint16_t *)y)[i] = float_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* The 32 weights of a block, float32 (w = d * q + m, two roundings). */
INLINE void dequant_block(const uint8_t *qs, float d, float m, float *w) {
    for (int j = 0; j < 16; ++j) {
        const float lo = d * (float)(qs[j] & 0x0f), hi = d * (float)(qs[j] >> 4);
        w[j] = lo + m;
        w[j + 16] = hi + m;
    }
}

#if defined(__AVX512F__)
/* Block b into the (low, high) accumulators of rows [r0, r0 + nr) of the float32 x. */
INLINE void block_f32(const uint8_t *qs, const float *d, const float *m, const float *x, int64_t in, int64_t b,
                      int64_t r0, int nr, __m512 (*acc)[2]) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + b * QS_BYTES)));
    const __m512 vd = _mm512_set1_ps(d[b]), vm = _mm512_set1_ps(m[b]);
    const __m512 w_lo =
        _mm512_add_ps(_mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0f)))), vm);
    const __m512 w_hi = _mm512_add_ps(_mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))), vm);
    for (int r = 0; r < ROW_TILE; ++r) {
        if (r < nr) {
            const float *xr = x + (r0 + r) * in + b * Q4_1_BLOCK;
            acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w_lo, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w_hi, acc[r][1]);
        }
    }
}
#endif

/* One output channel (its qs, d, m rows) for rows [r0, r0 + nr) of the float32 x. */
static inline void channel_tile_f32(const uint8_t *qs, const float *d, const float *m, const float *x, int64_t in,
                                    int64_t r0, int nr, float *dots) {
    const int64_t nblocks = in / Q4_1_BLOCK;
#if defined(__AVX512F__)
    __m512 even[ROW_TILE][2], odd[ROW_TILE][2];
    for (int r = 0; r < ROW_TILE; ++r) even[r][0] = even[r][1] = odd[r][0] = odd[r][1] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nblocks; b += 2) {
        block_f32(qs, d, m, x, in, b, r0, nr, even);
        block_f32(qs, d, m, x, in, b + 1, r0, nr, odd);
    }
    if (b < nblocks) block_f32(qs, d, m, x, in, b, r0, nr, even);
    for (int r = 0; r < nr; ++r)
        dots[r] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(even[r][0], even[r][1]), _mm512_add_ps(odd[r][0], odd[r][1])));
#else
    float acc[ROW_TILE][Q4_1_BLOCK];
    memset(acc, 0, sizeof acc);
    float w[Q4_1_BLOCK];
    for (int64_t b = 0; b < nblocks; ++b) {
        dequant_block(qs + b * QS_BYTES, d[b], m[b], w);
        for (int r = 0; r < nr; ++r) {
            const float *xr = x + (r0 + r) * in + b * Q4_1_BLOCK;
            for (int j = 0; j < Q4_1_BLOCK; ++j) acc[r][j] += xr[j] * w[j];
        }
    }
    for (int r = 0; r < nr; ++r) {
        float s = 0.0f;
        for (int j = 0; j < Q4_1_BLOCK; ++j) s += acc[r][j];
        dots[r] = s;
    }
#endif
}

#if defined(Q4_1_AVX2) && !defined(__AVX512F__)
#define Q4_1_F32_TILES 1
/* The float32 x product on AVX2 (q4_1_avx2.h), channel tiles shared out among the threads. */
static int q4_1_matmul_f32_tiles(const uint8_t *qs, const float *d, const float *m, const float *x, int64_t rows,
                                 int64_t in, int64_t out, void *y, int y_bf16, int threads) {
    const int64_t nblocks = in / Q4_1_BLOCK;
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(rows * nblocks + 1));
    if (xsum == NULL) return -1;
    q4_1_block_sums(x, in, rows, in, xsum);
    const int64_t tiles = (out + Q4_1_TILE_CHANNELS - 1) / Q4_1_TILE_CHANNELS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && out >= 64)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t o = t * Q4_1_TILE_CHANNELS;
        const int nc = out - o < Q4_1_TILE_CHANNELS ? (int)(out - o) : Q4_1_TILE_CHANNELS;
        for (int64_t r0 = 0; r0 < rows; r0 += Q4_1_TILE_ROWS) {
            const int nr = rows - r0 < Q4_1_TILE_ROWS ? (int)(rows - r0) : Q4_1_TILE_ROWS;
            float dots[Q4_1_TILE_ROWS][Q4_1_TILE_CHANNELS];
            q4_1_tile(qs + o * nblocks * QS_BYTES, d + o * nblocks, m + o * nblocks, nblocks, x + r0 * in, in,
                      xsum + r0 * nblocks, nr, nc, dots);
            for (int r = 0; r < nr; ++r)
                for (int c = 0; c < nc; ++c) store(y, y_bf16, (r0 + r) * out + o + c, dots[r][c]);
        }
    }
    free(xsum);
    return 0;
}
#endif

/* y [rows, out] = x [rows, in] @ W^T, W given as qs [out, in / 2] and d, m [out, in / 32].
 * x: float32 or (x_bf16) bfloat16, contiguous; y: float32 or (y_bf16) bfloat16, contiguous.
 * Returns 0, or -1 when in is not a multiple of 32 or memory runs out. */
int q4_1_matmul(const uint8_t *qs, const float *d, const float *m, const void *x, int x_bf16, int64_t rows, int64_t in,
                int64_t out, void *y, int y_bf16, int threads) {
    if (in % Q4_1_BLOCK != 0 || rows < 0) return -1;
    const int64_t nblocks = in / Q4_1_BLOCK;
#if Q4_1_BF16_DOT
    if (x_bf16) {
        float *xsum = (float *)malloc(sizeof(float) * (size_t)(rows * nblocks + 1));
        if (xsum == NULL) return -1;
        q4_1_block_sums_bf16((const uint16_t *)x, in, rows, in, xsum);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && out >= 64)
        for (int64_t o = 0; o < out; ++o) {
            float dots[Q4_1_BF16_ROWS];
            for (int64_t r0 = 0; r0 < rows; r0 += Q4_1_BF16_ROWS) {
                const int nr = rows - r0 < Q4_1_BF16_ROWS ? (int)(rows - r0) : Q4_1_BF16_ROWS;
                q4_1_channel_bf16(qs + o * nblocks * QS_BYTES, d + o * nblocks, m + o * nblocks, nblocks,
                                  (const uint16_t *)x + r0 * in, in, xsum + r0 * nblocks, nr, dots);
                for (int r = 0; r < nr; ++r) store(y, y_bf16, (r0 + r) * out + o, dots[r]);
            }
        }
        free(xsum);
        return 0;
    }
#endif
    const float *xf = (const float *)x;
    float *widened = NULL;
    if (x_bf16) {
        widened = (float *)malloc(sizeof(float) * (size_t)(rows * in + 1));
        if (widened == NULL) return -1;
        for (int64_t i = 0; i < rows * in; ++i) widened[i] = bf16_to_float(((const uint16_t *)x)[i]);
        xf = widened;
    }
#if Q4_1_F32_TILES
    const int rc = q4_1_matmul_f32_tiles(qs, d, m, xf, rows, in, out, y, y_bf16, threads);
    free(widened);
    return rc;
#endif
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && out >= 64)
    for (int64_t o = 0; o < out; ++o) {
        float dots[ROW_TILE];
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int nr = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
            channel_tile_f32(qs + o * nblocks * QS_BYTES, d + o * nblocks, m + o * nblocks, xf, in, r0, nr, dots);
            for (int r = 0; r < nr; ++r) store(y, y_bf16, (r0 + r) * out + o, dots[r]);
        }
    }
    free(widened);
    return 0;
}

/* W as a dense [out, in] matrix: float32, or (y_bf16) rounded to bfloat16 (nearest even). */
int q4_1_dequantize(const uint8_t *qs, const float *d, const float *m, int64_t in, int64_t out, void *y, int y_bf16,
                    int threads) {
    if (in % Q4_1_BLOCK != 0) return -1;
    const int64_t nblocks = in / Q4_1_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && out >= 64)
    for (int64_t o = 0; o < out; ++o) {
        float buf[Q4_1_BLOCK];
        for (int64_t b = 0; b < nblocks; ++b) {
            const int64_t i = o * nblocks + b;
            dequant_block(qs + i * QS_BYTES, d[i], m[i], buf);
            for (int j = 0; j < Q4_1_BLOCK; ++j) store(y, y_bf16, o * in + b * Q4_1_BLOCK + j, buf[j]);
        }
    }
    return 0;
}

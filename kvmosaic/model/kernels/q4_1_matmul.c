/* y = x @ W^T where W is stored as GGUF Q4_1 blocks, the shipped model's own 4-bit format
 * (quantization="gguf", kvmosaic/model/quant_gguf.py; docs/ARCHITECTURE.md).
 *
 * A Q4_1 block holds 32 consecutive weights of one output channel: float16 scale d, float16
 * minimum m, then 16 bytes whose low nibbles are weights 0..15 and high nibbles 16..31; a
 * weight is w = d * q + m. A row of W is in/32 blocks (20 bytes each), rows one after another.
 *
 * Numerics (the torch reference in quant_gguf.py computes the same up to summation order):
 *   - a weight is float(d) * q + float(m), product and sum each rounded to float32 (no FMA:
 *     exactly what gguf-py's dequantize, and so the float model, computes);
 *   - x is read as given (float32, or bfloat16 widened exactly);
 *   - each output is a float32 sum of x * w in 32 lanes (lane j: element j of every block;
 *     under AVX-512 even and odd blocks in separate lanes, with fused multiply-add), the lanes
 *     added at the end; stored as float32 or rounded to bfloat16 (nearest even).
 * Every (row, channel) output is computed by one thread in the same order whatever the number
 * of rows, so a row's result does not depend on the other rows (batch invariance). Rows are
 * taken in tiles so that a block, read once from memory, serves all of them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define Q4_1_BLOCK 32
#define Q4_1_BYTES 20
#define ROW_TILE 4

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h); /* exact, as the portable conversion below */
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                --exp;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void block_scales(const uint8_t *blk, float *d, float *m) {
    uint16_t hd, hm;
    memcpy(&hd, blk, 2);
    memcpy(&hm, blk + 2, 2);
    *d = half_to_float(hd);
    *m = half_to_float(hm);
}

/* The 32 weights of a block, as float32 (w = d * q + m, two roundings). */
static inline void dequant_block(const uint8_t *blk, float *w) {
    float d, m;
    block_scales(blk, &d, &m);
    const uint8_t *qs = blk + 4;
    for (int j = 0; j < 16; ++j) {
        const float lo = d * (float)(qs[j] & 0x0f), hi = d * (float)(qs[j] >> 4);
        w[j] = lo + m;
        w[j + 16] = hi + m;
    }
}

static inline void store(void *y, int out_bf16, int64_t i, float v) {
    if (out_bf16)
        ((uint16_t *)y)[i] = float_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* One output channel for rows [r0, r0 + nr) of the float32 x. */
static inline void channel_tile(const uint8_t *wrow, const float *x, int64_t in, int64_t r0, int nr, float *dots) {
    const int64_t nblocks = in / Q4_1_BLOCK;
#if defined(__AVX512F__)
    /* Four accumulators a row (low / high half of even / odd blocks): independent FMA chains. */
    __m512 acc[ROW_TILE][4];
    for (int r = 0; r < ROW_TILE; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi32(0x0f);
    for (int64_t b = 0; b < nblocks; ++b) {
        const uint8_t *blk = wrow + b * Q4_1_BYTES;
        float d, m;
        block_scales(blk, &d, &m);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 4)));
        const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
        const __m512 w_lo = _mm512_add_ps(_mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_and_si512(q, low4))), vm);
        const __m512 w_hi = _mm512_add_ps(_mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))), vm);
        const int odd = (int)(b & 1) * 2;
        for (int r = 0; r < ROW_TILE; ++r) {
            if (r < nr) {
                const float *xr = x + (r0 + r) * in + b * Q4_1_BLOCK;
                acc[r][odd] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w_lo, acc[r][odd]);
                acc[r][odd + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w_hi, acc[r][odd + 1]);
            }
        }
    }
    for (int r = 0; r < nr; ++r)
        dots[r] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
#else
    float acc[ROW_TILE][Q4_1_BLOCK];
    memset(acc, 0, sizeof acc);
    float w[Q4_1_BLOCK];
    for (int64_t b = 0; b < nblocks; ++b) {
        dequant_block(wrow + b * Q4_1_BYTES, w);
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

/* y [rows, out] = x [rows, in] @ W^T, W being `out` rows of in/32 Q4_1 blocks. x: float32 or
 * (x_bf16) bfloat16, row stride in; y: float32 or (y_bf16) bfloat16, contiguous.
 * Returns 0, or -1 when in is not a multiple of 32 or memory runs out. */
int q4_1_matmul(const uint8_t *w, const void *x, int x_bf16, int64_t rows, int64_t in, int64_t out, void *y,
                int y_bf16, int threads) {
    if (in % Q4_1_BLOCK != 0 || rows < 0) return -1;
    const float *xf = (const float *)x;
    float *widened = NULL;
    if (x_bf16) {
        widened = (float *)malloc(sizeof(float) * (size_t)(rows * in + 1));
        if (widened == NULL) return -1;
        for (int64_t i = 0; i < rows * in; ++i) widened[i] = bf16_to_float(((const uint16_t *)x)[i]);
        xf = widened;
    }
    const int64_t row_bytes = in / Q4_1_BLOCK * Q4_1_BYTES;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && out >= 64)
    for (int64_t o = 0; o < out; ++o) {
        float dots[ROW_TILE];
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int nr = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
            channel_tile(w + o * row_bytes, xf, in, r0, nr, dots);
            for (int r = 0; r < nr; ++r) store(y, y_bf16, (r0 + r) * out + o, dots[r]);
        }
    }
    free(widened);
    return 0;
}

/* W as a dense [out, in] matrix: float32, or (y_bf16) rounded to bfloat16 (nearest even). */
int q4_1_dequantize(const uint8_t *w, int64_t in, int64_t out, void *y, int y_bf16, int threads) {
    if (in % Q4_1_BLOCK != 0) return -1;
    const int64_t nblocks = in / Q4_1_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && out >= 64)
    for (int64_t o = 0; o < out; ++o) {
        float buf[Q4_1_BLOCK];
        for (int64_t b = 0; b < nblocks; ++b) {
            dequant_block(w + (o * nblocks + b) * Q4_1_BYTES, buf);
            for (int j = 0; j < Q4_1_BLOCK; ++j) store(y, y_bf16, o * in + b * Q4_1_BLOCK + j, buf[j]);
        }
    }
    return 0;
}

/* The decoder's row functions with torch's roundings (elementwise.c's operators and
 * decode_step.c's fused layers both run them, so the two agree bit for bit): RMSNorm with the
 * residual add, the rotary embedding in place, SiLU(gate) * up. One row (token) at a time; ``bf16`` is a constant
 * at every call site, so the compiler makes a vectorized copy per dtype. */
#ifndef KVMOSAIC_ELEMENTWISE_H
#define KVMOSAIC_ELEMENTWISE_H
#include "bf16.h"

#define MAX_HIDDEN 8192
#define MAX_HEAD_DIM 512
#ifndef INLINE
#define INLINE static inline __attribute__((always_inline))
#endif

INLINE float load(const void *p, const int bf16, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store(void *p, const int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)p)[i] = float_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ELEMENTWISE_X16 1 /* the rows 16 lanes at a time (the compiler leaves the bfloat16 loops scalar) */

/* Elements i.. of a row (the lanes of mask) as float32; zeros in the other lanes. */
INLINE __m512 load16(const void *p, const int bf16, int64_t i, __mmask16 mask) {
    if (bf16) {
        const __m256i h = mask == 0xffff ? _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))
                                         : _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return mask == 0xffff ? _mm512_loadu_ps((const float *)p + i) : _mm512_maskz_loadu_ps(mask, (const float *)p + i);
}

/* v rounded to bfloat16 as float_to_bf16 rounds (16 values): by VCVTNEPS2BF16 where the CPU has it
 * (one instruction for float_to_bf16x16's seven: the same rounding and NaNs), except for a vector
 * holding a subnormal, which that instruction would flush to zero. */
INLINE __m256i bf16x16_of(__m512 v) {
#if defined(__AVX512BF16__)
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20 /* subnormal */) == 0, 1)) return (__m256i)_mm512_cvtneps_pbh(v);
#endif
    return _mm512_cvtepi32_epi16(float_to_bf16x16(v));
}

/* Stores the lanes of mask at elements i.., rounded as float_to_bf16 rounds (subnormals kept). */
INLINE void store16(void *p, const int bf16, int64_t i, __m512 v, __mmask16 mask) {
    if (bf16 && mask == 0xffff)
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), bf16x16_of(v));
    else if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)p + i, mask, bf16x16_of(v));
    else if (mask == 0xffff)
        _mm512_storeu_ps((float *)p + i, v);
    else
        _mm512_mask_storeu_ps((float *)p + i, mask, v);
}

/* store16 for v whose lanes are already values of the dtype (round16's): no rounding to do. */
INLINE void store_exact16(void *p, const int bf16, int64_t i, __m512 v, __mmask16 mask) {
    if (!bf16) {
        store16(p, 0, i, v, mask);
        return;
    }
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
    if (mask == 0xffff)
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), h);
    else
        _mm256_mask_storeu_epi16((uint16_t *)p + i, mask, h);
}

/* v rounded to the dtype's nearest value (float32: v). */
INLINE __m512 round16(__m512 v, const int bf16) {
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_of(v)), 16)) : v;
}
#endif

/* out = rms_norm(x (+ residual)) * weight over one row, as Hugging Face's Llama: the sum with the
 * residual rounded to the dtype (and written back to residual), float32 statistics, the normalized
 * row rounded, times the weight and rounded. The layer path and the fused decode step both call
 * it: a row gives the same bits in either. */
INLINE void rms_norm_row(const void *x, void *residual, const void *weight, void *out, int64_t hidden, float eps,
                         const int bf16) {
#if defined(ELEMENTWISE_X16)
    float row[MAX_HIDDEN] __attribute__((aligned(64)));
    __m512 squares = _mm512_setzero_ps();
    for (int64_t d = 0; d < hidden; d += 16) {
        const __mmask16 mask = first_lanes(hidden - d);
        __m512 v = load16(x, bf16, d, mask);
        if (residual != NULL) {
            v = round16(_mm512_add_ps(v, load16(residual, bf16, d, mask)), bf16);
            store_exact16(residual, bf16, d, v, mask);
        }
        _mm512_store_ps(row + d, v);
        squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v)); /* rounded as torch's pow(2) */
    }
    const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hidden + eps);
    for (int64_t d = 0; d < hidden; d += 16) {
        const __mmask16 mask = first_lanes(hidden - d);
        const __m512 n = round16(_mm512_mul_ps(_mm512_load_ps(row + d), _mm512_set1_ps(inv)), bf16);
        store16(out, bf16, d, _mm512_mul_ps(load16(weight, bf16, d, mask), n), mask);
    }
#else
    float row[MAX_HIDDEN];
    for (int64_t d = 0; d < hidden; ++d) row[d] = load(x, bf16, d);
    if (residual != NULL) {
        for (int64_t d = 0; d < hidden; ++d) {
            const float sum = row[d] + load(residual, bf16, d);
            row[d] = bf16 ? round_bf16(sum) : sum;
            store(residual, bf16, d, row[d]);
        }
    }
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < hidden; ++d) squares += row[d] * row[d];
    const float inv = 1.0f / sqrtf(squares / (float)hidden + eps);
    for (int64_t d = 0; d < hidden; ++d) {
        const float n = bf16 ? round_bf16(row[d] * inv) : row[d] * inv;
        store(out, bf16, d, load(weight, bf16, d) * n);
    }
#endif
}

/* silu(g) = g / (1 + exp(-g)), with exp_clamped: within an ulp or two of torch's float32 SiLU
 * (Sleef's exp), so in bfloat16 it rounds to torch's value but for rare ties. */
INLINE float silu(float g) { return g / (1.0f + exp_clamped(-g)); }

/* One bfloat16 silu(gate) * up from float32 sums, rounded as silu_mul_row rounds a GEMM's rounded outputs: gate
 * and up rounded to bfloat16, silu rounded, the product rounded. */
INLINE uint16_t silu_times_up_bf16(float gate, float up) {
    return float_to_bf16(round_bf16(silu(round_bf16(gate))) * round_bf16(up));
}

#if defined(__AVX512F__)
/* silu on 16 lanes, the same operations (exp16_clamped is exp_clamped on 16 lanes). */
INLINE __m512 silu16(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16_clamped(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}
#endif

/* act = silu(gate) * up over one row of ``inter`` elements, silu rounded to the dtype and the
 * product too (torch's ``F.silu(gate) * up``). */
INLINE void silu_mul_row(const void *gate, const void *up, void *act, int64_t inter, const int bf16) {
    int64_t d = 0;
#if defined(__AVX512F__) /* the loop below, 16 at a time (the compiler does not vectorize it in bfloat16) */
    for (; d + 16 <= inter; d += 16) {
        const __m512 g = bf16 ? bf16x16_to_float((const uint16_t *)gate + d) : _mm512_loadu_ps((const float *)gate + d);
        const __m512 u = bf16 ? bf16x16_to_float((const uint16_t *)up + d) : _mm512_loadu_ps((const float *)up + d);
        const __m512 s = silu16(g);
        if (bf16)
            store_bf16x16((uint16_t *)act + d, _mm512_mul_ps(round_bf16x16(s), u));
        else
            _mm512_storeu_ps((float *)act + d, _mm512_mul_ps(s, u));
    }
#endif
    for (; d < inter; ++d) {
        const float s = silu(load(gate, bf16, d));
        store(act, bf16, d, (bf16 ? round_bf16(s) : s) * load(up, bf16, d));
    }
}

INLINE void rope_row(void *x, const float *cos, const float *signed_sin, int64_t heads, int64_t dim, const int bf16) {
    const int64_t half = dim / 2;
#if defined(ELEMENTWISE_X16)
    if (half % 16 == 0) { /* the loop below, 16 lanes at a time */
        __m512 c[MAX_HEAD_DIM / 16], s[MAX_HEAD_DIM / 16];
        for (int64_t k = 0; k < dim / 16; ++k) {
            c[k] = round16(_mm512_loadu_ps(cos + 16 * k), bf16);
            s[k] = round16(_mm512_loadu_ps(signed_sin + 16 * k), bf16);
        }
        const int64_t n = dim / 16, h = half / 16;
        for (int64_t head = 0; head < heads; ++head) {
            __m512 v[MAX_HEAD_DIM / 16];
            for (int64_t k = 0; k < n; ++k) v[k] = load16(x, bf16, head * dim + 16 * k, 0xffff);
            for (int64_t k = 0; k < n; ++k) {
                const __m512 a = round16(_mm512_mul_ps(v[k], c[k]), bf16);
                const __m512 b = round16(_mm512_mul_ps(v[k < h ? k + h : k - h], s[k]), bf16);
                store16(x, bf16, head * dim + 16 * k, _mm512_add_ps(a, b), 0xffff);
            }
        }
        return;
    }
#endif
    float c[MAX_HEAD_DIM], s[MAX_HEAD_DIM], v[MAX_HEAD_DIM], out[MAX_HEAD_DIM];
    for (int64_t d = 0; d < dim; ++d) {
        c[d] = bf16 ? round_bf16(cos[d]) : cos[d];
        s[d] = bf16 ? round_bf16(signed_sin[d]) : signed_sin[d];
    }
    for (int64_t h = 0; h < heads; ++h) {
        for (int64_t d = 0; d < dim; ++d) v[d] = load(x, bf16, h * dim + d);
        for (int64_t d = 0; d < half; ++d) {
            const float a = v[d] * c[d], b = v[d + half] * s[d];
            out[d] = bf16 ? round_bf16(a) + round_bf16(b) : a + b;
        }
        for (int64_t d = half; d < dim; ++d) {
            const float a = v[d] * c[d], b = v[d - half] * s[d];
            out[d] = bf16 ? round_bf16(a) + round_bf16(b) : a + b;
        }
        for (int64_t d = 0; d < dim; ++d) store(x, bf16, h * dim + d, out[d]);
    }
}

/* A stored K moved to other positions (blend/rope.py's rerotate, bit for bit): each head's first rot
 * dims of src become src * cos + roll(src, rot / 2) * signed_sin ([rot] float32: one shift's tables),
 * computed in float32 — each product and the sum rounded to float32, as torch's float32 ops — and
 * rounded once to the dtype in dst; the dims past rot are copied. */
INLINE void rerotate_row(const void *src, void *dst, const float *cos, const float *signed_sin, int64_t heads,
                         int64_t dim, int64_t rot, const int bf16) {
    const int64_t half = rot / 2;
#if defined(ELEMENTWISE_X16)
    if (half % 16 == 0 && dim % 16 == 0) {
        const int64_t n = rot / 16, h = half / 16;
        for (int64_t head = 0; head < heads; ++head) {
            __m512 v[MAX_HEAD_DIM / 16];
            for (int64_t k = 0; k < n; ++k) v[k] = load16(src, bf16, head * dim + 16 * k, 0xffff);
            for (int64_t k = 0; k < n; ++k) {
                const __m512 a = _mm512_mul_ps(v[k], _mm512_loadu_ps(cos + 16 * k));
                const __m512 b = _mm512_mul_ps(v[k < h ? k + h : k - h], _mm512_loadu_ps(signed_sin + 16 * k));
                store16(dst, bf16, head * dim + 16 * k, _mm512_add_ps(a, b), 0xffff);
            }
            for (int64_t d = rot; d < dim; d += 16)
                store_exact16(dst, bf16, head * dim + d, load16(src, bf16, head * dim + d, 0xffff), 0xffff);
        }
        return;
    }
#endif
    for (int64_t head = 0; head < heads; ++head) {
        const int64_t o = head * dim;
        for (int64_t d = 0; d < rot; ++d) {
            const float a = load(src, bf16, o + d) * cos[d];
            const float b = load(src, bf16, o + (d < half ? d + half : d - half)) * signed_sin[d];
            store(dst, bf16, o + d, a + b);
        }
        for (int64_t d = rot; d < dim; ++d) store(dst, bf16, o + d, load(src, bf16, o + d));
    }
}
#endif

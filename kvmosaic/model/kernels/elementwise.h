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

INLINE void rms_norm_row(const void *x, void *residual, const void *weight, void *out, int64_t hidden, float eps,
                         const int bf16) {
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
}

/* silu(g) = g / (1 + exp(-g)), with exp_clamped: within an ulp or two of torch's float32 SiLU
 * (Sleef's exp), so in bfloat16 it rounds to torch's value but for rare ties. */
INLINE float silu(float g) { return g / (1.0f + exp_clamped(-g)); }

/* act = silu(gate) * up over one row of ``inter`` elements, silu rounded to the dtype and the
 * product too (torch's ``F.silu(gate) * up``). */
INLINE void silu_mul_row(const void *gate, const void *up, void *act, int64_t inter, const int bf16) {
    int64_t d = 0;
#if defined(__AVX512F__) /* the loop below, 16 at a time (the compiler does not vectorize it in bfloat16) */
    for (; d + 16 <= inter; d += 16) {
        const __m512 g = bf16 ? bf16x16_to_float((const uint16_t *)gate + d) : _mm512_loadu_ps((const float *)gate + d);
        const __m512 u = bf16 ? bf16x16_to_float((const uint16_t *)up + d) : _mm512_loadu_ps((const float *)up + d);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16_clamped(_mm512_sub_ps(_mm512_setzero_ps(), g))));
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
    float c[MAX_HEAD_DIM], s[MAX_HEAD_DIM], v[MAX_HEAD_DIM], out[MAX_HEAD_DIM];
    const int64_t half = dim / 2;
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
#endif

/* bfloat16 <-> float32 as torch converts them (round to nearest even, NaN kept NaN), and an
 * exp that vectorizes without -ffast-math. Shared by the kernels of this folder. */
#ifndef KVMOSAIC_BF16_H
#define KVMOSAIC_BF16_H
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The float32 value nearest to f that is a bfloat16 value. */
static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* exp(x) for x in [-87, 88] (clamped outside), relative error ~1e-7 (Cephes' polynomial, in
 * fused multiply-adds): plain arithmetic, so loops over it vectorize; exp16_clamped below is the
 * same operations on 16 lanes, bit for bit. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO 2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = floorf(fmaf(x, EXP_LOG2E, 0.5f));
    const float r = fmaf(n, EXP_LN2_LO, fmaf(-n, EXP_LN2_HI, x));
    float p = EXP_P0;
    p = fmaf(p, r, EXP_P1);
    p = fmaf(p, r, EXP_P2);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P5);
    p = fmaf(p * r, r, r + 1.0f);
    /* 2^n in two halves, so that n = 128 (x near 88) does not overflow the exponent field */
    const int32_t half = (int32_t)n >> 1;
    uint32_t b1 = (uint32_t)(half + 127) << 23, b2 = (uint32_t)((int32_t)n - half + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    return p * s1 * s2;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp_clamped on 16 lanes: the same operations, 2^n by VSCALEFPS (one exact scaling where the
 * scalar form makes two). */
static inline __m512 exp16_clamped(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x));
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* A mask of the first n of 16 lanes (none for n <= 0, all for n >= 16). */
static inline __mmask16 first_lanes(int64_t n) {
    return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}

/* 16 bfloat16 values as float32, and back as float_to_bf16 rounds them (in 32-bit lanes). */
static inline __m512 bf16x16_to_float(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512i float_to_bf16x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f), high = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                                 _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
}

#if defined(__AVX512BF16__) /* VCVTNEPS2BF16: the same rounding in one instruction, but subnormals flush to 0 */
static inline __m512 round_bf16x16(__m512 f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f)), 16));
}

static inline void store_bf16x16(uint16_t *p, __m512 f) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(f)); }

/* Two adjacent bfloat16 values (a query's two dimensions, two keys' probabilities) on every 32-bit lane. */
static inline __m512bh broadcast_pair(const uint16_t *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

/* 32 elements of two rows a, b side by side for VDPBF16PS: out[0]'s 16-bit lanes 2i, 2i + 1 are a[i], b[i] for
 * i < 16, out[1]'s the same for i = 16 .. 31 (prefill's packed V; decode's pairs of V rows). */
static inline void interleave_rows(__m512i a, __m512i b, __m512i out[2]) {
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i first = _mm512_add_epi32(_mm512_mullo_epi32(iota, _mm512_set1_epi32(0x10001)), _mm512_set1_epi32(32 << 16));
    out[0] = _mm512_permutex2var_epi16(a, first, b); /* b's elements numbered from 32 */
    out[1] = _mm512_permutex2var_epi16(a, _mm512_add_epi32(first, _mm512_set1_epi32(16 * 0x10001)), b);
}
#else
static inline __m512 round_bf16x16(__m512 f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(float_to_bf16x16(f), 16));
}

static inline void store_bf16x16(uint16_t *p, __m512 f) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(float_to_bf16x16(f)));
}
#endif
#endif

#endif

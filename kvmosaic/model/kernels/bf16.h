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

/* exp(x) for x in [-87, 88] (clamped outside), relative error ~1e-7 (Cephes' polynomial):
 * plain arithmetic, so loops over it vectorize. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* 2^n in two halves, so that n = 128 (x near 88) does not overflow the exponent field */
    const int32_t half = (int32_t)n >> 1;
    uint32_t b1 = (uint32_t)(half + 127) << 23, b2 = (uint32_t)((int32_t)n - half + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    return p * s1 * s2;
}
#endif

/* The decoder's elementwise steps, one pass each, with torch's roundings: RMSNorm (with the
 * residual add fused in) and the rotary embedding in place. Each row
 * (token) is computed on its own and the same way whatever the number of rows, so a token's
 * result does not depend on what else is in the batch (cache on and off agree). See
 * kvmosaic/model/kernels/__init__.py.
 *
 * In bfloat16 every step rounds where torch rounds: RMSNorm as Hugging Face's Llama does
 * (float32 statistics, the normalized row rounded to bfloat16, then times the weight and
 * rounded), RoPE as x * cos + rotate(x) * sin with each product and the sum rounded.
 *
 * Each function is a loop over rows calling a row function with the dtype as a constant, so
 * the compiler makes a vectorized copy per dtype.
 */
#include "bf16.h"

#define PARALLEL_ROWS 8 /* fewer rows than this run on the calling thread (decode) */
#define MAX_HIDDEN 8192
#define MAX_HEAD_DIM 512
#define INLINE static inline __attribute__((always_inline))

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

/* out[r] = rms_norm(x[r] (+ residual[r])) * weight. With residual non-NULL, x[r] + residual[r]
 * (rounded to the dtype) is also written back to residual[r]: the residual stream of the next
 * sublayer. x, residual, out: [rows, hidden] with row strides (in elements); weight: [hidden];
 * hidden <= MAX_HIDDEN (checked by the caller). */
void rms_norm(const void *x, int64_t x_stride, void *residual, int64_t residual_stride, const void *weight,
              void *out, int64_t out_stride, int64_t rows, int64_t hidden, float eps, int bf16, int num_threads) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        const char *xr = (const char *)x + r * x_stride * size;
        char *res = residual == NULL ? NULL : (char *)residual + r * residual_stride * size;
        char *o = (char *)out + r * out_stride * size;
        if (bf16)
            rms_norm_row(xr, res, weight, o, hidden, eps, 1);
        else
            rms_norm_row(xr, res, weight, o, hidden, eps, 0);
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

/* In place on x [tokens, heads, dim] (token stride x_stride in elements, heads contiguous):
 * x = x * cos + roll(x, dim / 2) * signed_sin, with cos / signed_sin [tokens, dim] float32 (the
 * first half of signed_sin negated, model/llama.py's RotaryEmbedding), rounded to the dtype
 * first as torch's .to(dtype) does; dim <= MAX_HEAD_DIM (checked by the caller). */
void rope(void *x, int64_t x_stride, const float *cos, const float *signed_sin, int64_t tokens, int64_t heads,
          int64_t dim, int bf16, int num_threads) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if (tokens >= PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; ++t) {
        char *xt = (char *)x + t * x_stride * size;
        if (bf16)
            rope_row(xt, cos + t * dim, signed_sin + t * dim, heads, dim, 1);
        else
            rope_row(xt, cos + t * dim, signed_sin + t * dim, heads, dim, 0);
    }
}

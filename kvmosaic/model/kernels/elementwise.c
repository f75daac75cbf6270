/* The decoder's elementwise steps, one pass each, with torch's roundings: RMSNorm (with the
 * residual add fused in) and the rotary embedding in place. Each row
 * (token) is computed on its own and the same way whatever the number of rows, so a token's
 * result does not depend on what else is in the batch (cache on and off agree). See
 * kvmosaic/model/kernels/__init__.py.
 *
 * In bfloat16 every step rounds where torch rounds: RMSNorm as Hugging Face's Llama does
 * (float32 statistics, the normalized row rounded to bfloat16, then times the weight and
 * rounded), RoPE as x * cos + rotate(x) * sin with each product and the sum rounded, SiLU(gate)
 * * up with SiLU and the product rounded (SiLU's exp is ours: see elementwise.h).
 *
 * Each function is a loop over rows calling a row function with the dtype as a constant, so
 * the compiler makes a vectorized copy per dtype.
 */
#include "elementwise.h"

#define PARALLEL_ROWS 8 /* fewer rows than this run on the calling thread (decode) */

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

/* In place on the first heads + kv_heads heads of each token's row of x (heads contiguous, dim each;
 * row stride x_stride elements): x = x * cos + roll(x, dim / 2) * signed_sin, with cos / signed_sin
 * [tokens, dim] float32 (the first half of signed_sin negated, model/llama.py's RotaryEmbedding),
 * rounded to the dtype first as torch's .to(dtype) does; dim <= MAX_HEAD_DIM (checked by the
 * caller). With slots non-NULL the rows are the fused QKV projection's (q heads, k heads, v heads):
 * each token's rotated k heads and its v heads are then copied to row slots[t] of k_pool and v_pool
 * [num_slots, kv_heads, dim], the rotation and the KV write in one pass over the rows. */
void rope_store(void *x, int64_t x_stride, const float *cos, const float *signed_sin, int64_t tokens, int64_t heads,
                int64_t kv_heads, int64_t dim, const int64_t *slots, void *k_pool, void *v_pool, int bf16,
                int num_threads) {
    const int64_t size = bf16 ? 2 : 4, kv_bytes = kv_heads * dim * size;
#pragma omp parallel for num_threads(num_threads) if (tokens >= PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; ++t) {
        char *row = (char *)x + t * x_stride * size, *k = row + heads * dim * size;
        if (bf16)
            rope_row(row, cos + t * dim, signed_sin + t * dim, heads + kv_heads, dim, 1);
        else
            rope_row(row, cos + t * dim, signed_sin + t * dim, heads + kv_heads, dim, 0);
        if (slots != NULL) {
            memcpy((char *)k_pool + slots[t] * kv_bytes, k, (size_t)kv_bytes);
            memcpy((char *)v_pool + slots[t] * kv_bytes, k + kv_bytes, (size_t)kv_bytes);
        }
    }
}

/* A stored segment's KV placed at new positions: for each layer l < layers and token t < tokens, the K row
 * at src + l * src_layer + t * row (row = kv_heads * dim elements) moved by one shift (rerotate_row with
 * cos / signed_sin [rot]) into row slots[t] of the K pool at address k_pools[l], and the V row at
 * src + l * src_layer + src_v + t * row copied to row slots[t] of v_pools[l] (pools [num_slots,
 * kv_heads, dim], contiguous). The K and V of one token at one layer: one task. */
void rerotate_store(const void *src, int64_t src_layer, int64_t src_v, int64_t layers, int64_t tokens,
                    int64_t kv_heads, int64_t dim, int64_t rot, const float *cos, const float *signed_sin,
                    const int64_t *slots, const int64_t *k_pools, const int64_t *v_pools, int bf16, int num_threads) {
    const int64_t size = bf16 ? 2 : 4, row = kv_heads * dim;
#pragma omp parallel for collapse(2) num_threads(num_threads) if (layers * tokens >= PARALLEL_ROWS)
    for (int64_t l = 0; l < layers; ++l) {
        for (int64_t t = 0; t < tokens; ++t) {
            const char *k = (const char *)src + (l * src_layer + t * row) * size;
            char *k_dst = (char *)k_pools[l] + slots[t] * row * size;
            if (bf16)
                rerotate_row(k, k_dst, cos, signed_sin, kv_heads, dim, rot, 1);
            else
                rerotate_row(k, k_dst, cos, signed_sin, kv_heads, dim, rot, 0);
            memcpy((char *)v_pools[l] + slots[t] * row * size, k + src_v * size, (size_t)(row * size));
        }
    }
}

/* act[r] = silu(gate[r]) * up[r], gate and up the two halves of x[r] (x [rows, 2 * inter], row
 * stride x_stride in elements: the fused gate/up projection's output); act [rows, inter]. */
void silu_mul(const void *x, int64_t x_stride, void *act, int64_t rows, int64_t inter, int bf16, int num_threads) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        const char *gate = (const char *)x + r * x_stride * size, *up = gate + inter * size;
        char *out = (char *)act + r * inter * size;
        if (bf16)
            silu_mul_row(gate, up, out, inter, 1);
        else
            silu_mul_row(gate, up, out, inter, 0);
    }
}

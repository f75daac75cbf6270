/* A decode step of a Llama-family decoder in one parallel region: every layer's RMSNorms, the
 * Q/K/V, output, gate/up and down projections, RoPE, the KV write and the paged attention, for a
 * batch of one-token sequences, with no return to Python and no thread fork between operators.
 * At decode on a CPU the weights stream from memory once per step and everything else is small:
 * what separates a step from the memory-bandwidth floor is the ~20 operator calls per layer
 * (dispatch, a thread-pool wake-up each), not arithmetic. See kvmosaic/model/fused_decode.py
 * and docs/ARCHITECTURE.md ("The fused decode step").
 *
 * Numerics are the layer-by-layer path's (model/llama.py in bfloat16), rounding where it rounds:
 * RMSNorm and RoPE are the same row functions (elementwise.h), attention the same kernel
 * (paged_decode.h); a projection sums its bfloat16 products in float32 (VDPBF16PS, products
 * exact) and rounds to bfloat16 as oneDNN does, in another summation order; SiLU is
 * x / (1 + exp(-x)) in float32, rounded, and the product with up rounded, as torch computes them.
 *
 * Every (row, channel) dot product runs the same instructions in the same order whatever the
 * batch (rows are tiled, weights read once per tile): a sequence's result does not depend on
 * the other sequences of the step, for any batch size.
 */
#include <omp.h>
#include <stdlib.h>

#include "elementwise.h"
#include "paged_decode.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define CHANNELS 4  /* output channels per tile: their weight rows are read once per tile */
#define ROWS 4      /* batch rows per tile */
#define PER_LAYER 8 /* pointers per layer: see decode_step */

/* out[r][c] = x_r . w_c for CHANNELS weight rows at w and nr rows of x (in % 32 == 0). */
INLINE void dot_tile(const uint16_t *w, int64_t in, const uint16_t *x, int64_t x_stride, const int nr,
                     float out[ROWS][CHANNELS]) {
    __m512 acc[ROWS][CHANNELS];
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < CHANNELS; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 32) {
        __m512bh wv[CHANNELS];
        for (int c = 0; c < CHANNELS; ++c) {
            /* the next tile's line: ~3-5% faster than the hardware prefetcher alone (measured) */
            _mm_prefetch((const char *)(w + (c + CHANNELS) * in + i), _MM_HINT_T0);
            wv[c] = (__m512bh)_mm512_loadu_si512(w + c * in + i);
        }
        for (int r = 0; r < nr; ++r) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * x_stride + i);
            for (int c = 0; c < CHANNELS; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
        }
    }
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < CHANNELS; ++c) out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

/* dot_tile with the row count a constant, so the accumulators stay in registers. */
static void dots(const uint16_t *w, int64_t in, const uint16_t *x, int64_t x_stride, int nr, float out[ROWS][CHANNELS]) {
    switch (nr) {
    case 1: dot_tile(w, in, x, x_stride, 1, out); break;
    case 2: dot_tile(w, in, x, x_stride, 2, out); break;
    case 3: dot_tile(w, in, x, x_stride, 3, out); break;
    default: dot_tile(w, in, x, x_stride, 4, out); break;
    }
}

/* y [batch, out] = bfloat16(x [batch, in] @ w [out, in]^T); channel tiles shared out among the
 * team (called inside the parallel region; ends with the team's barrier). */
static void project(const uint16_t *w, int64_t in, int64_t out, const uint16_t *x, int64_t batch, uint16_t *y) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < out / CHANNELS; ++t) {
        for (int64_t r0 = 0; r0 < batch; r0 += ROWS) {
            const int nr = batch - r0 < ROWS ? (int)(batch - r0) : ROWS;
            float o[ROWS][CHANNELS];
            dots(w + t * CHANNELS * in, in, x + r0 * in, in, nr, o);
            for (int r = 0; r < nr; ++r)
                for (int c = 0; c < CHANNELS; ++c) y[(r0 + r) * out + t * CHANNELS + c] = float_to_bf16(o[r][c]);
        }
    }
}

/* act [batch, inter] = bf16(bf16(silu(gate)) * up), gate and up the two halves of x @ w^T, each
 * rounded to bfloat16 first (w [2 * inter, in]: gate rows, then up rows). */
static void gate_up_silu(const uint16_t *w, int64_t in, int64_t inter, const uint16_t *x, int64_t batch, uint16_t *act) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < inter / CHANNELS; ++t) {
        for (int64_t r0 = 0; r0 < batch; r0 += ROWS) {
            const int nr = batch - r0 < ROWS ? (int)(batch - r0) : ROWS;
            float gate[ROWS][CHANNELS], up[ROWS][CHANNELS];
            dots(w + t * CHANNELS * in, in, x + r0 * in, in, nr, gate);
            dots(w + (inter + t * CHANNELS) * in, in, x + r0 * in, in, nr, up);
            for (int r = 0; r < nr; ++r)
                for (int c = 0; c < CHANNELS; ++c) {
                    const float g = round_bf16(gate[r][c]);
                    const float silu = round_bf16(g / (1.0f + expf(-g)));
                    act[(r0 + r) * inter + t * CHANNELS + c] = float_to_bf16(silu * round_bf16(up[r][c]));
                }
        }
    }
}

/* After a sublayer: this thread's copy of the stream, res = bf16(from + delta), h = norm(res) for
 * every row (RMSNorm with the residual add, as the torch path), and its share [lo, hi) of the
 * elements written to the shared buffer ``to`` (no barrier: see decode_step). */
static void add_and_norm(const uint16_t *delta, const uint16_t *from, uint16_t *to, uint16_t *res,
                         const uint16_t *norm, uint16_t *h, int64_t batch, int64_t hidden, float eps, int64_t lo,
                         int64_t hi) {
    memcpy(res, from, (size_t)(batch * hidden) * sizeof(uint16_t));
    for (int64_t b = 0; b < batch; ++b)
        rms_norm_row(delta + b * hidden, res + b * hidden, norm, h + b * hidden, hidden, eps, 1);
    memcpy(to + lo, res + lo, (size_t)(hi - lo) * sizeof(uint16_t));
}
#endif

/* Runs every layer over ``batch`` decode tokens and leaves the final hidden state (the last
 * sublayer's output plus the residual stream, before the final norm) in ``stream``.
 *
 * layers: num_layers * 8 pointers, per layer: qkv [(H + 2 Hkv) D, hidden], o [hidden, H D],
 * gate_up [2 inter, hidden], down [hidden, inter] (bfloat16, rows contiguous), input and
 * post-attention norm weights [hidden], the layer's K and V pools [num_slots, Hkv, D] (bfloat16);
 * stream [batch, hidden] bfloat16: the embeddings in, the final hidden state out;
 * cos, signed_sin [batch, D] float32 (model/llama.py's tables at the tokens' positions);
 * slot_mapping [batch]: where each token's K/V goes; ctx_slots [batch, max_len] and lens [batch]:
 * each sequence's context, the new token last.
 * Returns 0, -1 for shapes it does not serve, -2 without AVX512-BF16, -3 out of memory; with
 * batch 0 it only answers whether it serves the shapes. */
int decode_step(void *const *layers, int64_t num_layers, int64_t hidden, int64_t inter, int64_t heads,
                int64_t kv_heads, int64_t dim, float eps, float scale, uint16_t *stream, const float *cos,
                const float *signed_sin, const int64_t *slot_mapping, const int64_t *ctx_slots, const int64_t *lens,
                int64_t max_len, int64_t batch, int num_threads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const int64_t group = kv_heads > 0 ? heads / kv_heads : 0;
    const int64_t q_width = heads * dim, kv_width = kv_heads * dim, qkv_width = q_width + 2 * kv_width;
    if (group < 1 || heads % kv_heads || group > MAX_GROUP || dim > MAX_DIM || dim % 32 || hidden > MAX_HIDDEN
        || hidden % 32 || inter % 32 || q_width % 32 || qkv_width % CHANNELS || hidden % CHANNELS || inter % CHANNELS)
        return -1;
    if (batch == 0) return 0;
    if (num_threads < 1) num_threads = 1;
    const int64_t widest = qkv_width > inter ? qkv_width : inter, rows = batch * hidden;
    /* shared: delta, the second residual buffer, wide, attn; per thread: its residual and normed rows */
    const size_t bytes = (size_t)(2 * rows + batch * (widest + q_width) + 2 * num_threads * rows) * sizeof(uint16_t);
    uint16_t *scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (scratch == NULL) return -3;
    uint16_t *delta = scratch, *other = delta + rows, *wide = other + rows, *attn = wide + batch * widest;
    uint16_t *private_rows = attn + batch * q_width;
#pragma omp parallel num_threads(num_threads)
    {
        float q[MAX_GROUP * MAX_DIM], o[MAX_GROUP * MAX_DIM], lse[MAX_GROUP];
        const int me = omp_get_thread_num(), team = omp_get_num_threads();
        uint16_t *res = private_rows + (int64_t)me * 2 * rows, *h = res + rows;
        /* The residual stream lives in two shared buffers, read from one and written to the other
         * at each update: every thread adds the sublayer's output to the whole stream in its own
         * copy (and norms it there: no barrier), and writes back its share of the elements. The
         * buffer it writes was last read an update earlier, at least one barrier ago. */
        uint16_t *buffers[2] = {stream, other};
        int64_t updates = 0;
        const int64_t share_lo = rows * me / team, share_hi = rows * (me + 1) / team;
        for (int64_t layer = 0; layer < num_layers; ++layer) {
            void *const *p = layers + layer * PER_LAYER;
            const uint16_t *w_qkv = p[0], *w_o = p[1], *w_gate_up = p[2], *w_down = p[3], *norm1 = p[4], *norm2 = p[5];
            uint16_t *k_pool = p[6], *v_pool = p[7];
            if (layer == 0) {
                for (int64_t b = 0; b < batch; ++b)
                    rms_norm_row(stream + b * hidden, NULL, norm1, h + b * hidden, hidden, eps, 1);
            } else {
                add_and_norm(delta, buffers[updates % 2], buffers[(updates + 1) % 2], res, norm1, h, batch, hidden, eps,
                             share_lo, share_hi);
                ++updates;
            }
            project(w_qkv, hidden, qkv_width, h, batch, wide);
#pragma omp for collapse(2) schedule(dynamic, 1)
            for (int64_t b = 0; b < batch; ++b) {
                for (int64_t g = 0; g < kv_heads; ++g) {
                    /* this row's q heads of group g and its K/V head g: rotated, K/V written to the pool */
                    uint16_t *row = wide + b * qkv_width, *qb = row + g * group * dim;
                    uint16_t *k = row + q_width + g * dim, *v = k + kv_width;
                    rope_row(qb, cos + b * dim, signed_sin + b * dim, group, dim, 1);
                    rope_row(k, cos + b * dim, signed_sin + b * dim, 1, dim, 1);
                    memcpy(k_pool + slot_mapping[b] * kv_width + g * dim, k, (size_t)dim * sizeof(uint16_t));
                    memcpy(v_pool + slot_mapping[b] * kv_width + g * dim, v, (size_t)dim * sizeof(uint16_t));
                    for (int64_t i = 0; i < group * dim; ++i) q[i] = bf16_to_float(qb[i]);
                    paged_decode_head(q, k_pool, v_pool, 1, 1, ctx_slots + b * max_len, lens[b], kv_heads, dim, g,
                                      group, scale, o, lse);
                    uint16_t *out = attn + b * q_width + g * group * dim;
                    for (int64_t i = 0; i < group * dim; ++i) out[i] = float_to_bf16(o[i]);
                }
            }
            project(w_o, q_width, hidden, attn, batch, delta);
            add_and_norm(delta, buffers[updates % 2], buffers[(updates + 1) % 2], res, norm2, h, batch, hidden, eps,
                         share_lo, share_hi);
            ++updates;
            gate_up_silu(w_gate_up, hidden, inter, h, batch, wide);
            project(w_down, inter, hidden, wide, batch, delta);
        }
        const uint16_t *last = buffers[updates % 2];
        for (int64_t i = share_lo; i < share_hi; ++i)
            stream[i] = float_to_bf16(bf16_to_float(last[i]) + bf16_to_float(delta[i]));
    }
    free(scratch);
    return 0;
#else
    (void)layers, (void)num_layers, (void)hidden, (void)inter, (void)heads, (void)kv_heads, (void)dim, (void)eps;
    (void)scale, (void)stream, (void)cos, (void)signed_sin, (void)slot_mapping, (void)ctx_slots, (void)lens;
    (void)max_len, (void)batch, (void)num_threads;
    return -2;
#endif
}

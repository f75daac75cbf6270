/* Causal prefill attention over the paged pool in bfloat16, on AVX512-BF16: one prompt span's
 * queries (the last T positions of its context, or any positions in it: the tokens a blend
 * recomputes) against its context up to each query, K and V read from the pool through the
 * span's slots. torch's CPU flash kernel ran these shapes at ~10% of the
 * machine's bfloat16 GEMM peak (a third of a 750-token prefill on an AVX-512 CPU without AMX;
 * docs/ARCHITECTURE.md, "Prefill attention").
 *
 * Each KV head's context is first repacked once, for all its query heads and rows: K as
 * [16-key tiles][D/2 pairs][16 keys][2] (a VDPBF16PS lane is one key's dot product with a pair
 * of a query's dimensions), V as [key pairs][D][2] (a lane is one output dimension over a pair of
 * keys). Then every (query head, tile of ROWS query rows) runs an online softmax over passes of
 * SUPER keys: the pass's scores by VDPBF16PS in float32 (products exact), BLOCK keys at a time,
 * into an L1 buffer; the softmax in float32 with a base-2 exponential accurate to 9e-5
 * (exp2_coarse: P is then rounded to bfloat16, a relative step of 2^-8, as torch's flash kernel
 * rounds it), against each row's maximum so far; P.V by VDPBF16PS again with float32 sums, half
 * the rows at a time so that all their sums stay in registers.
 *
 * Invariants: a query row's result depends only on its own query, its position and the context
 * up to it: rows never share sums, key passes and blocks start at the context's first key whatever the
 * span's length, keys past a row's position get probability exactly 0 and a pass wholly past it scales
 * its sums by exactly 1. So a row gives the
 * same bits whether the prompt before it came from the cache or was computed in the same step,
 * and whatever else the batch holds (tests/test_prefill_attention.py).
 */
#include <omp.h>
#include <stdlib.h>

#include "prefill_softmax.h"

#ifndef ROWS_D64
#define ROWS_D64 7  /* query rows per bfloat16 tile: as many as the registers hold (measured) */
#endif
#ifndef ROWS_D128
#define ROWS_D128 4
#endif

#ifndef SUPER
#define SUPER 256 /* keys per softmax pass, a multiple of BLOCK: its scores and probabilities stay in L1 */
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* In DEFINE_TILE: P.V over a pass of width keys for rows [R0, R1) of the tile (constants, so that their sums
 * stay in registers). */
#define PV_ROWS(DV, R0, R1)                                                                                          \
    for (int64_t kp = 0; kp < width / 2; ++kp) {                                                                     \
        __m512bh vv[DV];                                                                                             \
        for (int c = 0; c < DV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v + kp * 2 * dim + c * 32);               \
        for (int r = R0; r < R1; ++r) {                                                                              \
            const __m512bh pp = broadcast_pair(probs[r] + 2 * kp);                                                  \
            for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], pp);                        \
        }                                                                                                            \
    }

/* ROWS query rows of one head (rows i0.. of the span; row r sees keys 0..last[r]) against the
 * packed context; DV = D / 16 output vectors per row. Writes bfloat16 rows of out.
 *
 * The keys go by in passes of SUPER (from the context's first key, whatever the span): the
 * pass's scores, BLOCK keys at a time into a buffer (and each row's running top); then each
 * row's probabilities from them against the row's maximum so far, rounded to bfloat16; then
 * P.V over the whole pass with the accumulators in registers. The online softmax's rescaling,
 * its horizontal reductions and the accumulators' trips to the stack happen once a pass, not
 * once a BLOCK (the rescaling had held the tile at ~2/3 of the bfloat16 GEMM's rate). */
#define DEFINE_TILE(NAME, ROWS, DV)                                                                                  \
    static void NAME(const uint16_t *const *q_rows, const int64_t *last, int nr, const uint16_t *kt,               \
                     const uint16_t *vt, float scale, uint16_t *const *out_rows) {                                  \
        const int64_t dim = DV * 16;                                                                                 \
        const __m512 unit = _mm512_set1_ps(scale * EXP_LOG2E), minus_inf = _mm512_set1_ps(-INFINITY);                \
        float scores[ROWS][SUPER] __attribute__((aligned(64)));                                                      \
        uint16_t probs[ROWS][SUPER] __attribute__((aligned(64)));                                                    \
        __m512 acc[ROWS][DV], m = minus_inf, l = _mm512_setzero_ps();                                                \
        int64_t reach = 0;                                                                                           \
        for (int r = 0; r < ROWS; ++r) {                                                                             \
            for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_setzero_ps();                                           \
            if (r < nr && last[r] + 1 > reach) reach = last[r] + 1;                                                  \
        }                                                                                                            \
        for (int64_t j0 = 0; j0 < reach; j0 += SUPER) {                                                              \
            const int64_t rest = (reach - j0 + BLOCK - 1) / BLOCK * BLOCK, width = rest < SUPER ? rest : SUPER;     \
            __m512 top[MAX_ROWS];                                                                                    \
            for (int r = 0; r < MAX_ROWS; ++r) top[r] = minus_inf;                                                   \
            for (int64_t b = 0; b < width; b += BLOCK) {                                                             \
                __m512 s[ROWS][2];                                                                                   \
                for (int r = 0; r < ROWS; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();                             \
                const uint16_t *k0 = kt + (j0 + b) * dim, *k1 = k0 + 16 * dim;                                       \
                for (int64_t p = 0; p < dim / 2; ++p) {                                                              \
                    const __m512bh ka = (__m512bh)_mm512_loadu_si512(k0 + p * 32);                                  \
                    const __m512bh kb = (__m512bh)_mm512_loadu_si512(k1 + p * 32);                                  \
                    for (int r = 0; r < ROWS; ++r) {                                                                 \
                        const __m512bh qp = broadcast_pair(q_rows[r] + 2 * p);                                      \
                        s[r][0] = _mm512_dpbf16_ps(s[r][0], ka, qp);                                                 \
                        s[r][1] = _mm512_dpbf16_ps(s[r][1], kb, qp);                                                 \
                    }                                                                                                \
                }                                                                                                    \
                for (int r = 0; r < ROWS; ++r)                                                                       \
                    for (int h = 0; h < 2; ++h) {                                                                    \
                        const int64_t seen = last[r] - (j0 + b + 16 * h) + 1; /* of these 16 keys */                \
                        const __m512 seen_s = seen >= 16 ? s[r][h] : _mm512_mask_mov_ps(minus_inf, first_lanes(seen), s[r][h]); \
                        top[r] = _mm512_max_ps(top[r], seen_s);                                                      \
                        _mm512_store_ps(scores[r] + b + 16 * h, s[r][h]);                                            \
                    }                                                                                                \
            }                                                                                                        \
            const __m512 m_new = _mm512_max_ps(m, _mm512_mul_ps(reduce_rows_max(top), unit));                        \
            /* m - m_new <= 0; -inf - finite (the first pass) clamped: a factor of ~0 on accumulators still 0 */    \
            const __m512 factor = exp2_coarse(_mm512_max_ps(_mm512_sub_ps(m, m_new), _mm512_set1_ps(-200.0f)));     \
            __m512 sum[MAX_ROWS];                                                                                    \
            for (int r = 0; r < MAX_ROWS; ++r) sum[r] = _mm512_setzero_ps();                                         \
            for (int r = 0; r < ROWS; ++r) {                                                                         \
                const __m512 mr = row_figure(m_new, r);                                                              \
                for (int64_t j = 0; j < width; j += 32) {                                                            \
                    __m512 p[2];                                                                                     \
                    for (int h = 0; h < 2; ++h) {                                                                    \
                        const int64_t seen = last[r] - (j0 + j + 16 * h) + 1;                                        \
                        p[h] = exp2_coarse(_mm512_fmsub_ps(_mm512_load_ps(scores[r] + j + 16 * h), unit, mr));      \
                        if (seen < 16) p[h] = _mm512_maskz_mov_ps(first_lanes(seen), p[h]);                          \
                    }                                                                                                \
                    sum[r] = _mm512_add_ps(sum[r], _mm512_add_ps(p[0], p[1]));                                       \
                    _mm512_store_si512(probs[r] + j, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));                      \
                }                                                                                                    \
                const __m512 corr = row_figure(factor, r);                                                           \
                for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], corr);                            \
            }                                                                                                        \
            l = _mm512_add_ps(_mm512_mul_ps(l, factor), reduce_rows_add(sum));                                       \
            m = m_new;                                                                                               \
            const uint16_t *v = vt + j0 * dim;                                                                       \
            PV_ROWS(DV, 0, (ROWS + 1) / 2)                                                                           \
            PV_ROWS(DV, (ROWS + 1) / 2, ROWS)                                                                        \
        }                                                                                                            \
        for (int r = 0; r < nr; ++r) {                                                                               \
            const __m512 inv = _mm512_set1_ps(1.0f / row_scalar(l, r));                                              \
            for (int c = 0; c < DV; ++c)                                                                             \
                _mm256_storeu_si256((__m256i *)(out_rows[r] + c * 16),                                               \
                                    _mm512_cvtepi32_epi16(float_to_bf16x16(_mm512_mul_ps(acc[r][c], inv))));        \
        }                                                                                                            \
    }

DEFINE_TILE(tile_d64, ROWS_D64, 4)
DEFINE_TILE(tile_d128, ROWS_D128, 8)
#endif

/* out [T, heads, D] = causal attention of q [T, heads, D] (heads contiguous, q_stride elements
 * from one token's to the next: q may be a view of the fused QKV projection's output) over K and
 * V at slots [ctx] of the pools [num_slots, kv_heads, D]; all bfloat16. Query i is at context position positions[i] (it sees
 * keys 0..positions[i]; each < ctx) or, with positions NULL, the span's tokens are the last T of
 * the context. Returns 0, -1 for a shape it does not serve (D other than 64 or 128, T > ctx), -2
 * without AVX512-BF16, -3 out of memory. */
int prefill_attention_amx(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *slots,
                          const int64_t *positions, int64_t ctx, int64_t num_tokens, int64_t heads, int64_t kv_heads,
                          int64_t dim, int64_t q_stride, float scale, uint16_t *out, int num_threads);

int prefill_attention(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *slots,
                      const int64_t *positions, int64_t ctx, int64_t num_tokens, int64_t heads, int64_t kv_heads,
                      int64_t dim, int64_t q_stride, float scale, uint16_t *out, int num_threads) {
    const int on_tiles = prefill_attention_amx(q, k_pool, v_pool, slots, positions, ctx, num_tokens, heads, kv_heads,
                                               dim, q_stride, scale, out, num_threads);
    if (on_tiles != -2) return on_tiles; /* AMX served it (or refused the shape, as this kernel would) */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if ((dim != 64 && dim != 128) || kv_heads < 1 || heads % kv_heads || num_tokens > ctx || num_tokens < 0) return -1;
    if (num_tokens == 0) return 0;
    const int rows = dim == 64 ? ROWS_D64 : ROWS_D128;
    const int64_t group = heads / kv_heads, past = ctx - num_tokens, ctx_pad = (ctx + BLOCK - 1) / BLOCK * BLOCK;
    const size_t per_head = (size_t)(2 * ctx_pad * dim);
    uint16_t *packed = aligned_alloc(64, (per_head * kv_heads * sizeof(uint16_t) + 63) / 64 * 64);
    if (packed == NULL) return -3;
    const int64_t tiles = (num_tokens + rows - 1) / rows;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        pack_heads(k_pool, v_pool, slots, ctx, ctx_pad, kv_heads, dim, packed, per_head);
        /* the last rows see the most keys: hand them out first */
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t t = tiles - 1; t >= 0; --t) {
            for (int64_t h = 0; h < heads; ++h) {
                const uint16_t *kt = packed + (h / group) * per_head, *vt = kt + ctx_pad * dim;
                const uint16_t *q_rows[MAX_ROWS];
                uint16_t *out_rows[MAX_ROWS];
                int64_t index[MAX_ROWS], last[MAX_ROWS];
                const int nr = tile_rows(t, rows, num_tokens, positions, past, index, last);
                for (int r = 0; r < rows; ++r) {
                    q_rows[r] = q + index[r] * q_stride + h * dim;
                    out_rows[r] = out + (index[r] * heads + h) * dim;
                }
                if (dim == 64)
                    tile_d64(q_rows, last, nr, kt, vt, scale, out_rows);
                else
                    tile_d128(q_rows, last, nr, kt, vt, scale, out_rows);
            }
        }
    }
    free(packed);
    return 0;
#else
    (void)q, (void)k_pool, (void)v_pool, (void)slots, (void)positions, (void)ctx, (void)num_tokens, (void)heads, (void)kv_heads;
    (void)dim, (void)q_stride, (void)scale, (void)out, (void)num_threads;
    return -2;
#endif
}

#if defined(__AVX512F__)
/* float32: K of head g as [ctx_pad/16][D][16] (a lane is one key), V gathered as [ctx_pad][D];
 * zeros past ctx. */
static void pack_f32(const float *k_pool, const float *v_pool, const int64_t *slots, int64_t ctx, int64_t ctx_pad,
                     int64_t kv_heads, int64_t g, int64_t dim, float *kt, float *v) {
    for (int64_t j = 0; j < ctx_pad; ++j) {
        const float *krow = j < ctx ? k_pool + (slots[j] * kv_heads + g) * dim : NULL;
        const float *vrow = j < ctx ? v_pool + (slots[j] * kv_heads + g) * dim : NULL;
        float *tile = kt + (j / 16) * 16 * dim + j % 16;
        for (int64_t d = 0; d < dim; ++d) tile[d * 16] = krow ? krow[d] : 0.0f;
        if (vrow) memcpy(v + j * dim, vrow, (size_t)dim * sizeof(float));
        else memset(v + j * dim, 0, (size_t)dim * sizeof(float));
    }
}

/* The float32 tile: as DEFINE_TILE, scores and P.V by FMA, P kept in float32 (torch's float32
 * flash kernel does not round it). */
#define DEFINE_TILE_F32(NAME, ROWS, DV)                                                                              \
    static void NAME(const float *const *q_rows, const int64_t *last, int nr, const float *kt, const float *vv,     \
                     float scale, float *const *out_rows) {                                                          \
        const int64_t dim = DV * 16;                                                                                 \
        __m512 acc[ROWS][DV], m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();                                \
        int64_t reach = 0;                                                                                           \
        for (int r = 0; r < ROWS; ++r) {                                                                             \
            for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_setzero_ps();                                           \
            if (r < nr && last[r] + 1 > reach) reach = last[r] + 1;                                                  \
        }                                                                                                            \
        for (int64_t j0 = 0; j0 < reach; j0 += BLOCK) {                                                              \
            __m512 s[ROWS][2];                                                                                       \
            for (int r = 0; r < ROWS; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();                                 \
            const float *k0 = kt + j0 * dim, *k1 = k0 + 16 * dim;                                                    \
            for (int64_t d = 0; d < dim; ++d) {                                                                      \
                const __m512 a = _mm512_loadu_ps(k0 + d * 16), b = _mm512_loadu_ps(k1 + d * 16);                     \
                for (int r = 0; r < ROWS; ++r) {                                                                     \
                    const __m512 qd = _mm512_set1_ps(q_rows[r][d]);                                                  \
                    s[r][0] = _mm512_fmadd_ps(a, qd, s[r][0]);                                                       \
                    s[r][1] = _mm512_fmadd_ps(b, qd, s[r][1]);                                                       \
                }                                                                                                    \
            }                                                                                                        \
            float probs[ROWS][BLOCK] __attribute__((aligned(64)));                                                   \
            __m512 corr[ROWS];                                                                                       \
            softmax_rows(s, ROWS, last, j0, scale, 0, &m, &l, corr);                                                 \
            for (int r = 0; r < ROWS; ++r) {                                                                         \
                for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], corr[r]);                         \
                _mm512_store_ps(probs[r], s[r][0]);                                                                  \
                _mm512_store_ps(probs[r] + 16, s[r][1]);                                                             \
            }                                                                                                        \
            for (int j = 0; j < BLOCK; ++j) {                                                                        \
                __m512 v[DV];                                                                                        \
                for (int c = 0; c < DV; ++c) v[c] = _mm512_loadu_ps(vv + (j0 + j) * dim + c * 16);                   \
                for (int r = 0; r < ROWS; ++r) {                                                                     \
                    const __m512 p = _mm512_set1_ps(probs[r][j]);                                                    \
                    for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_fmadd_ps(v[c], p, acc[r][c]);                   \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < nr; ++r) {                                                                               \
            const __m512 inv = _mm512_set1_ps(1.0f / row_scalar(l, r));                                                          \
            for (int c = 0; c < DV; ++c) _mm512_storeu_ps(out_rows[r] + c * 16, _mm512_mul_ps(acc[r][c], inv));      \
        }                                                                                                            \
    }

DEFINE_TILE_F32(tile_f32_d64, 6, 4)
DEFINE_TILE_F32(tile_f32_d128, 3, 8)
#endif

int prefill_attention_f32_avx2(const float *q, const float *k_pool, const float *v_pool, const int64_t *slots,
                               const int64_t *positions, int64_t ctx, int64_t num_tokens, int64_t heads,
                               int64_t kv_heads, int64_t dim, int64_t q_stride, float scale, float *out, int num_threads);

/* prefill_attention in float32 (AVX-512; on AVX2 with FMA prefill_attention_avx2.c's): the same
 * contract, P not rounded. */
int prefill_attention_f32(const float *q, const float *k_pool, const float *v_pool, const int64_t *slots,
                          const int64_t *positions, int64_t ctx, int64_t num_tokens, int64_t heads, int64_t kv_heads,
                          int64_t dim, int64_t q_stride, float scale, float *out, int num_threads) {
#if defined(__AVX512F__)
    if ((dim != 64 && dim != 128) || kv_heads < 1 || heads % kv_heads || num_tokens > ctx || num_tokens < 0) return -1;
    if (num_tokens == 0) return 0;
    const int rows = dim == 64 ? 6 : 3;
    const int64_t group = heads / kv_heads, past = ctx - num_tokens, ctx_pad = (ctx + BLOCK - 1) / BLOCK * BLOCK;
    const size_t per_head = (size_t)(2 * ctx_pad * dim);
    float *packed = aligned_alloc(64, (per_head * kv_heads * sizeof(float) + 63) / 64 * 64);
    if (packed == NULL) return -3;
    const int64_t tiles = (num_tokens + rows - 1) / rows;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < kv_heads; ++g)
            pack_f32(k_pool, v_pool, slots, ctx, ctx_pad, kv_heads, g, dim, packed + g * per_head,
                     packed + g * per_head + ctx_pad * dim);
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t t = tiles - 1; t >= 0; --t) {
            for (int64_t h = 0; h < heads; ++h) {
                const float *kt = packed + (h / group) * per_head, *vv = kt + ctx_pad * dim;
                const float *q_rows[MAX_ROWS];
                float *out_rows[MAX_ROWS];
                int64_t index[MAX_ROWS], last[MAX_ROWS];
                const int nr = tile_rows(t, rows, num_tokens, positions, past, index, last);
                for (int r = 0; r < rows; ++r) {
                    q_rows[r] = q + index[r] * q_stride + h * dim;
                    out_rows[r] = out + (index[r] * heads + h) * dim;
                }
                if (dim == 64)
                    tile_f32_d64(q_rows, last, nr, kt, vv, scale, out_rows);
                else
                    tile_f32_d128(q_rows, last, nr, kt, vv, scale, out_rows);
            }
        }
    }
    free(packed);
    return 0;
#elif defined(__AVX2__) && defined(__FMA__)
    return prefill_attention_f32_avx2(q, k_pool, v_pool, slots, positions, ctx, num_tokens, heads, kv_heads, dim,
                                      q_stride, scale, out, num_threads);
#else
    (void)q, (void)k_pool, (void)v_pool, (void)slots, (void)positions, (void)ctx, (void)num_tokens, (void)heads, (void)kv_heads;
    (void)dim, (void)q_stride, (void)scale, (void)out, (void)num_threads;
    return -2;
#endif
}

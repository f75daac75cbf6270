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
 * keys). Then every (query head, tile of ROWS query rows) runs an online softmax over blocks of
 * BLOCK keys: scores by VDPBF16PS in float32 (products exact), softmax in float32 with a base-2
 * exponential accurate to 4e-6 (exp2_coarse: P is then rounded to bfloat16, a relative step of
 * 2^-8, as torch's flash kernel rounds it), P.V by VDPBF16PS again with float32 sums.
 *
 * Invariants: a query row's result depends only on its own query, its position and the context
 * up to it: rows never share sums, key blocks start at the context's first key whatever the
 * span's length, and keys past a row's position get probability exactly 0. So a row gives the
 * same bits whether the prompt before it came from the cache or was computed in the same step,
 * and whatever else the batch holds (tests/test_prefill_attention.py).
 */
#include <omp.h>
#include <stdlib.h>

#include "bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#define BLOCK 32    /* keys per online-softmax step: two 16-lane score vectors per row */
#define ROWS_D64 7  /* query rows per bfloat16 tile: as many as the registers hold (measured) */
#define ROWS_D128 4

/* The lane that holds row r (< MAX_ROWS) in a vector of per-row figures from reduce_rows_*: the
 * reduction tree leaves row k in lanes 4k, 4k+1 and row k+4 in lanes 4k+2, 4k+3. */
#define MAX_ROWS 8
static inline __m512 row_figure(__m512 per_row, int r) {
    return _mm512_permutexvar_ps(_mm512_set1_epi32(r < 4 ? 4 * r : 4 * (r - 4) + 2), per_row);
}

/* The horizontal max / sum of each of 8 vectors at once (lane layout as row_figure reads it).
 * Each lane only ever combines values of one row, in a tree that is the same for every row: a
 * row's figure does not depend on the other rows, nor on its place among them. */
#define DEFINE_REDUCE_ROWS(NAME, OP)                                                                  \
    static inline __m512 NAME(const __m512 v[MAX_ROWS]) {                                             \
        __m512 t[4], u[2];                                                                            \
        for (int i = 0; i < 4; ++i) /* quarters 0, 1: row 2i's halves folded; 2, 3: row 2i+1's */      \
            t[i] = OP(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),                             \
                      _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));                            \
        for (int i = 0; i < 2; ++i) /* quarter k: row 4i+k's four partial lanes */                    \
            u[i] = OP(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),                             \
                      _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));                            \
        const __m512 w = OP(_mm512_shuffle_ps(u[0], u[1], 0x44), _mm512_shuffle_ps(u[0], u[1], 0xEE)); \
        return OP(w, _mm512_permute_ps(w, 0xB1));                                                     \
    }
DEFINE_REDUCE_ROWS(reduce_rows_max, _mm512_max_ps)
DEFINE_REDUCE_ROWS(reduce_rows_add, _mm512_add_ps)

/* 2^t on 16 lanes, to 4e-6 relative (a degree-4 fit on [-1/2, 1/2] after taking out the nearest
 * integer); t below -150 gives 0, large t +inf. For probabilities that are rounded to bfloat16
 * (relative step 2^-8) before P.V: a third of exp16_clamped's instructions. */
static inline __m512 exp2_coarse(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.6721810036e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5922119334e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022228004e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312102353e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One online-softmax step of ``rows`` (<= MAX_ROWS) query rows over a BLOCK-key block: s[r][0]
 * (keys 0-15) and s[r][1] (16-31) hold row r's raw scores and are replaced by its probabilities
 * exp(score * scale - max), exactly 0 for keys past the row's position ``last[r]``. The rows'
 * running maxima (of score * unit) and sums live in *m and *l (lane layout of row_figure); corr[r]
 * gets the factor row r's accumulator must be scaled by (exactly 1 when the block is wholly past
 * the row: max and sum unchanged). The rows go through the reductions together, so their
 * horizontal steps share instructions.
 *
 * coarse (a constant: the bfloat16 tiles, whose probabilities are rounded to bfloat16): the
 * exponents in base 2, score * scale * log2(e) - max in one fused multiply-subtract, by
 * exp2_coarse; else (float32) score * scale rounded, minus the max, by exp16_clamped, as torch's
 * float32 kernel computes them. The maxima are taken over the raw scores and then scaled: rounding
 * is monotonic, so that is the maximum of the scaled scores. */
static inline void softmax_rows(__m512 s[][2], int rows, const int64_t *last, int64_t j0, float scale, const int coarse,
                                __m512 *m, __m512 *l, __m512 *corr) {
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY), unit = _mm512_set1_ps(coarse ? scale * EXP_LOG2E : scale);
    __mmask16 lo[MAX_ROWS], hi[MAX_ROWS];
    __m512 top[MAX_ROWS], sum[MAX_ROWS];
    int64_t seen = last[0];
    for (int r = 1; r < rows; ++r) seen = last[r] < seen ? last[r] : seen;
    const int whole = j0 + BLOCK <= seen + 1; /* every row sees every key of the block */
    for (int r = 0; r < MAX_ROWS; ++r) {
        top[r] = minus_inf, sum[r] = _mm512_setzero_ps();
        if (r >= rows) continue;
        if (whole) {
            lo[r] = hi[r] = 0xffff;
            top[r] = _mm512_max_ps(s[r][0], s[r][1]);
            continue;
        }
        const int64_t visible = last[r] - j0 + 1;
        lo[r] = first_lanes(visible), hi[r] = first_lanes(visible - 16);
        top[r] = _mm512_max_ps(_mm512_mask_mov_ps(minus_inf, lo[r], s[r][0]),
                               _mm512_mask_mov_ps(minus_inf, hi[r], s[r][1]));
    }
    const __m512 m_new = _mm512_max_ps(*m, _mm512_mul_ps(reduce_rows_max(top), unit));
    /* m - m_new <= 0; -inf - finite (a row's first block) is clamped: a factor of ~0 on an
     * accumulator that is still 0 */
    const __m512 factor = coarse ? exp2_coarse(_mm512_max_ps(_mm512_sub_ps(*m, m_new), _mm512_set1_ps(-200.0f)))
                                 : exp16_clamped(_mm512_sub_ps(*m, m_new));
    for (int r = 0; r < rows; ++r) {
        const __m512 mr = row_figure(m_new, r);
        for (int h = 0; h < 2; ++h) {
            const __m512 p = coarse ? exp2_coarse(_mm512_fmsub_ps(s[r][h], unit, mr))
                                    : exp16_clamped(_mm512_sub_ps(_mm512_mul_ps(s[r][h], unit), mr));
            s[r][h] = whole ? p : _mm512_maskz_mov_ps(h ? hi[r] : lo[r], p);
        }
        sum[r] = _mm512_add_ps(s[r][0], s[r][1]);
        corr[r] = row_figure(factor, r);
    }
    *l = _mm512_add_ps(_mm512_mul_ps(*l, factor), reduce_rows_add(sum));
    *m = m_new;
}

/* Row tile t of a span (``rows`` per tile): each row's query index (rows past the span repeat
 * its first row, computed and not written) and the last key it sees (``positions[i]``, or with
 * positions NULL its place among the context's last tokens, past + i). Returns the real rows. */
static inline int tile_rows(int64_t t, int rows, int64_t num_tokens, const int64_t *positions, int64_t past,
                            int64_t index[MAX_ROWS], int64_t last[MAX_ROWS]) {
    const int64_t i0 = t * rows;
    const int nr = num_tokens - i0 < rows ? (int)(num_tokens - i0) : rows;
    for (int r = 0; r < rows; ++r) {
        index[r] = r < nr ? i0 + r : i0;
        last[r] = positions != NULL ? positions[index[r]] : past + index[r];
    }
    return nr;
}

/* Row r's figure from a vector in row_figure's layout. */
static inline float row_scalar(__m512 per_row, int r) {
    return _mm512_cvtss_f32(row_figure(per_row, r));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
static inline __m512bh broadcast_pair(const uint16_t *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

/* K [ctx, kv_heads, D] of head g, through slots, as [ctx_pad/16][D/2][16][2]; zeros past ctx. */
static void pack_k(const uint16_t *pool, const int64_t *slots, int64_t ctx, int64_t ctx_pad, int64_t kv_heads,
                   int64_t g, int64_t dim, uint16_t *kt) {
    for (int64_t j = 0; j < ctx_pad; ++j) {
        const uint16_t *row = j < ctx ? pool + (slots[j] * kv_heads + g) * dim : NULL;
        uint16_t *tile = kt + (j / 16) * 16 * dim + (j % 16) * 2;
        for (int64_t p = 0; p < dim / 2; ++p) {
            tile[p * 32] = row ? row[2 * p] : 0;
            tile[p * 32 + 1] = row ? row[2 * p + 1] : 0;
        }
    }
}

/* V [ctx, kv_heads, D] of head g as [ctx_pad/2][D][2]; zeros past ctx. */
static void pack_v(const uint16_t *pool, const int64_t *slots, int64_t ctx, int64_t ctx_pad, int64_t kv_heads,
                   int64_t g, int64_t dim, uint16_t *vt) {
    for (int64_t j = 0; j < ctx_pad; ++j) {
        const uint16_t *row = j < ctx ? pool + (slots[j] * kv_heads + g) * dim : NULL;
        uint16_t *pair = vt + (j / 2) * 2 * dim + (j % 2);
        for (int64_t d = 0; d < dim; ++d) pair[2 * d] = row ? row[d] : 0;
    }
}

/* ROWS query rows of one head (rows i0.. of the span; row r sees keys 0..last[r]) against the
 * packed context; DV = D / 16 output vectors per row. Writes bfloat16 rows of out. */
#define DEFINE_TILE(NAME, ROWS, DV)                                                                                  \
    static void NAME(const uint16_t *const *q_rows, const int64_t *last, int nr, const uint16_t *kt,               \
                     const uint16_t *vt, float scale, uint16_t *const *out_rows) {                                  \
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
            const uint16_t *k0 = kt + j0 * dim, *k1 = k0 + 16 * dim;                                                 \
            for (int64_t p = 0; p < dim / 2; ++p) {                                                                  \
                const __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + p * 32);                                       \
                const __m512bh b = (__m512bh)_mm512_loadu_si512(k1 + p * 32);                                       \
                for (int r = 0; r < ROWS; ++r) {                                                                     \
                    const __m512bh qp = broadcast_pair(q_rows[r] + 2 * p);                                          \
                    s[r][0] = _mm512_dpbf16_ps(s[r][0], a, qp);                                                      \
                    s[r][1] = _mm512_dpbf16_ps(s[r][1], b, qp);                                                      \
                }                                                                                                    \
            }                                                                                                        \
            uint16_t probs[ROWS][BLOCK] __attribute__((aligned(64)));                                                \
            __m512 corr[ROWS];                                                                                       \
            softmax_rows(s, ROWS, last, j0, scale, 1, &m, &l, corr);                                                 \
            for (int r = 0; r < ROWS; ++r) {                                                                         \
                for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], corr[r]);                         \
                _mm512_store_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(s[r][1], s[r][0]));                        \
            }                                                                                                        \
            const uint16_t *v = vt + j0 * dim;                                                                       \
            for (int kp = 0; kp < BLOCK / 2; ++kp) {                                                                 \
                __m512bh vv[DV];                                                                                     \
                for (int c = 0; c < DV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v + kp * 2 * dim + c * 32);       \
                for (int r = 0; r < ROWS; ++r) {                                                                     \
                    const __m512bh pp = broadcast_pair(probs[r] + 2 * kp);                                          \
                    for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], pp);                \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < nr; ++r) {                                                                               \
            const __m512 inv = _mm512_set1_ps(1.0f / row_scalar(l, r));                                                          \
            for (int c = 0; c < DV; ++c) {                                                                           \
                float o[16];                                                                                         \
                _mm512_storeu_ps(o, _mm512_mul_ps(acc[r][c], inv));                                                  \
                for (int i = 0; i < 16; ++i) out_rows[r][c * 16 + i] = float_to_bf16(o[i]);                          \
            }                                                                                                        \
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
int prefill_attention(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *slots,
                      const int64_t *positions, int64_t ctx, int64_t num_tokens, int64_t heads, int64_t kv_heads,
                      int64_t dim, int64_t q_stride, float scale, uint16_t *out, int num_threads) {
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
#pragma omp for schedule(static)
        for (int64_t item = 0; item < 2 * kv_heads; ++item) {
            const int64_t g = item / 2;
            uint16_t *kt = packed + g * per_head, *vt = kt + ctx_pad * dim;
            if (item % 2 == 0)
                pack_k(k_pool, slots, ctx, ctx_pad, kv_heads, g, dim, kt);
            else
                pack_v(v_pool, slots, ctx, ctx_pad, kv_heads, g, dim, vt);
        }
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

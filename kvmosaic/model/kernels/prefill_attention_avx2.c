/* Causal prefill attention in float32 on CPUs with AVX2 and FMA but no AVX-512: what
 * prefill_attention_f32 (prefill_attention.c) calls there, with its contract and invariants, on
 * 8-lane vectors and 16 registers. On an AVX2 AMD EPYC (Zen 3) torch's float32 flash kernel ran
 * the shipped model's 745-token prefill at 7-26 GFLOP/s a layer, this kernel at ~100-110 (two threads;
 * docs/ARCHITECTURE.md, "Prefill attention").
 *
 * Each KV head's context is repacked once for all its query heads: K as [8-key tiles][D][8] (a
 * lane is one key), V as [ctx_pad][D]. A tile of ROWS query rows then runs an online softmax
 * over blocks of BLOCK keys: the rows' scores by FMA (the K vector loaded once for all rows), the
 * softmax's reductions and rescaling factors for the rows together, and P.V in passes of CHUNK output dimensions whose accumulators stay in
 * registers for the block (16 ymm registers do not hold a row's 64 accumulators, let alone
 * six rows'), P kept in float32 as torch's float32 flash kernel keeps it.
 *
 * Invariants, as in prefill_attention.c: a query row's result depends only on its own query, its
 * position and the context up to it. Every row runs the same operations in the same order over
 * blocks that start at the context's first key; keys past a row's position get probability
 * exactly 0 and a block wholly past it leaves the row's max, sum and accumulators exactly as
 * they were (factor exp(0) = 1, products 0), so its tile-mates' reach does not change its bits.
 */
#include <omp.h>
#include <stdlib.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define LANES 8
#define BLOCK 16   /* keys per online-softmax step: two 8-lane score vectors per row */
#define ROWS 6     /* query rows per tile (<= 8): 12 score registers, 2 for K, 1 for the broadcast
                    * query element; the scores go to memory for the softmax, which would spill them.
                    * 745 tokens, two threads: 8.1 ms with 4 rows, 5.7-6.3 ms with 6 (measured) */
#define CHUNK 16   /* output dimensions per P.V pass: ROWS x 2 accumulators in registers */
#define MAX_DIM 128

/* exp_clamped (bf16.h) on 8 lanes: the same operations, bit for bit, 2^n in two halves too. */
static inline __m256 exp8_clamped(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x));
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* The horizontal max / sum of each of 4 vectors, row r's in lane r (lanes 4-7 repeat them).
 * Each lane only combines values of one row, in a tree that is the same for every row: a row's
 * figure does not depend on the other rows, nor on its place among them. */
#define DEFINE_REDUCE_ROWS(NAME, OP)                                                          \
    static inline __m256 NAME(const __m256 v[4]) {                                            \
        const __m256 u0 = OP(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1])); \
        const __m256 u1 = OP(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3])); \
        const __m256 w = OP(_mm256_shuffle_ps(u0, u1, 0x44), _mm256_shuffle_ps(u0, u1, 0xEE)); \
        return OP(w, _mm256_permute2f128_ps(w, w, 0x01));                                     \
    }
DEFINE_REDUCE_ROWS(reduce_rows_max, _mm256_max_ps)
DEFINE_REDUCE_ROWS(reduce_rows_add, _mm256_add_ps)

/* K of head g as [ctx_pad/8][D][8], V as [ctx_pad][D]; zeros past ctx. */
static void pack(const float *k_pool, const float *v_pool, const int64_t *slots, int64_t ctx, int64_t ctx_pad,
                 int64_t kv_heads, int64_t g, int64_t dim, float *kt, float *v) {
    for (int64_t j = 0; j < ctx_pad; ++j) {
        const float *krow = j < ctx ? k_pool + (slots[j] * kv_heads + g) * dim : NULL;
        const float *vrow = j < ctx ? v_pool + (slots[j] * kv_heads + g) * dim : NULL;
        float *tile = kt + (j / LANES) * LANES * dim + j % LANES;
        for (int64_t d = 0; d < dim; ++d) tile[d * LANES] = krow ? krow[d] : 0.0f;
        if (vrow) memcpy(v + j * dim, vrow, (size_t)dim * sizeof(float));
        else memset(v + j * dim, 0, (size_t)dim * sizeof(float));
    }
}

/* One online-softmax step of the tile's rows over a BLOCK-key block: probs[r] holds row r's raw
 * scores (keys j0..j0+15) and gets exp(score * scale - new max) in their place, exactly 0 for
 * keys past the row's position last[r]; *m, *l hold the rows' running maxima and sums (row r in
 * lane r), corr[r] the factor row r's accumulators must be scaled by (exactly 1 where the block is
 * wholly past the row). The rows' reductions and factors go through the same instructions
 * together. */
static inline void softmax_rows(const int64_t *last, int64_t j0, float scale, __m256 *m,
                                __m256 *l, float probs[ROWS][BLOCK], float corr[ROWS], const int masked) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY), scales = _mm256_set1_ps(scale);
    __m256 lo[ROWS], hi[ROWS], top[8], sum[8];
    for (int r = ROWS; r < 8; ++r) top[r] = minus_inf, sum[r] = _mm256_setzero_ps();
    __m256 s[ROWS][2];
    for (int r = 0; r < ROWS; ++r) {
        s[r][0] = _mm256_mul_ps(_mm256_load_ps(probs[r]), scales);
        s[r][1] = _mm256_mul_ps(_mm256_load_ps(probs[r] + LANES), scales);
        if (masked) { /* all ones where the block is wholly visible: the same bits as unmasked */
            const int64_t visible = last[r] - j0 + 1;
            const int32_t seen = visible < 0 ? 0 : visible > BLOCK ? BLOCK : (int32_t)visible;
            lo[r] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(seen), lanes));
            hi[r] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(seen - LANES), lanes));
            top[r] = _mm256_max_ps(_mm256_blendv_ps(minus_inf, s[r][0], lo[r]), _mm256_blendv_ps(minus_inf, s[r][1], hi[r]));
        } else {
            top[r] = _mm256_max_ps(s[r][0], s[r][1]);
        }
    }
    const __m256 m_new = _mm256_max_ps(*m, _mm256_blend_ps(reduce_rows_max(top), reduce_rows_max(top + 4), 0xF0));
    /* m - m_new <= 0; -inf - finite (a row's first block) clamps to -87: a factor of ~1e-38 on
     * accumulators that are still 0 */
    const __m256 factor = exp8_clamped(_mm256_sub_ps(*m, m_new));
    float row_max[LANES] __attribute__((aligned(32)));
    _mm256_store_ps(row_max, m_new);
    for (int r = 0; r < ROWS; ++r) {
        const __m256 mr = _mm256_broadcast_ss(row_max + r);
        __m256 pa = exp8_clamped(_mm256_sub_ps(s[r][0], mr)), pb = exp8_clamped(_mm256_sub_ps(s[r][1], mr));
        if (masked) pa = _mm256_and_ps(lo[r], pa), pb = _mm256_and_ps(hi[r], pb);
        _mm256_store_ps(probs[r], pa);
        _mm256_store_ps(probs[r] + LANES, pb);
        sum[r] = _mm256_add_ps(pa, pb);
    }
    *l = _mm256_add_ps(_mm256_mul_ps(*l, factor), _mm256_blend_ps(reduce_rows_add(sum), reduce_rows_add(sum + 4), 0xF0));
    *m = m_new;
    float factors[LANES] __attribute__((aligned(32)));
    _mm256_store_ps(factors, factor);
    for (int r = 0; r < ROWS; ++r) corr[r] = factors[r];
}

/* ROWS query rows (nr of them real: the rest repeat row 0 and are not written) of one head. */
static void tile(const float *const *q_rows, const int64_t *last, int nr, int64_t dim, const float *kt,
                 const float *vv, float scale, float *const *out_rows) {
    float acc[ROWS][MAX_DIM] __attribute__((aligned(32))) = {{0}};
    __m256 m = _mm256_set1_ps(-INFINITY), l = _mm256_setzero_ps();
    int64_t reach = 0, seen_by_all = INT64_MAX; /* keys [0, seen_by_all) are visible to every row */
    for (int r = 0; r < ROWS; ++r) {
        if (last[r] + 1 > reach) reach = last[r] + 1;
        if (last[r] + 1 < seen_by_all) seen_by_all = last[r] + 1;
    }
    for (int64_t j0 = 0; j0 < reach; j0 += BLOCK) {
        __m256 s[ROWS][2];
        for (int r = 0; r < ROWS; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
        const float *k0 = kt + j0 * dim, *k1 = k0 + LANES * dim;
        for (int64_t d = 0; d < dim; ++d) {
            const __m256 a = _mm256_load_ps(k0 + d * LANES), b = _mm256_load_ps(k1 + d * LANES);
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; ++r) {
                const __m256 qd = _mm256_broadcast_ss(q_rows[r] + d);
                s[r][0] = _mm256_fmadd_ps(a, qd, s[r][0]);
                s[r][1] = _mm256_fmadd_ps(b, qd, s[r][1]);
            }
        }
        float probs[ROWS][BLOCK] __attribute__((aligned(32))), corr[ROWS];
        for (int r = 0; r < ROWS; ++r) {
            _mm256_store_ps(probs[r], s[r][0]);
            _mm256_store_ps(probs[r] + LANES, s[r][1]);
        }
        if (j0 + BLOCK <= seen_by_all)
            softmax_rows(last, j0, scale, &m, &l, probs, corr, 0);
        else
            softmax_rows(last, j0, scale, &m, &l, probs, corr, 1);
        for (int64_t c0 = 0; c0 < dim; c0 += CHUNK) {
            __m256 o[ROWS][2];
            for (int r = 0; r < ROWS; ++r) {
                const __m256 f = _mm256_set1_ps(corr[r]);
                o[r][0] = _mm256_mul_ps(_mm256_load_ps(acc[r] + c0), f);
                o[r][1] = _mm256_mul_ps(_mm256_load_ps(acc[r] + c0 + LANES), f);
            }
            for (int j = 0; j < BLOCK; ++j) {
                const float *vrow = vv + (j0 + j) * dim + c0;
                const __m256 v0 = _mm256_loadu_ps(vrow), v1 = _mm256_loadu_ps(vrow + LANES);
#pragma GCC unroll 8
                for (int r = 0; r < ROWS; ++r) {
                    const __m256 p = _mm256_broadcast_ss(probs[r] + j);
                    o[r][0] = _mm256_fmadd_ps(v0, p, o[r][0]);
                    o[r][1] = _mm256_fmadd_ps(v1, p, o[r][1]);
                }
            }
            for (int r = 0; r < ROWS; ++r) {
                _mm256_store_ps(acc[r] + c0, o[r][0]);
                _mm256_store_ps(acc[r] + c0 + LANES, o[r][1]);
            }
        }
    }
    float sums[LANES] __attribute__((aligned(32)));
    _mm256_store_ps(sums, l);
    for (int r = 0; r < nr; ++r) {
        const __m256 inv = _mm256_set1_ps(1.0f / sums[r]);
        for (int64_t c = 0; c < dim; c += LANES)
            _mm256_storeu_ps(out_rows[r] + c, _mm256_mul_ps(_mm256_load_ps(acc[r] + c), inv));
    }
}

int prefill_attention_f32_avx2(const float *q, const float *k_pool, const float *v_pool, const int64_t *slots,
                               const int64_t *positions, int64_t ctx, int64_t num_tokens, int64_t heads,
                               int64_t kv_heads, int64_t dim, int64_t q_stride, float scale, float *out, int num_threads) {
    if ((dim != 64 && dim != 128) || kv_heads < 1 || heads % kv_heads || num_tokens > ctx || num_tokens < 0) return -1;
    if (num_tokens == 0) return 0;
    const int64_t group = heads / kv_heads, past = ctx - num_tokens, ctx_pad = (ctx + BLOCK - 1) / BLOCK * BLOCK;
    const size_t per_head = (size_t)(2 * ctx_pad * dim);
    float *packed = aligned_alloc(64, (per_head * kv_heads * sizeof(float) + 63) / 64 * 64);
    if (packed == NULL) return -3;
    const int64_t tiles = (num_tokens + ROWS - 1) / ROWS;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < kv_heads; ++g)
            pack(k_pool, v_pool, slots, ctx, ctx_pad, kv_heads, g, dim, packed + g * per_head,
                 packed + g * per_head + ctx_pad * dim);
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t t = tiles - 1; t >= 0; --t) {
            for (int64_t h = 0; h < heads; ++h) {
                const float *kt = packed + (h / group) * per_head, *vv = kt + ctx_pad * dim;
                const float *q_rows[ROWS];
                float *out_rows[ROWS];
                int64_t last[ROWS];
                const int64_t i0 = t * ROWS;
                const int nr = num_tokens - i0 < ROWS ? (int)(num_tokens - i0) : ROWS;
                for (int r = 0; r < ROWS; ++r) {
                    const int64_t index = r < nr ? i0 + r : i0;
                    last[r] = positions != NULL ? positions[index] : past + index;
                    q_rows[r] = q + index * q_stride + h * dim;
                    out_rows[r] = out + (index * heads + h) * dim;
                }
                tile(q_rows, last, nr, dim, kt, vv, scale, out_rows);
            }
        }
    }
    free(packed);
    return 0;
}
#endif

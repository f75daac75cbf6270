/* The online softmax and the packed K / V layouts shared by the prefill attention kernels
 * (prefill_attention.c: AVX512-BF16 and float32 tiles; prefill_attention_amx.c: AMX tiles). A query row's
 * figures go through the same operations whatever tile or rows it shares them with. */
#ifndef KVMOSAIC_PREFILL_SOFTMAX_H
#define KVMOSAIC_PREFILL_SOFTMAX_H

#include "bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#define BLOCK 32    /* keys per online-softmax step: two 16-lane score vectors per row */

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

/* 2^t on 16 lanes, to 9e-5 relative: t's fraction above floor(t) by VREDUCEPS, a degree-3 fit of 2^f on [0, 1)
 * (constant term 1: exactly 1 at t = 0), scaled by 2^floor(t) by VSCALEFPS; t below -150 gives 0, large t +inf.
 * For probabilities that are rounded to bfloat16 (relative step 2^-8) before P.V: a quarter of exp16_clamped's
 * instructions. */
static inline __m512 exp2_coarse(__m512 t) {
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(7.7065203e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.2764700e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9511634e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, t);
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
/* Transposes 16 x 16 32-bit elements in place: r[c] becomes the old column c (lane i: old r[i]'s element c). */
static inline void transpose_16x16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) { /* per 128-bit lane: elements 0, 1 (t[2i]) and 2, 3 (t[2i + 1]) of rows 2i, 2i + 1 */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) { /* r[4i + k], 128-bit lane L: element 4L + k of rows 4i to 4i + 3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; ++k) { /* column 4L + k: lane L of r[k], r[4 + k], r[8 + k], r[12 + k] */
        const __m512i lo_a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), lo_b = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
        const __m512i hi_a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE), hi_b = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
        t[k] = _mm512_shuffle_i32x4(lo_a, lo_b, 0x88);
        t[4 + k] = _mm512_shuffle_i32x4(lo_a, lo_b, 0xDD);
        t[8 + k] = _mm512_shuffle_i32x4(hi_a, hi_b, 0x88);
        t[12 + k] = _mm512_shuffle_i32x4(hi_a, hi_b, 0xDD);
    }
    for (int c = 0; c < 16; ++c) r[c] = t[c];
}

/* K [ctx, kv_heads, D] of head g, through slots, as [ctx_pad/16][D/2][16][2]; zeros past ctx. Each 16 keys' rows
 * read whole and transposed in registers, 16 pairs (two bfloat16 as one 32-bit element) at a time: a third of
 * what gathering each pair of the 16 keys cost (the decode step's chunks spent ~45% of their attention in it). */
static void pack_k(const uint16_t *pool, const int64_t *slots, int64_t ctx, int64_t ctx_pad, int64_t kv_heads,
                   int64_t g, int64_t dim, uint16_t *kt) {
    const int64_t pairs = dim / 2;
    for (int64_t j0 = 0; j0 < ctx_pad; j0 += 16) {
        const uint32_t *rows[16];
        for (int i = 0; i < 16; ++i)
            rows[i] = j0 + i < ctx ? (const uint32_t *)(pool + (slots[j0 + i] * kv_heads + g) * dim) : NULL;
        uint32_t *tile = (uint32_t *)(kt + j0 * dim);
        for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i) r[i] = rows[i] != NULL ? _mm512_loadu_si512(rows[i] + p0) : _mm512_setzero_si512();
            transpose_16x16_epi32(r);
            for (int c = 0; c < 16; ++c) _mm512_store_si512(tile + (p0 + c) * 16, r[c]);
        }
    }
}

/* V [ctx, kv_heads, D] of head g as [ctx_pad/2][D][2]; zeros past ctx: two keys' rows interleaved, 32 elements
 * of each at a time. */
static void pack_v(const uint16_t *pool, const int64_t *slots, int64_t ctx, int64_t ctx_pad, int64_t kv_heads,
                   int64_t g, int64_t dim, uint16_t *vt) {
    for (int64_t j = 0; j < ctx_pad; j += 2) {
        const uint16_t *ra = j < ctx ? pool + (slots[j] * kv_heads + g) * dim : NULL;
        const uint16_t *rb = j + 1 < ctx ? pool + (slots[j + 1] * kv_heads + g) * dim : NULL;
        uint16_t *pair = vt + j * dim;
        for (int64_t d = 0; d < dim; d += 32) {
            const __m512i a = ra ? _mm512_loadu_si512(ra + d) : _mm512_setzero_si512();
            const __m512i b = rb ? _mm512_loadu_si512(rb + d) : _mm512_setzero_si512();
            __m512i both[2];
            interleave_rows(a, b, both);
            _mm512_storeu_si512(pair + 2 * d, both[0]);
            _mm512_storeu_si512(pair + 2 * d + 32, both[1]);
        }
    }
}

/* Inside a parallel region: every KV head g's context packed at packed + g * per_head, K (pack_k) then V
 * (pack_v) ctx_pad * dim elements on, one work item per head and matrix. */
static inline void pack_heads(const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *slots, int64_t ctx,
                              int64_t ctx_pad, int64_t kv_heads, int64_t dim, uint16_t *packed, size_t per_head) {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < 2 * kv_heads; ++item) {
        uint16_t *kt = packed + (item / 2) * per_head;
        if (item % 2 == 0)
            pack_k(k_pool, slots, ctx, ctx_pad, kv_heads, item / 2, dim, kt);
        else
            pack_v(v_pool, slots, ctx, ctx_pad, kv_heads, item / 2, dim, kt + ctx_pad * dim);
    }
}

#endif

#endif

/* Causal prefill attention over the paged pool in bfloat16 on AMX tiles: prefill_attention.c's contract and
 * packed layouts (prefill_softmax.h), with the two products on the tile unit instead of VDPBF16PS. On an AMX
 * Xeon the vector kernel ran at a fifth of the bfloat16 GEMM rate; the tiles do a 16 x 16 x 32 product in one
 * instruction (docs/ARCHITECTURE.md, "Prefill attention").
 *
 * A task of 32 query rows of one head (two tiles of 16 rows, sharing every K and V tile loaded) walks the
 * context in steps of AMX_KEYS keys: S = Q.K^T 32 keys at a time into four 16 x 16 float32 tiles (Q as the A
 * tiles, K's packed [16 keys][D/2][2] rows as B tiles), the online softmax on the vectors (softmax_step: the
 * operations of softmax_rows, 8 rows at a time, over the step's vectors), P rounded to bfloat16 as the A
 * tiles, P.V added to the rows' float32 accumulators in C tiles loaded from them and stored back (V's packed
 * [key pairs][D][2] as B tiles); a row whose maximum moved has its accumulator scaled first (by exactly 1,
 * nothing, where it held: a row's sums so depend on its own maxima alone).
 *
 * Invariants, as the vector kernel's: a row's result depends only on its query, its position and the context
 * up to it. A tile product computes each output element from its own row of A alone, in an order fixed by the
 * hardware; steps start at the context's first key, every AMX_KEYS keys; keys past a row's position get
 * probability exactly 0 and a step wholly past it leaves the row's figures as they were, so where a task's
 * last step is cut (its rows' reach) does not change a row. The kernel is chosen once per process
 * (AMX present and permitted by the OS), so every prefill row of a process goes through the same one
 * (tests/test_prefill_attention.py). Its bits differ from the vector kernel's (another summation order). */
#include <omp.h>
#include <stdlib.h>

#include "prefill_softmax.h"

#include "amx.h"
#if defined(KVMOSAIC_AMX)

#define AMX_ROWS 32  /* query rows per task: two tiles of 16 rows, sharing every K and V tile loaded */
#define AMX_KEYS 64  /* keys per online-softmax step (up to: a task's last step stops at its reach, rounded up to 32) */
#define AMX_DIM 128  /* the widest head */

/* Every tile register 16 rows of 64 bytes: A as 16 rows x 32 bfloat16, B as 16 pair rows x 16 x 2, C as
 * 16 x 16 float32. Tiles 0-3: C; 4, 5: A (the two row tiles' Q chunk, then their P chunk); 6, 7: B (K's or
 * V's). */
static void configure_tiles(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_configure(rows);
}

/* Scores of the task's row tiles against 32 keys from k0 (packed K: [16 keys][D/2][2] per 16 keys) into
 * scores (row stride AMX_KEYS floats): C tiles 0, 1 the first row tile's two halves of the keys, 2, 3 the
 * second's (when two). */
static inline void scores_32(const uint16_t *q, int two, const uint16_t *k0, int64_t dim, float *scores) {
    const uint16_t *k1 = k0 + 16 * dim;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t c = 0; c < dim / 32; ++c) { /* 32 of Q's dimensions: 16 pair rows of K's tiles */
        _tile_loadd(6, k0 + c * 512, 64); _tile_loadd(7, k1 + c * 512, 64);
        _tile_loadd(4, q + c * 32, dim * 2);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, q + 16 * dim + c * 32, dim * 2);
            _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, scores, AMX_KEYS * 4); _tile_stored(1, scores + 16, AMX_KEYS * 4);
    if (two) { _tile_stored(2, scores + 16 * AMX_KEYS, AMX_KEYS * 4); _tile_stored(3, scores + 16 * AMX_KEYS + 16, AMX_KEYS * 4); }
}

/* P.V of the task's row tiles over `chunks` 32-key chunks of one step for dims 16g to 16g + 31, added on the tile
 * unit to their accumulator rows in acc (row stride dim floats): C tiles 0, 1 the first row tile's two 16-dim
 * groups, 2, 3 the second's, loaded from acc, summed over the chunks, stored back. probs: [AMX_ROWS][AMX_KEYS]
 * bfloat16; v: packed V ([key pairs][D][2]) at the step's first key. */
static inline void pv_pass(const uint16_t *probs, int two, int chunks, const uint16_t *v, int64_t dim, int64_t g,
                           float *acc) {
    const int64_t stride = dim * 4; /* bytes: one key pair's D pairs of bfloat16, one accumulator row */
    _tile_loadd(0, acc + g * 16, stride); _tile_loadd(1, acc + (g + 1) * 16, stride);
    if (two) { _tile_loadd(2, acc + 16 * dim + g * 16, stride); _tile_loadd(3, acc + 16 * dim + (g + 1) * 16, stride); }
    for (int c = 0; c < chunks; ++c) {
        const uint16_t *vc = v + c * 16 * 2 * dim;
        _tile_loadd(6, vc + g * 32, stride); _tile_loadd(7, vc + (g + 1) * 32, stride);
        _tile_loadd(4, probs + c * 32, AMX_KEYS * 2);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, probs + 16 * AMX_KEYS + c * 32, AMX_KEYS * 2);
            _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc + g * 16, stride); _tile_stored(1, acc + (g + 1) * 16, stride);
    if (two) { _tile_stored(2, acc + 16 * dim + g * 16, stride); _tile_stored(3, acc + 16 * dim + (g + 1) * 16, stride); }
}

/* One online-softmax step of MAX_ROWS rows over `vectors` 16-key vectors of their scores from key j0 (row
 * stride AMX_KEYS): the probabilities exp2(score * unit - max), exactly 0 past a row's last key, rounded to
 * bfloat16 into probs; the running maxima and sums in *m, *l (row_figure's layout); *factor what each row's
 * accumulator is scaled by (row_figure's layout: exactly 1 where the row's maximum held); returns whether
 * some row's is not 1. A row's maximum and sum run over its vectors in order, so vectors past its
 * last key (zeros: a step cut short at the task's reach has none of them) change neither; a step wholly
 * past the row leaves its figures as they were (factor exactly 1). softmax_rows' operations, on longer steps. */
static inline int softmax_step(const float *scores, uint16_t *probs, int vectors, const int64_t *last, int64_t j0,
                                __m512 unit, __m512 *m, __m512 *l, __m512 *factor) {
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    __m512 top[MAX_ROWS], sum[MAX_ROWS];
    int64_t seen = last[0];
    for (int r = 1; r < MAX_ROWS; ++r) seen = last[r] < seen ? last[r] : seen;
    const int whole = j0 + 16 * vectors <= seen + 1; /* every row sees every key of the step */
    for (int r = 0; r < MAX_ROWS; ++r) {
        const float *row = scores + r * AMX_KEYS;
        top[r] = minus_inf;
        for (int i = 0; i < vectors; ++i) {
            const __m512 x = _mm512_load_ps(row + 16 * i);
            top[r] = _mm512_max_ps(top[r], whole ? x : _mm512_mask_mov_ps(minus_inf, first_lanes(last[r] - j0 + 1 - 16 * i), x));
        }
    }
    const __m512 m_new = _mm512_max_ps(*m, _mm512_mul_ps(reduce_rows_max(top), unit));
    /* m - m_new <= 0; -inf - finite (a row's first step) is clamped: a factor of ~0 on an accumulator that is still 0 */
    const __m512 scale = exp2_coarse(_mm512_max_ps(_mm512_sub_ps(*m, m_new), _mm512_set1_ps(-200.0f)));
    for (int r = 0; r < MAX_ROWS; ++r) {
        const float *row = scores + r * AMX_KEYS;
        const __m512 mr = row_figure(m_new, r);
        sum[r] = _mm512_setzero_ps();
        for (int i = 0; i < vectors; i += 2) {
            __m512 p[2];
            for (int h = 0; h < 2; ++h) {
                p[h] = exp2_coarse(_mm512_fmsub_ps(_mm512_load_ps(row + 16 * (i + h)), unit, mr));
                if (!whole) p[h] = _mm512_maskz_mov_ps(first_lanes(last[r] - j0 + 1 - 16 * (i + h)), p[h]);
                sum[r] = _mm512_add_ps(sum[r], p[h]);
            }
            _mm512_store_si512(probs + r * AMX_KEYS + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
        }
    }
    *l = _mm512_add_ps(_mm512_mul_ps(*l, scale), reduce_rows_add(sum));
    *m = m_new;
    *factor = scale;
    return _mm512_cmp_ps_mask(scale, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0;
}

/* AMX_ROWS query rows of one head (q rows packed at dim elements apart; row r sees keys 0..last[r], nr real
 * rows, the rest repeat the first) against the packed context, in steps of AMX_KEYS keys from the context's
 * first. Writes bfloat16 rows of out. */
static void tile_amx(const uint16_t *q, const int64_t *last, int nr, const uint16_t *kt, const uint16_t *vt,
                     float scale, int64_t dim, uint16_t *const *out_rows) {
    float scores[AMX_ROWS * AMX_KEYS] __attribute__((aligned(64)));
    uint16_t probs[AMX_ROWS * AMX_KEYS] __attribute__((aligned(64)));
    float acc[AMX_ROWS * AMX_DIM] __attribute__((aligned(64)));
    const int two = nr > 16, groups = two ? 4 : 2;
    const __m512 unit = _mm512_set1_ps(scale * EXP_LOG2E);
    __m512 m[4], l[4];
    for (int g = 0; g < 4; ++g) m[g] = _mm512_set1_ps(-INFINITY), l[g] = _mm512_setzero_ps();
    int64_t reach = 0;
    for (int r = 0; r < nr; ++r) reach = last[r] + 1 > reach ? last[r] + 1 : reach;
    memset(acc, 0, sizeof(float) * AMX_ROWS * dim);
    for (int64_t j0 = 0; j0 < reach; j0 += AMX_KEYS) {
        const int chunks = reach - j0 >= AMX_KEYS ? AMX_KEYS / 32 : (int)((reach - j0 + 31) / 32);
        for (int c = 0; c < chunks; ++c) scores_32(q, two, kt + (j0 + 32 * c) * dim, dim, scores + 32 * c);
        for (int g = 0; g < groups; ++g) {
            __m512 factor;
            if (!softmax_step(scores + g * MAX_ROWS * AMX_KEYS, probs + g * MAX_ROWS * AMX_KEYS, 2 * chunks,
                              last + g * MAX_ROWS, j0, unit, &m[g], &l[g], &factor))
                continue;
            for (int r = 0; r < MAX_ROWS; ++r) { /* a row whose maximum held is scaled by exactly 1: as it was */
                const __m512 corr = row_figure(factor, r);
                float *a = acc + (g * MAX_ROWS + r) * dim;
                for (int64_t c = 0; c < dim; c += 16) _mm512_store_ps(a + c, _mm512_mul_ps(_mm512_load_ps(a + c), corr));
            }
        }
        for (int64_t g = 0; g < dim / 16; g += 2) pv_pass(probs, two, chunks, vt + j0 * dim, dim, g, acc);
    }
    for (int r = 0; r < nr; ++r) {
        const __m512 inv = _mm512_set1_ps(1.0f / row_scalar(l[r / MAX_ROWS], r % MAX_ROWS));
        for (int64_t c = 0; c < dim; c += 16) /* VCVTNEPS2BF16: float_to_bf16's rounding, subnormals flushed */
            store_bf16x16(out_rows[r] + c, _mm512_mul_ps(_mm512_load_ps(acc + r * dim + c), inv));
    }
}
#endif

/* 1 where bfloat16 prefill attention runs on AMX tiles in this process (built with AMX, granted by the OS). */
int prefill_attention_amx_ready(void) {
#if defined(KVMOSAIC_AMX)
    return amx_permitted();
#else
    return 0;
#endif
}

/* prefill_attention (prefill_attention.c) on AMX tiles: the same arguments and results; -2 where this build
 * or this process has no AMX (the caller then runs the vector kernel). */
int prefill_attention_amx(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *slots,
                          const int64_t *positions, int64_t ctx, int64_t num_tokens, int64_t heads, int64_t kv_heads,
                          int64_t dim, int64_t q_stride, float scale, uint16_t *out, int num_threads) {
#if defined(KVMOSAIC_AMX)
    if (!amx_permitted()) return -2;
    if ((dim != 64 && dim != 128) || kv_heads < 1 || heads % kv_heads || num_tokens > ctx || num_tokens < 0) return -1;
    if (num_tokens == 0) return 0;
    const int64_t group = heads / kv_heads, past = ctx - num_tokens, ctx_pad = (ctx + BLOCK - 1) / BLOCK * BLOCK;
    const size_t per_head = (size_t)(2 * ctx_pad * dim);
    uint16_t *packed = aligned_alloc(64, (per_head * kv_heads * sizeof(uint16_t) + 63) / 64 * 64);
    if (packed == NULL) return -3;
    const int64_t tiles = (num_tokens + AMX_ROWS - 1) / AMX_ROWS;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        pack_heads(k_pool, v_pool, slots, ctx, ctx_pad, kv_heads, dim, packed, per_head);
        configure_tiles();
        /* the last rows see the most keys: hand them out first */
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t t = tiles - 1; t >= 0; --t) {
            for (int64_t h = 0; h < heads; ++h) {
                const uint16_t *kt = packed + (h / group) * per_head, *vt = kt + ctx_pad * dim;
                uint16_t q_tile[AMX_ROWS * AMX_DIM] __attribute__((aligned(64)));
                uint16_t *out_rows[AMX_ROWS];
                int64_t index[AMX_ROWS], last[AMX_ROWS];
                const int nr = tile_rows(t, AMX_ROWS, num_tokens, positions, past, index, last);
                for (int r = 0; r < AMX_ROWS; ++r) {
                    memcpy(q_tile + r * dim, q + index[r] * q_stride + h * dim, (size_t)dim * sizeof(uint16_t));
                    out_rows[r] = out + (index[r] * heads + h) * dim;
                }
                tile_amx(q_tile, last, nr, kt, vt, scale, dim, out_rows);
            }
        }
        _tile_release();
    }
    free(packed);
    return 0;
#else
    (void)q, (void)k_pool, (void)v_pool, (void)slots, (void)positions, (void)ctx, (void)num_tokens, (void)heads, (void)kv_heads;
    (void)dim, (void)q_stride, (void)scale, (void)out, (void)num_threads;
    return -2;
#endif
}

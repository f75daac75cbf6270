/* Attention on AMX tiles in bfloat16: causal prefill attention over the paged pool, and (at the end of this file)
 * decode attention over one chunk of a context for the rows that attend it (decode_rows_amx).
 *
 * Prefill: prefill_attention.c's contract and
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

#include "paged_decode.h"
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

#if defined(KVMOSAIC_AMX)
/* Decode attention on the tile unit. A chunk (n <= DECODE_CHUNK keys) is short enough for its whole softmax at once:
 * no online rescaling. The scores are computed transposed, S^T = K.Q^T, so that K's rows are the A tiles, read in
 * place from the pool (16 keys of a block lie in consecutive slots; others are copied), and the queries, packed
 * once, are the B tiles; each key's scores are then one vector (a lane per query row), and each row's maximum,
 * exponentials and sum run down the lanes with no horizontal step. The probabilities are rounded to bfloat16 (as
 * the prefill kernel rounds them), turned into rows (a 16 x 16 transpose of key pairs per 32 keys) and P.V is summed
 * in four C tiles over the chunk, stored once. Every figure of a query row comes from its own query and the chunk. */
/* The B tiles of up to 16 query rows (bfloat16, row stride dim; rows past ``rows`` zero): per 32 dims, [16 pairs]
 * [16 rows] of 32-bit pairs. */
static inline void decode_pack_queries(const uint16_t *q, int rows, int64_t dim, uint32_t *qt) {
    for (int64_t c = 0; c < dim / 32; ++c) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_si512(q + i * dim + 32 * c) : _mm512_setzero_si512();
        transpose_16x16_epi32(r);
        for (int p = 0; p < 16; ++p) _mm512_store_si512(qt + (c * 16 + p) * 16, r[p]);
    }
}

/* Where 16 keys' rows of head g are read as an A tile: in place when the keys lie in consecutive slots (stride: a slot
 * row), else copied to ``copy`` (stride dim), keys past n as zeros. */
static inline const uint16_t *decode_key_rows(const uint16_t *k_pool, const int64_t *slots, int64_t j0, int64_t n,
                                              int64_t kv_heads, int64_t g, int64_t dim, uint16_t *copy, int64_t *stride) {
    int consecutive = j0 + 16 <= n;
    for (int i = 1; i < 16 && consecutive; ++i) consecutive = slots[j0 + i] == slots[j0] + i;
    if (consecutive) {
        *stride = kv_heads * dim * 2;
        return k_pool + (slots[j0] * kv_heads + g) * dim;
    }
    for (int i = 0; i < 16; ++i)
        for (int64_t d = 0; d < dim; d += 32)
            _mm512_store_si512(copy + i * dim + d, j0 + i < n ? _mm512_loadu_si512(k_pool + (slots[j0 + i] * kv_heads + g) * dim + d)
                                                               : _mm512_setzero_si512());
    *stride = dim * 2;
    return copy;
}

/* Up to 16 query rows of one kv head over a chunk of n keys (K in the pool at slots, V packed by pack_v in vt):
 * out [rows, dim] float32 and lse [rows]. */
static void decode_block_amx(const uint16_t *q, int rows, const uint16_t *k_pool, const int64_t *slots, int64_t n,
                             int64_t kv_heads, int64_t g, const uint16_t *vt, int64_t dim, float scale, float *out,
                             float *lse, KvPrefetch *kv) {
    uint32_t qt[16 * 16 * (AMX_DIM / 32)] __attribute__((aligned(64)));
    float st[DECODE_CHUNK * 16] __attribute__((aligned(64)));            /* S^T: key j's 16 rows at st + 16 j */
    uint32_t pt[DECODE_CHUNK / 32 * 256] __attribute__((aligned(64)));   /* P: per 32 keys, [16 rows][16 key pairs] */
    uint16_t copies[4][16 * AMX_DIM] __attribute__((aligned(64)));
    float acc[16 * AMX_DIM] __attribute__((aligned(64)));
    const int64_t n_pad = (n + 31) / 32 * 32, chunks = dim / 32;
    decode_pack_queries(q, rows, dim, qt);
    for (int64_t k0 = 0; k0 < n_pad; k0 += 64) { /* C tiles 0-3: 16 keys each, a key per tile row */
        const int blocks = n_pad - k0 >= 64 ? 4 : 2;
        const uint16_t *a[4];
        int64_t stride[4];
        for (int b = 0; b < blocks; ++b)
            a[b] = decode_key_rows(k_pool, slots, k0 + 16 * b, n, kv_heads, g, dim, copies[b], &stride[b]);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); /* tile numbers are literals in the instructions */
        for (int64_t c = 0; c < chunks; ++c) {
            _tile_loadd(6, qt + c * 256, 64);
            _tile_loadd(4, a[0] + 32 * c, stride[0]); _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, a[1] + 32 * c, stride[1]); _tile_dpbf16ps(1, 5, 6);
            if (blocks == 4) {
                _tile_loadd(4, a[2] + 32 * c, stride[2]); _tile_dpbf16ps(2, 4, 6);
                _tile_loadd(5, a[3] + 32 * c, stride[3]); _tile_dpbf16ps(3, 5, 6);
            }
        }
        float *s = st + k0 * 16;
        _tile_stored(0, s, 64); _tile_stored(1, s + 256, 64);
        if (blocks == 4) { _tile_stored(2, s + 512, 64); _tile_stored(3, s + 768, 64); }
    }
    /* each lane a row: its maximum (of score * unit, base 2), then exponentials and their sum; 0 past n */
    const __m512 unit = _mm512_set1_ps(scale * EXP_LOG2E);
    __m512 top = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) top = _mm512_max_ps(top, _mm512_load_ps(st + 16 * j));
    top = _mm512_mul_ps(top, unit);
    /* lanes 2i and 2i + 1 of a pair's vector: row i's probabilities of its two keys */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t j0 = 0; j0 < n_pad; j0 += 32) {
        __m512i w[16];
        for (int kp = 0; kp < 16; ++kp) {
            __m512 p[2];
            for (int h = 0; h < 2; ++h) {
                const int64_t j = j0 + 2 * kp + h;
                kv_prefetch_key(kv); /* the coming tasks' K and V, a row every kv heads keys, as the vector kernel asks */
                p[h] = j < n ? exp2_coarse(_mm512_fmsub_ps(_mm512_load_ps(st + 16 * j), unit, top)) : _mm512_setzero_ps();
                total = _mm512_add_ps(total, p[h]);
            }
            w[kp] = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
        }
        transpose_16x16_epi32(w); /* w[r]: row r's 16 key pairs */
        for (int r = 0; r < 16; ++r) _mm512_store_si512(pt + (j0 / 32) * 256 + r * 16, w[r]);
    }
    const int64_t vstride = dim * 4; /* bytes: one key pair's D pairs of bfloat16, one accumulator row */
    for (int64_t d0 = 0; d0 < dim; d0 += 64) { /* C tiles 0-3: 16 dims each */
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t j0 = 0; j0 < n_pad; j0 += 32) {
            const uint16_t *vc = vt + j0 * dim + d0 * 2;
            _tile_loadd(4, pt + (j0 / 32) * 256, 64);
            _tile_loadd(6, vc, vstride); _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, vc + 32, vstride); _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, vc + 64, vstride); _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, vc + 96, vstride); _tile_dpbf16ps(3, 4, 7);
        }
        _tile_stored(0, acc + d0, dim * 4); _tile_stored(1, acc + d0 + 16, dim * 4);
        _tile_stored(2, acc + d0 + 32, dim * 4); _tile_stored(3, acc + d0 + 48, dim * 4);
    }
    float tops[16], sums[16];
    _mm512_storeu_ps(tops, top), _mm512_storeu_ps(sums, total);
    for (int r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.0f / sums[r]);
        for (int64_t c = 0; c < dim; c += 16) _mm512_storeu_ps(out + r * dim + c, _mm512_mul_ps(_mm512_load_ps(acc + r * dim + c), inv));
        lse[r] = tops[r] * (float)M_LN2 + logf(sums[r]);
    }
}

#endif

/* Decode attention of ``rows`` bfloat16 query rows q (row stride dim) over the n (<= DECODE_CHUNK) keys of kv head g
 * at slots, every row seeing every key: out [rows, dim] float32 and lse [rows], paged_decode_head's contract. The
 * chunk's V packed once, then 16 rows at a time (decode_block_amx). Tiles as decode_amx_configure loads them. */
void decode_rows_amx(const uint16_t *q, int rows, const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *slots,
                     int64_t n, int64_t kv_heads, int64_t dim, int64_t g, float scale, float *out, float *lse,
                     KvPrefetch *kv) {
#if defined(KVMOSAIC_AMX)
    uint16_t vt[DECODE_CHUNK * AMX_DIM] __attribute__((aligned(64)));
    pack_v(v_pool, slots, n, (n + 31) / 32 * 32, kv_heads, g, dim, vt);
    for (int r0 = 0; r0 < rows; r0 += 16)
        decode_block_amx(q + r0 * dim, rows - r0 < 16 ? rows - r0 : 16, k_pool, slots, n, kv_heads, g, vt, dim, scale,
                         out + r0 * dim, lse + r0, r0 == 0 ? kv : NULL);
#else /* never called: decode_amx_serves is 0 */
    (void)q, (void)rows, (void)k_pool, (void)v_pool, (void)slots, (void)n, (void)kv_heads, (void)dim, (void)g, (void)scale;
    (void)out, (void)lse, (void)kv;
#endif
}

/* The tile configuration decode_rows_amx computes in, loaded on the calling thread; and the thread's tile state
 * let go. Nothing without AMX (decode_amx_serves is 0 there). */
void decode_amx_configure(void) {
#if defined(KVMOSAIC_AMX)
    configure_tiles();
#endif
}

void decode_amx_release(void) {
#if defined(KVMOSAIC_AMX)
    _tile_release();
#endif
}

/* 1 where decode attention of this shape runs on AMX tiles in this process (decode_rows_amx): a bfloat16 pool
 * and bfloat16 queries, head dim 64 or 128. */
int decode_amx_serves(int kv_bf16, int q_bf16, int64_t dim, int64_t group) {
#if defined(KVMOSAIC_AMX)
    return kv_bf16 && q_bf16 && (dim == 64 || dim == 128) && group <= MAX_GROUP && amx_permitted();
#else
    (void)kv_bf16, (void)q_bf16, (void)dim, (void)group;
    return 0;
#endif
}

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

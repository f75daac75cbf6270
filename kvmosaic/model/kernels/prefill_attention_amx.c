/* Causal prefill attention over the paged pool in bfloat16 on AMX tiles: prefill_attention.c's contract and
 * packed layouts (prefill_softmax.h), with the two products on the tile unit instead of VDPBF16PS. On an AMX
 * Xeon the vector kernel ran at a fifth of the bfloat16 GEMM rate; the tiles do a 16 x 16 x 32 product in one
 * instruction (docs/ARCHITECTURE.md, "Prefill attention").
 *
 * A tile of 16 query rows of one head walks the context in BLOCK-key blocks: S = Q.K^T into two 16 x 16
 * float32 tiles (Q as the A tile, K's packed [16 keys][D/2][2] rows as B tiles), the online softmax on the
 * vectors (softmax_rows, rows 0-7 and 8-15 apart: the same operations as the vector kernel), P rounded to
 * bfloat16 as the A tile, P.V into float32 tiles from zero (V's packed [key pairs][D][2] as B tiles), and the
 * row's accumulator scaled and added to in one fused multiply-add.
 *
 * Invariants, as the vector kernel's: a row's result depends only on its query, its position and the context
 * up to it. A tile product computes each output element from its own row of A alone, in an order fixed by the
 * hardware; blocks start at the context's first key; keys past a row's position get probability exactly 0
 * and a block wholly past it leaves the row's figures as they were. The kernel is chosen once per process
 * (AMX present and permitted by the OS), so every prefill row of a process goes through the same one
 * (tests/test_prefill_attention.py). Its bits differ from the vector kernel's (another summation order). */
#include <omp.h>
#include <stdlib.h>

#include "prefill_softmax.h"

#include "amx.h"
#if defined(KVMOSAIC_AMX)

#define AMX_ROWS 16 /* query rows per tile: a tile register's rows */

/* Every tile register 16 rows of 64 bytes: A as 16 rows x 32 bfloat16, B as 16 pair rows x 16 x 2, C as
 * 16 x 16 float32. Tiles 0-3: C (S in 0, 1; P.V's output in 0-3); 4: A (Q's chunk, then P); 5-7: B. */
static void configure_tiles(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_configure(rows);
}

/* P.V over one key block for four 16-dim column groups from g: tiles 0-3 from zero, stored to out (row stride
 * dim floats). P is in tile 4; V's groups are B tiles 16 dims wide, 2 * dim elements from one key pair to the next. */
static inline void pv_groups(const uint16_t *v, int64_t g, int64_t dim, float *out) {
    const int64_t stride = dim * 4; /* bytes: one key pair's D pairs of bfloat16 */
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(5, v + (g + 0) * 32, stride); _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, v + (g + 1) * 32, stride); _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, v + (g + 2) * 32, stride); _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, v + (g + 3) * 32, stride); _tile_dpbf16ps(3, 4, 5);
    _tile_stored(0, out + (g + 0) * 16, stride); _tile_stored(1, out + (g + 1) * 16, stride);
    _tile_stored(2, out + (g + 2) * 16, stride); _tile_stored(3, out + (g + 3) * 16, stride);
}

/* AMX_ROWS query rows of one head (q rows packed at dim elements apart; row r sees keys 0..last[r], nr real
 * rows, the rest repeat the first) against the packed context. Writes bfloat16 rows of out. */
static void tile_amx(const uint16_t *q, const int64_t *last, int nr, const uint16_t *kt, const uint16_t *vt,
                     float scale, int64_t dim, uint16_t *const *out_rows) {
    float scores[AMX_ROWS][BLOCK] __attribute__((aligned(64)));
    uint16_t probs[AMX_ROWS][BLOCK] __attribute__((aligned(64)));
    float block_out[AMX_ROWS * 128] __attribute__((aligned(64))), acc[AMX_ROWS * 128] __attribute__((aligned(64)));
    __m512 m[2] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY)}, l[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const int halves = nr > MAX_ROWS ? 2 : 1, live = halves * MAX_ROWS;
    int64_t reach = 0;
    for (int r = 0; r < nr; ++r) reach = last[r] + 1 > reach ? last[r] + 1 : reach;
    memset(acc, 0, sizeof(float) * AMX_ROWS * dim); /* the rows' dim columns: all that is read */
    memset(probs, 0, sizeof probs); /* a half with no real row keeps probability 0 */
    for (int64_t j0 = 0; j0 < reach; j0 += BLOCK) {
        const uint16_t *k0 = kt + j0 * dim, *k1 = k0 + 16 * dim;
        _tile_zero(0); _tile_zero(1);
        for (int64_t c = 0; c < dim / 32; ++c) { /* 32 of Q's dimensions: 16 pair rows of K's tiles */
            _tile_loadd(4, q + c * 32, dim * 2);
            _tile_loadd(5, k0 + c * 512, 64); _tile_loadd(6, k1 + c * 512, 64);
            _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6);
        }
        _tile_stored(0, &scores[0][0], BLOCK * 4); _tile_stored(1, &scores[0][16], BLOCK * 4);
        __m512 corr[AMX_ROWS];
        for (int h = 0; h < halves; ++h) {
            __m512 s[MAX_ROWS][2];
            for (int r = 0; r < MAX_ROWS; ++r)
                s[r][0] = _mm512_load_ps(scores[h * MAX_ROWS + r]), s[r][1] = _mm512_load_ps(scores[h * MAX_ROWS + r] + 16);
            softmax_rows(s, MAX_ROWS, last + h * MAX_ROWS, j0, scale, 1, &m[h], &l[h], corr + h * MAX_ROWS);
            for (int r = 0; r < MAX_ROWS; ++r)
                _mm512_store_si512(probs[h * MAX_ROWS + r], (__m512i)_mm512_cvtne2ps_pbh(s[r][1], s[r][0]));
        }
        _tile_loadd(4, &probs[0][0], BLOCK * 2);
        for (int64_t g = 0; g < dim / 16; g += 4) pv_groups(vt + j0 * dim, g, dim, block_out);
        for (int r = 0; r < live; ++r)
            for (int64_t c = 0; c < dim; c += 16) {
                float *a = acc + r * dim + c;
                _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(a), corr[r], _mm512_load_ps(block_out + r * dim + c)));
            }
    }
    for (int r = 0; r < nr; ++r) {
        const __m512 inv = _mm512_set1_ps(1.0f / row_scalar(l[r / MAX_ROWS], r % MAX_ROWS));
        for (int64_t c = 0; c < dim; c += 16) {
            float o[16];
            _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_load_ps(acc + r * dim + c), inv));
            for (int i = 0; i < 16; ++i) out_rows[r][c + i] = float_to_bf16(o[i]);
        }
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
                uint16_t q_tile[AMX_ROWS * 128] __attribute__((aligned(64)));
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

/* Paged decode attention for CPUs: one query token per sequence, reading K and V in place in
 * the paged pool (no gather, no upcast copy). See kvmosaic/model/kernels/__init__.py and
 * docs/ARCHITECTURE.md ("Attention over the pool").
 *
 * For each (sequence, kv head) the group's G query heads walk the sequence's slots in tiles of
 * TILE tokens with an online softmax in float32: scores of a tile, one rescale of the running
 * sum, then the tile's values. Each K and V row is read once per (sequence, kv head) and
 * converted to float32 in registers. Returns the attention output and the log-sum-exp of the
 * scaled scores (cascade attention merges partial results with it). A context is attended in
 * chunks of DECODE_CHUNK keys, one task each, merged in chunk order (paged_decode.h). In bfloat16
 * where the CPU has AMX a chunk is attended on the tiles instead (decode_rows_amx), and a chunk that
 * several sequences share (the same slots: a cached prefix) once for all their query rows
 * (paged_decode_share, attend_shared): each row's bits as when it is attended alone.
 *
 * Written in plain C so that it builds in about a second with the system compiler; OpenMP
 * resolves to the runtime torch has already loaded (libgomp.so.1), so torch.set_num_threads
 * and this kernel share one thread pool.
 */
#include <omp.h>
#include <stdlib.h>

#include "paged_decode.h"

#define TILE 32

/* CALL(G, D) with the query group and head size as constants where (group, dim) is a common shape,
 * so that an inlined attend_one_* has constant trip counts; else CALL(group, dim). Returns. */
#define SHAPE_CASE(CALL, G, D) \
    if (group == G && dim == D) { \
        CALL(G, D); \
        return; \
    }
#define SHAPE_CASES(CALL, G) SHAPE_CASE(CALL, G, 64) SHAPE_CASE(CALL, G, 128)
#define WITH_CONSTANT_SHAPE(CALL) \
    SHAPE_CASES(CALL, 1) SHAPE_CASES(CALL, 2) SHAPE_CASES(CALL, 3) SHAPE_CASES(CALL, 4) SHAPE_CASES(CALL, 5) \
    SHAPE_CASES(CALL, 6) SHAPE_CASES(CALL, 7) SHAPE_CASES(CALL, 8) CALL(group, dim)
#define PREFETCH 16 /* tokens ahead */

static inline __attribute__((always_inline)) void load_row(const void *pool, int kv_bf16, int64_t offset,
                                                           const int64_t dim, float *dst) {
    if (kv_bf16) {
        const uint16_t *src = (const uint16_t *)pool + offset;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) dst[d] = bf16_to_float(src[d]);
    } else {
        memcpy(dst, (const float *)pool + offset, (size_t)dim * sizeof(float));
    }
}

/* One tile of the online softmax for one query row: ``scores[0..n)`` become exp(score - new max)
 * (``scores[n..TILE)`` zero), the running max ``*m`` and sum ``*l`` move to include them, and the
 * factor the row's accumulator must be scaled by (exp(old max - new max)) is returned. */
static inline __attribute__((always_inline)) float softmax_tile(float *scores, int64_t n, float *m, float *l) {
    float tile_max = *m;
#pragma omp simd reduction(max : tile_max)
    for (int64_t j = 0; j < n; ++j) tile_max = scores[j] > tile_max ? scores[j] : tile_max;
    const float correction = exp_clamped(*m - tile_max);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < TILE; ++j) {
        scores[j] = j < n ? exp_clamped(scores[j] - tile_max) : 0.0f;
        sum += scores[j];
    }
    *l = *l * correction + sum;
    *m = tile_max;
    return correction;
}

/* The online softmax's start for a group's query rows: scaled queries, zero accumulators, an
 * empty running max and sum. */
static inline __attribute__((always_inline)) void start_rows(const float *q, float scale, int64_t group,
                                                             const int64_t dim, float *qs, float *acc, float *m,
                                                             float *l) {
    for (int64_t i = 0; i < group * dim; ++i) {
        qs[i] = q[i] * scale;
        acc[i] = 0.0f;
    }
    for (int64_t r = 0; r < group; ++r) {
        m[r] = -3.0e38f;
        l[r] = 0.0f;
    }
}

/* Its end: out [group, D] = acc / sum, lse = max + log(sum). */
static inline __attribute__((always_inline)) void finish_rows(const float *acc, const float *m, const float *l,
                                                              int64_t group, const int64_t dim, float *out,
                                                              float *lse) {
    for (int64_t r = 0; r < group; ++r) {
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < dim; ++d) out[r * dim + d] = acc[r * dim + d] * inv;
        lse[r] = m[r] + logf(l[r]);
    }
}

/* One (sequence, kv head): the group's queries over the sequence's slots. Inlined into one copy
 * per head size (see paged_decode_attention), so the loops over ``dim`` have a constant trip
 * count. */
static inline __attribute__((always_inline)) void attend_one(
    const float *q, const void *k_pool, const void *v_pool, int kv_bf16, const int64_t *seq_slots, int64_t len,
    int64_t kv_heads, const int64_t dim, int64_t g, int64_t group, float scale, float *out, float *lse,
    KvPrefetch *kv) {
    float qs[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM], s[MAX_GROUP * TILE];
    float row[MAX_DIM], m[MAX_GROUP], l[MAX_GROUP];
    start_rows(q, scale, group, dim, qs, acc, m, l);
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        for (int64_t j = 0; j < n; ++j) {
            kv_prefetch_key(kv);
            load_row(k_pool, kv_bf16, (seq_slots[t0 + j] * kv_heads + g) * dim, dim, row);
            for (int64_t r = 0; r < group; ++r) {
                const float *qr = qs + r * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; ++d) dot += qr[d] * row[d];
                s[r * TILE + j] = dot;
            }
        }
        for (int64_t r = 0; r < group; ++r) {
            const float correction = softmax_tile(s + r * TILE, n, m + r, l + r);
            float *ar = acc + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) ar[d] *= correction;
        }
        for (int64_t j = 0; j < n; ++j) {
            load_row(v_pool, kv_bf16, (seq_slots[t0 + j] * kv_heads + g) * dim, dim, row);
            for (int64_t r = 0; r < group; ++r) {
                const float p = s[r * TILE + j];
                float *ar = acc + r * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) ar[d] += p * row[d];
            }
        }
    }
    finish_rows(acc, m, l, group, dim, out, lse);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1

/* softmax_tile on two 16-lane vectors (TILE is 32): the same exponentials bit for bit
 * (exp16_clamped is exp_clamped on 16 lanes), the tile's sum in another order. */
_Static_assert(TILE == 32, "softmax_tile_x16 covers a tile with two vectors");
static inline __attribute__((always_inline)) float softmax_tile_x16(float *scores, int64_t n, float *m, float *l) {
    const __mmask16 lo = first_lanes(n), hi = first_lanes(n - 16);
    const __m512 a = _mm512_maskz_loadu_ps(lo, scores), b = _mm512_maskz_loadu_ps(hi, scores + 16);
    const __m512 none = _mm512_set1_ps(-3.0e38f);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(none, lo, a), _mm512_mask_mov_ps(none, hi, b)));
    const float tile_max = top > *m ? top : *m;
    const float correction = exp_clamped(*m - tile_max);
    const __m512 shift = _mm512_set1_ps(tile_max);
    const __m512 pa = _mm512_maskz_mov_ps(lo, exp16_clamped(_mm512_sub_ps(a, shift)));
    const __m512 pb = _mm512_maskz_mov_ps(hi, exp16_clamped(_mm512_sub_ps(b, shift)));
    _mm512_storeu_ps(scores, pa);
    _mm512_storeu_ps(scores + 16, pb);
    *l = *l * correction + _mm512_reduce_add_ps(_mm512_add_ps(pa, pb));
    *m = tile_max;
    return correction;
}

/* attend_one for a bfloat16 pool and bfloat16-exact queries on CPUs with AVX512-BF16: scores
 * with the bf16 dot-product instruction (products exact, sums in float32); P.V with it too, two
 * keys a product: the tile's probabilities rounded to bfloat16 (relative 2^-9, as the tile unit's
 * path, the prefill kernels and FlashAttention round them; the softmax's sum from the unrounded
 * ones), each pair of V rows interleaved in registers. Half the P.V instructions of float32 FMAs
 * on values widened one by one: the attention of one row 8.4 -> 7.6-8.0 ns a key row a thread, of
 * 32 rows' 775-token contexts over 30 layers 14.5 -> 13.1 ms in a fast-memory minute (1-2% in slow
 * ones), the c = 1 step's 0.41-0.45 -> 0.39-0.40 ms (Zen 5 EPYC; BENCHMARKS.md, nineteenth
 * session). Requires dim % 32 == 0. Inlined with constant (group, dim) for the common shapes (see
 * attend_avx512bf16), so the queries and accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_one_avx512bf16(
    const float *q, const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *seq_slots, int64_t len,
    int64_t kv_heads, const int64_t dim, int64_t g, const int64_t group, float scale, float *out, float *lse,
    KvPrefetch *kv) {
    __m512bh qb[MAX_GROUP][MAX_DIM / 32];
    __m512 acc[MAX_GROUP][MAX_DIM / 16];
    float s[MAX_GROUP * TILE], m[MAX_GROUP], l[MAX_GROUP];
    const int64_t pairs = dim / 32, vecs = dim / 16;
    for (int64_t r = 0; r < group; ++r) {
        for (int64_t c = 0; c < pairs; ++c)
            qb[r][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + r * dim + 32 * c + 16), _mm512_loadu_ps(q + r * dim + 32 * c));
        for (int64_t c = 0; c < vecs; ++c) acc[r][c] = _mm512_setzero_ps();
        m[r] = -3.0e38f;
        l[r] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        for (int64_t j = 0; j < n; ++j) {
            kv_prefetch_key(kv);
            const int64_t row = (seq_slots[t0 + j] * kv_heads + g) * dim;
            const uint16_t *krow = k_pool + row;
            if (t0 + j + PREFETCH < len) {
                const uint16_t *ahead = k_pool + (seq_slots[t0 + j + PREFETCH] * kv_heads + g) * dim;
                for (int64_t c = 0; c < dim; c += 32) _mm_prefetch((const char *)(ahead + c), _MM_HINT_T0);
            }
            for (int64_t c = 0; c < dim; c += 32) _mm_prefetch((const char *)(v_pool + row + c), _MM_HINT_T0);
            __m512bh k[MAX_DIM / 32];
            for (int64_t c = 0; c < pairs; ++c) k[c] = (__m512bh)_mm512_loadu_si512(krow + 32 * c);
            for (int64_t r = 0; r < group; ++r) {
                __m512 dot = _mm512_setzero_ps();
                for (int64_t c = 0; c < pairs; ++c) dot = _mm512_dpbf16_ps(dot, qb[r][c], k[c]);
                s[r * TILE + j] = _mm512_reduce_add_ps(dot) * scale;
            }
        }
        uint16_t probs[MAX_GROUP][TILE] __attribute__((aligned(64)));
        for (int64_t r = 0; r < group; ++r) {
            const __m512 corr = _mm512_set1_ps(softmax_tile_x16(s + r * TILE, n, m + r, l + r));
            for (int64_t c = 0; c < vecs; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], corr);
            const __m512bh rounded = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + r * TILE + 16), _mm512_loadu_ps(s + r * TILE));
            _mm512_store_si512(probs[r], (__m512i)rounded);
        }
        for (int64_t j = 0; j < n; j += 2) {
            const uint16_t *va = v_pool + (seq_slots[t0 + j] * kv_heads + g) * dim;
            const uint16_t *vb = j + 1 < n ? v_pool + (seq_slots[t0 + j + 1] * kv_heads + g) * dim : va; /* its weight 0 */
            __m512i v[MAX_DIM / 16]; /* v[c]: dimensions 16c .. 16c + 15 of keys j, j + 1 side by side */
            for (int64_t c = 0; c < pairs; ++c)
                interleave_rows(_mm512_loadu_si512(va + 32 * c), _mm512_loadu_si512(vb + 32 * c), v + 2 * c);
            for (int64_t r = 0; r < group; ++r) {
                const __m512bh pp = broadcast_pair(probs[r] + j);
                for (int64_t c = 0; c < vecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)v[c], pp);
            }
        }
    }
    for (int64_t r = 0; r < group; ++r) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int64_t c = 0; c < vecs; ++c) _mm512_storeu_ps(out + r * dim + 16 * c, _mm512_mul_ps(acc[r][c], inv));
        lse[r] = m[r] + logf(l[r]);
    }
}
/* attend_one_avx512bf16 with a constant head size and group, where they are common ones. */
static void attend_avx512bf16(const float *q, const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *seq_slots,
                              int64_t len, int64_t kv_heads, int64_t dim, int64_t g, int64_t group, float scale,
                              float *out, float *lse, KvPrefetch *kv) {
#define CALL(G, D) attend_one_avx512bf16(q, k_pool, v_pool, seq_slots, len, kv_heads, D, g, G, scale, out, lse, kv)
    WITH_CONSTANT_SHAPE(CALL);
#undef CALL
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_F32 1

/* r[j] = the sum of v[j]'s 8 lanes, for 8 vectors at once (three rounds of shuffles and adds). */
static inline __m256 sum_lanes_8(const __m256 *v) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* attend_one for a float32 pool on CPUs with AVX2 and FMA: a tile's scores eight keys at a time
 * (one vector of eight sums per query head), its values in register passes of 32 dimensions per
 * query head. Requires dim % 32 == 0. Same results as attend_one up to float32 summation order.
 * Inlined with constant (group, dim) for the common shapes (see attend_avx2_f32). */
static inline __attribute__((always_inline)) void attend_one_avx2_f32(
    const float *q, const float *k_pool, const float *v_pool, const int64_t *seq_slots, int64_t len,
    int64_t kv_heads, const int64_t dim, int64_t g, const int64_t group, float scale, float *out, float *lse,
    KvPrefetch *kv) {
    float qs[MAX_GROUP * MAX_DIM] __attribute__((aligned(32))), acc[MAX_GROUP * MAX_DIM] __attribute__((aligned(32)));
    float s[MAX_GROUP * TILE] __attribute__((aligned(32))), m[MAX_GROUP], l[MAX_GROUP];
    const float *rows[TILE];
    start_rows(q, scale, group, dim, qs, acc, m, l);
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        for (int64_t j = 0; j < n; ++j) {
            kv_prefetch_key(kv);
            rows[j] = k_pool + (seq_slots[t0 + j] * kv_heads + g) * dim;
            if (t0 + j + PREFETCH < len) {
                const float *ahead = k_pool + (seq_slots[t0 + j + PREFETCH] * kv_heads + g) * dim;
                for (int64_t c = 0; c < dim; c += 16) _mm_prefetch((const char *)(ahead + c), _MM_HINT_T0);
            }
            const float *vrow = v_pool + (rows[j] - k_pool);
            for (int64_t c = 0; c < dim; c += 16) _mm_prefetch((const char *)(vrow + c), _MM_HINT_T0);
        }
        for (int64_t j = n; j < TILE; ++j) rows[j] = rows[0]; /* a short tile's extra scores are ignored */
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
            for (int64_t r = 0; r < group; ++r) {
                __m256 dots[8];
                for (int k = 0; k < 8; ++k) {
                    const float *krow = rows[j0 + k];
                    __m256 d0 = _mm256_mul_ps(_mm256_load_ps(qs + r * dim), _mm256_loadu_ps(krow));
                    __m256 d1 = _mm256_mul_ps(_mm256_load_ps(qs + r * dim + 8), _mm256_loadu_ps(krow + 8));
                    for (int64_t c = 16; c < dim; c += 16) {
                        d0 = _mm256_fmadd_ps(_mm256_load_ps(qs + r * dim + c), _mm256_loadu_ps(krow + c), d0);
                        d1 = _mm256_fmadd_ps(_mm256_load_ps(qs + r * dim + c + 8), _mm256_loadu_ps(krow + c + 8), d1);
                    }
                    dots[k] = _mm256_add_ps(d0, d1);
                }
                _mm256_store_ps(s + r * TILE + j0, sum_lanes_8(dots));
            }
        }
        for (int64_t r = 0; r < group; ++r) {
            const float correction = softmax_tile(s + r * TILE, n, m + r, l + r);
            const float *sr = s + r * TILE;
            for (int64_t c = 0; c < dim; c += 32) {
                const __m256 corr = _mm256_set1_ps(correction);
                float *ar = acc + r * dim + c;
                __m256 a0 = _mm256_mul_ps(_mm256_load_ps(ar), corr), a1 = _mm256_mul_ps(_mm256_load_ps(ar + 8), corr);
                __m256 a2 = _mm256_mul_ps(_mm256_load_ps(ar + 16), corr), a3 = _mm256_mul_ps(_mm256_load_ps(ar + 24), corr);
                for (int64_t j = 0; j < n; ++j) {
                    const float *vrow = v_pool + (rows[j] - k_pool) + c;
                    const __m256 p = _mm256_broadcast_ss(sr + j);
                    a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vrow), a0);
                    a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vrow + 8), a1);
                    a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vrow + 16), a2);
                    a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vrow + 24), a3);
                }
                _mm256_store_ps(ar, a0), _mm256_store_ps(ar + 8, a1), _mm256_store_ps(ar + 16, a2), _mm256_store_ps(ar + 24, a3);
            }
        }
    }
    finish_rows(acc, m, l, group, dim, out, lse);
}

/* attend_one_avx2_f32 with a constant head size and group, where they are common ones. */
static void attend_avx2_f32(const float *q, const float *k_pool, const float *v_pool, const int64_t *seq_slots,
                            int64_t len, int64_t kv_heads, int64_t dim, int64_t g, int64_t group, float scale,
                            float *out, float *lse, KvPrefetch *kv) {
#define CALL(G, D) attend_one_avx2_f32(q, k_pool, v_pool, seq_slots, len, kv_heads, D, g, G, scale, out, lse, kv)
    WITH_CONSTANT_SHAPE(CALL);
#undef CALL
}
#endif

/* float32 values that are bfloat16 values, as bfloat16: their upper halves. */
static inline void bf16_upper_halves(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        out[i] = (uint16_t)(bits >> 16);
    }
}

/* One (sequence, kv head): the group's ``group`` query heads ``q`` [group, D] float32 over the
 * first ``len`` of ``seq_slots``; writes out [group, D] and lse [group]; kv (NULL: none) asked for a
 * row per key. The AVX512-BF16 path where the pool is bfloat16, the queries bfloat16 values and D a
 * multiple of 32. Shared with decode_step.c (paged_decode.h). */
void paged_decode_head(const float *q, const void *k_pool, const void *v_pool, int kv_bf16, int q_bf16_exact,
                       const int64_t *seq_slots, int64_t len, int64_t kv_heads, int64_t dim, int64_t g, int64_t group,
                       float scale, float *out, float *lse, KvPrefetch *kv) {
    if (len <= DECODE_CHUNK && decode_amx_serves(kv_bf16, q_bf16_exact, dim, group)) {
        uint16_t qb[MAX_GROUP * MAX_DIM];
        bf16_upper_halves(q, group * dim, qb);
        decode_rows_amx(qb, (int)group, (const uint16_t *)k_pool, (const uint16_t *)v_pool, seq_slots, len, kv_heads, dim,
                        g, scale, out, lse, kv);
        return;
    }
#ifdef HAVE_AVX512_BF16
    if (kv_bf16 && q_bf16_exact && dim % 32 == 0) {
        attend_avx512bf16(q, (const uint16_t *)k_pool, (const uint16_t *)v_pool, seq_slots, len, kv_heads, dim, g,
                          group, scale, out, lse, kv);
        return;
    }
#endif
#ifdef HAVE_AVX2_F32
    if (!kv_bf16 && dim % 32 == 0) {
        attend_avx2_f32(q, (const float *)k_pool, (const float *)v_pool, seq_slots, len, kv_heads, dim, g, group, scale,
                        out, lse, kv);
        return;
    }
#endif
    if (dim == 64)
        attend_one(q, k_pool, v_pool, kv_bf16, seq_slots, len, kv_heads, 64, g, group, scale, out, lse, kv);
    else if (dim == 128)
        attend_one(q, k_pool, v_pool, kv_bf16, seq_slots, len, kv_heads, 128, g, group, scale, out, lse, kv);
    else
        attend_one(q, k_pool, v_pool, kv_bf16, seq_slots, len, kv_heads, dim, g, group, scale, out, lse, kv);
}

void paged_decode_merge(const float *parts, const float *part_lse, int64_t chunks, int64_t group, int64_t dim, float *out,
                        float *lse) {
    for (int64_t r = 0; r < group; ++r) {
        float m = part_lse[r], sum = 0.0f;
        for (int64_t c = 1; c < chunks; ++c) m = part_lse[c * group + r] > m ? part_lse[c * group + r] : m;
        float *o = out + r * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) {
            const float w = expf(part_lse[c * group + r] - m);
            const float *p = parts + (c * group + r) * dim;
            sum += w;
            for (int64_t d = 0; d < dim; ++d) o[d] += w * p[d];
        }
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
        lse[r] = m + logf(sum);
    }
}

void paged_decode_prefetch(const void *k_pool, const void *v_pool, const int64_t *seq_slots, int64_t n,
                           int64_t row_bytes) {
    for (int64_t j = 0; j < n; ++j) {
        const char *k = (const char *)k_pool + seq_slots[j] * row_bytes, *v = (const char *)v_pool + seq_slots[j] * row_bytes;
        for (int64_t offset = 0; offset < row_bytes; offset += 64) {
            __builtin_prefetch(k + offset, 0, 2); /* prefetcht1: to L2 (an L1 target was slower, measured) */
            __builtin_prefetch(v + offset, 0, 2);
        }
    }
}

typedef struct {
    int64_t slot, n, t; /* a task's first slot, key count, index */
} TaskKey;

static int task_key_order(const void *a, const void *b) {
    const TaskKey *x = a, *y = b;
    if (x->slot != y->slot) return x->slot < y->slot ? -1 : 1;
    if (x->n != y->n) return x->n < y->n ? -1 : 1;
    return (x->t > y->t) - (x->t < y->t);
}

int paged_decode_share(const int64_t *first, const int64_t *lens, const int64_t *ctx_slots, int64_t max_len,
                       int64_t batch, int64_t per_lead, int64_t *start, int64_t *count, int64_t *members) {
    const int64_t tasks = first[batch];
    TaskKey *keys = malloc((size_t)(tasks > 0 ? tasks : 1) * sizeof(TaskKey));
    char *taken = calloc((size_t)(tasks > 0 ? tasks : 1), 1);
    if (keys == NULL || taken == NULL) {
        free(keys), free(taken);
        return -3;
    }
    for (int64_t b = 0; b < batch; ++b)
        for (int64_t t = first[b]; t < first[b + 1]; ++t) {
            const int64_t begin = (t - first[b]) * DECODE_CHUNK;
            keys[t] = (TaskKey){ctx_slots[b * max_len + begin], lens[b] - begin < DECODE_CHUNK ? lens[b] - begin : DECODE_CHUNK, t};
        }
    qsort(keys, (size_t)tasks, sizeof(TaskKey), task_key_order);
    int64_t used = 0, leads = 0, *run = members + tasks; /* scratch past members: caller sizes it 2 x tasks */
    for (int64_t i = 0; i < tasks;) {
        int64_t j = i;
        while (j < tasks && keys[j].slot == keys[i].slot && keys[j].n == keys[i].n) ++j;
        for (int64_t a = i; a < j; ++a) { /* each task not yet taken leads those of the run with its very slots */
            if (taken[a]) continue;
            int64_t size = 0, b0, c0;
            paged_decode_task(first, batch, keys[a].t, &b0, &c0);
            const int64_t *ref = ctx_slots + b0 * max_len + c0 * DECODE_CHUNK;
            for (int64_t e = a; e < j; ++e) {
                if (taken[e]) continue;
                int64_t b1, c1;
                paged_decode_task(first, batch, keys[e].t, &b1, &c1);
                if (e == a || memcmp(ref, ctx_slots + b1 * max_len + c1 * DECODE_CHUNK, (size_t)keys[a].n * sizeof(int64_t)) == 0) {
                    taken[e] = 1;
                    run[size++] = keys[e].t;
                }
            }
            for (int64_t m = 0; m < size; m += per_lead) {
                /* shares of consecutive members in task order; their leads taken in turn from their shares' places,
                 * so that the threads' contiguous ranges of tasks hold leads alike */
                const int64_t share = size - m < per_lead ? size - m : per_lead, lead = run[m + leads++ % share];
                start[lead] = used, count[lead] = share;
                for (int64_t k = 0; k < share; ++k) {
                    members[used++] = run[m + k];
                    if (run[m + k] != lead) count[run[m + k]] = 0;
                }
            }
        }
        i = j;
    }
    free(keys), free(taken);
    return 0;
}

void paged_decode_tasks(const int64_t *lens, int64_t batch, int64_t *first) {
    first[0] = 0;
    for (int64_t b = 0; b < batch; ++b) first[b + 1] = first[b] + decode_chunks(lens[b]);
}

void paged_decode_task(const int64_t *first, int64_t batch, int64_t t, int64_t *b, int64_t *chunk) {
    int64_t lo = 0, hi = batch; /* the last b with first[b] <= t */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (first[mid] <= t) lo = mid;
        else hi = mid;
    }
    *b = lo, *chunk = t - first[lo];
}

void paged_decode_shared_head(const uint16_t *rows, const int64_t *member, int64_t count, const int64_t *first,
                              int64_t batch, int64_t kv_heads, int64_t g, int64_t group, int64_t dim, const void *k_pool,
                              const void *v_pool, const int64_t *slots, int64_t n, float scale, float *parts,
                              float *part_lse) {
    float out[16 * MAX_DIM], lse[16];
    decode_rows_amx(rows, (int)(count * group), k_pool, v_pool, slots, n, kv_heads, dim, g, scale, out, lse, NULL);
    for (int64_t m = 0; m < count; ++m) {
        int64_t b, c;
        paged_decode_task(first, batch, member[m], &b, &c);
        const int64_t part = decode_part(first, kv_heads, b, g, c);
        memcpy(parts + part * group * dim, out + m * group * dim, (size_t)(group * dim) * sizeof(float));
        memcpy(part_lse + part * group, lse + m * group, (size_t)group * sizeof(float));
    }
}

/* paged_decode_shared_head for every kv head, the members' query rows from q [B, H, D] float32 (bfloat16 values). */
static void attend_shared(const int64_t *member, int64_t count, const int64_t *first, int64_t batch, int64_t heads,
                          int64_t kv_heads, int64_t dim, const float *q, const void *k_pool, const void *v_pool,
                          const int64_t *slots, int64_t n, float scale, float *parts, float *part_lse) {
    const int64_t group = heads / kv_heads;
    uint16_t rows[16 * MAX_DIM];
    for (int64_t g = 0; g < kv_heads; ++g) {
        for (int64_t m = 0; m < count; ++m) {
            int64_t b, c;
            paged_decode_task(first, batch, member[m], &b, &c);
            bf16_upper_halves(q + (b * heads + g * group) * dim, group * dim, rows + m * group * dim);
        }
        paged_decode_shared_head(rows, member, count, first, batch, kv_heads, g, group, dim, k_pool, v_pool, slots, n,
                                 scale, parts, part_lse);
    }
}

/* q [B, H, D] float32; k_pool, v_pool [num_slots, Hkv, D] (bfloat16 when kv_bf16, else float32);
 * slots [B, max_len] int64, of which the first lens[b] (>= 1) are sequence b's context; out
 * [B, H, D] and lse [B, H] float32. q_bf16_exact: every q value is a bfloat16 value (the model
 * computes in bfloat16), which lets the AVX512-BF16 path take q as bfloat16 without rounding.
 * Each (sequence, kv head) in chunks of DECODE_CHUNK keys, merged (paged_decode.h).
 * Returns 0, -1 when a shape is out of the supported range, -3 out of memory. */
int paged_decode_attention(const float *q, const void *k_pool, const void *v_pool, int kv_bf16, int q_bf16_exact,
                           const int64_t *slots, const int64_t *lens, int64_t batch, int64_t heads,
                           int64_t kv_heads, int64_t dim, int64_t max_len, float scale, float *out,
                           float *lse, int num_threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP || dim > MAX_DIM)
        return -1;
    const int64_t group = heads / kv_heads;
    int64_t *first = malloc((size_t)(batch + 1) * sizeof(int64_t));
    if (first == NULL) return -3;
    paged_decode_tasks(lens, batch, first);
    const int64_t tasks = first[batch];
    float *parts = malloc((size_t)(kv_heads * tasks * group * (dim + 1)) * sizeof(float));
    if (parts == NULL) {
        free(first);
        return -3;
    }
    float *part_lse = parts + kv_heads * tasks * group * dim;
    const int tiles = decode_amx_serves(kv_bf16, q_bf16_exact, dim, group);
    int64_t *share = tiles ? malloc((size_t)(4 * tasks + 1) * sizeof(int64_t)) : NULL; /* start, count, members x 2 */
    if (tiles && (share == NULL || paged_decode_share(first, lens, slots, max_len, batch, 16 / group, share,
                                                      share + tasks, share + 2 * tasks) != 0)) {
        free(share), free(parts), free(first);
        return -3;
    }
#pragma omp parallel num_threads(num_threads)
    {
        /* this thread's tasks, in order, each one's K/V asked for while the one before it is attended */
        const int me = omp_get_thread_num(), team = omp_get_num_threads();
        const int64_t lo = tasks * me / team, hi = tasks * (me + 1) / team;
        const int64_t row_bytes = kv_heads * dim * (kv_bf16 ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float));
        KvPrefetch cursor = {k_pool, v_pool, first, lens, slots, batch, max_len, row_bytes, lo, hi, 0, 0, 0, 0, kv_heads, 0};
        if (tiles) decode_amx_configure();
        for (int64_t t = lo; t < hi; ++t) {
            int64_t b, c;
            paged_decode_task(first, batch, t, &b, &c);
            const int64_t begin = c * DECODE_CHUNK, n = lens[b] - begin < DECODE_CHUNK ? lens[b] - begin : DECODE_CHUNK;
            if (tiles && share[tasks + t] != 1) { /* another task's rows attend these keys too: the lead's, at once */
                if (share[tasks + t] > 1)
                    attend_shared(share + 2 * tasks + share[t], share[tasks + t], first, batch, heads, kv_heads, dim,
                                  q, k_pool, v_pool, slots + b * max_len + begin, n, scale, parts, part_lse);
                continue;
            }
            kv_prefetch_before(&cursor, t);
            for (int64_t g = 0; g < kv_heads; ++g) {
                const int64_t part = decode_part(first, kv_heads, b, g, c);
                paged_decode_head(q + (b * heads + g * group) * dim, k_pool, v_pool, kv_bf16, q_bf16_exact,
                                  slots + b * max_len + begin, n, kv_heads, dim, g, group, scale,
                                  parts + part * group * dim, part_lse + part * group, &cursor);
            }
        }
        if (tiles) decode_amx_release();
#pragma omp barrier
#pragma omp for collapse(2)
        for (int64_t b = 0; b < batch; ++b) {
            for (int64_t g = 0; g < kv_heads; ++g) {
                const int64_t part = decode_part(first, kv_heads, b, g, 0), head = b * heads + g * group;
                paged_decode_merge(parts + part * group * dim, part_lse + part * group, decode_chunks(lens[b]), group,
                                   dim, out + head * dim, lse + head);
            }
        }
    }
    free(share);
    free(parts);
    free(first);
    return 0;
}

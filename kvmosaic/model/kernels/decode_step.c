/* A decode step of a Llama-family decoder in one parallel region: every layer's RMSNorms, the
 * Q/K/V, output, gate/up and down projections, RoPE, the KV write and the paged attention, for a
 * batch of one-token sequences, with no return to Python and no thread fork between operators.
 * At decode on a CPU the weights stream from memory once per step and everything else is small:
 * what separates a step from the memory-bandwidth floor is the ~20 operator calls per layer
 * (dispatch, a thread-pool wake-up each), not arithmetic. See kvmosaic/model/fused_decode.py
 * and docs/ARCHITECTURE.md ("The fused decode step").
 *
 * In bfloat16 and float32 (decode_step_layers.h, once per dtype). Numerics are the layer-by-layer
 * path's (model/llama.py), rounding where it rounds:
 * RMSNorm and RoPE are the same row functions (elementwise.h), attention the same kernel
 * (paged_decode.h); a projection sums its bfloat16 products in float32 (VDPBF16PS, products
 * exact; float32: FMA) and rounds to the dtype as torch does, in another summation order; SiLU is
 * x / (1 + exp(-x)) in float32, rounded, and the product with up rounded, as torch computes them.
 *
 * Every (row, channel) dot product runs the same instructions in the same order whatever the
 * batch (rows are tiled, weights read once per tile): a sequence's result does not depend on
 * the other sequences of the step, for any batch size.
 */
#include <omp.h>
#include <stdlib.h>

#include "amx.h"
#include "elementwise.h"
#include "paged_decode.h"
#include "q4_1_avx2.h"
#include "q4_1_bf16.h"

/* A projection's weight: rows in the step's dtype (d NULL), or a GGUF's Q4_1 blocks (w the
 * nibbles, d and m the scales and minima widened; kernels/__init__.py's Q4_1Weights). */
typedef struct {
    const void *w;
    const float *d, *m;
} Weight;

/* float32 needs AVX-512, or AVX2 with FMA (8 lanes: a tile of fewer rows, so that the accumulators,
 * weight vectors and x fit the 16 ymm registers); bfloat16 needs AVX512-BF16. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define FUSED_F32 1
#include <immintrin.h>

#define CHANNELS 4  /* output channels per tile: their weight rows are read once per tile */
#if defined(__AVX512F__)
#define ROWS 4      /* batch rows per tile */
#else
#define ROWS 2
#endif
#define PER_LAYER 16 /* pointers per layer: see decode_step */
/* Phase timers, compiled in only for benchmarks/decode_phases.py (-DKVMOSAIC_PHASE_TIMERS, through
 * KVMOSAIC_KERNEL_DEFINES): the seconds thread 0 spent in each phase of the layers, summed over steps
 * until the caller zeroes them. A phase ends at thread 0's next mark, so the barrier that closes it
 * (and any wait for the other thread) counts in it. */
#define DECODE_PHASES 6 /* norm + qkv, attention, merge + o, norm + gate_up, down, final norm + head */
#ifdef KVMOSAIC_PHASE_TIMERS
double decode_phase_seconds[DECODE_PHASES];
#define PHASE_START double phase_t = omp_get_wtime()
#define PHASE_MARK(i)                                                                                                  \
    if (me == 0) {                                                                                                     \
        const double phase_now = omp_get_wtime();                                                                      \
        decode_phase_seconds[i] += phase_now - phase_t;                                                                \
        phase_t = phase_now;                                                                                           \
    }
#else
#define PHASE_START
#define PHASE_MARK(i)
#endif
/* What decode_step's attention tasks share (decode_step_layers.h's attention_task). */
typedef struct {
    const int64_t *first, *lens, *ctx_slots, *slot_mapping;
    const float *cos, *signed_sin;
    int64_t batch, max_len, kv_heads, group, dim, q_width, kv_width, qkv_width;
    float scale;
    float *parts, *part_lse;
    /* where chunks of several rows' contexts are the same keys (paged_decode_share; NULL: not sought): the lead
     * task of each attends them for all its members at once, on the tiles */
    const int64_t *share_start, *share_count, *share_members;
} AttentionStep;

/* Each thread's attention tasks are fixed in advance (static_share: the tasks are equal chunks of
 * keys but a row's last), and where the caller asks (kv_ahead bytes a layer, decode_step's argument)
 * its QKV projection asks for their K and V rows into L2 a few rows per weight tile
 * (kv_prefetch_tile; lines pushed out of L2 wait in the L3). On the Zen 4 EPYC attention alone waited
 * on those reads at ~16 GB/s with the memory otherwise idle, and beside the projection's stream they
 * came in at its rate (up to 4 MB a layer: the step 1.5-3.5% faster at batch 1, 3-10% at 4, 4% at 8,
 * 9% at 16, the same at 32); on the AMX Xeon the same made the step slower at every batch (5-8% at 1,
 * 20% at 8, 30% at 16: BENCHMARKS.md, issue 26, ninth session). Prefetches only: the results do not
 * change. */
/* A weight tile's share of the thread's K/V rows: the rows asked for per tile (per_tile). */
INLINE void kv_prefetch_tile(KvPrefetch *kv) {
    if (kv != NULL) kv_prefetch_rows(kv, kv->per_tile);
}

/* [lo, hi) of n iterations for thread me of team: schedule(static)'s split, as libgomp makes it. */
INLINE void static_share(int64_t n, int me, int team, int64_t *lo, int64_t *hi) {
    const int64_t q = n / team, r = n % team;
    *lo = q * me + (me < r ? me : r);
    *hi = *lo + q + (me < r);
}

/* Where a tile's weights are read once (prefetch_next false: decode tiles, a batch of at most ROWS rows), they are
 * asked for this many bytes ahead of the loads, the hardware's stream prefetch alone running short in some minutes: a
 * bfloat16 step of the shipped model at one row on a Zen 5 EPYC 5.5 -> 4.9 and 5.8 -> 5.4 ms in fast-memory minutes
 * (~80 GB/s read), 7.5 -> 6.7 in slow ones (~50) of one hour and no different in a later hour's; float32 ~3%; 4 KB
 * ahead close, 16 KB and into L2 (T1) less; never slower (BENCHMARKS.md, eighteenth session). Asked for as
 * non-temporal (NTA): lines read once a step need not push out of the caches what the next step reads again (the
 * context's K and V, the interpreter's own working set between steps): at one row 2.8% off the bfloat16 step in a
 * fast-memory minute, 3.1-4.6% in slow ones, each in every round of an in-process A/B; float32 2.7% in one run, 0.9%
 * in another (4 rounds of 6); no different at 4 or 16 rows (and where the next tile is asked for, batch > ROWS, T0
 * stays: no different either; benchmarks/kernel_ab.py, twentieth session). */
#ifndef TILE_AHEAD_BYTES
#define TILE_AHEAD_BYTES 8192
#endif
#ifndef TILE_AHEAD_HINT
#define TILE_AHEAD_HINT _MM_HINT_NTA
#endif
#define PF_TILES 4 /* prefetch the weight rows this many tiles ahead: ~2-4% over one (measured, AVX2 EPYC) */

/* The weights of the step's projections are laid out in decode tiles (decode_tile_shape,
 * model/decode_tiles.py): a tile's CHANNELS rows occupy the same CHANNELS * in elements as in row order, interleaved by
 * LANES (float32; LANES_BF16 for bfloat16: one vector load), so that a tile is read as one sequential stream, (c, i) at
 * (i / LANES) * CHANNELS * LANES + c * LANES + i % LANES. An AMD EPYC's hardware prefetcher follows one
 * stream better than CHANNELS rows read side by side: ~10-15% more read bandwidth in float32 (AVX2 EPYC), ~1.5x
 * in bfloat16 (Zen 4); an AMX Xeon reads the rows (prefetched by hand) ~1.1x / ~1.5x faster (BENCHMARKS.md).
 * So the layout is a runtime argument (``tiled``), chosen per CPU (model/decode_tiles.py's interleave). The
 * products and their order are those of the row layout. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
/* The dense weights' layouts (decode_step's ``layout``; model/decode_tiles.py): rows, decode tiles, or
 * (bfloat16 on a CPU with AMX) the tile unit's blocks (AMX_BLOCK). */
#define LAYOUT_ROWS 0
#define LAYOUT_TILES 1
#define LAYOUT_AMX 2

/* The weight vector of channel c at element i (a multiple of LANES) of a tile at w. */
INLINE const float *tile_f32_at(const float *w, int64_t in, int tiled, int c, int64_t i) {
    return tiled ? w + i * CHANNELS + c * LANES : w + c * in + i;
}

/* Whether a projection over ``batch`` rows prefetches each next tile's weights by hand. Rows: always
 * (~3-5% over the hardware prefetcher alone, measured). Tiles are one stream, which the hardware
 * prefetcher follows while a tile's products are one row's; once several row groups share a tile its
 * products take as long as its load and the prefetcher falls behind (bfloat16, batch 16: the
 * projections 17.5 -> 14 ms a step on a Zen 4 EPYC; at batch 4 and below prefetching was slower). */
INLINE int prefetch_next(int tiled, int64_t batch) { return !tiled || batch > ROWS; }

#if defined(__AVX512F__)
/* out[r][c] = x_r . w_c for a tile of CHANNELS float32 weight rows at w (decode tiles when
 * tiled, else rows) and nr rows of x (in % 16 == 0); prefetch: fetch the next tile's lines ahead
 * (see prefetch_next). */
INLINE void dot_tile_f32(const float *w, int64_t in, int tiled, int prefetch, const float *x, int64_t x_stride,
                         const int nr, float out[ROWS][CHANNELS]) {
    __m512 acc[ROWS][CHANNELS];
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < CHANNELS; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
        __m512 wv[CHANNELS];
        for (int c = 0; c < CHANNELS; ++c) {
            if (prefetch)
                _mm_prefetch((const char *)(tiled ? tile_f32_at(w, in, 1, c, i) + CHANNELS * in : w + (c + CHANNELS) * in + i),
                             _MM_HINT_T0);
            else /* tiled */
                _mm_prefetch((const char *)tile_f32_at(w, in, 1, c, i) + TILE_AHEAD_BYTES, TILE_AHEAD_HINT);
            wv[c] = _mm512_loadu_ps(tile_f32_at(w, in, tiled, c, i));
        }
        for (int r = 0; r < nr; ++r) {
            const __m512 xv = _mm512_loadu_ps(x + r * x_stride + i);
            for (int c = 0; c < CHANNELS; ++c) acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < CHANNELS; ++c) out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}
#else
INLINE float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* dot_tile_f32 on AVX2: the same contract, 8 lanes (in % 8 == 0); rows are prefetched PF_TILES
 * tiles ahead, tiles left to the hardware prefetcher (measured on the AVX2 EPYC at one row only). */
INLINE void dot_tile_f32(const float *w, int64_t in, int tiled, int prefetch, const float *x, int64_t x_stride,
                         const int nr, float out[ROWS][CHANNELS]) {
    __m256 acc[ROWS][CHANNELS];
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < CHANNELS; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < in; i += 8) {
        __m256 wv[CHANNELS];
        for (int c = 0; c < CHANNELS; ++c) {
            if (prefetch && !tiled && i % 16 == 0)
                _mm_prefetch((const char *)(w + (c + PF_TILES * CHANNELS) * in + i), _MM_HINT_T0);
            wv[c] = _mm256_loadu_ps(tile_f32_at(w, in, tiled, c, i));
        }
        for (int r = 0; r < nr; ++r) {
            const __m256 xv = _mm256_loadu_ps(x + r * x_stride + i);
            for (int c = 0; c < CHANNELS; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < CHANNELS; ++c) out[r][c] = sum8(acc[r][c]);
}
#endif

#if defined(Q4_1_AVX2)
/* The Q4_1 counterparts of project and gate_up_silu (float32; q4_1_avx2.h's sums, which the layer
 * path's q4_1_matmul runs too). xsum: this thread's [batch, in / 32] buffer for x's block sums. */
static void project_q4_1(Weight w, int64_t in, int64_t out, const float *x, int64_t batch, float *y, float *xsum) {
    const int64_t nblocks = in / 32;
    q4_1_block_sums(x, in, batch, in, xsum);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < out / Q4_1_TILE_CHANNELS; ++t) {
        const int64_t o = t * Q4_1_TILE_CHANNELS;
        for (int64_t r0 = 0; r0 < batch; r0 += Q4_1_TILE_ROWS) {
            const int nr = batch - r0 < Q4_1_TILE_ROWS ? (int)(batch - r0) : Q4_1_TILE_ROWS;
            float dots[Q4_1_TILE_ROWS][Q4_1_TILE_CHANNELS];
            q4_1_tile((const uint8_t *)w.w + o * nblocks * 16, w.d + o * nblocks, w.m + o * nblocks, nblocks,
                      x + r0 * in, in, xsum + r0 * nblocks, nr, Q4_1_TILE_CHANNELS, dots);
            for (int r = 0; r < nr; ++r)
                for (int c = 0; c < Q4_1_TILE_CHANNELS; ++c) y[(r0 + r) * out + o + c] = dots[r][c];
        }
    }
}

static void gate_up_silu_q4_1(Weight w, int64_t in, int64_t inter, const float *x, int64_t batch, float *act,
                              float *xsum) {
    const int64_t nblocks = in / 32, up = inter * nblocks;
    q4_1_block_sums(x, in, batch, in, xsum);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < inter / Q4_1_TILE_CHANNELS; ++t) {
        const int64_t o = t * Q4_1_TILE_CHANNELS;
        const uint8_t *qs = (const uint8_t *)w.w + o * nblocks * 16;
        for (int64_t r0 = 0; r0 < batch; r0 += Q4_1_TILE_ROWS) {
            const int nr = batch - r0 < Q4_1_TILE_ROWS ? (int)(batch - r0) : Q4_1_TILE_ROWS;
            float gate[Q4_1_TILE_ROWS][Q4_1_TILE_CHANNELS], u[Q4_1_TILE_ROWS][Q4_1_TILE_CHANNELS];
            q4_1_tile(qs, w.d + o * nblocks, w.m + o * nblocks, nblocks, x + r0 * in, in, xsum + r0 * nblocks, nr,
                      Q4_1_TILE_CHANNELS, gate);
            q4_1_tile(qs + up * 16, w.d + up + o * nblocks, w.m + up + o * nblocks, nblocks, x + r0 * in, in,
                      xsum + r0 * nblocks, nr, Q4_1_TILE_CHANNELS, u);
            for (int r = 0; r < nr; ++r)
                for (int c = 0; c < Q4_1_TILE_CHANNELS; ++c) act[(r0 + r) * inter + o + c] = silu(gate[r][c]) * u[r][c];
        }
    }
}
#endif

#if defined(Q4_1_BF16_DOT)
/* The Q4_1 counterparts of project and gate_up_silu for bfloat16 x (q4_1_bf16.h's sums, which the layer path's
 * q4_1_matmul runs too), each result rounded to bfloat16 as it stores them; gate and up rounded, silu and the
 * product as the dense step's (and the layer path's silu_mul). xsum: this thread's [batch, in / 32] buffer. */
static void project_q4_1_bf16(Weight w, int64_t in, int64_t out, const uint16_t *x, int64_t batch, uint16_t *y,
                              float *xsum) {
    const int64_t nblocks = in / 32;
    q4_1_block_sums_bf16(x, in, batch, in, xsum);
#pragma omp for schedule(static)
    for (int64_t o = 0; o < out; ++o) {
        for (int64_t r0 = 0; r0 < batch; r0 += Q4_1_BF16_ROWS) {
            const int nr = batch - r0 < Q4_1_BF16_ROWS ? (int)(batch - r0) : Q4_1_BF16_ROWS;
            float dots[Q4_1_BF16_ROWS];
            q4_1_channel_bf16((const uint8_t *)w.w + o * nblocks * 16, w.d + o * nblocks, w.m + o * nblocks, nblocks,
                              x + r0 * in, in, xsum + r0 * nblocks, nr, dots);
            for (int r = 0; r < nr; ++r) y[(r0 + r) * out + o] = float_to_bf16(dots[r]);
        }
    }
}

static void gate_up_silu_q4_1_bf16(Weight w, int64_t in, int64_t inter, const uint16_t *x, int64_t batch,
                                   uint16_t *act, float *xsum) {
    const int64_t nblocks = in / 32, up = inter * nblocks;
    q4_1_block_sums_bf16(x, in, batch, in, xsum);
#pragma omp for schedule(static)
    for (int64_t o = 0; o < inter; ++o) {
        const uint8_t *qs = (const uint8_t *)w.w + o * nblocks * 16;
        for (int64_t r0 = 0; r0 < batch; r0 += Q4_1_BF16_ROWS) {
            const int nr = batch - r0 < Q4_1_BF16_ROWS ? (int)(batch - r0) : Q4_1_BF16_ROWS;
            float gate[Q4_1_BF16_ROWS], u[Q4_1_BF16_ROWS];
            q4_1_channel_bf16(qs, w.d + o * nblocks, w.m + o * nblocks, nblocks, x + r0 * in, in, xsum + r0 * nblocks,
                              nr, gate);
            q4_1_channel_bf16(qs + up * 16, w.d + up + o * nblocks, w.m + up + o * nblocks, nblocks, x + r0 * in, in,
                              xsum + r0 * nblocks, nr, u);
            for (int r = 0; r < nr; ++r)
                act[(r0 + r) * inter + o] = silu_times_up_bf16(gate[r], u[r]);
        }
    }
}
#endif

#define ELEM float
#define NAME(f) f##_f32
#define TO_F(x) (x)
#define FROM_F(x) (x)
#define ROUND(x) (x)
#define IS_BF16 0
#include "decode_step_layers.h"
#undef ELEM
#undef NAME
#undef TO_F
#undef FROM_F
#undef ROUND
#undef IS_BF16

#if defined(__AVX512BF16__)
#define LANES_BF16 32 /* bfloat16 elements in one vector: a decode tile's interleave */

/* The weight vector of channel c at element i (a multiple of LANES_BF16) of a bfloat16 tile at w. */
INLINE const uint16_t *tile_bf16_at(const uint16_t *w, int64_t in, int tiled, int c, int64_t i) {
    return tiled ? w + i * CHANNELS + c * LANES_BF16 : w + c * in + i;
}

/* out[r][c] = x_r . w_c for a tile of CHANNELS bfloat16 weight rows at w (decode tiles when tiled,
 * else rows) and nr rows of x (in % 32 == 0); prefetch as dot_tile_f32's. */
INLINE void dot_tile_bf16(const uint16_t *w, int64_t in, int tiled, int prefetch, const uint16_t *x,
                          int64_t x_stride, const int nr, float out[ROWS][CHANNELS]) {
    __m512 acc[ROWS][CHANNELS];
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < CHANNELS; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += LANES_BF16) {
        __m512bh wv[CHANNELS];
        for (int c = 0; c < CHANNELS; ++c) {
            if (prefetch)
                _mm_prefetch((const char *)(tiled ? tile_bf16_at(w, in, 1, c, i) + CHANNELS * in : w + (c + CHANNELS) * in + i),
                             _MM_HINT_T0);
            else /* tiled */
                _mm_prefetch((const char *)tile_bf16_at(w, in, 1, c, i) + TILE_AHEAD_BYTES, TILE_AHEAD_HINT);
            wv[c] = (__m512bh)_mm512_loadu_si512(tile_bf16_at(w, in, tiled, c, i));
        }
        for (int r = 0; r < nr; ++r) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * x_stride + i);
            for (int c = 0; c < CHANNELS; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
        }
    }
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < CHANNELS; ++c) out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

#if defined(KVMOSAIC_AMX)
/* Decode projections on the tile unit (LAYOUT_AMX). A weight [out, in] is kept as B tiles: for each
 * block of 16 output channels, its in / 32 tiles in order, each 16 pairs of inputs x 16 channels x 2
 * (AMX_BLOCK elements, 1 KB: channel n's inputs 2p and 2p + 1 at (p * 16 + n) * 2), so that a thread's
 * share of the blocks is one sequential stream. The batch's rows are the A tiles, 16 rows each (past
 * AMX_MAX_BATCH rows, tiles of 32 rows over zero-padded buffers); a tile product computes each output
 * from its own row alone, in an order the hardware fixes: a row's result does not depend on the batch. On an AMX Xeon the four projections of
 * 30 layers streamed at ~25 GB/s at 1 to 16 rows, against ~17 for oneDNN's packed GEMMs (BENCHMARKS.md,
 * issue 26, ninth session). */
#define AMX_BLOCK 512
#define AMX_MAX_BATCH 32 /* rows in two A tiles; past them, tiles of 32 rows (the step's buffers padded with zero rows) */
/* B tiles asked for ahead (the distance mattered little from 4 to 32): into L1 for one tile of rows (at one
 * row, the step 11.7-12.1 against 12.3-12.7 ms into L2), into L2 for two, whose A tiles L1 must keep (at 32
 * rows, 10.5 against 12.8-13.4 ms for the projections alone). */
#define AMX_AHEAD 8

/* The tiles of 32 rows a batch takes: one (of one or two A tiles) up to AMX_MAX_BATCH rows; past them whole
 * tiles of 32 over rows padded with zeros (the caller's buffers). */
static inline int64_t amx_groups(int64_t batch) {
    return batch <= AMX_MAX_BATCH ? 1 : (batch + AMX_MAX_BATCH - 1) / AMX_MAX_BATCH;
}

/* Tiles: 0 and 1 the products of rows 0-15 (a projection's in 0; gate in 0, up in 1), 2 and 3 those of
 * rows 16-31, 4 and 5 the A tiles of rows 0-15 and 16-31, 6 the B tile. */
static void amx_configure_step(int64_t batch) {
    if (batch > AMX_MAX_BATCH) batch = AMX_MAX_BATCH;
    const uint8_t lo = batch < 16 ? (uint8_t)batch : 16, hi = batch > 16 ? (uint8_t)(batch - 16) : 0;
    const uint8_t rows[8] = {lo, lo, hi, hi, lo, hi, 16, 0};
    amx_configure(rows);
}

/* Tiles C (rows 0-15) and C2 (rows 16-31, where two) += the rows of x ([rows, in], row stride ld) . the nk B tiles
 * at b; the tile numbers are literals (the instructions name their registers). */
#define AMX_DOTS(C, C2, b, x, ld)                                                                                               \
    for (int64_t kb = 0; kb < nk; ++kb) {                                                                              \
        const char *ahead = (const char *)((b) + (kb + AMX_AHEAD) * AMX_BLOCK);                                        \
        if (two)                                                                                                       \
            for (int line = 0; line < AMX_BLOCK * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);             \
        else                                                                                                           \
            for (int line = 0; line < AMX_BLOCK * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);             \
        _tile_loadd(6, (b) + kb * AMX_BLOCK, 64);                                                                      \
        _tile_loadd(4, (x) + kb * 32, (ld) * 2);                                                                       \
        _tile_dpbf16ps(C, 4, 6);                                                                                       \
        if (two) {                                                                                                     \
            _tile_loadd(5, (x) + 16 * (ld) + kb * 32, (ld) * 2);                                                       \
            _tile_dpbf16ps(C2, 5, 6);                                                                                  \
        }                                                                                                              \
    }

/* sums [batch][16] of tiles C (rows 0-15) and C2 (rows 16-31, where two) */
#define AMX_STORE(C, C2, sums)                                                                                             \
    _tile_stored(C, (sums)[0], 64);                                                                                    \
    if (two) _tile_stored(C2, (sums)[16], 64);

/* y [batch, out] = x [batch, in] @ w^T rounded to bfloat16 (with y NULL, the same values widened to float32
 * into yf: logits), w in B tiles; shared out among the team by blocks of 16 channels (ends with the team's
 * barrier); kv: K/V rows asked for as the blocks go, as project_rows asks per tile of CHANNELS. Past
 * AMX_MAX_BATCH rows x holds amx_groups(batch) * 32 rows (tiles configured by amx_configure_step), each
 * block's B tiles read from memory once for them all, and only the first batch rows are written. */
static void project_amx(const uint16_t *w, int64_t in, int64_t out, const uint16_t *x, int64_t x_stride, int64_t batch,
                        uint16_t *y, float *yf, KvPrefetch *kv) {
    const int64_t nk = in / 32, groups = amx_groups(batch);
    float sums[AMX_MAX_BATCH][16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t cb = 0; cb < out / 16; ++cb) {
        for (int i = 0; i < 16 / CHANNELS; ++i) kv_prefetch_tile(kv);
        const uint16_t *b = w + cb * nk * AMX_BLOCK;
        for (int64_t group = 0; group < groups; ++group) {
            const int64_t r0 = group * AMX_MAX_BATCH, rows = batch - r0 < AMX_MAX_BATCH ? batch - r0 : AMX_MAX_BATCH;
            const int two = groups > 1 || batch > 16;
            _tile_zero(0);
            if (two) _tile_zero(2);
            AMX_DOTS(0, 2, b, x + r0 * x_stride, x_stride)
            AMX_STORE(0, 2, sums)
            for (int64_t r = 0; r < rows; ++r) {
                const __m512 f = _mm512_load_ps(sums[r]);
                if (y != NULL)
                    store_bf16x16(y + (r0 + r) * out + cb * 16, f);
                else
                    _mm512_storeu_ps(yf + (r0 + r) * out + cb * 16, round_bf16x16(f));
            }
        }
    }
}

/* silu(gate) * up on 16 lanes of float32 sums, as elementwise.h's silu_mul_row rounds the GEMM's rounded outputs:
 * gate and up rounded to bfloat16, silu16, silu rounded, the product (rounded by the caller's
 * store_bf16x16, which flushes subnormals as silu_mul_row's store does). */
static inline __m512 silu_times_up(__m512 gate, __m512 up) {
    return _mm512_mul_ps(round_bf16x16(silu16(round_bf16x16(gate))), round_bf16x16(up));
}

/* act [batch, inter] = silu(gate) * up as gate_up_silu computes it (gate and up rounded, silu and the
 * product too), gate and up from w [2 * inter, in] in B tiles; x's rows as project_amx's. */
static void gate_up_silu_amx(const uint16_t *w, int64_t in, int64_t inter, const uint16_t *x, int64_t batch,
                             uint16_t *act) {
    const int64_t nk = in / 32, groups = amx_groups(batch);
    const int two = groups > 1 || batch > 16;
    float gate[AMX_MAX_BATCH][16] __attribute__((aligned(64))), up[AMX_MAX_BATCH][16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t cb = 0; cb < inter / 16; ++cb) {
        const uint16_t *g = w + cb * nk * AMX_BLOCK, *u = w + (inter / 16 + cb) * nk * AMX_BLOCK;
        for (int64_t group = 0; group < groups; ++group) {
            const int64_t r0 = group * AMX_MAX_BATCH, rows = batch - r0 < AMX_MAX_BATCH ? batch - r0 : AMX_MAX_BATCH;
            _tile_zero(0);
            _tile_zero(1);
            if (two) {
                _tile_zero(2);
                _tile_zero(3);
            }
            AMX_DOTS(0, 2, g, x + r0 * in, in)
            AMX_DOTS(1, 3, u, x + r0 * in, in)
            AMX_STORE(0, 2, gate)
            AMX_STORE(1, 3, up)
            for (int64_t r = 0; r < rows; ++r)
                for (int c = 0; c < 16; ++c)
                    act[(r0 + r) * inter + cb * 16 + c] = silu_times_up_bf16(gate[r][c], up[r][c]);
        }
    }
}
/* Prompt-sized products on the tile unit (linear_amx past AMX_MAX_BATCH rows): 32 rows x 32 channels at a time
 * (C tiles 0-3, A tiles 4-5, B tiles 6-7: each tile loaded feeds two products), a thread's share of the channel
 * pairs (or of the rows: AMX_ROW_SHARE_GROUPS), the rows in passes of amx_pass_groups x 32 that stay in L2 while the
 * thread's pairs pass over them. Each C tile is zeroed and summed over the input in project_amx's order (kb = 0, 1,
 * ...) from the same A and B tiles: a row's bits are project_amx's, at any number of rows. On a 2-core AMX Xeon
 * ~3,000-3,500 GFLOP/s over this model's four projections at 745 rows as a forward meets their weights in a
 * harness (BENCHMARKS.md, issue 26, sixteenth session); which spans take it: model/prompt_gemms.py. */
/* The rows of one pass over a thread's output blocks: as many groups of 32 as fit in AMX_GEMM_PASS_BYTES of
 * bfloat16 input (L2 is 2 MB a core on the AMX Xeon), so that each block's B tiles come from memory or L3 once
 * for all of them. At four groups a pass (the thirteenth session's) the blocks' B tiles streamed from L3 at
 * ~11 GB/s a core, below what the tile products consume: in a harness over gate/up's weights at 745 rows on
 * one core, 1,460 GFLOP/s at 4 groups a pass, 1,750 at 24 with the next block's B tiles asked for ahead; over
 * the model's four projections (benchmarks/prompt_gemms.py) -8% at 745 rows, -20% at 140 (BENCHMARKS.md,
 * issue 26, fourteenth session). 512 KB and 1.5 MB passes were no faster. */
#define AMX_GEMM_PASS_BYTES (1 << 20)

static inline int64_t amx_pass_groups(int64_t in) {
    const int64_t groups = AMX_GEMM_PASS_BYTES / (32 * in * 2);
    return groups > 1 ? groups : 1;
}

/* The B tiles of a thread's next output block, asked for into L2 a few lines per step of the current block's
 * input loops (spread over its pass): ranges [a, a + bytes) and [b, b + bytes) (b NULL: one range). */
typedef struct {
    const char *a, *b;
    int64_t bytes, at, per_step;
} BAhead;

static inline __attribute__((always_inline)) void b_ahead(BAhead *ahead) {
    for (int64_t i = 0; i < ahead->per_step && ahead->at < ahead->bytes; ++i, ahead->at += 64) {
        _mm_prefetch(ahead->a + ahead->at, _MM_HINT_T1);
        if (ahead->b != NULL) _mm_prefetch(ahead->b + ahead->at, _MM_HINT_T1);
    }
}

/* A block of a prompt-sized product waiting to be finished: its sums (32 rows x 32 channels: C tiles 0 | 1 over
 * 2 | 3) rounded to bfloat16 and stored, or for SiLU . up (gate's 16 channels | up's 16) turned into 16 outputs.
 * Each block is finished while the tile unit sums the next one, a few rows per step of its input loop
 * (amx_block), so the vector work and the tile products overlap instead of taking turns: over this model's 30
 * layers at 745 rows the fused SiLU . up took 50 ms finishing each block after it, 33 with the next one. */
typedef struct {
    float sums[32][32] __attribute__((aligned(64)));
    uint16_t *y; /* the block's first output: row r at y + r * stride */
    int64_t stride, rows, channels, done;
} Pending;

/* Finishes the pending block's rows up to ``end``. Plain: the sums rounded as project_amx rounds them
 * (VCVTNEPS2BF16: torch's rounding, subnormals flushed as oneDNN's GEMMs flush them); silu: silu_times_up (the
 * same bits as the plain product then silu_mul). */
static inline __attribute__((always_inline)) void finish_rows(Pending *p, int64_t end, const int silu) {
    for (; p->done < end && p->done < p->rows; ++p->done) {
        const float *sums = p->sums[p->done];
        uint16_t *y = p->y + p->done * p->stride;
        if (silu) {
            store_bf16x16(y, silu_times_up(_mm512_load_ps(sums), _mm512_load_ps(sums + 16)));
        } else {
            store_bf16x16(y, _mm512_load_ps(sums));
            if (p->channels == 32) store_bf16x16(y + 16, _mm512_load_ps(sums + 16));
        }
    }
}

/* One block: C tiles 0-3 = 32 rows at a (row stride lda; rows 16-31 only where rows > 16) times the B tiles of one
 * or two blocks of 16 channels (b1 NULL: one; tiles 1 and 3 for b1), each zeroed and summed over the input in
 * project_amx's order (kb = 0, 1, ...), so a row's bits are project_amx's at any number of rows; meanwhile the
 * pending block is finished; then this block's sums are pending, its outputs at y (row stride ``stride``).
 * Each input step loads its four tiles before its four products (the tile registers are not renamed: a load
 * waits for the products reading its register, and loads issued first overlap the products before them), and
 * the A tiles, which stream from L2 through the pass, with the non-temporal hint (TILELOADDT1), so that L1 keeps
 * the block's B tiles for the pass's other groups: on one core of the AMX Xeon a loop over 24 groups of 32 rows
 * went from ~2,000 to ~3,100 GFLOP/s of the ~3,700 the products alone reach, the model's four projections at 745
 * rows over 30 layers 57 to 49 ms on two cores (BENCHMARKS.md, issue 26, sixteenth session). */
static inline __attribute__((always_inline)) void amx_block(const uint16_t *a, int64_t in, int64_t lda, const uint16_t *b0,
                                                            const uint16_t *b1, int64_t rows, uint16_t *y,
                                                            int64_t stride, Pending *p, BAhead *ahead, const int silu) {
    const int64_t nk = in / 32, per_step = (32 + nk - 1) / nk;
    const int two = rows > 16;
    _tile_zero(0);
    if (two) _tile_zero(2);
    if (b1 != NULL) _tile_zero(1);
    if (b1 != NULL && two) _tile_zero(3);
    for (int64_t kb = 0; kb < nk; ++kb) {
        _tile_stream_loadd(4, a + kb * 32, lda * 2);
        _tile_loadd(6, b0 + kb * AMX_BLOCK, 64);
        if (b1 != NULL) _tile_loadd(7, b1 + kb * AMX_BLOCK, 64);
        if (two) _tile_stream_loadd(5, a + 16 * lda + kb * 32, lda * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (b1 != NULL) _tile_dpbf16ps(1, 4, 7);
        if (two) _tile_dpbf16ps(2, 5, 6);
        if (b1 != NULL && two) _tile_dpbf16ps(3, 5, 7);
        finish_rows(p, (kb + 1) * per_step, silu);
        b_ahead(ahead);
    }
    finish_rows(p, 32, silu);
    _tile_stored(0, p->sums[0], 128);
    if (two) _tile_stored(2, p->sums[16], 128);
    if (b1 != NULL) _tile_stored(1, p->sums[0] + 16, 128);
    if (b1 != NULL && two) _tile_stored(3, p->sums[16] + 16, 128);
    p->y = y, p->stride = stride, p->rows = rows, p->channels = b1 != NULL ? 32 : 16, p->done = 0;
}

/* From this many groups of 32 rows a thread, a team shares a prompt-sized product by its rows (each thread its groups,
 * every output channel) instead of by its output channels (each thread every row, its share of the channels). A
 * thread's rows are then those the row kernels before it wrote on the same core (rms_norm, rope_store and the like
 * share rows as static schedules do), and its outputs those the next row kernel reads there: at 745 rows a
 * prefill's activations no longer cross between the cores' caches between the products (the four products over
 * 30 layers ~8 ms faster in process, 103 -> 95 ms the prefill, on the 2-core AMX Xeon). Each thread then reads every
 * weight, which costs where the rows are few: at 300 rows 3% slower, at 500 6% faster, at 1,500 12%
 * (BENCHMARKS.md, issue 26, sixteenth session). Either way each output is the same sum in the same order. */
#define AMX_ROW_SHARE_GROUPS 6

/* The prompt-sized products, in the calling team: the rows in groups of 32 (the last one from ``tail``: its rows
 * copied there after zeros, 32 x in; the others at x, x_stride elements apart), shared out by output blocks or by
 * groups (AMX_ROW_SHARE_GROUPS), in passes of amx_pass_groups groups that stay in L2 while a thread's output blocks
 * pass over them, each output block one amx_block per group, the next block's B tiles asked for meanwhile (BAhead).
 * Plain (silu 0): y [batch, out] = x @ w^T (y's rows y_stride elements apart), an output block 32 channels (two
 * blocks of B tiles; 16 for an odd last one). silu: y [batch, out] = silu(gate) * up, gate and up the two halves of
 * x @ w^T (w [2 * out, in]: the gate's blocks, then the up's), an output block 16 channels from a block of gate
 * channels and the same block of up channels. */
static void gemm_amx_blocks(const uint16_t *w, int64_t in, int64_t out, const uint16_t *x, int64_t x_stride,
                            const uint16_t *tail, int64_t batch, uint16_t *y, int64_t y_stride, const int silu) {
    const int64_t nk = in / 32, blocks = out / 16, groups = (batch + 31) / 32, width = silu ? 1 : 2;
    const int64_t pass = amx_pass_groups(in), block_bytes = nk * AMX_BLOCK * 2;
    const int me = omp_get_thread_num(), team = omp_get_num_threads();
    const int64_t units = (blocks + width - 1) / width;
    int64_t lo = 0, hi = units, g_lo = 0, g_hi = groups; /* this thread's output units and groups of rows */
    if (groups >= AMX_ROW_SHARE_GROUPS * team)
        static_share(groups, me, team, &g_lo, &g_hi);
    else
        static_share(units, me, team, &lo, &hi);
    Pending pending = {.rows = 0};
    for (int64_t g0 = g_lo; g0 < g_hi; g0 += pass) {
        const int64_t g1 = g0 + pass < g_hi ? g0 + pass : g_hi, steps = (g1 - g0) * nk;
        for (int64_t unit = lo; unit < hi; ++unit) {
            const int64_t cb = width * unit;
            const uint16_t *b0 = w + cb * nk * AMX_BLOCK;
            const uint16_t *b1 = silu ? w + (blocks + cb) * nk * AMX_BLOCK : cb + 1 < blocks ? b0 + nk * AMX_BLOCK : NULL;
            BAhead ahead = {.bytes = 0, .at = 0, .per_step = 0};
            if (unit + 1 < hi) { /* the next block's tiles: the gate's and the up's (silu), or 16-32 channels' */
                const int64_t next = cb + width;
                ahead.a = (const char *)(w + next * nk * AMX_BLOCK);
                ahead.b = silu ? (const char *)(w + (blocks + next) * nk * AMX_BLOCK) : NULL;
                ahead.bytes = silu || next + 1 >= blocks ? block_bytes : 2 * block_bytes;
                ahead.per_step = (ahead.bytes / 64 + steps - 1) / steps;
            }
            for (int64_t g = g0; g < g1; ++g) {
                const int64_t r0 = 32 * g, rows = batch - r0 < 32 ? batch - r0 : 32;
                amx_block(rows < 32 ? tail : x + r0 * x_stride, in, rows < 32 ? in : x_stride, b0, b1, rows,
                          y + r0 * y_stride + cb * 16, y_stride, &pending, &ahead, silu);
            }
        }
    }
    finish_rows(&pending, 32, silu);
}
#endif

#define ELEM uint16_t
#define NAME(f) f##_bf16
#define TO_F(x) bf16_to_float(x)
#define FROM_F(x) float_to_bf16(x)
#define ROUND(x) round_bf16(x)
#define IS_BF16 1
#include "decode_step_layers.h"
#endif
#endif

/* 1 where the step's projections can run on the tile unit (LAYOUT_AMX): built with AMX and granted
 * by the OS; else 0. */
int decode_step_amx(void) {
#if defined(FUSED_F32) && defined(KVMOSAIC_AMX)
    return amx_permitted();
#else
    return 0;
#endif
}

/* Runs every layer over ``batch`` decode tokens and leaves the final hidden state (the last
 * sublayer's output plus the residual stream, before the final norm) in ``stream``.
 *
 * layers: num_layers * 16 pointers, per layer: the projections qkv [(H + 2 Hkv) D, hidden], o [hidden,
 * H D], gate_up [2 inter, hidden], down [hidden, inter] as three pointers each, (w, d, m): the
 * weight in the dtype, contiguous, in decode tiles (decode_tile_shape) when tiled, else in rows, d and m NULL; or Q4_1 blocks, w the nibbles [out, in / 2],
 * d and m [out, in / 32]; then the input and post-attention norm weights [hidden], the layer's K
 * and V pools [num_slots, Hkv, D] (the dtype);
 * stream [batch, hidden] in the dtype: the embeddings in, the final hidden state out;
 * cos, signed_sin [batch, D] float32 (model/llama.py's tables at the tokens' positions);
 * slot_mapping [batch]: where each token's K/V goes; ctx_slots [batch, max_len] and lens [batch]:
 * each sequence's context, the new token last.
 * head_norm [hidden], head [vocab, hidden] in the projections' layout (the dtype), logits [batch, vocab] float32:
 * with logits non-NULL, also the model's final RMSNorm and LM head over every row, each logit
 * rounded to the dtype and widened (what linear_rows and a widening give after the step); NULL:
 * the hidden state only.
 * layout: the dense weights' (LAYOUT_ROWS, LAYOUT_TILES: the same products either way; LAYOUT_AMX:
 * bfloat16 only, the tile unit's blocks).
 * kv_ahead: bytes of each thread's K/V rows its QKV projection asks for a layer, ahead of attention (0: none).
 * bf16: 1 for bfloat16, 0 for float32.
 * Returns 0, -1 for shapes it does not serve, -2 without AVX-512 or AVX2 with FMA (AVX512-BF16 for
 * bfloat16; for LAYOUT_AMX, the tile unit granted), -3 out of memory; with batch 0 it only answers
 * whether it serves the shapes. */
int decode_step(void *const *layers, int64_t num_layers, int64_t hidden, int64_t inter, int64_t heads,
                int64_t kv_heads, int64_t dim, float eps, float scale, void *stream, const float *cos,
                const float *signed_sin, const int64_t *slot_mapping, const int64_t *ctx_slots, const int64_t *lens,
                int64_t max_len, int64_t batch, const void *head_norm, const void *head, int64_t vocab, float *logits,
                int layout, int64_t kv_ahead, int bf16, int num_threads) {
#if defined(FUSED_F32)
    const int64_t group = kv_heads > 0 ? heads / kv_heads : 0;
    const int64_t q_width = heads * dim, kv_width = kv_heads * dim, qkv_width = q_width + 2 * kv_width;
    if (group < 1 || heads % kv_heads || group > MAX_GROUP || dim > MAX_DIM || dim % 32 || hidden > MAX_HIDDEN
        || hidden % 32 || inter % 32 || q_width % 32 || qkv_width % CHANNELS || hidden % CHANNELS || inter % CHANNELS)
        return -1;
    for (int64_t layer = 0; layers != NULL && layer < num_layers; ++layer)
        for (int proj = 0; proj < 4; ++proj)
            if (layers[layer * PER_LAYER + 3 * proj + 1] != NULL) {
#if !defined(Q4_1_AVX2)
                return -2; /* Q4_1 blocks need the AVX2 tiles */
#endif
#if !defined(Q4_1_BF16_DOT)
                if (bf16) return -2; /* Q4_1 blocks in bfloat16 need AVX512-BF16's */
#endif
            }
    if (layout == LAYOUT_AMX) {
        if (!bf16 || qkv_width % 16 || hidden % 16 || inter % 16 || (head && vocab % 16)) return -1;
        if (!decode_step_amx()) return -2;
    } else if (layout != LAYOUT_ROWS && layout != LAYOUT_TILES) {
        return -1;
    }
    if (bf16) {
#if defined(__AVX512BF16__)
        return batch == 0 ? 0 : decode_step_bf16(layers, num_layers, hidden, inter, heads, kv_heads, dim, eps, scale,
                                                 stream, cos, signed_sin, slot_mapping, ctx_slots, lens, max_len, batch,
                                                 head_norm, head, vocab, logits, layout, kv_ahead, num_threads);
#else
        return -2;
#endif
    }
    return batch == 0 ? 0 : decode_step_f32(layers, num_layers, hidden, inter, heads, kv_heads, dim, eps, scale,
                                            stream, cos, signed_sin, slot_mapping, ctx_slots, lens, max_len, batch,
                                            head_norm, head, vocab, logits, layout, kv_ahead, num_threads);
#else
    (void)layers, (void)num_layers, (void)hidden, (void)inter, (void)heads, (void)kv_heads, (void)dim, (void)eps;
    (void)scale, (void)stream, (void)cos, (void)signed_sin, (void)slot_mapping, (void)ctx_slots, (void)lens;
    (void)max_len, (void)batch, (void)head_norm, (void)head, (void)vocab, (void)logits, (void)layout, (void)kv_ahead, (void)bf16;
    (void)num_threads;
    return -2;
#endif
}

/* The decode tiles of the dtype's weights (bf16: 1 for bfloat16, 0 for float32; see tile_f32_at,
 * tile_bf16_at): (channels, lanes), written to shape[0], shape[1]; returns 0, or -2 where there
 * is no fused step in that dtype (nothing tiled). */
int decode_tile_shape(int bf16, int64_t *shape) {
#if defined(FUSED_F32)
    if (bf16) {
#if defined(__AVX512BF16__)
        shape[0] = CHANNELS, shape[1] = LANES_BF16;
        return 0;
#else
        return -2;
#endif
    }
    shape[0] = CHANNELS, shape[1] = LANES;
    return 0;
#else
    (void)bf16, (void)shape;
    return -2;
#endif
}

#if defined(FUSED_F32) && defined(KVMOSAIC_AMX)
/* A new 32-row buffer (free it, row stride in) holding x's last batch % 32 rows (row stride x_stride), zeros after
 * them: gemm_amx_blocks' last group. */
static uint16_t *last_rows_padded(const void *x, int64_t in, int64_t x_stride, int64_t batch) {
    uint16_t *tail = aligned_alloc(64, (size_t)(32 * in) * sizeof(uint16_t));
    if (tail == NULL) return NULL;
    memset(tail, 0, (size_t)(32 * in) * sizeof(uint16_t));
    for (int64_t r = 0; r < batch % 32; ++r)
        memcpy(tail + r * in, (const uint16_t *)x + (batch / 32 * 32 + r) * x_stride, (size_t)in * sizeof(uint16_t));
    return tail;
}

#endif

/* y [batch, out] = x [batch, in] @ w^T in bfloat16 (x's rows x_stride elements apart, y's out), w [out, in] in the tile
 * unit's B tiles (LAYOUT_AMX), each row on its own as in the fused step (its LM head: model/decode_tiles.py's
 * AmxLinear); any batch (past AMX_MAX_BATCH rows, gemm_amx_blocks). Returns 0, -1 for shapes it does not serve, -2
 * without the tile unit, -3 out of memory. */
int linear_amx(const void *w, int64_t in, int64_t out, const void *x, int64_t x_stride, int64_t batch, void *y,
               int num_threads) {
#if defined(FUSED_F32) && defined(KVMOSAIC_AMX)
    if (in % 32 || out % 16 || batch < 0 || x_stride < in) return -1;
    if (!amx_permitted()) return -2;
    if (batch == 0) return 0;
    uint16_t *tail = NULL;
    if (batch > AMX_MAX_BATCH && batch % 32) { /* the last group of rows, after zeros, computed and let go */
        tail = last_rows_padded(x, in, x_stride, batch);
        if (tail == NULL) return -3;
    }
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        if (batch > AMX_MAX_BATCH) {
            const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
            amx_configure(rows);
            gemm_amx_blocks(w, in, out, x, x_stride, tail, batch, y, out, 0);
        } else {
            amx_configure_step(batch);
            project_amx(w, in, out, x, x_stride, batch, y, NULL, NULL);
        }
        _tile_release();
    }
    free(tail);
    return 0;
#else
    (void)w, (void)in, (void)out, (void)x, (void)x_stride, (void)batch, (void)y, (void)num_threads;
    return -2;
#endif
}

/* act [batch, inter] (rows act_stride elements apart) = silu(gate) * up in bfloat16, gate and up the halves of
 * x [batch, in] @ w^T, w [2 * inter, in] in the tile unit's B tiles (LAYOUT_AMX): gemm_amx_blocks with SiLU . up, each
 * row on its own at any batch, the same bits as linear_amx's product then silu_mul (the prompt rows' MLP:
 * model/packed_linear.py). Returns as linear_amx. */
int linear_amx_silu(const void *w, int64_t in, int64_t inter, const void *x, int64_t batch, void *act,
                    int64_t act_stride, int num_threads) {
#if defined(FUSED_F32) && defined(KVMOSAIC_AMX)
    if (in % 32 || inter % 16 || batch < 0 || act_stride < inter) return -1;
    if (!amx_permitted()) return -2;
    if (batch == 0) return 0;
    uint16_t *tail = NULL;
    if (batch % 32) { /* the last group of rows, after zeros, computed and let go */
        tail = last_rows_padded(x, in, in, batch);
        if (tail == NULL) return -3;
    }
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
        amx_configure(rows);
        gemm_amx_blocks(w, in, inter, x, in, tail, batch, act, act_stride, 1);
        _tile_release();
    }
    free(tail);
    return 0;
#else
    (void)w, (void)in, (void)inter, (void)x, (void)batch, (void)act, (void)act_stride, (void)num_threads;
    return -2;
#endif
}

/* y [batch, out] = x [batch, in] @ w [out, in]^T in the dtype (bf16: 1 for bfloat16, 0 for
 * float32), each row on its own as in the fused step: the LM head after the fused layers. tiled:
 * w is in decode tiles (decode_tile_shape), else in rows; the same products in the same order either way.
 * Returns 0, -1 for shapes it does not serve, -2 without AVX-512 or AVX2 with FMA (AVX512-BF16 for bfloat16). */
int linear_rows(const void *w, int64_t in, int64_t out, int tiled, const void *x, int64_t batch, void *y, int bf16,
                int num_threads) {
#if defined(FUSED_F32)
    if (in % 32 || out % CHANNELS) return -1;
#if !defined(__AVX512BF16__)
    if (bf16) return -2;
#endif
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
#if defined(__AVX512BF16__)
        if (bf16)
            project_rows_bf16(w, in, out, tiled, x, batch, y, NULL, NULL);
        else
#endif
            project_rows_f32(w, in, out, tiled, x, batch, y, NULL, NULL);
    }
    return 0;
#else
    (void)w, (void)in, (void)out, (void)tiled, (void)x, (void)batch, (void)y, (void)bf16, (void)num_threads;
    return -2;
#endif
}

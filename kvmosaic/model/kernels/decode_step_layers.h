/* The fused decode step's layers for one dtype (decode_step.c includes this once per dtype, with
 * ELEM, NAME, TO_F, FROM_F, ROUND, IS_BF16 and a NAME(dot_tile) defined). A ``tiled`` argument says
 * whether a product's dense weights are in decode tiles (decode_step.c) or in rows: the layout this
 * CPU reads faster (model/decode_tiles.py's interleave), the same products either way; a ``layout``
 * argument (LAYOUT_ROWS, LAYOUT_TILES or, in bfloat16 with AMX, LAYOUT_AMX: the tile unit's) says
 * which the step's projections are in. */

/* dot_tile with the row count a constant, so the accumulators stay in registers. */
static void NAME(dots_in)(const ELEM *w, int64_t in, int tiled, int prefetch, const ELEM *x, int64_t x_stride,
                          int nr, float out[ROWS][CHANNELS]) {
    switch (nr) {
    case 1: NAME(dot_tile)(w, in, tiled, prefetch, x, x_stride, 1, out); break;
#if ROWS > 2
    case 2: NAME(dot_tile)(w, in, tiled, prefetch, x, x_stride, 2, out); break;
    case 3: NAME(dot_tile)(w, in, tiled, prefetch, x, x_stride, 3, out); break;
#endif
    default: NAME(dot_tile)(w, in, tiled, prefetch, x, x_stride, ROWS, out); break;
    }
}

/* dots_in with the layout a constant too, so a tile's addressing folds. */
static void NAME(dots)(const ELEM *w, int64_t in, int tiled, int prefetch, const ELEM *x, int64_t x_stride, int nr,
                       float out[ROWS][CHANNELS]) {
    if (tiled) NAME(dots_in)(w, in, 1, prefetch, x, x_stride, nr, out);
    else NAME(dots_in)(w, in, 0, prefetch, x, x_stride, nr, out);
}

/* y [batch, out] = x [batch, in] @ w [out, in]^T (rounded to the dtype; w in decode tiles when tiled);
 * with y NULL, the same values widened to float32 into yf (logits). Channel tiles shared out among
 * the team (called inside the parallel region; ends with the team's barrier); kv: K/V rows to ask
 * for as the tiles go (NULL: none). */
static void NAME(project_rows)(const ELEM *w, int64_t in, int64_t out, int tiled, const ELEM *x, int64_t batch,
                               ELEM *y, float *yf, KvPrefetch *kv) {
    const int prefetch = prefetch_next(tiled, batch);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < out / CHANNELS; ++t) {
        kv_prefetch_tile(kv);
        for (int64_t r0 = 0; r0 < batch; r0 += ROWS) {
            const int nr = batch - r0 < ROWS ? (int)(batch - r0) : ROWS;
            float o[ROWS][CHANNELS];
            NAME(dots)(w + t * CHANNELS * in, in, tiled, prefetch, x + r0 * in, in, nr, o);
            for (int r = 0; r < nr; ++r)
                for (int c = 0; c < CHANNELS; ++c) {
                    const ELEM v = FROM_F(o[r][c]);
                    if (y != NULL) y[(r0 + r) * out + t * CHANNELS + c] = v;
                    else yf[(r0 + r) * out + t * CHANNELS + c] = TO_F(v);
                }
        }
    }
}

/* project_rows for a Weight: dense (in ``layout``; on the tile unit x's rows as project_amx takes them), or
 * Q4_1 blocks; xsum: this thread's block-sum buffer; kv as project_rows' (dense weights only). */
static void NAME(project)(Weight w, int layout, int64_t in, int64_t out, const ELEM *x, int64_t batch, ELEM *y,
                          float *xsum, KvPrefetch *kv) {
#if !IS_BF16 && defined(Q4_1_AVX2)
    if (w.d != NULL) {
        project_q4_1(w, in, out, x, batch, y, xsum);
        return;
    }
#elif IS_BF16 && defined(Q4_1_BF16_DOT)
    if (w.d != NULL) {
        project_q4_1_bf16(w, in, out, x, batch, y, xsum);
        return;
    }
#endif
    (void)xsum;
#if IS_BF16 && defined(KVMOSAIC_AMX)
    if (layout == LAYOUT_AMX) {
        project_amx(w.w, in, out, x, in, batch, y, NULL, kv);
        return;
    }
#endif
    NAME(project_rows)(w.w, in, out, layout == LAYOUT_TILES, x, batch, y, NULL, kv);
}

/* act [batch, inter] = silu(gate) * up, gate and up the two halves of x @ w^T, each rounded to
 * the dtype first, silu (elementwise.h's, as the layer path's) and the product too (w [2 * inter,
 * in]: gate rows, then up rows; dense, in ``layout`` — in decode tiles with the halves' tiles paired,
 * decode_tiles.to_step_layout — or Q4_1 blocks). */
static void NAME(gate_up_silu)(Weight weight, int layout, int64_t in, int64_t inter, const ELEM *x, int64_t batch,
                               ELEM *act, float *xsum) {
#if !IS_BF16 && defined(Q4_1_AVX2)
    if (weight.d != NULL) {
        gate_up_silu_q4_1(weight, in, inter, x, batch, act, xsum);
        return;
    }
#elif IS_BF16 && defined(Q4_1_BF16_DOT)
    if (weight.d != NULL) {
        gate_up_silu_q4_1_bf16(weight, in, inter, x, batch, act, xsum);
        return;
    }
#endif
    (void)xsum;
#if IS_BF16 && defined(KVMOSAIC_AMX)
    if (layout == LAYOUT_AMX) {
        gate_up_silu_amx(weight.w, in, inter, x, batch, act);
        return;
    }
#endif
    const ELEM *w = weight.w;
    const int tiled = layout == LAYOUT_TILES, prefetch = prefetch_next(tiled, batch);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < inter / CHANNELS; ++t) {
        /* in decode tiles gate tile t and up tile t lie side by side (decode_tiles.pair_halves); in rows, the halves */
        const ELEM *gate_w = tiled ? w + 2 * t * CHANNELS * in : w + t * CHANNELS * in;
        const ELEM *up_w = tiled ? gate_w + CHANNELS * in : w + (inter + t * CHANNELS) * in;
        for (int64_t r0 = 0; r0 < batch; r0 += ROWS) {
            const int nr = batch - r0 < ROWS ? (int)(batch - r0) : ROWS;
            float gate[ROWS][CHANNELS], up[ROWS][CHANNELS];
            NAME(dots)(gate_w, in, tiled, prefetch, x + r0 * in, in, nr, gate);
            NAME(dots)(up_w, in, tiled, prefetch, x + r0 * in, in, nr, up);
            for (int r = 0; r < nr; ++r)
                for (int c = 0; c < CHANNELS; ++c) {
                    const float g = ROUND(gate[r][c]);
                    act[(r0 + r) * inter + t * CHANNELS + c] = FROM_F(ROUND(silu(g)) * ROUND(up[r][c]));
                }
        }
    }
}

#if IS_BF16
/* The keys (slots, n) of a chunk that several rows' contexts share, attended for each member task (paged_decode_share)
 * at once on the tiles, kv head by kv head (paged_decode_shared_head): each member's group of q heads rotated as its
 * own task rotates them. */
static void NAME(attention_shared)(const AttentionStep *a, const int64_t *member, int64_t count, const ELEM *wide,
                                   const ELEM *k_pool, const ELEM *v_pool, const int64_t *slots, int64_t n) {
    const int64_t dim = a->dim, group = a->group;
    ELEM rows[16 * MAX_DIM];
    for (int64_t g = 0; g < a->kv_heads; ++g) {
        for (int64_t m = 0; m < count; ++m) {
            int64_t b, c;
            paged_decode_task(a->first, a->batch, member[m], &b, &c);
            memcpy(rows + m * group * dim, wide + b * a->qkv_width + g * group * dim, (size_t)(group * dim) * sizeof(ELEM));
            rope_row(rows + m * group * dim, a->cos + b * dim, a->signed_sin + b * dim, group, dim, IS_BF16);
        }
        paged_decode_shared_head(rows, member, count, a->first, a->batch, a->kv_heads, g, group, dim, k_pool, v_pool,
                                 slots, n, a->scale, a->parts, a->part_lse);
    }
}
#endif

/* One attention task of decode_step: one chunk of one row, every kv head: the head's group of q
 * heads rotated (a private copy, q_rot then q: the row's other chunks read them too), attending the
 * chunk's keys; the chunk that holds the new token rotates its K and writes its K/V to the pool
 * first (rotating it in place in wide, the QKV projection's rows); the partial results go to a->parts.
 * kv: the thread's K/V cursor (this task's rows asked for unless it did, the next tasks' as it goes). */
static void NAME(attention_task)(const AttentionStep *a, int64_t t, ELEM *wide, ELEM *k_pool, ELEM *v_pool, ELEM *q_rot,
                                 float *q, KvPrefetch *kv) {
    const int64_t dim = a->dim, group = a->group, kv_width = a->kv_width;
    int64_t b, c;
    paged_decode_task(a->first, a->batch, t, &b, &c);
    const int64_t len = a->lens[b], begin = c * DECODE_CHUNK, n = len - begin < DECODE_CHUNK ? len - begin : DECODE_CHUNK;
    const int64_t *slots = a->ctx_slots + b * a->max_len + begin;
#if IS_BF16
    if (a->share_count != NULL && a->share_count[t] != 1) { /* keys other rows attend too (never a row's newest) */
        if (a->share_count[t] > 1) NAME(attention_shared)(a, a->share_members + a->share_start[t], a->share_count[t], wide,
                                                          k_pool, v_pool, slots, n);
        return;
    }
#endif
    kv_prefetch_before(kv, t);
    for (int64_t g = 0; g < a->kv_heads; ++g) {
        ELEM *row = wide + b * a->qkv_width, *k = row + a->q_width + g * dim, *v = k + kv_width;
        memcpy(q_rot, row + g * group * dim, (size_t)(group * dim) * sizeof(ELEM));
        rope_row(q_rot, a->cos + b * dim, a->signed_sin + b * dim, group, dim, IS_BF16);
        for (int64_t i = 0; i < group * dim; ++i) q[i] = TO_F(q_rot[i]);
        if (begin + n == len) {
            rope_row(k, a->cos + b * dim, a->signed_sin + b * dim, 1, dim, IS_BF16);
            memcpy(k_pool + a->slot_mapping[b] * kv_width + g * dim, k, (size_t)dim * sizeof(ELEM));
            memcpy(v_pool + a->slot_mapping[b] * kv_width + g * dim, v, (size_t)dim * sizeof(ELEM));
        }
        const int64_t part = decode_part(a->first, a->kv_heads, b, g, c);
        paged_decode_head(q, k_pool, v_pool, IS_BF16, IS_BF16, slots, n, a->kv_heads, dim, g, group, a->scale,
                          a->parts + part * group * dim, a->part_lse + part * group, kv);
    }
}

/* After a sublayer: this thread's copy of the stream, res = from + delta (rounded), h = norm(res) for
 * every row (RMSNorm with the residual add, as the torch path), and its share [lo, hi) of the
 * elements written to the shared buffer ``to`` (no barrier: see decode_step). */
static void NAME(add_and_norm)(const ELEM *delta, const ELEM *from, ELEM *to, ELEM *res,
                         const ELEM *norm, ELEM *h, int64_t batch, int64_t hidden, float eps, int64_t lo,
                         int64_t hi) {
    memcpy(res, from, (size_t)(batch * hidden) * sizeof(ELEM));
    for (int64_t b = 0; b < batch; ++b)
        rms_norm_row(delta + b * hidden, res + b * hidden, norm, h + b * hidden, hidden, eps, IS_BF16);
    memcpy(to + lo, res + lo, (size_t)(hi - lo) * sizeof(ELEM));
}

static int NAME(decode_step)(void *const *layers, int64_t num_layers, int64_t hidden, int64_t inter, int64_t heads,
                             int64_t kv_heads, int64_t dim, float eps, float scale, ELEM *stream, const float *cos,
                             const float *signed_sin, const int64_t *slot_mapping, const int64_t *ctx_slots,
                             const int64_t *lens, int64_t max_len, int64_t batch, const ELEM *head_norm,
                             const ELEM *head, int64_t vocab, float *logits, int layout, int64_t kv_ahead,
                             int num_threads) {
    const int64_t group = kv_heads > 0 ? heads / kv_heads : 0;
    const int64_t q_width = heads * dim, kv_width = kv_heads * dim, qkv_width = q_width + 2 * kv_width;
    if (num_threads < 1) num_threads = 1;
    const int64_t widest = qkv_width > inter ? qkv_width : inter, rows = batch * hidden;
    /* the rows the A tiles read: on the tile unit past two tiles of rows, whole tiles of 32 (zero rows
     * after the batch's, computed and let go) */
#if IS_BF16 && defined(KVMOSAIC_AMX)
    const int64_t padded = layout == LAYOUT_AMX && batch > AMX_MAX_BATCH ? amx_groups(batch) * AMX_MAX_BATCH : batch;
#else
    const int64_t padded = batch;
#endif
    const int64_t padded_rows = padded * hidden;
    /* shared: delta, the second residual buffer, wide, attn; per thread: its residual and normed rows */
    const size_t bytes = (size_t)(2 * rows + padded * (widest + q_width) + 2 * num_threads * padded_rows) * sizeof(ELEM);
    int64_t *first = malloc((size_t)(batch + 1) * sizeof(int64_t));
    if (first == NULL) return -3;
    paged_decode_tasks(lens, batch, first);
    const int64_t tasks = first[batch], parts_count = kv_heads * tasks;
    /* per thread: x's block sums for a Q4_1 projection, [batch, widest input / 32] */
    const int64_t longer_in = inter > q_width ? inter : q_width, widest_in = longer_in > hidden ? longer_in : hidden;
    const int64_t sums_per_thread = batch * (widest_in / 32);
    float *parts = malloc((size_t)(parts_count * group * (dim + 1) + num_threads * sums_per_thread) * sizeof(float));
    float *part_lse = parts + parts_count * group * dim, *sums = part_lse + parts_count * group;
    ELEM *scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (scratch == NULL || parts == NULL) {
        free(scratch), free(parts), free(first);
        return -3;
    }
    if (padded > batch) memset(scratch, 0, bytes);
    ELEM *delta = scratch, *other = delta + rows, *wide = other + rows, *attn = wide + padded * widest;
    ELEM *private_rows = attn + padded * q_width;
    int64_t *share = NULL; /* start, count, members (x 2): chunks that several rows attend, on the tiles */
    if (decode_amx_serves(IS_BF16, IS_BF16, dim, group)) {
        share = malloc((size_t)(4 * tasks + 1) * sizeof(int64_t));
        if (share == NULL || paged_decode_share(first, lens, ctx_slots, max_len, batch, 16 / group, share, share + tasks,
                                                share + 2 * tasks) != 0) {
            free(share), free(scratch), free(parts), free(first);
            return -3;
        }
    }
    const AttentionStep step = {first, lens, ctx_slots, slot_mapping, cos, signed_sin, batch, max_len, kv_heads, group, dim,
                                q_width, kv_width, qkv_width, scale, parts, part_lse, share, share ? share + tasks : NULL,
                                share ? share + 2 * tasks : NULL};
#pragma omp parallel num_threads(num_threads)
    {
        float q[MAX_GROUP * MAX_DIM], o[MAX_GROUP * MAX_DIM], lse[MAX_GROUP];
        ELEM q_rot[MAX_GROUP * MAX_DIM];
        const int me = omp_get_thread_num(), team = omp_get_num_threads();
        ELEM *res = private_rows + (int64_t)me * 2 * padded_rows, *h = res + padded_rows;
        float *xsum = sums + me * sums_per_thread;
        /* The residual stream lives in two shared buffers, read from one and written to the other
         * at each update: every thread adds the sublayer's output to the whole stream in its own
         * copy (and norms it there: no barrier), and writes back its share of the elements. The
         * buffer it writes was last read an update earlier, at least one barrier ago. */
        ELEM *buffers[2] = {stream, other};
        int64_t updates = 0;
        const int64_t share_lo = rows * me / team, share_hi = rows * (me + 1) / team;
        /* this thread's attention tasks [lo, hi), the same in every layer, and their K/V asked for
         * during each layer's QKV projection (KvPrefetch: the keys of task lo on, per_tile a weight tile)
         * and on during attention (a key per kv_heads keys attended) */
        int64_t lo, hi, tiles_lo, tiles_hi, keys = 0;
        static_share(tasks, me, team, &lo, &hi);
        static_share(qkv_width / CHANNELS, me, team, &tiles_lo, &tiles_hi);
        KvPrefetch kv_first = {NULL, NULL, first, lens, ctx_slots, batch, max_len, kv_width * (int64_t)sizeof(ELEM), lo, hi,
                               0, 0, 0, 0, kv_heads, 0};
        for (int64_t t = hi - 1; t >= lo; --t) {
            kv_prefetch_task(&kv_first, t);
            keys += kv_first.keys;
        }
        const int64_t most = kv_ahead / (2 * kv_first.row_bytes), my_tiles = tiles_hi - tiles_lo;
        const int attention_tiles = share != NULL; /* paged_decode_head's choice: decode_amx_serves */
#if IS_BF16 && defined(KVMOSAIC_AMX)
        if (layout == LAYOUT_AMX) amx_configure_step(batch);
#endif
        keys = keys < most ? keys : most;
        kv_first.per_tile = my_tiles > 0 ? (keys + my_tiles - 1) / my_tiles : 0;
        PHASE_START;
        for (int64_t layer = 0; layer < num_layers; ++layer) {
            void *const *p = layers + layer * PER_LAYER;
            const Weight w_qkv = {p[0], p[1], p[2]}, w_o = {p[3], p[4], p[5]}, w_gate_up = {p[6], p[7], p[8]},
                         w_down = {p[9], p[10], p[11]};
            const ELEM *norm1 = p[12], *norm2 = p[13];
            ELEM *k_pool = p[14], *v_pool = p[15];
            if (layer == 0) {
                for (int64_t b = 0; b < batch; ++b)
                    rms_norm_row(stream + b * hidden, NULL, norm1, h + b * hidden, hidden, eps, IS_BF16);
            } else {
                NAME(add_and_norm)(delta, buffers[updates % 2], buffers[(updates + 1) % 2], res, norm1, h, batch, hidden, eps,
                             share_lo, share_hi);
                ++updates;
            }
            KvPrefetch kv = kv_first; /* this layer's pools, the same keys */
            kv.k_pool = (const char *)k_pool, kv.v_pool = (const char *)v_pool;
            NAME(project)(w_qkv, layout, hidden, qkv_width, h, batch, wide, xsum, &kv);
            PHASE_MARK(0)
            if (attention_tiles) decode_amx_configure();
            for (int64_t t = lo; t < hi; ++t) NAME(attention_task)(&step, t, wide, k_pool, v_pool, q_rot, q, &kv);
#if IS_BF16 && defined(KVMOSAIC_AMX)
            if (attention_tiles && layout == LAYOUT_AMX) amx_configure_step(batch); /* the projections' tiles again */
#endif
#pragma omp barrier
            PHASE_MARK(1)
#pragma omp for collapse(2) schedule(static)
            for (int64_t b = 0; b < batch; ++b) {
                for (int64_t g = 0; g < kv_heads; ++g) {
                    const int64_t part = decode_part(first, kv_heads, b, g, 0);
                    paged_decode_merge(parts + part * group * dim, part_lse + part * group, decode_chunks(lens[b]), group,
                                       dim, o, lse);
                    ELEM *out = attn + b * q_width + g * group * dim;
                    for (int64_t i = 0; i < group * dim; ++i) out[i] = FROM_F(o[i]);
                }
            }
            NAME(project)(w_o, layout, q_width, hidden, attn, batch, delta, xsum, NULL);
            PHASE_MARK(2)
            NAME(add_and_norm)(delta, buffers[updates % 2], buffers[(updates + 1) % 2], res, norm2, h, batch, hidden, eps,
                         share_lo, share_hi);
            ++updates;
            NAME(gate_up_silu)(w_gate_up, layout, hidden, inter, h, batch, wide, xsum);
            PHASE_MARK(3)
            NAME(project)(w_down, layout, inter, hidden, wide, batch, delta, xsum, NULL);
            PHASE_MARK(4)
        }
        const ELEM *last = buffers[updates % 2];
        for (int64_t i = share_lo; i < share_hi; ++i)
            stream[i] = FROM_F(TO_F(last[i]) + TO_F(delta[i]));
        if (logits != NULL) {
            /* the head: every thread takes the whole final stream into its own rows (no barrier),
             * norms them as the model's final RMSNorm does, and computes its share of the head's
             * tiles, as linear_rows does after a step */
            for (int64_t i = 0; i < rows; ++i) res[i] = FROM_F(TO_F(last[i]) + TO_F(delta[i]));
            for (int64_t b = 0; b < batch; ++b)
                rms_norm_row(res + b * hidden, NULL, head_norm, h + b * hidden, hidden, eps, IS_BF16);
#if IS_BF16 && defined(KVMOSAIC_AMX)
            if (layout == LAYOUT_AMX)
                project_amx(head, hidden, vocab, h, hidden, batch, NULL, logits, NULL);
            else
#endif
                NAME(project_rows)(head, hidden, vocab, layout == LAYOUT_TILES, h, batch, NULL, logits, NULL);
            PHASE_MARK(5)
        }
#if IS_BF16 && defined(KVMOSAIC_AMX)
        if (layout == LAYOUT_AMX) _tile_release();
#endif
        if (attention_tiles) decode_amx_release();
    }
    free(share), free(scratch), free(parts), free(first);
    return 0;
}

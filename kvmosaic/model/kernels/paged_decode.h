/* Decode attention over the paged pool, one (sequence, kv head) at a time: paged_decode.c
 * defines it, decode_step.c's fused layers call it. */
#ifndef KVMOSAIC_PAGED_DECODE_H
#define KVMOSAIC_PAGED_DECODE_H
#include "bf16.h"

#define MAX_GROUP 16
#define MAX_DIM 256
/* Keys per task: a sequence's context is attended in chunks of DECODE_CHUNK keys (the last one shorter),
 * each a task of its own, merged by log-sum-exp in chunk order, so that a single long sequence
 * keeps every thread busy. Fixed, not sized to the batch: a sequence's result depends on its
 * length alone, never on the other sequences of the step. */
#define DECODE_CHUNK 128

static inline int64_t decode_chunks(int64_t len) { return (len + DECODE_CHUNK - 1) / DECODE_CHUNK; }

/* out [group, D], lse [group] from ``chunks`` partial results of one (sequence, kv head),
 * parts [chunks, group, D] and part_lse [chunks, group] in chunk order. */
void paged_decode_merge(const float *parts, const float *part_lse, int64_t chunks, int64_t group, int64_t dim, float *out,
                        float *lse);

/* The task table of a step: a task is one chunk of one sequence, every kv head of it (a slot
 * row holds all the heads' K, or V, side by side: the task reads its keys' rows whole). first[b]
 * is sequence b's first task (its chunks in order), first[batch] the task count. */
void paged_decode_tasks(const int64_t *lens, int64_t batch, int64_t *first);

/* Asks for every K and V line of a task's n keys (whole slot rows of row_bytes, all heads) to be
 * brought into L2 before the task reads them head by head: the chunk's misses overlap instead of
 * trickling in at the head loop's pace (the batch-16 step's attention ~15% faster, cold pool). */
void paged_decode_prefetch(const void *k_pool, const void *v_pool, const int64_t *seq_slots, int64_t n,
                           int64_t row_bytes);

/* Tasks that attend the very same keys (the chunks of a prefix that several sequences share: the same slots), so
 * that one of them, the lead, attends them for up to per_lead of them at once (decode_rows_amx: each row's
 * figures as if alone). For each lead t: members[start[t] .. start[t] + count[t]) are the tasks it attends for,
 * itself among them, in task order; every other task has count 0. Every task is some lead's member. members holds 2 x tasks (the
 * second half scratch). Returns 0, -3 out of memory. */
int paged_decode_share(const int64_t *first, const int64_t *lens, const int64_t *ctx_slots, int64_t max_len,
                       int64_t batch, int64_t per_lead, int64_t *start, int64_t *count, int64_t *members);

/* A shared chunk's keys (slots, n) attended on the tiles for kv head g of every member task of a lead (count of
 * them, paged_decode_share), their groups of q heads at rows (bfloat16, [count][group][dim]) at once: each member's
 * partial result where its own task would have put it (decode_part), its bits as if attended alone. */
void paged_decode_shared_head(const uint16_t *rows, const int64_t *member, int64_t count, const int64_t *first,
                              int64_t batch, int64_t kv_heads, int64_t g, int64_t group, int64_t dim, const void *k_pool,
                              const void *v_pool, const int64_t *slots, int64_t n, float scale, float *parts,
                              float *part_lse);

/* The (sequence, chunk) of task t: a binary search in first. */
void paged_decode_task(const int64_t *first, int64_t batch, int64_t t, int64_t *b, int64_t *chunk);

/* A thread's cursor over the K and V rows of its coming attention tasks [task, end_task), asking for
 * them into L2 a few rows at a time while the thread computes something else: the fused step's QKV
 * projection (per_tile rows a weight tile), and the attention itself (a row every ``every`` keys
 * attended: with ``every`` the kv head count, a task's rows come in while the task before it is
 * attended). Asked for all at once, a task's lines fill the core's miss buffers and the thread waits
 * on them with nothing to compute (on an AMX Xeon, a batch-16 step's attention 15.2 against 12.2 ms
 * so; BENCHMARKS.md, issue 26, eighth session). Prefetches only: no result depends on them. */
typedef struct {
    const char *k_pool, *v_pool;
    const int64_t *first, *lens, *ctx_slots;
    int64_t batch, max_len, row_bytes;
    int64_t task, end_task;   /* the next task whose keys are asked for, and the end of this thread's */
    int64_t slot0, key, keys; /* that task's first slot (index into ctx_slots), next key, key count */
    int64_t per_tile;         /* keys asked for per weight tile */
    int64_t every, tick;      /* during attention: a key asked for every ``every`` keys attended */
} KvPrefetch;

/* Points kv at task t's keys (t < end_task). */
static inline void kv_prefetch_task(KvPrefetch *kv, int64_t t) {
    int64_t b, c;
    paged_decode_task(kv->first, kv->batch, t, &b, &c);
    const int64_t begin = c * DECODE_CHUNK;
    kv->task = t, kv->key = 0, kv->slot0 = b * kv->max_len + begin;
    kv->keys = kv->lens[b] - begin < DECODE_CHUNK ? kv->lens[b] - begin : DECODE_CHUNK;
}

/* Asks for the next ``rows`` keys' K and V rows (whole slot rows, every head). */
static inline void kv_prefetch_rows(KvPrefetch *kv, int64_t rows) {
    for (int64_t j = 0; j < rows && kv->task < kv->end_task; ++j) {
        const int64_t row = kv->ctx_slots[kv->slot0 + kv->key] * kv->row_bytes;
        for (int64_t offset = 0; offset < kv->row_bytes; offset += 64) {
            __builtin_prefetch(kv->k_pool + row + offset, 0, 2); /* prefetcht1: to L2 */
            __builtin_prefetch(kv->v_pool + row + offset, 0, 2);
        }
        if (++kv->key == kv->keys) {
            if (kv->task + 1 < kv->end_task) kv_prefetch_task(kv, kv->task + 1);
            else kv->task = kv->end_task;
        }
    }
}

/* Called once per key attended (NULL: nothing): a row every ``every`` calls. */
static inline __attribute__((always_inline)) void kv_prefetch_key(KvPrefetch *kv) {
    if (kv == NULL || ++kv->tick < kv->every) return;
    kv->tick = 0;
    kv_prefetch_rows(kv, 1);
}

/* Before attending task t (one of kv's): its rows asked for at once unless the cursor already asked
 * for them all, and the cursor moved past it. */
static inline void kv_prefetch_before(KvPrefetch *kv, int64_t t) {
    if (t < kv->task) return;
    int64_t b, c;
    paged_decode_task(kv->first, kv->batch, t, &b, &c);
    const int64_t begin = c * DECODE_CHUNK, n = kv->lens[b] - begin < DECODE_CHUNK ? kv->lens[b] - begin : DECODE_CHUNK;
    paged_decode_prefetch(kv->k_pool, kv->v_pool, kv->ctx_slots + b * kv->max_len + begin, n, kv->row_bytes);
    if (t + 1 < kv->end_task) kv_prefetch_task(kv, t + 1);
    else kv->task = kv->end_task;
}

/* The group's queries of kv head g over one run of a sequence's slots: out [group, D], lse [group]
 * (paged_decode.c); kv: the thread's cursor, asked for a row per key attended (NULL: none). */
void paged_decode_head(const float *q, const void *k_pool, const void *v_pool, int kv_bf16, int q_bf16_exact,
                       const int64_t *seq_slots, int64_t len, int64_t kv_heads, int64_t dim, int64_t g, int64_t group,
                       float scale, float *out, float *lse, KvPrefetch *kv);

/* Decode attention on the AMX tile unit (prefill_attention_amx.c): whether it serves a shape in this process;
 * the tile configuration it needs, loaded on the calling thread (before a thread's first chunk, and again
 * after other tile work); ``rows`` query rows of one kv head over one chunk's keys (n <= DECODE_CHUNK). */
int decode_amx_serves(int kv_bf16, int q_bf16, int64_t dim, int64_t group);
void decode_amx_configure(void);
void decode_amx_release(void);
void decode_rows_amx(const uint16_t *q, int rows, const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *slots,
                     int64_t n, int64_t kv_heads, int64_t dim, int64_t g, float scale, float *out, float *lse,
                     KvPrefetch *kv);

/* Where the partial result of (sequence b, kv head g, chunk c) goes among a step's kv_heads *
 * first[batch]: a (sequence, kv head)'s chunks side by side, in order, as paged_decode_merge
 * reads them. */
static inline int64_t decode_part(const int64_t *first, int64_t kv_heads, int64_t b, int64_t g, int64_t c) {
    return kv_heads * first[b] + g * (first[b + 1] - first[b]) + c;
}
#endif

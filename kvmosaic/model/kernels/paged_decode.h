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

void paged_decode_head(const float *q, const void *k_pool, const void *v_pool, int kv_bf16, int q_bf16_exact,
                       const int64_t *seq_slots, int64_t len, int64_t kv_heads, int64_t dim, int64_t g, int64_t group,
                       float scale, float *out, float *lse);

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

/* The (sequence, chunk) of task t: a binary search in first. */
void paged_decode_task(const int64_t *first, int64_t batch, int64_t t, int64_t *b, int64_t *chunk);

/* Where the partial result of (sequence b, kv head g, chunk c) goes among a step's kv_heads *
 * first[batch]: a (sequence, kv head)'s chunks side by side, in order, as paged_decode_merge
 * reads them. */
static inline int64_t decode_part(const int64_t *first, int64_t kv_heads, int64_t b, int64_t g, int64_t c) {
    return kv_heads * first[b] + g * (first[b + 1] - first[b]) + c;
}
#endif

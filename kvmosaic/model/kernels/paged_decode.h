/* Decode attention over the paged pool, one (sequence, kv head) at a time: paged_decode.c
 * defines it, decode_step.c's fused layers call it. */
#ifndef KVMOSAIC_PAGED_DECODE_H
#define KVMOSAIC_PAGED_DECODE_H
#include "bf16.h"

#define MAX_GROUP 16
#define MAX_DIM 256

void paged_decode_head(const float *q, const void *k_pool, const void *v_pool, int kv_bf16, int q_bf16_exact,
                       const int64_t *seq_slots, int64_t len, int64_t kv_heads, int64_t dim, int64_t g, int64_t group,
                       float scale, float *out, float *lse);
#endif

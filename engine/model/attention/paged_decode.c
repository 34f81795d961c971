/* Decode attention read in place from the paged KV cache (chunkscope; see paged_decode.py).
 *
 * One query token per sequence. For sequence b, its context [0, ctx_lens[b]) lies in the blocks
 * block_table[b, :], slot = block_id * block_size + offset, each slot holding [Hkv, D] keys and
 * values. For each K/V head the G = Hq / Hkv query heads that share it are served together, so
 * every key and value is loaded once per K/V head: pass 1 scores (fp32) into a scratch row,
 * pass 2 exp and sum, pass 3 O = sum_t p_t V_t / sum_t p_t. fp32 accumulation throughout; bf16
 * inputs are widened exactly (bits << 16) and the output rounded to nearest even.
 *
 * Plain C written for the vectorizer (-O3 -fopenmp-simd, the host's ISA): no intrinsics, so it
 * builds wherever a C compiler does. exp is a Cephes-style polynomial (max rel. error ~2e-7 on
 * the range it sees, arguments <= 0), vectorizable where libm's expf is not.
 *
 * Threads: with OpenMP (-fopenmp) the (sequence, K/V head) pairs are shared out to `threads`
 * threads (the runtime torch uses), each with its own scratch; each pair's output rows are
 * written by one thread only.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../vexp.h"
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = ((uint32_t)h) << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40); /* NaN */
    uint32_t rounding = 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)((c.u + rounding) >> 16);
}

#define MAX_D 256
#define MAX_G 16

/* Whether the library shares its work out to threads (built with OpenMP). */
int paged_decode_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* dtype: 0 = fp32, 1 = bf16 (q, caches and out alike). Strides in elements. threads: how many
 * threads share the (sequence, K/V head) pairs (ignored without OpenMP). Returns 0, or -1 for
 * arguments it does not take (head dim, group size), -2 when scratch memory fails. */
int paged_decode_attention(
    int dtype,
    const void *q, long q_row_stride, long q_head_stride, const int64_t *q_rows,
    int num_seqs, int num_heads, int num_kv_heads, int head_dim,
    const void *k_cache, const void *v_cache, long slot_stride, long kv_head_stride,
    const int64_t *block_table, long table_stride, const int64_t *ctx_lens, int block_size,
    float scale,
    void *out, long out_row_stride, long out_head_stride, int threads)
{
    if (head_dim < 1 || head_dim > MAX_D || num_kv_heads < 1 || num_heads % num_kv_heads)
        return -1;
    const int G = num_heads / num_kv_heads;
    if (G > MAX_G) return -1;
    long max_ctx = 1;
    for (int b = 0; b < num_seqs; b++)
        if (ctx_lens[b] > max_ctx) max_ctx = ctx_lens[b];
    if (threads < 1) threads = 1;
#ifndef _OPENMP
    threads = 1;
#endif
    const long jobs = (long)num_seqs * num_kv_heads;
    if (threads > jobs) threads = jobs > 0 ? (int)jobs : 1;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)G * (size_t)max_ctx * (size_t)threads);
    if (!scratch) return -2;
    const int bf16 = dtype == 1;
    const float *qf = (const float *)q, *kf = (const float *)k_cache, *vf = (const float *)v_cache;
    const uint16_t *qh = (const uint16_t *)q, *kh = (const uint16_t *)k_cache,
                   *vh = (const uint16_t *)v_cache;

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (long job = 0; job < jobs; job++) {
        const int b = (int)(job / num_kv_heads), h = (int)(job % num_kv_heads);
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *scores = scratch + (size_t)tid * (size_t)G * (size_t)max_ctx;
        float qs[MAX_G][MAX_D], acc[MAX_G][MAX_D], vrow[MAX_D];
        const long n = ctx_lens[b];
        const int64_t *table = block_table + (long)b * table_stride;
        const long qrow = q_rows[b];
        {
            /* the group's queries, widened and pre-scaled */
            for (int g = 0; g < G; g++) {
                long base = qrow * q_row_stride + (long)(h * G + g) * q_head_stride;
                for (int d = 0; d < head_dim; d++)
                    qs[g][d] = scale * (bf16 ? bf16_to_f32(qh[base + d]) : qf[base + d]);
            }
            /* pass 1: scores, one key row loaded once for the group */
            float mx[MAX_G];
            for (int g = 0; g < G; g++) mx[g] = -INFINITY;
            for (long t = 0; t < n; t++) {
                long slot = table[t / block_size] * block_size + t % block_size;
                long base = slot * slot_stride + (long)h * kv_head_stride;
                for (int g = 0; g < G; g++) {
                    float s = 0.0f;
                    if (bf16) {
#pragma omp simd reduction(+ : s)
                        for (int d = 0; d < head_dim; d++) s += qs[g][d] * bf16_to_f32(kh[base + d]);
                    } else {
#pragma omp simd reduction(+ : s)
                        for (int d = 0; d < head_dim; d++) s += qs[g][d] * kf[base + d];
                    }
                    scores[(long)g * max_ctx + t] = s;
                    if (s > mx[g]) mx[g] = s;
                }
            }
            /* pass 2: probabilities (unnormalized) and their sums */
            float sum[MAX_G];
            for (int g = 0; g < G; g++) {
                float *row = scores + (long)g * max_ctx;
                const float m = mx[g];
                float l = 0.0f;
#pragma omp simd reduction(+ : l)
                for (long t = 0; t < n; t++) {
                    float p = exp_neg(row[t] - m);
                    row[t] = p;
                    l += p;
                }
                sum[g] = l;
                memset(acc[g], 0, sizeof(float) * head_dim);
            }
            /* pass 3: O = sum_t p_t V_t, one value row widened once for the group */
            for (long t = 0; t < n; t++) {
                long slot = table[t / block_size] * block_size + t % block_size;
                long base = slot * slot_stride + (long)h * kv_head_stride;
                if (bf16) {
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) vrow[d] = bf16_to_f32(vh[base + d]);
                } else {
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) vrow[d] = vf[base + d];
                }
                for (int g = 0; g < G; g++) {
                    const float p = scores[(long)g * max_ctx + t];
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) acc[g][d] += p * vrow[d];
                }
            }
            for (int g = 0; g < G; g++) {
                const float inv = sum[g] > 0.0f ? 1.0f / sum[g] : 0.0f;
                long base = qrow * out_row_stride + (long)(h * G + g) * out_head_stride;
                if (bf16) {
                    uint16_t *o = (uint16_t *)out;
                    for (int d = 0; d < head_dim; d++) o[base + d] = f32_to_bf16(acc[g][d] * inv);
                } else {
                    float *o = (float *)out;
                    for (int d = 0; d < head_dim; d++) o[base + d] = acc[g][d] * inv;
                }
            }
        }
    }
    free(scratch);
    return 0;
}

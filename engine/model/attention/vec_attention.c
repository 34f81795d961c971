/* A step's attention over the paged KV cache on AVX-512 FMA, fp32 arithmetic: prefill chunks
 * and decodes (chunkscope; see vec.py). For CPUs with AVX-512 but no AMX, where torch's flash kernel computes its two
 * products with MKL's sgemm (on AMD CPUs MKL's AVX2 code: ~75 GFLOP/s on one Zen 5 core).
 *
 * A job is one sequence's chunk for one K/V head: the G query heads that share it, stacked as
 * rows (row r = query head g * q_len + i at position start + i), each row causal over keys
 * 0 .. its position (prefix and the chunk's own keys in one online softmax: no mask tensor, no
 * merge). Keys are read through the block table where they lie (fp32 caches; bf16 ones are
 * widened chunk by chunk into a staging buffer). Keys come in chunks of 256 (K and V: 128 KiB,
 * they stay in L2) and every tile of 16 query rows passes over a chunk before the next one:
 *   1. S^T = K . Q^T, 8 keys at a time: for each of the 64 dims one load of Q^T's row (16
 *      queries, pre-scaled by scale * log2 e) and 8 FMAs with one key's value broadcast each;
 *      one zmm = one key's scores for the tile's 16 queries, so a query's max over a block of
 *      keys is an element-wise max (no horizontal reduction);
 *   2. online softmax per block of 32 keys: the running output is rescaled only when a max
 *      moved; P^T = 2^(S^T - max), masked keys exactly 0;
 *   3. O[q] += P[q][j] V[j]: 6 query rows x 4 vectors of 16 dims kept in registers, each key's
 *      value row loaded once per 6 queries, P broadcast.
 * Key blocks past a tile's last position are skipped; only keys past a row's position are
 * masked. A decode (one query row per head) takes its own path (decode_head): a 16-row tile
 * would leave 14 of 16 lanes idle. fp32 accumulation; the output rounded to bf16 (nearest even) in bf16 mode.
 *
 * The head dim is a compile-time parameter (-DHEAD_DIM=64, the default, or 128: NV = HEAD_DIM / 16
 * vectors a row; the register blocks shrink at 128 so that they still fit 32 registers).
 * Threads: the work is cut into jobs, one per (sequence, K/V head) for a decode and, for a
 * chunk, one per (sequence, K/V head, range of query tiles) with as many ranges as threads;
 * with OpenMP (-fopenmp) the jobs are shared out to `threads` threads, each with its own
 * scratch, every output row written by exactly one job. Without AVX-512F (an AVX2 + FMA build),
 * avx512_on_avx2.h supplies the intrinsics as pairs of 8-lane vectors: the same arithmetic.
 * Build: -O3 -mavx512f -mavx512bw -mavx512dq -mfma [-fopenmp] [-DHEAD_DIM=128].
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifndef __AVX512F__
#include "avx512_on_avx2.h"
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "HEAD_DIM must be 64 or 128"
#endif
#define NV (HEAD_DIM / 16) /* 16-float vectors per row */
#define QB (HEAD_DIM == 64 ? 6 : 3) /* query rows per block of O += P V (QB x NV sums in registers) */
#define DB (HEAD_DIM == 64 ? 4 : 2) /* a decode's heads per block of O += p V */
#define TQ 16 /* query rows per tile */
#define KB 32 /* keys per softmax block */
#ifndef CHUNK_KEYS
#define CHUNK_KEYS 256 /* keys per chunk (a multiple of KB) */
#endif
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_GROUPS 16 /* query heads per K/V head */

/* 2^x for x <= 0 (clamped at -126): Cephes' exp2f polynomial on [-0.5, 0.5], relative error
 * ~2e-7. */
ALWAYS_INLINE __m512 exp2_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

ALWAYS_INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

ALWAYS_INLINE uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Per-thread scratch, grown as needed (kept between calls). */
typedef struct {
    float (*qt)[HEAD_DIM][TQ]; /* per tile: Q^T, scaled to base-2 exponents */
    float (*ot)[TQ][HEAD_DIM]; /* per tile: running output rows */
    float (*mt)[TQ], (*st)[TQ]; /* per tile: running max, sum */
    int32_t (*tpos)[TQ];        /* per tile: row positions (pad rows: the tile's first) */
    int *tmin, *tmax;
    const float **krow, **vrow; /* a chunk's key and value rows */
    float *kst, *vst;           /* bf16 mode: a chunk widened to fp32 */
    float *sc;                  /* a decode's scores, then probabilities: [groups][n] */
    size_t cap[10], cap_sc;
} workspace;

static __thread workspace ws;

static int grow(void **p, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    need = need * 3 / 2 + 64;
    void *q = aligned_alloc(64, (need + 63) / 64 * 64);
    if (!q) return -1;
    free(*p);
    *p = q;
    *cap = need;
    return 0;
}

static int reserve(int rows, int bf16) {
    size_t nt = (size_t)(rows + TQ - 1) / TQ, ck = CHUNK_KEYS;
    if (grow((void **)&ws.qt, &ws.cap[0], nt * sizeof(*ws.qt)) ||
        grow((void **)&ws.ot, &ws.cap[1], nt * sizeof(*ws.ot)) ||
        grow((void **)&ws.mt, &ws.cap[2], nt * sizeof(*ws.mt)) ||
        grow((void **)&ws.st, &ws.cap[3], nt * sizeof(*ws.st)) ||
        grow((void **)&ws.tpos, &ws.cap[4], nt * sizeof(*ws.tpos)) ||
        grow((void **)&ws.tmin, &ws.cap[5], nt * sizeof(int)) ||
        grow((void **)&ws.tmax, &ws.cap[6], nt * sizeof(int)) ||
        grow((void **)&ws.krow, &ws.cap[7], ck * sizeof(void *)) ||
        grow((void **)&ws.vrow, &ws.cap[8], ck * sizeof(void *)))
        return -3;
    if (bf16 && grow((void **)&ws.kst, &ws.cap[9], 2 * ck * HEAD_DIM * sizeof(float))) return -3;
    ws.vst = ws.kst ? ws.kst + ck * HEAD_DIM : NULL;
    return 0;
}

/* S^T for nk (<= 8) keys starting at row pointer k[0..nk): s[u] = K[u] . Q^T (16 queries). */
ALWAYS_INLINE void scores(const int nk, const float *const *k, const float (*qt)[TQ], __m512 *s) {
    __m512 a[8];
    for (int u = 0; u < nk; u++) a[u] = _mm512_setzero_ps();
    for (int d = 0; d < HEAD_DIM; d++) {
        __m512 q = _mm512_load_ps(qt[d]);
        for (int u = 0; u < nk; u++) a[u] = _mm512_fmadd_ps(_mm512_set1_ps(k[u][d]), q, a[u]);
    }
    for (int u = 0; u < nk; u++) s[u] = a[u];
}

/* O[q0 .. q0 + nq) += P[q][j] V[j] over nk keys; p[j][q] are the probabilities. */
ALWAYS_INLINE void accumulate(const int nq, int q0, int nk, const float *const *v,
                              const float (*p)[TQ], float (*o)[HEAD_DIM]) {
    __m512 a[QB][NV];
    for (int i = 0; i < nq; i++)
        for (int c = 0; c < NV; c++) a[i][c] = _mm512_load_ps(o[q0 + i] + 16 * c);
    for (int j = 0; j < nk; j++) {
        const float *vr = v[j];
#if NV == 4 /* head dim 64: a key's value row in 4 registers, then each query's P broadcast */
        __m512 vv[NV];
        for (int c = 0; c < NV; c++) vv[c] = _mm512_loadu_ps(vr + 16 * c);
        for (int i = 0; i < nq; i++) {
            __m512 pj = _mm512_set1_ps(p[j][q0 + i]);
            for (int c = 0; c < NV; c++) a[i][c] = _mm512_fmadd_ps(pj, vv[c], a[i][c]);
        }
#else /* head dim 128: the QB broadcasts first, then the value row one vector at a time
       * (24 sums + 3 broadcasts + 1 value: within 32 registers) */
        __m512 pj[QB];
        for (int i = 0; i < nq; i++) pj[i] = _mm512_set1_ps(p[j][q0 + i]);
        for (int c = 0; c < NV; c++) {
            __m512 vc = _mm512_loadu_ps(vr + 16 * c);
            for (int i = 0; i < nq; i++) a[i][c] = _mm512_fmadd_ps(pj[i], vc, a[i][c]);
        }
#endif
    }
    for (int i = 0; i < nq; i++)
        for (int c = 0; c < NV; c++) _mm512_store_ps(o[q0 + i] + 16 * c, a[i][c]);
}

static void scores_any(int nk, const float *const *k, const float (*qt)[TQ], __m512 *s) {
    switch (nk) {
    case 8: scores(8, k, qt, s); break;
    case 7: scores(7, k, qt, s); break;
    case 6: scores(6, k, qt, s); break;
    case 5: scores(5, k, qt, s); break;
    case 4: scores(4, k, qt, s); break;
    case 3: scores(3, k, qt, s); break;
    case 2: scores(2, k, qt, s); break;
    default: scores(1, k, qt, s); break;
    }
}

static void accumulate_any(int nq, int q0, int nk, const float *const *v, const float (*p)[TQ],
                           float (*o)[HEAD_DIM]) {
    switch (nq) {
#if QB > 3
    case 6: accumulate(6, q0, nk, v, p, o); break;
    case 5: accumulate(5, q0, nk, v, p, o); break;
    case 4: accumulate(4, q0, nk, v, p, o); break;
#endif
    case 3: accumulate(3, q0, nk, v, p, o); break;
    case 2: accumulate(2, q0, nk, v, p, o); break;
    default: accumulate(1, q0, nk, v, p, o); break;
    }
}

/* Tile t (nq real rows) over keys [j0, j1) whose rows are krow/vrow[j - c0]. */
static void tile_block(int t, int nq, int j0, int j1, int c0) {
    float sbuf[KB][TQ] __attribute__((aligned(64)));
    const __m512i pos = _mm512_load_si512(ws.tpos[t]);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int b0 = j0; b0 < j1; b0 += KB) {
        int b1 = b0 + KB < j1 ? b0 + KB : j1, nk = b1 - b0;
        __m512 s[KB];
        for (int u = 0; u < nk; u += 8)
            scores_any(nk - u < 8 ? nk - u : 8, ws.krow + (b0 - c0) + u, ws.qt[t], s + u);
        __m512 mx = ninf;
        __mmask16 keep[KB];
        int masked = b1 - 1 > ws.tmin[t];
        for (int u = 0; u < nk; u++) {
            keep[u] = masked ? _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(b0 + u)) : 0xffff;
            mx = _mm512_max_ps(mx, _mm512_mask_mov_ps(ninf, keep[u], s[u]));
        }
        __m512 old = _mm512_load_ps(ws.mt[t]);
        __m512 mnew = _mm512_max_ps(old, mx);
        __mmask16 moved = _mm512_cmp_ps_mask(mnew, old, _CMP_GT_OQ);
        __m512 sum = _mm512_load_ps(ws.st[t]);
        if (moved) { /* rescale the rows whose max moved (the first block: from -inf, all 0) */
            __m512 alpha = exp2_neg(_mm512_sub_ps(old, mnew));
            sum = _mm512_mul_ps(sum, alpha);
            float al[TQ] __attribute__((aligned(64)));
            _mm512_store_ps(al, alpha);
            for (int q = 0; q < nq; q++) {
                if (!((moved >> q) & 1)) continue;
                __m512 aq = _mm512_set1_ps(al[q]);
                for (int c = 0; c < NV; c++)
                    _mm512_store_ps(ws.ot[t][q] + 16 * c,
                                    _mm512_mul_ps(_mm512_load_ps(ws.ot[t][q] + 16 * c), aq));
            }
            _mm512_store_ps(ws.mt[t], mnew);
        }
        for (int u = 0; u < nk; u++) {
            __m512 e = _mm512_maskz_mov_ps(keep[u], exp2_neg(_mm512_sub_ps(s[u], mnew)));
            sum = _mm512_add_ps(sum, e);
            _mm512_store_ps(sbuf[u], e);
        }
        _mm512_store_ps(ws.st[t], sum);
        for (int q0 = 0; q0 < nq; q0 += QB)
            accumulate_any(nq - q0 < QB ? nq - q0 : QB, q0, nk, ws.vrow + (b0 - c0),
                           (const float(*)[TQ])sbuf, ws.ot[t]);
    }
}

/* HEAD_DIM bf16 values at p widened to fp32 (exact) in NV vectors. */
ALWAYS_INLINE void widen_row(const uint16_t *p, __m512 v[NV]) {
    for (int c = 0; c < NV; c++)
        v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 16 * c))), 16));
}

ALWAYS_INLINE void load_row(int bf16, const void *base, long off, __m512 v[NV]) {
    if (bf16) {
        widen_row((const uint16_t *)base + off, v);
    } else {
        const float *f = (const float *)base + off;
        for (int c = 0; c < NV; c++) v[c] = _mm512_loadu_ps(f + 16 * c);
    }
}

/* A decode (one query token) for K/V head h: its G query heads over keys [0, n), K/V read in
 * place through the block table. Pass 1: each key row loaded once for the G heads, a score per
 * head by NV FMAs and a horizontal sum; pass 2: 2^(s - max) and the sums, 16 keys a vector;
 * pass 3: O[g] += p V, each value row loaded once for the G heads (DB heads' sums in registers
 * at a time). */
static void decode_head(int bf16, const float (*qv)[HEAD_DIM], int groups, int n,
                        const int64_t *blocks, int block_size, const void *k_cache,
                        const void *v_cache, long kv_ts, long hoff, float *sc, long sc_stride,
                        void *out, long ooff, long o_hs) {
    float mx[MAX_GROUPS];
    for (int g = 0; g < groups; g++) mx[g] = -INFINITY;
    for (int j = 0; j < n; j++) {
        long off = (blocks[j / block_size] * block_size + j % block_size) * kv_ts + hoff;
        __m512 k[NV];
        load_row(bf16, k_cache, off, k);
        for (int g = 0; g < groups; g++) {
            __m512 a = _mm512_mul_ps(_mm512_load_ps(qv[g]), k[0]);
            for (int c = 1; c < NV; c++) a = _mm512_fmadd_ps(_mm512_load_ps(qv[g] + 16 * c), k[c], a);
            float s = _mm512_reduce_add_ps(a);
            sc[g * sc_stride + j] = s;
            mx[g] = s > mx[g] ? s : mx[g];
        }
    }
    float inv[MAX_GROUPS];
    for (int g = 0; g < groups; g++) {
        float *row = sc + g * sc_stride;
        const __m512 m = _mm512_set1_ps(mx[g]);
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < n; j += 16) {
            __mmask16 live = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
            __m512 e = _mm512_maskz_mov_ps(
                live, exp2_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, row + j), m)));
            _mm512_mask_storeu_ps(row + j, live, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    for (int g0 = 0; g0 < groups; g0 += DB) {
        const int ng = groups - g0 < DB ? groups - g0 : DB;
        __m512 a[DB][NV];
        for (int g = 0; g < DB; g++)
            for (int c = 0; c < NV; c++) a[g][c] = _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            long off = (blocks[j / block_size] * block_size + j % block_size) * kv_ts + hoff;
            __m512 v[NV];
            load_row(bf16, v_cache, off, v);
            for (int g = 0; g < DB; g++) {
                if (g >= ng) break;
                __m512 p = _mm512_set1_ps(sc[(g0 + g) * sc_stride + j]);
                for (int c = 0; c < NV; c++) a[g][c] = _mm512_fmadd_ps(p, v[c], a[g][c]);
            }
        }
        for (int g = 0; g < ng; g++) {
            long o = ooff + (long)(g0 + g) * o_hs;
            __m512 iv = _mm512_set1_ps(inv[g0 + g]);
            for (int c = 0; c < NV; c++) {
                __m512 r = _mm512_mul_ps(a[g][c], iv);
                if (bf16) {
                    float f[16];
                    _mm512_storeu_ps(f, r);
                    uint16_t *dst = (uint16_t *)out + o + 16 * c;
                    for (int i = 0; i < 16; i++) dst[i] = f32_to_bf16(f[i]);
                } else {
                    _mm512_storeu_ps((float *)out + o + 16 * c, r);
                }
            }
        }
    }
}

/* A chunk's tiles [t0, t1) of one sequence (q0 its first query row, q_len rows at positions
 * [n - q_len, n)) for K/V head h; the calling thread's scratch. Returns 0 or -3. */
static int chunk_job(int bf16, const void *q, long q_ts, long q_hs, int groups, int q0, int q_len,
                     int n, int h, int t0, int t1, const int64_t *blocks, int block_size,
                     const void *k_cache, const void *v_cache, long kv_ts, long kv_hs, float c,
                     void *out, long o_ts, long o_hs) {
    const int start = n - q_len, rows = groups * q_len;
    if (reserve(rows, bf16)) return -3;
    int last = 0; /* the last key any of the job's rows sees */
    for (int t = t0; t < t1; t++) { /* positions */
        int lo = TQ * t, hi = rows < lo + TQ ? rows : lo + TQ, mn = n, mx = 0;
        for (int r = lo; r < hi; r++) {
            int p = start + r % q_len;
            mn = p < mn ? p : mn;
            mx = p > mx ? p : mx;
        }
        for (int m = 0; m < TQ; m++) ws.tpos[t][m] = lo + m < hi ? start + (lo + m) % q_len : mn;
        ws.tmin[t] = mn, ws.tmax[t] = mx;
        last = mx > last ? mx : last;
    }
    for (int t = t0; t < t1; t++) { /* Q^T, scaled; the running state cleared */
        memset(ws.qt[t], 0, sizeof(*ws.qt));
        memset(ws.ot[t], 0, sizeof(*ws.ot));
        _mm512_store_ps(ws.mt[t], _mm512_set1_ps(-INFINITY));
        _mm512_store_ps(ws.st[t], _mm512_setzero_ps());
        for (int m = 0; m < TQ && TQ * t + m < rows; m++) {
            int r = TQ * t + m;
            long off = (long)(q0 + r % q_len) * q_ts + ((long)h * groups + r / q_len) * q_hs;
            if (bf16) {
                const uint16_t *qr = (const uint16_t *)q + off;
                for (int d = 0; d < HEAD_DIM; d++) ws.qt[t][d][m] = bf16_to_f32(qr[d]) * c;
            } else {
                const float *qr = (const float *)q + off;
                for (int d = 0; d < HEAD_DIM; d++) ws.qt[t][d][m] = qr[d] * c;
            }
        }
    }
    for (int c0 = 0; c0 <= last; c0 += CHUNK_KEYS) {
        int c1 = last + 1 - c0 < CHUNK_KEYS ? last + 1 : c0 + CHUNK_KEYS;
        for (int j = c0; j < c1; j++) {
            long slot = blocks[j / block_size] * block_size + j % block_size;
            long off = slot * kv_ts + (long)h * kv_hs;
            if (bf16) {
                float *kd = ws.kst + (long)(j - c0) * HEAD_DIM;
                float *vd = ws.vst + (long)(j - c0) * HEAD_DIM;
                const uint16_t *ks = (const uint16_t *)k_cache + off;
                const uint16_t *vs = (const uint16_t *)v_cache + off;
                for (int d = 0; d < HEAD_DIM; d += 16) {
                    __m512i k16 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(ks + d)));
                    __m512i v16 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vs + d)));
                    _mm512_storeu_ps(kd + d, _mm512_castsi512_ps(_mm512_slli_epi32(k16, 16)));
                    _mm512_storeu_ps(vd + d, _mm512_castsi512_ps(_mm512_slli_epi32(v16, 16)));
                }
                ws.krow[j - c0] = kd, ws.vrow[j - c0] = vd;
            } else {
                ws.krow[j - c0] = (const float *)k_cache + off;
                ws.vrow[j - c0] = (const float *)v_cache + off;
            }
        }
        for (int t = t0; t < t1; t++) {
            if (c0 > ws.tmax[t]) continue; /* the whole chunk is past this tile's rows */
            int j1 = c1 < ws.tmax[t] + 1 ? c1 : ws.tmax[t] + 1;
            int nq = rows - TQ * t < TQ ? rows - TQ * t : TQ;
            tile_block(t, nq, c0, j1, c0);
        }
    }
    for (int t = t0; t < t1; t++) { /* out = O / sum */
        for (int m = 0; m < TQ && TQ * t + m < rows; m++) {
            int r = TQ * t + m;
            long off = (long)(q0 + r % q_len) * o_ts + ((long)h * groups + r / q_len) * o_hs;
            float inv = 1.0f / ws.st[t][m];
            if (bf16) {
                uint16_t *o = (uint16_t *)out + off;
                for (int d = 0; d < HEAD_DIM; d++) o[d] = f32_to_bf16(ws.ot[t][m][d] * inv);
            } else {
                float *o = (float *)out + off;
                for (int d = 0; d < HEAD_DIM; d++) o[d] = ws.ot[t][m][d] * inv;
            }
        }
    }
    return 0;
}

/* A decode (sequence's one query row q0, n keys) for K/V head h. Returns 0 or -3. */
static int decode_job(int bf16, const void *q, long q_ts, long q_hs, int groups, int q0, int n,
                      int h, const int64_t *blocks, int block_size, const void *k_cache,
                      const void *v_cache, long kv_ts, long kv_hs, float c, void *out, long o_ts,
                      long o_hs) {
    if (grow((void **)&ws.sc, &ws.cap_sc, (size_t)groups * (n + 16) * sizeof(float))) return -3;
    float qv[MAX_GROUPS][HEAD_DIM] __attribute__((aligned(64)));
    for (int g = 0; g < groups; g++) {
        long off = (long)q0 * q_ts + ((long)h * groups + g) * q_hs;
        for (int d = 0; d < HEAD_DIM; d++)
            qv[g][d] = c * (bf16 ? bf16_to_f32(((const uint16_t *)q)[off + d])
                                 : ((const float *)q)[off + d]);
    }
    decode_head(bf16, (const float(*)[HEAD_DIM])qv, groups, n, blocks, block_size, k_cache,
                v_cache, kv_ts, (long)h * kv_hs, ws.sc, n + 16, out,
                (long)q0 * o_ts + (long)h * groups * o_hs, o_hs);
    return 0;
}

typedef struct {
    int s, h, t0, t1; /* sequence, K/V head, query tiles [t0, t1) (a decode: 0, 0) */
} job;

/* The kernel's head dim (the library is built for one). */
int vec_attention_head_dim(void) { return HEAD_DIM; }

/* Whether the library shares its work out to threads (built with OpenMP). */
int vec_attention_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/*
 * The attention of each sequence's q_len query rows at positions [ctx_len - q_len, ctx_len),
 * causal over its keys [0, ctx_len) (the step's own K/V already stored), read through its
 * block table: chunks (q_len > 1) and decodes (q_len 1) alike.
 * dtype: 0 = fp32, 1 = bf16 (q, caches and out alike). Strides in elements.
 * q: [tokens][kv_heads * groups][HEAD_DIM] (strides q_ts, q_hs; d contiguous); query head
 *   kv * groups + g uses K/V head kv.
 * seqs: int32 [nseq][3] = q_start, q_len, ctx_len; table: int64 [nseq][table_w] block ids.
 * k_cache, v_cache: slot s = block * block_size + i of head h at cache + s*kv_ts + h*kv_hs.
 * out: row of token t, query head hq at out + t*o_ts + hq*o_hs.
 * threads: how many threads share the jobs (1: the calling thread alone; ignored without OpenMP).
 * Returns 0, or -2 (bad arguments: groups above 16 among them), -3 (out of memory).
 */
int vec_attention_paged(int dtype, const void *q, long q_ts, long q_hs, int kv_heads, int groups,
                        int nseq, const int32_t *seqs, const int64_t *table, long table_w,
                        int block_size, const void *k_cache, const void *v_cache, long kv_ts,
                        long kv_hs, float scale, void *out, long o_ts, long o_hs, int threads) {
    if (block_size < 1 || kv_heads < 1 || groups < 1 || groups > MAX_GROUPS ||
        (dtype != 0 && dtype != 1))
        return -2;
    const int bf16 = dtype == 1;
    const float c = scale * 1.44269504088896341f; /* scores in base-2 exponents */
    long njobs = 0;
    if (threads < 1) threads = 1;
    for (int s = 0; s < nseq; s++) {
        int q_len = seqs[3 * s + 1], n = seqs[3 * s + 2];
        if (q_len < 1 || n < q_len || (n + block_size - 1) / block_size > table_w) return -2;
        int nt = (groups * q_len + TQ - 1) / TQ;
        njobs += (long)kv_heads * (q_len == 1 ? 1 : (nt < threads ? nt : threads));
    }
    job *jobs = (job *)malloc((size_t)(njobs ? njobs : 1) * sizeof(job));
    if (!jobs) return -3;
    long at = 0;
    for (int pass = 0; pass < 2; pass++) /* chunks first (the long jobs), then decodes */
        for (int s = 0; s < nseq; s++) {
            int q_len = seqs[3 * s + 1];
            if ((q_len == 1) != (pass == 1)) continue;
            int nt = (groups * q_len + TQ - 1) / TQ, parts = q_len == 1 ? 1 : (nt < threads ? nt : threads);
            for (int h = 0; h < kv_heads; h++)
                for (int p = 0; p < parts; p++) {
                    job j = {s, h, (int)((long)nt * p / parts), (int)((long)nt * (p + 1) / parts)};
                    jobs[at++] = j;
                }
        }
    int rc = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && njobs > 1)
    for (long i = 0; i < njobs; i++) {
        const job j = jobs[i];
        const int q0 = seqs[3 * j.s], q_len = seqs[3 * j.s + 1], n = seqs[3 * j.s + 2];
        const int64_t *blocks = table + (long)j.s * table_w;
        int r = q_len == 1
                    ? decode_job(bf16, q, q_ts, q_hs, groups, q0, n, j.h, blocks, block_size,
                                 k_cache, v_cache, kv_ts, kv_hs, c, out, o_ts, o_hs)
                    : chunk_job(bf16, q, q_ts, q_hs, groups, q0, q_len, n, j.h, j.t0, j.t1, blocks,
                                block_size, k_cache, v_cache, kv_ts, kv_hs, c, out, o_ts, o_hs);
        if (r) {
#pragma omp atomic write
            rc = r;
        }
    }
    free(jobs);
    return rc;
}

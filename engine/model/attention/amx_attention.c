/* bf16 attention of stacked query rows over a key prefix, on AMX tiles (no mask).
 *
 * Built and loaded by engine/model/attention/amx.py (ctypes; no torch headers). For each K/V head
 * h (the split backend stacks a K/V head's G query heads as rows of Q[h]), the keys are taken in
 * chunks of 512 (K and V^T 128 KiB: they stay in L2 while every tile of 16 query rows passes
 * over them); per tile and chunk, two passes, 32 keys at a time:
 *   1. S^T = K . Q^T (K rows straight from the cache as the A tile, Q^T packed once per head in
 *      VNNI layout as B): 16 keys x 16 queries per tile, one zmm = one key's scores for the 16
 *      queries, so the max per query is an element-wise max of rows (no horizontal reduction);
 *      the chunk's scores are kept (32 KiB, L1);
 *   2. P^T = exp(S^T - max) from the kept scores (fp32 sum per query; P^T rounded to bf16 and
 *      interleaved in key pairs: the VNNI B operand), O^T += V^T . P^T with V^T (packed once
 *      per call) as A.
 * Within a chunk the max is exact, so O^T (64 dims x 16 queries, fp32) stays in four tile
 * registers over the chunk; between chunks it is rescaled once (online softmax). Tiles: 0-3
 * O^T, 4-5 Q^T (two 32-dim halves), 6 S^T / P^T, 7 K / V^T. Outputs: O in fp32 and the natural
 * log-sum-exp of the scaled scores per row (what torch's flash kernel returns), for the merge.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define HEAD_DIM 64
#define KB 32 /* keys per step */
#ifndef CHUNK_BLOCKS
#define CHUNK_BLOCKS 16 /* key blocks per chunk: 512 keys, K and V^T 128 KiB */
#endif

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_ready = 0;

/* 0 when this thread may use AMX tile data (the permission is per process, asked once). */
int amx_attention_init(void) {
    if (amx_ready) return 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return -1;
    amx_ready = 1;
    return 0;
}

static void load_config(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* 2^x for x <= 0 (x >= -126 after clamping): Taylor polynomial of degree 5 on [-0.5, 0.5]
 * (relative error < 3e-6; P is rounded to bf16, 4e-3, anyway). */
static inline __m512 exp2_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* V^T of one head in A-tile blocks: vt[block][d][32 keys], keys past n zero. A full block: two
 * gathers of 16 keys' 32-bit words (dims 2w, 2w+1) split into their even and odd halves. */
static void pack_vt(const uint16_t *v, long rs, int n, uint16_t *vt) {
    int full = n / KB;
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5,
                                                             4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)(rs / 2)));
    __m512i even, odd;
    {
        uint16_t e[32], o[32];
        for (int i = 0; i < 32; i++) e[i] = 2 * i, o[i] = 2 * i + 1;
        even = _mm512_loadu_si512(e);
        odd = _mm512_loadu_si512(o);
    }
    for (int b = 0; b < full; b++) {
        const uint16_t *src = v + (long)b * KB * rs;
        uint16_t *dst = vt + (size_t)b * HEAD_DIM * KB;
        for (int w = 0; w < HEAD_DIM / 2; w++) {
            __m512i g0 = _mm512_i32gather_epi32(rows, src + 2 * w, 4);
            __m512i g1 = _mm512_i32gather_epi32(rows, src + 16 * rs + 2 * w, 4);
            _mm512_store_si512((__m512i *)(dst + (2 * w) * KB), _mm512_permutex2var_epi16(g0, even, g1));
            _mm512_store_si512((__m512i *)(dst + (2 * w + 1) * KB),
                               _mm512_permutex2var_epi16(g0, odd, g1));
        }
    }
    if (full * KB < n) {
        uint16_t *dst = vt + (size_t)full * HEAD_DIM * KB;
        memset(dst, 0, HEAD_DIM * KB * sizeof(uint16_t));
        for (int j = full * KB; j < n; j++)
            for (int d = 0; d < HEAD_DIM; d++) dst[d * KB + j % KB] = v[(long)j * rs + d];
    }
}

/*
 * q: bf16, Q[h][r][d] at q + h*q_hs + r*q_rs (d contiguous), rows r < rows.
 * k, v: bf16, key j of head h at k + j*kv_rs + h*kv_hs (d contiguous), j < n (n >= 1).
 * out: fp32 [heads][rows][64] contiguous; lse: fp32 [heads][rows].
 * Returns 0, or -1 (no AMX permission), -2 (head_dim not 64), -3 (out of memory).
 */
int amx_attention_prefix(const uint16_t *q, long q_hs, long q_rs, int heads, int rows,
                         const uint16_t *k, const uint16_t *v, long kv_rs, long kv_hs, int n,
                         int head_dim, float scale, float *out, float *lse) {
    if (head_dim != HEAD_DIM) return -2;
    if (amx_attention_init()) return -1;
    int nb = (n + KB - 1) / KB;
    int full = n / KB; /* blocks read from the cache in place; a partial last one is copied */
    int tail = n - full * KB;
    int nt = (rows + 15) / 16;
    uint16_t *vt = aligned_alloc(64, (size_t)nb * HEAD_DIM * KB * sizeof(uint16_t));
    uint16_t(*qt)[2][16][32] = aligned_alloc(64, (size_t)nt * sizeof(*qt));
    float(*ost)[HEAD_DIM][16] = aligned_alloc(64, (size_t)nt * sizeof(*ost));
    float(*mst)[16] = aligned_alloc(64, (size_t)nt * sizeof(*mst));
    float(*sst)[16] = aligned_alloc(64, (size_t)nt * sizeof(*sst));
    float(*sbig)[16] = aligned_alloc(64, CHUNK_BLOCKS * KB * sizeof(*sbig)); /* 32 KiB */
    if (!vt || !qt || !ost || !mst || !sst || !sbig) {
        free(vt), free(qt), free(ost), free(mst), free(sst), free(sbig);
        return -3;
    }
    uint16_t ktail[KB * HEAD_DIM] __attribute__((aligned(64)));
    uint16_t pbuf[16][32] __attribute__((aligned(64)));
    const float c = scale * 1.44269504088896341f; /* scores to base-2 exponents */
    const __m512 cc = _mm512_set1_ps(c);
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    load_config();
    for (int h = 0; h < heads; h++) {
        const uint16_t *kh = k + h * kv_hs;
        pack_vt(v + h * kv_hs, kv_rs, n, vt);
        if (tail) {
            memset(ktail, 0, sizeof(ktail));
            for (int j = 0; j < tail; j++)
                memcpy(ktail + j * HEAD_DIM, kh + (long)(full * KB + j) * kv_rs,
                       HEAD_DIM * sizeof(uint16_t));
        }
        /* Q^T of every tile in VNNI layout: qt[t][half][p][2m + j] = Q[16t + m][32 half + 2p + j] */
        memset(qt, 0, (size_t)nt * sizeof(*qt));
        for (int r = 0; r < rows; r++) {
            const uint32_t *qrow = (const uint32_t *)(q + h * q_hs + (long)r * q_rs);
            for (int w = 0; w < 32; w++) ((uint32_t *)qt[r / 16][w / 16][w % 16])[r % 16] = qrow[w];
        }
        /* keys in chunks that stay in L2 while every query tile passes over them */
        for (int c0 = 0; c0 < nb; c0 += CHUNK_BLOCKS) {
            int c1 = c0 + CHUNK_BLOCKS < nb ? c0 + CHUNK_BLOCKS : nb;
            for (int t = 0; t < nt; t++) {
                _tile_loadd(4, qt[t][0], 64);
                _tile_loadd(5, qt[t][1], 64);
                /* pass 1: the max score of each query over this chunk */
                __m512 mx = _mm512_set1_ps(-INFINITY);
                for (int b = c0; b < c1; b++) {
                    const uint16_t *kb = b < full ? kh + (long)b * KB * kv_rs : ktail;
                    long ks = b < full ? kv_rs : HEAD_DIM;
                    int valid = b < full ? KB : tail;
                    for (int s = 0; s < 2; s++) {
                        _tile_zero(6);
                        _tile_loadd(7, kb + s * 16 * ks, ks * 2);
                        _tile_dpbf16ps(6, 7, 4);
                        _tile_loadd(7, kb + s * 16 * ks + 32, ks * 2);
                        _tile_dpbf16ps(6, 7, 5);
                        _tile_stored(6, sbig[(b - c0) * KB + s * 16], 64);
                    }
                    float(*sbuf)[16] = sbig + (b - c0) * KB;
                    for (int j = 0; j < valid; j++)
                        mx = _mm512_max_ps(mx, _mm512_load_ps(sbuf[j]));
                }
                __m512 sum;
                if (c0 == 0) {
                    sum = _mm512_setzero_ps();
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                } else { /* rescale the running output and sum to the new max */
                    __m512 old = _mm512_load_ps(mst[t]);
                    mx = _mm512_max_ps(mx, old);
                    __m512 alpha = exp2_neg(_mm512_mul_ps(_mm512_sub_ps(old, mx), cc));
                    sum = _mm512_mul_ps(_mm512_load_ps(sst[t]), alpha);
                    for (int d = 0; d < HEAD_DIM; d++)
                        _mm512_store_ps(ost[t][d], _mm512_mul_ps(_mm512_load_ps(ost[t][d]), alpha));
                    _tile_loadd(0, ost[t][0], 64);
                    _tile_loadd(1, ost[t][16], 64);
                    _tile_loadd(2, ost[t][32], 64);
                    _tile_loadd(3, ost[t][48], 64);
                }
                _mm512_store_ps(mst[t], mx);
                /* pass 2: P^T = exp(S^T - max), O^T += V^T P^T */
                __m512 mc = _mm512_mul_ps(mx, cc);
                for (int b = c0; b < c1; b++) {
                    int valid = b < full ? KB : tail;
                    float(*sbuf)[16] = sbig + (b - c0) * KB;
                    for (int p = 0; p < 16; p++) {
                        __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps();
                        if (2 * p < valid)
                            e0 = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(sbuf[2 * p]), cc, mc));
                        if (2 * p + 1 < valid)
                            e1 = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(sbuf[2 * p + 1]), cc, mc));
                        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
                        __m512i pk = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
                        _mm512_store_si512((__m512i *)pbuf[p], _mm512_permutexvar_epi16(inter, pk));
                    }
                    const uint16_t *vb = vt + (size_t)b * HEAD_DIM * KB;
                    _tile_loadd(6, pbuf, 64);
                    _tile_loadd(7, vb, 64);
                    _tile_dpbf16ps(0, 7, 6);
                    _tile_loadd(7, vb + 16 * KB, 64);
                    _tile_dpbf16ps(1, 7, 6);
                    _tile_loadd(7, vb + 32 * KB, 64);
                    _tile_dpbf16ps(2, 7, 6);
                    _tile_loadd(7, vb + 48 * KB, 64);
                    _tile_dpbf16ps(3, 7, 6);
                }
                _mm512_store_ps(sst[t], sum);
                _tile_stored(0, ost[t][0], 64);
                _tile_stored(1, ost[t][16], 64);
                _tile_stored(2, ost[t][32], 64);
                _tile_stored(3, ost[t][48], 64);
            }
        }
        for (int t = 0; t < nt; t++) {
            int r0 = 16 * t, nr = rows - r0 < 16 ? rows - r0 : 16;
            __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_load_ps(sst[t]));
            for (int d = 0; d < HEAD_DIM; d++)
                _mm512_store_ps(ost[t][d], _mm512_mul_ps(_mm512_load_ps(ost[t][d]), inv));
            float *oh = out + ((long)h * rows + r0) * HEAD_DIM;
            for (int m = 0; m < nr; m++) {
                for (int d = 0; d < HEAD_DIM; d++) oh[m * HEAD_DIM + d] = ost[t][d][m];
                lse[(long)h * rows + r0 + m] = mst[t][m] * scale + logf(sst[t][m]);
            }
        }
    }
    _tile_release();
    free(vt), free(qt), free(ost), free(mst), free(sst), free(sbig);
    return 0;
}

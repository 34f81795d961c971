/* bf16 attention of stacked query rows on AMX tiles: a step over the paged cache (causal, K/V
 * read through the block table), or unmasked over a key range.
 *
 * Built and loaded by engine/model/attention/amx.py (ctypes; no torch headers). A job is the
 * stacked query rows of one K/V head (the G query heads that share it, each with its positions)
 * over that head's keys, given as 16-key groups (a pointer and a row stride each: read in place
 * from the cache, or staged when a group is not one stride apart). Keys are taken in chunks of
 * 512 (K and V^T 128 KiB: they stay in L2 while every tile of 16 query rows passes over them);
 * per tile and chunk, two passes, 32 keys at a time:
 *   1. S^T = K . Q^T (K rows as the A tile, Q^T packed once per job in VNNI layout as B): 16 keys
 *      x 16 queries per tile, one zmm = one key's scores for the 16 queries, so the max per query
 *      is an element-wise max of rows (no horizontal reduction); the chunk's scores are kept
 *      (32 KiB, L1); keys past a row's position get -inf;
 *   2. P^T = exp(S^T - max) from the kept scores (fp32 sum per query; P^T rounded to bf16 and
 *      interleaved in key pairs: the VNNI B operand; masked keys 0), O^T += V^T . P^T with V^T
 *      (packed once per job) as A.
 * Key blocks past a tile's last position are skipped; only blocks past its first are masked.
 * Within a chunk the max is exact, so O^T (64 dims x 16 queries, fp32) stays in four tile
 * registers over the chunk; between chunks it is rescaled once (online softmax). Tiles: 0-3
 * O^T, 4-5 Q^T (two 32-dim halves), 6 S^T / P^T, 7 K / V^T. Output: bf16 rows written in place
 * (paged), or fp32 rows and the natural log-sum-exp (prefix).
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

/* One attention job: the stacked query rows of one K/V head (of one sequence) over its keys. */
typedef struct {
    int rows, n;               /* query rows, keys */
    const uint16_t **qrow;     /* [rows] each row's 64 dims */
    const int *pos;            /* [rows] row r sees keys 0 .. pos[r] (pos[r] < n) */
    const uint16_t **kp, **vp; /* [2 * ceil(n / 32)] 16-key groups: the first key's row */
    const long *gs;            /* [...] the group's row stride (elements) */
    float scale;
    float *out, *lse;          /* fp32 mode: out [rows][64], lse [rows] */
    uint16_t **orow;           /* else bf16 mode: each row's output (no lse) */
} job;

/* Per-thread scratch, grown as needed (no allocation per call once warm). */
typedef struct {
    size_t cap_vt;
    uint16_t *vt;                 /* V^T blocks [nb][64][32] */
    uint16_t (*qt)[2][16][32];    /* Q^T tiles */
    float (*ost)[HEAD_DIM][16];   /* O^T per tile */
    float (*mst)[16], (*sst)[16]; /* max, sum per tile */
    int32_t (*tpos)[16];          /* row positions per tile */
    int *tmin, *tmax;
    float (*sbig)[16];            /* one chunk's scores */
    const uint16_t **kp, **vp;
    long *gs;
    const uint16_t **qrow;
    uint16_t **orow;
    int *pos;
    uint16_t *kst, *vst; /* staged 16-key groups (not contiguous in the cache, or a tail) */
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

/* Room for jobs of up to `rows` rows and `n` keys; staging for `staged` groups. -3 if none. */
static int reserve(int rows, int n, int staged) {
    size_t nb = (size_t)(n + KB - 1) / KB, nt = (size_t)(rows + 15) / 16, ng = 2 * nb;
    static __thread size_t cap_qt, cap_ost, cap_mst, cap_sst, cap_tpos, cap_tmin, cap_tmax,
        cap_sbig, cap_kp, cap_vp, cap_gs, cap_qrow, cap_orow, cap_pos, cap_kst, cap_vst;
    if (grow((void **)&ws.vt, &ws.cap_vt, nb * HEAD_DIM * KB * 2) ||
        grow((void **)&ws.qt, &cap_qt, nt * sizeof(*ws.qt)) ||
        grow((void **)&ws.ost, &cap_ost, nt * sizeof(*ws.ost)) ||
        grow((void **)&ws.mst, &cap_mst, nt * sizeof(*ws.mst)) ||
        grow((void **)&ws.sst, &cap_sst, nt * sizeof(*ws.sst)) ||
        grow((void **)&ws.tpos, &cap_tpos, nt * sizeof(*ws.tpos)) ||
        grow((void **)&ws.tmin, &cap_tmin, nt * sizeof(int)) ||
        grow((void **)&ws.tmax, &cap_tmax, nt * sizeof(int)) ||
        grow((void **)&ws.sbig, &cap_sbig, CHUNK_BLOCKS * KB * sizeof(*ws.sbig)) ||
        grow((void **)&ws.kp, &cap_kp, ng * sizeof(void *)) ||
        grow((void **)&ws.vp, &cap_vp, ng * sizeof(void *)) ||
        grow((void **)&ws.gs, &cap_gs, ng * sizeof(long)) ||
        grow((void **)&ws.qrow, &cap_qrow, (size_t)rows * sizeof(void *)) ||
        grow((void **)&ws.orow, &cap_orow, (size_t)rows * sizeof(void *)) ||
        grow((void **)&ws.pos, &cap_pos, (size_t)rows * sizeof(int)) ||
        grow((void **)&ws.kst, &cap_kst, (size_t)(staged + 1) * 16 * HEAD_DIM * 2) ||
        grow((void **)&ws.vst, &cap_vst, (size_t)(staged + 1) * 16 * HEAD_DIM * 2))
        return -3;
    return 0;
}

/* V^T in A-tile blocks: vt[block][d][32 keys]. Each 16-key half: a gather of 16 keys' 32-bit
 * words (dims 2w, 2w+1) at its own row stride; the two halves split into even and odd dims. */
static void pack_vt(const job *jb, int nb, uint16_t *vt) {
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i even, odd;
    {
        uint16_t e[32], o[32];
        for (int i = 0; i < 32; i++) e[i] = 2 * i, o[i] = 2 * i + 1;
        even = _mm512_loadu_si512(e);
        odd = _mm512_loadu_si512(o);
    }
    for (int b = 0; b < nb; b++) {
        const uint16_t *s0 = jb->vp[2 * b], *s1 = jb->vp[2 * b + 1];
        const __m512i r0 = _mm512_mullo_epi32(iota, _mm512_set1_epi32((int)(jb->gs[2 * b] / 2)));
        const __m512i r1 =
            _mm512_mullo_epi32(iota, _mm512_set1_epi32((int)(jb->gs[2 * b + 1] / 2)));
        uint16_t *dst = vt + (size_t)b * HEAD_DIM * KB;
        for (int w = 0; w < HEAD_DIM / 2; w++) {
            __m512i g0 = _mm512_i32gather_epi32(r0, s0 + 2 * w, 4);
            __m512i g1 = _mm512_i32gather_epi32(r1, s1 + 2 * w, 4);
            _mm512_store_si512((__m512i *)(dst + (2 * w) * KB), _mm512_permutex2var_epi16(g0, even, g1));
            _mm512_store_si512((__m512i *)(dst + (2 * w + 1) * KB),
                               _mm512_permutex2var_epi16(g0, odd, g1));
        }
    }
}

static inline uint16_t to_bf16(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* The job's attention (tile config loaded, workspace reserved). Row r sees keys 0 .. pos[r]:
 * key blocks past a tile's last position are skipped, and only blocks that reach past a tile's
 * first position are masked (scores -inf, P 0). Every row sees key 0, so the first chunk gives
 * each row a finite max. */
static void attend(const job *jb) {
    const int n = jb->n, rows = jb->rows;
    const int nb = (n + KB - 1) / KB, nt = (rows + 15) / 16;
    const float c = jb->scale * 1.44269504088896341f; /* scores to base-2 exponents */
    const __m512 cc = _mm512_set1_ps(c), ninf = _mm512_set1_ps(-INFINITY);
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    uint16_t pbuf[16][32] __attribute__((aligned(64)));
    float(*sbig)[16] = ws.sbig;
    pack_vt(jb, nb, ws.vt);
    /* Q^T of every tile in VNNI layout: qt[t][half][p][2m + j] = Q[16t + m][32 half + 2p + j] */
    memset(ws.qt, 0, (size_t)nt * sizeof(*ws.qt));
    for (int r = 0; r < rows; r++) {
        const uint32_t *qrow = (const uint32_t *)jb->qrow[r];
        for (int w = 0; w < 32; w++) ((uint32_t *)ws.qt[r / 16][w / 16][w % 16])[r % 16] = qrow[w];
    }
    for (int t = 0; t < nt; t++) { /* pad rows take the tile's first position: no new keys */
        int lo = 16 * t, hi = rows < lo + 16 ? rows : lo + 16, mn = jb->pos[lo], mx = mn;
        for (int r = lo; r < hi; r++) {
            mn = jb->pos[r] < mn ? jb->pos[r] : mn;
            mx = jb->pos[r] > mx ? jb->pos[r] : mx;
        }
        for (int m = 0; m < 16; m++) ws.tpos[t][m] = lo + m < hi ? jb->pos[lo + m] : mn;
        ws.tmin[t] = mn, ws.tmax[t] = mx;
    }
    for (int c0 = 0; c0 < nb; c0 += CHUNK_BLOCKS) {
        int c1 = c0 + CHUNK_BLOCKS < nb ? c0 + CHUNK_BLOCKS : nb;
        for (int t = 0; t < nt; t++) {
            if (c0 * KB > ws.tmax[t]) continue; /* the whole chunk is past this tile's rows */
            const int bend = c1 < ws.tmax[t] / KB + 1 ? c1 : ws.tmax[t] / KB + 1;
            const __m512i pv = _mm512_load_si512(ws.tpos[t]);
            _tile_loadd(4, ws.qt[t][0], 64);
            _tile_loadd(5, ws.qt[t][1], 64);
            /* pass 1: the max score of each query over this chunk */
            __m512 mx = ninf;
            for (int b = c0; b < bend; b++) {
                for (int s = 0; s < 2; s++) {
                    const uint16_t *kb = jb->kp[2 * b + s];
                    long ks = jb->gs[2 * b + s];
                    _tile_zero(6);
                    _tile_loadd(7, kb, ks * 2);
                    _tile_dpbf16ps(6, 7, 4);
                    _tile_loadd(7, kb + 32, ks * 2);
                    _tile_dpbf16ps(6, 7, 5);
                    _tile_stored(6, sbig[(b - c0) * KB + s * 16], 64);
                }
                float(*sbuf)[16] = sbig + (b - c0) * KB;
                if (b * KB + KB - 1 > ws.tmin[t]) { /* some key of the block is past some row */
                    for (int j = 0; j < KB; j++) {
                        __mmask16 m = _mm512_cmpge_epi32_mask(pv, _mm512_set1_epi32(b * KB + j));
                        __m512 sc = _mm512_mask_mov_ps(ninf, m, _mm512_load_ps(sbuf[j]));
                        _mm512_store_ps(sbuf[j], sc);
                        mx = _mm512_max_ps(mx, sc);
                    }
                } else {
                    for (int j = 0; j < KB; j++) mx = _mm512_max_ps(mx, _mm512_load_ps(sbuf[j]));
                }
            }
            __m512 sum;
            if (c0 == 0) {
                sum = _mm512_setzero_ps();
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            } else { /* rescale the running output and sum to the new max */
                __m512 old = _mm512_load_ps(ws.mst[t]);
                mx = _mm512_max_ps(mx, old);
                __m512 alpha = exp2_neg(_mm512_mul_ps(_mm512_sub_ps(old, mx), cc));
                sum = _mm512_mul_ps(_mm512_load_ps(ws.sst[t]), alpha);
                for (int d = 0; d < HEAD_DIM; d++)
                    _mm512_store_ps(ws.ost[t][d], _mm512_mul_ps(_mm512_load_ps(ws.ost[t][d]), alpha));
                _tile_loadd(0, ws.ost[t][0], 64);
                _tile_loadd(1, ws.ost[t][16], 64);
                _tile_loadd(2, ws.ost[t][32], 64);
                _tile_loadd(3, ws.ost[t][48], 64);
            }
            _mm512_store_ps(ws.mst[t], mx);
            /* pass 2: P^T = exp(S^T - max), O^T += V^T P^T */
            __m512 mc = _mm512_mul_ps(mx, cc);
            for (int b = c0; b < bend; b++) {
                const int masked = b * KB + KB - 1 > ws.tmin[t];
                float(*sbuf)[16] = sbig + (b - c0) * KB;
                for (int p = 0; p < 16; p++) {
                    __m512 e0 = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(sbuf[2 * p]), cc, mc));
                    __m512 e1 = exp2_neg(_mm512_fmsub_ps(_mm512_load_ps(sbuf[2 * p + 1]), cc, mc));
                    if (masked) {
                        int j = b * KB + 2 * p;
                        e0 = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(pv, _mm512_set1_epi32(j)), e0);
                        e1 = _mm512_maskz_mov_ps(
                            _mm512_cmpge_epi32_mask(pv, _mm512_set1_epi32(j + 1)), e1);
                    }
                    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
                    __m512i pk = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
                    _mm512_store_si512((__m512i *)pbuf[p], _mm512_permutexvar_epi16(inter, pk));
                }
                const uint16_t *vb = ws.vt + (size_t)b * HEAD_DIM * KB;
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
            _mm512_store_ps(ws.sst[t], sum);
            _tile_stored(0, ws.ost[t][0], 64);
            _tile_stored(1, ws.ost[t][16], 64);
            _tile_stored(2, ws.ost[t][32], 64);
            _tile_stored(3, ws.ost[t][48], 64);
        }
    }
    const __m512i col = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
    for (int t = 0; t < nt; t++) {
        int r0 = 16 * t, nr = rows - r0 < 16 ? rows - r0 : 16;
        for (int m = 0; m < nr; m++) {
            float inv = 1.0f / ws.sst[t][m];
            if (jb->orow) { /* bf16 row: 16 dims per gather down O^T's column m */
                uint16_t *o = jb->orow[r0 + m];
                for (int d = 0; d < HEAD_DIM; d += 16) {
                    __m512 x = _mm512_i32gather_ps(col, &ws.ost[t][d][m], 4);
                    __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(x, _mm512_set1_ps(inv)));
                    _mm256_storeu_si256((__m256i *)(o + d), (__m256i)y);
                }
            } else {
                float *o = jb->out + (long)(r0 + m) * HEAD_DIM;
                for (int d = 0; d < HEAD_DIM; d++) o[d] = ws.ost[t][d][m] * inv;
                jb->lse[r0 + m] = ws.mst[t][m] * jb->scale + logf(ws.sst[t][m]);
            }
        }
    }
}

/* The 16-key groups of keys 0 .. n-1 whose row j lies at base + off[j] (elements): a group
 * whose 16 rows are one stride apart is read in place; one that is not (blocks smaller than 16
 * or not aligned to it) or that runs past n is copied into staging, zero past n. Returns the
 * number of groups that need staging when `kst` is NULL (a dry run). */
static int groups(const long *off, long rs, int n, const uint16_t *kbase, const uint16_t *vbase,
                  uint16_t *kst, uint16_t *vst) {
    int ng = 2 * ((n + KB - 1) / KB), staged = 0;
    for (int g = 0; g < ng; g++) {
        int j0 = 16 * g, inplace = j0 + 16 <= n;
        for (int i = 1; inplace && i < 16; i++) inplace = off[j0 + i] == off[j0] + i * rs;
        if (inplace) {
            if (kst) ws.kp[g] = kbase + off[j0], ws.vp[g] = vbase + off[j0], ws.gs[g] = rs;
            continue;
        }
        if (kst) {
            uint16_t *kd = kst + (size_t)staged * 16 * HEAD_DIM, *vd = vst + (size_t)staged * 16 * HEAD_DIM;
            memset(kd, 0, 16 * HEAD_DIM * 2);
            memset(vd, 0, 16 * HEAD_DIM * 2);
            for (int i = 0; i < 16 && j0 + i < n; i++) {
                memcpy(kd + i * HEAD_DIM, kbase + off[j0 + i], HEAD_DIM * 2);
                memcpy(vd + i * HEAD_DIM, vbase + off[j0 + i], HEAD_DIM * 2);
            }
            ws.kp[g] = kd, ws.vp[g] = vd, ws.gs[g] = HEAD_DIM;
        }
        staged++;
    }
    return staged;
}

/*
 * Unmasked attention over a key prefix (every row sees all n keys), fp32 output and lse.
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
    long *off = malloc((size_t)(n + KB) * sizeof(long));
    if (!off) return -3;
    for (int j = 0; j < n; j++) off[j] = (long)j * kv_rs;
    if (reserve(rows, n, groups(off, kv_rs, n, k, v, NULL, NULL))) {
        free(off);
        return -3;
    }
    load_config();
    for (int r = 0; r < rows; r++) ws.pos[r] = n - 1;
    for (int h = 0; h < heads; h++) {
        for (int r = 0; r < rows; r++) ws.qrow[r] = q + h * q_hs + (long)r * q_rs;
        groups(off, kv_rs, n, k + h * kv_hs, v + h * kv_hs, ws.kst, ws.vst);
        job jb = {rows, n, ws.qrow, ws.pos, ws.kp, ws.vp, ws.gs, scale,
                  out + (long)h * rows * HEAD_DIM, lse + (long)h * rows, NULL};
        attend(&jb);
    }
    _tile_release();
    free(off);
    return 0;
}

/*
 * A step's attention read through the paged cache's block tables: each sequence's q_len query
 * rows at positions [ctx_len - q_len, ctx_len) attend causally to keys [0, ctx_len) (the step's
 * own K/V already stored), one online softmax over all of them (no merge). Decodes are
 * sequences with q_len 1.
 * q: bf16 [tokens][heads_q][64] (strides q_ts, q_hs; d contiguous), heads_q = kv_heads * groups,
 *   query head kv * groups + g uses K/V head kv.
 * seqs: int32 [nseq][3] = q_start, q_len, ctx_len; table: int64 [nseq][table_w] block ids.
 * k_cache, v_cache: bf16, slot s = block * block_size + i of head h at cache + s*kv_ts + h*kv_hs.
 * out: bf16, row of token t, query head hq at out + t*o_ts + hq*o_hs.
 * Returns 0, or -1 (no AMX permission), -2 (bad arguments), -3 (out of memory).
 */
int amx_attention_paged(const uint16_t *q, long q_ts, long q_hs, int kv_heads, int groups_,
                        int nseq, const int32_t *seqs, const int64_t *table, long table_w,
                        int block_size, const uint16_t *k_cache, const uint16_t *v_cache,
                        long kv_ts, long kv_hs, float scale, uint16_t *out, long o_ts, long o_hs) {
    if (block_size < 1 || kv_heads < 1 || groups_ < 1) return -2;
    if (amx_attention_init()) return -1;
    int nmax = 0, rmax = 0;
    for (int s = 0; s < nseq; s++) {
        int q_len = seqs[3 * s + 1], n = seqs[3 * s + 2];
        if (q_len < 1 || n < q_len || (n + block_size - 1) / block_size > table_w) return -2;
        nmax = n > nmax ? n : nmax;
        rmax = groups_ * q_len > rmax ? groups_ * q_len : rmax;
    }
    long *off = malloc((size_t)(nmax + KB) * sizeof(long));
    if (!off) return -3;
    int loaded = 0;
    for (int s = 0; s < nseq; s++) {
        int q0 = seqs[3 * s], q_len = seqs[3 * s + 1], n = seqs[3 * s + 2], start = n - q_len;
        const int64_t *blocks = table + (long)s * table_w;
        for (int j = 0; j < n; j++) off[j] = (blocks[j / block_size] * block_size + j % block_size) * kv_ts;
        int rows = groups_ * q_len;
        if (reserve(rows, n, groups(off, kv_ts, n, k_cache, v_cache, NULL, NULL))) {
            free(off);
            if (loaded) _tile_release();
            return -3;
        }
        if (!loaded) load_config(), loaded = 1;
        for (int r = 0; r < rows; r++) ws.pos[r] = start + r % q_len;
        for (int h = 0; h < kv_heads; h++) {
            for (int r = 0; r < rows; r++) {
                long i = q0 + r % q_len, hq = (long)h * groups_ + r / q_len;
                ws.qrow[r] = q + i * q_ts + hq * q_hs;
                ws.orow[r] = out + i * o_ts + hq * o_hs;
            }
            groups(off, kv_ts, n, k_cache + h * kv_hs, v_cache + h * kv_hs, ws.kst, ws.vst);
            job jb = {rows, n, ws.qrow, ws.pos, ws.kp, ws.vp, ws.gs, scale, NULL, NULL, ws.orow};
            attend(&jb);
        }
    }
    if (loaded) _tile_release();
    free(off);
    return 0;
}

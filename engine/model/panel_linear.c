/* fp32 linear layers over weights packed in 16-output panels (chunkscope; see panel_linear.py).
 *
 * out[m][n] = sum_k x[m][k] * W[n][k] (+ bias[n]) with W [N][K] packed once into panels:
 * P[b][k][j] = W[16b + j][k] (zero past N), so a panel is one sequential stream of K x 16 floats.
 * The micro-kernel keeps a 6-row x 16-output block of sums in registers (12 vectors of 8 floats),
 * reads each panel row once per 6 input rows and broadcasts x[m][k] into it: the decode step's
 * few rows read each weight once, in order, with nothing else around it. Each output's sum runs
 * over k in order, whatever the number of rows: a row's result does not depend on the batch.
 *
 * Plain C with GCC's vector extension (8 floats; -O3 -march=native picks the host's ISA), so it
 * builds wherever GCC or clang does.
 *
 * Threads: with OpenMP (-fopenmp), a call of many rows (two groups or more) gives each of
 * `threads` threads a range of rows, each thread running the one-thread kernel on its rows
 * (its own packed rows, every panel): no barrier, the weights streamed as on one thread per
 * group. Fewer rows share the panels (16 outputs each) out instead, the rows packed once by the
 * calling thread. Each output is computed alike on any thread (the same sum in the same
 * order): the bits do not depend on the thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

#define MR 6 /* rows per block */
#define NR 16 /* outputs per panel */
#ifndef MB_BYTES
#define MB_BYTES (128 * 1024) /* input rows per group, in bytes */
#endif

/* Pack W [n][k] (row stride ws) into ceil(n / 16) panels of k x 16 floats at p. */
void panel_pack(const float *w, long ws, int n, int k, float *p) {
    int np = (n + NR - 1) / NR;
    for (int b = 0; b < np; b++)
        for (int kk = 0; kk < k; kk++) {
            float *dst = p + ((long)b * k + kk) * NR;
            for (int j = 0; j < NR; j++) {
                int o = b * NR + j;
                dst[j] = o < n ? w[(long)o * ws + kk] : 0.0f;
            }
        }
}

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* rows [0, mr) of the block's sums (+ bias) to out, outputs [0, nv) of each. */
static inline void store(int mr, v8 a[MR][2], const float *bias, float *out, long os, int nv) {
    for (int m = 0; m < mr; m++) {
        float s[NR];
        memcpy(s, &a[m][0], sizeof(v8));
        memcpy(s + 8, &a[m][1], sizeof(v8));
        float *o = out + m * os;
        if (bias)
            for (int j = 0; j < nv; j++) o[j] = s[j] + bias[j];
        else
            for (int j = 0; j < nv; j++) o[j] = s[j];
    }
}

/* rows [0, mr) (mr <= MR) of a packed row block xt[k][MR] against one panel; writes outputs
 * [0, nv) of each row. */
static inline void block(int mr, const float *xt, const float *panel, int k, const float *bias,
                         float *out, long os, int nv) {
    v8 a[MR][2];
    for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = (v8){0};
    for (int kk = 0; kk < k; kk++) {
        v8 w0 = load8(panel + kk * NR), w1 = load8(panel + kk * NR + 8);
        const float *xk = xt + kk * MR;
        for (int m = 0; m < MR; m++) {
            a[m][0] += xk[m] * w0;
            a[m][1] += xk[m] * w1;
        }
    }
    store(mr, a, bias, out, os, nv);
}

/* fewer rows than a block (a decode step of one or two sequences): x read in place, only the
 * rows there are (no zero rows computed). */
static inline void block_few(int mr, const float *x, long xs, const float *panel, int k,
                             const float *bias, float *out, long os, int nv) {
    v8 a[MR][2];
    for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = (v8){0};
    for (int kk = 0; kk < k; kk++) {
        v8 w0 = load8(panel + kk * NR), w1 = load8(panel + kk * NR + 8);
        for (int m = 0; m < MR; m++) {
            if (m < mr) {
                float xv = x[m * xs + kk];
                a[m][0] += xv * w0;
                a[m][1] += xv * w1;
            }
        }
    }
    store(mr, a, bias, out, os, nv);
}

static __thread float *scratch; /* a group's packed rows */
static __thread size_t scratch_cap;

/* Whether the library shares its panels out to threads (built with OpenMP). */
int panel_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* out [rows][n] (row stride os) = x [rows][k] (row stride xs) . W^T (+ bias) over the panels p.
 * threads: how many threads share the panels (1 below ~2 panels each). Returns 0, or -1 when
 * scratch memory fails. */
int panel_linear(const float *x, long xs, int rows, const float *p, int n, int k,
                 const float *bias, float *out, long os, int threads) {
    /* rows in groups of ~MB_BYTES of x, packed per 6-row block as xt[k][6] (zero past the
     * last row); every panel (k x 16 floats, L1/L2) then passes over the group's blocks */
    const int np = (n + NR - 1) / NR;
    long group = MB_BYTES / ((long)k * (long)sizeof(float));
    group = group < MR ? MR : group / MR * MR;
    if (threads > 1 && rows >= 2 * group) { /* a range of rows per thread */
        int nthr = rows / group < threads ? (int)(rows / group) : threads, rc = 0;
#pragma omp parallel for schedule(static) num_threads(nthr)
        for (int t = 0; t < nthr; t++) {
            long r0 = (long)rows * t / nthr / MR * MR;
            long r1 = t + 1 == nthr ? rows : (long)rows * (t + 1) / nthr / MR * MR;
            if (r1 > r0 && panel_linear(x + r0 * xs, xs, (int)(r1 - r0), p, n, k, bias,
                                        out + r0 * os, os, 1)) {
#pragma omp atomic write
                rc = -1;
            }
        }
        return rc;
    }
    if (threads > np / 2) threads = np / 2 > 1 ? np / 2 : 1;
    if (rows < MR) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int b = 0; b < np; b++) {
            int nv = n - b * NR < NR ? n - b * NR : NR;
            block_few(rows, x, xs, p + (long)b * k * NR, k, bias ? bias + b * NR : 0,
                      out + b * NR, os, nv);
        }
        return 0;
    }
    long gmax = rows < group ? (rows + MR - 1) / MR * MR : group;
    size_t need = sizeof(float) * (size_t)gmax * (size_t)k;
    if (need > scratch_cap) { /* grown once per thread, kept: no allocation per call */
        float *grown = realloc(scratch, need);
        if (!grown) return -1;
        scratch = grown, scratch_cap = need;
    }
    float *xt = scratch;
    for (int g0 = 0; g0 < rows; g0 += (int)group) {
        int g1 = rows - g0 < group ? rows : g0 + (int)group;
        for (int m0 = g0; m0 < g1; m0 += MR) {
            float *dst = xt + (long)(m0 - g0) * k;
            int mr = g1 - m0 < MR ? g1 - m0 : MR;
            for (int m = 0; m < MR; m++) {
                const float *src = x + (long)(m0 + m) * xs;
                for (int kk = 0; kk < k; kk++) dst[kk * MR + m] = m < mr ? src[kk] : 0.0f;
            }
        }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int b = 0; b < np; b++) {
            int nv = n - b * NR < NR ? n - b * NR : NR;
            const float *panel = p + (long)b * k * NR, *bb = bias ? bias + b * NR : 0;
            for (int m0 = g0; m0 < g1; m0 += MR) {
                int mr = g1 - m0 < MR ? g1 - m0 : MR;
                block(mr, xt + (long)(m0 - g0) * k, panel, k, bb, out + (long)m0 * os + b * NR,
                      os, nv);
            }
        }
    }
    return 0;
}

/* Row-wise fp32 operations of the decoder step, each in one pass over a row (chunkscope; see
 * fused.py). Plain C for the vectorizer (-O3 -march=native -fopenmp -fno-trapping-math:
 * the last lets it select between values computed on both sides of a comparison; nothing here
 * reads the floating-point exception flags), so it builds on any CPU with a C compiler. torch
 * runs each of these as several elementwise ops (RMSNorm: pow, mean, add, rsqrt, two muls;
 * rotary: two muls, a cat of a negated half, an add; silu x up: silu, mul), each a dispatch and
 * a pass over the tensor: at a decode step's few rows the dispatches are the cost. Results are
 * torch's up to fp32 summation order (the RMS) and the exp inside silu. Rows of n elements with
 * a row stride in elements.
 */
#include <math.h>
#include <stdint.h>

/* Threads: each function's rows are shared out to `threads` threads (OpenMP, built with
 * -fopenmp) when there are at least PARALLEL_MIN elements; one thread below that (a decode
 * step's few rows: the fork would cost more than the pass). Each row is computed alike on any
 * thread. */
#define PARALLEL_MIN 16384

/* Whether the library shares its rows out to threads (built with OpenMP). */
int f32_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#include "vexp.h"

/* out = w * (x * rsqrt(mean(x^2) + eps)) */
void f32_rms_norm(const float *x, long xs, const float *w, int rows, int n, float eps, float *out,
                  long os, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (long)rows * n >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * xs;
        float *o = out + (long)r * os;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* In place on x [rows][heads][d] (row stride xs, heads d apart): x * cos + rotate_half(x) * sin,
 * rotate_half(x) = [-x2, x1] for x = [x1, x2]; cos, sin [rows][d] (row stride cs). */
void f32_rope(float *x, long xs, int rows, int heads, int d, const float *cos_, const float *sin_,
              long cs, int threads) {
    const int half = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (long)rows * heads * d >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++) {
        const float *c = cos_ + (long)r * cs, *s = sin_ + (long)r * cs;
        for (int h = 0; h < heads; h++) {
            float *v = x + (long)r * xs + (long)h * d;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out [rows][n] = silu(gate) * up with gu [rows][2n] = [gate | up]; silu(g) = g / (1 + exp(-g)) */
void f32_silu_mul(const float *gu, long gs, int rows, int n, float *out, long os, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (long)rows * n >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++) {
        const float *g = gu + (long)r * gs, *u = g + n;
        float *o = out + (long)r * os;
#pragma omp simd
        for (int i = 0; i < n; i++) {
            const float x = g[i];
            const float e = exp_neg(x < 0.0f ? x : -x); /* exp(-|x|), in (0, 1] */
            const float inv = 1.0f / (1.0f + e), ei = e * inv;
            const float sig = x < 0.0f ? ei : inv; /* both computed, one selected: vectorizes */
            o[i] = x * sig * u[i];
        }
    }
}

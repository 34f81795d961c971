/* Row-wise bf16 operations of the decoder step fused into one pass each (AVX-512, AVX512-BF16).
 *
 * Built and loaded by engine/model/fused.py (ctypes, as the attention kernel). torch runs each of
 * these as several elementwise ops over bf16 tensors (~3 G elements/s on one thread, each op
 * reading and writing the whole tensor); here each row is read once. Every function rounds to
 * bf16 where torch's op sequence does (llama.py's RMSNorm, rope.apply_rotary, MLP), so the
 * results are torch's up to fp32 summation order (the RMS) and the exp of silu.
 * bf16 values: uint16_t; rows of n elements (n a multiple of 16) with a row stride in elements.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* Threads: each function's rows are shared out to `threads` threads (OpenMP, built with
 * -fopenmp) when there are at least PARALLEL_MIN elements; one thread below that (a decode
 * step's few rows: the fork would cost more than the pass). Each row is computed alike on any
 * thread. */
#define PARALLEL_MIN 16384

/* Whether the library shares its rows out to threads (built with OpenMP). */
int fused_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static inline __m512 load16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

static inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

static inline void store16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, to_bf16(x));
}

static inline __m512 round_bf16(__m512 x) { /* x rounded to bf16 (nearest even), as fp32 */
    __m512i w = _mm512_cvtepu16_epi32(to_bf16(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))): RMSNorm normalized in fp32, scaled in bf16. */
void fused_rms_norm(const uint16_t *x, long xs, const uint16_t *w, int rows, int n, float eps,
                    uint16_t *out, long os, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (long)rows * n >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (long)r * xs;
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 16) {
            __m512 v = load16(xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps);
        __m512 s = _mm512_set1_ps(inv);
        for (int i = 0; i < n; i += 16) {
            __m512 normed = round_bf16(_mm512_mul_ps(load16(xr + i), s));
            store16(out + (long)r * os + i, _mm512_mul_ps(load16(w + i), normed));
        }
    }
}

/* In place, each head of each row: x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), with
 * rotate_half(x) = (-x[d/2:], x[:d/2]); cos, sin: bf16 [rows][d] (d a multiple of 32). */
void fused_rope(uint16_t *x, long xs, int rows, int heads, int d, const uint16_t *cos,
                const uint16_t *sin, long cs, int threads) {
    int h2 = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (long)rows * heads * d >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++) {
        const uint16_t *c = cos + (long)r * cs, *s = sin + (long)r * cs;
        for (int h = 0; h < heads; h++) {
            uint16_t *p = x + (long)r * xs + (long)h * d;
            for (int i = 0; i < h2; i += 16) {
                __m512 a = load16(p + i), b = load16(p + h2 + i);
                __m512 lo = _mm512_add_ps(round_bf16(_mm512_mul_ps(a, load16(c + i))),
                                          round_bf16(_mm512_mul_ps(
                                              _mm512_sub_ps(_mm512_setzero_ps(), b), load16(s + i))));
                __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(b, load16(c + h2 + i))),
                                          round_bf16(_mm512_mul_ps(a, load16(s + h2 + i))));
                store16(p + i, lo);
                store16(p + h2 + i, hi);
            }
        }
    }
}

/* e^x for fp32 (|error| ~1 ulp: Cody-Waite reduction, degree-6 polynomial). */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), f);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* out = bf16(bf16(silu(gate)) * up), gate and up the two halves of each row of gu (n each). */
void fused_silu_mul(const uint16_t *gu, long gs, int rows, int n, uint16_t *out, long os, int threads) {
    const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (long)rows * n >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gu + (long)r * gs, *u = g + n;
        for (int i = 0; i < n; i += 16) {
            __m512 x = load16(g + i);
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x));
            __m512 silu = round_bf16(_mm512_div_ps(x, _mm512_add_ps(one, e)));
            store16(out + (long)r * os + i, _mm512_mul_ps(silu, load16(u + i)));
        }
    }
}

/* The AVX-512 intrinsics vec_attention.c uses, each as two AVX2 halves (chunkscope; see vec.py).
 *
 * Included after <immintrin.h> when the compiler does not target AVX-512F: every name below is
 * #defined to a function on a pair of 256-bit vectors (a 16-bit mask stays a 16-bit mask), so
 * the one kernel source builds and runs on AVX2 + FMA CPUs with the same arithmetic, lane for
 * lane (fp32 FMAs, the same exp2 polynomial; scalef and roundscale by exact equivalents on the
 * range the kernel uses). Only what vec_attention.c calls is here.
 */
#ifndef CHUNKSCOPE_AVX512_ON_AVX2_H
#define CHUNKSCOPE_AVX512_ON_AVX2_H

#include <immintrin.h>
#include <stdint.h>

typedef struct { __m256 lo, hi; } emu_m512;
typedef struct { __m256i lo, hi; } emu_m512i;

#define EMU static inline __attribute__((always_inline))

#define __m512 emu_m512
#define __m512i emu_m512i
#define __mmask16 uint16_t

EMU emu_m512 emu_pair(__m256 lo, __m256 hi) {
    emu_m512 r = {lo, hi};
    return r;
}

EMU uint16_t emu_bits(__m256 lo, __m256 hi) {
    return (uint16_t)(_mm256_movemask_ps(lo) | (_mm256_movemask_ps(hi) << 8));
}

/* lanes whose bit of m is set: all ones */
EMU __m256 emu_lanes(unsigned m) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i b = _mm256_and_si256(_mm256_set1_epi32((int)m), sel);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, sel));
}

EMU emu_m512 emu_set1_ps(float x) { return emu_pair(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
EMU emu_m512 emu_setzero_ps(void) { return emu_pair(_mm256_setzero_ps(), _mm256_setzero_ps()); }
EMU emu_m512 emu_load_ps(const void *p) {
    const float *f = (const float *)p;
    return emu_pair(_mm256_load_ps(f), _mm256_load_ps(f + 8));
}
EMU emu_m512 emu_loadu_ps(const void *p) {
    const float *f = (const float *)p;
    return emu_pair(_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8));
}
EMU void emu_store_ps(void *p, emu_m512 a) {
    _mm256_store_ps((float *)p, a.lo);
    _mm256_store_ps((float *)p + 8, a.hi);
}
EMU void emu_storeu_ps(void *p, emu_m512 a) {
    _mm256_storeu_ps((float *)p, a.lo);
    _mm256_storeu_ps((float *)p + 8, a.hi);
}
EMU emu_m512 emu_add_ps(emu_m512 a, emu_m512 b) {
    return emu_pair(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi));
}
EMU emu_m512 emu_sub_ps(emu_m512 a, emu_m512 b) {
    return emu_pair(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi));
}
EMU emu_m512 emu_mul_ps(emu_m512 a, emu_m512 b) {
    return emu_pair(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi));
}
EMU emu_m512 emu_max_ps(emu_m512 a, emu_m512 b) {
    return emu_pair(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi));
}
EMU emu_m512 emu_fmadd_ps(emu_m512 a, emu_m512 b, emu_m512 c) {
    return emu_pair(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
/* round to nearest integer (the only rounding the kernel asks for) */
EMU emu_m512 emu_roundscale_nearest(emu_m512 a) {
    const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return emu_pair(_mm256_round_ps(a.lo, r), _mm256_round_ps(a.hi, r));
}
#define _mm512_roundscale_ps(a, imm) emu_roundscale_nearest(a)
/* a * 2^n for integral n in [-126, 127] (the kernel's range): 2^n built in the exponent bits */
EMU __m256 emu_scalef8(__m256 a, __m256 n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(a, _mm256_castsi256_ps(e));
}
EMU emu_m512 emu_scalef_ps(emu_m512 a, emu_m512 n) {
    return emu_pair(emu_scalef8(a.lo, n.lo), emu_scalef8(a.hi, n.hi));
}
EMU uint16_t emu_cmp_gt_mask(emu_m512 a, emu_m512 b) {
    return emu_bits(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ));
}
#define _mm512_cmp_ps_mask(a, b, imm) emu_cmp_gt_mask(a, b) /* the kernel asks _CMP_GT_OQ only */
EMU uint16_t emu_cmpge_epi32_mask(emu_m512i a, emu_m512i b) { /* a >= b: not b > a */
    __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(b.lo, a.lo));
    __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(b.hi, a.hi));
    return (uint16_t)~emu_bits(lo, hi);
}
EMU emu_m512 emu_mask_mov_ps(emu_m512 src, uint16_t k, emu_m512 a) {
    return emu_pair(_mm256_blendv_ps(src.lo, a.lo, emu_lanes(k & 0xff)),
                    _mm256_blendv_ps(src.hi, a.hi, emu_lanes(k >> 8)));
}
EMU emu_m512 emu_maskz_mov_ps(uint16_t k, emu_m512 a) {
    return emu_pair(_mm256_and_ps(a.lo, emu_lanes(k & 0xff)), _mm256_and_ps(a.hi, emu_lanes(k >> 8)));
}
EMU emu_m512 emu_maskz_loadu_ps(uint16_t k, const void *p) {
    const float *f = (const float *)p;
    return emu_pair(_mm256_maskload_ps(f, _mm256_castps_si256(emu_lanes(k & 0xff))),
                    _mm256_maskload_ps(f + 8, _mm256_castps_si256(emu_lanes(k >> 8))));
}
EMU void emu_mask_storeu_ps(void *p, uint16_t k, emu_m512 a) {
    float *f = (float *)p;
    _mm256_maskstore_ps(f, _mm256_castps_si256(emu_lanes(k & 0xff)), a.lo);
    _mm256_maskstore_ps(f + 8, _mm256_castps_si256(emu_lanes(k >> 8)), a.hi);
}
EMU float emu_reduce_add_ps(emu_m512 a) {
    __m256 s = _mm256_add_ps(a.lo, a.hi);
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
EMU emu_m512i emu_set1_epi32(int x) {
    emu_m512i r = {_mm256_set1_epi32(x), _mm256_set1_epi32(x)};
    return r;
}
EMU emu_m512i emu_load_si512(const void *p) {
    emu_m512i r = {_mm256_load_si256((const __m256i *)p), _mm256_load_si256((const __m256i *)p + 1)};
    return r;
}
EMU emu_m512i emu_cvtepu16_epi32(__m256i a) {
    emu_m512i r = {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)),
                   _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
    return r;
}
EMU emu_m512i emu_slli_epi32(emu_m512i a, int n) {
    emu_m512i r = {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)};
    return r;
}
EMU emu_m512 emu_castsi512_ps(emu_m512i a) {
    return emu_pair(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi));
}

#define _mm512_set1_ps emu_set1_ps
#define _mm512_setzero_ps emu_setzero_ps
#define _mm512_load_ps emu_load_ps
#define _mm512_loadu_ps emu_loadu_ps
#define _mm512_store_ps emu_store_ps
#define _mm512_storeu_ps emu_storeu_ps
#define _mm512_add_ps emu_add_ps
#define _mm512_sub_ps emu_sub_ps
#define _mm512_mul_ps emu_mul_ps
#define _mm512_max_ps emu_max_ps
#define _mm512_fmadd_ps emu_fmadd_ps
#define _mm512_scalef_ps emu_scalef_ps
#define _mm512_cmpge_epi32_mask emu_cmpge_epi32_mask
#define _mm512_mask_mov_ps emu_mask_mov_ps
#define _mm512_maskz_mov_ps emu_maskz_mov_ps
#define _mm512_maskz_loadu_ps emu_maskz_loadu_ps
#define _mm512_mask_storeu_ps emu_mask_storeu_ps
#define _mm512_reduce_add_ps emu_reduce_add_ps
#define _mm512_set1_epi32 emu_set1_epi32
#define _mm512_load_si512 emu_load_si512
#define _mm512_cvtepu16_epi32 emu_cvtepu16_epi32
#define _mm512_slli_epi32 emu_slli_epi32
#define _mm512_castsi512_ps emu_castsi512_ps

#endif

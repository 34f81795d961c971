/* exp for softmax-style arguments, vectorizable (chunkscope's C kernels; included, not built
 * alone). A Cephes-style polynomial: max relative error ~2e-7 on x <= 0, where libm's expf does
 * not vectorize. */
#ifndef CHUNKSCOPE_VEXP_H
#define CHUNKSCOPE_VEXP_H
#include <math.h>
#include <stdint.h>

/* exp(x) for x <= 0 (softmax arguments after the max is subtracted); 0 below -87.3 */
#pragma omp declare simd
static inline float exp_neg(float x) {
    const float lo = -87.33654f;
    float xc = x < lo ? lo : x;
    /* x = n ln2 + r, |r| <= ln2/2 */
    float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float r2 = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r + 1.0f;
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((int32_t)n + 127) << 23;
    float y = p * c.f;
    return x < lo ? 0.0f : y;
}

#endif

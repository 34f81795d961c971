/* Element-wise pieces of a Llama layer for one CPU thread (chunkscope; see cpu_ops.py).
 *
 * Each function computes what the torch expression in llama.py / rope.py computes, rounding to
 * the model's dtype where torch rounds (one rounding per torch op in bf16), so the bf16 results
 * match torch's to the bit except where torch's own vectorized exp or a different summation
 * order moves an fp32 intermediate by an ulp. fp32 products and sums are not contracted into
 * FMAs (-ffp-contract=off), as torch's element-wise kernels do not contract them either.
 *
 * dtype: 0 = fp32, 1 = bf16. Row strides in elements; the last dim contiguous.
 */
#include <math.h>
#include <stdint.h>

#define MAX_HIDDEN 65536

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

/* bf16 rounding of an fp32 value, kept as fp32 */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline float load(const void *p, long i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, long i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* h += delta (when delta is not NULL), then x = weight * rms_norm(h):
 *   bf16: x = bf16(w * bf16(h * rsqrt(mean(h^2) + eps)))   (h widened to fp32)
 *   fp32: x = (h * rsqrt(mean(h^2) + eps)) * w
 * h: [rows, hidden] (stride h_stride), updated in place; delta likewise; x: [rows, hidden]. */
int add_rms_norm(int dtype, void *h, long h_stride, const void *delta, long d_stride,
                 const void *weight, float eps, void *x, long x_stride, long rows, int hidden) {
    if (hidden < 1 || hidden > MAX_HIDDEN) return -1;
    const int bf16 = dtype == 1;
    float buf[MAX_HIDDEN];
    for (long r = 0; r < rows; r++) {
        const long hb = r * h_stride, db = r * d_stride, xb = r * x_stride;
        float ss = 0.0f;
        if (delta) {
            for (int i = 0; i < hidden; i++) {
                float v = load(h, hb + i, bf16) + load(delta, db + i, bf16);
                if (bf16) v = round_bf16(v);
                store(h, hb + i, v, bf16);
                buf[i] = v;
            }
        } else {
            for (int i = 0; i < hidden; i++) buf[i] = load(h, hb + i, bf16);
        }
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < hidden; i++) ss += buf[i] * buf[i];
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int i = 0; i < hidden; i++) {
            float w = load(weight, i, bf16);
            float v = buf[i] * inv;
            store(x, xb + i, bf16 ? w * round_bf16(v) : v * w, bf16);
        }
    }
    return 0;
}

/* exp for the SiLU: 0 below fp32's range, +inf above it (as expf), so silu(-100) is -0 */
static inline float exp_f(float x) {
    float xc = x < -87.33654f ? -87.33654f : (x > 88.0f ? 88.0f : x);
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
    return x > 88.72284f ? INFINITY : (x < -87.33654f ? 0.0f : y);
}

/* out = silu(gate) * up, gate = gu[:, :inter], up = gu[:, inter:]; bf16 rounds silu(gate)
 * first, as torch's two ops do. */
int silu_mul(int dtype, const void *gu, long gu_stride, void *out, long out_stride, long rows,
             int inter) {
    const int bf16 = dtype == 1;
    for (long r = 0; r < rows; r++) {
        const long gb = r * gu_stride, ob = r * out_stride;
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gu + gb;
            uint16_t *o = (uint16_t *)out + ob;
#pragma omp simd
            for (int i = 0; i < inter; i++) {
                float a = bf16_to_f32(g[i]);
                float s = round_bf16(a / (1.0f + exp_f(-a)));
                o[i] = f32_to_bf16(s * bf16_to_f32(g[inter + i]));
            }
        } else {
            const float *g = (const float *)gu + gb;
            float *o = (float *)out + ob;
#pragma omp simd
            for (int i = 0; i < inter; i++) {
                float a = g[i];
                o[i] = (a / (1.0f + exp_f(-a))) * g[inter + i];
            }
        }
    }
    return 0;
}

/* Rotary embedding in place on x [rows, heads, dim] (row stride, head stride), with the
 * step's tables cos/sin [rows, dim] (row stride tab_stride) in the same dtype:
 *   x' = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half]);
 * bf16 rounds each product and the sum, as torch's three ops do. */
int rope_inplace(int dtype, void *x, long row_stride, long head_stride, long rows, int heads,
                 int dim, const void *cos_t, const void *sin_t, long tab_stride) {
    if (dim < 2 || dim % 2 || dim > 1024) return -1;
    const int bf16 = dtype == 1, half = dim / 2;
    float xv[1024];
    for (long r = 0; r < rows; r++) {
        const long tb = r * tab_stride;
        for (int h = 0; h < heads; h++) {
            const long xb = r * row_stride + (long)h * head_stride;
            for (int i = 0; i < dim; i++) xv[i] = load(x, xb + i, bf16);
            for (int i = 0; i < dim; i++) {
                float rot = i < half ? -xv[i + half] : xv[i - half];
                float c = load(cos_t, tb + i, bf16), s = load(sin_t, tb + i, bf16);
                float a = xv[i] * c, b = rot * s;
                if (bf16) {
                    a = round_bf16(a);
                    b = round_bf16(b);
                }
                store(x, xb + i, a + b, bf16);
            }
        }
    }
    return 0;
}

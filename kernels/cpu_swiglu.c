/* SwiGLU's elementwise half on the CPU: out = silu(gate) * up, for rows holding [gate | up] side by side
 * (the fused gate/up projection's output), in one pass; and GeGLU's (Gemma), out = gelu_tanh(gate) * up.
 *
 * torch runs it as three ops (chunk, silu, mul_): ~10 us of a ~300 us SmolLM2 decode layer on 2 cores,
 * mostly per-op overhead, and two passes over a prefill chunk's [T, 2F] rows. silu(x) = x * sigmoid(x),
 * sigmoid from e = exp(-|x|) (cpu_simd.h's exp8, about 1 ulp): 1 / (1 + e) for x >= 0, e / (1 + e)
 * below, so neither side overflows. torch computes x / (1 + exp(-x)): results differ by a few ulp.
 * AVX2 + FMA builds only (the plain C build returns -2 and the caller keeps torch's ops).
 * Built by kvcli_kernels/cpu_build.py like cpu_int8dot.c; rows are split across threads when many.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "cpu_simd.h" /* exp8 */
#define KVS_AVX2 1
#endif

static inline float silu1(float x) {
    const float e = expf(-fabsf(x)), r = 1.0f / (1.0f + e);
    return x * (x >= 0.0f ? r : e * r);
}

/* gu: M rows of 2F floats with row stride `row` (gate then up); out: [M, F] contiguous.
 * Returns 0, or -2 where this build has no vector path. */
int kvs_swiglu(const float *gu, int64_t M, int64_t F, int64_t row, float *out, int nthreads) {
#ifdef KVS_AVX2
    const int nt = M * F < (1 << 16) ? 1 : nthreads;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * row, *u = g + F;
        float *o = out + m * F;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= F; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_or_ps(x, sign));  /* exp(-|x|) */
            const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
            const __m256 s = _mm256_blendv_ps(_mm256_mul_ps(e, r), r, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, s), _mm256_loadu_ps(u + i)));
        }
        for (; i < F; i++) o[i] = silu1(g[i]) * u[i];
    }
    return 0;
#else
    (void)gu, (void)M, (void)F, (void)row, (void)out, (void)nthreads, (void)silu1;
    return -2;
#endif
}

/* gelu_tanh(x) = 0.5 x (1 + tanh(z)), z = sqrt(2 / pi) (x + 0.044715 x^3), as transformers' gelu_pytorch_tanh
 * and ggml's gelu; tanh(|z|) = (1 - t) / (1 + t) with t = exp(-2 |z|), the sign put back (no overflow). */
static inline float gelu1(float x) {
    const float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    const float t = expf(-2.0f * fabsf(z)), th = (1.0f - t) / (1.0f + t);
    return 0.5f * x * (1.0f + (z >= 0.0f ? th : -th));
}

int kvs_geglu(const float *gu, int64_t M, int64_t F, int64_t row, float *out, int nthreads) {
#ifdef KVS_AVX2
    const int nt = M * F < (1 << 16) ? 1 : nthreads;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * row, *u = g + F;
        float *o = out + m * F;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
        const __m256 c = _mm256_set1_ps(0.7978845608028654f), a = _mm256_set1_ps(0.044715f);
        const __m256 two = _mm256_set1_ps(-2.0f);
        for (; i + 8 <= F; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 z = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(a, x), _mm256_mul_ps(x, x), x));
            const __m256 az = _mm256_andnot_ps(sign, z);
            const __m256 t = exp8(_mm256_mul_ps(two, az));
            const __m256 th = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
            const __m256 ts = _mm256_or_ps(th, _mm256_and_ps(sign, z)); /* tanh(z): |tanh| with z's sign */
            const __m256 ge = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, ts));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(ge, _mm256_loadu_ps(u + i)));
        }
        for (; i < F; i++) o[i] = gelu1(g[i]) * u[i];
    }
    return 0;
#else
    (void)gu, (void)M, (void)F, (void)row, (void)out, (void)nthreads, (void)gelu1;
    return -2;
#endif
}

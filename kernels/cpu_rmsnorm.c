/* RMSNorm of fp32 rows on the CPU: out = x / sqrt(mean(x^2) + eps) * w.
 *
 * torch's CPU rms_norm runs as a handful of small ops (pow, mean, add, rsqrt, mul, mul), ~20 us for one
 * 576-wide row, twice per layer per decode step: 1.2 ms of a 13 ms SmolLM2 step. One pass here. The
 * same formula as transformers' LlamaRMSNorm (mean of squares in fp32, then x * rsqrt(...) * w), summed
 * in another order: results differ from torch's by a few ulp.
 * Built by kvcli_kernels/cpu_build.py like cpu_int8dot.c; rows are split across threads when many.
 */
#include <math.h>
#include <stdint.h>

void kvq_rmsnorm(const float *x, const float *w, float *out, int64_t M, int64_t K, float eps, int nthreads) {
    const int nt = M * K < (1 << 15) ? 1 : nthreads;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        float *o = out + m * K;
        float part[8] = {0};
        int64_t k = 0;
        for (; k + 8 <= K; k += 8)
            for (int j = 0; j < 8; j++) part[j] += xr[k + j] * xr[k + j];
        float ss = 0.0f;
        for (int j = 0; j < 8; j++) ss += part[j];
        for (; k < K; k++) ss += xr[k] * xr[k];
        const float r = 1.0f / sqrtf(ss / (float)K + eps);
        for (k = 0; k < K; k++) o[k] = (xr[k] * r) * w[k];
    }
}

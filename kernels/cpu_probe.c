/* The machine's own limits, measured the way kvcli's CPU kernels meet them (the roofline benchmark,
 * kvcli/bench/roofline.py, times these calls and divides):
 *
 *   kvp_read       read bandwidth: every thread streams its contiguous share of a buffer with vector loads into
 *                  eight independent accumulators, as a decode step streams its weight panels (torch's sum over
 *                  a large tensor, used before, is not that loop; on the AMD EPYC VM both move together with the
 *                  machine's bandwidth phases, which is why the roofline measures every round).
 *   kvp_int8_peak  the integer dot-product instruction kvcli's int8 GEMM issues, on registers only (no memory):
 *                  512-bit vpdpbusd on AVX-512-VNNI (64 multiply-adds each), 256-bit vpmaddubsw on AVX2 (32, the
 *                  16-bit sums added as the GEMM adds them); twelve independent chains hide the latency.
 *   kvp_fp32_peak  fp32 fused multiply-adds of the widest vector, on registers (the decode attention's scores and
 *                  values are such FMAs: the verify-step figure's floor for a row's attention).
 *
 * Each returns a value computed from everything it read or summed (the caller keeps it), so the compiler cannot
 * drop the work. Built by kvcli_kernels/cpu_build.py like the other kernels; SIMD builds only.
 */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__AVX2__)
#include <immintrin.h>

#if defined(__AVX512F__)
typedef __m512i pv;
#define PV_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define PV_XOR(a, b) _mm512_xor_si512((a), (b))
#define PV_ZERO() _mm512_setzero_si512()
static inline uint64_t pv_fold(pv v) { return (uint64_t)_mm512_reduce_add_epi64(v); }
#else
typedef __m256i pv;
#define PV_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define PV_XOR(a, b) _mm256_xor_si256((a), (b))
#define PV_ZERO() _mm256_setzero_si256()
static inline uint64_t pv_fold(pv v) {
    uint64_t lane[4];
    _mm256_storeu_si256((__m256i *)lane, v);
    return lane[0] + lane[1] + lane[2] + lane[3];
}
#endif

/* Reads the first bytes / (8 * vector width) whole steps of buf, split evenly over the threads that run;
 * *read_out gets the bytes read. */
uint64_t kvp_read(const uint8_t *buf, int64_t bytes, int nthreads, int64_t *read_out) {
    const int64_t step = 8 * (int64_t)sizeof(pv);
    uint64_t total = 0;
    int64_t done = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total, done)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t per = bytes / step / nt * step;
        const uint8_t *p = buf + (int64_t)t * per, *end = p + per;
        done += per;
        pv a0 = PV_ZERO(), a1 = PV_ZERO(), a2 = PV_ZERO(), a3 = PV_ZERO();
        pv a4 = PV_ZERO(), a5 = PV_ZERO(), a6 = PV_ZERO(), a7 = PV_ZERO();
        const int64_t w = (int64_t)sizeof(pv);
        for (; p < end; p += step) {
            a0 = PV_XOR(a0, PV_LOAD(p));
            a1 = PV_XOR(a1, PV_LOAD(p + w));
            a2 = PV_XOR(a2, PV_LOAD(p + 2 * w));
            a3 = PV_XOR(a3, PV_LOAD(p + 3 * w));
            a4 = PV_XOR(a4, PV_LOAD(p + 4 * w));
            a5 = PV_XOR(a5, PV_LOAD(p + 5 * w));
            a6 = PV_XOR(a6, PV_LOAD(p + 6 * w));
            a7 = PV_XOR(a7, PV_LOAD(p + 7 * w));
        }
        total += pv_fold(PV_XOR(PV_XOR(PV_XOR(a0, a1), PV_XOR(a2, a3)), PV_XOR(PV_XOR(a4, a5), PV_XOR(a6, a7))));
    }
    *read_out = done;
    return total;
}

#define CHAINS 12
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
typedef __m512i dv;
#define DV_MACS 64
#define DV_SET1(v) _mm512_set1_epi32(v)
#define DV_STEP(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#define DV_ADD(a, b) _mm512_add_epi32((a), (b))
static inline int64_t dv_fold(dv v) { return _mm512_reduce_add_epi32(v); }
#else
typedef __m256i dv;
#define DV_MACS 32
#define DV_SET1(v) _mm256_set1_epi32(v)
#define DV_STEP(acc, u, s) _mm256_add_epi16((acc), _mm256_maddubs_epi16((u), (s)))
#define DV_ADD(a, b) _mm256_add_epi16((a), (b))
static inline int64_t dv_fold(dv v) {
    int16_t lane[16];
    int64_t s = 0;
    _mm256_storeu_si256((__m256i *)lane, v);
    for (int i = 0; i < 16; i++) s += lane[i];
    return s;
}
#endif

/* Runs iters x CHAINS dot-product instructions on every thread; *macs_out gets the multiply-adds done (all
 * threads). seed feeds the operands so that nothing is known at compile time. Returns a fold of the sums. */
int64_t kvp_int8_peak(int64_t iters, int nthreads, int seed, int64_t *macs_out) {
    int64_t total = 0, threads = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total, threads)
    {
        threads += 1;
        const dv u = DV_SET1(seed & 0x01010101), s = DV_SET1((seed >> 8) & 0x01010101);
        dv acc[CHAINS];
        for (int c = 0; c < CHAINS; c++) acc[c] = DV_SET1(c);
        for (int64_t i = 0; i < iters; i++)
            for (int c = 0; c < CHAINS; c++) acc[c] = DV_STEP(acc[c], u, s);
        dv sum = acc[0];
        for (int c = 1; c < CHAINS; c++) sum = DV_ADD(sum, acc[c]);
        total += dv_fold(sum);
    }
    *macs_out = iters * CHAINS * DV_MACS * threads;
    return total;
}

/* Runs iters x CHAINS fp32 fused multiply-adds of the widest vector on every thread (the decode attention's
 * arithmetic: scores and values are fp32 FMAs); *fmas_out gets the lane multiply-adds done (all threads). Each
 * chain is acc = acc * m + c with m = 0.5: it settles at 2 c, nothing overflows or goes subnormal. Returns a
 * fold of the chains, so that nothing is computed away. */
#if defined(__AVX512F__)
typedef __m512 fv;
#define FV_LANES 16
#define FV_SET1(v) _mm512_set1_ps(v)
#define FV_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define FV_ADD(a, b) _mm512_add_ps((a), (b))
static inline double fv_fold(fv v) { return (double)_mm512_reduce_add_ps(v); }
#else
typedef __m256 fv;
#define FV_LANES 8
#define FV_SET1(v) _mm256_set1_ps(v)
#define FV_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define FV_ADD(a, b) _mm256_add_ps((a), (b))
static inline double fv_fold(fv v) {
    float lane[8];
    double s = 0;
    _mm256_storeu_ps(lane, v);
    for (int i = 0; i < 8; i++) s += lane[i];
    return s;
}
#endif

double kvp_fp32_peak(int64_t iters, int nthreads, int seed, int64_t *fmas_out) {
    double total = 0;
    int64_t threads = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total, threads)
    {
        threads += 1;
        const fv m = FV_SET1(0.5f), c = FV_SET1((float)(seed & 0xFF) + 1.0f);
        fv acc[CHAINS];
        for (int k = 0; k < CHAINS; k++) acc[k] = FV_SET1((float)k);
        for (int64_t i = 0; i < iters; i++)
            for (int k = 0; k < CHAINS; k++) acc[k] = FV_FMA(acc[k], m, c);
        fv sum = acc[0];
        for (int k = 1; k < CHAINS; k++) sum = FV_ADD(sum, acc[k]);
        total += fv_fold(sum);
    }
    *fmas_out = iters * CHAINS * FV_LANES * threads;
    return total;
}

/* which instruction kvp_fp32_peak times */
const char *kvp_fp32_peak_what(void) {
#if defined(__AVX512F__)
    return "512-bit vfmadd";
#else
    return "256-bit vfmadd";
#endif
}

/* the load width kvp_read uses, in bytes (its checksum folds lanes of 8 bytes of one such vector) */
int kvp_read_width(void) { return (int)sizeof(pv); }

/* which instruction kvp_int8_peak times, for the benchmark's header */
const char *kvp_int8_peak_what(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return "512-bit vpdpbusd";
#else
    return "256-bit vpmaddubsw";
#endif
}

#endif

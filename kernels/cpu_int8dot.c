/* y = x W^T on the CPU for group-quantized weights, with integer dot products (llama.cpp's Q4 x Q8 idea).
 *
 * Each row of x (fp32) is quantized per block of 32 to int8 with its own scale (dx = max|x| / 127) and its
 * exact float sum (sx). A weight block of 32 codes q with scale d and min m (w = d q + m) then contributes
 *     d dx sum(q qx) + m sx
 * where sum(q qx) is exact integer arithmetic (AVX2 maddubs, or AVX-512-VNNI dpbusd). Weights:
 *   bits 4: codes uint8 [N, K / 2]; per block of 32, byte j holds code j (low nibble) and j + 16 (high)
 *   bits 8: codes int8  [N, K]
 *   scale, mins: [N, K / G] fp16 or fp32 (G a multiple of 32); mins may be NULL.
 * Every (row of y, column of y) is computed by one thread in one fixed order, whatever M and the thread
 * count: a row's result does not depend on the rows it is batched with.
 *
 * Built at first use by kvcli_kernels/cpu_int8dot.py (cc -O3 -fopenmp, flags of the ISA in use). The
 * OpenMP runtime is the one torch already loaded (same soname, libgomp.so.1), so torch.set_num_threads and
 * this kernel share one thread pool.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVQ_AVX2 1
#endif

#define QK 32
#define TILE_G 4  /* groups of 8 weight rows per work item: their codes stay in L1 while the x rows pass */
#define TILE_M 4  /* x rows per pass over a weight row: its blocks are unpacked once for all of them */

typedef struct {
    const int8_t *qx;  /* [M, K] */
    const float *dx;   /* [M, K / 32] */
    const float *sx;   /* [M, K / 32] */
    const uint8_t *codes;
    const void *scale, *mins;
    int scale_f16;
    int64_t M, K, N, G;
    float *y;
    int64_t ldy;
} kvq_args;

static inline float f16_to_f32(uint16_t h) {
#ifdef KVQ_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    bits = exp == 31 ? (sign | 0x7F800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float load_group(const void *p, int f16, int64_t i) {
    return f16 ? f16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* ---- activations: int8 per block of 32, scale and exact sum ------------------------------------- */

static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
#ifdef KVQ_AVX2
        __m256 v[4];
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
            sum = _mm256_add_ps(sum, v[i]);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float am = _mm_cvtss_f32(m4);
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
        s[b] = _mm_cvtss_f32(s4);
        d[b] = am / 127.0f;
        const __m256 id = _mm256_set1_ps(am > 0.0f ? 127.0f / am : 0.0f);
        __m256i i32[4];
        for (int i = 0; i < 4; i++)
            i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* packs works per 128-bit lane: the 32-bit groups come out in order 0 4 1 5 2 6 3 7 */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), p);
#else
        float am = 0.0f, sum = 0.0f;
        for (int j = 0; j < QK; j++) {
            am = fmaxf(am, fabsf(xb[j]));
            sum += xb[j];
        }
        s[b] = sum;
        d[b] = am / 127.0f;
        const float id = am > 0.0f ? 127.0f / am : 0.0f;
        for (int j = 0; j < QK; j++) q[b * QK + j] = (int8_t)nearbyintf(xb[j] * id);
#endif
    }
}

/* ---- eight weight rows against up to TILE_M x rows ----------------------------------------------
 * Weights are interleaved by groups of 8 rows ("x8"), so that one integer dot-product instruction
 * computes 4 products for each of 8 output columns at once and a block's result lands in the 8 lanes
 * of one vector (no horizontal sums; scales load as vectors):
 *   bits 4: [N / 8, K / 32, 4, 8, 4] bytes: chunk c, lane j, byte t holds the code of row 8g + j at
 *           k = 32 b + 4 c + t (low nibble) and k = 32 b + 16 + 4 c + t (high nibble)
 *   bits 8: [N / 8, K / 32, 8, 8, 4] int8: step s, lane j, byte t = row 8g + j at k = 32 b + 4 s + t
 *   scale, mins: [N / 8, K / G, 8]
 * Step s of a block multiplies the 4 activations 32 b + 4 s .. + 3 (broadcast) into every lane. */

#ifdef KVQ_AVX2
static inline __m256 load8(const void *p, int f16, int64_t i) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
               : _mm256_loadu_ps((const float *)p + i);
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#else
#define DPBUSD(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#endif
#endif

static inline __attribute__((always_inline)) void group_tile(const kvq_args *a, const int bits, const int R, int64_t g,
                                                             int64_t m0) {
    const int64_t nb = a->K / QK, per = a->G / QK, ng = a->K / a->G;
#ifdef KVQ_AVX2
    __m256 acc[TILE_M], macc[TILE_M];
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t gi = (g * ng + b / per) * 8;
        const __m256 dw = load8(a->scale, a->scale_f16, gi);
        __m256i w[8];
        if (bits == 4) {
            const uint8_t *c = a->codes + (g * nb + b) * 128;
            const __m256i m = _mm256_set1_epi8(0x0F);
            for (int s = 0; s < 4; s++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 * s));
                w[s] = _mm256_and_si256(v, m);
                w[s + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
            }
        } else {
            const int8_t *c = (const int8_t *)a->codes + (g * nb + b) * 256;
            for (int s = 0; s < 8; s++) w[s] = _mm256_loadu_si256((const __m256i *)(c + 32 * s));
        }
        for (int r = 0; r < R; r++) {
            const int64_t xi = (m0 + r) * nb + b;
            const int8_t *xq = a->qx + (m0 + r) * a->K + b * QK;
            __m256i isum = _mm256_setzero_si256();
            if (bits == 4) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                for (int s = 0; s < 8; s++) isum = _mm256_dpbusd_epi32(isum, w[s], bcast4(xq + 4 * s));
#else
                /* 8 pair sums of at most 2 * 15 * 127 stay inside int16 */
                __m256i s16 = _mm256_maddubs_epi16(w[0], bcast4(xq));
                for (int s = 1; s < 8; s++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[s], bcast4(xq + 4 * s)));
                isum = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
            } else {
                for (int s = 0; s < 8; s++) /* |w| as u8 (-128 -> 128), its sign moved onto x */
                    isum = DPBUSD(isum, _mm256_sign_epi8(w[s], w[s]), _mm256_sign_epi8(bcast4(xq + 4 * s), w[s]));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(a->dx[xi])), acc[r]);
            if (a->mins) macc[r] = _mm256_fmadd_ps(load8(a->mins, a->scale_f16, gi), _mm256_set1_ps(a->sx[xi]), macc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(a->y + (m0 + r) * a->ldy + 8 * g, _mm256_add_ps(acc[r], macc[r]));
#else
    for (int r = 0; r < R; r++) {
        float acc[8] = {0}, macc[8] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const int64_t gi = (g * ng + b / per) * 8, xi = (m0 + r) * nb + b;
            const int8_t *xq = a->qx + (m0 + r) * a->K + b * QK;
            for (int j = 0; j < 8; j++) {
                int32_t isum = 0;
                for (int s = 0; s < 8; s++)
                    for (int t = 0; t < 4; t++) {
                        int32_t q;
                        if (bits == 4) {
                            const uint8_t c = a->codes[(g * nb + b) * 128 + 32 * (s & 3) + 4 * j + t];
                            q = s < 4 ? (c & 15) : (c >> 4);
                        } else {
                            q = ((const int8_t *)a->codes)[(g * nb + b) * 256 + 32 * s + 4 * j + t];
                        }
                        isum += q * xq[4 * s + t];
                    }
                acc[j] += (float)isum * (load_group(a->scale, a->scale_f16, gi + j) * a->dx[xi]);
                if (a->mins) macc[j] += load_group(a->mins, a->scale_f16, gi + j) * a->sx[xi];
            }
        }
        for (int j = 0; j < 8; j++) a->y[(m0 + r) * a->ldy + 8 * g + j] = acc[j] + macc[j];
    }
#endif
}

static void gemm_tile(const kvq_args *a, const int bits, int64_t t) {
    const int64_t g0 = t * TILE_G, g1 = g0 + TILE_G < a->N / 8 ? g0 + TILE_G : a->N / 8;
    for (int64_t m0 = 0; m0 < a->M; m0 += TILE_M) {
        const int64_t R = a->M - m0 < TILE_M ? a->M - m0 : TILE_M;
        for (int64_t g = g0; g < g1; g++) {
            /* constant R and bits: each case is its own unrolled loop with the accumulators in registers */
            if (bits == 4) {
                switch (R) {
                case 4: group_tile(a, 4, 4, g, m0); break;
                case 3: group_tile(a, 4, 3, g, m0); break;
                case 2: group_tile(a, 4, 2, g, m0); break;
                default: group_tile(a, 4, 1, g, m0);
                }
            } else {
                switch (R) {
                case 4: group_tile(a, 8, 4, g, m0); break;
                case 3: group_tile(a, 8, 3, g, m0); break;
                case 2: group_tile(a, 8, 2, g, m0); break;
                default: group_tile(a, 8, 1, g, m0);
                }
            }
        }
    }
}

/* y [M, N] (row stride ldy) = x [M, K] @ W^T. Returns 0, or -1 when out of memory. */
int kvq_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const void *scale,
               const void *mins, int scale_f16, int64_t G, int64_t N, float *y, int64_t ldy, int nthreads) {
    const int64_t nb = K / QK, ntiles = (N / 8 + TILE_G - 1) / TILE_G;
    int8_t *qx = (int8_t *)malloc((size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb)), *sx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    if (!qx || !dx || !sx) {
        free(qx), free(dx), free(sx);
        return -1;
    }
    const kvq_args a = {qx, dx, sx, codes, scale, mins, scale_f16, M, K, N, G, y, ldy};
    /* below ~64k weights a second thread costs more to wake than it saves */
    const int nt = N * K < (1 << 16) ? 1 : nthreads;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, qx + m * K, dx + m * nb, sx + m * nb);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; t++) gemm_tile(&a, bits, t);
    }
    free(qx), free(dx), free(sx);
    return 0;
}

/* The weight itself, w = d q + m, as fp32 or (round to nearest even) bf16 [N, K] in plain row order: the
 * read-back that calls with many rows run through a plain GEMM. Rows n0 .. n0 + rows of the weight. */
void kvq_dequant(const uint8_t *codes, int bits, const void *scale, const void *mins, int scale_f16, int64_t G,
                 int64_t K, int64_t n0, int64_t rows, float *out32, uint16_t *out16, int nthreads) {
    const int64_t nb = K / QK, per = G / QK, ng = K / G;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t i = 0; i < rows; i++) {
        const int64_t n = n0 + i, g = n / 8, j = n % 8;
        float row[QK];
        for (int64_t b = 0; b < nb; b++) {
            const int64_t gi = (g * ng + b / per) * 8 + j;
            const float d = load_group(scale, scale_f16, gi), m = mins ? load_group(mins, scale_f16, gi) : 0.0f;
            for (int s = 0; s < 8; s++)
                for (int t = 0; t < 4; t++) {
                    int32_t q;
                    if (bits == 4) {
                        const uint8_t c = codes[(g * nb + b) * 128 + 32 * (s & 3) + 4 * j + t];
                        q = s < 4 ? (c & 15) : (c >> 4);
                    } else {
                        q = ((const int8_t *)codes)[(g * nb + b) * 256 + 32 * s + 4 * j + t];
                    }
                    row[4 * s + t] = d * (float)q + m;
                }
            if (out32) {
                memcpy(out32 + i * K + b * QK, row, sizeof row);
            } else {
                for (int q = 0; q < QK; q++) {
                    uint32_t u;
                    memcpy(&u, &row[q], 4);
                    out16[i * K + b * QK + q] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
                }
            }
        }
    }
}

/* y = x W^T on the CPU for group-quantized weights, with integer dot products (llama.cpp's Q4 x Q8 idea,
 * with a second int8 level for the activations).
 *
 * Each row of x (fp32) is quantized per block of 32 to two int8 levels with one scale, x ~ dx (q1 + q2 / 256)
 * (quantize_row), and its exact float sum sx. A weight block of 32 codes q with scale d and min m
 * (w = d q + m) then contributes
 *     d (dx / 256) sum(q (256 q1 + q2)) + m sx
 * where the sum is exact integer arithmetic (AVX2 maddubs, or AVX-512-VNNI dpbusd). 4-bit codes with one scale
 * per 32 (Q4_0 / Q4_1) take one level outside outlier blocks where the caller asks (one_level: the rounding and
 * order of kvq_gemm_i8, so both kernels give a row the same bits; one_level_tile). Weight layout
 * (interleaved by 8 rows, see group_tile) is built by pack_x8 in cpu_int8dot.py. Scales and mins per group
 * of G (a multiple of 32) are kvq_groups: the file's own form where it can be read directly (fp16, or
 * K-quants' 8-bit multipliers of an fp16 value per super-block, or AWQ/GPTQ zero points), else fp32.
 * Every (row of y, column of y) is computed by one thread in one fixed order, whatever M and the thread
 * count: a row's result does not depend on the rows it is batched with.
 *
 * Calls with many rows take kvq_gemm_f32 at the end of this file instead (AVX2 builds): an fp32 GEMM over
 * weight panels dequantized on the fly; on AMX-BF16 CPUs kvq_gemm_bf16, the same in bf16 on AMX tiles.
 *
 * Built at first use by kvcli_kernels/cpu_build.py (cc -O3 -fopenmp, flags of the ISA in use). The
 * OpenMP runtime is the one torch already loaded (same soname, libgomp.so.1), so torch.set_num_threads and
 * this kernel share one thread pool.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include "cpu_scratch.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVQ_AVX2 1
#endif

#define QK 32
#define TILE_G 4  /* groups of 8 weight rows per work item: their codes stay in L1 while the x rows pass */
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 16 /* how far ahead of its block the loop asks for the weight codes (prefetch_lines) */
#endif
#define TILE_M 4  /* x rows per pass over a weight row: its blocks are unpacked once for all of them */
/* How far ahead of its block the small-row loop (2-8 rows, one_level_rec16) also asks for the weight codes into L2
 * (prefetch_far). With 2+ rows a block's arithmetic is a few times a 1-row step's, and the line asks
 * PREFETCH_BLOCKS ahead alone left a core short of lines in flight: on the 1B shape's 64 linears (2-core Xeon with
 * AMX, 2026-12-08, interleaved runs of the same process, ad hoc) 6 rows took 1.35-1.40x the time of 1 row without
 * them, 1.16-1.24x with them 12-32 KiB ahead (6 KiB: no change); the 1-row loop gained nothing from them. */
#ifndef FAR_PREFETCH_BYTES
#define FAR_PREFETCH_BYTES (16 * 1024)
#endif
/* One activation level (see "one level" below): a block keeps its second level past this many times its row's
 * RMS; sums are gathered per ONE_LEVEL_KC k and added to the output once per such chunk (kvq_gemm_i8's panels). */
#ifndef IG_OUTLIER
#define IG_OUTLIER 4.0f
#endif
#define ONE_LEVEL_KC 2048

/* A many-row GEMM where this build has none (kvq_gemm_f32 / _bf16 / _i8): returns -2, the caller takes another. */
#define KVQ_GEMM_ABSENT(name)                                                                                        \
    int name(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, int offset, int scale_kind,       \
             const void *scale, const uint16_t *scale_sup, int64_t scale_per, int min_kind, const void *mins,        \
             const uint16_t *min_sup, int64_t min_per, int64_t G, int64_t N, float *y, int64_t ldy, int nthreads) { \
        (void)x, (void)M, (void)K, (void)codes, (void)bits, (void)offset, (void)scale_kind, (void)scale;            \
        (void)scale_sup, (void)scale_per, (void)min_kind, (void)mins, (void)min_sup, (void)min_per, (void)G;        \
        (void)N, (void)y, (void)ldy, (void)nthreads;                                                                \
        return -2;                                                                                                  \
    }

/* Per-group values (scales or mins), in the x8 order [N / 8, K / G, 8]:
 *   KVQ_F16 / KVQ_F32  the value itself
 *   KVQ_SUB            v (uint8) * sup (fp16, one per `per_super` groups: [N / 8, K / (G per_super), 8]),
 *                      the K-quants' two levels (d * sc); KVQ_NEG_SUB the same negated (mins: -(dmin * m))
 *   KVQ_SUB_I8         as KVQ_SUB with int8 multipliers (Q6_K's signed sub-scales)
 *   KVQ_ZERO           -(v (uint8 zero point) * scale), for mins only (AWQ / GPTQ / compressed-tensors)
 * Each product is exact in fp32 (11 x 8 bits), as QuantTensor.group_scales / group_mins compute it. */
enum { KVQ_NONE = 0, KVQ_F16 = 1, KVQ_F32 = 2, KVQ_SUB = 3, KVQ_NEG_SUB = 4, KVQ_ZERO = 5, KVQ_SUB_I8 = 6 };

typedef struct {
    int kind;
    const void *v;
    const uint16_t *sup;
    int64_t per_super;
    int shift; /* log2(per_super) where a power of two, else -1: an integer division per block was ~40 % of
                * a Q4_K matmul's time (perf, 2026-12-01) */
} kvq_groups;

static kvq_groups groups_of(int kind, const void *v, const uint16_t *sup, int64_t per_super) {
    int shift = -1;
    for (int i = 0; i < 31; i++)
        if (per_super == (int64_t)1 << i) shift = i;
    const kvq_groups q = {kind, v, sup, per_super, shift};
    return q;
}

/* The super-block of group gr (or the number of super-blocks in ng groups). */
static inline int64_t super_of(const kvq_groups *q, int64_t gr) { return q->shift >= 0 ? gr >> q->shift : gr / q->per_super; }

typedef struct {
    const int8_t *qx;  /* [M, K / 32, 2, 32]: two levels per block (quantize_row) */
    const float *dx;   /* [M, K / 32] */
    const float *sx;   /* [M, K / 32] */
    const int32_t *xs; /* [M, K / 16]: 256 sum(q1) + sum(q2) per half block, where offset != 0 (else NULL) */
    const uint8_t *codes;
    kvq_groups scale, mins;
    int64_t M, K, N, G;
    float *y;
    int64_t ldy;
    int offset; /* unsigned codes (bits 4, 5, 6): the code offset the kernel takes off, w = d (q - offset) + m */
    const float *dxs;   /* AMX: [M, K / 32] dx / 256 */
    int one_level;       /* activations at one level outside outlier blocks (4-bit codes, one scale per 32) */
    const uint8_t *flag; /* one level: [M, K / 32] the block keeps its second level */
    const int32_t *lv;   /* one level: [M, K / 32, 2] offset x sum(q1), offset x sum(q2) */
    const struct one_rec *rec; /* one level, 2+ rows on AVX-512: the same per block, rows side by side (one_rec) */
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

/* Group value of row n (lane j of its group of 8) at group index gr; `scale` for KVQ_ZERO. */
static inline float group_value(const kvq_groups *q, const kvq_groups *scale, int64_t n, int64_t gr, int64_t ng) {
    const int64_t i = ((n / 8) * ng + gr) * 8 + n % 8;
    switch (q->kind) {
    case KVQ_F16: return f16_to_f32(((const uint16_t *)q->v)[i]);
    case KVQ_F32: return ((const float *)q->v)[i];
    case KVQ_SUB:
    case KVQ_NEG_SUB:
    case KVQ_SUB_I8: {
        const int64_t ns = super_of(q, ng);
        const float m = q->kind == KVQ_SUB_I8 ? (float)((const int8_t *)q->v)[i] : (float)((const uint8_t *)q->v)[i];
        const float v = f16_to_f32(q->sup[((n / 8) * ns + super_of(q, gr)) * 8 + n % 8]) * m;
        return q->kind == KVQ_NEG_SUB ? -v : v;
    }
    case KVQ_ZERO: return -((float)((const uint8_t *)q->v)[i] * group_value(scale, scale, n, gr, ng));
    default: return 0.0f;
    }
}

/* ---- activations: two int8 levels per block of 32, scale and exact sum -------------------------
 * x ~ d (q1 + q2 / 256): q1 = round(x / d) with d = max|x| / 127, then the remainder (at most d / 2)
 * again in steps of d / 256. One int8 level alone (llama.cpp's Q8) loses too much on models with
 * outlier channels (SmolLM2: top-1 agreement with the fp32 reference 0.93 instead of 0.97); with the
 * second the activations carry ~15 bits, finer than bf16's 8, for one more integer pass over the codes
 * already in registers. Stored per block: q1[32], q2[32].
 *
 * One level (outlier > 0; see "one level" below): the second level is kept only in blocks whose max|x|
 * exceeds `outlier` x the row's RMS (flag[b] = 1), zeroed elsewhere; s then holds the rounded x's sum
 * d (sum(q1) + sum(q2) / 256) (mins multiply it, as the codes do) and lv[2 b], lv[2 b + 1] offset x sum(q1),
 * offset x sum(q2). Both kernels that round so (kvq_linear's one-level loop, kvq_gemm_i8) call this. */

static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s, int32_t *xs, float outlier,
                         int offset, uint8_t *flag, int32_t *lv) {
    float limit = 0.0f;
    if (outlier > 0.0f) { /* the row's sum of squares in 8 double partial sums (element k in k % 8; K is a
                           * multiple of 32), added in one fixed tree: every build the same bits (a float's
                           * square is exact in double) */
        double part[8] = {0};
#ifdef KVQ_AVX2
        __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
        for (int64_t k = 0; k < K; k += 8) {
            const __m256 v = _mm256_loadu_ps(x + k);
            const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
            const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
            lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a)), hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
        }
        _mm256_storeu_pd(part, lo), _mm256_storeu_pd(part + 4, hi);
#else
        for (int64_t k = 0; k < K; k += 8)
            for (int j = 0; j < 8; j++) part[j] += (double)x[k + j] * x[k + j];
#endif
        const double ss = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
        limit = outlier * (float)sqrt(ss / (double)K);
    }
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        int8_t *qb = q + 2 * b * QK;
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
        const __m256 id = _mm256_set1_ps(am > 0.0f ? 127.0f / am : 0.0f), k256 = _mm256_set1_ps(256.0f);
        const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m256i i1[4], i2[4];
        for (int i = 0; i < 4; i++) {
            const __m256 t = _mm256_mul_ps(v[i], id), r1 = _mm256_round_ps(t, rnd);
            i1[i] = _mm256_cvtps_epi32(r1);
            i2[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(t, r1), k256), rnd));
        }
        /* packs saturates (a remainder of d / 2 gives 128 -> 127) and works per 128-bit lane: the 32-bit
         * groups come out in order 0 4 1 5 2 6 3 7. q2 is clamped to -127 too: int8 weights move their sign
         * onto x (sign_epi8), and -(-128) is -128 in int8. */
        const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        __m256i p1 = _mm256_packs_epi16(_mm256_packs_epi32(i1[0], i1[1]), _mm256_packs_epi32(i1[2], i1[3]));
        __m256i p2 = _mm256_packs_epi16(_mm256_packs_epi32(i2[0], i2[1]), _mm256_packs_epi32(i2[2], i2[3]));
        p2 = _mm256_max_epi8(p2, _mm256_set1_epi8(-127));
        _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(p1, perm));
        _mm256_storeu_si256((__m256i *)(qb + QK), _mm256_permutevar8x32_epi32(p2, perm));
#else
        float am = 0.0f, sum = 0.0f;
        for (int j = 0; j < QK; j++) {
            am = fmaxf(am, fabsf(xb[j]));
            sum += xb[j];
        }
        s[b] = sum;
        d[b] = am / 127.0f;
        const float id = am > 0.0f ? 127.0f / am : 0.0f;
        for (int j = 0; j < QK; j++) {
            const float t = xb[j] * id, r1 = nearbyintf(t), r2 = nearbyintf((t - r1) * 256.0f);
            qb[j] = (int8_t)r1;
            qb[QK + j] = (int8_t)(r2 > 127.0f ? 127.0f : r2 < -127.0f ? -127.0f : r2);
        }
#endif
        if (outlier > 0.0f) {
            flag[b] = d[b] * 127.0f > limit;
            if (!flag[b]) memset(qb + QK, 0, QK);
            int32_t s1 = 0, s2 = 0;
            for (int j = 0; j < QK; j++) s1 += qb[j], s2 += qb[QK + j];
            lv[2 * b] = offset * s1, lv[2 * b + 1] = offset * s2;
            /* mins multiply the rounded x's sum, as the codes do: the codes' mean (7.5 for 4 bits) times the
             * block's rounding errors cancels against it (against the exact sum, Q4_1 lost 1-2 % of |y|) */
            s[b] = d[b] * ((float)s1 + (float)s2 * (1.0f / 256.0f));
        }
        if (xs)
            for (int h = 0; h < 2; h++) {
                int32_t s1 = 0, s2 = 0;
                for (int j = 16 * h; j < 16 * h + 16; j++) s1 += qb[j], s2 += qb[QK + j];
                xs[2 * b + h] = 256 * s1 + s2;
            }
    }
}

/* ---- eight weight rows against up to TILE_M x rows ----------------------------------------------
 * Weights are interleaved by groups of 8 rows ("x8"), so that one integer dot-product instruction
 * computes 4 products for each of 8 output columns at once and a block's result lands in the 8 lanes
 * of one vector (no horizontal sums; scales load as vectors):
 *   bits 4: [N / 8, K / 32, 4, 8, 4] bytes: chunk c, lane j, byte t holds the code of row 8g + j at
 *           k = 32 b + 4 c + t (low nibble) and k = 32 b + 16 + 4 c + t (high nibble)
 *   bits 8: [N / 8, K / 32, 8, 8, 4] int8: step s, lane j, byte t = row 8g + j at k = 32 b + 4 s + t
 *   bits 5, 6 (Q5_0/Q5_1/Q5_K, Q6_K): per block the 4-bit layout's 128 bytes, then the high bits, the
 *           file's own 5 or 6 bits per weight in all: bits 5, 32 bytes: bit s of byte p holds bit 4 of
 *           the code step s's vector has at byte p (lane j = p / 4, t = p % 4); bits 6, 64 bytes: bits
 *           2 (s % 4) .. + 1 of byte 32 (s / 4) + p hold its bits 4 and 5 (three operations a step to
 *           unpack, where two planes of single bits took six)
 * Codes of bits 5 and 6 (and 4-bit ones with an offset, Q4_0's 8) are unsigned: they go into the dot product as they are,
 * without the sign moves int8 codes need, and `offset` times the activations' integer sum (xs) comes off
 * after. Both sums are exact integers, so the result is the signed form's bit for bit.
 *   scale, mins: [N / 8, K / G, 8]
 * Step s of a block multiplies the 4 activations 32 b + 4 s .. + 3 (broadcast) into every lane. */

#ifdef KVQ_AVX2
static inline __m256 load_f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline __m256 load_u8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 load_i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The 8 lanes of group gr of row group g (group_value's vector form); `scale_v` = the scales, for KVQ_ZERO. */
static inline __attribute__((always_inline)) __m256 groups8(const kvq_groups *q, __m256 scale_v, int64_t g, int64_t gr,
                                                            int64_t ng) {
    const int64_t i = (g * ng + gr) * 8;
    switch (q->kind) {
    case KVQ_F16: return load_f16x8((const uint16_t *)q->v + i);
    case KVQ_F32: return _mm256_loadu_ps((const float *)q->v + i);
    case KVQ_SUB:
    case KVQ_NEG_SUB:
    case KVQ_SUB_I8: {
        const int64_t ns = super_of(q, ng);
        const __m256 m = q->kind == KVQ_SUB_I8 ? load_i8x8((const int8_t *)q->v + i) : load_u8x8((const uint8_t *)q->v + i);
        const __m256 v = _mm256_mul_ps(load_f16x8(q->sup + (g * ns + super_of(q, gr)) * 8), m);
        return q->kind == KVQ_NEG_SUB ? _mm256_sub_ps(_mm256_setzero_ps(), v) : v;
    }
    case KVQ_ZERO: return _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(load_u8x8((const uint8_t *)q->v + i), scale_v));
    default: return _mm256_setzero_ps();
    }
}

/* OR the high bits (bits 5 / 6, see above) into the nibbles of step s. 16-bit shifts: the bits kept
 * (4, or 4 and 5) come from the same byte. */
static inline __attribute__((always_inline)) __m256i high_bits(__m256i v, const uint8_t *high, const int bits,
                                                               const int s) {
    if (bits == 5) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)high);
        const __m256i b = s < 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - s)) : _mm256_srl_epi16(h, _mm_cvtsi32_si128(s - 4));
        return _mm256_or_si256(v, _mm256_and_si256(b, _mm256_set1_epi8(0x10)));
    }
    const __m256i h = _mm256_loadu_si256((const __m256i *)(high + 32 * (s / 4)));
    const int sh = 2 * (s % 4);
    const __m256i b = sh < 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - sh)) : _mm256_srl_epi16(h, _mm_cvtsi32_si128(sh - 4));
    return _mm256_or_si256(v, _mm256_and_si256(b, _mm256_set1_epi8(0x30)));
}

/* Every cache line of the `bytes` at p towards L1. The weight stream of a decode step (one row of x) runs at
 * the pace of the misses in flight: the hardware prefetcher alone kept 2 cores at ~19 GB/s on a 1B shape,
 * asking for each line PREFETCH_BLOCKS blocks ahead lifted decode from 21.7 to 30 tok/s (2-core Xeon, 2026-12-05,
 * an interleaved A/B in the engine; one line of two per block: 25; the lines asked in a loop: no gain). */
static inline __attribute__((always_inline)) void prefetch_lines(const void *p, const int bytes) {
    const char *c = (const char *)p;
    _mm_prefetch(c, _MM_HINT_T0);
    _mm_prefetch(c + 64, _MM_HINT_T0); /* (bytes is 128 to 256: a block of 8 rows) */
    if (bytes > 128) _mm_prefetch(c + 128, _MM_HINT_T0);
    if (bytes > 192) _mm_prefetch(c + 192, _MM_HINT_T0);
}

/* The `bytes` FAR_PREFETCH_BYTES past p towards L2 (prefetch_lines' sizes). */
static inline __attribute__((always_inline)) void prefetch_far(const void *p, const int bytes) {
    const char *c = (const char *)p + FAR_PREFETCH_BYTES;
    _mm_prefetch(c, _MM_HINT_T1);
    _mm_prefetch(c + 64, _MM_HINT_T1);
    if (bytes > 128) _mm_prefetch(c + 128, _MM_HINT_T1);
    if (bytes > 192) _mm_prefetch(c + 192, _MM_HINT_T1);
}

/* A block's 128 bytes of 4-bit codes (x8 layout) as 8 step vectors of unsigned bytes: chunk s's low nibbles are
 * step s, its high nibbles step s + 4. */
static inline __attribute__((always_inline)) void unpack_nibbles(const uint8_t *c, __m256i w[8]) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    for (int s = 0; s < 4; s++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 * s));
        w[s] = _mm256_and_si256(v, m);
        w[s + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    }
}

static inline int32_t load32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline __m256i bcast4(const int8_t *p) { return _mm256_set1_epi32(load32(p)); }

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#else
#define DPBUSD(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#endif
#endif

/* Group index of step s (k = 32 b + 4 s ..) of block b: groups of 16 (Q6_K; int8 codes, no mins) split a
 * block in two, steps 0-3 and 4-7. */
static inline int64_t group_of(int64_t b, int s, int64_t G) { return (b * QK + 4 * s) / G; }

/* Bytes of one block of 8 rows x 32 codes. */
static inline int64_t block_bytes(int bits) { return bits == 4 ? 128 : bits == 5 ? 160 : bits == 6 ? 192 : 256; }

/* The stored code at step s, byte p (lane p / 4, t = p % 4) of block `blk` (= g * nb + b); unsigned for
 * bits 4-7 (before the offset), signed for bits 8. */
static inline int32_t code_at(const uint8_t *codes, int bits, int64_t blk, int s, int p) {
    const uint8_t *c = codes + blk * block_bytes(bits);
    if (bits == 8) return ((const int8_t *)c)[32 * s + p];
    const int32_t nib = s < 4 ? (c[32 * s + p] & 15) : (c[32 * (s - 4) + p] >> 4);
    if (bits == 4) return nib;
    const int32_t hi = bits == 5 ? ((c[128 + p] >> s) & 1) : ((c[128 + 32 * (s / 4) + p] >> (2 * (s % 4))) & 3);
    return nib | hi << 4;
}

/* ksub 1: Q4_K / Q5_K groups (KVQ_SUB scales, KVQ_NEG_SUB mins, super-blocks of a power of two groups of
 * 32) read inline, without groups8's dispatch and division; mw then holds +dmin m and is subtracted
 * (fnmadd: the same single rounding of macc - v sx as groups8's negated value in an fmadd). ksub 2: Q6_K's
 * (KVQ_SUB_I8 scales of groups of 16, no mins). */
#ifdef KVQ_AVX2
/* Block b of group g's scales: dw (its first group of 16 where g16), dw2 (the second, else dw), mw its mins. */
static inline __attribute__((always_inline)) void group_scales(const kvq_args *a, const int g16, const int ksub,
                                                               int64_t g, int64_t b, __m256 *dw_, __m256 *dw2_,
                                                               __m256 *mw_) {
    const int64_t ng = a->K / a->G;
    const int64_t gr = g16 ? 2 * b : ksub ? b : group_of(b, 0, a->G);
    __m256 dw, dw2, mw = _mm256_setzero_ps();
    if (ksub == 2) {
        const int sh = a->scale.shift;
        dw = _mm256_mul_ps(load_f16x8(a->scale.sup + (g * (ng >> sh) + (gr >> sh)) * 8),
                           load_i8x8((const int8_t *)a->scale.v + (g * ng + gr) * 8));
        dw2 = _mm256_mul_ps(load_f16x8(a->scale.sup + (g * (ng >> sh) + ((gr + 1) >> sh)) * 8),
                            load_i8x8((const int8_t *)a->scale.v + (g * ng + gr + 1) * 8));
    } else if (ksub) {
        const int sh = a->scale.shift, mh = a->mins.shift;
        dw = _mm256_mul_ps(load_f16x8(a->scale.sup + (g * (ng >> sh) + (gr >> sh)) * 8),
                           load_u8x8((const uint8_t *)a->scale.v + (g * ng + gr) * 8));
        mw = _mm256_mul_ps(load_f16x8(a->mins.sup + (g * (ng >> mh) + (gr >> mh)) * 8),
                           load_u8x8((const uint8_t *)a->mins.v + (g * ng + gr) * 8));
        dw2 = dw;
    } else {
        dw = groups8(&a->scale, _mm256_setzero_ps(), g, gr, ng);
        mw = a->mins.kind ? groups8(&a->mins, dw, g, gr, ng) : _mm256_setzero_ps();
        dw2 = g16 ? groups8(&a->scale, _mm256_setzero_ps(), g, gr + 1, ng) : dw;
    }
    *dw_ = dw, *dw2_ = dw2, *mw_ = mw;
}

/* Block b of group g's codes as 8 step vectors (4-8 bits), their lines asked for ahead (far: into L2 as well). */
static inline __attribute__((always_inline)) void group_codes(const kvq_args *a, const int bits, const int far,
                                                              int64_t g, int64_t b, __m256i w[8]) {
    const int64_t nb = a->K / QK;
    if (bits == 4 || bits == 5 || bits == 6) {
        const uint8_t *c = a->codes + (g * nb + b) * block_bytes(bits);
        prefetch_lines(c + PREFETCH_BLOCKS * block_bytes(bits), block_bytes(bits));
        if (far) prefetch_far(c, block_bytes(bits));
        unpack_nibbles(c, w);
        if (bits != 4)
            for (int s = 0; s < 8; s++) w[s] = high_bits(w[s], c + 128, bits, s);
    } else { /* bits 8 and 7 */
        const int8_t *c = (const int8_t *)a->codes + (g * nb + b) * 256;
        prefetch_lines(c + PREFETCH_BLOCKS * 256, 256);
        if (far) prefetch_far(c, 256);
        for (int s = 0; s < 8; s++) w[s] = _mm256_loadu_si256((const __m256i *)(c + 32 * s));
    }
}

/* Block b of group g (8 weight rows) against rows m0 .. m0 + R - 1 of x: acc / macc (the mins' share) += its sums. */
static inline __attribute__((always_inline)) void group_block(const kvq_args *a, const int bits, const int g16,
                                                              const int ksub, const int R, int64_t g, int64_t m0,
                                                              int64_t b, __m256 *acc, __m256 *macc) {
    const int64_t nb = a->K / QK;
    __m256 dw, dw2, mw;
    group_scales(a, g16, ksub, g, b, &dw, &dw2, &mw);
    __m256i w[8];
    group_codes(a, bits, R > 1, g, b, w);
    for (int r = 0; r < R; r++) {
        const int64_t xi = (m0 + r) * nb + b;
        const int8_t *xq = a->qx + (m0 + r) * 2 * a->K + 2 * b * QK;
        __m256i i1 = _mm256_setzero_si256(), i2 = _mm256_setzero_si256();
        int32_t off = 0; /* unsigned codes: the offset's share, offset (256 sum(q1) + sum(q2)) */
        if (bits == 4) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            /* two chains per level: dpbusd's latency (4-5 cycles) would otherwise bound a single row */
            __m256i i1b = _mm256_setzero_si256(), i2b = _mm256_setzero_si256();
            for (int s = 0; s < 8; s += 2) {
                i1 = _mm256_dpbusd_epi32(i1, w[s], bcast4(xq + 4 * s));
                i2 = _mm256_dpbusd_epi32(i2, w[s], bcast4(xq + QK + 4 * s));
                i1b = _mm256_dpbusd_epi32(i1b, w[s + 1], bcast4(xq + 4 * s + 4));
                i2b = _mm256_dpbusd_epi32(i2b, w[s + 1], bcast4(xq + QK + 4 * s + 4));
            }
            i1 = _mm256_add_epi32(i1, i1b);
            i2 = _mm256_add_epi32(i2, i2b);
#else
            /* 8 pair sums of at most 2 * 15 * 127 stay inside int16 */
            __m256i s1 = _mm256_maddubs_epi16(w[0], bcast4(xq)), s2 = _mm256_maddubs_epi16(w[0], bcast4(xq + QK));
            for (int s = 1; s < 8; s++) {
                s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[s], bcast4(xq + 4 * s)));
                s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(w[s], bcast4(xq + QK + 4 * s)));
            }
            i1 = _mm256_madd_epi16(s1, _mm256_set1_epi16(1));
            i2 = _mm256_madd_epi16(s2, _mm256_set1_epi16(1));
#endif
            if (a->xs) { /* Q4_0: codes 0..15 less 8, taken off as offset x the block's integer sum */
                const int32_t *xs = a->xs + ((m0 + r) * nb + b) * 2;
                off = a->offset * (xs[0] + xs[1]);
            }
        } else if (bits != 8) { /* 5, 6 */
            /* per half block (a Q6_K group of 16 ends after step 3) */
            const int32_t *xs = a->xs ? a->xs + ((m0 + r) * nb + b) * 2 : NULL;
            for (int h = 0; h < 2; h++) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                /* two chains per level */
                __m256i a1 = _mm256_setzero_si256(), a2 = a1, b1 = a1, b2 = a1;
                for (int s = 4 * h; s < 4 * h + 4; s += 2) {
                    a1 = _mm256_dpbusd_epi32(a1, w[s], bcast4(xq + 4 * s));
                    a2 = _mm256_dpbusd_epi32(a2, w[s], bcast4(xq + QK + 4 * s));
                    b1 = _mm256_dpbusd_epi32(b1, w[s + 1], bcast4(xq + 4 * s + 4));
                    b2 = _mm256_dpbusd_epi32(b2, w[s + 1], bcast4(xq + QK + 4 * s + 4));
                }
                i1 = _mm256_add_epi32(i1, _mm256_add_epi32(a1, b1));
                i2 = _mm256_add_epi32(i2, _mm256_add_epi32(a2, b2));
#else
                /* maddubs pairs stay inside int16 summed over 4 steps for 5-bit codes (4 * 2 * 31 * 127),
                 * over 2 for 6-bit ones (2 * 2 * 63 * 127): then one madd into int32 */
                const __m256i ones = _mm256_set1_epi16(1);
                for (int s0 = 4 * h; s0 < 4 * h + 4; s0 += (bits == 5 ? 4 : 2)) {
                    __m256i s1 = _mm256_maddubs_epi16(w[s0], bcast4(xq + 4 * s0));
                    __m256i s2 = _mm256_maddubs_epi16(w[s0], bcast4(xq + QK + 4 * s0));
                    for (int s = s0 + 1; s < s0 + (bits == 5 ? 4 : 2); s++) {
                        s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[s], bcast4(xq + 4 * s)));
                        s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(w[s], bcast4(xq + QK + 4 * s)));
                    }
                    i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(s1, ones));
                    i2 = _mm256_add_epi32(i2, _mm256_madd_epi16(s2, ones));
                }
#endif
                if (g16 && h == 0) { /* the first group of 16 is complete */
                    const __m256i isum = _mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(i1, 8), i2),
                                                          _mm256_set1_epi32(xs ? a->offset * xs[0] : 0));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(a->dx[xi] / 256.0f)), acc[r]);
                    i1 = i2 = _mm256_setzero_si256();
                }
            }
            if (xs) off = a->offset * (g16 ? xs[1] : xs[0] + xs[1]);
        } else {
            for (int s = 0; s < 8; s++) { /* |w| as u8 (-128 -> 128), its sign moved onto x */
                if (g16 && s == 4) { /* the first group of 16 is complete */
                    const __m256i isum = _mm256_add_epi32(_mm256_slli_epi32(i1, 8), i2);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(a->dx[xi] / 256.0f)), acc[r]);
                    i1 = i2 = _mm256_setzero_si256();
                }
                const __m256i u = _mm256_sign_epi8(w[s], w[s]);
                i1 = DPBUSD(i1, u, _mm256_sign_epi8(bcast4(xq + 4 * s), w[s]));
                i2 = DPBUSD(i2, u, _mm256_sign_epi8(bcast4(xq + QK + 4 * s), w[s]));
            }
        }
        /* 256 q1 + q2 in int32: at most 256 * 32 * 128 * 127 + 32 * 128 * 127 < 2^31 */
        __m256i isum = _mm256_add_epi32(_mm256_slli_epi32(i1, 8), i2);
        if (bits != 8) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(off));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw2, _mm256_set1_ps(a->dx[xi] / 256.0f)), acc[r]);
        if (ksub == 1)
            macc[r] = _mm256_fnmadd_ps(mw, _mm256_set1_ps(a->sx[xi]), macc[r]);
        else if (a->mins.kind)
            macc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->sx[xi]), macc[r]);
    }
}
#endif

static inline __attribute__((always_inline)) void group_tile(const kvq_args *a, const int bits, const int g16,
                                                             const int ksub, const int R, int64_t g, int64_t m0) {
    const int64_t nb = a->K / QK, ng = a->K / a->G;
#ifdef KVQ_AVX2
    (void)ng;
    __m256 acc[TILE_M], macc[TILE_M];
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) group_block(a, bits, g16, ksub, R, g, m0, b, acc, macc);
    for (int r = 0; r < R; r++) _mm256_storeu_ps(a->y + (m0 + r) * a->ldy + 8 * g, _mm256_add_ps(acc[r], macc[r]));
#else
    (void)ksub;
    for (int r = 0; r < R; r++) {
        float acc[8] = {0}, macc[8] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const int64_t xi = (m0 + r) * nb + b;
            const int8_t *xq = a->qx + (m0 + r) * 2 * a->K + 2 * b * QK;
            const int64_t gr = g16 ? 2 * b : group_of(b, 0, a->G);
            for (int j = 0; j < 8; j++) {
                int32_t isum[2] = {0, 0}; /* groups of 16: one sum per half block */
                for (int s = 0; s < 8; s++)
                    for (int t = 0; t < 4; t++) {
                        int32_t q;
                        if (bits != 8) {
                            q = code_at(a->codes, bits, g * nb + b, s, 4 * j + t) - a->offset;
                        } else {
                            q = ((const int8_t *)a->codes)[(g * nb + b) * 256 + 32 * s + 4 * j + t];
                        }
                        isum[g16 && s >= 4] += q * (256 * xq[4 * s + t] + xq[QK + 4 * s + t]);
                    }
                const int64_t n = 8 * g + j;
                acc[j] += (float)isum[0] * (group_value(&a->scale, &a->scale, n, gr, ng) * (a->dx[xi] / 256.0f));
                if (g16) acc[j] += (float)isum[1] * (group_value(&a->scale, &a->scale, n, gr + 1, ng) * (a->dx[xi] / 256.0f));
                if (a->mins.kind) macc[j] += group_value(&a->mins, &a->scale, n, gr, ng) * a->sx[xi];
            }
        }
        for (int j = 0; j < 8; j++) a->y[(m0 + r) * a->ldy + 8 * g + j] = acc[j] + macc[j];
    }
#endif
}

/* ---- one level: 4-bit codes with one scale (and min) per 32, few rows ---------------------------------
 * The activations rounded as kvq_gemm_i8 rounds them (one int8 level per block, the second only in outlier
 * blocks: quantize_row with IG_OUTLIER), and summed in its order, so that a row's result is the same bit for
 * bit whichever of the two kernels a call of its row count takes: per ONE_LEVEL_KC chunk of k, level 1's
 * block sums f += (sum(q1 w) - offset sum(q1)) d_w d_x, the min's f += m_w sx, level 2's (flagged blocks)
 * f2 += (sum(q2 w) - offset sum(q2)) d_w (d_x / 256); then y = f + f2 for the first chunk, y + (f + f2) after.
 * Half the dot products of the two-level loop (group_tile) in blocks without an outlier. */
#ifdef KVQ_AVX2
/* Block b of group g against rows m0 .. m0 + R - 1: f / f2 (the outlier blocks' second level) += their sums. */
static inline __attribute__((always_inline)) void one_level_block8(const kvq_args *a, const int R, int64_t g, int64_t m0,
                                                                   int64_t b, __m256 *f, __m256 *f2) {
    const int64_t nb = a->K / QK;
    const int mins = a->mins.kind != KVQ_NONE;
    const __m256 dw = groups8(&a->scale, _mm256_setzero_ps(), g, b, nb);
    const __m256 mw = mins ? groups8(&a->mins, dw, g, b, nb) : _mm256_setzero_ps();
    const uint8_t *c = a->codes + (g * nb + b) * 128;
    prefetch_lines(c + PREFETCH_BLOCKS * 128, 128);
    if (R > 1) prefetch_far(c, 128);
    __m256i w[8];
    unpack_nibbles(c, w);
    for (int r = 0; r < R; r++) {
        const int64_t xi = (m0 + r) * nb + b;
        const int8_t *xq = a->qx + (m0 + r) * 2 * a->K + 2 * b * QK;
        for (int lev = 0; lev < 2; lev++) {
            if (lev == 1 && !a->flag[xi]) break;
            const int8_t *xl = xq + lev * QK;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            /* two chains: dpbusd's latency (4-5 cycles) would otherwise bound a single row */
            __m256i i1 = _mm256_setzero_si256(), i1b = _mm256_setzero_si256();
            for (int st = 0; st < 8; st += 2) {
                i1 = _mm256_dpbusd_epi32(i1, w[st], bcast4(xl + 4 * st));
                i1b = _mm256_dpbusd_epi32(i1b, w[st + 1], bcast4(xl + 4 * st + 4));
            }
            const __m256i isum = _mm256_add_epi32(i1, i1b);
#else
            /* 8 pair sums of at most 2 * 15 * 127 stay inside int16 */
            __m256i p = _mm256_maddubs_epi16(w[0], bcast4(xl));
            for (int st = 1; st < 8; st++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[st], bcast4(xl + 4 * st)));
            const __m256i isum = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
            const __m256 sum = _mm256_cvtepi32_ps(_mm256_sub_epi32(isum, _mm256_set1_epi32(a->lv[2 * xi + lev])));
            if (lev == 0) {
                f[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(dw, _mm256_set1_ps(a->dx[xi])), f[r]);
                if (mins) f[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->sx[xi]), f[r]);
            } else {
                f2[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(dw, _mm256_set1_ps(a->dx[xi] * (1.0f / 256.0f))), f2[r]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void one_level_tile(const kvq_args *a, const int R, int64_t g, int64_t m0) {
    const int64_t nb = a->K / QK;
    __m256 y[TILE_M];
    for (int64_t b0 = 0; b0 < nb; b0 += ONE_LEVEL_KC / QK) {
        const int64_t b1 = b0 + ONE_LEVEL_KC / QK < nb ? b0 + ONE_LEVEL_KC / QK : nb;
        __m256 f[TILE_M], f2[TILE_M];
        for (int r = 0; r < R; r++) f[r] = f2[r] = _mm256_setzero_ps();
        for (int64_t b = b0; b < b1; b++) one_level_block8(a, R, g, m0, b, f, f2);
        for (int r = 0; r < R; r++) {
            const __m256 t = _mm256_add_ps(f[r], f2[r]);
            y[r] = b0 == 0 ? t : _mm256_add_ps(y[r], t);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(a->y + (m0 + r) * a->ldy + 8 * g, y[r]);
}

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)) /* (no ONE_LEVEL_512 below) */
/* One row (a decode step) against groups g and h far apart, block by block: one_level_two16's two weight streams
 * for builds without the 16-column loop (AVX2). Each column's sums are one_level_tile's, in the same order. */
static __attribute__((noinline)) void one_level_two8(const kvq_args *a, int64_t g, int64_t h) {
    const int64_t nb = a->K / QK;
    __m256 y[2];
    for (int64_t b0 = 0; b0 < nb; b0 += ONE_LEVEL_KC / QK) {
        const int64_t b1 = b0 + ONE_LEVEL_KC / QK < nb ? b0 + ONE_LEVEL_KC / QK : nb;
        __m256 f[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, f2[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = b0; b < b1; b++) {
            one_level_block8(a, 1, g, 0, b, f, f2);
            one_level_block8(a, 1, h, 0, b, f + 1, f2 + 1);
        }
        for (int i = 0; i < 2; i++) {
            const __m256 t = _mm256_add_ps(f[i], f2[i]);
            y[i] = b0 == 0 ? t : _mm256_add_ps(y[i], t);
        }
    }
    _mm256_storeu_ps(a->y + 8 * g, y[0]);
    _mm256_storeu_ps(a->y + 8 * h, y[1]);
}
#endif
#endif

#if defined(KVQ_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
/* The same on 16 columns (groups g and g + 1, the low and high halves of each vector) and up to ONE_LEVEL_M rows:
 * a block's codes unpacked once for twice the columns and every row of a verification step, each row's sums the
 * 8-column loop's lane for lane (the same operations per lane, in the same order). A 6-row call through the
 * 8-column loop unpacked each block twice (4 + 2 rows) at half the width, 1.4-1.9x kvq_gemm_i8's time on
 * SmolLM2's linears, where it repacks panels per call (2-core Xeon, 2026-12-07). */
#define ONE_LEVEL_512 1
#define ONE_LEVEL_M 8
static inline __m512 join8(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* One level's block sum for 16 columns, less lv (offset x the level's code sum), as floats: two dpbusd chains (their
 * latency would otherwise bound a single row). */
static inline __attribute__((always_inline)) __m512 one_level_sum16(const __m512i w[8], const int8_t *xl, int32_t lv) {
    __m512i i1 = _mm512_setzero_si512(), i1b = _mm512_setzero_si512();
    for (int st = 0; st < 8; st += 2) {
        i1 = _mm512_dpbusd_epi32(i1, w[st], _mm512_set1_epi32(load32(xl + 4 * st)));
        i1b = _mm512_dpbusd_epi32(i1b, w[st + 1], _mm512_set1_epi32(load32(xl + 4 * st + 4)));
    }
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(i1, i1b), _mm512_set1_epi32(lv)));
}

/* unpack_nibbles for two groups of 8 weight rows at once: block c0's steps in the low half of each vector, c1's in the
 * high half. */
static inline __attribute__((always_inline)) void unpack_nibbles16(const uint8_t *c0, const uint8_t *c1, __m512i w[8]) {
    const __m512i m = _mm512_set1_epi8(0x0F);
    for (int s = 0; s < 4; s++) {
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(c0 + 32 * s))),
                                             _mm256_loadu_si256((const __m256i *)(c1 + 32 * s)), 1);
        w[s] = _mm512_and_si512(v, m);
        w[s + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
    }
}

/* A group kind known at compile time (kind >= 0: the forms one level takes, form_ok), or -1: read at run time. */
static inline __attribute__((always_inline)) __m256 groups8_as(const kvq_groups *q, const int kind, __m256 scale_v,
                                                               int64_t g, int64_t b, int64_t nb) {
    if (kind == KVQ_F16) return load_f16x8((const uint16_t *)q->v + (g * nb + b) * 8);
    if (kind == KVQ_F32) return _mm256_loadu_ps((const float *)q->v + (g * nb + b) * 8);
    if (kind == KVQ_NONE) return _mm256_setzero_ps();
    return groups8(q, scale_v, g, b, nb);
}

/* Block b of groups g, g + 1 (scale and min kinds SK, MK as groups8_as takes them): its scales and mins as 16
 * lanes, its codes unpacked; the cache lines PREFETCH_BLOCKS blocks on asked for. Returns whether it has mins. */
static inline __attribute__((always_inline)) int block16_weights(const kvq_args *a, const int SK, const int MK,
                                                                 int64_t g, int64_t b, __m512 *dw, __m512 *mw,
                                                                 __m512i w[8], const int far) {
    const int64_t nb = a->K / QK;
    const int mins = MK < 0 ? a->mins.kind != KVQ_NONE : MK != KVQ_NONE;
    const __m256 z = _mm256_setzero_ps();
    const __m256 d0 = groups8_as(&a->scale, SK, z, g, b, nb), d1 = groups8_as(&a->scale, SK, z, g + 1, b, nb);
    *dw = join8(d0, d1);
    *mw = mins ? join8(groups8_as(&a->mins, MK, d0, g, b, nb), groups8_as(&a->mins, MK, d1, g + 1, b, nb))
               : _mm512_setzero_ps();
    const uint8_t *c0 = a->codes + (g * nb + b) * 128, *c1 = c0 + nb * 128;
    prefetch_lines(c0 + PREFETCH_BLOCKS * 128, 128);
    prefetch_lines(c1 + PREFETCH_BLOCKS * 128, 128);
    if (far) prefetch_far(c0, 128), prefetch_far(c1, 128);
    unpack_nibbles16(c0, c1, w);
    return mins;
}

/* Block b of groups g, g + 1 against rows m0 .. m0 + R - 1: f / f2 (the outlier blocks' second level) += their sums. */
static inline __attribute__((always_inline)) void one_level_block16(const kvq_args *a, const int R, int64_t g,
                                                                    int64_t m0, int64_t b, __m512 *f, __m512 *f2) {
    const int64_t nb = a->K / QK;
    __m512 dw, mw;
    __m512i w[8];
    const int mins = block16_weights(a, -1, -1, g, b, &dw, &mw, w, R > 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const int64_t xi = (m0 + r) * nb + b;
        const int8_t *xq = a->qx + (m0 + r) * 2 * a->K + 2 * b * QK;
        f[r] = _mm512_fmadd_ps(one_level_sum16(w, xq, a->lv[2 * xi]), _mm512_mul_ps(dw, _mm512_set1_ps(a->dx[xi])), f[r]);
        if (mins) f[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->sx[xi]), f[r]);
        if (a->flag[xi]) /* an outlier block: its second level */
            f2[r] = _mm512_fmadd_ps(one_level_sum16(w, xq + QK, a->lv[2 * xi + 1]),
                                    _mm512_mul_ps(dw, _mm512_set1_ps(a->dx[xi] * (1.0f / 256.0f))), f2[r]);
    }
}

/* A ONE_LEVEL_KC chunk's sums into y: the first chunk stores, the later ones add. */
static inline __attribute__((always_inline)) void one_level_store16(const kvq_args *a, const int R, int64_t g,
                                                                    int64_t m0, int64_t b0, const __m512 *f,
                                                                    const __m512 *f2) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        float *yr = a->y + (m0 + r) * a->ldy + 8 * g;
        const __m512 t = _mm512_add_ps(f[r], f2[r]);
        _mm512_storeu_ps(yr, b0 == 0 ? t : _mm512_add_ps(_mm512_loadu_ps(yr), t));
    }
}

static inline __attribute__((always_inline)) void one_level_tile16(const kvq_args *a, const int R, int64_t g,
                                                                   int64_t m0) {
    const int64_t nb = a->K / QK;
    for (int64_t b0 = 0; b0 < nb; b0 += ONE_LEVEL_KC / QK) {
        const int64_t b1 = b0 + ONE_LEVEL_KC / QK < nb ? b0 + ONE_LEVEL_KC / QK : nb;
        __m512 f[ONE_LEVEL_M], f2[ONE_LEVEL_M]; /* in registers: every loop over r unrolled (R is a constant) */
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) f[r] = f2[r] = _mm512_setzero_ps();
        for (int64_t b = b0; b < b1; b++) one_level_block16(a, R, g, m0, b, f, f2);
        one_level_store16(a, R, g, m0, b0, f, f2);
    }
}

/* The small-row loop's view of a row's block: both levels' codes and what the sums need, for the rows of a group of
 * ONE_LEVEL_M side by side per block (rec[m0 nb + b R + r] for rows m0 + r of a group of R), so that a block's rows
 * sit at fixed offsets from one pointer. Read in place (one_level_block16 with qx, dx, sx, lv and flag apart), a
 * 6-row block took ~370 instructions, a third of them address arithmetic and reloads of spilled row pointers, for
 * its 48 dot products (objdump, 2026-12-07). */
typedef struct one_rec {
    int8_t q[2 * QK];
    float dx, sx;
    int32_t lv0, lv1, flag, pad[3];
} one_rec;

/* one_level_block16 on records (x: the block's first row's): every operation per lane the same, in the same order. */
static inline __attribute__((always_inline)) void one_level_rec16(const kvq_args *a, const int R, const int SK,
                                                                  const int MK, int64_t g, int64_t b,
                                                                  const one_rec *x, __m512 *f, __m512 *f2) {
    __m512 dw, mw;
    __m512i w[8];
    const int mins = block16_weights(a, SK, MK, g, b, &dw, &mw, w, 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const one_rec *xr = x + r;
        f[r] = _mm512_fmadd_ps(one_level_sum16(w, xr->q, xr->lv0), _mm512_mul_ps(dw, _mm512_set1_ps(xr->dx)), f[r]);
        if (mins) f[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xr->sx), f[r]);
        if (xr->flag) /* an outlier block: its second level */
            f2[r] = _mm512_fmadd_ps(one_level_sum16(w, xr->q + QK, xr->lv1),
                                    _mm512_mul_ps(dw, _mm512_set1_ps(xr->dx * (1.0f / 256.0f))), f2[r]);
    }
}

static inline __attribute__((always_inline)) void one_level_rtile16(const kvq_args *a, const int R, const int SK,
                                                                    const int MK, int64_t g, int64_t m0) {
    const int64_t nb = a->K / QK;
    const one_rec *x = a->rec + m0 * nb;
    for (int64_t b0 = 0; b0 < nb; b0 += ONE_LEVEL_KC / QK) {
        const int64_t b1 = b0 + ONE_LEVEL_KC / QK < nb ? b0 + ONE_LEVEL_KC / QK : nb;
        __m512 f[ONE_LEVEL_M], f2[ONE_LEVEL_M];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) f[r] = f2[r] = _mm512_setzero_ps();
        for (int64_t b = b0; b < b1; b++) one_level_rec16(a, R, SK, MK, g, b, x + b * R, f, f2);
        one_level_store16(a, R, g, m0, b0, f, f2);
    }
}

/* Groups g0 .. g1 - 1 (an even count) in pairs against rows m0 .. m0 + R - 1 of the records, 2 <= R <= ONE_LEVEL_M:
 * one loop per row count and per scale / min kind of Q4_0 and Q4_1 (fp16 scales, no mins or fp16 ones), the kinds
 * read at run time for the others. */
#define REC_ROWS(SK, MK)                                                          \
    for (int64_t g = g0; g + 1 < g1; g += 2) switch (R) {                         \
        case 8: one_level_rtile16(a, 8, SK, MK, g, m0); break;                    \
        case 7: one_level_rtile16(a, 7, SK, MK, g, m0); break;                    \
        case 6: one_level_rtile16(a, 6, SK, MK, g, m0); break;                    \
        case 5: one_level_rtile16(a, 5, SK, MK, g, m0); break;                    \
        case 4: one_level_rtile16(a, 4, SK, MK, g, m0); break;                    \
        case 3: one_level_rtile16(a, 3, SK, MK, g, m0); break;                    \
        default: one_level_rtile16(a, 2, SK, MK, g, m0);                          \
        }
static __attribute__((noinline)) void rec_q4_0(const kvq_args *a, int64_t g0, int64_t g1, int64_t m0, int64_t R) {
    REC_ROWS(KVQ_F16, KVQ_NONE)
}
static __attribute__((noinline)) void rec_q4_1(const kvq_args *a, int64_t g0, int64_t g1, int64_t m0, int64_t R) {
    REC_ROWS(KVQ_F16, KVQ_F16)
}
static __attribute__((noinline)) void rec_any(const kvq_args *a, int64_t g0, int64_t g1, int64_t m0, int64_t R) {
    REC_ROWS(-1, -1)
}
#undef REC_ROWS

/* Row m's blocks into its group's records (kvq_linear, once its row is quantized). */
static void fill_recs(const kvq_args *a, int64_t m) {
    const int64_t nb = a->K / QK, m0 = m - m % ONE_LEVEL_M, r = m - m0;
    const int64_t R = a->M - m0 < ONE_LEVEL_M ? a->M - m0 : ONE_LEVEL_M;
    one_rec *x = (one_rec *)a->rec + m0 * nb + r;
    for (int64_t b = 0; b < nb; b++, x += R) {
        const int64_t xi = m * nb + b;
        memcpy(x->q, a->qx + 2 * xi * QK, 2 * QK);
        x->dx = a->dx[xi], x->sx = a->sx[xi], x->lv0 = a->lv[2 * xi], x->lv1 = a->lv[2 * xi + 1], x->flag = a->flag[xi];
    }
}

/* One row (a decode step) against two pairs of groups far apart, g and h, block by block: each thread then
 * reads two weight streams at once, which kept more lines in flight than one stream at twice the pace
 * (docs/kernels.md). Each column's sums are one_level_tile16's, in the same order. */
static __attribute__((noinline)) void one_level_two16(const kvq_args *a, int64_t g, int64_t h) {
    const int64_t nb = a->K / QK;
    for (int64_t b0 = 0; b0 < nb; b0 += ONE_LEVEL_KC / QK) {
        const int64_t b1 = b0 + ONE_LEVEL_KC / QK < nb ? b0 + ONE_LEVEL_KC / QK : nb;
        __m512 f[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, f2[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t b = b0; b < b1; b++) {
            one_level_block16(a, 1, g, 0, b, f, f2);
            one_level_block16(a, 1, h, 0, b, f + 1, f2 + 1);
        }
        one_level_store16(a, 1, g, 0, b0, f, f2);
        one_level_store16(a, 1, h, 0, b0, f + 1, f2 + 1);
    }
}
#endif

/* Constant bits, group kind and row count: each case is its own unrolled loop, accumulators in registers. */
#define TILE_CASES(BITS, G16, KSUB)                              \
    switch (R) {                                                 \
    case 4: group_tile(a, BITS, G16, KSUB, 4, g, m0); break;     \
    case 3: group_tile(a, BITS, G16, KSUB, 3, g, m0); break;     \
    case 2: group_tile(a, BITS, G16, KSUB, 2, g, m0); break;     \
    default: group_tile(a, BITS, G16, KSUB, 1, g, m0);           \
    }

/* The same with loops for 4 rows and 1 (tails of 2-3 rows one by one: the same values, a row's sum does
 * not depend on its neighbours), for forms less common than Q4_0/Q4_1/Q4_K/Q8_0: half the compile time. */
#define TILE_CASES_41(BITS, G16, KSUB)                                                   \
    if (R == 4) {                                                                        \
        group_tile(a, BITS, G16, KSUB, 4, g, m0);                                        \
    } else {                                                                             \
        for (int64_t r = 0; r < R; r++) group_tile(a, BITS, G16, KSUB, 1, g, m0 + r);    \
    }

/* Groups g0 .. g1 - 1 against rows m0 .. m0 + R - 1 of x, for one form: each form its own function, so the
 * compiler meets seven small loops rather than one function holding them all (a first load's compile). */
#define FORM_TILES(NAME, CASES, BITS, G16, KSUB)                                                         \
    static __attribute__((noinline)) void NAME(const kvq_args *a, int64_t g0, int64_t g1, int64_t m0, \
                                               int64_t R) {                                            \
        for (int64_t g = g0; g < g1; g++) {                                                            \
            CASES(BITS, G16, KSUB)                                                                     \
        }                                                                                              \
    }
/* one unrolled loop per form a file has; the generic scale reads for the others (form_ok) */
FORM_TILES(tiles_q4k, TILE_CASES, 4, 0, 1)     /* Q4_K */
FORM_TILES(tiles_q4, TILE_CASES, 4, 0, 0)      /* Q4_0, Q4_1, AWQ / GPTQ */
FORM_TILES(tiles_q5k, TILE_CASES_41, 5, 0, 1)  /* Q5_K */
FORM_TILES(tiles_q5, TILE_CASES_41, 5, 0, 0)   /* Q5_0, Q5_1 */
FORM_TILES(tiles_q6k, TILE_CASES_41, 6, 1, 2)  /* Q6_K */
FORM_TILES(tiles_q8g16, TILE_CASES_41, 8, 1, 0) /* 8-bit codes in groups of 16 */
FORM_TILES(tiles_q8, TILE_CASES, 8, 0, 0)      /* Q8_0 */
#undef FORM_TILES

#ifdef ONE_LEVEL_512
/* ---- the two-level forms on 16 columns: group_block for groups g and g + 1 at once -------------------------------
 * K-quant, Q5 / Q6 / Q8_0 and AWQ / GPTQ-style weights at 2-8 rows (a verification step, a small decode batch) went
 * through the 8-column loop in passes of TILE_M rows, so a 6-row call unpacked each block twice at half the width. Here
 * a block pair's scales and codes are group_block's (the same helpers, joined into halves) and each row's sums are its
 * lanes' (integer sums exact, then the same float operations per lane in the same order): every output bit for bit as
 * the 8-column loop's. AVX-512 has no vpsignb: 8-bit codes take |w| and x negated where w < 0 by mask (the same
 * int8 products). */
static inline __m512i join8i(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

static inline __attribute__((always_inline)) __m512i bcast4_16(const int8_t *p) { return _mm512_set1_epi32(load32(p)); }

static inline __attribute__((always_inline)) void group_block16(const kvq_args *a, const int bits, const int g16,
                                                                const int ksub, const int R, int64_t g, int64_t m0,
                                                                int64_t b, __m512 *acc, __m512 *macc) {
    const int64_t nb = a->K / QK;
    __m512 dw, dw2, mw;
    __m512i w[8];
    {
        __m256 d0, d20, m0w, d1, d21, m1w;
        group_scales(a, g16, ksub, g, b, &d0, &d20, &m0w);
        group_scales(a, g16, ksub, g + 1, b, &d1, &d21, &m1w);
        dw = join8(d0, d1), dw2 = join8(d20, d21), mw = join8(m0w, m1w);
        __m256i w0[8], w1[8];
        group_codes(a, bits, 1, g, b, w0);
        group_codes(a, bits, 1, g + 1, b, w1);
        for (int s = 0; s < 8; s++) w[s] = join8i(w0[s], w1[s]);
    }
    for (int r = 0; r < R; r++) {
        const int64_t xi = (m0 + r) * nb + b;
        const int8_t *xq = a->qx + (m0 + r) * 2 * a->K + 2 * b * QK;
        const __m512 dxv = _mm512_set1_ps(a->dx[xi] / 256.0f);
        __m512i i1 = _mm512_setzero_si512(), i2 = _mm512_setzero_si512();
        int32_t off = 0;
        if (bits == 4) {
            for (int st = 0; st < 8; st++) {
                i1 = _mm512_dpbusd_epi32(i1, w[st], bcast4_16(xq + 4 * st));
                i2 = _mm512_dpbusd_epi32(i2, w[st], bcast4_16(xq + QK + 4 * st));
            }
            if (a->xs) {
                const int32_t *xs = a->xs + ((m0 + r) * nb + b) * 2;
                off = a->offset * (xs[0] + xs[1]);
            }
        } else if (bits != 8) { /* 5, 6 */
            const int32_t *xs = a->xs ? a->xs + ((m0 + r) * nb + b) * 2 : NULL;
            for (int h = 0; h < 2; h++) {
                for (int st = 4 * h; st < 4 * h + 4; st++) {
                    i1 = _mm512_dpbusd_epi32(i1, w[st], bcast4_16(xq + 4 * st));
                    i2 = _mm512_dpbusd_epi32(i2, w[st], bcast4_16(xq + QK + 4 * st));
                }
                if (g16 && h == 0) {
                    const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(i1, 8), i2),
                                                          _mm512_set1_epi32(xs ? a->offset * xs[0] : 0));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dxv), acc[r]);
                    i1 = i2 = _mm512_setzero_si512();
                }
            }
            if (xs) off = a->offset * (g16 ? xs[1] : xs[0] + xs[1]);
        } else {
            for (int st = 0; st < 8; st++) {
                if (g16 && st == 4) {
                    const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(i1, 8), i2);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dxv), acc[r]);
                    i1 = i2 = _mm512_setzero_si512();
                }
                const __m512i u = _mm512_abs_epi8(w[st]);
                const __mmask64 neg = _mm512_movepi8_mask(w[st]);
                const __m512i x1 = bcast4_16(xq + 4 * st), x2 = bcast4_16(xq + QK + 4 * st);
                i1 = _mm512_dpbusd_epi32(i1, u, _mm512_mask_sub_epi8(x1, neg, _mm512_setzero_si512(), x1));
                i2 = _mm512_dpbusd_epi32(i2, u, _mm512_mask_sub_epi8(x2, neg, _mm512_setzero_si512(), x2));
            }
        }
        __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(i1, 8), i2);
        if (bits != 8) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(off));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw2, dxv), acc[r]);
        if (ksub == 1)
            macc[r] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(a->sx[xi]), macc[r]);
        else if (a->mins.kind)
            macc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->sx[xi]), macc[r]);
    }
}

static inline __attribute__((always_inline)) void group_tile16(const kvq_args *a, const int bits, const int g16,
                                                               const int ksub, const int R, int64_t g, int64_t m0) {
    const int64_t nb = a->K / QK;
    __m512 acc[ONE_LEVEL_M], macc[ONE_LEVEL_M];
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) group_block16(a, bits, g16, ksub, R, g, m0, b, acc, macc);
    for (int r = 0; r < R; r++) _mm512_storeu_ps(a->y + (m0 + r) * a->ldy + 8 * g, _mm512_add_ps(acc[r], macc[r]));
}

/* Groups g0 .. g1 - 1 in pairs against rows m0 .. m0 + R - 1 (2 <= R <= ONE_LEVEL_M), one function per form as
 * FORM_TILES; an odd last group by the form's 8-column loop. */
#define FORM_TILES16(NAME, TILES8, BITS, G16, KSUB)                                                          \
    static __attribute__((noinline)) void NAME(const kvq_args *a, int64_t g0, int64_t g1, int64_t m0,     \
                                               int64_t R) {                                                \
        const int64_t g2 = g0 + (g1 - g0) / 2 * 2;                                                         \
        for (int64_t g = g0; g < g2; g += 2) switch (R) {                                                  \
            case 8: group_tile16(a, BITS, G16, KSUB, 8, g, m0); break;                                     \
            case 7: group_tile16(a, BITS, G16, KSUB, 7, g, m0); break;                                     \
            case 6: group_tile16(a, BITS, G16, KSUB, 6, g, m0); break;                                     \
            case 5: group_tile16(a, BITS, G16, KSUB, 5, g, m0); break;                                     \
            case 4: group_tile16(a, BITS, G16, KSUB, 4, g, m0); break;                                     \
            case 3: group_tile16(a, BITS, G16, KSUB, 3, g, m0); break;                                     \
            default: group_tile16(a, BITS, G16, KSUB, 2, g, m0);                                           \
            }                                                                                              \
        if (g2 < g1)                                                                                       \
            for (int64_t r0 = 0; r0 < R; r0 += TILE_M)                                                     \
                TILES8(a, g2, g1, m0 + r0, R - r0 < TILE_M ? R - r0 : TILE_M);                             \
    }
FORM_TILES16(tiles16_q4k, tiles_q4k, 4, 0, 1)
FORM_TILES16(tiles16_q4, tiles_q4, 4, 0, 0)
FORM_TILES16(tiles16_q5k, tiles_q5k, 5, 0, 1)
FORM_TILES16(tiles16_q5, tiles_q5, 5, 0, 0)
FORM_TILES16(tiles16_q6k, tiles_q6k, 6, 1, 2)
FORM_TILES16(tiles16_q8g16, tiles_q8g16, 8, 1, 0)
FORM_TILES16(tiles16_q8, tiles_q8, 8, 0, 0)
#undef FORM_TILES16
#endif

#ifdef KVQ_AVX2
/* One row (a decode step) against groups g and h far apart, block by block: one_level_two16's two weight streams
 * per thread for the two-level forms. Each column's sums are group_tile's, in the same order. */
#define FORM_TWO(NAME, BITS, G16, KSUB)                                                                 \
    static __attribute__((noinline)) void NAME(const kvq_args *a, int64_t g, int64_t h) {           \
        const int64_t nb = a->K / QK;                                                               \
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, macc[2] = {acc[0], acc[1]};      \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            group_block(a, BITS, G16, KSUB, 1, g, 0, b, acc, macc);                                 \
            group_block(a, BITS, G16, KSUB, 1, h, 0, b, acc + 1, macc + 1);                         \
        }                                                                                           \
        _mm256_storeu_ps(a->y + 8 * g, _mm256_add_ps(acc[0], macc[0]));                             \
        _mm256_storeu_ps(a->y + 8 * h, _mm256_add_ps(acc[1], macc[1]));                             \
    }
FORM_TWO(two_q4k, 4, 0, 1)
FORM_TWO(two_q4, 4, 0, 0)
FORM_TWO(two_q5k, 5, 0, 1)
FORM_TWO(two_q5, 5, 0, 0)
FORM_TWO(two_q6k, 6, 1, 2)
FORM_TWO(two_q8g16, 8, 1, 0)
FORM_TWO(two_q8, 8, 0, 0)
#undef FORM_TWO
#endif

typedef void (*tiles_fn)(const kvq_args *, int64_t, int64_t, int64_t, int64_t);
typedef void (*two_fn)(const kvq_args *, int64_t, int64_t);

/* A form's loops (form_ok holds): its index in FORM_TILES_FNS / FORM_TWO_FNS. K-quant groups are read inline
 * (group_tile's ksub 1). */
static int form_of(const kvq_args *a, const int bits) {
    const int ksub = a->G == QK && a->scale.kind == KVQ_SUB && a->mins.kind == KVQ_NEG_SUB && a->scale.shift >= 0 &&
                     a->mins.shift >= 0;
    return bits == 4 ? (ksub ? 0 : 1) : bits == 5 ? (ksub ? 2 : 3) : bits == 6 ? 4 : a->G == 16 ? 5 : 6;
}
static const tiles_fn FORM_TILES_FNS[7] = {tiles_q4k, tiles_q4, tiles_q5k, tiles_q5, tiles_q6k, tiles_q8g16, tiles_q8};
#ifdef ONE_LEVEL_512
static const tiles_fn FORM_TILES16_FNS[7] = {tiles16_q4k, tiles16_q4,    tiles16_q5k, tiles16_q5,
                                             tiles16_q6k, tiles16_q8g16, tiles16_q8};
#endif
#ifdef KVQ_AVX2
static const two_fn FORM_TWO_FNS[7] = {two_q4k, two_q4, two_q5k, two_q5, two_q6k, two_q8g16, two_q8};
#endif

#ifdef KVQ_AVX2
static __attribute__((noinline)) void tiles_q4_one(const kvq_args *a, int64_t g0, int64_t g1, int64_t m0, int64_t R) {
    for (int64_t g = g0; g < g1; g++) switch (R) {
        case 4: one_level_tile(a, 4, g, m0); break;
        case 3: one_level_tile(a, 3, g, m0); break;
        case 2: one_level_tile(a, 2, g, m0); break;
        default: one_level_tile(a, 1, g, m0);
        }
}
#endif
#ifdef ONE_LEVEL_512
/* Groups g0 .. g1 - 1 in pairs against rows m0 .. m0 + R - 1 (R <= ONE_LEVEL_M); an odd last group by the
 * 8-column loop. One row (a decode step's odd last pair) reads its blocks in place; more rows read their records,
 * which kvq_linear builds for every call of 2+ rows that comes here. */
static __attribute__((noinline)) void tiles_q4_one16(const kvq_args *a, int64_t g0, int64_t g1, int64_t m0, int64_t R) {
    const int64_t g2 = g0 + (g1 - g0) / 2 * 2;
    if (R == 1)
        for (int64_t g = g0; g < g2; g += 2) one_level_tile16(a, 1, g, m0);
    else if (a->scale.kind == KVQ_F16 && a->mins.kind == KVQ_NONE)
        rec_q4_0(a, g0, g2, m0, R);
    else if (a->scale.kind == KVQ_F16 && a->mins.kind == KVQ_F16)
        rec_q4_1(a, g0, g2, m0, R);
    else
        rec_any(a, g0, g2, m0, R);
    if (g2 < g1)
        for (int64_t r0 = 0; r0 < R; r0 += TILE_M)
            tiles_q4_one(a, g2, g1, m0 + r0, R - r0 < TILE_M ? R - r0 : TILE_M);
}
#endif

static void gemm_tile(const kvq_args *a, const int bits, int64_t t) {
    const int64_t g0 = t * TILE_G, g1 = g0 + TILE_G < a->N / 8 ? g0 + TILE_G : a->N / 8;
    tiles_fn tiles =
#ifdef KVQ_AVX2
        a->one_level ? tiles_q4_one :
#endif
        FORM_TILES_FNS[form_of(a, bits)];
#ifdef ONE_LEVEL_512
    if (a->one_level) {
        for (int64_t m0 = 0; m0 < a->M; m0 += ONE_LEVEL_M)
            tiles_q4_one16(a, g0, g1, m0, a->M - m0 < ONE_LEVEL_M ? a->M - m0 : ONE_LEVEL_M);
        return;
    }
    if (a->M >= 2) { /* the two-level forms' 16-column loop, an odd last row by the 8-column one */
        const tiles_fn tiles16 = FORM_TILES16_FNS[form_of(a, bits)];
        for (int64_t m0 = 0; m0 < a->M; m0 += ONE_LEVEL_M) {
            const int64_t R = a->M - m0 < ONE_LEVEL_M ? a->M - m0 : ONE_LEVEL_M;
            (R >= 2 ? tiles16 : tiles)(a, g0, g1, m0, R);
        }
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < a->M; m0 += TILE_M) tiles(a, g0, g1, m0, a->M - m0 < TILE_M ? a->M - m0 : TILE_M);
}

/* Whether gemm_tile has a loop for this weight: 4-bit codes in groups of a multiple of 32; 5-bit ones
 * too; 6-bit ones only as Q6_K (groups of 16, int8 sub-scales of an fp16 d, no mins); 8-bit ones in
 * groups of 16 or a multiple of 32. */
static int form_ok(const kvq_args *a, int bits) {
    if (a->one_level) /* 4-bit codes, one fp16 / fp32 scale (and min) per 32 (the plain C build: its own loop over
                       * the same rounding, in its own order; it has no kvq_gemm_i8 to agree with) */
        return bits == 4 && a->G == QK && (a->scale.kind == KVQ_F16 || a->scale.kind == KVQ_F32) &&
               (a->mins.kind == KVQ_NONE || a->mins.kind == KVQ_F16 || a->mins.kind == KVQ_F32);
    switch (bits) {
    case 4:
    case 5: return a->G % QK == 0;
    case 6: return a->G == 16 && a->scale.kind == KVQ_SUB_I8 && a->mins.kind == KVQ_NONE && a->scale.shift >= 0;
    case 8: return a->G == 16 || a->G % QK == 0;
    default: return 0;
    }
}

/* ---- the same integer sums on AMX tiles (Intel, AMX-INT8) -------------------------------------------
 * Where the CPU has AMX and the process may use it (kvq_amx_enable), calls of at least `amx_min_rows` rows and
 * `amx_min_elems` activations (rows x K: small K leaves too little work per block for the tiles' overheads)
 * of 4-bit codes (groups of a multiple of 32), or of `amx_min_rows8` rows of Q8_0's int8 codes (whose dpbusd loop
 * costs more per product: sign moves, twice the bytes), compute each block's two integer sums
 * with tile dot products instead of dpbusd: A = 16 (or fewer) rows of x's levels q1 / q2 of block b, read in
 * place from the quantized activations (K = 32 bytes a row, row stride 2K); B = 16 weight rows (the groups
 * 2p, 2p + 1) of the same block, unpacked from the x8 layout into the tile's 4-byte-interleaved ("VNNI")
 * order, which is the x8 layout's own step order: step s of a group is 8 lanes x 4 consecutive k. Each
 * block's two int32 tiles then go through the integer kernel's epilogue in the same order and roundings
 * (256 i1 + i2 - offset xs, then one fma with d dx / 256 per block; the mins' sum apart, added at the end),
 * so every output is the integer kernel's bit for bit, whichever path computed it and whatever the row count.
 * Per-block scales bound K per tile product to 32 (one block, half a tile's depth) and make every block's
 * sums go through memory (tile store, vector loads): the epilogue's vector work, not the tiles, bounds it.
 * Two panels share x's tiles (amx_tile2). Measured per linear in docs/results/int8dot-ops-1b.txt. */
/* Compiled only where the build asks for it (KVCLI_AMX: the CPU reports AMX, kvcli_kernels/cpu_build.py):
 * elsewhere the code could never run, and it is half of this file's compile time. */
#if defined(KVCLI_AMX) && defined(KVQ_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__x86_64__) && \
    defined(__linux__)
#define KVQ_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_CHUNK_KB 1024 /* x's rows per pass over the weights: this many KiB of their levels */
static int amx_min_rows = 0; /* 0: AMX off (the default until kvq_amx_enable) */
static int64_t amx_min_elems = 0;
static int amx_min_rows8 = 0;

typedef struct { /* ldtilecfg's 64 bytes, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

#define AMX_TILE_BIT (1u << 24) /* CPUID.(7, 0):EDX */
#define AMX_INT8_BIT (1u << 25)
#define AMX_BF16_BIT (1u << 22)

/* 1 where the CPU has the AMX features `bits` (CPUID.(7, 0):EDX) and Linux grants this process the tile state
 * (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: off for every process until it asks), -1 where the CPU lacks them,
 * -2 where Linux refuses. */
static int amx_request(unsigned bits) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || (d & bits) != bits) return -1;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -2;
}

/* AMX on from `min_rows` rows and `min_elems` activations (rows x K), for 8-bit codes from `min_rows8` rows
 * (min_rows 0: off). Returns 1 when on, 0 when turned off, -1 where the CPU has no AMX-INT8, -2 where Linux refuses
 * the tile state (amx_request). */
int kvq_amx_enable(int min_rows, int64_t min_elems, int min_rows8) {
    amx_min_rows = 0;
    if (min_rows <= 0) return 0;
    const int rc = amx_request(AMX_TILE_BIT | AMX_INT8_BIT);
    if (rc == 1)
        amx_min_rows = min_rows, amx_min_elems = min_elems, amx_min_rows8 = min_rows8 > 0 ? min_rows8 : min_rows;
    return rc;
}

/* Tile rows for the last R (<= 16) rows of x: fewer than 16 for a short tail (a tile product costs by its
 * rows); x is padded with zero rows up to amx_padded_rows. (Tiles of 6 rows for 5-6 were no faster than 8.) */
static int amx_tile_rows(int64_t R) { return R > 8 ? 16 : R > 4 ? 8 : R > 2 ? 4 : 2; }

static int64_t amx_padded_rows(int64_t M) {
    const int64_t rest = M % 16;
    return M - rest + (rest ? amx_tile_rows(rest) : 0);
}

static int amx_form_ok(const kvq_args *a, int bits) { return (bits == 4 || bits == 8) && a->G % QK == 0; }

/* B of block b for weight rows 16 p .. 16 p + 15: 8 rows (k quads) x 64 bytes, the groups 2p and 2p + 1 side
 * by side (an absent second group, N = 8 mod 16, as zeros). 4-bit codes less their offset (Q4_0's 8): signed
 * int8 where the offset is not 0, so the tile sum is the integer kernel's sum less offset x xs already. */
static inline void amx_unpack_b(const kvq_args *a, const int bits, int64_t p, int64_t b, int two, uint8_t *out) {
    const int64_t nb = a->K / QK, bb = block_bytes(bits);
    const uint8_t *c0 = a->codes + (2 * p * nb + b) * bb, *c1 = two ? a->codes + ((2 * p + 1) * nb + b) * bb : NULL;
    const int chunks = bits == 4 ? 4 : 8;
    for (int s = 0; s < chunks; s++) {
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(c0 + 32 * s));
        const __m256i hi = two ? _mm256_loadu_si256((const __m256i *)(c1 + 32 * s)) : _mm256_setzero_si256();
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        if (bits == 4) { /* chunk s: low nibbles step s, high nibbles step s + 4; less the offset, as int8 */
            const __m512i m = _mm512_set1_epi8(0x0F), o = _mm512_set1_epi8((char)a->offset);
            _mm512_store_si512(out + 64 * s, _mm512_sub_epi8(_mm512_and_si512(v, m), o));
            _mm512_store_si512(out + 64 * (s + 4), _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), m), o));
        } else {
            _mm512_store_si512(out + 64 * s, v);
        }
    }
}

/* The 16 lanes of group gr of weight rows 16 p ..: groups8 of the two groups of 8. */
static inline __m512 groups16(const kvq_groups *q, __m512 scale_v, int64_t p, int64_t gr, int64_t ng, int two) {
    const __m256 lo = groups8(q, _mm512_castps512_ps256(scale_v), 2 * p, gr, ng);
    const __m256 hi = two ? groups8(q, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(scale_v), 1)), 2 * p + 1, gr, ng)
                          : _mm256_setzero_ps();
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* Rows m0 .. m0 + R - 1 of y (the tile computes MT rows; the padding's results are dropped) for weight rows
 * 16 p .. + 15. Tiles: 2 / 3 x's two levels, 4 the weights, 0 / 1 (blocks of even index) and 5 / 6 (odd) the
 * sums. B from `panel` (the panel unpacked, K / 32 x 512 bytes) or, where NULL, unpacked here into bbuf. */
static inline __attribute__((always_inline)) void amx_tile(const kvq_args *a, const int bits, const int SIGNED, const int MT, int64_t m0,
                                                           int64_t R, int64_t p, const uint8_t *panel, uint8_t *bbuf,
                                                           int32_t *cbuf) {
    const int64_t nb = a->K / QK, ng = a->K / a->G;
    const int two = 2 * p + 1 < a->N / 8;
    __m512 acc[16];
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    /* Block b + 1's tile products are issued before block b's epilogue, which then overlaps them: their sums
     * go to the other tile pair and the other half of cbuf. */
#define AMX_ISSUE(B, C1, C2)                                                    \
    do {                                                                        \
        const int8_t *xq = a->qx + m0 * 2 * a->K + 2 * (B) * QK;                \
        int32_t *cb = cbuf + ((B) & 1) * 2 * 16 * 16;                           \
        const uint8_t *bt = panel ? panel + (B) * 512 : bbuf + ((B) & 1) * 512; \
        if (!panel) amx_unpack_b(a, bits, p, (B), two, bbuf + ((B) & 1) * 512); \
        __asm__ volatile("" ::: "memory"); /* tile loads read what was stored */ \
        _tile_loadd(4, bt, 64);                                                 \
        _tile_loadd(2, xq, 2 * a->K);                                           \
        _tile_loadd(3, xq + QK, 2 * a->K);                                      \
        _tile_zero(C1);                                                         \
        _tile_zero(C2);                                                         \
        if (SIGNED) {                                                           \
            _tile_dpbssd(C1, 2, 4);                                             \
            _tile_dpbssd(C2, 3, 4);                                             \
        } else {                                                                \
            _tile_dpbsud(C1, 2, 4);                                             \
            _tile_dpbsud(C2, 3, 4);                                             \
        }                                                                       \
        _tile_stored(C1, cb, 64);                                               \
        _tile_stored(C2, cb + 16 * 16, 64);                                     \
    } while (0)
    AMX_ISSUE(0, 0, 1);
    for (int64_t b = 0; b < nb; b++) {
        if (b + 1 < nb) {
            if (b & 1)
                AMX_ISSUE(b + 1, 0, 1);
            else
                AMX_ISSUE(b + 1, 5, 6);
        }
        __asm__ volatile("" ::: "memory");
        const int32_t *cb = cbuf + (b & 1) * 2 * 16 * 16;
        const int64_t gr = group_of(b, 0, a->G);
        const __m512 dw = groups16(&a->scale, _mm512_setzero_ps(), p, gr, ng, two);
        /* per row: five vector operations, dx / 256 broadcast from memory (no shuffle port) */
        const float *dxs = a->dxs + m0 * nb + b;
        for (int r = 0; r < MT; r++) {
            const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cb + 16 * r), 8),
                                                  _mm512_load_si512(cb + 16 * 16 + 16 * r));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(dxs[r * nb])), acc[r]);
        }
    }
#undef AMX_ISSUE
    const __mmask16 cols = two ? 0xFFFF : 0x00FF;
    if (a->mins.kind) { /* the mins' share, summed apart as the integer kernel does, then added */
        __m512 macc[16];
        for (int r = 0; r < MT; r++) macc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const int64_t gr = group_of(b, 0, a->G);
            const __m512 dw = a->mins.kind == KVQ_ZERO ? groups16(&a->scale, _mm512_setzero_ps(), p, gr, ng, two) : _mm512_setzero_ps();
            const __m512 mw = groups16(&a->mins, dw, p, gr, ng, two);
            for (int r = 0; r < MT; r++) macc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->sx[(m0 + r) * nb + b]), macc[r]);
        }
        for (int r = 0; r < MT; r++) acc[r] = _mm512_add_ps(acc[r], macc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(a->y + (m0 + r) * a->ldy + 16 * p, cols, acc[r]);
}

/* amx_tile for two panels p, p + 1 at once (x's tiles loaded once for both): tiles 4 / 7 their weights, 0 / 1
 * and 5 / 6 their sums; no tile pair left to overlap blocks. */
static inline __attribute__((always_inline)) void amx_tile2(const kvq_args *a, const int bits, const int SIGNED, const int MT,
                                                            int64_t m0, int64_t R, int64_t p, const uint8_t *panel,
                                                            uint8_t *bbuf, int32_t *cbuf) {
    const int64_t nb = a->K / QK, ng = a->K / a->G;
    const int two1 = 2 * (p + 1) + 1 < a->N / 8;
    __m512 acc[2][16];
    for (int r = 0; r < MT; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *xq = a->qx + m0 * 2 * a->K + 2 * b * QK;
        int32_t *cb = cbuf + (b & 1) * 4 * 16 * 16;
        const uint8_t *b0 = panel ? panel + b * 512 : bbuf, *b1 = panel ? panel + (nb + b) * 512 : bbuf + 512;
        if (!panel) amx_unpack_b(a, bits, p, b, 1, bbuf), amx_unpack_b(a, bits, p + 1, b, two1, bbuf + 512);
        __asm__ volatile("" ::: "memory");
        _tile_loadd(2, xq, 2 * a->K);
        _tile_loadd(3, xq + QK, 2 * a->K);
        _tile_loadd(4, b0, 64);
        _tile_loadd(7, b1, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(5);
        _tile_zero(6);
        if (SIGNED) {
            _tile_dpbssd(0, 2, 4);
            _tile_dpbssd(1, 3, 4);
            _tile_dpbssd(5, 2, 7);
            _tile_dpbssd(6, 3, 7);
        } else {
            _tile_dpbsud(0, 2, 4);
            _tile_dpbsud(1, 3, 4);
            _tile_dpbsud(5, 2, 7);
            _tile_dpbsud(6, 3, 7);
        }
        _tile_stored(0, cb, 64);
        _tile_stored(1, cb + 256, 64);
        _tile_stored(5, cb + 512, 64);
        _tile_stored(6, cb + 768, 64);
        __asm__ volatile("" ::: "memory");
        const int64_t gr = group_of(b, 0, a->G);
        const float *dxs = a->dxs + m0 * nb + b;
        for (int h = 0; h < 2; h++) {
            const __m512 dw = groups16(&a->scale, _mm512_setzero_ps(), p + h, gr, ng, h == 0 || two1);
            const int32_t *c = cb + h * 512;
            for (int r = 0; r < MT; r++) {
                const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c + 16 * r), 8),
                                                      _mm512_load_si512(c + 256 + 16 * r));
                acc[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(dxs[r * nb])), acc[h][r]);
            }
        }
    }
    for (int h = 0; h < 2; h++) {
        const int two = h == 0 || two1;
        if (a->mins.kind) {
            __m512 macc[16];
            for (int r = 0; r < MT; r++) macc[r] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const int64_t gr = group_of(b, 0, a->G);
                const __m512 dw = a->mins.kind == KVQ_ZERO ? groups16(&a->scale, _mm512_setzero_ps(), p + h, gr, ng, two) : _mm512_setzero_ps();
                const __m512 mw = groups16(&a->mins, dw, p + h, gr, ng, two);
                for (int r = 0; r < MT; r++) macc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->sx[(m0 + r) * nb + b]), macc[r]);
            }
            for (int r = 0; r < MT; r++) acc[h][r] = _mm512_add_ps(acc[h][r], macc[r]);
        }
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(a->y + (m0 + r) * a->ldy + 16 * (p + h), two ? 0xFFFF : 0x00FF, acc[h][r]);
    }
}

/* Tile shapes for tiles of MT rows of x (palette 1): 0 / 1 and 5 / 6 MT x 16 int32 sums, 2 / 3 MT x 32
 * int8 levels, 4 the weights' 8 k quads x 16 columns x 4. */
__attribute__((target("amx-tile"))) static void amx_configure(int MT) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[5] = cfg.rows[6] = (uint8_t)MT;
    cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[5] = cfg.colsb[6] = 64;
    cfg.rows[2] = cfg.rows[3] = (uint8_t)MT, cfg.colsb[2] = cfg.colsb[3] = QK;
    cfg.rows[4] = cfg.rows[7] = QK / 4, cfg.colsb[4] = cfg.colsb[7] = 64;
    /* _tile_loadconfig's asm names only the first 8 bytes as its input: the whole struct must be stored */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* Panels p0 .. p1 - 1 (16 weight rows each) against rows m_begin .. m_end - 1 of x: tiles of 16 rows and a
 * shorter last one (amx_tile_rows). A panel that meets more than one tile of x is unpacked once into `panel`
 * (K / 32 x 512 bytes). */
__attribute__((target("amx-tile,amx-int8"), always_inline)) static inline void amx_panels_of(
    const kvq_args *a, const int bits, const int SIGNED, int64_t p0, int64_t p1, int64_t m_begin, int64_t m_end,
    uint8_t *panel) {
    uint8_t bbuf[2 * 512] __attribute__((aligned(64)));
    int32_t cbuf[2 * 4 * 16 * 16] __attribute__((aligned(64)));
    const int64_t nb = a->K / QK;
    const int reuse = m_end - m_begin > 16 && panel;
    int configured = 0;
    for (int64_t p = p0; p < p1;) {
        const int np = p + 1 < p1 ? 2 : 1;
        if (reuse)
            for (int h = 0; h < np; h++)
                for (int64_t b = 0; b < nb; b++)
                    amx_unpack_b(a, bits, p + h, b, 2 * (p + h) + 1 < a->N / 8, panel + (h * nb + b) * 512);
        const uint8_t *bp = reuse ? panel : NULL;
        for (int64_t m0 = m_begin; m0 < m_end; m0 += 16) {
            const int64_t R = m_end - m0 < 16 ? m_end - m0 : 16;
            const int MT = amx_tile_rows(R);
            if (MT != configured) amx_configure(MT), configured = MT;
#define AMX_ROWS(FN, BITS, SIGNED)                                          \
    switch (MT) {                                                           \
    case 2: FN(a, BITS, SIGNED, 2, m0, R, p, bp, bbuf, cbuf); break;        \
    case 4: FN(a, BITS, SIGNED, 4, m0, R, p, bp, bbuf, cbuf); break;        \
    case 8: FN(a, BITS, SIGNED, 8, m0, R, p, bp, bbuf, cbuf); break;        \
    default: FN(a, BITS, SIGNED, 16, m0, R, p, bp, bbuf, cbuf);             \
    }
#define AMX_CASES(BITS, SIGNED)                                             \
    if (np == 2) {                                                          \
        AMX_ROWS(amx_tile2, BITS, SIGNED)                                   \
    } else {                                                                \
        AMX_ROWS(amx_tile, BITS, SIGNED)                                    \
    }
            AMX_CASES(bits, SIGNED)
#undef AMX_CASES
#undef AMX_ROWS
        }
        p += np;
    }
    _tile_release();
}

/* One function per form (as gemm_tile's loops: one holding all three took the compiler twice as long). */
#define AMX_PANELS_FN(NAME, BITS, SIGNED)                                                                         \
    __attribute__((target("amx-tile,amx-int8"), noinline)) static void NAME(                                     \
        const kvq_args *a, int64_t p0, int64_t p1, int64_t m_begin, int64_t m_end, uint8_t *panel) {            \
        amx_panels_of(a, BITS, SIGNED, p0, p1, m_begin, m_end, panel);                                            \
    }
AMX_PANELS_FN(amx_panels_q4_signed, 4, 1) /* Q4_0: codes less 8, signed */
AMX_PANELS_FN(amx_panels_q4, 4, 0)
AMX_PANELS_FN(amx_panels_q8, 8, 1)
#undef AMX_PANELS_FN

static void amx_panels(const kvq_args *a, const int bits, int64_t p0, int64_t p1, int64_t m_begin, int64_t m_end,
                       uint8_t *panel) {
    if (bits == 4 && a->offset)
        amx_panels_q4_signed(a, p0, p1, m_begin, m_end, panel);
    else if (bits == 4)
        amx_panels_q4(a, p0, p1, m_begin, m_end, panel);
    else
        amx_panels_q8(a, p0, p1, m_begin, m_end, panel);
}

/* Rows of x per pass over the weights: their two levels (2K bytes a row) stay in L2 while the panels pass. */
static int64_t amx_chunk_rows(int64_t K) {
    const int64_t rows = (AMX_CHUNK_KB << 10) / (2 * K) / 16 * 16;
    return rows < 16 ? 16 : rows;
}

/* kvq_linear's work on AMX, inside its parallel region once x is quantized (padded to amx_padded_rows):
 * each thread its share of the panels. Returns 0, or -1 out of memory. */
static int amx_linear(const kvq_args *a, const int bits) {
    const int64_t npanels = (a->N / 8 + 1) / 2, mc = amx_chunk_rows(a->K);
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t p0 = npanels * t / nt, p1 = npanels * (t + 1) / nt;
    uint8_t *panel = a->M > 16 ? (uint8_t *)aligned_alloc(64, (size_t)(2 * a->K / QK * 512)) : NULL;
    if (a->M > 16 && !panel) return -1;
    for (int64_t mb = 0; mb < a->M; mb += mc) amx_panels(a, bits, p0, p1, mb, mb + mc < a->M ? mb + mc : a->M, panel);
    free(panel);
    return 0;
}
#else
int kvq_amx_enable(int min_rows, int64_t min_elems, int min_rows8) {
    (void)min_elems, (void)min_rows8;
    return min_rows <= 0 ? 0 : -1;
}
#endif

/* y [M, N] (row stride ldy) = x [M, K] @ W^T. bits 4, 5, 6 (unsigned codes, less `offset`) or 8 (int8
 * codes, offset 0). one_level: the activations rounded and summed as kvq_gemm_i8 does (one_level_tile; 4-bit
 * codes with one scale per 32), else two levels everywhere. Returns 0, -1 when out of memory, -3 for a form
 * gemm_tile has no loop for. */
int kvq_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, int offset, int scale_kind,
               const void *scale, const uint16_t *scale_sup, int64_t scale_per, int min_kind, const void *mins,
               const uint16_t *min_sup, int64_t min_per, int64_t G, int one_level, int64_t N, float *y, int64_t ldy,
               int nthreads) {
    const int64_t nb = K / QK, ntiles = (N / 8 + TILE_G - 1) / TILE_G;
    kvq_args form = {NULL, NULL, NULL, NULL, codes, groups_of(scale_kind, scale, scale_sup, scale_per),
                     groups_of(min_kind, mins, min_sup, min_per), M, K, N, G, y, ldy, offset};
    form.one_level = one_level != 0;
    if (!form_ok(&form, bits)) return -3;
#ifdef KVQ_AMX /* (the tiles sum both levels in the two-level form: not for one level) */
    const int amx = !one_level && amx_min_rows > 0 && amx_form_ok(&form, bits) &&
                    (bits == 8 ? M >= amx_min_rows8 : M >= amx_min_rows && M * K >= amx_min_elems);
    const int64_t Mp = amx ? amx_padded_rows(M) : M; /* AMX reads whole tiles: zero rows, results dropped */
#else
    const int amx = 0;
    const int64_t Mp = M;
#endif
    /* one buffer (cpu_scratch.h): the activations' codes, scales and sums; the zeroed ones as calloc gave them */
    const int need_xs = offset != 0 && bits != 8 && !one_level;
    const size_t b_qx = scratch_align((size_t)(2 * Mp * K)), b_f = scratch_align(sizeof(float) * (size_t)(Mp * nb));
    const size_t b_xs = need_xs ? scratch_align(sizeof(int32_t) * (size_t)(2 * Mp * nb)) : 0;
    const size_t b_flag = one_level ? scratch_align((size_t)(Mp * nb)) : 0;
    const size_t b_lv = one_level ? scratch_align(sizeof(int32_t) * (size_t)(2 * Mp * nb)) : 0;
#ifdef ONE_LEVEL_512
    const int recs = one_level && !amx && M >= 2; /* the small-row loop's records (one_rec) */
    const size_t b_rec = recs ? scratch_align(sizeof(struct one_rec) * (size_t)(M * nb)) : 0;
#else
    const int recs = 0;
    const size_t b_rec = 0;
#endif
    int fresh;
    char *buf = (char *)scratch_take(b_qx + b_f * (amx ? 3 : 2) + b_xs + b_flag + b_lv + b_rec, &fresh);
    if (!buf) return -1;
    int8_t *qx = (int8_t *)buf;
    float *dx = (float *)(buf + b_qx), *sx = (float *)(buf + b_qx + b_f);
    int32_t *xs = need_xs ? (int32_t *)(buf + b_qx + 2 * b_f) : NULL;
    uint8_t *flag = one_level ? (uint8_t *)(buf + b_qx + 2 * b_f + b_xs) : NULL;
    int32_t *lv = one_level ? (int32_t *)(buf + b_qx + 2 * b_f + b_xs + b_flag) : NULL;
    float *dxs = amx ? (float *)(buf + b_qx + 2 * b_f + b_xs + b_flag + b_lv) : NULL; /* AMX's epilogue: dx / 256 */
    memset(dx, 0, 2 * b_f); /* dx, sx */
    if (xs) memset(xs, 0, b_xs);
    if (dxs) memset(dxs, 0, b_f);
    if (Mp > M) memset(qx + 2 * M * K, 0, (size_t)(2 * (Mp - M) * K));
    kvq_args a = form;
    a.qx = qx, a.dx = dx, a.sx = sx, a.xs = xs, a.dxs = dxs, a.flag = flag, a.lv = lv;
    a.rec = recs ? (const struct one_rec *)(buf + b_qx + b_f * (amx ? 3 : 2) + b_xs + b_flag + b_lv) : NULL;
    int failed = 0;
    /* below ~64k weights a second thread costs more to wake than it saves */
    const int nt = N * K < (1 << 16) ? 1 : nthreads;
#ifdef ONE_LEVEL_512
    /* a decode row at one level: each thread's pairs of groups in two streams far apart (one_level_two16) */
    const int64_t npairs = (N / 8) % 2 == 0 ? N / 16 : 0, half = npairs / 2;
    const int two = !amx && one_level && M == 1 && npairs >= 4;
    const two_fn one8 = NULL; /* (one level takes the pairs above) */
#else
    const int two = 0;
#ifdef KVQ_AVX2
    const two_fn one8 = one_level_two8; /* builds without the 16-column loop (AVX2) */
#endif
#endif
    /* the same by groups of 8: a form's two-level loops (FORM_TWO_FNS), or the 8-column one-level loop's, with the
     * loop for an odd group count's last group alone */
    const int form_index = form_of(&a, bits);
#ifdef KVQ_AVX2
    const two_fn two8 = !amx && M == 1 && N / 8 >= 8 ? (one_level ? one8 : FORM_TWO_FNS[form_index]) : NULL;
    const tiles_fn last8 = one_level ? tiles_q4_one : FORM_TILES_FNS[form_index];
#else
    const two_fn two8 = NULL;
    const tiles_fn last8 = FORM_TILES_FNS[form_index];
#endif
    const int64_t ngroups = N / 8, ghalf = ngroups / 2;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            quantize_row(x + m * K, K, qx + 2 * m * K, dx + m * nb, sx + m * nb, xs ? xs + 2 * m * nb : NULL,
                         one_level ? IG_OUTLIER : 0.0f, offset, flag ? flag + m * nb : NULL, lv ? lv + 2 * m * nb : NULL);
            for (int64_t b = 0; dxs && b < nb; b++) dxs[m * nb + b] = dx[m * nb + b] / 256.0f;
#ifdef ONE_LEVEL_512
            if (a.rec) fill_recs(&a, m);
#endif
        }
        if (amx) { /* (after the loop's implicit barrier: x is quantized) */
#ifdef KVQ_AMX
            if (amx_linear(&a, bits) != 0) {
#pragma omp atomic write
                failed = 1;
            }
#endif
        } else if (two) {
#ifdef ONE_LEVEL_512
#pragma omp for schedule(static)
            for (int64_t p = 0; p < half + npairs % 2; p++) {
                if (p < half)
                    one_level_two16(&a, 2 * p, 2 * (p + half));
                else /* an odd pair count's last pair alone */
                    tiles_q4_one16(&a, 2 * (npairs - 1), 2 * npairs, 0, 1);
            }
#endif
        } else if (two8) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < ghalf + ngroups % 2; p++) {
                if (p < ghalf)
                    two8(&a, p, p + ghalf);
                else /* an odd group count's last group alone */
                    last8(&a, ngroups - 1, ngroups, 0, 1);
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < ntiles; t++) gemm_tile(&a, bits, t);
        }
    }
    scratch_give(buf, fresh);
    return failed ? -1 : 0;
}

/* Codes [N, K] (uint8 below 2^bits; int8 for bits 8, as bytes) into the layout above, [N / 8, K / 32,
 * block_bytes]: what pack_x8 in cpu_int8dot.py writes (its reference), ~100x faster at load. */
void kvq_pack(const uint8_t *q, int64_t N, int64_t K, int bits, uint8_t *out, int nthreads) {
    const int64_t nb = K / QK, bb = block_bytes(bits);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (g * nb + b) * bb;
            memset(o, 0, (size_t)bb);
            for (int j = 0; j < 8; j++) {
                const uint8_t *row = q + (8 * g + j) * K + QK * b;
                for (int s = 0; s < 8; s++)
                    for (int t = 0; t < 4; t++) {
                        const uint8_t c = row[4 * s + t];
                        const int p = 4 * j + t;
                        if (bits == 8) {
                            o[32 * s + p] = c;
                            continue;
                        }
                        o[32 * (s & 3) + p] |= (uint8_t)(s < 4 ? (c & 15) : (c & 15) << 4);
                        if (bits == 5) /* (bits 4 has no high bits: nothing past its 128 bytes) */
                            o[128 + p] |= (uint8_t)(((c >> 4) & 1) << s);
                        else if (bits == 6)
                            o[128 + 32 * (s / 4) + p] |= (uint8_t)(((c >> 4) & 3) << (2 * (s % 4)));
                    }
            }
        }
}

#ifdef KVQ_AVX2
/* v with bits 4.. of each byte set from a word of high bits: byte t of (word >> shifts[s]) & mask, s the 32-bit lane. */
static inline __m128i or_high(__m128i v, int32_t word, __m128i shifts, __m128i mask) {
    return _mm_or_si128(v, _mm_slli_epi16(_mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(word), shifts), mask), 4));
}

/* The 32 codes of row j (of its group of 8) in block blk, in k order, as bytes: k 0..15 in *lo, 16..31 in
 * *hi (code_at's vector form). Step s holds the row's 4 bytes at 32 s + 4 j: the low nibbles of steps 0-3
 * are k 0..15, their high nibbles k 16..31; 5/6-bit high bits are moved in with 32-bit variable shifts
 * (byte t of a shifted word keeps bit s of byte t in its bit 0). */
static inline __attribute__((always_inline)) void block_codes(const uint8_t *codes, const int bits, int64_t blk,
                                                              int64_t j, __m128i *lo, __m128i *hi) {
    if (bits == 8) {
        const uint8_t *c = codes + blk * 256 + 4 * j;
        *lo = _mm_setr_epi32(load32(c), load32(c + 32), load32(c + 64), load32(c + 96));
        *hi = _mm_setr_epi32(load32(c + 128), load32(c + 160), load32(c + 192), load32(c + 224));
        return;
    }
    const uint8_t *c = codes + blk * block_bytes(bits) + 4 * j;
    const __m128i v = _mm_setr_epi32(load32(c), load32(c + 32), load32(c + 64), load32(c + 96)), m4 = _mm_set1_epi8(0x0F);
    __m128i l = _mm_and_si128(v, m4), h = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    if (bits == 5) {
        const __m128i one = _mm_set1_epi8(1);
        l = or_high(l, load32(c + 128), _mm_setr_epi32(0, 1, 2, 3), one);
        h = or_high(h, load32(c + 128), _mm_setr_epi32(4, 5, 6, 7), one);
    } else if (bits == 6) {
        const __m128i sh = _mm_setr_epi32(0, 2, 4, 6), three = _mm_set1_epi8(3);
        l = or_high(l, load32(c + 128), sh, three);
        h = or_high(h, load32(c + 160), sh, three);
    }
    *lo = l, *hi = h;
}

/* 8 codes (bytes) as floats less the offset: signed for 8-bit codes. */
static inline __m256 codes8_ps(__m128i b, const int bits, int offset) {
    const __m256i q = bits == 8 ? _mm256_cvtepi8_epi32(b) : _mm256_sub_epi32(_mm256_cvtepu8_epi32(b), _mm256_set1_epi32(offset));
    return _mm256_cvtepi32_ps(q);
}

/* 16 floats as bf16, rounded to nearest even as the scalar loop below does (bit for bit). */
static inline __m256i bf16_bits8(__m256 a) {
    const __m256i u = _mm256_castps_si256(a);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
}

static inline void store_bf16x16(uint16_t *out, __m256 a, __m256 b) {
    _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits8(a), bf16_bits8(b)), 0xD8));
}

/* Row n of the weight (kvq_dequant's vector form for groups of 16 or a multiple of 32): per block its
 * group values once (two for groups of 16: k 0..15 and 16..31), the 32 codes unpacked together, then
 * d q + m in the same two roundings as the scalar loop. */
static void dequant_row(const uint8_t *codes, const int bits, int offset, const kvq_groups *sc, const kvq_groups *mn,
                        int64_t G, int64_t K, int64_t n, float *out32, uint16_t *out16) {
    const int64_t nb = K / QK, ng = K / G, g = n / 8, j = n % 8;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t gr0 = group_of(b, 0, G), gr1 = group_of(b, 4, G);
        const __m256 d0 = _mm256_set1_ps(group_value(sc, sc, n, gr0, ng));
        const __m256 d1 = gr1 == gr0 ? d0 : _mm256_set1_ps(group_value(sc, sc, n, gr1, ng));
        const __m256 m0 = _mm256_set1_ps(mn->kind ? group_value(mn, sc, n, gr0, ng) : 0.0f);
        const __m256 m1 = gr1 == gr0 ? m0 : _mm256_set1_ps(mn->kind ? group_value(mn, sc, n, gr1, ng) : 0.0f);
        __m128i lo, hi;
        block_codes(codes, bits, g * nb + b, j, &lo, &hi);
        const __m256 w0 = _mm256_add_ps(_mm256_mul_ps(d0, codes8_ps(lo, bits, offset)), m0);
        const __m256 w1 = _mm256_add_ps(_mm256_mul_ps(d0, codes8_ps(_mm_srli_si128(lo, 8), bits, offset)), m0);
        const __m256 w2 = _mm256_add_ps(_mm256_mul_ps(d1, codes8_ps(hi, bits, offset)), m1);
        const __m256 w3 = _mm256_add_ps(_mm256_mul_ps(d1, codes8_ps(_mm_srli_si128(hi, 8), bits, offset)), m1);
        if (out32) {
            float *o = out32 + b * QK;
            _mm256_storeu_ps(o, w0), _mm256_storeu_ps(o + 8, w1), _mm256_storeu_ps(o + 16, w2), _mm256_storeu_ps(o + 24, w3);
        } else {
            store_bf16x16(out16 + b * QK, w0, w1);
            store_bf16x16(out16 + b * QK + 16, w2, w3);
        }
    }
}
#endif

/* The weight itself, w = d (q - offset) + m, as fp32 or (round to nearest even) bf16 [N, K] in plain row order: the
 * read-back that calls with many rows run through a plain GEMM. Rows n0 .. n0 + rows of the weight. AVX2
 * builds take dequant_row for groups of 16 or a multiple of 32 (every form gemm_tile has a loop for):
 * 3.6-7x the scalar loop (by form, on a 2048 x 8192 weight), which was 40-50 % of a 256-row prefill chunk's linear time on a 1B shape. */
void kvq_dequant(const uint8_t *codes, int bits, int offset, int scale_kind, const void *scale, const uint16_t *scale_sup,
                 int64_t scale_per, int min_kind, const void *mins, const uint16_t *min_sup, int64_t min_per, int64_t G,
                 int64_t K, int64_t n0, int64_t rows, float *out32, uint16_t *out16, int nthreads) {
    const kvq_groups sc = groups_of(scale_kind, scale, scale_sup, scale_per), mn = groups_of(min_kind, mins, min_sup, min_per);
    const int64_t nb = K / QK, ng = K / G;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t i = 0; i < rows; i++) {
        const int64_t n = n0 + i, g = n / 8, j = n % 8;
#ifdef KVQ_AVX2
        if (G == 16 || G % QK == 0) {
            dequant_row(codes, bits, bits == 8 ? 0 : offset, &sc, &mn, G, K, n, out32 ? out32 + i * K : NULL,
                        out32 ? NULL : out16 + i * K);
            continue;
        }
#endif
        float row[QK];
        for (int64_t b = 0; b < nb; b++) {
            for (int s = 0; s < 8; s++) {
                const int64_t gr = group_of(b, s, G);
                const float d = group_value(&sc, &sc, n, gr, ng), m = mn.kind ? group_value(&mn, &sc, n, gr, ng) : 0.0f;
                for (int t = 0; t < 4; t++) {
                    const int32_t q = code_at(codes, bits, g * nb + b, s, (int)(4 * j + t)) - (bits == 8 ? 0 : offset);
                    row[4 * s + t] = d * (float)q + m;
                }
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

/* ---- many rows: an fp32 GEMM over weight panels dequantized on the fly (AVX2 + FMA) ---------------
 * Where bf16 dot products are emulated (AVX2), the integer kernel's two activation levels cost as much
 * as an fp32 GEMM (two maddubs per 4 products; scripts/probe_int8_throughput.py), so calls with many
 * rows (prefill chunks) run an fp32 GEMM instead. Rather than reading the whole weight back to fp32 for
 * a library GEMM (a transient as large as the dense weight, written and read again), each thread
 * dequantizes a panel of 16 weight rows x KC k (16 KB, L2) into [k][16] order and multiplies it with a
 * 6 x 16 register tile (12 FMA accumulators, the BLIS Haswell shape). The weights are exact (w = d q + m
 * in fp32, as the read-back); each output element sums its k in one fixed order, whatever M and the
 * thread count. */
#ifdef KVQ_AVX2
#define GEMM_MR 6
#define GEMM_NR 16
#define GEMM_KC 256
#define GEMM_PB 4 /* panels (of 16 rows) per work item */

/* Rows 8g .. 8g + 7 of the weight at k in [k0, k0 + kc) (whole blocks) into out[k - k0][0..7] (row
 * stride GEMM_NR floats). Codes of a block: 4-bit chunk c / 8-bit step s holds, for lane j (row 8g + j),
 * 4 consecutive k; a byte shuffle puts the same k of the 8 rows side by side. */
static void pack_rows8(const kvq_args *a, const int bits, int64_t g, int64_t k0, int64_t kc, float *out) {
    const int64_t nb = a->K / QK, ng = a->K / a->G;
    /* per 128-bit lane: bytes (row j, t) -> (t, row j) for the lane's 4 rows */
    const __m256i tr = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                        0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* dword t of both lanes side by side */
    for (int64_t b = k0 / QK; b < (k0 + kc) / QK; b++) {
        float *ob = out + (b * QK - k0) * GEMM_NR;
        for (int s = 0; s < 8; s++) { /* step s: k = 32 b + 4 s + t */
            const int64_t gr = group_of(b, s, a->G);
            const __m256 dw = groups8(&a->scale, _mm256_setzero_ps(), g, gr, ng);
            const __m256 mw = a->mins.kind ? groups8(&a->mins, dw, g, gr, ng) : _mm256_setzero_ps();
            __m256i v;
            if (bits == 4 || bits == 5 || bits == 6) {
                const uint8_t *cb = a->codes + (g * nb + b) * block_bytes(bits);
                const __m256i c = _mm256_loadu_si256((const __m256i *)(cb + 32 * (s & 3)));
                v = _mm256_and_si256(s < 4 ? c : _mm256_srli_epi16(c, 4), _mm256_set1_epi8(0x0F));
                if (bits != 4) v = high_bits(v, cb + 128, bits, s);
            } else {
                v = _mm256_loadu_si256((const __m256i *)((const int8_t *)a->codes + (g * nb + b) * 256 + 32 * s));
            }
            v = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, tr), perm);
            for (int t = 0; t < 4; t++) {
                const __m128i q8 = _mm_cvtsi64_si128(t == 0 ? _mm256_extract_epi64(v, 0) : t == 1 ? _mm256_extract_epi64(v, 1)
                                                     : t == 2 ? _mm256_extract_epi64(v, 2) : _mm256_extract_epi64(v, 3));
                const __m256i qi = bits == 8 ? _mm256_cvtepi8_epi32(q8)
                                   : a->offset ? _mm256_sub_epi32(_mm256_cvtepu8_epi32(q8), _mm256_set1_epi32(a->offset))
                                               : _mm256_cvtepu8_epi32(q8);
                /* d q + m: the same two fp32 roundings as the read-back (kvq_dequant) */
                const __m256 w = _mm256_add_ps(_mm256_mul_ps(dw, _mm256_cvtepi32_ps(qi)), mw);
                _mm256_storeu_ps(ob + (4 * s + t) * GEMM_NR, w);
            }
        }
    }
}

static inline __attribute__((always_inline)) void gemm_micro(const int R, const int NV, const float *x, int64_t ldx,
                                                             const float *bp, int64_t kc, float *y, int64_t ldy,
                                                             const int first) {
    __m256 c0[GEMM_MR], c1[GEMM_MR];
    for (int r = 0; r < R; r++) c0[r] = c1[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_loadu_ps(bp + k * GEMM_NR);
        const __m256 b1 = NV == 2 ? _mm256_loadu_ps(bp + k * GEMM_NR + 8) : b0;
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            c0[r] = _mm256_fmadd_ps(xv, b0, c0[r]);
            if (NV == 2) c1[r] = _mm256_fmadd_ps(xv, b1, c1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float *yr = y + r * ldy;
        _mm256_storeu_ps(yr, first ? c0[r] : _mm256_add_ps(_mm256_loadu_ps(yr), c0[r]));
        if (NV == 2) _mm256_storeu_ps(yr + 8, first ? c1[r] : _mm256_add_ps(_mm256_loadu_ps(yr + 8), c1[r]));
    }
}

#define MICRO_CASES(NV)                                                     \
    switch (R) {                                                            \
    case 6: gemm_micro(6, NV, xr, a->K, bp, kc, yr, a->ldy, first); break;  \
    case 5: gemm_micro(5, NV, xr, a->K, bp, kc, yr, a->ldy, first); break;  \
    case 4: gemm_micro(4, NV, xr, a->K, bp, kc, yr, a->ldy, first); break;  \
    case 3: gemm_micro(3, NV, xr, a->K, bp, kc, yr, a->ldy, first); break;  \
    case 2: gemm_micro(2, NV, xr, a->K, bp, kc, yr, a->ldy, first); break;  \
    default: gemm_micro(1, NV, xr, a->K, bp, kc, yr, a->ldy, first);        \
    }

/* y [M, N] (row stride ldy) = x [M, K] @ W^T in fp32. Returns 0, -1 out of memory, -2 not built for this
 * ISA (the caller reads the weight back instead). */
int kvq_gemm_f32(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, int offset, int scale_kind,
                 const void *scale, const uint16_t *scale_sup, int64_t scale_per, int min_kind, const void *mins,
                 const uint16_t *min_sup, int64_t min_per, int64_t G, int64_t N, float *y, int64_t ldy, int nthreads) {
    const kvq_args a0 = {NULL, NULL, NULL, NULL, codes, groups_of(scale_kind, scale, scale_sup, scale_per), groups_of(min_kind, mins, min_sup, min_per),
                         M, K, N, G, y, ldy, offset};
    const kvq_args *a = &a0;
    const int64_t npanels = (N / 8 + 1) / 2, nitems = (npanels + GEMM_PB - 1) / GEMM_PB;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *buf = (float *)aligned_alloc(64, sizeof(float) * GEMM_KC * GEMM_NR * GEMM_PB);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < nitems; item++) {
            if (!buf) continue;
            const int64_t p0 = item * GEMM_PB, p1 = p0 + GEMM_PB < npanels ? p0 + GEMM_PB : npanels;
            for (int64_t k0 = 0; k0 < K; k0 += GEMM_KC) {
                const int64_t kc = K - k0 < GEMM_KC ? K - k0 : GEMM_KC;
                const int first = k0 == 0;
                for (int64_t p = p0; p < p1; p++) {
                    float *bp = buf + (p - p0) * GEMM_KC * GEMM_NR;
                    pack_rows8(a, bits, 2 * p, k0, kc, bp);
                    if (2 * p + 1 < N / 8) pack_rows8(a, bits, 2 * p + 1, k0, kc, bp + 8);
                }
                for (int64_t m0 = 0; m0 < M; m0 += GEMM_MR) {
                    const int R = (int)(M - m0 < GEMM_MR ? M - m0 : GEMM_MR);
                    const float *xr = x + m0 * K + k0;
                    for (int64_t p = p0; p < p1; p++) {
                        const float *bp = buf + (p - p0) * GEMM_KC * GEMM_NR;
                        float *yr = y + m0 * ldy + 16 * p;
                        if (2 * p + 1 < N / 8) {
                            MICRO_CASES(2)
                        } else {
                            MICRO_CASES(1)
                        }
                    }
                }
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
#else
KVQ_GEMM_ABSENT(kvq_gemm_f32)
#endif

/* ---- many rows on AMX-BF16: a bf16 GEMM over weight panels dequantized on the fly ---------------------
 * Where the CPU has AMX, calls with many rows (prefill chunks) multiply in bf16 on the tiles (tdpbf16ps, fp32
 * sums) instead of reading the whole weight back to bf16 for torch's GEMM (a transient as large as the dense
 * weight, written, then re-packed by oneDNN). Each thread takes a range of panels of 32 weight rows; per KC k
 * it dequantizes BG_PB of them (pack_rows8: w = d q + m in fp32, the read-back's roundings; then to bf16,
 * round to nearest even as kvq_dequant) into the tiles' pair-interleaved order, [k / 2][16 columns][2], and
 * runs every 32 rows of x past them: 2 x 2 tiles of 16 rows x 16 columns (C 0-3, x 4-5, weights 6-7), the
 * sums kept in a per-thread buffer between KC steps. BG_KC / BG_PB: 256 / 4 (KC 256-2048, PB 2-8 were within
 * the run-to-run spread of per-linear timings on the 1B shape at 512 rows, 2-core Xeon, 2026-12-05, ad hoc). x is converted to bf16 once (round to nearest even: torch's
 * x.to(torch.bfloat16)). So the numbers are those of the read-back route (bf16 weights, bf16 activations, fp32
 * sums), in another order of summation; each output's k order is fixed whatever M and the thread count. */
#ifdef KVQ_AMX
#ifndef BG_KC
#define BG_KC 256
#endif
#ifndef BG_PB
#define BG_PB 4
#endif

static int amx_granted = 0; /* 0: not asked yet; else amx_request's answer for AMX-BF16 */

/* 1 where the CPU has AMX-BF16 and Linux grants the tile state (asked once per process), else 0. */
static int amx_bf16_permit(void) {
    if (!amx_granted) amx_granted = amx_request(AMX_TILE_BIT | AMX_BF16_BIT);
    return amx_granted == 1;
}

/* 16 floats (as their bits) rounded to bf16, nearest even (kvq_dequant's rule), still in the high halves. */
static inline __m512i bf16_round16(__m512i u) {
    return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
}

/* Lane c = (bf16 of u0[c], bf16 of u1[c]): a tile row of 16 columns' (k, k + 1) pairs. */
static inline __m512i bf16_pairs16(__m512i u0, __m512i u1) {
    return _mm512_or_si512(_mm512_srli_epi32(bf16_round16(u0), 16),
                           _mm512_and_si512(bf16_round16(u1), _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* fp32 [kc][16] (row stride 16) -> bf16 pairs [kc / 2][16][2]. */
static inline void bg_pairs(const float *in, int64_t kc, uint32_t *out) {
    for (int64_t r = 0; r < kc / 2; r++)
        _mm512_store_si512(out + 16 * r, bf16_pairs16(_mm512_loadu_si512(in + 2 * r * 16), _mm512_loadu_si512(in + (2 * r + 1) * 16)));
}

/* bg_pack for the forms the int8 tiles read (4-bit codes, Q8_0; groups of a multiple of 32): each block's codes
 * of 16 weight rows as amx_unpack_b lays them out (k quads x 16 columns x 4, less the offset, as int8), then per
 * k quad its four k as fp32, d q + m (pack_rows8's two roundings), paired to bf16 in registers. ~3x pack_rows8 +
 * bg_pairs (ad hoc, 2-core Xeon, 2026-12-05). */
static void bg_pack_tiles(const kvq_args *a, const int bits, int64_t q, int64_t k0, int64_t kc, uint32_t *out) {
    uint8_t codes[512] __attribute__((aligned(64)));
    const int64_t ng = a->K / a->G;
    for (int h = 0; h < 2; h++) {
        const int64_t p = 2 * q + h; /* 16 weight rows: the groups of 8 2p, 2p + 1 */
        uint32_t *o = out + h * kc * 8;
        if (2 * p >= a->N / 8) {
            memset(o, 0, (size_t)kc * 8 * sizeof(uint32_t));
            continue;
        }
        const int two = 2 * p + 1 < a->N / 8;
        for (int64_t b = k0 / QK; b < (k0 + kc) / QK; b++) {
            amx_unpack_b(a, bits, p, b, two, codes);
            const int64_t gr = group_of(b, 0, a->G); /* one group per block (G a multiple of 32) */
            const __m512 dw = groups16(&a->scale, _mm512_setzero_ps(), p, gr, ng, two);
            const __m512 mw = a->mins.kind ? groups16(&a->mins, dw, p, gr, ng, two) : _mm512_setzero_ps();
            uint32_t *ob = o + (b * QK - k0) / 2 * 16;
            for (int s = 0; s < 8; s++) { /* k = 32 b + 4 s + t */
                const __m512i v = _mm512_load_si512(codes + 64 * s);
                __m512i w[4];
                for (int t = 0; t < 4; t++) {
                    const __m512i c = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * t), 24);
                    w[t] = _mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(dw, _mm512_cvtepi32_ps(c)), mw));
                }
                _mm512_store_si512(ob + (2 * s) * 16, bf16_pairs16(w[0], w[1]));
                _mm512_store_si512(ob + (2 * s + 1) * 16, bf16_pairs16(w[2], w[3]));
            }
        }
    }
}

/* Panel q (weight rows 32 q .. 32 q + 31; absent rows past N as zeros) at k0 .. k0 + kc into `out`: two tiles'
 * worth of pairs, columns 0-15 then 16-31, each [kc / 2][16][2]. */
static void bg_pack(const kvq_args *a, const int bits, int64_t q, int64_t k0, int64_t kc, float *tmp, uint32_t *out) {
    if (amx_form_ok(a, bits)) {
        bg_pack_tiles(a, bits, q, k0, kc, out);
        return;
    }
    for (int h = 0; h < 2; h++) {
        for (int j = 0; j < 2; j++) {
            const int64_t g = 4 * q + 2 * h + j;
            if (g < a->N / 8) {
                pack_rows8(a, bits, g, k0, kc, tmp + 8 * j);
            } else {
                for (int64_t k = 0; k < kc; k++) memset(tmp + k * 16 + 8 * j, 0, 8 * sizeof(float));
            }
        }
        bg_pairs(tmp, kc, out + h * kc * 8);
    }
}

/* Tiles: 0-3 C (16 rows x 16 fp32), 4-5 x (rows x 32 bf16), 6-7 weights (16 pairs x 16 columns); `rows` rows
 * of x and C in the first x tile and its two C tiles (a last, shorter tile of x). */
__attribute__((target("amx-tile"))) static void bg_configure(int rows) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)rows;
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* C[32 rows][32 cols] (TWO = 1) or C[rows][32] (TWO = 0, tiles 0 / 1 / 4 as configured) += x[.., k0 .. k0 + kc]
 * W^T over one packed panel; C read from c (row stride ldc floats; zero when first) and stored to o (row stride
 * ldo: c itself, or y at the last k). */
__attribute__((target("amx-tile,amx-bf16"), always_inline)) static inline void bg_micro(const int TWO, const uint16_t *x, int64_t ldx,
                                                                         const uint32_t *bp, int64_t kc, const float *c,
                                                                         int64_t ldc, int first, float *o, int64_t ldo) {
    const uint32_t *b1 = bp + kc * 8;
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        if (TWO) {
            _tile_zero(2);
            _tile_zero(3);
        }
    } else {
        _tile_loadd(0, c, 4 * ldc);
        _tile_loadd(1, c + 16, 4 * ldc);
        if (TWO) {
            _tile_loadd(2, c + 16 * ldc, 4 * ldc);
            _tile_loadd(3, c + 16 * ldc + 16, 4 * ldc);
        }
    }
    for (int64_t s = 0; s < kc / 32; s++) {
        _tile_loadd(4, x + 32 * s, 2 * ldx);
        _tile_loadd(6, bp + 256 * s, 64);
        _tile_loadd(7, b1 + 256 * s, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (TWO) {
            _tile_loadd(5, x + 16 * ldx + 32 * s, 2 * ldx);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, o, 4 * ldo);
    _tile_stored(1, o + 16, 4 * ldo);
    if (TWO) {
        _tile_stored(2, o + 16 * ldo, 4 * ldo);
        _tile_stored(3, o + 16 * ldo + 16, 4 * ldo);
    }
}

/* One thread's panels q0 .. q1 - 1 of y = x W^T. xb: x in bf16 in blocks of BG_KC k, [K / BG_KC][M][kc] (the
 * block at k0 holds rows of kc = min(BG_KC, K - k0) values at xb + k0 M). The sums of a work item's panels stay in
 * `cbuf` ([M][BG_PB x 32] fp32) until its last k, then go to y. Both operands and the sums are read with short
 * strides: rows of y or x a power-of-two KiB apart (N = 8192 floats, K = 2048 bf16) fell into a few cache sets. */
__attribute__((target("amx-tile,amx-bf16"))) static void bg_panels(const kvq_args *a, const int bits, const uint16_t *xb,
                                                                   int64_t q0, int64_t q1, float *tmp, uint32_t *packed,
                                                                   float *cbuf) {
    const int64_t M = a->M, K = a->K, full = M / 16 * 16, ldc = BG_PB * 32;
    for (int64_t i0 = q0; i0 < q1; i0 += BG_PB) {
        const int64_t i1 = i0 + BG_PB < q1 ? i0 + BG_PB : q1;
        for (int64_t k0 = 0; k0 < K; k0 += BG_KC) {
            const int64_t kc = K - k0 < BG_KC ? K - k0 : BG_KC;
            const uint16_t *xk = xb + k0 * M;
            const int first = k0 == 0, last = k0 + kc == K;
            for (int64_t q = i0; q < i1; q++) bg_pack(a, bits, q, k0, kc, tmp, packed + (q - i0) * kc * 16);
            for (int64_t m0 = 0; m0 < M; m0 += 32) { /* x's 32 rows stay in L1 while the panels pass */
                const int64_t rows = M - m0 < 32 ? M - m0 : 32;
                if (m0 == 0 || rows < 32) bg_configure(rows < 16 ? (int)rows : 16); /* a short tail: its own shape */
                for (int64_t q = i0; q < i1; q++) {
                    const uint32_t *bp = packed + (q - i0) * kc * 16;
                    float *c = cbuf + m0 * ldc + 32 * (q - i0);
                    /* the last k's sums go straight to y where the panel's 32 columns are all in it */
                    const int direct = last && 32 * (q + 1) <= a->N;
                    float *o = direct ? a->y + m0 * a->ldy + 32 * q : c;
                    const int64_t ldo = direct ? a->ldy : ldc;
                    if (rows == 32)
                        bg_micro(1, xk + m0 * kc, kc, bp, kc, c, ldc, first, o, ldo);
                    else if (rows <= 16)
                        bg_micro(0, xk + m0 * kc, kc, bp, kc, c, ldc, first, o, ldo);
                    else { /* 17-31 rows: a full 16-row tile, then the rest */
                        bg_micro(0, xk + m0 * kc, kc, bp, kc, c, ldc, first, o, ldo);
                        bg_configure((int)(rows - 16));
                        bg_micro(0, xk + (m0 + 16) * kc, kc, bp, kc, c + 16 * ldc, ldc, first, o + 16 * ldo, ldo);
                        bg_configure(16);
                    }
                }
            }
        }
        if (32 * i1 > a->N) /* the last panel reaches past N: its columns within N from cbuf */
            for (int64_t m = 0; m < M; m++)
                memcpy(a->y + m * a->ldy + 32 * (i1 - 1), cbuf + m * ldc + 32 * (i1 - 1 - i0),
                       (size_t)(a->N - 32 * (i1 - 1)) * sizeof(float));
    }
    _tile_release();
}

/* Row m of x (fp32, K) into xb's k blocks (bg_panels), as bf16 rounded to nearest even. */
static void bg_row_to_bf16(const float *x, int64_t M, int64_t K, int64_t m, uint16_t *xb) {
    for (int64_t k0 = 0; k0 < K; k0 += BG_KC) {
        const int64_t kc = K - k0 < BG_KC ? K - k0 : BG_KC;
        uint16_t *out = xb + k0 * M + m * kc;
        for (int64_t i = 0; i < kc; i += 16) { /* kc is a multiple of 32 */
            const __m512i r = bf16_round16(_mm512_loadu_si512(x + m * K + k0 + i));
            _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
        }
    }
}

/* y [M, N] (row stride ldy) = x [M, K] @ W^T with bf16 products on AMX tiles (K a multiple of 32). Returns 0,
 * -1 out of memory, -2 where the CPU or Linux give no AMX-BF16 (the caller reads the weight back instead),
 * -3 for a form pack_rows8 has no loop for. */
int kvq_gemm_bf16(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, int offset, int scale_kind,
                  const void *scale, const uint16_t *scale_sup, int64_t scale_per, int min_kind, const void *mins,
                  const uint16_t *min_sup, int64_t min_per, int64_t G, int64_t N, float *y, int64_t ldy, int nthreads) {
    const kvq_args a = {NULL, NULL, NULL, NULL, codes, groups_of(scale_kind, scale, scale_sup, scale_per),
                        groups_of(min_kind, mins, min_sup, min_per), M, K, N, G, y, ldy, offset};
    if (!form_ok(&a, bits) || K % QK != 0) return -3;
    if (!amx_bf16_permit()) return -2;
    uint16_t *xb = (uint16_t *)aligned_alloc(64, (size_t)(2 * M * K + 64));
    if (!xb) return -1;
    const int64_t npanels = (N + 31) / 32;
    const int nt = npanels < nthreads ? (int)npanels : nthreads;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) bg_row_to_bf16(x, M, K, m, xb);
        float *tmp = (float *)aligned_alloc(64, sizeof(float) * BG_KC * 16);
        uint32_t *packed = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * BG_KC * 16 * BG_PB);
        float *cbuf = (float *)aligned_alloc(64, sizeof(float) * (size_t)(M * BG_PB * 32));
        if (!tmp || !packed || !cbuf) {
#pragma omp atomic write
            failed = 1;
        } else {
            bg_panels(&a, bits, xb, npanels * t / n, npanels * (t + 1) / n, tmp, packed, cbuf);
        }
        free(tmp), free(packed), free(cbuf);
    }
    free(xb);
    return failed ? -1 : 0;
}
#else
KVQ_GEMM_ABSENT(kvq_gemm_bf16)
#endif

/* ---- many rows: int8 activations of one level, a second level only in outlier blocks -----------------
 * Prefill chunks on CPUs without AMX: llama.cpp's rounding of the activations (one int8 level per block of
 * 32, its Q8 form) lets the integer dot product run at its full rate (AVX-512-VNNI: 64 products an
 * instruction, twice bf16's), where the two levels of kvq_linear issue two products per multiply-add and the
 * float GEMMs run at the float rate. One level alone loses precision in blocks that hold an outlier channel:
 * their step, max|x| / 127, swamps the block's other values. So a block whose max|x| exceeds IG_OUTLIER times
 * its row's RMS keeps the second level (x ~ d (q1 + q2 / 256), as kvq_linear). The rule reads the row alone,
 * so a row's result does not depend on the rows beside it: a tile runs the second pass where any of its rows
 * needs it, and a row without the level adds exact zeros. Mins multiply the rounded x's sum, as the codes do
 * (llama.cpp's Q8_1 sum): the codes' mean (7.5 at 4 bits) times the block's rounding errors cancels against it.
 * Measured on the bundled model, teacher-forced over 1,024 positions (960 prefilled in chunks of 320), against
 * transformers' fp32 on the same weights (an ad hoc probe like tests/test_vs_transformers.py's agreement test,
 * AMD EPYC, 2026-12-06): top-1 agreement / largest / median logit error
 *   bf16 weights and activations (the read-back route this replaces)  0.994 / 0.50 / 0.13
 *   one level everywhere                                              0.976 / 1.47 / 0.45
 *   IG_OUTLIER 8                                                      0.985 / 1.64 / 0.26
 *   IG_OUTLIER 4 (kept)                                               0.992 / 0.70 / 0.17
 *   two levels everywhere (kvq_linear, below 256 rows)                1.000 / 0.04 / 0.01
 * 4-bit codes only (maddubs' 16-bit pair sums of 8 steps stay below 2^15 at 4 bits: 16 x 15 x 127).
 *
 * Each thread takes panels of IG_W weight rows; per IG_KC k it unpacks IG_PB of them from the x8 layout
 * (bytes [block][step][IG_W][4]: a step's vector holds 4 k of each column, the dot product's order) with their
 * scales and mins as fp32, and runs every IG_MR rows of x past IG_NP panels in registers: int32 sums per block
 * (8 steps), then y += (sum - offset sum(q)) d_w d_x (+ m_w d_x sum(q)) in fp32; the second level's sums go to
 * their own accumulators, added once per IG_KC. Each output's k order is fixed whatever M and the thread count.
 * IG_KC 2048, IG_PB 1: y is read and written once per 2,048 k (at 256 the 1B shape's 32 MB gate/up output went
 * through memory 8 times a call: 0.23 -> 0.29 TMAC/s at 512 rows, AMD EPYC, 2026-12-06, ad hoc); IG_MR x IG_NP
 * 6 x 2 on AVX-512 (12 + 12 accumulators), 4 x 2 on AVX2 (4 x 1, 6 x 1 and 3 x 2 were 0.7-0.95x as fast there). */
#ifdef KVQ_AVX2
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define IG_512 1
#define IG_W 16
#ifndef IG_MR
#define IG_MR 6
#endif
#else
#define IG_W 8
#ifndef IG_MR
#define IG_MR 4
#endif
#endif
#ifndef IG_NP
#define IG_NP 2
#endif
#define IG_KC ONE_LEVEL_KC
#define IG_PB 1 /* register tiles (IG_NP panels) per work item */
#ifndef IG_MB_BYTES
#define IG_MB_BYTES (384 << 10)
#endif
typedef struct {
    const int8_t *q;     /* [2, M, K]: level 1, then level 2 (zeros outside flagged blocks); planes apart, so that
                          * the first pass reads K bytes a row, not 2K */
    int64_t plane;       /* M K */
    const float *d;      /* [M, nb] */
    const float *sx;     /* [M, nb]: sums of the rounded x (for mins) */
    const int32_t *s;    /* [M, nb, 2]: offset x sum(level 1), offset x sum(level 2) */
    const uint8_t *flag; /* [M, nb]: the block keeps its second level */
    const int32_t *nflag; /* [M]: blocks of the row that keep it */
    int64_t nb;
} ig_x;

/* Row x (K) into its levels (quantize_row's one-level rounding), split into the two planes. */
static void ig_quantize_row(const float *x, int64_t K, int offset, int8_t *q, int8_t *q1, int8_t *q2, float *d,
                            float *sx, int32_t *s, uint8_t *flag, int32_t *nflag) {
    const int64_t nb = K / QK;
    quantize_row(x, K, q, d, sx, NULL, IG_OUTLIER, offset, flag, s); /* q: [nb, 2, 32] scratch of the row */
    nflag[0] = 0;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *qb = q + 2 * b * QK;
        nflag[0] += flag[b];
        memcpy(q1 + b * QK, qb, QK), memcpy(q2 + b * QK, qb + QK, QK);
    }
}

/* Panel p (weight rows IG_W p ..) for blocks b0 .. b0 + nbc into out ([nbc][8][IG_W][4] codes, then fp32 scales
 * [nbc][IG_W], then mins [nbc][IG_W] where the weight has them). Rows past N: zero codes and scales. */
static void ig_pack(const kvq_args *a, int64_t p, int64_t b0, int64_t nbc, uint8_t *out) {
    const int64_t nb = a->K / QK, ng = a->K / a->G, ngroups = a->N / 8;
    float *dw = (float *)(out + nbc * 8 * IG_W * 4), *mw = dw + nbc * IG_W;
    for (int h = 0; h < IG_W / 8; h++) {
        const int64_t g = p * (IG_W / 8) + h;
        for (int64_t bi = 0; bi < nbc; bi++) {
            const int64_t b = b0 + bi, gr = group_of(b, 0, a->G);
            uint8_t *ob = out + bi * 8 * IG_W * 4 + 32 * h;
            if (g >= ngroups) {
                for (int s = 0; s < 8; s++) memset(ob + s * IG_W * 4, 0, 32);
                memset(dw + bi * IG_W + 8 * h, 0, 32), memset(mw + bi * IG_W + 8 * h, 0, 32);
                continue;
            }
            const uint8_t *cb = a->codes + (g * nb + b) * 128;
            for (int s = 0; s < 8; s++) {
                const __m256i c = _mm256_loadu_si256((const __m256i *)(cb + 32 * (s & 3)));
                _mm256_storeu_si256((__m256i *)(ob + s * IG_W * 4),
                                    _mm256_and_si256(s < 4 ? c : _mm256_srli_epi16(c, 4), _mm256_set1_epi8(0x0F)));
            }
            const __m256 sc = groups8(&a->scale, _mm256_setzero_ps(), g, gr, ng);
            _mm256_storeu_ps(dw + bi * IG_W + 8 * h, sc);
            _mm256_storeu_ps(mw + bi * IG_W + 8 * h, a->mins.kind ? groups8(&a->mins, sc, g, gr, ng) : _mm256_setzero_ps());
        }
    }
}

#ifdef IG_512
typedef __m512i ig_vi;
typedef __m512 ig_vf;
#define IG_LOADW(p) _mm512_loadu_si512((const void *)(p))
#define IG_BCAST(p) _mm512_set1_epi32(load32(p))
#define IG_DOT(acc, w, x) _mm512_dpbusd_epi32((acc), (w), (x))
#define IG_ZERO_I() _mm512_setzero_si512()
#define IG_SUMS(acc) (acc)
#define IG_CVT(v) _mm512_cvtepi32_ps(v)
#define IG_SUB(a, b) _mm512_sub_epi32((a), (b))
#define IG_SET1I(v) _mm512_set1_epi32(v)
#define IG_SET1F(v) _mm512_set1_ps(v)
#define IG_LOADF(p) _mm512_loadu_ps(p)
#define IG_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define IG_MUL(a, b) _mm512_mul_ps((a), (b))
#define IG_ADD(a, b) _mm512_add_ps((a), (b))
#define IG_ZERO_F() _mm512_setzero_ps()
#else /* AVX2: maddubs pair sums (16-bit) summed over a block's 8 steps, widened once per block */
typedef __m256i ig_vi;
typedef __m256 ig_vf;
#define IG_LOADW(p) _mm256_loadu_si256((const __m256i *)(p))
#define IG_BCAST(p) _mm256_set1_epi32(load32(p))
#define IG_DOT(acc, w, x) _mm256_add_epi16((acc), _mm256_maddubs_epi16((w), (x)))
#define IG_ZERO_I() _mm256_setzero_si256()
#define IG_SUMS(acc) _mm256_madd_epi16((acc), _mm256_set1_epi16(1))
#define IG_CVT(v) _mm256_cvtepi32_ps(v)
#define IG_SUB(a, b) _mm256_sub_epi32((a), (b))
#define IG_SET1I(v) _mm256_set1_epi32(v)
#define IG_SET1F(v) _mm256_set1_ps(v)
#define IG_LOADF(p) _mm256_loadu_ps(p)
#define IG_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define IG_MUL(a, b) _mm256_mul_ps((a), (b))
#define IG_ADD(a, b) _mm256_add_ps((a), (b))
#define IG_ZERO_F() _mm256_setzero_ps()
#endif

/* One level's sums of block bi for R rows x NP panels, folded into f: f += (sum - s) d_w d_x (level 2: d_x / 256). */
static inline __attribute__((always_inline)) void ig_level(const int R, const int NP, const ig_x *X, int64_t m0, int64_t b,
                                                           const int lev, const uint8_t *const *wp, const float *const *dwp,
                                                           int64_t bi, ig_vf f[IG_MR][IG_NP]) {
    ig_vi acc[IG_MR][IG_NP];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < NP; p++) acc[r][p] = IG_ZERO_I();
    const int8_t *xq = X->q + lev * X->plane + (m0 * X->nb + b) * QK;
    for (int s = 0; s < 8; s++) {
        ig_vi w[IG_NP];
        for (int p = 0; p < NP; p++) w[p] = IG_LOADW(wp[p] + (bi * 8 + s) * IG_W * 4);
        for (int r = 0; r < R; r++) {
            const ig_vi xv = IG_BCAST(xq + r * X->nb * QK + 4 * s);
            for (int p = 0; p < NP; p++) acc[r][p] = IG_DOT(acc[r][p], w[p], xv);
        }
    }
    for (int r = 0; r < R; r++) {
        const int64_t i = (m0 + r) * X->nb + b;
        const ig_vi t = IG_SET1I(X->s[2 * i + lev]);
        const ig_vf dx = IG_SET1F(lev ? X->d[i] * (1.0f / 256.0f) : X->d[i]);
        for (int p = 0; p < NP; p++)
            f[r][p] = IG_FMA(IG_CVT(IG_SUB(IG_SUMS(acc[r][p]), t)), IG_MUL(IG_LOADF(dwp[p] + bi * IG_W), dx), f[r][p]);
    }
}

/* Rows m0 .. m0 + R of y, columns of NP panels (ncols of them valid), over blocks b0 .. b0 + nbc. */
static inline __attribute__((always_inline)) void ig_micro(const int R, const int NP, const ig_x *X, int64_t m0, int64_t b0,
                                                           int64_t nbc, const uint8_t *const *wp, int mins, float *y,
                                                           int64_t ldy, int first, int ncols) {
    ig_vf f[IG_MR][IG_NP];
    const float *dwp[IG_NP], *mwp[IG_NP];
    for (int p = 0; p < NP; p++) {
        dwp[p] = (const float *)(wp[p] + nbc * 8 * IG_W * 4);
        mwp[p] = dwp[p] + nbc * IG_W;
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < NP; p++) f[r][p] = IG_ZERO_F();
    for (int64_t bi = 0; bi < nbc; bi++) {
        const int64_t b = b0 + bi;
        ig_level(R, NP, X, m0, b, 0, wp, dwp, bi, f);
        if (mins)
            for (int r = 0; r < R; r++) {
                const ig_vf sxv = IG_SET1F(X->sx[(m0 + r) * X->nb + b]);
                for (int p = 0; p < NP; p++) f[r][p] = IG_FMA(IG_LOADF(mwp[p] + bi * IG_W), sxv, f[r][p]);
            }
    }
    /* The second level, in its own pass over the blocks where some row of the tile keeps it (a branch in the
     * loop above cost ~10 % on small K): its sums go to f2, added once; a row without the level adds zeros. */
    int any = 0;
    for (int r = 0; r < R; r++) any |= X->nflag[m0 + r] != 0;
    if (any) {
        ig_vf f2[IG_MR][IG_NP];
        for (int r = 0; r < R; r++)
            for (int p = 0; p < NP; p++) f2[r][p] = IG_ZERO_F();
        for (int64_t bi = 0; bi < nbc; bi++) {
            const int64_t b = b0 + bi;
            int two = 0;
            for (int r = 0; r < R; r++) two |= X->flag[(m0 + r) * X->nb + b];
            if (two) ig_level(R, NP, X, m0, b, 1, wp, dwp, bi, f2);
        }
        for (int r = 0; r < R; r++)
            for (int p = 0; p < NP; p++) f[r][p] = IG_ADD(f[r][p], f2[r][p]);
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < NP; p++) {
            const int n = ncols - p * IG_W;
            if (n <= 0) continue;
            float *yr = y + (m0 + r) * ldy + p * IG_W;
            if (n >= IG_W) {
#ifdef IG_512
                _mm512_storeu_ps(yr, first ? f[r][p] : _mm512_add_ps(_mm512_loadu_ps(yr), f[r][p]));
#else
                _mm256_storeu_ps(yr, first ? f[r][p] : _mm256_add_ps(_mm256_loadu_ps(yr), f[r][p]));
#endif
                continue;
            }
            float v[IG_W];
            memcpy(v, &f[r][p], sizeof v);
            for (int j = 0; j < n; j++) yr[j] = first ? v[j] : yr[j] + v[j];
        }
}

#define IG_ROWS(NP)                                                                                    \
    switch (R) {                                                                                       \
    case IG_MR: ig_micro(IG_MR, NP, &X, m0, b0, nbc, wp, mins, yt, a->ldy, first, ncols); break;        \
    default: for (int r = 0; r < R; r++) ig_micro(1, NP, &X, m0 + r, b0, nbc, wp, mins, yt, a->ldy, first, ncols); \
    }

/* y [M, N] (row stride ldy) = x [M, K] @ W^T with x rounded as above. Returns 0, -1 out of memory, -2 not built
 * for this ISA or not 4-bit codes (the caller takes its float GEMM), -3 no loop for the groups. */
int kvq_gemm_i8(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, int offset, int scale_kind,
                const void *scale, const uint16_t *scale_sup, int64_t scale_per, int min_kind, const void *mins_,
                const uint16_t *min_sup, int64_t min_per, int64_t G, int64_t N, float *y, int64_t ldy, int nthreads) {
    if (bits != 4) return -2;
    const kvq_args a0 = {NULL, NULL, NULL, NULL, codes, groups_of(scale_kind, scale, scale_sup, scale_per),
                         groups_of(min_kind, mins_, min_sup, min_per), M, K, N, G, y, ldy, offset};
    const kvq_args *a = &a0;
    if (G % QK != 0 || K % QK != 0 || N % 8 != 0) return -3;
    const int64_t nb = K / QK;
    const int64_t npanels = (N + IG_W - 1) / IG_W, ntiles = (npanels + IG_NP - 1) / IG_NP;
    const int64_t nitems = (ntiles + IG_PB - 1) / IG_PB;
    const size_t panel_bytes = (size_t)(IG_KC / QK) * (8 * IG_W * 4 + 2 * IG_W * sizeof(float));
    /* one buffer (cpu_scratch.h): x's levels, scales, sums and flags, then each thread's row and panels */
    const size_t b_q = scratch_align((size_t)(2 * M * K)), b_f = scratch_align(sizeof(float) * (size_t)(M * nb));
    const size_t b_s = scratch_align(sizeof(int32_t) * (size_t)(2 * M * nb)), b_flag = scratch_align((size_t)(M * nb));
    const size_t b_nflag = scratch_align(sizeof(int32_t) * (size_t)M), b_row = scratch_align((size_t)(2 * K));
    const size_t b_thread = b_row + scratch_align(panel_bytes * IG_PB * IG_NP);
    const size_t shared = b_q + 2 * b_f + b_s + b_flag + b_nflag;
    const int team = nthreads > 1 ? nthreads : 1;
    int fresh;
    char *base = (char *)scratch_take(shared + (size_t)team * b_thread, &fresh);
    if (!base) return -1;
    int8_t *q = (int8_t *)base;
    float *d = (float *)(base + b_q), *sx = (float *)(base + b_q + b_f);
    int32_t *s = (int32_t *)(base + b_q + 2 * b_f);
    uint8_t *flag = (uint8_t *)(base + b_q + 2 * b_f + b_s);
    int32_t *nflag = (int32_t *)(base + b_q + 2 * b_f + b_s + b_flag);
    const ig_x X = {q, M * K, d, sx, s, flag, nflag, nb};
    const int mins = min_kind != KVQ_NONE;
    /* Rows per pass over a thread's panels: their first level (IG_MB_BYTES of x) stays in L2 while the panels
     * pass, where all M rows (e.g. 512 x 8192 bytes) were read again for every panel pair (SmolLM2's shapes at
     * 512 rows: 1.93 -> 1.44 ms for 960 x 576, 2.95 -> 2.21 for 576 x 1536, ad hoc; 192, 384 and 768 KiB were
     * within the run-to-run spread of each other on the 1B and SmolLM2 shapes, AMD EPYC, 2026-12-06). */
    const int64_t mb = (IG_MB_BYTES / K) / IG_MR * IG_MR > IG_MR ? (IG_MB_BYTES / K) / IG_MR * IG_MR : IG_MR;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        int8_t *row = (int8_t *)(base + shared + (size_t)me * b_thread);
        uint8_t *buf = (uint8_t *)row + b_row;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            ig_quantize_row(x + m * K, K, offset, row, q + m * K, q + M * K + m * K, d + m * nb, sx + m * nb,
                            s + 2 * m * nb, flag + m * nb, nflag + m);
        /* this thread's items: a static share, as `omp for schedule(static)` would give (after the loop's barrier) */
        const int64_t i0 = nitems * me / nt, i1 = nitems * (me + 1) / nt;
        for (int64_t mlo = 0; mlo < M; mlo += mb) {
            const int64_t mhi = mlo + mb < M ? mlo + mb : M;
            for (int64_t item = i0; item < i1; item++) {
                const int64_t t0 = item * IG_PB, t1 = t0 + IG_PB < ntiles ? t0 + IG_PB : ntiles;
                for (int64_t k0 = 0; k0 < K; k0 += IG_KC) {
                    const int64_t b0 = k0 / QK, nbc = (K - k0 < IG_KC ? K - k0 : IG_KC) / QK;
                    const size_t pb = (size_t)nbc * (8 * IG_W * 4 + 2 * IG_W * sizeof(float));
                    const int first = k0 == 0;
                    for (int64_t t = t0; t < t1; t++)
                        for (int p = 0; p < IG_NP && t * IG_NP + p < npanels; p++)
                            ig_pack(a, t * IG_NP + p, b0, nbc, buf + ((t - t0) * IG_NP + p) * pb);
                    for (int64_t m0 = mlo; m0 < mhi; m0 += IG_MR) {
                        const int R = (int)(mhi - m0 < IG_MR ? mhi - m0 : IG_MR);
                        for (int64_t t = t0; t < t1; t++) {
                            const uint8_t *wp[IG_NP];
                            for (int p = 0; p < IG_NP; p++) wp[p] = buf + ((t - t0) * IG_NP + p) * pb;
                            const int64_t c0 = t * IG_NP * IG_W;
                            const int ncols = (int)(N - c0 < IG_NP * IG_W ? N - c0 : IG_NP * IG_W);
                            float *yt = y + c0;
                            if (ncols > (IG_NP - 1) * IG_W) {
                                IG_ROWS(IG_NP)
                            } else {
                                IG_ROWS(1)
                            }
                        }
                    }
                }
            }
        }
    }
    scratch_give(base, fresh);
    return 0;
}
#else
KVQ_GEMM_ABSENT(kvq_gemm_i8)
#endif

/* Causal attention of a prefill chunk on the CPU (AVX2 + FMA): q_len query tokens, the last q_len of L,
 * against L keys and values as fp32 [kv_heads, L, D] rows (kvcli/attention/torch_backend.py reads a
 * request's cache that way for prefill chunks: a view of an fp32 cache, or a converted copy). torch's flash-attention CPU kernel reaches about
 * a third of the FMA peak on these shapes (head_dim 64); this one is built like a GEMM:
 *
 * Work items are (KV head, block of QP query positions); the rows of an item are its positions x the q
 * heads of the GQA group (they share every key). Keys are taken in blocks of KB: each block of K is
 * transposed once per item into [D][KB] (so that a score tile is a register-blocked GEMM: 6 rows x 16
 * keys, 12 FMA accumulators over d), V is read in place. For every 6-row tile: scores, an online softmax
 * (flash attention: running max and sum per row, earlier output rescaled), then P @ V into the row's
 * output in 16-column slices (6 x 16 register tiles over the block's keys). Query t (position
 * L - q_len + t) sees keys 0 .. its position; tiles skip the key blocks none of their rows sees.
 * Everything in fp32; each output row sums its keys in one fixed order, whatever q_len, thread count or
 * its neighbours. AVX-512 builds take 32 keys per score tile and 32 columns per P @ V slice (16-lane
 * vectors, each lane in the same order: the AVX2 build's outputs bit for bit, tested), 1.27x the AVX2
 * build's speed for a 512-token chunk after 8k keys on a 2-core Xeon (2026-12-06, ad hoc).
 *
 * Built at first use by kvcli_kernels/cpu_build.py (cc -O3 -fopenmp).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVP_AVX2 1
#if defined(__AVX512F__)
#define KVP_AVX512 1 /* 32-key score tiles and 32-column P @ V slices: score_tile512, pv_tile512 */
#endif
#endif

#define MR 6   /* rows per register tile */
#define KB 64  /* keys per block */
#define QP 64  /* query positions per work item */

#ifdef KVP_AVX2
#include "cpu_simd.h" /* hsum8, hmax8, exp8 */

/* s[r][0..15] = sum_d q_r[d] kt[d][0..15] for R rows: 16 keys of the transposed block (row stride KB). */
static inline __attribute__((always_inline)) void score_tile(const int R, const float *const *qr, const float *kt,
                                                             int64_t D, float *s) {
    __m256 c0[MR], c1[MR];
    for (int r = 0; r < R; r++) c0[r] = c1[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 b0 = _mm256_loadu_ps(kt + d * KB), b1 = _mm256_loadu_ps(kt + d * KB + 8);
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(qr[r] + d);
            c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(s + r * KB, c0[r]);
        _mm256_storeu_ps(s + r * KB + 8, c1[r]);
    }
}

/* o_r[c .. c + 15] += sum_key p[r][key] v[key][c .. c + 15] for R rows (o rows have stride D). */
static inline __attribute__((always_inline)) void pv_tile(const int R, const float *p, const float *v, int64_t D,
                                                          int nk, float *o, int64_t c) {
    __m256 c0[MR], c1[MR];
    for (int r = 0; r < R; r++) {
        c0[r] = _mm256_loadu_ps(o + r * D + c);
        c1[r] = _mm256_loadu_ps(o + r * D + c + 8);
    }
    for (int j = 0; j < nk; j++) {
        const __m256 b0 = _mm256_loadu_ps(v + j * D + c), b1 = _mm256_loadu_ps(v + j * D + c + 8);
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(p + r * KB + j);
            c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(o + r * D + c, c0[r]);
        _mm256_storeu_ps(o + r * D + c + 8, c1[r]);
    }
}

#ifdef KVP_AVX512
/* score_tile on 32 keys in 16-lane vectors: each lane sums its key's products over d in the same order as
 * score_tile's, so the scores are the same bit for bit (half the instructions). */
static inline __attribute__((always_inline)) void score_tile512(const int R, const float *const *qr, const float *kt,
                                                                int64_t D, float *s) {
    __m512 c0[MR], c1[MR];
    for (int r = 0; r < R; r++) c0[r] = c1[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 b0 = _mm512_loadu_ps(kt + d * KB), b1 = _mm512_loadu_ps(kt + d * KB + 16);
        for (int r = 0; r < R; r++) {
            const __m512 a = _mm512_set1_ps(qr[r][d]);
            c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
            c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(s + r * KB, c0[r]);
        _mm512_storeu_ps(s + r * KB + 16, c1[r]);
    }
}

/* pv_tile on 32 columns (same per-lane order as pv_tile: the same outputs bit for bit). */
static inline __attribute__((always_inline)) void pv_tile512(const int R, const float *p, const float *v, int64_t D,
                                                             int nk, float *o, int64_t c) {
    __m512 c0[MR], c1[MR];
    for (int r = 0; r < R; r++) {
        c0[r] = _mm512_loadu_ps(o + r * D + c);
        c1[r] = _mm512_loadu_ps(o + r * D + c + 16);
    }
    for (int j = 0; j < nk; j++) {
        const __m512 b0 = _mm512_loadu_ps(v + j * D + c), b1 = _mm512_loadu_ps(v + j * D + c + 16);
        for (int r = 0; r < R; r++) {
            const __m512 a = _mm512_set1_ps(p[r * KB + j]);
            c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
            c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(o + r * D + c, c0[r]);
        _mm512_storeu_ps(o + r * D + c + 16, c1[r]);
    }
}
#endif

/* One 6-row tile against one key block: scores, online softmax, P @ V. o: the tile's output rows
 * (stride D), m / l: their running maxima and sums. pos[r]: the row's position (keys > pos masked). */
static inline __attribute__((always_inline)) void tile_block(const int R, const float *const *qr, const int64_t *pos,
                                                             const float *kt, const float *v, int64_t kb, int nk,
                                                             int64_t D, float scale, float *o, float *m, float *l,
                                                             float *s) {
#ifdef KVP_AVX512
    for (int j0 = 0; j0 < nk; j0 += 32) score_tile512(R, qr, kt + j0, D, s + j0); /* kt is zero past nk up to KB */
#else
    for (int j0 = 0; j0 < nk; j0 += 16) score_tile(R, qr, kt + j0, D, s + j0);
#endif
    const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    for (int r = 0; r < R; r++) {
        float *sr = s + r * KB;
        const int64_t seen = pos[r] - kb + 1; /* keys of the block this row sees */
        __m256 mx = ninf;
        for (int j = 0; j < nk; j += 8) {
            const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            const __m256 vis = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(seen < nk ? seen : nk)), idx));
            const __m256 x = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(sr + j), sc), vis);
            _mm256_storeu_ps(sr + j, x);
            mx = _mm256_max_ps(mx, x);
        }
        const float m_new = fmaxf(m[r], hmax8(mx));
        const float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new);
        const __m256 mv = _mm256_set1_ps(m_new);
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < nk; j += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mv));
            _mm256_storeu_ps(sr + j, p);
            sum = _mm256_add_ps(sum, p);
        }
        l[r] = l[r] * alpha + hsum8(sum);
        m[r] = m_new;
        if (alpha != 1.0f) {
            const __m256 av = _mm256_set1_ps(alpha);
            for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(o + r * D + c, _mm256_mul_ps(_mm256_loadu_ps(o + r * D + c), av));
        }
    }
    int64_t c = 0;
#ifdef KVP_AVX512
    for (; c + 32 <= D; c += 32) pv_tile512(R, s, v, D, nk, o, c);
#endif
    for (; c < D; c += 16) pv_tile(R, s, v, D, nk, o, c);
}

/* kt[d][j] = k[j][d] for the block's nk keys (rows of D floats), zero for j >= nk (finite, masked anyway):
 * 8 x 8 tiles transposed in registers. */
static void transpose_block(const float *k, int nk, int64_t D, float *kt) {
    for (int j = 0; j < KB; j += 8)
        for (int64_t d = 0; d < D; d += 8) {
            __m256 r[8];
            for (int u = 0; u < 8; u++) r[u] = j + u < nk ? _mm256_loadu_ps(k + (j + u) * D + d) : _mm256_setzero_ps();
            const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
            const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
            const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
            const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
            const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float *o = kt + d * KB + j;
            _mm256_storeu_ps(o + 0 * KB, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(o + 1 * KB, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(o + 2 * KB, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(o + 3 * KB, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(o + 4 * KB, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(o + 5 * KB, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(o + 6 * KB, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(o + 7 * KB, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
}

#define TILE_CASES                                                                         \
    switch (R) {                                                                           \
    case 6: tile_block(6, qr, pos, kt, vb, kb, nk, D, scale, ob, mb, lb, s); break;        \
    case 5: tile_block(5, qr, pos, kt, vb, kb, nk, D, scale, ob, mb, lb, s); break;        \
    case 4: tile_block(4, qr, pos, kt, vb, kb, nk, D, scale, ob, mb, lb, s); break;        \
    case 3: tile_block(3, qr, pos, kt, vb, kb, nk, D, scale, ob, mb, lb, s); break;        \
    case 2: tile_block(2, qr, pos, kt, vb, kb, nk, D, scale, ob, mb, lb, s); break;        \
    default: tile_block(1, qr, pos, kt, vb, kb, nk, D, scale, ob, mb, lb, s);              \
    }
#endif

/* out [T, H, D] (token stride o_row, heads contiguous) = causal attention of q [T, H, D] (token stride
 * q_row, heads contiguous) over k, v fp32 [KVH, L, D] (head strides k_head, v_head; rows of D contiguous);
 * query t is at position L - T + t. D a multiple of 16, H a multiple of KVH. Returns 0, -1 when out of
 * memory, -2 where not built (no AVX2). */
int kvp_prefill(const float *q, int64_t q_row, const float *k, int64_t k_head, const float *v, int64_t v_head,
                int64_t T, int64_t L, int64_t H, int64_t KVH, int64_t D, float scale, float *out, int64_t o_row,
                int nthreads) {
#ifdef KVP_AVX2
    const int64_t g = H / KVH, nblk = (T + QP - 1) / QP, items = KVH * nblk;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        const int64_t rows_max = QP * g;
        float *kt = (float *)aligned_alloc(64, sizeof(float) * (size_t)(D * KB));
        float *o = (float *)malloc(sizeof(float) * (size_t)(rows_max * D));
        float *ml = (float *)malloc(sizeof(float) * (size_t)(2 * rows_max));
        float *s = (float *)aligned_alloc(64, sizeof(float) * MR * KB);
        if (!kt || !o || !ml || !s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!kt || !o || !ml || !s) continue;
            /* later query blocks see more keys: they come first, so the long items start early */
            const int64_t h = it % KVH, blk = nblk - 1 - it / KVH;
            const int64_t t0 = blk * QP, nt = T - t0 < QP ? T - t0 : QP, rows = nt * g;
            const int64_t last_pos = L - T + t0 + nt - 1;
            const float *kh = k + h * k_head, *vh = v + h * v_head;
            float *m = ml, *l = ml + rows_max;
            memset(o, 0, sizeof(float) * (size_t)(rows * D));
            for (int64_t r = 0; r < rows; r++) m[r] = -INFINITY, l[r] = 0.0f;
            for (int64_t kb = 0; kb <= last_pos; kb += KB) {
                const int nk = (int)(last_pos + 1 - kb < KB ? last_pos + 1 - kb : KB);
                transpose_block(kh + kb * D, nk, D, kt);
                const float *vb = vh + kb * D;
                for (int64_t r0 = 0; r0 < rows; r0 += MR) {
                    const int R = (int)(rows - r0 < MR ? rows - r0 : MR);
                    const float *qr[MR];
                    int64_t pos[MR];
                    for (int r = 0; r < R; r++) { /* row r0 + r: position t0 + (r0 + r) / g, head h g + (r0 + r) % g */
                        const int64_t t = t0 + (r0 + r) / g;
                        qr[r] = q + t * q_row + (h * g + (r0 + r) % g) * D;
                        pos[r] = L - T + t;
                    }
                    if (pos[R - 1] < kb) continue; /* rows are in position order: none sees this block */
                    float *ob = o + r0 * D, *mb = m + r0, *lb = l + r0;
                    TILE_CASES
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                const int64_t t = t0 + r / g;
                float *dst = out + t * o_row + (h * g + r % g) * D;
                const float inv = 1.0f / l[r];
                for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
            }
        }
        free(kt), free(o), free(ml), free(s);
    }
    return failed ? -1 : 0;
#else
    (void)q, (void)q_row, (void)k, (void)k_head, (void)v, (void)v_head, (void)T, (void)L, (void)H, (void)KVH, (void)D, (void)scale, (void)out;
    (void)o_row, (void)nthreads;
    return -2;
#endif
}

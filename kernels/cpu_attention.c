/* Paged decode attention on the CPU: one query token per request against its cached K/V, read through
 * the block table directly in the cache's stored dtype, so each cached byte is read once per step (the
 * torch path converts a request's whole K/V to fp32 scratch first, then runs two GEMMs per KV head).
 *
 * Inputs (element strides, the head_dim stride is 1), in two structs built once each by the launcher:
 *   kva_step   per step: block tables, int32 or int64 [batch, t_row]; context lengths, int32 or int64
 *              [batch]; the n decode requests' table rows reqs[r] and q / out rows rows[r] (NULL: r);
 *              the number of q heads, softmax scale, sliding window and soft-cap
 *   kva_cache  per layer: K, V indexed [kv_heads, blocks, block_size, D] by strides (head-major or
 *              token-major storage), fp32 / fp16 / bf16 / int8 / fp8 e4m3, the last two with per-token
 *              fp32 scales ks, vs indexed [kv_heads, blocks, block_size]
 *   q, out     fp32 [tokens, heads, D] with row strides q_row, out_row (a row's heads contiguous)
 * The query is the last token (position p = len - 1) and sees keys [max(0, p - window + 1), p].
 * Scores are dot(q, k) * scale (quantized: dot(q, codes) * (ks * scale), the scale times the fp8 unit),
 * soft-capped to softcap * tanh(s / softcap) when softcap > 0,
 * probabilities are multiplied by vs * unit: what kvcli/attention/torch_backend.py computes, with the
 * softmax done online (flash-decoding) in fp32.
 *
 * Work items are (request, KV head, span of keys): the q heads of one KV head (the GQA group) share
 * every K/V row read; long contexts are split into spans so that threads have work even for one
 * request, and the spans are merged with their maxima and sums (log-sum-exp).
 * Query groups (kva_step.group, a speculative verification's rows): group[r] = k > 1 says queries r ..
 * r + k - 1 are consecutive positions of one request (the same table row, lengths L - k + 1 .. L, no
 * sliding window) and are computed as one item: their k x g heads share every K/V row read, each head
 * masked past its own row's length (a row's keys beyond its length get probability 0 and leave its
 * running maximum, sum and accumulator exactly as they were: the row's result is bit for bit what it
 * would be alone, wherever the spans are the same). group[r] = 0 marks the queries a group covers. Keys are
 * processed in tiles of at most TILE tokens, across block boundaries; in vector builds (span_tiles) each row
 * is read in its stored dtype and converted in registers (fp16 by F16C, bf16 by a shift, int8 / fp8 by
 * integer widening), 8 lanes at a time in AVX2 builds, 16 in AVX-512 builds (a head_dim of 8 mod 16 ending
 * with a half vector); builds without AVX2 convert each tile of one block to fp32 first (span), the same contract. Per head
 * the arithmetic does not depend on the other heads of the item.
 *
 * Built at first use by kvcli_kernels/cpu_attention.py (cc -O3 -fopenmp); the OpenMP runtime is the one
 * torch already loaded, so torch.set_num_threads governs both.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "cpu_scratch.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVA_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVA_AVX512 1 /* 16-lane tiles (tile_update512) instead of 8-lane ones */
#endif
#endif

/* KV dtype codes (kvcli_kernels/kv_formats.py); macros, not an enum: KVA_DTYPES below is tested by #if */
#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2
#define DT_I8 3
#define DT_FP8 4

#define TILE 32       /* keys per tile (fewer at block ends); a multiple of 8 */
#define MAX_D 256     /* head_dim limit of the stack buffers (the launcher falls back above) */
#define MAX_G 16      /* GQA group limit, likewise */
#define MAX_QG 64     /* heads of one work item: a query group's rows x the GQA group (the launcher splits above) */
#define MIN_SPAN 128  /* keys: shorter contexts are not split (merging costs more than it saves) */
#define SERIAL_MACS (1 << 17)  /* below this many q.k products a call stays on one thread */

/* Mirrored by kvcli_kernels/cpu_attention.py (_Step, _Cache): keep the field order and types in step.
 * Two parts, so that the launcher builds the per-step one once for every layer and the per-layer one
 * once per cache, and a call passes only q and out. */
typedef struct { /* per step: the decode requests, their block tables and lengths */
    const void *tables;
    int64_t t_row;
    const void *lens;
    const int64_t *reqs, *rows;
    const int64_t *group; /* NULL, or per query: rows in the group it starts (0: covered by an earlier one) */
    int64_t n, heads, window;
    float scale, softcap; /* softcap > 0: scores s become softcap * tanh(s / softcap) (Gemma 2) */
    int32_t tables64, lens64;
} kva_step;

typedef struct { /* per layer: the pool's K/V (and scales) */
    const void *k, *v;
    int64_t k_sh, k_sb, k_st, v_sh, v_sb, v_st;
    const float *ks, *vs;
    int64_t ks_sh, ks_sb, ks_st, vs_sh, vs_sb, vs_st;
    int64_t kv_heads, d, block_size;
    float unit; /* fp8: codes are read as code / 256, so scores and V weights are scaled by 256 */
    int32_t dtype;
} kva_cache;

/* sizeof each struct mirrored by the launcher (_Step, _Cache), for cpu_build.check_structs. */
int64_t kva_struct_size(int which) { return which == 0 ? (int64_t)sizeof(kva_step) : which == 1 ? (int64_t)sizeof(kva_cache) : -1; }

typedef struct {
    const kva_step *s;
    const kva_cache *c;
    const float *q;
    float *out;
    int64_t q_row, out_row;
    float scale; /* softmax scale times the unit (exact: a power of two) */
} kva_args;

static const float zero_row[MAX_D] __attribute__((aligned(32)));

static inline int64_t elem_size(int dt) { return dt == DT_F32 ? 4 : (dt == DT_F16 || dt == DT_BF16) ? 2 : 1; }

static inline float f16_bits_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    bits = exp == 31 ? (sign | 0x7F800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* e4m3fn code -> fp16 bits of code / 256 (same bits under fp16's exponent bias; see FP8_UNIT in
 * torch_backend.py): sign from bit 7 to 15, exponent and mantissa from bits 0-6 to 7-13. */
static inline uint16_t fp8_as_f16_bits(uint8_t c) { return (uint16_t)(((c & 0x80) << 8) | ((c & 0x7F) << 7)); }

static inline int64_t table_at(const kva_step *s, int64_t req, int64_t i) {
    return s->tables64 ? ((const int64_t *)s->tables)[req * s->t_row + i] : ((const int32_t *)s->tables)[req * s->t_row + i];
}

static inline int64_t len_at(const kva_step *s, int64_t req) {
    return s->lens64 ? ((const int64_t *)s->lens)[req] : ((const int32_t *)s->lens)[req];
}

static inline int64_t row_of(const kva_step *s, int64_t r) { return s->rows ? s->rows[r] : r; }

/* The item's queries for KV head h: rows r .. r + nq - 1's q heads of the GQA group side by side, as one group
 * of nq g heads (copied to qg when nq > 1), and each head's key limit lim (its row's length; t1 for one row). */
static inline const float *item_queries(const kva_args *a, int64_t r, int64_t nq, int64_t h, int64_t t1, float *qg,
                                        int64_t *lim) {
    const int64_t D = a->c->d, g = a->s->heads / a->c->kv_heads;
    for (int64_t i = 0; i < nq; i++)
        for (int64_t j = 0; j < g; j++) lim[i * g + j] = nq > 1 ? len_at(a->s, a->s->reqs ? a->s->reqs[r + i] : r + i) : t1;
    if (nq == 1) return a->q + row_of(a->s, r) * a->q_row + h * g * D;
    for (int64_t i = 0; i < nq; i++)
        memcpy(qg + i * g * D, a->q + row_of(a->s, r + i) * a->q_row + h * g * D, sizeof(float) * (size_t)(g * D));
    return qg;
}

#ifndef KVA_AVX2
/* ---- the plain C path (builds without AVX2) ------------------------------------------------------------ */

/* n rows of D elements (row stride st elements) of dtype dt -> fp32 rows of D at dst. */
static inline __attribute__((always_inline)) void cvt_rows(const void *src, const int dt, int64_t st, int n,
                                                           int64_t D, float *dst) {
    for (int u = 0; u < n; u++) {
        float *o = dst + u * D;
        for (int64_t i = 0; i < D; i++) {
            if (dt == DT_F16) {
                o[i] = f16_bits_to_f32(((const uint16_t *)src)[u * st + i]);
            } else if (dt == DT_BF16) {
                uint32_t b = (uint32_t)((const uint16_t *)src)[u * st + i] << 16;
                memcpy(&o[i], &b, 4);
            } else if (dt == DT_I8) {
                o[i] = (float)((const int8_t *)src)[u * st + i];
            } else {
                o[i] = f16_bits_to_f32(fp8_as_f16_bits(((const uint8_t *)src)[u * st + i]));
            }
        }
    }
}

/* One tile of n keys (rows kr / vr, fp32; kr padded to a multiple of 8 with zero rows) for the g q heads
 * of one KV head: scores, online-softmax update of m, l and acc [g][D]. sc: per-key score factor,
 * wv: per-key probability factor (both padded). nv[j] <= n: the keys head j sees (a query group's rows
 * see different lengths); a head that sees none keeps m, l and acc as they are. */
static void tile_update(const float *q, int64_t g, int64_t D, const float *const *kr, const float *const *vr,
                        int n, const int *nv, const float *sc, const float *wv, const float cap, float *m, float *l,
                        float *acc) {
    float s[MAX_QG * TILE] __attribute__((aligned(32))), p[MAX_QG * TILE] __attribute__((aligned(32)));
    for (int64_t j = 0; j < g; j++) {
        const float *qj = q + j * D;
        float mx = -INFINITY;
        for (int u = nv[j]; u < n; u++) p[j * TILE + u] = 0.0f;
        for (int u = 0; u < nv[j]; u++) {
            /* 8 partial sums, as the vector path: the compiler can vectorize them, and the rounding
             * error stays that of 8 interleaved D / 8-term sums, not of one D-term sum */
            float part[8] = {0};
            for (int64_t i = 0; i < D; i += 8)
                for (int w = 0; w < 8; w++) part[w] += qj[i + w] * kr[u][i + w];
            const float dot = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
            s[j * TILE + u] = cap > 0.0f ? cap * tanhf(dot * sc[u] / cap) : dot * sc[u];
            mx = s[j * TILE + u] > mx ? s[j * TILE + u] : mx;
        }
        if (nv[j] == 0) continue;
        const float m_new = mx > m[j] ? mx : m[j], corr = expf(m[j] - m_new);
        float sum = 0.0f;
        for (int u = 0; u < nv[j]; u++) {
            const float e = expf(s[j * TILE + u] - m_new);
            sum += e;
            p[j * TILE + u] = e * wv[u];
        }
        l[j] = l[j] * corr + sum;
        m[j] = m_new;
        float *aj = acc + j * D;
        for (int64_t i = 0; i < D; i++) aj[i] *= corr;
        for (int u = 0; u < nv[j]; u++)
            for (int64_t i = 0; i < D; i++) aj[i] += p[j * TILE + u] * vr[u][i];
    }
}


/* Keys in the tile starting at t: up to TILE, within t's block and the span's end t1. */
static inline int tile_len(int64_t t, int64_t t1, int64_t bs) {
    int64_t n = bs - t % bs;
    n = n < TILE ? n : TILE;
    return (int)(t1 - t < n ? t1 - t : n);
}

static inline void prefetch_rows(const char *p, int64_t stride, int n, int64_t row_bytes) {
    for (int u = 0; u < n; u++)
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + u * stride + b, 0, 3);
}

/* Keys [t0, t1) of queries r .. r + nq - 1 (one request: table row req) for KV head h: unnormalised acc
 * [nq g][D], maxima m and sums l; head i g + j is row r + i's q head h g + j and sees its row's keys only. */
static inline __attribute__((always_inline)) void span(const kva_args *a, const int dt, int64_t r, int64_t nq,
                                                       int64_t req, int64_t h, int64_t t0, int64_t t1, float *acc,
                                                       float *m, float *l) {
    const kva_cache *c = a->c;
    const int64_t D = c->d, g = a->s->heads / c->kv_heads, G = nq * g, bs = c->block_size, esz = elem_size(dt);
    float qg[MAX_QG * MAX_D] __attribute__((aligned(32)));
    int64_t lim[MAX_QG];
    const float *q = item_queries(a, r, nq, h, t1, qg, lim);
    float kt[TILE * MAX_D] __attribute__((aligned(32))), vt[TILE * MAX_D] __attribute__((aligned(32)));
    float sc[TILE], wv[TILE];
    int nv[MAX_QG];
    const float *kr[TILE], *vr[TILE];
    for (int64_t j = 0; j < G; j++) m[j] = -INFINITY, l[j] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)(G * D));
    /* Tiles are runs of one block's rows; the next tile's rows are prefetched while this one is
     * computed: blocks sit anywhere in the pool, and a block of one head is often one whole page
     * (16 x 64 fp32), where hardware prefetchers stop. */
    int64_t id = t0 < t1 ? table_at(a->s, req, t0 / bs) : 0;
    for (int64_t t = t0; t < t1;) {
        const int64_t off = t % bs;
        const int n = tile_len(t, t1, bs);
        const char *kp = (const char *)c->k + esz * (h * c->k_sh + id * c->k_sb + off * c->k_st);
        const char *vp = (const char *)c->v + esz * (h * c->v_sh + id * c->v_sb + off * c->v_st);
        const int64_t cur = id;
        if (t + n < t1) {
            const int64_t t2 = t + n, off2 = t2 % bs;
            id = off2 ? id : table_at(a->s, req, t2 / bs);
            /* asked for even where the next block follows this one in memory: 1.02-1.04x decode at 4k on the
             * 1B shape (2-core Xeon, 2026-12-05, interleaved pairs), the hardware prefetcher alone stopping at pages */
            const int n2 = tile_len(t2, t1, bs);
            prefetch_rows((const char *)c->k + esz * (h * c->k_sh + id * c->k_sb + off2 * c->k_st), esz * c->k_st, n2, esz * D);
            prefetch_rows((const char *)c->v + esz * (h * c->v_sh + id * c->v_sb + off2 * c->v_st), esz * c->v_st, n2, esz * D);
        }
        if (dt == DT_F32) {
            for (int u = 0; u < n; u++) kr[u] = (const float *)kp + u * c->k_st, vr[u] = (const float *)vp + u * c->v_st;
        } else {
            cvt_rows(kp, dt, c->k_st, n, D, kt);
            cvt_rows(vp, dt, c->v_st, n, D, vt);
            for (int u = 0; u < n; u++) kr[u] = kt + u * D, vr[u] = vt + u * D;
        }
        for (int u = 0; u < n; u++) {
            sc[u] = c->ks ? c->ks[h * c->ks_sh + cur * c->ks_sb + (off + u) * c->ks_st] * a->scale : a->scale;
            wv[u] = c->vs ? c->vs[h * c->vs_sh + cur * c->vs_sb + (off + u) * c->vs_st] * c->unit : 1.0f;
        }
        for (int u = n; u < ((n + 7) & ~7); u++) kr[u] = zero_row, sc[u] = 0.0f, wv[u] = 0.0f;
        for (int64_t j = 0; j < G; j++) nv[j] = lim[j] - t >= n ? n : lim[j] - t > 0 ? (int)(lim[j] - t) : 0;
        tile_update(q, G, D, kr, vr, n, nv, sc, wv, a->s->softcap, m, l, acc);
        t += n;
    }
}
#endif

#ifdef KVA_AVX2
#include "cpu_simd.h" /* hsum8, hmax8, exp8 (exp16) */

/* ---- the vector paths: rows read in their stored dtype, converted in registers --------------------------
 * Decode attention over a long context was bound by instructions, not memory: converting each tile to fp32
 * in L1 and reading it back per q head, one tile per block, reached 16.3 GB/s with the cache hot on a 2-core
 * Xeon (AVX-512), where the machine streams about 24; the AVX2 build of that path held the 1B shape's decode
 * at 8k to 62 % of its bandwidth bound (docs/results/roofline-avx2.txt, 2026-12-06). Both vector widths now
 * read rows where they lie: a K row once per 4 q heads (the q rows as memory operands), a V row once per 4
 * heads' accumulators held in registers across the tile, a vector's worth of keys' scores reduced together
 * by one fixed tree, and tiles that run across block boundaries (a 16-token block no longer caps a tile at
 * 16 keys). Per head the arithmetic does not depend on the other heads of the item, so query groups keep
 * their bit-for-bit property. span_tiles runs every head_dim (a multiple of 8): on 8 lanes in AVX2 builds
 * (tile_update256), on 16 in AVX-512 builds (tile_update512). */

/* One tile's keys: row pointers in the stored dtype (n real rows, then zero rows up to a multiple of 16),
 * their score and probability factors. */
typedef struct {
    const char *k[TILE], *v[TILE];
    float sc[TILE] __attribute__((aligned(64))), wv[TILE] __attribute__((aligned(64)));
    int n;
} kva_tile;

/* Keys [t, min(t + TILE, t1)) of request req, KV head h, across block boundaries. */
static inline __attribute__((always_inline)) void gather_tile(const kva_args *a, const int dt, int64_t req, int64_t h,
                                                              int64_t t, int64_t t1, kva_tile *tl) {
    const kva_cache *c = a->c;
    const int64_t bs = c->block_size, esz = elem_size(dt);
    const int n = (int)(t1 - t < TILE ? t1 - t : TILE);
    for (int u = 0; u < n;) {
        const int64_t pos = t + u, off = pos % bs, id = table_at(a->s, req, pos / bs);
        const int run = (int)(bs - off < n - u ? bs - off : n - u);
        const char *kb = (const char *)c->k + esz * (h * c->k_sh + id * c->k_sb + off * c->k_st);
        const char *vb = (const char *)c->v + esz * (h * c->v_sh + id * c->v_sb + off * c->v_st);
        for (int w = 0; w < run; w++) {
            tl->k[u + w] = kb + w * esz * c->k_st, tl->v[u + w] = vb + w * esz * c->v_st;
            tl->sc[u + w] = c->ks ? c->ks[h * c->ks_sh + id * c->ks_sb + (off + w) * c->ks_st] * a->scale : a->scale;
            tl->wv[u + w] = c->vs ? c->vs[h * c->vs_sh + id * c->vs_sb + (off + w) * c->vs_st] * c->unit : 1.0f;
        }
        u += run;
    }
    for (int u = n; u < ((n + 15) & ~15); u++) tl->k[u] = tl->v[u] = (const char *)zero_row, tl->sc[u] = tl->wv[u] = 0.0f;
    tl->n = n;
}

/* The next tile's rows, spread over this tile's work: key u's, asked for while key u's score is computed
 * (asked for all at once, before the tile, they stalled the core on full fill buffers: 16.2 against 13.1 ms
 * for a decode step's attention over 8k keys on the 1B shape, 2-core Xeon, 2026-12-06, ad hoc). */
static inline __attribute__((always_inline)) void prefetch_key(const kva_tile *next, int u, int64_t row_bytes) {
    if (next && u < next->n)
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next->k[u] + b, 0, 3), __builtin_prefetch(next->v[u] + b, 0, 3);
}

#ifndef KVA_AVX512
/* Lanes i .. i + 7 of a stored row (dtype constant after inlining). */
static inline __attribute__((always_inline)) __m256 load8(const char *row, const int dt, int64_t i) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)row + i);
    if (dt == DT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    if (dt == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i))), 16));
    if (dt == DT_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + i))));
    const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)row + i)));
    return _mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x80)), 8),
                                        _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x7F)), 7)));
}

/* Lane u of the result = the sum of the 8 lanes of a[u]. */
static inline __m256 reduce8(const __m256 a[8]) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* Scores of GJ heads (q rows q + j D) for the tile's keys into s [j][TILE], masked past nv[j], soft-capped;
 * the rows of `next` (when not NULL) are prefetched a key at a time. */
static inline __attribute__((always_inline)) void scores256(const int GJ, const float *q, int64_t D, const int dt,
                                                            const kva_tile *tl, const int *nv, const float cap, float *s,
                                                            const kva_tile *next) {
    __m256 part[4][8];
    const int64_t row = D * elem_size(dt);
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int c = 0; c < tl->n; c += 8) {
        for (int u = 0; u < 8; u++) {
            const char *kr = tl->k[c + u];
            prefetch_key(next, c + u, row);
            __m256 acc[4];
            for (int j = 0; j < GJ; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < D; i += 8) {
                const __m256 kv = load8(kr, dt, i);
                for (int j = 0; j < GJ; j++) acc[j] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(q + j * D + i), acc[j]);
            }
            for (int j = 0; j < GJ; j++) part[j][u] = acc[j];
        }
        for (int j = 0; j < GJ; j++) {
            __m256 sv = _mm256_mul_ps(reduce8(part[j]), _mm256_load_ps(tl->sc + c));
            if (cap > 0.0f) { /* soft-capping (Gemma 2): cap tanh(s / cap) = cap (e - 1) / (e + 1), e = exp(2 s / cap),
                               * 2 s / cap clamped to +-18 (tanh is 1 to fp32 there, exp8 stays finite) */
                const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(sv, _mm256_set1_ps(2.0f / cap)),
                                                             _mm256_set1_ps(-18.0f)), _mm256_set1_ps(18.0f));
                const __m256 e = exp8(t), one = _mm256_set1_ps(1.0f);
                sv = _mm256_mul_ps(_mm256_set1_ps(cap), _mm256_div_ps(_mm256_sub_ps(e, one), _mm256_add_ps(e, one)));
            }
            const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(nv[j] - c)), _CMP_LT_OQ);
            _mm256_store_ps(s + j * TILE + c, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sv, valid));
        }
    }
}

/* acc[j][i .. i + 8 NC) = acc * corr[j] + sum_u p[j][u] v[u] for GJ heads: the accumulators stay in
 * registers across the tile, each V row is converted once for the GJ heads. */
static inline __attribute__((always_inline)) void v_chunk256(const int GJ, const int NC, float *acc, const float *p,
                                                             const float *corr, const kva_tile *tl, const int dt,
                                                             int64_t D, int64_t i) {
    __m256 a[4][2];
    for (int j = 0; j < GJ; j++)
        for (int c = 0; c < NC; c++) a[j][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + j * D + i + 8 * c), _mm256_set1_ps(corr[j]));
    for (int u = 0; u < tl->n; u++) {
        __m256 v[2];
        for (int c = 0; c < NC; c++) v[c] = load8(tl->v[u], dt, i + 8 * c);
        for (int j = 0; j < GJ; j++) {
            const __m256 pj = _mm256_broadcast_ss(p + j * TILE + u);
            for (int c = 0; c < NC; c++) a[j][c] = _mm256_fmadd_ps(pj, v[c], a[j][c]);
        }
    }
    for (int j = 0; j < GJ; j++)
        for (int c = 0; c < NC; c++) _mm256_storeu_ps(acc + j * D + i + 8 * c, a[j][c]);
}

static inline __attribute__((always_inline)) void v_accumulate256(const int GJ, float *acc, const float *p,
                                                                  const float *corr, const kva_tile *tl, const int dt,
                                                                  int64_t D) {
    int64_t i = 0;
    for (; i + 16 <= D; i += 16) v_chunk256(GJ, 2, acc, p, corr, tl, dt, D, i);
    for (; i < D; i += 8) v_chunk256(GJ, 1, acc, p, corr, tl, dt, D, i);
}

/* One gathered tile for G heads: scores, online-softmax update of m, l and acc [G][D]. nv[j] <= n: the keys
 * head j sees (a query group's rows see different lengths); a head that sees none keeps m, l and acc. */
static inline __attribute__((always_inline)) void tile_update256(const float *q, int64_t G, int64_t D, const int dt,
                                                                 const kva_tile *tl, const int *nv, const float cap,
                                                                 float *m, float *l, float *acc, const kva_tile *next) {
    float s[MAX_QG * TILE] __attribute__((aligned(32))), p[MAX_QG * TILE] __attribute__((aligned(32))), corr[MAX_QG];
    const int n8 = (tl->n + 7) & ~7;
    for (int64_t j0 = 0; j0 < G; j0 += 4) {
        switch (G - j0 < 4 ? G - j0 : 4) { /* constant head counts: the accumulators stay in registers */
        case 4: scores256(4, q + j0 * D, D, dt, tl, nv + j0, cap, s + j0 * TILE, j0 ? NULL : next); break;
        case 3: scores256(3, q + j0 * D, D, dt, tl, nv + j0, cap, s + j0 * TILE, j0 ? NULL : next); break;
        case 2: scores256(2, q + j0 * D, D, dt, tl, nv + j0, cap, s + j0 * TILE, j0 ? NULL : next); break;
        default: scores256(1, q + j0 * D, D, dt, tl, nv + j0, cap, s + j0 * TILE, j0 ? NULL : next);
        }
    }
    for (int64_t j = 0; j < G; j++) {
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        for (int c = 0; c < n8; c += 8) vmax = _mm256_max_ps(vmax, _mm256_load_ps(s + j * TILE + c));
        const float mx = hmax8(vmax), m_new = mx > m[j] ? mx : m[j];
        if (m_new == -INFINITY) { /* nothing seen yet, nothing in this tile: probabilities 0, state as it is */
            for (int c = 0; c < n8; c += 8) _mm256_store_ps(p + j * TILE + c, _mm256_setzero_ps());
            corr[j] = 1.0f;
            continue;
        }
        corr[j] = expf(m[j] - m_new);
        __m256 vsum = _mm256_setzero_ps();
        const __m256 mv = _mm256_set1_ps(m_new);
        for (int c = 0; c < n8; c += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(s + j * TILE + c), mv)); /* masked lanes: 0 */
            vsum = _mm256_add_ps(vsum, e);
            _mm256_store_ps(p + j * TILE + c, _mm256_mul_ps(e, _mm256_load_ps(tl->wv + c)));
        }
        l[j] = l[j] * corr[j] + hsum8(vsum);
        m[j] = m_new;
    }
    for (int64_t j0 = 0; j0 < G; j0 += 4) {
        switch (G - j0 < 4 ? G - j0 : 4) {
        case 4: v_accumulate256(4, acc + j0 * D, p + j0 * TILE, corr + j0, tl, dt, D); break;
        case 3: v_accumulate256(3, acc + j0 * D, p + j0 * TILE, corr + j0, tl, dt, D); break;
        case 2: v_accumulate256(2, acc + j0 * D, p + j0 * TILE, corr + j0, tl, dt, D); break;
        default: v_accumulate256(1, acc + j0 * D, p + j0 * TILE, corr + j0, tl, dt, D);
        }
    }
}
#endif /* !KVA_AVX512 */
#endif

#ifdef KVA_AVX512
/* The 16-lane form of the vector path above: 16 keys' scores reduced together by one transpose-and-add tree; a
 * head_dim of 8 mod 16 ends each row with a half vector (no 8-lane code in these builds). */

/* Lanes i .. i + 15 of a stored row (dtype and half constant after inlining); half: lanes i .. i + 7 only, zeros
 * above (the last chunk of a head_dim of 8 mod 16: nothing past the row is read). */
static inline __attribute__((always_inline)) __m512 load16(const char *row, const int dt, int64_t i, const int half) {
    if (dt == DT_F32)
        return half ? _mm512_zextps256_ps512(_mm256_loadu_ps((const float *)row + i)) : _mm512_loadu_ps((const float *)row + i);
    if (dt == DT_F16 || dt == DT_BF16) {
        const uint16_t *r = (const uint16_t *)row + i;
        const __m256i h = half ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)r)) : _mm256_loadu_si256((const __m256i *)r);
        if (dt == DT_F16) return _mm512_cvtph_ps(h);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    const __m128i b = half ? _mm_loadl_epi64((const __m128i *)(row + i)) : _mm_loadu_si128((const __m128i *)(row + i));
    if (dt == DT_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m256i c = _mm256_cvtepu8_epi16(b);
    return _mm512_cvtph_ps(_mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8),
                                           _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7F)), 7)));
}

/* Lane u of the result = the sum of the 16 lanes of v[u / 4 + 4 (u % 4)] (a fixed tree: lanes l and l + 8,
 * then + 4, + 2, + 1): store key u's partials at slot KEY_SLOT(u) and lane u is key u's score. */
#define KEY_SLOT(u) ((((u) & 3) << 2) | ((u) >> 2))
static inline __m512 reduce16(const __m512 *v) {
    __m512 r1[8], r2[4], r3[2];
    for (int k = 0; k < 8; k++)
        r1[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; k++)
        r2[k] = _mm512_add_ps(_mm512_shuffle_f32x4(r1[2 * k], r1[2 * k + 1], 0x88), _mm512_shuffle_f32x4(r1[2 * k], r1[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; k++) r3[k] = _mm512_add_ps(_mm512_unpacklo_ps(r2[2 * k], r2[2 * k + 1]), _mm512_unpackhi_ps(r2[2 * k], r2[2 * k + 1]));
    return _mm512_add_ps(_mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(3, 2, 3, 2)));
}

/* 16 floats from p (half: 8, zeros above). */
static inline __attribute__((always_inline)) __m512 lanes16(const float *q, const int half) {
    return half ? _mm512_zextps256_ps512(_mm256_loadu_ps(q)) : _mm512_loadu_ps(q);
}

/* Heads per pass over a tile's K / V rows in the 16-lane form: 4 for a plain decode row (a GQA group of up to 4
 * heads, as the 8-lane form), up to 6 for a query group's rows (speculative verification: 6 rows x 3 heads on
 * SmolLM2), where each K and V row was converted once per 4 heads: 6 heads' V accumulators (6 x 4 registers for a
 * head_dim of 64) and the row's 4 still fit the 32 registers. Per head the arithmetic is the same either way. */
#define HEADS512 6

/* scores256's 16-lane form; a head_dim of 8 mod 16 ends with a half vector. */
static inline __attribute__((always_inline)) void scores512(const int GJ, const float *q, int64_t D, const int dt,
                                                            const kva_tile *tl, const int *nv, const float cap, float *s,
                                                            const kva_tile *next) {
    __m512 part[HEADS512][16];
    const int64_t row = D * elem_size(dt);
    for (int c = 0; c < tl->n; c += 16) {
        for (int u = 0; u < 16; u++) {
            const char *kr = tl->k[c + u];
            prefetch_key(next, c + u, row);
            __m512 acc[HEADS512];
            for (int j = 0; j < GJ; j++) acc[j] = _mm512_setzero_ps();
            int64_t i = 0;
            for (; i + 16 <= D; i += 16) {
                const __m512 kv = load16(kr, dt, i, 0);
                for (int j = 0; j < GJ; j++) acc[j] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(q + j * D + i), acc[j]);
            }
            if (i < D) {
                const __m512 kv = load16(kr, dt, i, 1);
                for (int j = 0; j < GJ; j++) acc[j] = _mm512_fmadd_ps(kv, lanes16(q + j * D + i, 1), acc[j]);
            }
            for (int j = 0; j < GJ; j++) part[j][KEY_SLOT(u)] = acc[j];
        }
        for (int j = 0; j < GJ; j++) {
            __m512 sv = _mm512_mul_ps(reduce16(part[j]), _mm512_load_ps(tl->sc + c));
            if (cap > 0.0f) { /* as tile_update's: cap tanh(s / cap) = cap (e - 1) / (e + 1), e = exp(2 s / cap) */
                const __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(sv, _mm512_set1_ps(2.0f / cap)),
                                                             _mm512_set1_ps(-18.0f)), _mm512_set1_ps(18.0f));
                const __m512 e = exp16(t), one = _mm512_set1_ps(1.0f);
                sv = _mm512_mul_ps(_mm512_set1_ps(cap), _mm512_div_ps(_mm512_sub_ps(e, one), _mm512_add_ps(e, one)));
            }
            const int rem = nv[j] - c;
            const __mmask16 valid = rem >= 16 ? (__mmask16)0xFFFF : rem > 0 ? (__mmask16)((1u << rem) - 1) : (__mmask16)0;
            _mm512_store_ps(s + j * TILE + c, _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), sv));
        }
    }
}

/* acc[j][i .. i + 16 NC) = acc * corr[j] + sum_u p[j][u] v[u] for GJ heads: the accumulators stay in
 * registers across the tile, each V row is converted once for the GJ heads. half (NC 1): columns i .. i + 7. */
static inline __attribute__((always_inline)) void v_chunk512(const int GJ, const int NC, const int half, float *acc,
                                                             const float *p, const float *corr, const kva_tile *tl,
                                                             const int dt, int64_t D, int64_t i) {
    __m512 a[HEADS512][4];
    for (int j = 0; j < GJ; j++)
        for (int c = 0; c < NC; c++) a[j][c] = _mm512_mul_ps(lanes16(acc + j * D + i + 16 * c, half), _mm512_set1_ps(corr[j]));
    for (int u = 0; u < tl->n; u++) {
        __m512 v[4];
        for (int c = 0; c < NC; c++) v[c] = load16(tl->v[u], dt, i + 16 * c, half);
        for (int j = 0; j < GJ; j++) {
            const __m512 pj = _mm512_set1_ps(p[j * TILE + u]);
            for (int c = 0; c < NC; c++) a[j][c] = _mm512_fmadd_ps(pj, v[c], a[j][c]);
        }
    }
    for (int j = 0; j < GJ; j++)
        for (int c = 0; c < NC; c++) {
            if (half)
                _mm256_storeu_ps(acc + j * D + i, _mm512_castps512_ps256(a[j][c]));
            else
                _mm512_storeu_ps(acc + j * D + i + 16 * c, a[j][c]);
        }
}

static inline __attribute__((always_inline)) void v_accumulate512(const int GJ, float *acc, const float *p,
                                                                  const float *corr, const kva_tile *tl, const int dt,
                                                                  int64_t D) {
    int64_t i = 0;
    for (; i + 64 <= D; i += 64) v_chunk512(GJ, 4, 0, acc, p, corr, tl, dt, D, i);
    for (; i + 16 <= D; i += 16) v_chunk512(GJ, 1, 0, acc, p, corr, tl, dt, D, i);
    if (i < D) v_chunk512(GJ, 1, 1, acc, p, corr, tl, dt, D, i);
}

/* tile_update256's 16-lane form. */
static inline __attribute__((always_inline)) void tile_update512(const float *q, int64_t G, int64_t D, const int dt,
                                                                 const kva_tile *tl, const int *nv, const float cap,
                                                                 float *m, float *l, float *acc, const kva_tile *next) {
    float s[MAX_QG * TILE] __attribute__((aligned(64))), p[MAX_QG * TILE] __attribute__((aligned(64))), corr[MAX_QG];
    const int n16 = (tl->n + 15) & ~15;
    const int64_t step = G > 4 ? HEADS512 : 4; /* a query group's heads: each K / V row converted once per 6 */
    for (int64_t j0 = 0; j0 < G; j0 += step) {
        switch (G - j0 < step ? G - j0 : step) { /* constant head counts: the accumulators stay in registers */
        case 6: scores512(6, q + j0 * D, D, dt, tl, nv + j0, cap, s + j0 * TILE, j0 ? NULL : next); break;
        case 5: scores512(5, q + j0 * D, D, dt, tl, nv + j0, cap, s + j0 * TILE, j0 ? NULL : next); break;
        case 4: scores512(4, q + j0 * D, D, dt, tl, nv + j0, cap, s + j0 * TILE, j0 ? NULL : next); break;
        case 3: scores512(3, q + j0 * D, D, dt, tl, nv + j0, cap, s + j0 * TILE, j0 ? NULL : next); break;
        case 2: scores512(2, q + j0 * D, D, dt, tl, nv + j0, cap, s + j0 * TILE, j0 ? NULL : next); break;
        default: scores512(1, q + j0 * D, D, dt, tl, nv + j0, cap, s + j0 * TILE, j0 ? NULL : next);
        }
    }
    for (int64_t j = 0; j < G; j++) {
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < n16; c += 16) vmax = _mm512_max_ps(vmax, _mm512_load_ps(s + j * TILE + c));
        const float mx = _mm512_reduce_max_ps(vmax), m_new = mx > m[j] ? mx : m[j];
        if (m_new == -INFINITY) { /* nothing seen yet, nothing in this tile: probabilities 0, state as it is */
            for (int c = 0; c < n16; c += 16) _mm512_store_ps(p + j * TILE + c, _mm512_setzero_ps());
            corr[j] = 1.0f;
            continue;
        }
        corr[j] = expf(m[j] - m_new);
        __m512 vsum = _mm512_setzero_ps();
        const __m512 mv = _mm512_set1_ps(m_new);
        for (int c = 0; c < n16; c += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(s + j * TILE + c), mv)); /* masked lanes: 0 */
            vsum = _mm512_add_ps(vsum, e);
            _mm512_store_ps(p + j * TILE + c, _mm512_mul_ps(e, _mm512_load_ps(tl->wv + c)));
        }
        l[j] = l[j] * corr[j] + _mm512_reduce_add_ps(vsum);
        m[j] = m_new;
    }
    for (int64_t j0 = 0; j0 < G; j0 += step) {
        switch (G - j0 < step ? G - j0 : step) {
        case 6: v_accumulate512(6, acc + j0 * D, p + j0 * TILE, corr + j0, tl, dt, D); break;
        case 5: v_accumulate512(5, acc + j0 * D, p + j0 * TILE, corr + j0, tl, dt, D); break;
        case 4: v_accumulate512(4, acc + j0 * D, p + j0 * TILE, corr + j0, tl, dt, D); break;
        case 3: v_accumulate512(3, acc + j0 * D, p + j0 * TILE, corr + j0, tl, dt, D); break;
        case 2: v_accumulate512(2, acc + j0 * D, p + j0 * TILE, corr + j0, tl, dt, D); break;
        default: v_accumulate512(1, acc + j0 * D, p + j0 * TILE, corr + j0, tl, dt, D);
        }
    }
}

#endif

#ifdef KVA_AVX2
/* span with vector tiles (8 lanes; 16 in AVX-512 builds), the same contract: the next tile is gathered
 * before the current one is computed, and its rows are prefetched while it is. */
static inline __attribute__((always_inline)) void span_tiles(const kva_args *a, const int dt, int64_t r, int64_t nq,
                                                             int64_t req, int64_t h, int64_t t0, int64_t t1, float *acc,
                                                             float *m, float *l) {
    const kva_cache *c = a->c;
    const int64_t D = c->d, G = nq * (a->s->heads / c->kv_heads);
    float qg[MAX_QG * MAX_D] __attribute__((aligned(64)));
    int64_t lim[MAX_QG];
    const float *q = item_queries(a, r, nq, h, t1, qg, lim);
    kva_tile tiles[2];
    int nv[MAX_QG], cur = 0;
    for (int64_t j = 0; j < G; j++) m[j] = -INFINITY, l[j] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)(G * D));
    if (t0 < t1) gather_tile(a, dt, req, h, t0, t1, &tiles[0]);
    for (int64_t t = t0; t < t1; cur ^= 1) {
        const kva_tile *tl = &tiles[cur], *next = t + tl->n < t1 ? &tiles[cur ^ 1] : NULL;
        if (next) gather_tile(a, dt, req, h, t + tl->n, t1, &tiles[cur ^ 1]);
        for (int64_t j = 0; j < G; j++) nv[j] = lim[j] - t >= tl->n ? tl->n : lim[j] - t > 0 ? (int)(lim[j] - t) : 0;
#ifdef KVA_AVX512
        tile_update512(q, G, D, dt, tl, nv, a->s->softcap, m, l, acc, next);
#else
        tile_update256(q, G, D, dt, tl, nv, a->s->softcap, m, l, acc, next);
#endif
        t += tl->n;
    }
}
#endif

/* One work item: queries r .. r + nq - 1 of table row req, KV head h, keys [t0, t1). The dtype is a constant
 * in each span_<dtype>, so each is its own loop, and its own function (one function holding all five took the
 * compiler twice as long). Each loop is also about a second of a machine's first compile, so a build holds the
 * dtypes in KVA_DTYPES (bit 1 << DT_x): the library kvcli loads holds fp16's, the CPU default, and any other
 * dtype is built on first need as a library of its own (-DKVA_DTYPES=1 << DT_x) whose loop this one calls
 * through kva_add_dtype (kvcli_kernels/cpu_attention.py, with_dtype). Same source, flags and structs. */
#ifndef KVA_DTYPES
#define KVA_DTYPES (1 << DT_F16)
#endif
typedef void (*kva_span_fn)(const kva_args *a, int64_t r, int64_t nq, int64_t req, int64_t h, int64_t t0, int64_t t1,
                            float *acc, float *m, float *l);
#ifdef KVA_AVX2
#define KVA_SPAN(DT) span_tiles(a, DT, r, nq, req, h, t0, t1, acc, m, l)
#else
#define KVA_SPAN(DT) span(a, DT, r, nq, req, h, t0, t1, acc, m, l)
#endif
#define KVA_SPAN_FN(NAME, DT)                                                                                   \
    static __attribute__((noinline)) void NAME(const kva_args *a, int64_t r, int64_t nq, int64_t req, int64_t h, \
                                               int64_t t0, int64_t t1, float *acc, float *m, float *l) {        \
        KVA_SPAN(DT);                                                                                           \
    }
#if KVA_DTYPES & (1 << DT_F32)
KVA_SPAN_FN(span_f32, DT_F32)
#define SPAN_F32 span_f32
#else
#define SPAN_F32 NULL
#endif
#if KVA_DTYPES & (1 << DT_F16)
KVA_SPAN_FN(span_f16, DT_F16)
#define SPAN_F16 span_f16
#else
#define SPAN_F16 NULL
#endif
#if KVA_DTYPES & (1 << DT_BF16)
KVA_SPAN_FN(span_bf16, DT_BF16)
#define SPAN_BF16 span_bf16
#else
#define SPAN_BF16 NULL
#endif
#if KVA_DTYPES & (1 << DT_I8)
KVA_SPAN_FN(span_i8, DT_I8)
#define SPAN_I8 span_i8
#else
#define SPAN_I8 NULL
#endif
#if KVA_DTYPES & (1 << DT_FP8)
KVA_SPAN_FN(span_fp8, DT_FP8)
#define SPAN_FP8 span_fp8
#else
#define SPAN_FP8 NULL
#endif
#undef KVA_SPAN_FN
#undef KVA_SPAN

#define N_DTYPES 5
/* The loop per dtype this library runs: its own, and those added by kva_add_dtype (NULL: none yet). */
static kva_span_fn spans[N_DTYPES] = {SPAN_F32, SPAN_F16, SPAN_BF16, SPAN_I8, SPAN_FP8};

/* This build's own loop for dtype dt (NULL where KVA_DTYPES leaves it out), for another library's kva_add_dtype. */
void *kva_span(int dt) { return dt >= 0 && dt < N_DTYPES && ((KVA_DTYPES >> dt) & 1) ? (void *)spans[dt] : NULL; }

/* Runs dtype dt's caches through `fn` (kva_span of a build that holds it). Returns 0, or -2 for a bad argument. */
int kva_add_dtype(int dt, void *fn) {
    if (dt < 0 || dt >= N_DTYPES || !fn) return -2;
    spans[dt] = (kva_span_fn)fn;
    return 0;
}

/* The dtypes this library runs now (bit 1 << DT_x). */
int kva_dtypes(void) {
    int mask = 0;
    for (int dt = 0; dt < N_DTYPES; dt++) mask |= spans[dt] ? 1 << dt : 0;
    return mask;
}

static void run_span(const kva_args *a, int64_t r, int64_t nq, int64_t req, int64_t h, int64_t t0, int64_t t1,
                     float *acc, float *m, float *l) {
    spans[a->c->dtype](a, r, nq, req, h, t0, t1, acc, m, l); /* (kva_decode has checked it is there) */
}

/* Rows r .. r + nq - 1's outputs for KV head h from unnormalised acc [nq g][D] and sums l. */
static void write_rows(const kva_args *a, int64_t r, int64_t nq, int64_t h, int64_t g, int64_t D, const float *acc,
                       const float *l) {
    for (int64_t i = 0; i < nq; i++) {
        float *o = a->out + row_of(a->s, r + i) * a->out_row + h * g * D;
        for (int64_t j = 0; j < g; j++) {
            const int64_t hj = i * g + j;
            const float inv = l[hj] > 0.0f ? 1.0f / l[hj] : 0.0f;
            for (int64_t e = 0; e < D; e++) o[j * D + e] = acc[hj * D + e] * inv;
        }
    }
}

/* Query r's unit: its rows (group[r]; 0 when an earlier group covers it, -1 when it cannot be one), and through
 * lo / cnt the keys the unit reads (its last row's). */
static inline int64_t unit_of(const kva_step *st, int64_t r, int64_t g, int64_t *lo, int64_t *cnt) {
    const int64_t n = st->n, rows = st->group ? st->group[r] : 1;
    *lo = *cnt = 0;
    if (rows < 0 || r + rows > n || rows * g > MAX_QG || (rows > 1 && st->window > 0)) return -1;
    if (rows == 0) return 0;
    const int64_t last = r + rows - 1, L = len_at(st, st->reqs ? st->reqs[last] : last), w = st->window;
    *lo = w > 0 && L - w > 0 ? L - w : 0;
    *cnt = L > *lo ? L - *lo : 0;
    return rows;
}

/* A unit of cnt keys in spans of whole tiles (where blocks allow), at most `want` of them and none under
 * MIN_SPAN keys (merging costs more than it saves): returns the span count, the span length through slen. */
static inline int64_t spans_of(int64_t cnt, int64_t want, int64_t *slen) {
    int64_t s = cnt / MIN_SPAN < want ? cnt / MIN_SPAN : want;
    s = s < 1 ? 1 : s;
    *slen = (cnt + s - 1) / s;
    *slen = (*slen + TILE - 1) / TILE * TILE;
    return *slen > 0 ? (cnt + *slen - 1) / *slen : 1;
}

/* Decode attention for the step's requests over one layer's cache: q, out [tokens, heads, D] with row
 * strides q_row, out_row, on up to nthreads threads. Returns 0, -1 when out of memory, -2 for
 * unsupported shapes, -4 for a KV dtype whose loop this library does not run (kva_add_dtype). */
int kva_decode(const kva_step *st, const kva_cache *c, const float *q, int64_t q_row, float *out, int64_t out_row,
               int nthreads) {
    const kva_args args = {st, c, q, out, q_row, out_row, st->scale * c->unit}, *a = &args;
    const int64_t n = st->n, kvh = c->kv_heads, D = c->d;
    if (kvh <= 0 || st->heads % kvh || st->heads / kvh > MAX_G || D % 8 || D > MAX_D || D <= 0) return -2;
    if (c->dtype < 0 || c->dtype >= N_DTYPES || !spans[c->dtype]) return -4;
    const int64_t g = st->heads / kvh;
    if (n == 0) return 0;
    /* the step's units (a query, or a query group): the work, then the thread count and items per unit */
    int64_t keys = 0, units = 0, gmax = 1, lo_r, cnt_r, slen_r;
    for (int64_t r = 0; r < n; r++) {
        const int64_t rows = unit_of(st, r, g, &lo_r, &cnt_r);
        if (rows < 0) return -2;
        keys += cnt_r * rows;
        units += rows > 0;
        gmax = rows > gmax ? rows : gmax;
    }
    const int nt = keys * st->heads * D < SERIAL_MACS || nthreads < 1 ? 1 : nthreads;
    /* about 4 items per thread, so that ragged spans still balance under dynamic scheduling */
    const int64_t want = nt > 1 ? (4 * nt + units * kvh - 1) / (units * kvh) : 1;
    int64_t items = 0, split = 0;
    for (int64_t r = 0; r < n; r++) {
        if (unit_of(st, r, g, &lo_r, &cnt_r) == 0) continue;
        const int64_t s = spans_of(cnt_r, want, &slen_r);
        items += kvh * s;
        split |= s > 1;
    }
    /* One buffer (cpu_scratch.h): per query its unit's rows (0: covered by a group), first key, key count,
     * spans, span length and first item; each item's query; each item's partial results where spans split. */
    const int64_t part = gmax * g * (D + 2); /* per item: acc [G][D], m [G], l [G] (G = the unit's heads) */
    const size_t b_plan = scratch_align(sizeof(int64_t) * (size_t)(6 * n)),
                 b_items = scratch_align(sizeof(int64_t) * (size_t)(items > 0 ? items : 1));
    int fresh;
    char *buf = (char *)scratch_take(b_plan + b_items + (split ? sizeof(float) * (size_t)(items * part) : 0), &fresh);
    if (!buf) return -1;
    int64_t *plan = (int64_t *)buf, *item_req = (int64_t *)(buf + b_plan);
    float *parts = split ? (float *)(buf + b_plan + b_items) : NULL;
    int64_t *nq = plan, *lo = plan + n, *cnt = plan + 2 * n, *nsp = plan + 3 * n, *slen = plan + 4 * n,
            *first = plan + 5 * n;
    for (int64_t r = 0, it = 0; r < n; r++) {
        nq[r] = unit_of(st, r, g, &lo[r], &cnt[r]);
        first[r] = it;
        nsp[r] = nq[r] ? spans_of(cnt[r], want, &slen[r]) : 0;
        if (!nq[r]) slen[r] = 0;
        for (int64_t i = 0; i < kvh * nsp[r]; i++) item_req[it++] = r;
    }

#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float acc[MAX_QG * MAX_D], m[MAX_QG], l[MAX_QG];
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t r = item_req[it], local = it - first[r], h = local / nsp[r], s = local % nsp[r];
            const int64_t req = st->reqs ? st->reqs[r] : r;
            const int64_t t0 = lo[r] + s * slen[r], t1 = t0 + slen[r] < lo[r] + cnt[r] ? t0 + slen[r] : lo[r] + cnt[r];
            if (nsp[r] > 1) {
                float *pa = parts + it * part;
                const int64_t G = nq[r] * g;
                run_span(a, r, nq[r], req, h, t0, t1, pa, pa + G * D, pa + G * D + G);
                continue;
            }
            run_span(a, r, nq[r], req, h, t0, t1, acc, m, l);
            write_rows(a, r, nq[r], h, g, D, acc, l);
        }
        if (split) {
#pragma omp for schedule(static)
            for (int64_t rh = 0; rh < n * kvh; rh++) {
                const int64_t r = rh / kvh, h = rh % kvh;
                if (nsp[r] < 2) continue;
                const int64_t G = nq[r] * g;
                const float *p0 = parts + (first[r] + h * nsp[r]) * part;
                for (int64_t j = 0; j < G; j++) {
                    float mx = -INFINITY, sum = 0.0f;
                    for (int64_t s = 0; s < nsp[r]; s++) {
                        const float ms = p0[s * part + G * D + j];
                        mx = ms > mx ? ms : mx;
                    }
                    float *o = acc + j * D; /* merged, unnormalised, then written by write_rows */
                    for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
                    for (int64_t s = 0; s < nsp[r]; s++) {
                        const float *ps = p0 + s * part;
                        const float w = ps[G * D + j] == -INFINITY ? 0.0f : expf(ps[G * D + j] - mx);
                        sum += ps[G * D + G + j] * w;
                        for (int64_t i = 0; i < D; i++) o[i] += ps[j * D + i] * w;
                    }
                    l[j] = sum;
                }
                write_rows(a, r, nq[r], h, g, D, acc, l);
            }
        }
    }
    scratch_give(buf, fresh);
    return 0;
}

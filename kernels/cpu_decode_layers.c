/* The decoder layers of a decode step in one call: for each layer, RMSNorm, the fused q/k/v projection,
 * rotary + KV store, decode attention, the output projection and residual add, RMSNorm, gate/up, SwiGLU,
 * down and residual add, over the step's rows (one per decoding request).
 *
 * Why: at batch 1 the arithmetic of a SmolLM2 layer is ~0.2 ms on 2 cores, and the Python around the ten
 * kernel calls (argument conversion, tensor allocation, dispatch checks) was ~30 % of the main thread's
 * time in a perf profile (libpython + libtorch_python + ctypes, 2026-12-01). This file computes nothing
 * itself beyond the residual adds: it calls the same kernels the per-op path calls (kvq_linear,
 * kvq_rmsnorm, kvr_rope_kv, kva_decode, kvs_swiglu, through function pointers the launcher takes from
 * their libraries) with the same arguments, in the same order, so the result is the per-op path's bit for
 * bit. Scratch memory is one buffer from the caller.
 * Built by kvcli_kernels/cpu_build.py like the others.
 */
#include <stdint.h>

typedef int (*linear_fn)(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, int offset, int scale_kind,
                         const void *scale, const uint16_t *scale_sup, int64_t scale_per, int min_kind,
                         const void *mins, const uint16_t *min_sup, int64_t min_per, int64_t G, int one_level,
                         int64_t N, float *y, int64_t ldy, int nthreads);
typedef int (*gemm_fn)(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, int offset, int scale_kind,
                       const void *scale, const uint16_t *scale_sup, int64_t scale_per, int min_kind, const void *mins,
                       const uint16_t *min_sup, int64_t min_per, int64_t G, int64_t N, float *y, int64_t ldy,
                       int nthreads);
typedef void (*rmsnorm_fn)(const float *x, const float *w, float *out, int64_t M, int64_t K, float eps, int nthreads);
typedef int (*rope_kv_fn)(const float *qkv, int64_t T, int64_t qkv_row, int64_t H, int64_t KVH, int64_t D,
                          const float *cos, const float *sin_signed, int64_t table_rows, const int64_t *positions,
                          const int64_t *slots, float *q_out, void *k, void *v, int dt, int64_t block_size,
                          int64_t num_slots, int64_t k_sb, int64_t k_st, int64_t k_sh, int64_t v_sb, int64_t v_st,
                          int64_t v_sh, float *ks, float *vs, int64_t s_sb, int64_t s_st, int64_t s_sh,
                          int nthreads);
typedef int (*attention_fn)(const void *step, const void *cache, const float *q, int64_t q_row, float *out,
                            int64_t out_row, int nthreads);
typedef int (*swiglu_fn)(const float *gu, int64_t M, int64_t F, int64_t row, float *out, int nthreads);

/* Mirrored by kvcli_kernels/cpu_decode_layers.py (Part, Linear, Layer, Model): keep field order and types. */
typedef struct { /* kvq_linear's weight arguments (kvcli_kernels.cpu_int8dot.weight_args), N and its route */
    const uint8_t *codes;
    int64_t bits, offset, scale_kind;
    const void *scale;
    const uint16_t *scale_sup;
    int64_t scale_per, min_kind;
    const void *mins;
    const uint16_t *min_sup;
    int64_t min_per, group_size, one_level, n;
    int64_t int8_min_rows; /* from this many rows kvq_gemm_i8 (the weight's row route), 0: never */
} kvd_part;

/* One fused projection (q/k/v, gate/up) held as up to KVD_PARTS weights of different forms (a Q4_K_M file:
 * q/k in Q4_K, v in Q6_K): each part writes its columns of the output, as LinearGroup's concatenation. */
#define KVD_PARTS 3
typedef struct {
    int64_t nparts, n; /* n: the parts' features together, the output's row stride */
    kvd_part part[KVD_PARTS];
} kvd_linear;

typedef struct {
    const float *attn_norm, *ffn_norm;
    kvd_linear qkv, o, gate_up, down;
    void *k, *v;        /* the layer's cache storage (strides are the model's) */
    float *ks, *vs;     /* an int8 / fp8 cache's scales (strides are the model's), or NULL */
    const void *cache;  /* its kva_cache (cpu_attention.c) */
    const float *q_norm, *k_norm; /* per-head RMSNorm weights [head_dim] before the rotary (Qwen3), or NULL */
    const float *attn_post_norm, *ffn_post_norm; /* on the attention / MLP output before the add (Gemma 3), or NULL */
    const float *cos, *sin_signed; /* this layer's rotary tables (Gemma 3's local layers), or NULL: the model's */
    const void *step;              /* this layer's attention step (its window), or NULL: the call's */
    const int64_t *slots;          /* this layer's KV slots (its KV group's block table), or NULL: the call's */
    const float *qkv_bias;         /* added to the q/k/v output (Qwen2's biases, q then k then v), or NULL */
} kvd_layer;

typedef struct {
    linear_fn linear;
    rmsnorm_fn rmsnorm;
    rope_kv_fn rope_kv;
    attention_fn attention;
    swiglu_fn swiglu;
    int64_t heads, kv_heads, head_dim, hidden, ffn;
    float eps;
    const float *cos, *sin_signed;
    int64_t table_rows;
    int64_t kv_dtype, block_size, num_slots, k_sb, k_st, k_sh, v_sb, v_st, v_sh;
    int64_t s_sb, s_st, s_sh; /* the scales' strides (int8 / fp8 caches; 0 otherwise) */
    gemm_fn gemm_i8;          /* kvq_gemm_i8, for parts whose route takes it at the step's rows */
} kvd_model;

/* sizeof each struct above, for the launcher's check against its ctypes mirror (cpu_build.check_structs). */
int64_t kvd_struct_size(int which) {
    switch (which) {
    case 0: return (int64_t)sizeof(kvd_part);
    case 1: return (int64_t)sizeof(kvd_linear);
    case 2: return (int64_t)sizeof(kvd_layer);
    case 3: return (int64_t)sizeof(kvd_model);
    default: return -1;
    }
}

static int linear(const kvd_model *m, const kvd_linear *w, const float *x, int64_t T, int64_t K, float *y, int nt) {
    float *col = y;
    for (int64_t p = 0; p < w->nparts; p++) {
        const kvd_part *q = w->part + p;
        if (q->int8_min_rows > 0 && T >= q->int8_min_rows) { /* as Int8DotCpu.__call__: -2, none in this build */
            const int rc = m->gemm_i8(x, T, K, q->codes, (int)q->bits, (int)q->offset, (int)q->scale_kind, q->scale,
                                      q->scale_sup, q->scale_per, (int)q->min_kind, q->mins, q->min_sup, q->min_per,
                                      q->group_size, q->n, col, w->n, nt);
            if (rc == 0) {
                col += q->n;
                continue;
            }
            if (rc != -2) return 1;
        }
        if (m->linear(x, T, K, q->codes, (int)q->bits, (int)q->offset, (int)q->scale_kind, q->scale, q->scale_sup, q->scale_per,
                      (int)q->min_kind, q->mins, q->min_sup, q->min_per, q->group_size, (int)q->one_level, q->n, col, w->n, nt))
            return 1;
        col += q->n;
    }
    return 0;
}

/* h [T, hidden] is updated in place through `n_layers` layers. scratch: T * (2 hidden + qkv + 2 q + 3 ffn)
 * floats. Returns 0, or (layer index + 1) * 16 + the failing step's code: 1 linear (no memory), 2 rotary /
 * KV store (position or slot out of range), 3 attention (no memory or an unsupported shape). */
int kvd_decode_layers(const kvd_model *m, const kvd_layer *layers, int64_t n_layers, float *h, int64_t T,
                      const int64_t *positions, const int64_t *slots, const void *step, float *scratch, int nthreads) {
    const int64_t hid = m->hidden, qd = m->heads * m->head_dim, nqkv = (m->heads + 2 * m->kv_heads) * m->head_dim;
    float *x = scratch, *qkv = x + T * hid, *q = qkv + T * nqkv, *att = q + T * qd, *gu = att + T * qd,
          *act = gu + T * 2 * m->ffn, *y = act + T * m->ffn;
    for (int64_t l = 0; l < n_layers; l++) {
        const kvd_layer *L = layers + l;
        const int64_t fail = (l + 1) * 16;
        m->rmsnorm(h, L->attn_norm, x, T, hid, m->eps, nthreads);
        if (linear(m, &L->qkv, x, T, hid, qkv, nthreads)) return fail + 1;
        if (L->qkv_bias) /* as Linear's y + bias: one fp32 add per element */
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < nqkv; i++) qkv[t * nqkv + i] += L->qkv_bias[i];
        if (L->q_norm) /* in place, every q head then every k head of each row (kvq_rmsnorm reads a row first) */
            for (int64_t t = 0; t < T; t++) {
                float *r = qkv + t * nqkv;
                m->rmsnorm(r, L->q_norm, r, m->heads, m->head_dim, m->eps, 1);
                m->rmsnorm(r + qd, L->k_norm, r + qd, m->kv_heads, m->head_dim, m->eps, 1);
            }
        if (m->rope_kv(qkv, T, nqkv, m->heads, m->kv_heads, m->head_dim, L->cos ? L->cos : m->cos,
                       L->cos ? L->sin_signed : m->sin_signed, m->table_rows, positions, L->slots ? L->slots : slots, q, L->k, L->v,
                       (int)m->kv_dtype, m->block_size, m->num_slots, m->k_sb, m->k_st, m->k_sh, m->v_sb, m->v_st,
                       m->v_sh, L->ks, L->vs, m->s_sb, m->s_st, m->s_sh, nthreads))
            return fail + 2;
        if (m->attention(L->step ? L->step : step, L->cache, q, qd, att, qd, nthreads)) return fail + 3;
        if (linear(m, &L->o, att, T, qd, y, nthreads)) return fail + 1;
        if (L->attn_post_norm) m->rmsnorm(y, L->attn_post_norm, y, T, hid, m->eps, nthreads);
        for (int64_t i = 0; i < T * hid; i++) h[i] += y[i];
        m->rmsnorm(h, L->ffn_norm, x, T, hid, m->eps, nthreads);
        if (linear(m, &L->gate_up, x, T, hid, gu, nthreads)) return fail + 1;
        m->swiglu(gu, T, m->ffn, 2 * m->ffn, act, nthreads); /* kvs_swiglu, or kvs_geglu (the same signature) */
        if (linear(m, &L->down, act, T, m->ffn, y, nthreads)) return fail + 1;
        if (L->ffn_post_norm) m->rmsnorm(y, L->ffn_post_norm, y, T, hid, m->eps, nthreads);
        for (int64_t i = 0; i < T * hid; i++) h[i] += y[i];
    }
    return 0;
}

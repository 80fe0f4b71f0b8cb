/* Rotary embedding of a step's q and k heads and the store of its k and v rows into the paged KV cache,
 * in one pass over the fused q/k/v projection output: on the CPU, what kvcli.model.layers.Rotary.apply
 * and TorchAttentionBackend.write_kv compute as about a dozen small torch ops per layer (roll, mul, add,
 * slices, index_copy_ of k and of v, a scan of the slots for negatives: ~55 us of a ~350 us SmolLM2
 * decode layer on 2 cores, AVX2, most of it per-op overhead).
 *
 * Same values, bit for bit: rotate-half with the sign folded into the sine table (sin_signed =
 * [-sin, sin]), out = x * cos + roll(x, D/2) * sin_signed as two rounded products and one rounded sum
 * (the build has -ffp-contract=off: no FMA contraction), as torch computes it; fp16 / bf16 caches get
 * round-to-nearest-even conversions, as torch's .to(); int8 / fp8 caches get kv_dtype.quantize's codes and
 * per-row scales (amax / qmax, each value divided by the scale, clamped, rounded to nearest even: IEEE
 * division and rounding, the same in C). Rows whose slot is negative are rotated but not
 * stored (padding). Positions outside the tables and slots outside the cache return an error code
 * instead of reading or writing out of bounds.
 * Built by kvcli_kernels/cpu_build.py like cpu_int8dot.c; rows are split across threads when many.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2, DT_I8 = 3, DT_FP8 = 4 }; /* cpu_attention.c's codes (kv_formats.py) */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> fp16, round to nearest even, overflow to inf, NaN kept (the conversion c10::Half uses). */
static inline uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t b = f32_bits(base);
    const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* fp32 -> bf16, round to nearest even, NaN kept quiet (as c10::BFloat16). */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = f32_bits(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* fp32 -> float8_e4m3fn, round to nearest even, subnormals kept, 480 and above NaN (quantize_row clamps to 448)
 * (the conversion c10::Float8_e4m3fn uses). */
static inline uint8_t f32_to_e4m3fn(float f) {
    uint32_t w = f32_bits(f);
    const uint32_t sign = w & 0x80000000u;
    w ^= sign;
    uint8_t r;
    if (w >= (1087u << 20)) { /* 480 and above: NaN (not reached after the clamp) */
        r = 0x7F;
    } else if (w < (121u << 23)) { /* below 2^-6: a subnormal, rounded by adding 2^-(6+3) x 2^23's magic */
        const uint32_t magic = 141u << 23;
        r = (uint8_t)(f32_bits(bits_f32(w) + bits_f32(magic)) - magic);
    } else {
        const uint32_t odd = (w >> 20) & 1u;
        w += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd;
        r = (uint8_t)(w >> 20);
    }
    return (uint8_t)(r | (sign >> 24));
}

/* kv_dtype.quantize of one row: scale = amax / qmax (0 for an all-zero row: codes 0), codes of x / scale
 * clamped to +-qmax and rounded to nearest even (int8) or converted (fp8). */
static inline void quantize_row(const float *x, int64_t n, int dt, void *dst, float *scale) {
    const float qmax = dt == DT_I8 ? 127.0f : 448.0f;
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float s = amax / qmax, safe = s > 0.0f ? s : 1.0f;
    *scale = s;
    for (int64_t i = 0; i < n; i++) {
        float y = x[i] / safe;
        y = y < -qmax ? -qmax : y > qmax ? qmax : y;
        if (dt == DT_I8)
            ((int8_t *)dst)[i] = (int8_t)nearbyintf(y);
        else
            ((uint8_t *)dst)[i] = f32_to_e4m3fn(y);
    }
}

/* n floats (a multiple of 8 for the vector path) into a cache row of dtype dt (a float one). */
static inline void store_row(const float *x, int64_t n, int dt, void *dst) {
    if (dt == DT_F32) {
        memcpy(dst, x, sizeof(float) * (size_t)n);
    } else if (dt == DT_F16) {
        uint16_t *o = (uint16_t *)dst;
        int64_t i = 0;
#if defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(o + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; i++) o[i] = f32_to_f16(x[i]);
    } else {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(x[i]);
    }
}

/* x [D] rotated into out [D]: out = x * c + roll(x, D/2) * s, roll(x, h)[i] = x[(i - h) mod D]. */
static inline void rotate(const float *restrict x, const float *restrict c, const float *restrict s, int64_t D,
                          float *restrict out) {
    const int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) {
        const float a = x[i] * c[i], b = x[i + h] * s[i];
        out[i] = a + b;
    }
    for (int64_t i = h; i < D; i++) {
        const float a = x[i] * c[i], b = x[i - h] * s[i];
        out[i] = a + b;
    }
}

/* qkv [T] rows of (H + 2 KVH) * D floats, row stride qkv_row: q heads, then k heads, then v heads.
 * cos, sin_signed: [table_rows, D] tables indexed by position. q_out: [T, H, D] contiguous.
 * k, v: the layer's cache indexed [blocks, block_size, KVH, D] with element strides (block, token, head)
 * and unit stride within a head's row; slot s is block s / block_size, token s % block_size; slots in
 * [0, num_slots). int8 / fp8 caches: ks, vs the fp32 scales [blocks, block_size, KVH] with element strides
 * s_sb, s_st, s_sh (both alike; NULL for the float dtypes). Returns 0; -2 for a position outside the tables
 * (nothing written); -3 for a slot past the cache (nothing written); -4 for an unknown dtype, an odd D or a
 * quantized cache without scales. */
int kvr_rope_kv(const float *qkv, int64_t T, int64_t qkv_row, int64_t H, int64_t KVH, int64_t D, const float *cos,
                const float *sin_signed, int64_t table_rows, const int64_t *positions, const int64_t *slots,
                float *q_out, void *k, void *v, int dt, int64_t block_size, int64_t num_slots, int64_t k_sb,
                int64_t k_st, int64_t k_sh, int64_t v_sb, int64_t v_st, int64_t v_sh, float *ks, float *vs,
                int64_t s_sb, int64_t s_st, int64_t s_sh, int nthreads) {
    const int quantized = dt == DT_I8 || dt == DT_FP8;
    if (dt < DT_F32 || dt > DT_FP8 || (quantized && (!ks || !vs)) || D % 2 || D <= 0 || D > 1024 || block_size <= 0)
        return -4;
    for (int64_t t = 0; t < T; t++) {  /* validate everything before the first write */
        if (positions[t] < 0 || positions[t] >= table_rows) return -2;
        if (slots[t] >= num_slots) return -3;
    }
    const int64_t esz = dt == DT_F32 ? 4 : quantized ? 1 : 2;
    const int nt = T * (H + 2 * KVH) * D < (1 << 16) ? 1 : nthreads;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * qkv_row;
        const float *c = cos + positions[t] * D, *s = sin_signed + positions[t] * D;
        for (int64_t hd = 0; hd < H; hd++) rotate(row + hd * D, c, s, D, q_out + (t * H + hd) * D);
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t blk = slot / block_size, off = slot % block_size;
        float kr[1024];
        for (int64_t hd = 0; hd < KVH; hd++) {
            rotate(row + (H + hd) * D, c, s, D, kr);
            char *kd = (char *)k + esz * (blk * k_sb + off * k_st + hd * k_sh);
            char *vd = (char *)v + esz * (blk * v_sb + off * v_st + hd * v_sh);
            if (quantized) {
                const int64_t si = blk * s_sb + off * s_st + hd * s_sh;
                quantize_row(kr, D, dt, kd, ks + si);
                quantize_row(row + (H + KVH + hd) * D, D, dt, vd, vs + si);
            } else {
                store_row(kr, D, dt, kd);
                store_row(row + (H + KVH + hd) * D, D, dt, vd);
            }
        }
    }
    return 0;
}

/* Per-call scratch memory kept per calling thread between calls (cpu_int8dot.c's kvq_linear and kvq_gemm_i8,
 * cpu_attention.c's kva_decode): a decode step calls each of them once per layer with buffers of a few KB, and
 * allocating and freeing them each time (malloc / calloc, up to seven a call) was about 2.7 % of the main thread's
 * samples in a perf profile of the bundled model's decode (2-core Xeon, 2026-12-07, ad hoc), time the other thread
 * spends waiting. A call takes one buffer (scratch_take) and carves its arrays from it; up to SCRATCH_KEEP bytes
 * stay with the thread for its next call (released at the thread's exit), larger requests (prefill chunks) are
 * allocated and freed as before. A call must not take scratch while a call on the same thread holds it: none of
 * these kernels calls another, and a kernel's OpenMP threads use the parts of its caller's buffer it hands them.
 * Each library that includes this header holds its own buffers. kvcli_kernels/cpu_build.py hashes the cpu_*.h
 * headers into every build's cache key. */
#ifndef KVCLI_CPU_SCRATCH_H
#define KVCLI_CPU_SCRATCH_H
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define SCRATCH_KEEP ((size_t)4 << 20)

typedef struct {
    void *p;
    size_t n;
} scratch_kept;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_ok; /* the key was created */

static void scratch_drop(void *v) {
    scratch_kept *k = (scratch_kept *)v;
    free(k->p);
    free(k);
}

static void scratch_init(void) { scratch_ok = pthread_key_create(&scratch_key, scratch_drop) == 0; }

/* bytes rounded up to a multiple of 64: an array's share of a buffer, so that the next one starts aligned. */
static inline size_t scratch_align(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

/* A 64-byte aligned buffer of at least `bytes` (contents undefined), or NULL when out of memory. *fresh is set
 * when the buffer is the caller's to hand back with scratch_give (larger than SCRATCH_KEEP, or no thread
 * store); otherwise it is this thread's kept buffer. */
static inline void *scratch_take(size_t bytes, int *fresh) {
    bytes = scratch_align(bytes ? bytes : 1);
    *fresh = 1;
    if (bytes > SCRATCH_KEEP || pthread_once(&scratch_once, scratch_init) != 0 || !scratch_ok)
        return aligned_alloc(64, bytes);
    scratch_kept *k = (scratch_kept *)pthread_getspecific(scratch_key);
    if (!k) {
        k = (scratch_kept *)calloc(1, sizeof(scratch_kept));
        if (!k || pthread_setspecific(scratch_key, k) != 0) {
            free(k);
            return aligned_alloc(64, bytes);
        }
    }
    if (k->n < bytes) {
        void *p = aligned_alloc(64, bytes);
        if (!p) return NULL;
        free(k->p);
        k->p = p, k->n = bytes;
    }
    *fresh = 0;
    return k->p;
}

static inline void scratch_give(void *p, int fresh) {
    if (fresh) free(p);
}
#endif

"""How many multiply-accumulates per cycle this CPU's AVX2 integer dot-product instructions give, against
fp32 FMA: the ceiling of kvcli's int8dot kernel (two int8 activation levels = two maddubs per 4 products
per lane) relative to an fp32 GEMM (what transformers' prefill runs, and kvcli's read-back path).

  python scripts/probe_int8_throughput.py

Compiles a small C loop (cc -O2 -mavx2 -mfma) of 12 independent chains per instruction and prints ns per
instruction and MACs per ns: vpmaddubsw (32 u8 x s8 products) + vpaddw, vpmaddwd (16 s16 x s16) + vpaddd,
vfmadd231ps (8 fp32). One thread; the ratios are what matters (clock-independent).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(void) {
    const long n = 100000000;
    __m256i x8 = _mm256_set1_epi8(5), acc16[12], w8[12], acc32[12], w16[12];
    __m256 f[12], fa = _mm256_set1_ps(1.0001f), fb = _mm256_set1_ps(0.9999f);
    for (int j = 0; j < 12; j++) {
        acc16[j] = _mm256_set1_epi16(j); w8[j] = _mm256_set1_epi8(j);
        acc32[j] = _mm256_set1_epi32(j); w16[j] = _mm256_set1_epi16(j); f[j] = _mm256_set1_ps(j);
    }
    double t = now();
    for (long i = 0; i < n; i++)
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) acc16[j] = _mm256_add_epi16(acc16[j], _mm256_maddubs_epi16(w8[j], x8));
    double t_maddubs = (now() - t) / n / 12 * 1e9;
    t = now();
    for (long i = 0; i < n; i++)
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) acc32[j] = _mm256_add_epi32(acc32[j], _mm256_madd_epi16(w16[j], x8));
    double t_madd = (now() - t) / n / 12 * 1e9;
    t = now();
    for (long i = 0; i < n; i++)
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) f[j] = _mm256_fmadd_ps(f[j], fa, fb);
    double t_fma = (now() - t) / n / 12 * 1e9;
    int sink = 0; float fs = 0;
    for (int j = 0; j < 12; j++) { sink += _mm256_extract_epi16(acc16[j], 0) + _mm256_extract_epi32(acc32[j], 0); fs += _mm256_cvtss_f32(f[j]); }
    printf("%.4f %.4f %.4f %d %g\n", t_maddubs, t_madd, t_fma, sink & 1, fs > 0 ? 0.0 : 1.0);
    return 0;
}
"""


def main() -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from kvcli.bench.machine import machine_line

    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "probe.c"), os.path.join(d, "probe")
        with open(src, "w") as f:
            f.write(SOURCE)
        try:
            subprocess.run(["cc", "-O2", "-mavx2", "-mfma", src, "-o", exe], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"error: cannot build the probe with cc -mavx2 -mfma: {e}", file=sys.stderr)
            return 1
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout.split()
    t_maddubs, t_madd, t_fma = (float(v) for v in out[:3])
    print(f"# probe_int8_throughput {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"# {machine_line()}")
    print("| instruction (256-bit) | products | ns per instruction | MACs per ns |")
    print("|---|---:|---:|---:|")
    rows = [("vpmaddubsw + vpaddw (u8 x s8)", 32, t_maddubs), ("vpmaddwd + vpaddd (s16 x s16)", 16, t_madd),
            ("vfmadd231ps (fp32)", 8, t_fma)]
    for name, products, t in rows:
        print(f"| {name} | {products} | {t:.3f} | {products / t:.1f} |")
    fma = 8 / t_fma
    print(f"one int8 level (maddubs) / fp32 FMA: {32 / t_maddubs / fma:.2f}x MACs per ns")
    print(f"two int8 levels (kvcli's int8dot: two maddubs per product) / fp32 FMA: {16 / t_maddubs / fma:.2f}x")
    print(f"int16 activations (madd) / fp32 FMA: {16 / t_madd / fma:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

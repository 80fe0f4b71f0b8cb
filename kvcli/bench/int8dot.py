"""Per-linear timings of kvcli's int8dot CPU kernel against torch's packed int4 kernel (int4-cpu), the
read-back + torch GEMM, kvcli's fused fp32 GEMM (weight panels dequantized on the fly; AVX2 builds
take it from GEMM_F32_MIN_ROWS rows) and its bf16 GEMM on AMX tiles (where the CPU has AMX-BF16: the
engine takes it from INT8DOT_DENSE_MIN_ROWS rows instead of the read-back), on SmolLM2-135M's linear shapes and its vocabulary projection,
with the error of each against a float64 reference. Where the CPU has AMX-INT8, the int8dot kernel is
timed twice: its dpbusd loop, and its integer sums on AMX tiles (the same outputs, bit for bit; the
engine takes the tiles by weight_plan.int8dot_tiles' rule); both at two activation levels, and beside them the
small-row loop at one level, which the engine runs for Q4_0 / Q4_1 forms where its int8 GEMM takes them (the
route's one_level). A second table times the many-row integer GEMM with
one int8 level of activations (kvq_gemm_i8: the engine takes it from INT8_GEMM_MIN_ROWS rows for 4-bit codes on
CPUs without AMX) beside the float routes it replaces, with its error against the exact float64 product (its
rounding of x, not a kernel error). Run it twice to see both ISAs:

  python -m kvcli.bench int8dot-ops
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m kvcli.bench int8dot-ops

Times are wall ms per call, best of 3 batches of --calls calls each, after a warm-up, at the torch thread
count (2 here). Weights are random (Q4_1-style for layers, Q8_0 for the vocabulary table): speed does not
depend on the values.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kvcli.bench import harness


# Per --shape: the [N, K] linears and the row counts measured.
LINEARS = {
    "smollm2": (((960, 576), (576, 576), (3072, 576), (576, 1536)), (1, 4, 16, 64, 128, 256, 512)),
    "1b": (((2048, 2048), (8192, 2048), (2048, 8192)), (1, 4, 5, 6, 8, 16, 24, 32, 48, 64, 128, 256, 512)),
}


def best_ms(fn, calls: int) -> float:
    """Best of 3 timings of `calls` calls, ms per call, after a warm-up call."""
    return harness.best_ms(fn, 3, calls)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def many_row(ours, x: torch.Tensor, ref: torch.Tensor, t_rb: float, t_f: float | None, calls: int) -> str | None:
    """One row of the many-row table (None where the build has no int8 GEMM)."""
    from kvcli_kernels.cpu_int8dot import int8dot_gemm_i8

    n = ours.out_features
    y = int8dot_gemm_i8(ours.lib, x, ours.args, n)
    if y is None:
        return None
    t_i8 = best_ms(lambda: int8dot_gemm_i8(ours.lib, x, ours.args, n), calls)
    f_cols = ("n/a", "n/a") if t_f is None else (f"{t_f:.3f}", f"{t_i8 / t_f:.2f}x")
    return (f"| {n} x {x.shape[1]} | {len(x)} | {t_i8:.3f} | {t_rb:.3f} | {f_cols[0]} | {t_i8 / t_rb:.2f}x | "
            f"{f_cols[1]} | {rel_err(y, ref):.1e} |")


def print_many(rows: list[str | None]) -> None:
    if not rows or None in rows:
        print("\nint8 GEMM (kvq_gemm_i8): n/a in this build")
        return
    print("\n| weight [N x K] | rows | int8 GEMM ms | read-back + GEMM ms | fused fp32 GEMM ms | int8 / read-back | "
          "int8 / fused | int8 GEMM rel. error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


def main_many(a, shapes, row_counts: list[int], gen: torch.Generator) -> None:
    """--many-rows: the int8 GEMM beside the read-back + GEMM and the fused fp32 GEMM (Q4_1-style weights, as the
    table above; Q4_0's offset costs one integer subtraction a block)."""
    from kvcli.bench.internals import Int8DotCpu, quantize_q4
    from kvcli_kernels.cpu_int8dot import int8dot_gemm_f32

    out = []
    for n, k in shapes:
        q = quantize_q4(torch.randn(n, k, generator=gen) * 0.02)
        ours = Int8DotCpu(q)
        w = q.dequantize().double()
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen)
            t_rb = best_ms(lambda: F.linear(x.to(ours.dense_dtype), ours.dense(ours.dense_dtype)), a.calls)
            fused = int8dot_gemm_f32(ours.lib, x, ours.args, n)
            t_f = best_ms(lambda: int8dot_gemm_f32(ours.lib, x, ours.args, n), a.calls) if fused is not None else None
            out.append(many_row(ours, x, x.double() @ w.t(), t_rb, t_f, a.calls))
    print_many(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--shape", choices=sorted(LINEARS), default="smollm2",
                    help="whose linear shapes: SmolLM2-135M's (default) or the 1B shape's (kvcli/bench/shapes.py), "
                         "at row counts around where the read-back starts to pay")
    ap.add_argument("--many-rows", action="store_true",
                    help="only the many-row table: the int8 GEMM beside the float routes, from 32 rows")
    a = ap.parse_args(argv)
    from kvcli.bench.internals import Int4Cpu
    from kvcli.bench.internals import Int8DotCpu, native_library, restore_tiles, tile_rule
    from kvcli_kernels.cpu_int8dot import int8dot_gemm_bf16, int8dot_gemm_f32, int8dot_gemm_i8
    from kvcli.bench.internals import QuantTensor, RowRoute, quantize_q4

    lib = native_library()
    if lib is None:
        print("kvcli's C kernel is not available here: nothing to compare")
        return
    tiles = tile_rule() is not None
    print(f"int8dot on AMX tiles: {'measured beside the dpbusd loop' if tiles else 'n/a (no AMX-INT8 here, or KVCLI_AMX=0)'}")

    def on_tiles(fn):
        """fn run with the kernel's integer sums on AMX tiles at every row count."""
        lib.kvq_amx_enable(1, 0, 1)
        try:
            return fn()
        finally:
            lib.kvq_amx_enable(0, 0, 0)

    lib.kvq_amx_enable(0, 0, 0)  # the dpbusd loop, unless on_tiles
    gen = torch.Generator().manual_seed(0)
    shapes, row_counts = LINEARS[a.shape]
    if a.many_rows:
        main_many(a, shapes, [r for r in row_counts if r >= 32], gen)
        return
    print("\n(int8dot and its AMX tiles: two activation levels; one level: the engine's small-row loop for Q4_0 / Q4_1 "
          "forms where its int8 GEMM takes them, weight_plan.int8dot_route's one_level; n/a where it does not)")
    print("\n| weight [N x K] | rows | int8dot ms | AMX tiles ms | one level ms | int4-cpu ms | read-back + GEMM ms | "
          "fused fp32 GEMM ms | int8dot / int4-cpu | tiles / int8dot | fused / int8dot | int8dot rel. error | "
          "int4-cpu rel. error | fused rel. error | AMX bf16 GEMM ms | AMX GEMM / read-back |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    many = []  # the int8 GEMM's rows, printed after
    for n, k in shapes:
        q = quantize_q4(torch.randn(n, k, generator=gen) * 0.02)
        ours = Int8DotCpu(q, route=RowRoute())  # two levels (one kernel, no one_level): what the AMX tiles serve
        one = Int8DotCpu(q).kernel_at_every_row_count()  # the engine's rounding of this form
        torch4 = Int4Cpu(q.unpack_codes(), q.group_scales(), q.group_mins(), q.group_size)
        w = q.dequantize().double()
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen)
            ours.kernel_at_every_row_count()  # each kernel itself at every row count
            torch4.dense_min_rows = None
            t_ours, t_t4 = best_ms(lambda: ours(x), a.calls), best_ms(lambda: torch4(x), a.calls)
            t_amx = on_tiles(lambda: best_ms(lambda: ours(x), a.calls)) if tiles else None
            if tiles and not torch.equal(on_tiles(lambda: ours(x)), ours(x)):
                raise SystemExit(f"int8dot on AMX tiles differs from its dpbusd loop at {n} x {k}, {rows} rows")
            amx_cols = ("n/a", "n/a") if t_amx is None else (f"{t_amx:.3f}", f"{t_amx / t_ours:.2f}x")
            t_one = f"{best_ms(lambda: one(x), a.calls):.3f}" if one.one_level else "n/a"
            rb = one.dense_dtype  # the engine's read-back dtype (the two-level object's route has none)
            t_rb = best_ms(lambda: F.linear(x.to(rb), one.dense(rb)), a.calls)
            ref = x.double() @ w.t()
            fused = int8dot_gemm_f32(ours.lib, x, ours.args, n)  # None: not in this build
            t_f = best_ms(lambda: int8dot_gemm_f32(ours.lib, x, ours.args, n), a.calls) if fused is not None else None
            f_cols = ("n/a", "n/a", "n/a") if t_f is None else (f"{t_f:.3f}", f"{t_f / t_ours:.2f}x",
                                                              f"{rel_err(fused, ref):.1e}")
            has_bf16 = int8dot_gemm_bf16(ours.lib, x, ours.args, n) is not None
            t_b = best_ms(lambda: int8dot_gemm_bf16(ours.lib, x, ours.args, n), a.calls) if has_bf16 else None
            b_cols = ("n/a", "n/a") if t_b is None else (f"{t_b:.3f}", f"{t_b / t_rb:.2f}x")
            if rows >= 32:
                many.append(many_row(ours, x, ref, t_rb, t_f, a.calls))
            print(f"| {n} x {k} | {rows} | {t_ours:.3f} | {amx_cols[0]} | {t_one} | {t_t4:.3f} | {t_rb:.3f} | "
                  f"{f_cols[0]} | {t_ours / t_t4:.2f}x | {amx_cols[1]} | {f_cols[1]} | {rel_err(ours(x), ref):.1e} | "
                  f"{rel_err(torch4(x), ref):.1e} | {f_cols[2]} | {b_cols[0]} | {b_cols[1]} |")
    print_many(many)
    # The vocabulary projection: a Q8_0 table, int8dot as stored vs the bf16 GEMM it replaced.
    n, k = 49152, shapes[0][1]  # the hidden size
    wt = torch.randn(n, k, generator=gen) * 0.05
    d = (wt.view(n, k // 32, 32).abs().amax(-1) / 127).half()
    codes = torch.round(wt.view(n, k // 32, 32) / d.float().unsqueeze(-1)).clamp(-127, 127).to(torch.int8).view(n, k)
    table = QuantTensor("q8", codes, d, None, 32)
    head = Int8DotCpu(table)
    head.kernel_at_every_row_count()
    wb = table.dequantize().to(torch.bfloat16)
    print(f"\n| vocabulary projection {n} x {k} | rows | int8dot (Q8_0 as stored) ms | AMX tiles ms | bf16 GEMM ms | "
          "fused fp32 GEMM ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for rows in (1, 2, 3, 4, 6, 8, 16, 64):
        x = torch.randn(rows, k, generator=gen)
        has_fused = int8dot_gemm_f32(head.lib, x, head.args, n) is not None
        t_f = f"{best_ms(lambda: int8dot_gemm_f32(head.lib, x, head.args, n), 5):.2f}" if has_fused else "n/a"
        t_amx = f"{on_tiles(lambda: best_ms(lambda: head(x), 5)):.2f}" if tiles else "n/a"
        print(f"| | {rows} | {best_ms(lambda: head(x), 5):.2f} | {t_amx} | "
              f"{best_ms(lambda: F.linear(x.bfloat16(), wb), 5):.2f} | {t_f} |")
    restore_tiles(lib)  # as the engine runs

#!/usr/bin/env python
"""Correctness and speed of the kvcli Triton kernels on one CUDA GPU (random data, no model files).

  python scripts/gpu_check.py --out gpu.md     # full run: one process per section, each time-capped
  python scripts/gpu_check.py --dry-run        # no GPU: kernel variants to compile, work, time budget
  python scripts/gpu_check.py --quick          # fewer sizes
  python scripts/gpu_check.py --sections bd    # only some sections (a rerun after a partial run)
  python scripts/gpu_check.py --cpu-smoke      # tiny correctness run under TRITON_INTERPRET=1 (no GPU)

Needs only torch and triton: kernels/ is loaded as the package `kvcli_kernels` and kvcli itself
straight from this checkout, so nothing has to be pip-installed. Section (d) uses numpy and, when
present, nvidia-ml-py (memory probe) and transformers (its baseline); where kvcli cannot be
imported, (d) is reported as skipped, not failed.
Sections, run in this order (of value: correctness first, the long engine run last):
  (a) every kernel vs the torch reference in bf16 and fp16 at model-like sizes;
  (b) decode attention (32 q / 8 KV heads, head_dim 128, page 16, bf16) for batch {1, 8, 64} x
      context {1k, 8k, 32k}: achieved bandwidth = bytes of K, V and q read / kernel time, as % of
      the measured device-to-device copy bandwidth (read + write bytes), split-K off and on, against
      torch SDPA (flash backend forced, the backend used is recorded) on the same K/V laid out
      contiguously (enable_gqa);
  (c) INT4 GEMM vs fp16 torch.matmul at batch 1 and 16; weights are [N, K] (out = x @ W^T), for
      N x K = 4096x4096, 14336x4096 (gate/up shape) and 4096x14336 (down shape); then at batch 1 the
      forms the engine holds K-quant GGUF weights in (Q4_K: nibbles + float32 scale and min per 32;
      Q6_K: int8 codes + float32 scale per 16; Q8_0: int8 codes + float32 scale per 32), their
      achieved bandwidth against the Q4_1 form's (issue: bring your own INT4 model, goal >= 70 %);
  (e) decode attention per KV cache dtype (issue: KV precision): the paged-attention kernel over
      fp16, int8 and fp8 (e4m3) caches (fp16 queries, same shape as (b), auto split) for batch
      {1, 8} x context {8k, 32k}: time, achieved bandwidth (codes + scales + q bytes read), and
      the time ratio against the fp16 cache; each output checked against the torch reference on
      the dequantized K/V. fp8 rows need compute capability >= 8.9 (marked skipped below that);
  (g) decode with and without CUDA graphs on llama-3-8b shapes (random INT4), batch 1 and 32;
  (d) the engine end to end on random INT4 weights (scripts/gpu_engine_check.py): triton vs torch
      backend logits and greedy tokens, paged vs contiguous greedy tokens, graph vs eager decode, and
      a ShareGPT-shaped trace paged vs contiguous under one KV budget (with the KV breakdown and a
      capture of the live view);
  (h) transformers on the same shapes: batch-1 decode, the same trace one request at a time, in
      static batches and through its continuous batching (each mode time-limited).
Goals summaries (the kernel targets and issue #28's engine targets, judged on the measured rows) close
the report.
Isolation: with more than one section, this process only drives: each section runs in its own
process with its own time cap (--section-seconds), so a sticky CUDA error, a crash or a timeout
costs that section only. Every case is guarded (a failure is a FAIL row with its message) and
the report (--out) is rewritten after every case, so a run cut short keeps every finished row.
Timing: each measured call is captured in a CUDA graph (no Python launch overhead in the number;
rows where capture failed say "eager"), and inputs rotate over enough copies (>= 256 MB in total)
that every call reads from HBM, not L2.
Exit status: 0 all correct, 1 a check failed or a section did not finish, 2 no CUDA device /
triton missing.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ROTATE_BYTES = 256 * 2**20  # > H200 L2 (50 MB) several times over
ORDER = "abcegdh"  # order of value: correctness, attention, INT4, KV dtypes, graphs, the engine, transformers
# Per-section wall-clock caps (process start and cold compiles included): 495 s in all, the budget of
# one run in a 15-minute device window (the machine's start included) that must leave time for a rerun.
DEFAULT_CAPS = {"a": 55.0, "b": 70.0, "c": 35.0, "e": 30.0, "g": 80.0, "d": 130.0, "h": 95.0}
SECTION_NAMES = {"a": "correctness", "b": "decode attention", "c": "int4 gemm", "e": "decode attention per KV dtype",
                 "g": "CUDA graphs", "d": "engine", "h": "transformers baselines"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes (about a minute)")
    p.add_argument("--out", metavar="FILE.md", help="also write the report as markdown to this file (after every case)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: run the correctness section at tiny sizes under the Triton interpreter")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: count the kernel variants each section compiles and its work, time one "
                        "compile per kernel here, and print the time budget")
    p.add_argument("--sections", default=ORDER, metavar="LETTERS",
                   help=f"which sections to run (default {ORDER}): a kernel correctness, b decode attention speed, "
                        "c INT4 GEMM speed, e decode attention per KV dtype (fp16/int8/fp8), g decode with and "
                        "without CUDA graphs, d the engine end to end, h transformers on the same shapes")
    p.add_argument("--section-seconds", default=",".join(f"{k}={v:g}" for k, v in DEFAULT_CAPS.items()),
                   metavar="a=S,b=S,...", help="wall-clock cap of each section's process (default %(default)s)")
    p.add_argument("--engine-seconds", type=float, default=60.0, metavar="S",
                   help="time limit for section (d)'s workload runs; cut runs report what finished (default 60)")
    p.add_argument("--in-process", action="store_true",
                   help="run the sections in this process (no isolation; for debugging)")
    p.add_argument("--state", metavar="DIR", help=argparse.SUPPRESS)  # the driver's shared state folder
    p.add_argument("--inject-failure", action="append", default=[], metavar="CASE",
                   help=argparse.SUPPRESS)  # tests: the case whose name contains CASE raises
    args = p.parse_args(argv)
    if not args.sections or set(args.sections) - set(ORDER):
        p.error(f"--sections takes letters from {ORDER} (got {args.sections!r})")
    args.sections = "".join(c for c in ORDER if c in args.sections)
    caps = dict(DEFAULT_CAPS)
    for item in filter(None, args.section_seconds.split(",")):
        key, _, val = item.partition("=")
        try:
            caps[key.strip()] = float(val)
        except ValueError:
            p.error(f"--section-seconds takes a=SECONDS,b=... (got {item!r})")
        if key.strip() not in DEFAULT_CAPS or caps[key.strip()] <= 0:
            p.error(f"--section-seconds: unknown section or non-positive time in {item!r}")
    args.caps = caps
    if args.engine_seconds <= 0:
        p.error("--engine-seconds must be positive")
    return args


def load_kernels() -> dict[str, ModuleType]:
    """Import kernels/ of this checkout as `kvcli_kernels` (works without pip install)."""
    if str(REPO) not in sys.path:  # kernels/kv_formats.py reads kvcli's KV formats
        sys.path.insert(0, str(REPO))
    if "kvcli_kernels" not in sys.modules:  # kernels/ is a namespace folder (no __init__.py): a package of its path
        pkg = ModuleType("kvcli_kernels")
        pkg.__path__ = [str(REPO / "kernels")]
        sys.modules["kvcli_kernels"] = pkg
    names = ("cache_write", "paged_attention", "int4_gemm", "reference")
    return {n: importlib.import_module(f"kvcli_kernels.{n}") for n in names}


# --------------------------------------------------------------------------------------------- timing


def time_us(fns: list[Callable[[], Any]], torch: ModuleType, device: Any, reps: int = 5) -> tuple[float, bool]:
    """(median microseconds per call of fns, called round-robin, replayed from a CUDA graph; whether
    the graph was used: False = capture failed and the calls were timed eagerly, launch overhead included).

    Without CUDA (--cpu-smoke) the calls are just run and wall-clock timed: that only exercises the
    code path, the number means nothing.
    """
    for f in fns:  # compile + allocator warm-up outside the capture
        f()
    calls = max(len(fns), 8)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(fns), False
    torch.cuda.synchronize()
    graphed = True
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(calls):
                fns[i % len(fns)]()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fns[i % len(fns)]()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - fall back to eager timing (includes launch overhead)
        print(f"  (CUDA graph capture failed: {type(exc).__name__}: {exc}; timing eagerly)", flush=True)
        torch.cuda.synchronize()
        graphed = False

        def run() -> None:
            for i in range(calls):
                fns[i % len(fns)]()

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2], graphed


def copies_for(nbytes: int, device: Any) -> int:
    """How many copies of an input to rotate over so that consecutive calls miss in L2."""
    if device.type != "cuda":
        return 1
    return max(1, min(64, -(-ROTATE_BYTES // max(nbytes, 1))))


def copy_bandwidth(torch: ModuleType, device: Any, nbytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    us, _ = time_us([lambda: dst.copy_(src)], torch, device)
    del src, dst
    return 2 * nbytes / (us * 1e-6)


# ------------------------------------------------------------------------------------ guarded cases

TOL = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 3e-2}  # attention atol = rtol
INT4_REL_TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


class SectionAborted(Exception):
    """The CUDA context is unusable after an error: the rest of the section cannot run in this process."""


def _msg(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


class Run:
    """The rows of the sections this process runs. After every case they are saved as JSON in the
    state folder (one file per section) and the whole report is re-rendered from all those files,
    so what a killed or crashed process had finished is never lost."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], state: Path) -> None:
        self.args, self.env, self.state = args, env, state
        self.data: dict[str, dict[str, Any]] = {}

    def section(self, letter: str) -> dict[str, Any]:
        self.data[letter] = dict(correct=[], decode=[], int4=[], forms=[], sweep=[], kvdtype=[], engine=None, copy_bw=0.0,
                                 notes=[], done=False)
        return self.data[letter]

    def save(self) -> None:
        for letter, d in self.data.items():
            (self.state / f"{letter}.json").write_text(json.dumps(d))
        write_report(self.state, self.args, self.env)

    def case(self, letter: str, name: str, fn: Callable[[], None], on_fail: Callable[[str], None]) -> bool:
        """Runs one case; an exception becomes on_fail(message) (a FAIL row). Saves either way."""
        ok = True
        try:
            if any(x and x in name for x in self.args.inject_failure):
                raise RuntimeError(f"injected failure in {name!r}")
            fn()
        except Exception as exc:  # noqa: BLE001 - one case's error must not end the section
            ok = False
            print(f"  FAIL {name}: {_msg(exc)}", flush=True)
            on_fail(_msg(exc))
            _raise_if_cuda_lost(exc)
        finally:
            self.save()
        return ok


def _raise_if_cuda_lost(exc: BaseException) -> None:
    import torch

    if not torch.cuda.is_available():
        return
    try:
        torch.cuda.synchronize()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception as again:  # noqa: BLE001 - a sticky error (illegal address, ...) repeats here
        raise SectionAborted(f"CUDA context unusable after {_msg(exc)} ({_msg(again)})") from None


def add_row(rows: list[dict[str, Any]], kernel: str, case: str, dtype: Any, err: float, tol: float,
            note: str = "") -> None:
    """One correctness row, printed as it comes; NaN error or a note (the error message) fails it."""
    ok = err <= tol and err == err and not note
    rows.append(dict(kernel=kernel, case=case, dtype=str(dtype).replace("torch.", ""), err=err, tol=tol, ok=ok,
                     note=note))
    print(f"  {'ok  ' if ok else 'FAIL'} {kernel:16s} {case:44s} {rows[-1]['dtype']:9s} err={err:.3g} tol={tol:.3g}"
          + (f" {note}" if note else ""), flush=True)


def recorder(rows: list[dict[str, Any]]) -> Callable[..., None]:
    """record(kernel, case, dtype, err, tol): one correctness row (section d's interface)."""
    return lambda *a, **k: add_row(rows, *a, **k)


# -------------------------------------------------------------------------------------------- plans
# What each section runs, shared by the real run and --dry-run (which launches the same shapes on
# meta tensors with the kernels swapped for recorders).


def plan_a(tiny: bool) -> dict[str, Any]:
    if tiny:
        attn = [("GQA 4, D 32, page 16", [1, 1, 9], [40, 3, 9 + 20], 8, 2, 32, 16)]
        return dict(write=(20, 2, 32, 16, 4), attn=attn, int4=[(1, 32, 128), (12, 48, 96)])
    attn = [
        ("GQA 4, D 128, page 16, 6 dec + 2 pre", [1] * 6 + [300, 1000],
         [4097, 1, 33, 9000, 16, 2500, 2300, 1000], 32, 8, 128, 16),
        ("GQA 3, D 128, page 32", [1, 1, 257], [32768, 777, 1500], 24, 8, 128, 32),
        ("GQA 1, D 64, page 64", [1, 1, 64], [3000, 65, 500], 16, 16, 64, 64),
    ]
    return dict(write=(8192, 8, 128, 16, 4096), attn=attn,
                int4=[(1, 4096, 4096), (7, 4096, 4096), (16, 14336, 4096), (16, 4096, 14336), (200, 4096, 4096)])


def plan_bc(args: argparse.Namespace) -> dict[str, Any]:
    if args.cpu_smoke:  # walk the benchmark code at toy sizes; the numbers mean nothing
        return dict(batches=(1, 2), contexts=(64,), shapes=((64, 128),), int4_m=(1, 16), copy_bytes=2**20,
                    sweep_shapes=((64, 128),), split_sweep=(2,))
    if args.quick:
        return dict(batches=(1, 8), contexts=(1024, 8192), shapes=((4096, 4096),), int4_m=(1, 16, 64),
                    copy_bytes=2**30, sweep_shapes=((4096, 4096),), split_sweep=SPLIT_SWEEP)
    return dict(batches=(1, 8, 64), contexts=(1024, 8192, 32768),
                shapes=((4096, 4096), (14336, 4096), (4096, 14336)), int4_m=(1, 16, 32, 64), copy_bytes=2**30,
                sweep_shapes=((4096, 4096), (28672, 4096), (4096, 14336)), split_sweep=SPLIT_SWEEP)


def plan_e(args: argparse.Namespace) -> dict[str, Any]:
    if args.cpu_smoke:
        return dict(batches=(1,), contexts=(64,))
    if args.quick:
        return dict(batches=(1, 8), contexts=(8192,))
    return dict(batches=(1, 8), contexts=(8192, 32768))


KV_DTYPES_E = ("fp16", "int8", "fp8")  # section (e); fp16 first: the others' ratio is against it
# Section (b): split counts timed at small batches, where the heuristic's choice ran at 0.77-0.88x SDPA flash
# (batch 1 at 32k, batch 8) on the H200.
SPLIT_SWEEP = (2, 4, 8, 16, 32, 64)
SPLIT_SWEEP_MAX_BATCH = 8
SPLITS_A = (None, 1, 8)  # section (a): automatic, off, forced 8
DECODE_SHAPE = dict(hq=32, hkv=8, d=128, bs=16)  # section (b)


# ------------------------------------------------------------------------------------ (a) correctness


def _paged_batch(torch, q_lens, seq_lens, hq, hkv, d, bs, dtype, device, gen):
    need = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen, device="cpu")
    table = torch.zeros(len(seq_lens), max(need) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    k = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype).to(device)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(dtype).to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k, v, cu, sl, table.to(device)


def section_a(run: Run, mods: dict[str, ModuleType], device: Any) -> None:
    import torch

    cw, pa, ig, ref = mods["cache_write"], mods["paged_attention"], mods["int4_gemm"], mods["reference"]
    sec = run.section("a")
    rows = sec["correct"]
    plan = plan_a(run.args.cpu_smoke)
    gen = torch.Generator().manual_seed(0)

    for dtype in (torch.bfloat16, torch.float16):
        dname = str(dtype).replace("torch.", "")
        # write_kv_cache: a prefill-sized scatter into a NaN pool, bit-exact.
        t, hkv, d, bs, nb = plan["write"]
        wname = f"{t} tokens, {hkv}x{d}, page {bs}"

        def write_case() -> None:
            key = torch.randn(t, hkv, d, generator=gen).to(dtype).to(device)
            val = torch.randn(t, hkv, d, generator=gen).to(dtype).to(device)
            slots = torch.randperm(nb * bs, generator=gen)[:t]
            slots[::7] = -1
            slots = slots.to(device)
            kc = torch.full((nb, bs, hkv, d), float("nan"), dtype=dtype, device=device)
            vc = torch.full_like(kc, float("nan"))
            cw.write_kv_cache(key, val, kc, vc, slots)
            valid = slots >= 0
            blk, off = slots[valid] // bs, slots[valid] % bs
            bad = int((kc[blk, off] != key[valid]).sum() + (vc[blk, off] != val[valid]).sum())
            untouched = int(kc.isnan().any(-1).any(-1).sum()) == nb * bs - int(valid.sum())
            add_row(rows, "write_kv_cache", wname, dtype, float(bad + (not untouched)), 0.0)

        run.case("a", f"write_kv_cache {wname} {dname}", write_case,
                 lambda m: add_row(rows, "write_kv_cache", wname, dtype, float("nan"), 0.0, m))

        # paged_attention: mixed decode + prefill-chunk batches; one case per split mode.
        for name, q_lens, seq_lens, hq, hkv, d, bs in plan["attn"]:
            data: dict[str, Any] = {}

            def inputs() -> dict[str, Any]:  # built once per batch, by the first split case that runs
                if not data:
                    q, k, v, cu, sl, bt = _paged_batch(torch, q_lens, seq_lens, hq, hkv, d, bs, dtype, device, gen)
                    data.update(args=(q, k, v, cu, sl, bt),
                                expect=ref.paged_attention_ref(q, k, v, cu, sl, bt, d**-0.5).float())
                return data

            for splits in SPLITS_A:
                cname = f"{name}, splits={splits or 'auto'}"

                def attn_case(splits: int | None = splits, cname: str = cname) -> None:
                    inp = inputs()
                    q = inp["args"][0]
                    out = torch.full_like(q, float("nan"))
                    pa.paged_attention(*inp["args"], d**-0.5, max(q_lens), max(seq_lens), num_splits=splits, out=out)
                    tol = TOL[dname]
                    expect = inp["expect"]
                    # Normalised so that 1.0 is the limit |out - ref| <= tol + tol * |ref| (atol = rtol = tol).
                    err = float(((out.float() - expect).abs() / (tol * (1.0 + expect.abs()))).max())
                    add_row(rows, "paged_attention", cname, dtype, err, 1.0)

                run.case("a", f"paged_attention {cname} {dname}", attn_case,
                         lambda m, cname=cname: add_row(rows, "paged_attention", cname, dtype, float("nan"), 1.0, m))
            data.clear()

        # int4_matmul: GEMV (M <= 8) and GEMM paths.
        for m, n, kk in plan["int4"]:
            cname = f"M={m} N={n} K={kk} G=32"

            def int4_case(m: int = m, n: int = n, kk: int = kk, cname: str = cname) -> None:
                w = (torch.randn(n, kk, generator=gen) * 0.05).to(device)
                codes, scale, mins = ref.quantize_int4(w, 32)
                x = torch.randn(m, kk, generator=gen).to(dtype).to(device)
                out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
                ig.int4_matmul(x, codes, scale, mins, 32, out=out)
                expect = ref.int4_matmul_ref(x, codes, scale, mins, 32).float()
                err = float((out.float() - expect).abs().max()) / float(expect.abs().max())
                add_row(rows, "int4_matmul", cname, dtype, err, INT4_REL_TOL[dname])

            run.case("a", f"int4_matmul {cname} {dname}", int4_case,
                     lambda m, cname=cname: add_row(rows, "int4_matmul", cname, dtype, float("nan"),
                                                    INT4_REL_TOL[dname], m))

        # The same kernels on int8 codes (5/6/8-bit GGUF types): Q6_K's groups of 16, no min.
        for m, n, kk in plan["int4"]:
            cname = f"int8 codes M={m} N={n} K={kk} G=16"

            def int8_case(m: int = m, n: int = n, kk: int = kk) -> None:
                codes = torch.randint(-32, 32, (n, kk), generator=gen, dtype=torch.int8).to(device)
                scale = (torch.rand(n, kk // 16, generator=gen) * 0.01).to(device)
                x = torch.randn(m, kk, generator=gen).to(dtype).to(device)
                out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
                ig.int4_matmul(x, codes, scale, None, 16, out=out)
                expect = ref.int8_matmul_ref(x, codes, scale, None, 16).float()
                err = float((out.float() - expect).abs().max()) / float(expect.abs().max())
                add_row(rows, "int4_matmul", f"int8 codes M={m} N={n} K={kk} G=16", dtype, err, INT4_REL_TOL[dname])

            run.case("a", f"int4_matmul {cname} {dname}", int8_case,
                     lambda m, cname=cname: add_row(rows, "int4_matmul", cname, dtype, float("nan"),
                                                    INT4_REL_TOL[dname], m))


# ---------------------------------------------------------------------------------------- performance


def _sdpa_decode(torch: ModuleType, q4: Any, dense: list[tuple[Any, Any]]) -> tuple[list[Callable[[], Any]], str]:
    """SDPA callables over the contiguous K/V copies with a forced backend: flash first (the baseline the
    goal names), then memory-efficient, then math; returns them with the backend actually used."""
    import torch.nn.functional as F

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3: no backend selection
        return [lambda k=k, v=v: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True) for k, v in dense], \
            "default (torch has no sdpa_kernel)"
    errors = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        def call(k: Any, v: Any, backend: Any = backend) -> Any:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

        try:
            call(*dense[0])
        except RuntimeError as exc:  # this backend cannot take these inputs
            errors.append(f"{backend.name}: {_msg(exc)[:80]}")
            continue
        note = backend.name.lower() + (f" (not available: {'; '.join(errors)})" if errors else "")
        return [lambda k=k, v=v, call=call: call(k, v) for k, v in dense], note
    raise RuntimeError("no SDPA backend runs: " + "; ".join(errors))


def section_b(run: Run, mods: dict[str, ModuleType], device: Any, copy_bw: float) -> None:
    import torch

    pa = mods["paged_attention"]
    sec = run.section("b")
    sec["copy_bw"] = copy_bw
    rows = sec["decode"]
    plan = plan_bc(run.args)
    hq, hkv, d, bs = DECODE_SHAPE["hq"], DECODE_SHAPE["hkv"], DECODE_SHAPE["d"], DECODE_SHAPE["bs"]
    dtype, esize = torch.bfloat16, 2
    for batch in plan["batches"]:
        for ctx in plan["contexts"]:
            row: dict[str, Any] = dict(batch=batch, ctx=ctx)

            def decode_case(batch: int = batch, ctx: int = ctx, row: dict[str, Any] = row) -> None:
                blocks_per_seq = ctx // bs
                num_blocks = batch * blocks_per_seq
                kv_bytes = 2 * batch * ctx * hkv * d * esize
                q_bytes = batch * hq * d * esize
                caches = [(torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype),
                           torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype))
                          for _ in range(copies_for(kv_bytes, device))]
                # A shuffled pool: each sequence's pages are scattered, as after a while of serving.
                bt = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
                q = torch.randn(batch, hq, d, device=device, dtype=dtype)
                out = torch.empty_like(q)
                cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
                sl = torch.full((batch,), ctx, dtype=torch.int32, device=device)
                auto = pa.auto_num_splits(q, caches[0][0], batch, 1, ctx)
                on = auto if auto > 1 else 4

                def attn(kc: Any, vc: Any, splits: int) -> Callable[[], Any]:
                    return lambda: pa.paged_attention(q, kc, vc, cu, sl, bt, d**-0.5, 1, ctx, num_splits=splits, out=out)

                def pct(us: float) -> float:
                    return 100.0 * (kv_bytes + q_bytes) / (us * 1e-6) / copy_bw

                t_off, g_off = time_us([attn(kc, vc, 1) for kc, vc in caches], torch, device)
                t_on, g_on = time_us([attn(kc, vc, on) for kc, vc in caches], torch, device)
                row.update(t_off=t_off, bw_off=pct(t_off), splits=on, t_on=t_on, bw_on=pct(t_on), auto=auto,
                           eager=not (g_off and g_on))
                run.save()  # our timings are kept even if the SDPA part fails
                if batch <= SPLIT_SWEEP_MAX_BATCH:  # where the split count decides the speed: every count timed
                    row["sweep"] = {n: time_us([attn(kc, vc, n) for kc, vc in caches], torch, device)[0]
                                    for n in plan["split_sweep"] if n not in (1, on)}
                    row["sweep"].update({1: t_off, on: t_on})
                    run.save()
                attn(*caches[0], auto)()
                ours = out.float()
                # SDPA over the same K/V, gathered into contiguous [B, Hkv, ctx, D].
                dense = []
                while caches:
                    kc, vc = caches.pop(0)
                    dense.append(tuple(c[bt.long()].view(batch, ctx, hkv, d).transpose(1, 2).contiguous()
                                       for c in (kc, vc)))
                    del kc, vc
                q4 = q.view(batch, hq, 1, d)
                sdpa, backend = _sdpa_decode(torch, q4, dense)
                t_sdpa, g_sdpa = time_us(sdpa, torch, device)
                tol = TOL["bfloat16"]
                sdpa_out = sdpa[0]().view(batch, hq, d).float()
                sdpa_err = float(((sdpa_out - ours).abs() / (tol * (1.0 + ours.abs()))).max())
                t_auto = t_on if auto > 1 else t_off
                row.update(t_sdpa=t_sdpa, bw_sdpa=pct(t_sdpa), speedup=t_sdpa / t_auto, sdpa_backend=backend,
                           sdpa_err=sdpa_err, eager=row["eager"] or not g_sdpa)
                if not sdpa_err <= 1.0:
                    row["error"] = f"SDPA and Triton outputs differ: {sdpa_err:.3g} x tolerance"
                print(f"  decode B={batch:<3d} ctx={ctx:<6d} off {t_off:8.1f} us ({row['bw_off']:5.1f}%)  "
                      f"split {on:<2d} {t_on:8.1f} us ({row['bw_on']:5.1f}%)  auto={auto:<2d} sdpa[{backend}] "
                      f"{t_sdpa:8.1f} us (|sdpa - ours| {sdpa_err:.2g} x tol)", flush=True)
                del dense, sdpa, ours

            rows.append(row)
            run.case("b", f"decode B={batch} ctx={ctx}", decode_case, lambda m, row=row: row.update(error=m))


def _kv_cache_e(torch: ModuleType, kv: str, num_blocks: int, device: Any) -> tuple[Any, ...]:
    """(k, v, k_scale, v_scale) for section (e): random fp16 K/V, or int8 / e4m3 codes with per-token
    fp32 scales in the range quantize-on-write produces (absmax / qmax of unit-normal vectors)."""
    hkv, d, bs = DECODE_SHAPE["hkv"], DECODE_SHAPE["d"], DECODE_SHAPE["bs"]
    shape = (num_blocks, bs, hkv, d)
    if kv == "fp16":
        return torch.randn(shape, device=device, dtype=torch.float16), \
            torch.randn(shape, device=device, dtype=torch.float16), None, None
    out = []
    for _ in range(2):
        if kv == "int8":
            codes = torch.randint(-127, 128, shape, device=device, dtype=torch.int8)
            qmax = 127.0
        else:
            codes = (torch.randn(shape, device=device) * 120.0).clamp_(-448, 448).to(torch.float8_e4m3fn)
            qmax = 448.0
        scale = (torch.rand(shape[:3], device=device) + 2.5) / qmax
        out.append((codes, scale))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def section_e(run: Run, mods: dict[str, ModuleType], device: Any, copy_bw: float) -> None:
    """Decode attention per KV cache dtype at long contexts: fp16 vs int8 vs fp8 caches, same kernel."""
    import torch

    pa, ref = mods["paged_attention"], mods["reference"]
    sec = run.section("e")
    sec["copy_bw"] = copy_bw
    rows = sec["kvdtype"]
    plan = plan_e(run.args)
    hq, hkv, d, bs = DECODE_SHAPE["hq"], DECODE_SHAPE["hkv"], DECODE_SHAPE["d"], DECODE_SHAPE["bs"]
    fp8_ok = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
    for batch in plan["batches"]:
        for ctx in plan["contexts"]:
            base: dict[str, float] = {}
            for kv in KV_DTYPES_E:
                row: dict[str, Any] = dict(batch=batch, ctx=ctx, kv=kv)
                rows.append(row)
                if kv == "fp8" and not fp8_ok:
                    row["skipped"] = "compute capability < 8.9"
                    continue

                def kv_case(batch: int = batch, ctx: int = ctx, kv: str = kv, row: dict[str, Any] = row,
                            base: dict[str, float] = base) -> None:
                    blocks_per_seq = ctx // bs
                    num_blocks = batch * blocks_per_seq
                    per_token = 2 * hkv * (d * 2 if kv == "fp16" else d + 4)  # K + V, codes + fp32 scales
                    kv_bytes = batch * ctx * per_token
                    q_bytes = batch * hq * d * 2
                    caches = [_kv_cache_e(torch, kv, num_blocks, device) for _ in range(copies_for(kv_bytes, device))]
                    bt = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
                    q = torch.randn(batch, hq, d, device=device, dtype=torch.float16)
                    out = torch.empty_like(q)
                    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
                    sl = torch.full((batch,), ctx, dtype=torch.int32, device=device)

                    def attn(kc: Any, vc: Any, ks: Any, vs: Any) -> Callable[[], Any]:
                        return lambda: pa.paged_attention(q, kc, vc, cu, sl, bt, d**-0.5, 1, ctx, out=out,
                                                          k_scale=ks, v_scale=vs)

                    t, graphed = time_us([attn(*c) for c in caches], torch, device)
                    if kv == "fp16":
                        base["t"] = t
                    row.update(t=t, bytes=kv_bytes + q_bytes, bw=100.0 * (kv_bytes + q_bytes) / (t * 1e-6) / copy_bw,
                               vs_fp16=base["t"] / t if "t" in base else None, eager=not graphed,
                               auto=pa.auto_num_splits(q, caches[0][0], batch, 1, ctx))
                    run.save()  # the timing is kept even if the check below fails
                    attn(*caches[0])()
                    kc, vc, ks, vs = caches[0]
                    want = ref.paged_attention_ref(q, kc, vc, cu, sl, bt, d**-0.5, ks, vs).float()
                    tol = TOL["float16"]
                    row["err"] = float(((out.float() - want).abs() / (tol * (1.0 + want.abs()))).max())
                    if not row["err"] <= 1.0:
                        row["error"] = f"kernel and reference differ: {row['err']:.3g} x tolerance"
                    print(f"  kv {kv:4s} B={batch:<3d} ctx={ctx:<6d} {t:8.1f} us ({row['bw']:5.1f}% BW)"
                          + (f"  fp16/this {row['vs_fp16']:.2f}x" if row["vs_fp16"] else "")
                          + f"  |ours - ref| {row['err']:.2g} x tol", flush=True)
                    del caches

                run.case("e", f"kv {kv} B={batch} ctx={ctx}", kv_case, lambda m, row=row: row.update(error=m))


def render_forms(forms: list[dict[str, Any]], int4: list[dict[str, Any]], smoke: bool) -> list[str]:
    """Section (c)'s K-quant forms at batch 1 against the Q4_1 row of the same shape, and the goal's line."""
    q41 = {(r["n"], r["k"]): r["bw_int4"] for r in int4 if r["m"] == 1 and "bw_int4" in r and not r.get("error")}
    lines = ["## (c) K-quant forms at batch 1 (fp16 activations) against the Q4_1 form",
             "",
             "Bytes = what the kernel reads for the weight (codes + float32 scales + mins). %BW as above; 'vs Q4_1'",
             "= this form's %BW / the Q4_1 row's %BW at the same shape (the goal: >= 70 %).",
             "",
             "| form | N | K | bytes | us | %BW | vs Q4_1 | result |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    ratios = []
    for r in forms:
        head = f"| {r['form']} | {r['n']} | {r['k']} | "
        if "t" not in r:
            lines.append(head + f"| | | | | **FAIL**: {r.get('error', 'not run')} |")
            continue
        ref = q41.get((r["n"], r["k"]))
        ratio = f"{100 * r['bw'] / ref:.0f}%" if ref else "-"
        if ref:
            ratios.append((100 * r["bw"] / ref, r["form"], r["n"], r["k"]))
        lines.append(head + f"{r['bytes'] / 2**20:.1f} MiB | {r['t']:.1f} | {r['bw']:.0f}% | {ratio} | "
                     f"{'eager' if r['eager'] else 'ok'} |")
    if ratios and not smoke:
        low = min(ratios)
        lines += ["", f"- K-quant forms >= 70% of the Q4_1 form's bandwidth at batch 1: lowest {low[0]:.0f}% "
                      f"({low[1]} {low[2]}x{low[3]}) over {len(ratios)} rows -> {'met' if low[0] >= 70 else 'NOT met'}"]
    return lines + [""]


def render_split_sweep(rows: list[dict[str, Any]], copy_bw: float) -> list[str]:
    """Section (b)'s split-count sweep: us (and %BW) per split count, the automatic choice and the best marked."""
    rows = [r for r in rows if r.get("sweep")]
    if not rows:
        return []
    counts = sorted({int(n) for r in rows for n in r["sweep"]})
    lines = ["## (b) decode attention by split count (bf16, same shapes; us, * = automatic, best in bold)", "",
             "| batch | context | " + " | ".join(str(n) for n in counts) + " |",
             "| --- | --- | " + " | ".join("---" for _ in counts) + " |"]
    for r in rows:
        sweep = {int(n): t for n, t in r["sweep"].items()}
        best = min(sweep.values())
        cells = []
        for n in counts:
            t = sweep.get(n)
            cell = "" if t is None else f"{t:.1f}" + ("*" if n == r["auto"] else "")
            cells.append(f"**{cell}**" if t == best else cell)
        lines.append(f"| {r['batch']} | {r['ctx']} | " + " | ".join(cells) + " |")
    return lines + [""]


def render_sweep(rows: list[dict[str, Any]]) -> list[str]:
    """Section (c)'s tile sweeps: each config's time and %BW, the best marked."""
    lines = ["## (c) tile sweeps (Q4_1 weights, fp16 activations; 'default' = the launcher's choice)", "",
             "| M | N | K | config | us | %BW | |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ok = [t for t in r["times"] if "t" in t]
        best = min(ok, key=lambda t: t["t"]) if ok else None
        for t in r["times"]:
            cfg = ", ".join(f"{k}={v}" for k, v in t["config"].items()) or "default"
            if "t" not in t:
                lines.append(f"| {r['m']} | {r['n']} | {r['k']} | {cfg} | | | **FAIL**: {t['error']} |")
            else:
                lines.append(f"| {r['m']} | {r['n']} | {r['k']} | {cfg} | {t['t']:.1f} | {t['bw']:.0f}% | "
                             f"{'best' if t is best else ''} |")
        if r.get("error"):
            lines.append(f"| {r['m']} | {r['n']} | {r['k']} | | | | **FAIL**: {r['error']} |")
    return lines + [""]


def render_e(rows: list[dict[str, Any]], copy_bw: float, smoke: bool) -> list[str]:
    """Section (e)'s table and the issue goal's line (fp8 / int8 against fp16 at 8k+)."""
    lines = ["## (e) decode attention per KV cache dtype, fp16 queries, 32 q / 8 KV heads, head_dim 128, page 16",
             "",
             f"%BW = (K + V codes + fp32 scales + q bytes read) / time / copy bandwidth ({copy_bw / 1e9:.0f} GB/s,",
             "read + write). 'fp16 time / this' > 1: faster than the fp16 cache at the same batch and context.",
             "'vs ref' = max |ours - ref| / (4e-3 (1 + |ref|)) against the torch reference on dequantized K/V.",
             "",
             "| batch | context | KV dtype | us | bytes read | %BW | fp16 time / this | auto splits | vs ref "
             "| result |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        head = f"| {r['batch']} | {r['ctx']} | {r['kv']} | "
        if r.get("skipped"):
            lines.append(head + f"| | | | | | skipped: {r['skipped']} |")
        elif "t" not in r:
            lines.append(head + "| | | | | | **FAIL**: " + r.get("error", "not run") + " |")
        else:
            ratio = f"{r['vs_fp16']:.2f}x" if r.get("vs_fp16") else "-"
            err = f"{r['err']:.2g}" if "err" in r else ""
            verdict = f"**FAIL**: {r['error']}" if r.get("error") else "ok" + (" (eager)" if r.get("eager") else "")
            lines.append(head + f"{r['t']:.1f} | {r['bytes']:,} | {r['bw']:.0f}% | {ratio} | {r['auto']} | {err} | "
                         f"{verdict} |")
    lines.append("")
    long = [r for r in rows if r["ctx"] >= 8192 and r.get("vs_fp16") and not r.get("error")]
    if long and not smoke:
        for kv in ("int8", "fp8"):
            got = [r["vs_fp16"] for r in long if r["kv"] == kv]
            if got:
                lines.append(f"- {kv} KV decode at 8k+ context: fp16 time / {kv} time {min(got):.2f}x - "
                             f"{max(got):.2f}x over {len(got)} rows (bytes read: {kv} 0.53x of fp16 at head_dim 128 "
                             f"incl. scales)")
        lines.append("")
    return lines


def section_c(run: Run, mods: dict[str, ModuleType], device: Any, copy_bw: float) -> None:
    import torch

    ig, ref = mods["int4_gemm"], mods["reference"]
    sec = run.section("c")
    sec["copy_bw"] = copy_bw
    rows = sec["int4"]
    plan = plan_bc(run.args)
    for n, k in plan["shapes"]:
        for m in plan["int4_m"]:
            row: dict[str, Any] = dict(m=m, n=n, k=k)

            def int4_case(m: int = m, n: int = n, k: int = k, row: dict[str, Any] = row) -> None:
                w = torch.randn(n, k, device=device) * 0.05
                codes, scale, mins = ref.quantize_int4(w, 32)
                q_bytes = codes.numel() + 2 * scale.numel() * scale.element_size()
                qsets = [(codes.clone(), scale.clone(), mins.clone()) for _ in range(copies_for(q_bytes, device))]
                wsets = [w.half() for _ in range(copies_for(n * k * 2, device))]
                del w, codes, scale, mins
                x = torch.randn(m, k, device=device, dtype=torch.float16)
                out = torch.empty(m, n, device=device, dtype=torch.float16)
                t_int4, g1 = time_us([lambda c=c, s=s, z=z: ig.int4_matmul(x, c, s, z, 32, out=out)
                                      for c, s, z in qsets], torch, device)
                t_fp16, g2 = time_us([lambda w16=w16: torch.matmul(x, w16.t()) for w16 in wsets], torch, device)
                row.update(t_int4=t_int4, t_fp16=t_fp16, speedup=t_fp16 / t_int4, eager=not (g1 and g2),
                           bw_int4=100.0 * q_bytes / (t_int4 * 1e-6) / copy_bw,
                           bw_fp16=100.0 * n * k * 2 / (t_fp16 * 1e-6) / copy_bw)
                run.save()
                if m > ig.GEMV_MAX_M:  # the per-group "codes" GEMM (the first GPU run's) beside the default
                    t_codes, _ = time_us([lambda c=c, s=s, z=z: ig.int4_matmul(x, c, s, z, 32, out=out, gemm="codes")
                                          for c, s, z in qsets], torch, device)
                    row.update(t_codes=t_codes)
                print(f"  int4 M={m:<3d} N={n:<6d} K={k:<6d} int4 {t_int4:8.1f} us  fp16 {t_fp16:8.1f} us"
                      + (f"  codes form {row['t_codes']:8.1f} us" if "t_codes" in row else ""), flush=True)
                del qsets, wsets

            rows.append(row)
            run.case("c", f"int4 M={m} N={n} K={k}", int4_case, lambda msg, row=row: row.update(error=msg))
    # K-quant forms at batch 1, after every Q4_1 row above (whose bandwidth they are judged against).
    for n, k in plan["shapes"]:
        for form in KQUANT_FORMS:
            row = dict(form=form, m=1, n=n, k=k)

            def form_case(form: str = form, n: int = n, k: int = k, row: dict[str, Any] = row) -> None:
                tensors = kquant_form(torch, form, n, k, device)
                q_bytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
                g = KQUANT_FORMS[form][0]
                sets = [[t.clone() if t is not None else None for t in tensors]
                        for _ in range(copies_for(q_bytes, device))]
                del tensors
                x = torch.randn(1, k, device=device, dtype=torch.float16)
                out = torch.empty(1, n, device=device, dtype=torch.float16)
                t, graphed = time_us([lambda c=c, s=s, z=z: ig.int4_matmul(x, c, s, z, g, out=out)
                                      for c, s, z in sets], torch, device)
                row.update(t=t, eager=not graphed, bytes=q_bytes, bw=100.0 * q_bytes / (t * 1e-6) / copy_bw)
                print(f"  {form} M=1 N={n:<6d} K={k:<6d} {t:8.1f} us", flush=True)
                del sets

            sec["forms"].append(row)
            run.case("c", f"{form} M=1 N={n} K={k}", form_case, lambda msg, row=row: row.update(error=msg))
    # Tile sweeps: the GEMV at batch 1 and the default GEMM at M = 64 over a few tile shapes each, fp16
    # activations, Q4_1 weights; the first config of each list is the launcher's default.
    for n, k in plan["sweep_shapes"]:
        for m, configs in ((1, SWEEP_GEMV), (64, SWEEP_GEMM)):
            row = dict(m=m, n=n, k=k, times=[])
            sec["sweep"].append(row)

            def sweep_case(m: int = m, n: int = n, k: int = k, configs: tuple = configs, row: dict = row) -> None:
                w = torch.randn(n, k, device=device) * 0.05
                codes, scale, mins = ref.quantize_int4(w, 32)
                q_bytes = codes.numel() + 2 * scale.numel() * scale.element_size()
                qsets = [(codes.clone(), scale.clone(), mins.clone()) for _ in range(copies_for(q_bytes, device))]
                del w
                x = torch.randn(m, k, device=device, dtype=torch.float16)
                out = torch.empty(m, n, device=device, dtype=torch.float16)
                for cfg in configs:
                    try:
                        t, _ = time_us([lambda c=c, s=s, z=z, cfg=cfg: ig.int4_matmul(x, c, s, z, 32, out=out,
                                                                                      config=cfg or None)
                                        for c, s, z in qsets], torch, device)
                        row["times"].append(dict(config=cfg, t=t, bw=100.0 * q_bytes / (t * 1e-6) / copy_bw))
                        print(f"  sweep M={m:<3d} N={n:<6d} K={k:<6d} {cfg or 'default'}: {t:8.1f} us", flush=True)
                    except Exception as exc:  # noqa: BLE001 - one config that fails to compile is a row, not the case
                        row["times"].append(dict(config=cfg, error=_msg(exc)))
                        _raise_if_cuda_lost(exc)
                    run.save()
                del qsets

            run.case("c", f"sweep M={m} N={n} K={k}", sweep_case, lambda msg, row=row: row.update(error=msg))


# Section (c)'s tile sweeps ({} = the launcher's default): GEMV (BLOCK_N, BLOCK_K, warps, stages) at M = 1 and
# the dequantizing GEMM at M = 64.
SWEEP_GEMV = ({}, dict(BLOCK_N=32, BLOCK_K=256, num_warps=4), dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4),
              dict(BLOCK_N=32, BLOCK_K=512, num_warps=8), dict(BLOCK_N=64, BLOCK_K=256, num_warps=8),
              dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=4))
SWEEP_GEMM = ({}, dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
              dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
              dict(BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3), dict(BLOCK_N=32, BLOCK_K=64, num_warps=4))


# The resident forms of K-quant GGUF linears on CUDA (kvcli.model.layers.Linear, modes triton and
# triton-int8): group size, code bits, whether there is a min. Random codes: only bytes and time matter.
KQUANT_FORMS = {"q4_k": (32, 4, True), "q6_k": (16, 8, False), "q8_0": (32, 8, False)}


def kquant_form(torch: ModuleType, form: str, n: int, k: int, device: Any) -> tuple[Any, Any, Any]:
    g, bits, has_min = KQUANT_FORMS[form]
    if bits == 4:
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    else:
        codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, device=device)
    scale = torch.rand(n, k // g, device=device) * 0.01
    return codes, scale, (-torch.rand(n, k // g, device=device) * 0.1 if has_min else None)


def render(env: dict[str, str], correct: list[dict[str, Any]], decode: list[dict[str, Any]],
           int4: list[dict[str, Any]], copy_bw: float, smoke: bool = False, engine: dict[str, Any] | None = None,
           notes: list[str] | None = None) -> str:
    lines = [
        "# kvcli Triton kernels: GPU check",
        "",
        f"- date: {env['date']}",
        f"- device: {env['device']}",
        f"- torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}",
        f"- command: `{env['command']}`",
        "",
    ]
    if smoke:
        lines += ["**--cpu-smoke: Triton interpreter on CPU at toy sizes. The timings below only show that the",
                  "benchmark code runs; they are not performance figures.**", ""]
    if notes:
        lines += ["**Partial result**: rows below were measured; these parts did not finish:", ""]
        lines += [f"- {n}" for n in notes] + [""]
    if correct:
        lines += ["## (a) correctness vs torch reference", "",
                  "| kernel | case | dtype | error | tolerance | result |", "| --- | --- | --- | --- | --- | --- |"]
        for r in correct:
            verdict = "pass" if r["ok"] else "**FAIL**" + (f": {r['note']}" if r.get("note") else "")
            lines.append(f"| {r['kernel']} | {r['case']} | {r['dtype']} | {r['err']:.3g} | {r['tol']:.3g} | {verdict} |")
        lines += ["", "Error columns: attention max |out - ref| / (t * (1 + |ref|)) with t = 2e-4 / 4e-3 / 3e-2 for",
                  "fp32 / fp16 / bf16 (limit 1); INT4 max |out - ref| / max |ref|; cache write: count of wrong or",
                  "clobbered elements; engine logits max |triton - torch| / max |torch|; engine tokens: number of",
                  "sequences that differ. References are plain torch in fp32 (kernels/reference.py).", ""]
    if decode or int4:
        lines += [f"Device-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s = 100% below, counted as read + write",
                  "bytes (2 x copy size / time). The %BW columns count only the bytes a kernel reads (attention: K + V",
                  "+ q; GEMM: the weights), so 100% means reading as fast as a copy reads and writes together.", ""]
    if decode:
        lines += [
            "## (b) decode attention, bf16, 32 q / 8 KV heads, head_dim 128, page 16",
            "",
            "%BW = (K + V + q bytes read) / time / copy bandwidth. 'split n' forces n KV segments (n = the",
            "automatic choice when it splits, else 4); 'auto' is what num_splits=None picks. SDPA reads the same",
            "K/V gathered into contiguous [B, 8, ctx, 128], with the backend named in its column forced. Speedup =",
            "SDPA time / Triton time (auto mode). 'vs SDPA' = max |SDPA - ours| / (0.03 (1 + |ours|)): above 1 the",
            "row fails. Rows marked eager were timed without a CUDA graph (capture failed; launch overhead included).",
            "",
            "| batch | context | no split us | %BW | split n | split us | %BW | auto | SDPA backend | SDPA us | SDPA %BW | speedup | vs SDPA | result |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in decode:
            lines.append(_decode_line(r))
        lines.append("")
    if int4:
        lines += [
            "## (c) INT4 GEMM (G=32, fp16 activations) vs fp16 torch.matmul",
            "",
            "W is [N, K] (out[M, N] = x @ W^T). %BW = weight bytes (codes + scales + mins, or fp16 W) / time.",
            "",
            "M > 8 runs the dequantizing GEMM (the default); 'codes form us' is the per-group GEMM of the first",
            "GPU run on the same weights.",
            "",
            "| M | N | K | int4 us | int4 %BW | fp16 us | fp16 %BW | speedup | codes form us | result |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in int4:
            if "t_fp16" not in r:
                lines.append(f"| {r['m']} | {r['n']} | {r['k']} | | | | | | | **FAIL**: {r.get('error', 'not run')} |")
                continue
            codes = f"{r['t_codes']:.1f}" if "t_codes" in r else ""
            lines.append(f"| {r['m']} | {r['n']} | {r['k']} | {r['t_int4']:.1f} | {r['bw_int4']:.0f}% | "
                         f"{r['t_fp16']:.1f} | {r['bw_fp16']:.0f}% | {r['speedup']:.2f}x | {codes} | "
                         f"{'**FAIL**: ' + r['error'] if r.get('error') else 'eager' if r['eager'] else 'ok'} |")
        lines.append("")
    if engine is not None:
        lines += _engine_module().render(engine)
    if (decode or int4) and not smoke:
        lines += goals(decode, int4)
    return "\n".join(lines)


def _decode_line(r: dict[str, Any]) -> str:
    head = f"| {r['batch']} | {r['ctx']} | "
    if "t_off" not in r:
        return head + "| | | | | | | | | | | **FAIL**: " + r.get("error", "not run") + " |"
    line = head + f"{r['t_off']:.1f} | {r['bw_off']:.0f}% | {r['splits']} | {r['t_on']:.1f} | {r['bw_on']:.0f}% | {r['auto']} | "
    if "t_sdpa" in r:
        line += (f"{r['sdpa_backend']} | {r['t_sdpa']:.1f} | {r['bw_sdpa']:.0f}% | {r['speedup']:.2f}x | "
                 f"{r['sdpa_err']:.2g} | ")
    else:
        line += "| | | | | "
    verdict = f"**FAIL**: {r['error']}" if r.get("error") else "ok"
    return line + (verdict + (" (eager)" if r.get("eager") else "")) + " |"


def goals(decode: list[dict[str, Any]], int4: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, judged on the rows above (8k+ contexts for attention, M = 1 for INT4)."""
    out = ["## goals (issue #3), judged on the rows above", ""]
    decode = [r for r in decode if "speedup" in r and not r.get("error")]
    int4 = [r for r in int4 if "speedup" in r and not r.get("error")]
    long = [r for r in decode if r["ctx"] >= 8192]
    if long:
        best = [max(r["bw_off"], r["bw_on"] if r["auto"] > 1 else 0.0) for r in long]
        bw_auto = [r["bw_on"] if r["auto"] > 1 else r["bw_off"] for r in long]
        worst_bw = min(bw_auto)
        worst_sp = min(r["speedup"] for r in long)
        out.append(f"- decode attention >= 85% of copy bandwidth at 8k+ context (auto split): lowest {worst_bw:.0f}% "
                   f"over {len(long)} rows -> {'met' if worst_bw >= 85 else 'NOT met'} (best mode per row: lowest "
                   f"{min(best):.0f}%)")
        out.append(f"- decode attention >= 1.0x contiguous SDPA at 8k+: lowest {worst_sp:.2f}x -> "
                   f"{'met' if worst_sp >= 1.0 else 'NOT met'}")
    gemv = [r for r in int4 if r["m"] == 1]
    if gemv:
        worst = min(r["speedup"] for r in gemv)
        out.append(f"- INT4 GEMV >= 2.5x fp16 at batch 1: lowest {worst:.2f}x over {len(gemv)} shapes -> "
                   f"{'met' if worst >= 2.5 else 'NOT met'}")
    return out + [""]


def _engine_module() -> ModuleType:
    """scripts/gpu_engine_check.py (section d), imported beside this script."""
    scripts = str(REPO / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module("gpu_engine_check")


def _kvcli_section(run: Run, letter: str) -> dict[str, Any] | None:
    """The section's record, or None (and a 'skipped' engine entry) where kvcli cannot be imported."""
    ge = _engine_module()
    sec = run.section(letter)
    missing = ge.kvcli_missing()
    if missing:
        print(f"  skipped: kvcli needs the module {missing!r}, which is not installed", flush=True)
        sec["engine"] = dict(skipped=f"kvcli needs the module `{missing}`, which is not installed here "
                                     "(sections a-c and e need only torch and triton)")
        return None
    return sec


def _engine_bench(run: Run, letter: str, case: str, bench: str) -> None:
    """A section that is one engine benchmark of gpu_engine_check (its function `bench`), filling the
    section's engine record step by step: rows measured before an error are kept, the error beside them."""
    sec = _kvcli_section(run, letter)
    if sec is None:
        return
    perf: dict[str, Any] = {}
    sec["engine"] = perf
    run.case(letter, case, lambda: getattr(_engine_module(), bench)(run.args.cpu_smoke, out=perf, progress=run.save),
             lambda m: perf.update(error=m))


def section_g(run: Run) -> None:
    """Decode with and without CUDA graphs."""
    _engine_bench(run, "g", "cuda graphs speed", "bench_graphs")


def section_h(run: Run) -> None:
    """transformers on (d)'s shapes and trace."""
    _engine_bench(run, "h", "transformers baselines", "bench_hf")


def section_d(run: Run) -> None:
    """The engine: correctness rows join table (a); the speed part's partial results are kept on error."""
    ge = _engine_module()
    sec = _kvcli_section(run, "d")
    if sec is None:
        return
    rows = sec["correct"]

    def correctness() -> None:
        ge.check_engine_correctness(lambda *a: (add_row(rows, *a), run.save()), smoke=run.args.cpu_smoke)

    run.case("d", "engine correctness", correctness,
             lambda m: add_row(rows, "engine", "correctness did not finish", "-", float("nan"), 0.0, m))
    perf: dict[str, Any] = {}
    sec["engine"] = perf

    def bench() -> None:
        ge.bench_engine(run.args.cpu_smoke, run.args.quick, ge.Deadline(run.args.engine_seconds), out=perf,
                        progress=run.save)

    run.case("d", "engine speed", bench, lambda m: perf.update(error=m))


# ------------------------------------------------------------------------------------- report files


def load_state(state: Path) -> dict[str, dict[str, Any]]:
    data = {}
    for letter in ORDER:
        f = state / f"{letter}.json"
        if f.exists():
            data[letter] = json.loads(f.read_text())
    return data


def report_text(state: Path, args: argparse.Namespace, env: dict[str, str]) -> str:
    data = load_state(state)
    sec = {k: data.get(k, {}) for k in ORDER}
    correct = sec["a"].get("correct", []) + sec["d"].get("correct", [])
    copy_bw = sec["b"].get("copy_bw") or sec["c"].get("copy_bw") or 0.0
    notes = [f"({k}) {n}" for k in ORDER for n in sec[k].get("notes", [])]
    text = render(env, correct, sec["b"].get("decode", []), sec["c"].get("int4", []), copy_bw,
                  smoke=args.cpu_smoke, engine=sec["d"].get("engine"), notes=notes)
    if sec["c"].get("forms"):
        text += "\n" + "\n".join(render_forms(sec["c"]["forms"], sec["c"].get("int4", []), args.cpu_smoke))
    if any(r.get("sweep") for r in sec["b"].get("decode", [])):
        text += "\n" + "\n".join(render_split_sweep(sec["b"]["decode"], copy_bw))
    if sec["c"].get("sweep"):
        text += "\n" + "\n".join(render_sweep(sec["c"]["sweep"]))
    if sec["e"].get("kvdtype"):
        text += "\n" + "\n".join(render_e(sec["e"]["kvdtype"], sec["e"].get("copy_bw") or copy_bw, args.cpu_smoke))
    ge = _engine_module() if any(sec[k].get("engine") for k in "gdh") else None
    if sec["g"].get("engine"):
        text += "\n" + "\n".join(ge.render_graphs(sec["g"]["engine"]))
    if sec["h"].get("engine"):
        text += "\n" + "\n".join(ge.render_hf(sec["h"]["engine"]))
    if ge is not None and not args.cpu_smoke:
        text += "\n" + "\n".join(ge.engine_goals(sec["g"].get("engine"), sec["d"].get("engine"), sec["h"].get("engine")))
    return text


def write_report(state: Path, args: argparse.Namespace, env: dict[str, str]) -> str:
    text = report_text(state, args, env)
    if args.out:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)  # a process killed mid-write never leaves half a report
    return text


def failures(state: Path) -> list[str]:
    data = load_state(state)
    bad = [f"{r['kernel']} {r['case']}" for d in data.values() for r in d.get("correct", []) if not r["ok"]]
    bad += [f"decode B={r['batch']} ctx={r['ctx']}" for r in data.get("b", {}).get("decode", []) if r.get("error")]
    bad += [f"int4 M={r['m']} N={r['n']}" for r in data.get("c", {}).get("int4", []) if r.get("error")]
    bad += [f"{r['form']} N={r['n']} K={r['k']}" for r in data.get("c", {}).get("forms", []) if r.get("error")]
    bad += [f"sweep M={r['m']} N={r['n']}" for r in data.get("c", {}).get("sweep", []) if r.get("error")]
    bad += [f"kv {r['kv']} B={r['batch']} ctx={r['ctx']}" for r in data.get("e", {}).get("kvdtype", []) if r.get("error")]
    bad += [f"({k}) {n}" for k, d in data.items() for n in d.get("notes", [])]
    for letter in "gdh":
        eng = data.get(letter, {}).get("engine") or {}
        if eng.get("error"):
            bad.append(f"({letter}) {SECTION_NAMES[letter]}: {eng['error']}")
    return bad


# ------------------------------------------------------------------------------------------ dry run

H200_SMS = 132
H200_BYTES_PER_S = 4.8e12  # HBM3e peak of the H200 (spec sheet): the data-movement estimate's rate


def dry_run(args: argparse.Namespace) -> int:
    """Kernel variants per section (launch shapes replayed on meta tensors, specialised as Triton's
    launcher does) and the bytes they move; compile seconds per variant measured here on one
    variant of each kernel. Prints the plan and the time budget against the section caps."""
    os.environ.pop("TRITON_INTERPRET", None)
    # A cold cache: the sample compiles must really compile (as on a fresh GPU machine).
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpu_check_dry_")
    import torch

    sys.path.insert(0, str(REPO / "tests" / "kernels"))
    try:
        import aot_compile_check as aot
    except ImportError as exc:
        print(f"gpu_check: --dry-run needs tests/kernels/aot_compile_check.py and triton's CUDA backend ({exc})",
              file=sys.stderr)
        return 2
    pa, ig, cw = aot._load("paged_attention"), aot._load("int4_gemm"), aot._load("cache_write")
    names = {pa: ["_paged_attention_kernel", "_merge_kernel"], ig: ["_int4_gemv_kernel", "_int4_gemm_kernel",
                                                                   "_splitk_reduce_kernel"], cw: ["_write_kv_cache_kernel"]}
    meta = torch.device("meta")

    def launches(mod: ModuleType, call: Callable[[], Any]) -> list[tuple[Any, tuple, dict]]:
        return aot.record(mod, names[mod], call)

    def attn(q_lens: list[int], seq_lens: list[int], hq: int, hkv: int, d: int, bs: int, dtype: Any,
             splits: int | None) -> list:
        n_tok, batch = sum(q_lens), len(seq_lens)
        blocks = sum(-(-s // bs) for s in seq_lens) + 2
        q = torch.empty(n_tok, hq, d, dtype=dtype, device=meta)
        k = torch.empty(blocks, bs, hkv, d, dtype=dtype, device=meta)
        cu = torch.empty(batch + 1, dtype=torch.int32, device=meta)
        sl = torch.empty(batch, dtype=torch.int32, device=meta)
        bt = torch.empty(batch, max(-(-s // bs) for s in seq_lens) + 1, dtype=torch.int32, device=meta)
        return launches(pa, lambda: pa.paged_attention(q, k, k, cu, sl, bt, d**-0.5, max(q_lens), max(seq_lens),
                                                       num_splits=splits))

    def int4(m: int, n: int, k: int, dtype: Any, g: int = 32) -> list:
        x = torch.empty(m, k, dtype=dtype, device=meta)
        codes = torch.empty(n, k // 2, dtype=torch.uint8, device=meta)
        sc = torch.empty(n, k // g, dtype=torch.float16, device=meta)
        return launches(ig, lambda: ig.int4_matmul(x, codes, sc, sc, g))

    def write(t: int, hkv: int, d: int, bs: int, nb: int, dtype: Any, slot_dtype: Any = torch.int64) -> list:
        key = torch.empty(t, hkv, d, dtype=dtype, device=meta)
        cache = torch.empty(nb, bs, hkv, d, dtype=dtype, device=meta)
        slots = torch.empty(t, dtype=slot_dtype, device=meta)
        return launches(cw, lambda: cw.write_kv_cache(key, key, cache, cache, slots))

    sections: dict[str, dict[str, Any]] = {}
    pa_, bc = plan_a(False), plan_bc(args)
    # (a)
    la: list = []
    bytes_a = 0
    for dtype in (torch.bfloat16, torch.float16):
        la += write(*pa_["write"], dtype)
        for _, q_lens, seq_lens, hq, hkv, d, bs in pa_["attn"]:
            for splits in SPLITS_A:
                la += attn(q_lens, seq_lens, hq, hkv, d, bs, dtype, splits)
            bytes_a += 2 * (sum(-(-s // bs) for s in seq_lens) + 2) * bs * hkv * d * 2
        for m, n, k in pa_["int4"]:
            la += int4(m, n, k, dtype)
            bytes_a += n * k * 4 + n * k // 2
            xa = torch.empty(m, k, dtype=dtype, device=meta)
            c8 = torch.empty(n, k, dtype=torch.int8, device=meta)
            s16 = torch.empty(n, k // 16, dtype=torch.float32, device=meta)
            la += launches(ig, lambda: ig.int4_matmul(xa, c8, s16, None, 16))  # int8 codes (Q6_K form)
            bytes_a += n * k * 5
    sections["a"] = dict(launches=la, bytes=bytes_a, work=f"{len(la)} checked launches + torch references")
    # (b)
    lb: list = []
    bytes_b, calls_b = 0, 0
    hq, hkv, d, bs = DECODE_SHAPE["hq"], DECODE_SHAPE["hkv"], DECODE_SHAPE["d"], DECODE_SHAPE["bs"]
    for batch in bc["batches"]:
        for ctx in bc["contexts"]:
            q = torch.empty(batch, hq, d, dtype=torch.bfloat16, device=meta)
            k = torch.empty(batch * ctx // bs, bs, hkv, d, dtype=torch.bfloat16, device=meta)
            auto = pa.auto_num_splits(q, k, batch, 1, ctx)
            for splits in {1, auto if auto > 1 else 4, auto}:
                lb += attn([1] * batch, [ctx] * batch, hq, hkv, d, bs, torch.bfloat16, splits)
            kv = 2 * batch * ctx * hkv * d * 2
            copies = max(1, min(64, -(-ROTATE_BYTES // kv)))
            calls = max(copies, 8)
            n_calls = 3 * (copies + 7 * calls)  # 3 timed modes (off, split, SDPA): warm-up + capture + 6 replays
            calls_b += n_calls
            bytes_b += n_calls * kv + 3 * copies * kv  # timed reads + random init and the contiguous copy
    sections["b"] = dict(launches=lb, bytes=bytes_b, work=f"{calls_b} timed calls incl. SDPA")
    # (c)
    lc: list = []
    bytes_c, calls_c = 0, 0
    for n, k in bc["shapes"]:
        for m in bc["int4_m"]:
            lc += int4(m, n, k, torch.float16)
            for wbytes in (n * k // 2 + n * k // 8, n * k * 2):  # INT4 codes + scales, fp16 W
                copies = max(1, min(64, -(-ROTATE_BYTES // wbytes)))
                n_calls = copies + 7 * max(copies, 8)
                calls_c += n_calls
                bytes_c += n_calls * wbytes + copies * wbytes
    for n, k in bc["shapes"]:
        for form, (g, bits, has_min) in KQUANT_FORMS.items():
            x1 = torch.empty(1, k, dtype=torch.float16, device=meta)
            codes = torch.empty(n, k * bits // 8, dtype=torch.uint8 if bits == 4 else torch.int8, device=meta)
            sc = torch.empty(n, k // g, dtype=torch.float32, device=meta)
            lc += launches(ig, lambda: ig.int4_matmul(x1, codes, sc, sc if has_min else None, g))
            wbytes = n * k * bits // 8 + (2 if has_min else 1) * 4 * n * k // g
            copies = max(1, min(64, -(-ROTATE_BYTES // wbytes)))
            n_calls = copies + 7 * max(copies, 8)
            calls_c += n_calls
            bytes_c += n_calls * wbytes + copies * wbytes
    sections["c"] = dict(launches=lc, bytes=bytes_c, work=f"{calls_c} timed calls incl. fp16 matmul and K-quant forms")
    # (e)
    le: list = []
    bytes_e, calls_e = 0, 0
    storage = {"fp16": torch.float16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
    for batch in plan_e(args)["batches"]:
        for ctx in plan_e(args)["contexts"]:
            for kv in KV_DTYPES_E:
                nb = batch * ctx // bs
                q = torch.empty(batch, hq, d, dtype=torch.float16, device=meta)
                k = torch.empty(nb, bs, hkv, d, dtype=storage[kv], device=meta)
                sc = None if kv == "fp16" else torch.empty(nb, bs, hkv, dtype=torch.float32, device=meta)
                cu = torch.empty(batch + 1, dtype=torch.int32, device=meta)
                sl = torch.empty(batch, dtype=torch.int32, device=meta)
                bt = torch.empty(batch, ctx // bs, dtype=torch.int32, device=meta)
                le += launches(pa, lambda: pa.paged_attention(q, k, k, cu, sl, bt, d**-0.5, 1, ctx, k_scale=sc,
                                                              v_scale=sc))
                kvb = batch * ctx * 2 * hkv * (d * 2 if kv == "fp16" else d + 4)
                copies = max(1, min(64, -(-ROTATE_BYTES // kvb)))
                n_calls = copies + 7 * max(copies, 8) + 1  # warm-up + capture + 6 replays, one checked call
                calls_e += n_calls
                bytes_e += n_calls * kvb + 2 * copies * kvb  # timed reads + random init
    sections["e"] = dict(launches=le, bytes=bytes_e, work=f"{calls_e} timed calls + torch references")
    # (d): the engine's step shapes are data-dependent; enumerate the shapes its runs can produce
    # (every token count up to the chunk size, every batch up to 64): an upper bound on its variants.
    ld: list = []
    from kvcli.config import PRESETS

    for preset, dtypes, max_tok in (("smollm2-135m", (torch.float32, torch.bfloat16), 256),
                                    ("llama-3-8b", (torch.bfloat16,), 512)):
        c = PRESETS[preset]
        h, heads, kvh = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or h // heads
        shapes = [(hd * (heads + 2 * kvh), h), (h, hd * heads), (2 * c["intermediate_size"], h),
                  (h, c["intermediate_size"])]
        for dtype in dtypes:
            for m in range(1, max_tok + 1):
                for n, k in shapes:
                    ld += int4(m, n, k, dtype)
                ld += write(m, kvh, hd, 16, 64, dtype)
            for batch in range(1, 65):
                for ctx in (64, 2048):
                    ld += attn([1] * batch, [ctx] * batch, heads, kvh, hd, 16, dtype, None)
                ld += attn([1] * (batch - 1) + [200], [300] * batch, heads, kvh, hd, 16, dtype, None)
    sections["d"] = dict(launches=ld, bytes=0, work=f"capped by --engine-seconds {args.engine_seconds:g} + setup")
    # (g): the 8B shapes at the two decode buckets (1 and 32) and the 512-token prefill chunks; (d)'s bound
    # above covers its other shapes.
    lg: list = []
    c = PRESETS["llama-3-8b"]
    h, heads, kvh = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // heads
    shapes = [(hd * (heads + 2 * kvh), h), (h, hd * heads), (2 * c["intermediate_size"], h), (h, c["intermediate_size"])]
    for m in (1, 32, 512):
        for n, k in shapes:
            lg += int4(m, n, k, torch.bfloat16)
        lg += write(m, kvh, hd, 16, 64, torch.bfloat16)
    for batch in (1, 32):
        for ctx in (600, 640):
            lg += attn([1] * batch, [ctx] * batch, heads, kvh, hd, 16, torch.bfloat16, None)
    lg += attn([512], [512], heads, kvh, hd, 16, torch.bfloat16, None)
    sections["g"] = dict(launches=lg, bytes=0, work="random 8B weights, 4 x 5 generate calls, graph captures")
    sections["h"] = dict(launches=[], bytes=0, work="transformers 8B bf16: decode + 3 modes, time-limited")

    # Compile seconds per variant, measured here on the first variant of each kernel.
    seen: set = set()
    per_kernel: dict[str, float] = {}
    for letter in ORDER:
        for fn, a, kw in sections[letter]["launches"]:
            if fn.__name__ in per_kernel:
                continue
            t0 = time.perf_counter()
            aot.compile_launch(fn, a, kw, 90)
            per_kernel[fn.__name__] = time.perf_counter() - t0
    env_line = f"{os.cpu_count()} CPU cores here, triton {importlib.import_module('triton').__version__}"
    print(f"gpu_check --dry-run{' --quick' if args.quick else ''}: compile seconds per variant measured here "
          f"({env_line}): " + ", ".join(f"{k.strip('_')} {v:.1f} s" for k, v in per_kernel.items()))
    print("| section | new kernel variants | compile s (est.) | work | data s at 4.8 TB/s | cap s | fits |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    total_var, total_est = 0, 0.0
    for letter in ORDER:
        keys = {aot.spec_key(fn, a, kw): fn.__name__ for fn, a, kw in sections[letter]["launches"]}
        new = {k: v for k, v in keys.items() if k not in seen}  # Triton's disk cache serves repeats
        seen |= set(keys)
        comp = sum(per_kernel[v] for v in new.values())
        data_s = sections[letter]["bytes"] / H200_BYTES_PER_S
        extra = {"d": args.engine_seconds, "g": 30.0, "h": sum(_engine_module().HF_SECONDS.values())}.get(letter, 0.0)
        est = comp + data_s + extra
        total_var += len(new)
        total_est += est
        cap = args.caps[letter]
        print(f"| ({letter}) | {len(new)} | {comp:.0f} | {sections[letter]['work']} | {data_s:.1f} | {cap:g} | "
              f"{'yes' if est <= cap else 'NO: raise its cap or cut its work'} |")
    print(f"total: {total_var} kernel variants; estimate {total_est:.0f} s against caps summing to "
          f"{sum(args.caps[k] for k in ORDER):g} s (the run cannot exceed the caps: each section is killed at its cap)")
    return 0


# --------------------------------------------------------------------------------------------- main


def _env(args: argparse.Namespace, argv: list[str] | None) -> dict[str, str]:
    import torch
    import triton

    return dict(
        date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        device=torch.cuda.get_device_name(0) if not args.cpu_smoke else "CPU (Triton interpreter)",
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=str(torch.version.cuda),
        command=shlex.join(["python", *sys.argv]) if argv is None else shlex.join(["python", "scripts/gpu_check.py", *argv]),
    )


def run_sections(args: argparse.Namespace, env: dict[str, str], state: Path) -> None:
    """Runs args.sections in this process (a worker runs one); every case saved as it finishes."""
    import torch

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    mods = load_kernels()
    run = Run(args, env, state)
    plan = plan_bc(args)
    for letter in args.sections:
        print(f"({letter}) " + SECTION_NAMES[letter], flush=True)
        try:
            if letter == "a":
                section_a(run, mods, device)
            elif letter in "bce":
                sec = run.section(letter)
                bw = copy_bandwidth(torch, device, plan["copy_bytes"])
                print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
                {"b": section_b, "c": section_c, "e": section_e}[letter](run, mods, device, bw)
            else:
                {"d": section_d, "g": section_g, "h": section_h}[letter](run)
            run.data[letter]["done"] = True
        except SectionAborted as exc:
            run.data[letter]["notes"].append(f"{exc}: the rest of the section was not run")
        except Exception as exc:  # noqa: BLE001 - outside any case (setup): the section ends, the run goes on
            if letter not in run.data:
                run.section(letter)
            run.data[letter]["notes"].append(f"section setup failed: {_msg(exc)}")
        run.save()


def drive(args: argparse.Namespace, argv: list[str] | None, state: Path) -> None:
    """One process per section, in order, each killed at its cap; what it saved before stays."""
    base = [sys.executable, str(Path(__file__).resolve())]
    passthrough = ["--engine-seconds", str(args.engine_seconds)] + (["--quick"] if args.quick else []) \
        + (["--cpu-smoke"] if args.cpu_smoke else []) + (["--out", args.out] if args.out else [])
    for x in args.inject_failure:
        passthrough += ["--inject-failure", x]
    for letter in args.sections:
        cap = args.caps[letter]
        print(f"== section ({letter}), cap {cap:g} s", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(base + ["--sections", letter, "--state", str(state)] + passthrough)
        note = None
        try:
            rc = proc.wait(timeout=cap)
            if rc != 0:
                note = f"its process exited with status {rc} after {time.perf_counter() - t0:.0f} s"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            note = f"stopped at its {cap:g} s cap"
        f = state / f"{letter}.json"
        d = json.loads(f.read_text()) if f.exists() else dict(correct=[], decode=[], int4=[], kvdtype=[], engine=None,
                                                              copy_bw=0.0, notes=[], done=False)
        if note or not d.get("done"):
            d["notes"].append((note or "did not finish") + " (rows it finished are kept)")
            f.write_text(json.dumps(d))
        print(f"== section ({letter}): {note or 'done'} in {time.perf_counter() - t0:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first kernel import
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed", file=sys.stderr)
        return 2
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device available (torch.cuda.is_available() is False); "
              "use --cpu-smoke for an interpreter-only smoke run or --dry-run for the plan", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("gpu_check: triton is not installed", file=sys.stderr)
        return 2
    env = _env(args, argv)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        state = Path(args.state) if args.state else Path(tmp)
        if args.state is None:
            (state / "env.json").write_text(json.dumps(env))
        else:  # a worker: the driver's date and command head the report
            env = json.loads((state / "env.json").read_text())
        if args.state is None:
            print(f"gpu_check on {env['device']} (torch {env['torch']}, triton {env['triton']}); sections "
                  f"{args.sections}, caps " + ", ".join(f"{k} {args.caps[k]:g} s" for k in args.sections), flush=True)
        if len(args.sections) > 1 and not args.in_process and args.state is None:
            drive(args, argv, state)
        else:
            run_sections(args, env, state)
        if args.state is not None:
            return 0  # the driver reports
        text = write_report(state, args, env)
        bad = failures(state)
    print()
    print(text)
    if bad:
        print(f"gpu_check: {len(bad)} check(s) failed or did not finish: " + "; ".join(bad)[:1000], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

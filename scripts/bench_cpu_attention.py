"""Decode attention of one layer: the torch backend's torch path (native=False: GEMMs, scratch conversion
of 16-bit caches) against kvcli's C kernel (kvcli_kernels/cpu_attention.c), same backend entry point.

SmolLM2-135M's shape by default (3 KV heads, 9 q heads, head_dim 64, blocks of 16), --batch requests
decoding at each context in consecutive blocks (the torch path's best case: its K/V are views of the
pool). Each timed call walks --layers separate caches, as a step does, so long contexts come from
memory rather than a warm L2; the figure is wall time per layer. Paths are interleaved round by round
and the median taken, for a shared machine whose load changes. No model: seconds, not minutes.

    python scripts/bench_cpu_attention.py [--contexts 512,4096] [--kv-dtypes fp32,fp16] [--threads 1,2]

--model: whole decode steps of the bundled model instead (one request at each context, the engine's
default CPU weights), the same engine's backend switched between the two paths round by round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--kv-dtypes", default="fp32,fp16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", action="store_true", help="time whole decode steps of the bundled model")
    ap.add_argument("--steps", type=int, default=8, help="--model: decode steps per path and round")
    a = ap.parse_args()
    if a.model:
        return model_steps(a)

    from kvcli.attention.base import AttentionMetadata
    from kvcli.attention.torch_backend import TorchAttentionBackend, native_attention
    from kvcli.bench.machine import machine_line
    from kvcli.kvcache.kv_cache import LayerKV
    from kvcli.kvcache.kv_dtype import kv_dtype_of, quantize
    from kvcli.model.int8dot_cpu import native_isa

    if native_attention() is None:
        raise SystemExit("the C kernel is unavailable (KVCLI_NATIVE=0, or no compiler: see cpu_attention.load_error)")
    machine = machine_line()  # before the thread counts below change torch's
    kvh, hq, d, bs, nb = 3, 9, 64, 16, a.batch
    threads = [int(t) for t in a.threads.split(",")]
    rows = []
    for context in (int(c) for c in a.contexts.split(",")):
        nblk = -(-context // bs)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([(i + 1) * nblk * bs for i in range(nb)]),
            cu_seqlens_q=torch.arange(nb + 1, dtype=torch.int32), seq_lens=torch.full((nb,), context, dtype=torch.int32),
            block_tables=torch.arange(1, nb * nblk + 1, dtype=torch.int32).view(nb, nblk), max_seqlen_q=1,
            max_seq_len=context, seq_lens_list=(context,) * nb, query_lens_list=(1,) * nb)
        q = torch.randn(nb, hq, d, generator=torch.Generator().manual_seed(1))
        for name in a.kv_dtypes.split(","):
            fmt = kv_dtype_of(name)
            gen = torch.Generator().manual_seed(0)
            layers = []
            for _ in range(a.layers):  # head-major storage, as KVCache allocates it
                k, v = (torch.randn(kvh, nb * nblk + 1, bs, d, generator=gen).movedim(0, 2) for _ in range(2))
                if fmt.quantized:
                    (kc, ks), (vc, vs) = quantize(k, fmt.storage), quantize(v, fmt.storage)
                    layers.append(LayerKV(*(t.movedim(2, 0).contiguous().movedim(0, 2) for t in (kc, vc, ks, vs))))
                else:
                    layers.append(LayerKV(k.to(fmt.storage), v.to(fmt.storage)))
            paths = {"torch": TorchAttentionBackend(native=False), "kernel": TorchAttentionBackend()}
            for nt in threads:
                torch.set_num_threads(nt)
                outs = {}
                for label, be in paths.items():  # warm-up (scratch buffers, build, thread pool)
                    outs[label] = be.forward(q, layers[0], meta, d**-0.5)
                assert torch.allclose(outs["torch"], outs["kernel"], atol=1e-4, rtol=1e-4)
                times: dict[str, list[float]] = {label: [] for label in paths}
                for _ in range(a.rounds):
                    for label, be in paths.items():
                        t = time.perf_counter()
                        for c in layers:
                            be.forward(q, c, meta, d**-0.5)
                        times[label].append((time.perf_counter() - t) / a.layers * 1e6)
                tt, tk = statistics.median(times["torch"]), statistics.median(times["kernel"])
                rows.append(f"| {context} | {name} | {nt} | {tt:.1f} | {tk:.1f} | {tt / tk:.2f}x |")
            del layers
    print(f"# decode attention per layer, {nb} request(s), {kvh} KV heads x {d}, GQA {hq // kvh}, blocks of {bs}; "
          f"wall us per layer over {a.layers} layers, median of {a.rounds} interleaved rounds; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# {machine}; kernel build {native_isa()}")
    print("| context | KV dtype | threads | torch path us | C kernel us | speed-up |")
    print("|---:|---|---:|---:|---:|---:|")
    print("\n".join(rows))


def model_steps(a: argparse.Namespace) -> None:
    """Decode steps of the bundled model at each context: one engine per context and KV format, a
    request prefilled to that length, then rounds of --steps steps with the kernel and as many with
    torch's path (engine.backend.native); wall ms per step, median over rounds."""
    from kvcli.attention.torch_backend import native_attention
    from kvcli.bench.machine import machine_line
    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.model.int8dot_cpu import native_isa
    from kvcli.model.loader import load_weights

    if native_attention() is None:
        raise SystemExit("the C kernel is unavailable (KVCLI_NATIVE=0, or no compiler: see cpu_attention.load_error)")
    machine = machine_line()
    loaded = load_weights(None)
    model, rows = None, []
    for context in (int(c) for c in a.contexts.split(",")):
        for name in a.kv_dtypes.split(","):
            engine = LLMEngine(loaded, EngineOptions(device="cpu", kv_dtype=name, max_model_len=context + 1024,
                                                     kv_budget="1GiB"), model=model)
            model = engine.model
            ids = (engine.tokenizer.encode("The keeper climbed the stairs to the lamp room and lit the lamp. ")
                   * context)[:context]
            req = engine.add_request(ids, SamplingParams(
                max_tokens=1 + 2 * a.rounds * a.steps * len(a.threads.split(",")), ignore_eos=True))
            while not req.output_token_ids:  # the prompt, prefilled in chunks
                engine.step()
            for nt in (int(t) for t in a.threads.split(",")):
                torch.set_num_threads(nt)
                times: dict[bool, list[float]] = {True: [], False: []}
                for _ in range(a.rounds):
                    for native in (True, False):
                        engine.backend.native = native
                        t = time.perf_counter()
                        for _ in range(a.steps):
                            engine.step()
                        times[native].append((time.perf_counter() - t) / a.steps * 1e3)
                tk, tt = statistics.median(times[True]), statistics.median(times[False])
                rows.append(f"| {context} | {name} | {nt} | {tt:.2f} | {tk:.2f} | {tt / tk:.2f}x |")
            del engine
    print(f"# decode step of the bundled model, 1 request, wall ms per step, median of {a.rounds} rounds of "
          f"{a.steps} steps per path; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# {machine}; kernel build {native_isa()}")
    print("| context | KV dtype | threads | torch path ms | C kernel ms | speed-up |")
    print("|---:|---|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

"""Pre-quantized Hugging Face folders (AWQ / GPTQ / compressed-tensors) against the bundled GGUF (CPU).

Folders (written once into .cache/hf-quant/, reused after): the bundled SmolLM2-135M's layer linears
(its Q4_1 weights dequantized) re-quantized round-to-nearest at group size 64 (576 columns is not a
multiple of 128) and packed per each format's layout (kvcli/model/hf_quant_encode.py); embeddings
and norms as fp16; its tokenizer. Round-to-nearest loses accuracy against the original; what is
measured here is the loader and the resident form, not a quantization method.
Per model: the file bytes of the layer linears, the resident layer bytes after load and the linear
path, load seconds (load_weights + engine, best of --repeats), the peak RSS of a fresh process that
only loads it (no dense copy: compare the dense fp16 folder quantized at load with --quant int4), and
greedy decode tok/s (--new-tokens after a --prompt-tokens prompt, decode steps only, best of
--repeats, after a warm-up). The 1-minute load average is printed per row: on a shared machine the
times are only as good as it is idle.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvcli.bench.harness import REPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CACHE = REPO / ".cache" / "hf-quant"
FORMATS = [("awq", False), ("gptq", True), ("gptq_v2", False), ("compressed-tensors", True),
           ("compressed-tensors", False)]
GROUP = 64


def write_folders(force: bool) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from kvcli.bench.internals import hf_quant_encode
    encode, quantization_config, rtn_quantize = (hf_quant_encode.encode, hf_quant_encode.quantization_config,
                                                 hf_quant_encode.rtn_quantize)
    from kvcli.model.loader import bundled_gguf_path, load_weights
    from kvcli.bench.internals import QuantTensor

    out = {}
    names = [f"{fmt}-{'sym' if sym else 'asym'}-g{GROUP}" for fmt, sym in FORMATS] + ["dense-fp16"]
    if not force and all((CACHE / n / "model.safetensors").exists() for n in names):
        return {n: CACHE / n for n in names}
    gguf = bundled_gguf_path()
    cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).to_dict()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    weights = load_weights(None).weights
    dense = {k: (v.dequantize() if isinstance(v, QuantTensor) else v.float()) for k, v in weights.items()}
    for (fmt, sym), name in zip([*FORMATS, (None, False)], names):
        d = CACHE / name
        d.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for k, w in dense.items():
            if fmt and k.startswith("model.layers.") and k.endswith("proj.weight"):
                q, s, z = rtn_quantize(w, GROUP, sym)
                tensors.update(encode(fmt, k[: -len("weight")], q, s, z))
            else:
                tensors[k] = w.to(torch.float16).contiguous()
        save_file(tensors, str(d / "model.safetensors"))
        qc = {"quantization_config": quantization_config(fmt, GROUP, sym)} if fmt else {}
        (d / "config.json").write_text(json.dumps(dict(cfg, **qc)))
        tok.save_pretrained(str(d))
        out[name] = d
    return out


def layer_file_bytes(path: Path) -> int:
    if path.suffix == ".gguf":
        import gguf

        return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path), "r").tensors
                   if t.name.startswith("blk.") and len(t.shape) == 2)
    from safetensors import safe_open

    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for k in f.keys():
            if k.startswith("model.layers.") and "proj." in k:
                t = f.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * {"I32": 4, "F16": 2, "F32": 4}[t.get_dtype()]
    return total


PEAK = ("import resource, sys; from kvcli.llm import LLM; "
        "LLM(sys.argv[1], quant='int4' if sys.argv[1].endswith('dense-fp16') else 'auto', kv_budget='64MiB'); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")


def peak_rss_mib(spec: str) -> float:
    out = subprocess.run([sys.executable, "-c", PEAK, spec], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def measure(spec: str, args) -> dict:
    from kvcli.config import SamplingParams
    from kvcli.llm import LLM

    loads, speeds = [], []
    llm = None
    for _ in range(args.repeats):
        t = time.perf_counter()
        llm = LLM(spec, quant="int4" if spec.endswith("dense-fp16") else "auto", kv_budget="64MiB",
                  prefix_caching=False)
        loads.append(time.perf_counter() - t)
    ids = list(range(1000, 1000 + args.prompt_tokens))
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    for _ in range(args.repeats):
        before = llm.engine.stats()
        llm.generate([ids], params)
        after = llm.engine.stats()
        speeds.append((after.decode_tokens - before.decode_tokens) / (after.decode_seconds - before.decode_seconds))
    return {"resident": llm.engine.weight_bytes()["layers"], "path": llm.engine.linear_mode, "load": min(loads),
            "tok_s": max(speeds)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--force", action="store_true", help="rewrite the folders")
    args = ap.parse_args(argv)
    from kvcli.model.loader import bundled_gguf_path

    folders = write_folders(args.force)
    models = {"bundled Q4_1 GGUF (g32)": bundled_gguf_path(), **folders}
    print(f"{'model':<28} {'file MiB':>8} {'resident MiB':>12} {'path':>9} {'load s':>7} {'peak RSS MiB':>12} "
          f"{'decode tok/s':>12}")
    for name, path in models.items():
        if name == "dense-fp16":
            name = "dense fp16, --quant int4"
        spec = str(path)
        m = measure(spec, args)
        rss = peak_rss_mib(spec)
        print(f"{name:<28} {layer_file_bytes(path) / 2**20:8.1f} {m['resident'] / 2**20:12.1f} {m['path']:>9} "
              f"{m['load']:7.2f} {rss:12.0f} {m['tok_s']:12.1f}   (load average {os.getloadavg()[0]:.1f})")

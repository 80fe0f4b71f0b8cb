"""Random-weight llama GGUFs of real shapes (1B, 3B, 8B) for the benchmarks at model sizes people run.

The blocks are random but well-formed (kquant_encode.random_blocks: random codes, finite fp16 scales), so a
file of any size is written in seconds, with no quantization pass: the figures that use them measure bytes,
bandwidth and speed, not quality. The tokenizer is the bundled model's (its 49,152-token vocabulary; real
1B-8B models have 128k, which only the embedding and the vocabulary projection would see).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool  # the embedding table is the vocabulary projection (no output.weight)


SHAPES = {
    "1b": Shape(2048, 8192, 16, 32, 8, tied=True),  # TinyLlama-1.1B / Llama-3.2-1B-like
    "3b": Shape(3072, 8192, 28, 24, 8, tied=True),  # Llama-3.2-3B-like
    "8b": Shape(4096, 14336, 32, 32, 8, tied=False),  # Llama-3.1-8B-like
}

# Per file kind: the linears' type (Q4_K_M: llama.cpp's mix, kquant_encode.q4_k_m_type), the embedding's and
# an untied vocabulary projection's.
KINDS = {
    "Q4_0": ("Q4_0", "Q8_0", "Q6_K"),
    "Q4_K_M": ("Q4_K_M", "Q6_K", "Q6_K"),
    "Q8_0": ("Q8_0", "Q8_0", "Q8_0"),
}


def write_shape(path: Path, shape: Shape, kind: str, seed: int = 0) -> Path:
    """A llama GGUF of `shape` with `kind`'s tensor types (a key of KINDS) at `path`."""
    import gguf
    import numpy as np

    from kvcli.bench.internals import kquant_encode
    from kvcli.model.loader import bundled_gguf_path

    linear, embedding, head = KINDS[kind]
    rng = np.random.default_rng(seed)
    src = kquant_encode.open_reader(bundled_gguf_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    h, d = shape.hidden, shape.hidden // shape.heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(path.stem)
    for add, v in [(w.add_block_count, shape.layers), (w.add_context_length, 32768), (w.add_embedding_length, h),
                   (w.add_feed_forward_length, shape.intermediate), (w.add_head_count, shape.heads),
                   (w.add_head_count_kv, shape.kv_heads), (w.add_rope_dimension_count, d), (w.add_vocab_size, vocab)]:
        add(v)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    kquant_encode.copy_fields(src, w, keep=lambda key: key.startswith("tokenizer."))

    def tensor(name: str, n: int, k: int, type_name: str) -> None:
        data = kquant_encode.random_blocks(type_name, n, k, rng, scale=0.02)
        kquant_encode.add_tensor(w, name, data, type_name)

    def norm(name: str) -> None:
        kquant_encode.add_tensor(w, name, np.ones(h, np.float32), "F32")

    tensor("token_embd.weight", vocab, h, embedding)
    norm("output_norm.weight")
    if not shape.tied:
        tensor("output.weight", vocab, h, head)
    linears = {"attn_q": (h, h), "attn_k": (shape.kv_heads * d, h), "attn_v": (shape.kv_heads * d, h),
               "attn_output": (h, h), "ffn_gate": (shape.intermediate, h), "ffn_up": (shape.intermediate, h),
               "ffn_down": (h, shape.intermediate)}
    for i in range(shape.layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for part, (n, k) in linears.items():
            name = f"blk.{i}.{part}.weight"
            tensor(name, n, k, kquant_encode.q4_k_m_type(name, (n, k), "F32") if linear == "Q4_K_M" else linear)
    kquant_encode.finish(w)
    return path


def shape_file(shape: str, kind: str) -> Path:
    """.cache/shapes/<shape>-<kind>.gguf, written on first use (a few seconds to a minute by size)."""
    import sys

    from kvcli.bench.harness import REPO

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (choose from {', '.join(sorted(SHAPES))})")
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r} (choose from {', '.join(KINDS)})")
    path = REPO / ".cache" / "shapes" / f"{shape}-{kind.lower()}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path.name} ...", file=sys.stderr, flush=True)
        write_shape(path.with_suffix(".part"), SHAPES[shape], kind).rename(path)
    return path

"""Read a GGUF file's config and tensors (header parsed by kvcli.model.gguf_file; gguf-py for types).

Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensors stay quantized (canonical QuantTensor
layouts, lossless); F32 loads as float32, F16 / BF16 stay half precision. Any other GGML type is
refused at load with a one-line error naming the tensor and its type.
llama.cpp stores q/k rows permuted for its rope kernel; they are permuted back to Hugging Face order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvcli.config import ModelConfig
from kvcli.model import kquants
from kvcli.model.gguf_file import GGUFFile, GGUFTensor, read_gguf
from kvcli.model.quant import QuantTensor, from_gguf_q4_0, from_gguf_q4_1, from_gguf_q8_0

# GGML type name -> decoder of its raw blocks (uint8 tensor, rows N, in_features K) into a QuantTensor.
_DECODERS = {
    "Q4_0": from_gguf_q4_0, "Q4_1": from_gguf_q4_1, "Q8_0": from_gguf_q8_0,
    "Q5_0": kquants.from_gguf_q5_0, "Q5_1": kquants.from_gguf_q5_1,
    "Q4_K": kquants.from_gguf_q4_k, "Q5_K": kquants.from_gguf_q5_k, "Q6_K": kquants.from_gguf_q6_k,
}
SUPPORTED_TYPES = ("F32", "F16", "BF16", *_DECODERS)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFError(ValueError):
    pass


# Metadata under "<arch>." that kvcli reads (read_config). Any other key under that prefix may change
# what the model computes (a rotary scaling, soft-capping, partial rotary, experts, ...): the file is
# refused, naming it, rather than loaded into a different model.
ARCH_KEYS_READ = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "attention.sliding_window",
    "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
})
# Under "<arch>.", known not to change the computation where the rotary scaling is none or linear
# (llama.cpp reads the original context only for YaRN; "finetuned" is a note).
ARCH_KEYS_INERT = frozenset({"rope.scaling.original_context_length", "rope.scaling.finetuned"})
# Other namespaces: file description (general.*), the tokenizer (tokenizer.*: read by the tokenizer
# builder), quantization notes (quantize.*: the importance matrix used), split files (checked below).
INERT_NAMESPACES = ("general.", "tokenizer.", "quantize.")
ROPE_SCALINGS = ("none", "linear")


def _field(reader: GGUFFile, key: str, default=None):
    return reader.get(key, default)


def _required(reader: GGUFFile, key: str, path: Path):
    v = _field(reader, key)
    if v is None:
        raise GGUFError(f"{path.name}: missing metadata {key}")
    return v


def _check_keys(reader: GGUFFile, arch: str, path: Path) -> None:
    """Every metadata key is read, known inert, or the file is refused in one line naming it."""
    prefix = arch + "."
    for key in reader.metadata:
        if key.startswith(INERT_NAMESPACES):
            continue
        if key.startswith("split."):
            count = _field(reader, "split.count", 1)
            if key == "split.count" and int(count) > 1:
                raise GGUFError(f"{path.name}: one part of a split GGUF ({count} parts): merge the parts first "
                                f"(llama.cpp's llama-gguf-split --merge)")
            continue
        rest = key[len(prefix):] if key.startswith(prefix) else None
        if rest in ARCH_KEYS_READ or rest in ARCH_KEYS_INERT:
            continue
        value = _field(reader, key)
        shown = value if not isinstance(value, (list, tuple)) or len(value) <= 4 else f"[{len(value)} values]"
        raise GGUFError(f"{path.name}: metadata {key} = {shown!r} is not read by kvcli and may change what the "
                        f"model computes; refusing the file rather than computing a different model")


def _rope_scaling(reader: GGUFFile, a: str, path: Path) -> dict | None:
    """<arch>.rope.scaling.type: none, or linear (positions divided by the factor, as llama.cpp's freq_scale);
    the others (yarn, longrope, ...) are refused."""
    kind = _field(reader, f"{a}.rope.scaling.type")
    if kind is None or kind == "none":
        return None
    if kind not in ROPE_SCALINGS:
        raise GGUFError(f"{path.name}: {a}.rope.scaling.type = {kind!r}: a rotary scaling kvcli does not compute "
                        f"(supported: {', '.join(ROPE_SCALINGS)})")
    factor = _field(reader, f"{a}.rope.scaling.factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise GGUFError(f"{path.name}: {a}.rope.scaling.type = linear needs a positive {a}.rope.scaling.factor "
                        f"(got {factor!r})")
    return {"rope_type": "linear", "factor": float(factor)}


def read_config(reader: GGUFFile, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise GGUFError(f"{path.name}: unsupported architecture {arch!r} (kvcli runs llama-family GGUFs: llama, qwen2)")
    a = arch
    _check_keys(reader, arch, path)
    heads = int(_required(reader, f"{a}.attention.head_count", path))
    hidden = int(_required(reader, f"{a}.embedding_length", path))
    n_vocab = _field(reader, f"{a}.vocab_size")
    if n_vocab is None:
        n_vocab = len(_required(reader, "tokenizer.ggml.tokens", path))
    names = {t.name for t in reader.tensors}
    head_dim = _field(reader, f"{a}.attention.key_length") or hidden // heads
    window = _field(reader, f"{a}.attention.sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise GGUFError(f"{path.name}: {a}.attention.sliding_window must be a non-negative integer (got {window!r})")
    for key in (f"{a}.rope.dimension_count", f"{a}.attention.value_length"):
        got = _field(reader, key)
        if got is not None and int(got) != int(head_dim):  # partial rotary, or V heads of another width
            raise GGUFError(f"{path.name}: {key} = {got} differs from the head dimension {head_dim}: kvcli "
                            f"computes full-width rotary and equal K/V heads only")
    # Generation ends on llama.cpp's end-of-generation set: eos, end of turn, end of message.
    eog = [v for v in (_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")) if v is not None]
    return ModelConfig(
        name=str(_field(reader, "general.name", path.stem)),
        architecture=arch,
        vocab_size=int(n_vocab),
        hidden_size=hidden,
        intermediate_size=int(_required(reader, f"{a}.feed_forward_length", path)),
        num_layers=int(_required(reader, f"{a}.block_count", path)),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(v) for v in eog)),
        rope_scaling=_rope_scaling(reader, a, path),
        sliding_window=int(window) if window else None,  # 0 = none, as llama.cpp writes it
    )


def _unpermute_index(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (pairs of rotary halves interleaved)."""
    half = rows // n_head // 2
    # llama.cpp wrote gguf[h, j, s] = hf[h, s, j] (shape [n_head, half, 2] vs [n_head, 2, half]).
    return torch.arange(rows).reshape(n_head, half, 2).transpose(1, 2).reshape(-1)


def _tensor(t: GGUFTensor, path: Path) -> QuantTensor | torch.Tensor:
    import gguf

    qt = t.tensor_type
    name = getattr(qt, "name", str(qt))
    if name not in SUPPORTED_TYPES:
        raise GGUFError(f"{path.name}: tensor {t.name} is {name}, a GGML type kvcli does not read "
                        f"(supported: {', '.join(SUPPORTED_TYPES)})")
    dims = [int(x) for x in t.shape]  # GGUF order: ne0 (in_features) first
    if len(dims) == 1:
        n, k = 1, dims[0]
    else:
        k, n = dims[0], int(np.prod(dims[1:]))
    block = gguf.GGML_QUANT_SIZES[qt][0]
    if k % block:
        raise GGUFError(f"{path.name}: tensor {t.name} ({name}) has {k} columns, not a multiple of its "
                        f"{block}-element blocks")
    raw = torch.from_numpy(np.array(t.data, copy=True))  # the reader hands out a read-only memmap
    if name in _DECODERS:
        return _DECODERS[name](raw, n, k)
    if name == "F32":
        out = raw
    else:  # F16 / BF16 stay half precision; linears upcast them per call, --dequantize once
        out = raw.view(torch.float16 if name == "F16" else torch.bfloat16)
    return out.reshape(k) if len(dims) == 1 else out.reshape(n, k)


def tensor_bytes_by_type(reader: GGUFFile) -> dict[str, tuple[int, int]]:
    """GGML type name -> (tensor count, bytes in the file), for `kvcli inspect`."""
    out: dict[str, tuple[int, int]] = {}
    for t in reader.tensors:
        c, b = out.get(t.tensor_type.name, (0, 0))
        out[t.tensor_type.name] = (c + 1, b + int(t.nbytes))
    return out


def open_gguf(path: Path) -> GGUFFile:
    try:
        return read_gguf(path)
    except (ValueError, OSError) as e:  # bad magic, truncated header, unreadable file
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None


def _unknown_tensor(name: str, arch: str, path: Path) -> str:
    if name == "rope_freqs.weight":
        return (f"{path.name}: tensor rope_freqs.weight (per-dimension rotary frequency factors, as Llama 3.1+ "
                f"files carry) is not applied by kvcli yet; refusing the file rather than computing a different "
                f"rotary embedding")
    return (f"{path.name}: tensor {name} is not part of the {arch} model kvcli computes; refusing the file "
            f"rather than ignoring it")


def load_gguf(path: Path, reader: GGUFFile | None = None
              ) -> tuple[ModelConfig, dict[str, QuantTensor | torch.Tensor], dict[str, int]]:
    """Returns (config, weights by Hugging Face name, count of tensors per GGML type). `reader`: the
    file's header when the caller already parsed it (the tokenizer reads the same metadata)."""
    reader = reader or open_gguf(path)
    config = read_config(reader, path)
    weights: dict[str, QuantTensor | torch.Tensor] = {}
    types: dict[str, int] = {}
    for t in reader.tensors:
        name = t.name
        if name in _TOP_NAMES:
            hf = _TOP_NAMES[name]
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _LAYER_NAMES:
                raise GGUFError(_unknown_tensor(name, config.architecture, path))
            hf = f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
        else:
            raise GGUFError(_unknown_tensor(name, config.architecture, path))
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        w = _tensor(t, path)
        if config.architecture == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            n_head = config.num_heads if ".q_proj." in hf else config.num_kv_heads
            rows = w.shape[0]
            idx = _unpermute_index(rows, n_head)
            w = w.rows(idx) if isinstance(w, QuantTensor) else w[idx].contiguous()
        weights[hf] = w
    missing = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(config.num_layers)
               if f"model.layers.{i}.self_attn.q_proj.weight" not in weights]
    if "model.embed_tokens.weight" not in weights or missing:
        raise GGUFError(f"{path.name}: incomplete model (missing tensors)")
    return config, weights, types

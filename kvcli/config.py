"""Small configuration dataclasses shared by the loader, engine and CLI."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvcli.kvcache.kv_dtype import KVDtype, kv_dtype_of

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str  # llama | mistral | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has a bias on q/k/v
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention: a query at position p sees keys [p - sliding_window + 1, p] in every
    # layer (Mistral); None = full causal attention. Every token's K/V is still stored (the KV
    # arithmetic of plan/inspect is unchanged).
    sliding_window: int | None = None

    def kv_bytes_per_token(self, kv_dtype: "torch.dtype | str | KVDtype") -> int:
        """K and V of every layer for one token, quantization scales included."""
        return kv_dtype_of(kv_dtype).bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim)

    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_layer = qkv + self.num_heads * self.head_dim * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h
        return L * per_layer + emb * (1 if self.tie_word_embeddings else 2) + h

    @staticmethod
    def from_hf_dict(cfg: dict, name: str = "model") -> "ModelConfig":
        """From a Hugging Face config.json dictionary."""
        arch = (cfg.get("model_type") or "").lower()
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (kvcli runs {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, scaling = _hf_rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            name=name,
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=_hf_sliding_window(cfg, arch, int(cfg["num_hidden_layers"])),
        )

    def to_hf_dict(self) -> dict:
        """A transformers config.json equivalent (used to build the reference model in tests)."""
        arch_cls = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        d = {
            "architectures": [arch_cls[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_scaling": self.rope_scaling,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
        }
        if self.architecture == "llama":
            d["attention_bias"] = self.attention_bias
        if self.architecture != "llama":
            d["sliding_window"] = self.sliding_window
        if self.architecture == "qwen2":  # qwen2 slides only when asked, from max_window_layers on
            d.update(use_sliding_window=self.sliding_window is not None, max_window_layers=0)
        return d


ROPE_TYPES = ("default", "linear", "llama3")  # what model/layers.py's Rotary computes


def _hf_rope(cfg: dict) -> tuple[float, dict | None]:
    """rope_theta and the scaling, from transformers 4's top-level `rope_theta` / `rope_scaling` or
    transformers 5's `rope_parameters` (theta and scaling in one dict; per layer type for models whose
    layers differ, refused here). A scaling type kvcli does not compute is refused, never dropped."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or "rope_theta" not in params:
            raise ValueError(f"rope_parameters must be one dict with rope_theta (got {params!r}); per-layer-type "
                             f"rotary parameters are not read by kvcli")
        theta, scaling = params["rope_theta"], dict(params)
    else:
        theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type") or scaling.get("type") if isinstance(scaling, dict) else scaling
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope scaling {kind!r} is not computed by kvcli (supported: {', '.join(ROPE_TYPES)})")
        if kind == "default":
            scaling = None
    partial = cfg.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} (rotary on part of each head) is not computed by kvcli")
    return float(theta), scaling


def _hf_sliding_window(cfg: dict, arch: str, num_layers: int) -> int | None:
    """The one window every layer uses, as transformers reads config.json (None = full attention).
    Mistral slides in every layer when `sliding_window` is set; Qwen2 only with `use_sliding_window`,
    and then only layers >= `max_window_layers`; `layer_types` overrides both. A window in some layers
    only is refused (one window per model here), never silently dropped."""
    window = cfg.get("sliding_window")
    if arch == "llama" or window is None:  # transformers' Llama ignores sliding_window
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer or null (got {window!r})")
    if arch == "qwen2" and not cfg.get("use_sliding_window", False):  # transformers drops the window then
        return None
    types = cfg.get("layer_types")
    if isinstance(types, list):
        sliding = [t == "sliding_attention" for t in types]
    elif arch == "qwen2":
        first = int(cfg.get("max_window_layers", 28))
        sliding = [i >= first for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    if not any(sliding):
        return None
    if not all(sliding):
        raise ValueError(f"sliding-window attention in {sum(sliding)} of {len(sliding)} layers only "
                         "(per-layer windows) is not supported")
    return window


# Real architectures for `--model dummy:NAME` (random weights, as vLLM's load_format=dummy).
PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "llama-2-13b": dict(model_type="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=1000000.0, rms_norm_eps=1e-5, max_position_embeddings=32768),
    "qwen2-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                       tie_word_embeddings=True),
}


def preset_config(spec: str) -> ModelConfig:
    """`NAME` from PRESETS or a path to a config.json."""
    if spec in PRESETS:
        return ModelConfig.from_hf_dict(PRESETS[spec], name=f"dummy:{spec}")
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"no such config file: {spec}")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {spec}: {e}") from None
        return ModelConfig.from_hf_dict(cfg, name=f"dummy:{path.name}")
    raise ValueError(f"unknown dummy preset {spec!r}; choose one of {', '.join(PRESETS)} or a config.json path")


MAX_SEED = 2**62  # room for seed + i (sample i of n, turn i of a chat) below torch's 2**63 limit


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # samples per prompt; they share the prompt's KV blocks (copy-on-write)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1 (got {self.n})")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0 (got {self.max_tokens})")
        if not 0 <= self.temperature < math.inf:  # also refuses nan
            raise ValueError(f"temperature must be a finite number >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k})")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:  # torch takes seeds below 2**63
            raise ValueError(f"seed must be in [0, {MAX_SEED}] (got {self.seed})")
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_(self, **kw) -> "SamplingParams":
        return replace(self, **kw)


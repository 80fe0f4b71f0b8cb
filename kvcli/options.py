"""Engine options: one object built by every command and by the Python API, validated once.

Each value lives here and is read from here (the block size, for instance, reaches the KV layout,
the KV cache tensors and the metrics through `EngineOptions.block_size` and nowhere else). Every
problem is a `ConfigError` whose message names the command-line flag, so the CLI can print it as
one line before any slow model load.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcli.kvcache.kv_dtype import KV_DTYPE_CHOICES, KVDtype, kv_dtype_of, resolve_kv_dtype


class ConfigError(ValueError):
    """Options that cannot work; the message is meant for the user as is and names the flag."""


SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)
ATTENTION_BACKENDS = ("auto", "torch", "triton", "invariant")
KV_LAYOUTS = ("paged", "contiguous")
RESERVATIONS = ("max-len", "request")
PREEMPT_MODES = ("recompute", "swap")
SPECULATE_MODES = ("none", "ngram")
DRAFT_LENGTHS = ("adaptive", "fixed")
MAX_SPECULATIVE_TOKENS = 32
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


def parse_bytes(text: str, flag: str | None = None) -> int:
    """`2GiB`, `512MB`, `1e9` -> bytes. With `flag`, the error message names it."""
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    prefix = f"{flag}: " if flag else ""
    try:
        value = float(num)
    except ValueError:
        raise ConfigError(f"{prefix}cannot read {text!r} as a size (e.g. 2GiB, 512MB)") from None
    if unit not in _UNITS or not math.isfinite(value):
        raise ConfigError(f"{prefix}cannot read {text!r} as a size (e.g. 2GiB, 512MB)")
    if not value > 0:
        raise ConfigError(f"{prefix}a size must be positive (got {text!r})")
    return int(value * _UNITS[unit])


def parse_kv_budget(spec: str) -> tuple[int | None, float]:
    """`--kv-budget`: (bytes, 0) for a size ("2GiB", "512MB", or a plain number above 1), or
    (None, fraction) for a share of free memory in (0, 1]."""
    try:
        frac = float(spec)
    except ValueError:
        frac = 2.0  # not a number: read it as a size below
    if math.isnan(frac):
        raise ConfigError(f"--kv-budget {spec}: must be a size (2GiB, 512MB, bytes) or a fraction in (0, 1]")
    if frac > 1:
        if math.isfinite(frac) and frac != int(frac):  # 1.5: neither a fraction of memory nor whole bytes
            raise ConfigError(f"--kv-budget {spec}: a fraction of free memory must be in (0, 1]; a size takes a unit "
                              f"(2GiB, 512MB) or whole bytes")
        return parse_bytes(spec, "--kv-budget"), 0.0
    if frac <= 0:
        raise ConfigError(f"--kv-budget {spec}: must be a size (2GiB, 512MB, bytes) or a fraction in (0, 1]")
    return None, frac


def parse_dtype(name: str | None, flag: str) -> torch.dtype | None:
    if name is None or name == "auto":
        return None
    if name not in DTYPES:
        raise ConfigError(f"{flag} must be fp32, fp16 or bf16 (got {name!r})")
    return DTYPES[name]


def parse_kv_dtype(name: str | None) -> KVDtype | None:
    """`--kv-dtype`: None for auto. fp8 (e4m3 + scales) is storage only on CPU (dequantized to fp32 to
    attend); the Triton kernels need compute capability >= 8.9, checked where the engine picks its backend."""
    if name is None or name == "auto":
        return None
    try:
        return kv_dtype_of(name)
    except KeyError:
        raise ConfigError(f"--kv-dtype must be one of {', '.join(KV_DTYPE_CHOICES)} (got {name!r})") from None


def parse_kv_window(value: "int | str | None") -> "int | str | None":
    """`--kv-window`: a number of tokens, `auto` (the context less the sinks and a margin, set by the engine),
    or `none`/None (no bound: a text must fit the context)."""
    if value is None or isinstance(value, bool):
        return None if value is None else _bad_window(value)
    if isinstance(value, int):
        return value if value > 0 else _bad_window(value)
    text = str(value).strip().lower()
    if text in ("none", "off"):
        return None
    if text == "auto":
        return "auto"
    try:
        n = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        return _bad_window(value)
    return n if n > 0 else _bad_window(value)


def parse_threads(value: "int | str") -> "int | str":
    """`--threads`: auto, or a positive number of CPU threads."""
    if value == "auto":
        return value
    n = value if isinstance(value, int) and not isinstance(value, bool) else \
        int(value) if isinstance(value, str) and value.strip().isdigit() else 0
    if n < 1:
        raise ConfigError(f"--threads must be auto or a positive number of CPU threads (got {value!r})")
    return n


def _bad_window(value: object):
    raise ConfigError(f"--kv-window must be a positive number of tokens, auto or none (got {value!r})")


def _one_of(value: str, allowed: tuple[str, ...], flag: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{flag} must be one of {', '.join(allowed)} (got {value!r})")


def _positive(value: int | None, flag: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ConfigError(f"{flag} must be a positive integer (got {value!r})")


@dataclass(frozen=True)
class EngineOptions:
    """Everything the engine is built from besides the weights. Validated on construction."""

    device: str | None = None  # None: cuda when available, else cpu
    block_size: int = 16  # tokens per KV block: the one stored value, read by layout, cache, metrics
    kv_budget: str | None = None  # "2GiB", "512MB", a fraction of free memory "0.5", or None (auto)
    dequantize: bool = False  # dense fp32 weights: exact, 8x the bytes
    max_model_len: int | None = None  # None: the model's context length
    max_num_batched_tokens: int = 512  # tokens computed per step; prompts are prefilled in chunks
    max_num_seqs: int = 64
    attention_backend: str = "auto"  # auto | torch | triton | invariant (batch-invariant torch, CPU)
    kv_layout: str = "paged"  # paged | contiguous (preallocated region per request, for comparison)
    reserve: str = "max-len"  # contiguous only: max-len | request (prompt + max_tokens)
    preempt: str = "recompute"  # recompute | swap
    swap_space: str = "4GiB"  # host memory for swapped-out blocks
    dtype: str | None = None  # compute dtype; default fp32 on CPU, bf16 (fp16 if unsupported) on CUDA
    kv_dtype: str | None = None  # auto | fp32 | fp16 | bf16 | int8 | fp8; auto (None): see resolve_kv_dtype
    prefix_caching: bool = True  # reuse full blocks of shared prefixes across requests
    watermark: float = 0.01  # paged admission keeps this share of blocks free for running requests
    # Paged layout, a model whose layers attend over different spans (Gemma 2 / 3): one block table per group of
    # layers (kvcache/kv_groups.py), so windowed layers hold only their window. False: one table for every layer.
    kv_groups: bool = True
    # Speculative decoding: guess up to num_speculative_tokens by prompt lookup (the last n tokens,
    # ngram_max down to ngram_min, matched in the request's own context), verify them in one step.
    speculate: str = "none"  # none | ngram
    num_speculative_tokens: int = 5
    # adaptive: each step verifies the number of guesses (1..num_speculative_tokens) that the request's recent
    # acceptance and the engine's measured step costs make fastest (spec_decode/draft_length.py); fixed: all of them.
    draft_length: str = "adaptive"
    ngram_min: int = 2
    ngram_max: int = 4
    # A bounded cache (kvcache/retention.py): each request keeps the KV of its first sink_tokens tokens and
    # of its last kv_window tokens; blocks wholly between go back to the pool. None: unbounded (a prompt
    # must fit the context). "auto": the context less the sink blocks and max(kv_window_margin, one block).
    kv_window: int | str | None = None
    sink_tokens: int = 4
    kv_window_margin: int = 0  # room kept for generation under kv_window="auto" (continue: --max-tokens)
    # Decode steps replayed from CUDA graphs (runner/cuda_graphs.py): CUDA with the Triton backend only.
    cuda_graphs: bool = True
    # CPU threads for the kernels (runner/threads.py): "auto" = torch's count, fewer while that decodes faster
    # (another process holding a core); a number fixes it.
    threads: int | str = "auto"

    def __post_init__(self) -> None:
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ConfigError(f"--block-size must be one of {', '.join(map(str, SUPPORTED_BLOCK_SIZES))} "
                              f"(got {self.block_size})")
        if self.kv_budget is not None and self.kv_budget != "auto":
            parse_kv_budget(self.kv_budget)
        _positive(self.max_model_len, "--max-model-len")
        _positive(self.max_num_batched_tokens, "--max-batch-tokens")
        _positive(self.max_num_seqs, "--max-num-seqs")
        _one_of(self.attention_backend, ATTENTION_BACKENDS, "--attention-backend")
        _one_of(self.kv_layout, KV_LAYOUTS, "--kv-layout")
        _one_of(self.reserve, RESERVATIONS, "--reserve")
        _one_of(self.preempt, PREEMPT_MODES, "--preempt")
        parse_bytes(self.swap_space, "--swap-space")
        parse_dtype(self.dtype, "--dtype")
        parse_kv_dtype(self.kv_dtype)
        _one_of(self.speculate, SPECULATE_MODES, "--speculate")
        _positive(self.num_speculative_tokens, "--num-speculative-tokens")
        _one_of(self.draft_length, DRAFT_LENGTHS, "--draft-length")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"--num-speculative-tokens must be at most {MAX_SPECULATIVE_TOKENS} "
                              f"(got {self.num_speculative_tokens})")
        _positive(self.ngram_min, "--ngram-min")
        _positive(self.ngram_max, "--ngram-max")
        if self.ngram_max < self.ngram_min:
            raise ConfigError(f"--ngram-max ({self.ngram_max}) must be at least --ngram-min ({self.ngram_min})")
        object.__setattr__(self, "kv_window", parse_kv_window(self.kv_window))
        object.__setattr__(self, "threads", parse_threads(self.threads))
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ConfigError(f"--sink-tokens must be a whole number >= 0 (got {self.sink_tokens!r})")
        if isinstance(self.kv_window_margin, bool) or not isinstance(self.kv_window_margin, int) \
                or self.kv_window_margin < 0:
            raise ConfigError(f"kv_window_margin must be a whole number >= 0 (got {self.kv_window_margin!r})")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"--cuda-graphs is on or off (got {self.cuda_graphs!r})")
        if not 0 <= self.watermark < 1:
            raise ConfigError(f"watermark must be in [0, 1) (got {self.watermark})")
        if self.device not in (None, "auto"):
            try:
                dev = torch.device(self.device)
            except (RuntimeError, ValueError):
                raise ConfigError(f"--device must be cpu, cuda or cuda:N (got {self.device!r})") from None
            if dev.type not in ("cpu", "cuda"):
                raise ConfigError(f"--device must be cpu, cuda or cuda:N (got {self.device!r})")

    def resolve_device(self) -> torch.device:
        if self.device in (None, "auto"):
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"--device {self.device}: torch sees no CUDA device")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ConfigError(f"--device {self.device}: there are {torch.cuda.device_count()} CUDA devices")
        return dev

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        default = torch.float32 if device.type == "cpu" else (
            torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
        return parse_dtype(self.dtype, "--dtype") or default

    def resolve_kv_dtype(self, device: torch.device, *, backend: str | None, quantized_weights: bool,
                         native_attention: bool | Callable[[], bool]) -> KVDtype:
        """The KV format for these options on `device`: kvcli.kvcache.kv_dtype.resolve_kv_dtype (the one
        rule for auto) over this object's facts (--kv-dtype, the compute dtype, --dequantize) and the
        caller's: the chosen backend's name (None: a simulation), kvcli-quantized linears, whether the C
        decode-attention kernel runs (a bool, or a callable asked only when it matters)."""
        return resolve_kv_dtype(self.kv_dtype, device_type=device.type, compute_dtype=self.compute_dtype(device),
                                dequantize=self.dequantize, backend=backend, quantized_weights=quantized_weights,
                                native_attention=native_attention)

    def window_tokens(self, max_model_len: int) -> int | None:
        """W for a context of max_model_len (resolving auto), or None when unbounded."""
        if self.kv_window != "auto":
            return self.kv_window  # type: ignore[return-value]
        sink_slots = -(-self.sink_tokens // self.block_size) * self.block_size
        return max_model_len - sink_slots - max(self.kv_window_margin, self.block_size)

    def swap_space_bytes(self) -> int:
        return parse_bytes(self.swap_space, "--swap-space")

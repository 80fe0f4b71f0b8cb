"""`kvcli inspect MODEL`: what a model file is, what kvcli makes of it in memory, and what fits.

Architecture and tensor types come from the file; resident bytes from really building the model the
way `continue` would (skipped with --no-load); KV bytes per token and the fit arithmetic are
`plan`'s (plan_cmd.kv_fits), over the memory this machine has available now.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvcli.commands.common import Fail
from kvcli.commands.plan_cmd import USABLE, KVFit, kv_fits, paged_kv_held
from kvcli.config import ModelConfig, read_json_object
from kvcli.kvcache.block_manager import sliding_window_of
from kvcli.kvcache.kv_groups import kv_groups_of
from kvcli.model.layers import rotary_table_bytes
from kvcli.model.loader import ModelLoadError, bundled_gguf_path, load_config, tensor_names, weight_files
from kvcli.options import ConfigError, EngineOptions
from kvcli.view.plain_log import human_bytes


@dataclass(frozen=True)
class TensorGroup:
    type: str  # GGML type (GGUF) or storage dtype (safetensors)
    count: int
    bytes: int


@dataclass
class InspectReport:
    source: str
    name: str
    architecture: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    context_length: int
    tensors: list[TensorGroup]
    file_tensor_bytes: int
    sliding_window: int | None = None  # attention window (tokens)
    window_released: bool = False  # every layer slides: the paged layout gives back the blocks before it
    resident: dict[str, int] | None = None  # layers / embedding / lm_head, after load
    tables: int | None = None  # the model's rotary tables, after load (not weights; held for the whole context)
    # what the process grew by over the load (RSS on the host, the allocator's bytes on CUDA): the weights, the
    # tables and what kvcli does not count (tokenizer, kernel libraries, the two-block KV pool)
    measured_growth: int | None = None
    linear_paths: str | None = None
    cpu_kernels: str | None = None  # kvcli's C kernels here: which build, or why none (model/int8dot_cpu.py)
    # projection -> {path: layers}, e.g. {"v_proj": {"int4x2-cpu": 30}}: which linears take which path
    projection_paths: dict[str, dict[str, int]] | None = None
    weight_plan: list[tuple[str, str]] | None = None  # how each weight runs (kvcli/model/weight_plan.py)
    device: str = "cpu"
    memory_available: int = 0
    kv_budget: int = 0  # what is left for KV: USABLE x available memory minus the weights and rotary tables
    fits: list[KVFit] = field(default_factory=list)  # per KV dtype, at `context_length`
    kv_dtype: str | None = None  # what the engine picks here for these flags (needs the load: --no-load, None)
    layer_kinds: str | None = None  # per-layer attention (Gemma 3: "5 sliding of 512 per global layer")
    # K and V of one request of context_length tokens (fp16): as the paged layout holds it in whole blocks (a
    # window's blocks in every sliding layer: Mistral's, or Gemma's through per-group block tables, else every
    # token), every layer every token, and the sliding layers' window tokens alone (no block rounding).
    kv_request_held: int | None = None
    kv_request_every: int | None = None
    kv_request_windowed: int | None = None
    kv_groups: str | None = None  # the paged layout's block tables per request (kvcache/kv_groups.py)


def _resolve(spec: str | None) -> str | None:
    """The model spec as the loaders take it; a path that does not exist fails here, fast."""
    if spec is None or spec in ("", "bundled"):
        return None
    if spec.startswith("dummy:"):
        return spec
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {spec}")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{spec}: expected a .gguf file, a checkpoint folder or dummy:NAME")
    return str(path)


def _config_and_tensors(spec: str | None) -> tuple[ModelConfig, list[TensorGroup]]:
    """The config and the tensors by type, from one parse of a GGUF's header."""
    if spec is not None and spec.startswith("dummy:"):
        return load_config(spec), []
    path = bundled_gguf_path() if spec is None else Path(spec)
    if path.is_dir():
        return load_config(spec), _safetensors_groups(path)
    from kvcli.model.gguf_loader import GGUFError, check_layer_tensors, open_gguf, read_config, tensor_bytes_by_type

    try:
        reader = open_gguf(path)
        config = read_config(reader, path)
        check_layer_tensors(reader, config, path)
        groups = tensor_bytes_by_type(reader)
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None
    except Exception as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    return config, [TensorGroup(k, c, b) for k, (c, b) in sorted(groups.items())]


def _quant_method(path: Path) -> str | None:
    """The folder's pre-quantized format (awq / gptq / compressed-tensors / ...), if config.json names one."""
    try:
        qc = json.loads((path / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    if qc is None and (path / "quantize_config.json").is_file():
        return "gptq"
    return str(qc.get("quant_method")) if isinstance(qc, dict) else None


NOT_LOADED = "not loaded (the image model)"  # an image-text folder's vision tower and projector


def _safetensors_groups(path: Path) -> list[TensorGroup]:
    """Storage dtype -> count and bytes over a checkpoint folder's safetensors files (headers only).
    In a pre-quantized folder the tensors of its quantized layers are grouped apart, e.g. "awq:I32"."""
    from safetensors import safe_open

    from kvcli.model.hf_quant import SUFFIXES

    method = _quant_method(path)
    packed_suffixes = SUFFIXES.get(method or "", ())
    rename = tensor_names(read_json_object(path / "config.json"))  # (load_config has accepted it)
    groups: dict[str, list[int]] = {}
    for f in weight_files(path):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                sl = st.get_slice(key)
                dtype = str(sl.get_dtype())
                if rename(key) is None:
                    dtype = NOT_LOADED
                elif key.rsplit(".", 1)[-1] in packed_suffixes:
                    dtype = f"{method}:{dtype}"
                n = 1
                for d in sl.get_shape():
                    n *= d
                size = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I32": 4, "I64": 8}.get(
                    str(sl.get_dtype()), 4)
                c, b = groups.setdefault(dtype, [0, 0])
                groups[dtype] = [c + 1, b + n * size]
    return [TensorGroup(k, c, b) for k, (c, b) in sorted(groups.items())]


def inspect_model(spec: str | None, options: EngineOptions, load: bool, context: int | None) -> InspectReport:
    from kvcli.engine.llm_engine import available_memory

    spec = _resolve(spec)
    try:
        config, groups = _config_and_tensors(spec)
    except ModelLoadError:
        raise
    except Exception as e:  # e.g. a damaged safetensors header
        raise ModelLoadError(f"{spec}: cannot read its tensors ({type(e).__name__}: {e})") from None
    device = options.resolve_device()
    rep = InspectReport(
        source=spec or str(bundled_gguf_path()), name=config.name, architecture=config.architecture,
        layers=config.num_layers, heads=config.num_heads, kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        context_length=config.max_position_embeddings, tensors=groups, sliding_window=config.sliding_window,
        file_tensor_bytes=sum(g.bytes for g in groups if g.type != NOT_LOADED), device=str(device))
    if config.layer_types is not None:
        n_sliding = sum(t == "sliding" for t in config.layer_types)
        n_full = config.num_layers - n_sliding
        rep.layer_kinds = (f"{n_sliding} sliding (window {config.local_window:,}) and {n_full} global of "
                           f"{config.num_layers} layers")
    if config.layer_types is not None or config.sliding_window is not None:
        ctx_kv = context or config.max_position_embeddings
        rep.kv_request_held = paged_kv_held(config, "fp16", ctx_kv, options.block_size, options.max_num_batched_tokens)
        rep.kv_request_every = config.kv_bytes_of_request("fp16", ctx_kv, windowed=False)
        rep.kv_request_windowed = config.kv_bytes_of_request("fp16", ctx_kv)
        kv_groups = kv_groups_of(config)
        rep.window_released = sliding_window_of(config) > 0 or kv_groups.hybrid
        rep.kv_groups = kv_groups.describe() if kv_groups.hybrid else None
    weights = rep.file_tensor_bytes
    if load:
        from kvcli.engine.llm_engine import LLMEngine
        from kvcli.model.loader import load_weights

        # A pool of two blocks (one pads block tables) in the widest KV format, so that it holds at least
        # that much whichever format the engine picks; the engine's pick is what inspect reports.
        pool = 2 * options.block_size * config.kv_bytes_per_token("fp32")
        before = _memory_in_use(device)
        loaded = load_weights(spec)
        engine = LLMEngine(loaded, replace(options, kv_budget=str(pool)))
        after = _memory_in_use(device)
        rep.measured_growth = None if before is None or after is None else after - before
        rep.kv_dtype = engine.kv_dtype.name
        rep.resident = engine.model.weight_bytes()  # type: ignore[union-attr]
        rep.tables = engine.model.table_bytes()  # type: ignore[union-attr]
        rep.linear_paths = engine.linear_mode
        if device.type == "cpu":
            from kvcli.native import registry

            rep.cpu_kernels = registry.status()
        rep.projection_paths = engine.model.projection_paths  # type: ignore[union-attr]
        rep.weight_plan = engine.model.plan.describe()  # type: ignore[union-attr]
        weights = sum(rep.resident.values())
        del engine, loaded
    rep.memory_available = available_memory(device)
    tables = rep.tables if rep.tables is not None else rotary_table_bytes(config)
    rep.kv_budget = max(0, int(rep.memory_available * USABLE) - weights - tables)
    ctx = context or config.max_position_embeddings
    rep.fits = kv_fits(config, rep.kv_budget, ctx, max(1, ctx // 4), options.block_size)
    return rep


def _memory_in_use(device) -> int | None:
    """What holds the weights after a load: the allocator's bytes on CUDA, the process's RSS on the host."""
    if device.type == "cuda":
        import torch

        return torch.cuda.memory_allocated(device)
    from kvcli.metrics.memory import process_rss

    return process_rss()


def to_json(rep: InspectReport) -> str:
    d = asdict(rep)
    return json.dumps(d, indent=2)


def _by_projection(paths: dict[str, dict[str, int]]) -> str:
    """"q_proj k_proj: int4-cpu x30 · v_proj: int4x2-cpu x30": projections with the same paths together."""
    groups: dict[str, list[str]] = {}
    for name, counts in paths.items():
        groups.setdefault(", ".join(f"{m} x{n}" for m, n in counts.items()), []).append(name)
    return " · ".join(f"{' '.join(names)}: {modes}" for modes, names in groups.items())


def render(rep: InspectReport, context: int) -> None:
    con = Console()
    t = Table(title=f"kvcli inspect · {Path(rep.source).name}", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("name", rep.name)
    t.add_row("architecture", f"{rep.architecture} · {rep.layers} layers · hidden {rep.hidden_size} · "
                              f"ffn {rep.intermediate_size} · vocab {rep.vocab_size:,}")
    kept = "blocks before it given back" if rep.window_released else "all KV kept"
    window = "" if rep.sliding_window is None else f" · sliding window {rep.sliding_window:,} ({kept})"
    t.add_row("attention", f"{rep.heads} heads · {rep.kv_heads} KV heads · head dim {rep.head_dim}{window}")
    if rep.layer_kinds:
        t.add_row("layers", rep.layer_kinds)
    t.add_row("context length", f"{rep.context_length:,} tokens")
    if rep.kv_request_held is not None and rep.kv_request_windowed is not None:
        every = rep.kv_request_every or rep.kv_request_held
        t.add_row("KV of one request", f"{human_bytes(rep.kv_request_held)} held at {context:,} tokens (fp16, whole "
                  f"blocks; the paged layout gives back the blocks before each window) · {human_bytes(every)} if "
                  f"every layer kept every token ({rep.kv_request_held / every:.2f}x) · "
                  f"{human_bytes(rep.kv_request_windowed)} the windows' tokens alone")
        if rep.kv_groups:
            t.add_row("KV groups", rep.kv_groups)
    for g in rep.tensors:
        t.add_row(f"tensors {g.type}", f"{g.count} · {human_bytes(g.bytes)}")
    t.add_row("file tensors", human_bytes(rep.file_tensor_bytes))
    if rep.resident is not None:
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in rep.resident.items())
        t.add_row("resident after load", f"{human_bytes(sum(rep.resident.values()))} ({parts})")
        held = sum(rep.resident.values()) + (rep.tables or 0)
        if rep.tables:
            t.add_row("  + rotary tables", f"{human_bytes(rep.tables)} (every position of the context): "
                                           f"{human_bytes(held)} held")
        if rep.measured_growth is not None:
            where = "GPU memory allocated" if rep.device.startswith("cuda") else "process RSS"
            t.add_row("measured at load", f"{where} grew {human_bytes(rep.measured_growth)} "
                      f"({rep.measured_growth / max(1, held):.2f}x the weights and tables; the rest is the "
                      f"tokenizer, kernel libraries and the KV pool)")
        t.add_row("linear paths", rep.linear_paths or "")
        if rep.cpu_kernels:
            t.add_row("kvcli C kernels", rep.cpu_kernels)
        if rep.projection_paths:
            t.add_row("  by projection", _by_projection(rep.projection_paths))
        for what, how in rep.weight_plan or ():
            t.add_row(f"  {what}", how)
    else:
        t.add_row("resident after load", "not loaded (--no-load): the file's bytes are used below")
    t.add_row("memory", f"{human_bytes(rep.memory_available)} available on {rep.device}; KV budget "
                        f"{human_bytes(rep.kv_budget)} ({USABLE:.0%} of it minus the weights and rotary tables)")
    con.print(t)
    k = Table(title=f"KV per dtype · requests of {context:,} tokens (contiguous) or ~{max(1, context // 4):,} "
                    f"(paged, assumed context / 4)" + (" · * the engine's pick here" if rep.kv_dtype else ""),
              title_justify="left")
    for col in ("KV dtype", "B/token", "tokens fit", "req. contig.", "req. paged"):
        k.add_column(col, justify="left" if col == "KV dtype" else "right")
    for f in rep.fits:
        k.add_row(f.kv_dtype + (" *" if f.kv_dtype == rep.kv_dtype else ""), f"{f.bytes_per_token:,}",
                  f"{f.tokens_fit:,}", f"{f.requests_contiguous:,}", f"{f.requests_paged:,}")
    con.print(k)


def run_inspect(model: str | None, options: EngineOptions, load: bool, context: int | None, as_json: bool,
                fail: Fail) -> None:
    if context is not None and context <= 0:
        fail(f"--context must be a positive integer (got {context})")
    try:
        rep = inspect_model(model, options, load, context)
    except (ModelLoadError, ConfigError) as e:
        fail(str(e))
    except MemoryError:
        fail("out of memory while loading the model (try --no-load)")
    if as_json:
        print(to_json(rep))
    else:
        render(rep, context or rep.context_length)


"""`kvcli plan`: will it fit? Weight and KV arithmetic from a model's config, paged vs contiguous."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from kvcli.commands.common import Fail
from kvcli.engine.llm_engine import native_attention_available, pick_backend
from kvcli.kvcache.block_manager import sliding_window_of
from kvcli.kvcache.kv_dtype import kv_dtype_of
from kvcli.kvcache.kv_groups import kv_groups_of
from kvcli.kvcache.interface import blocks_for
from kvcli.model.layers import rotary_table_bytes
from kvcli.model.loader import ModelLoadError, load_config
from kvcli.options import ConfigError, EngineOptions, parse_bytes
from kvcli.view.plain_log import human_bytes

# Bytes per weight as stored: GGUF Q4_1 linears (20 B per 32 weights), Q8_0 embedding/output (34 B per 32).
INT4_BYTES = 20 / 32
INT8_BYTES = 34 / 32
USABLE = 0.9  # leave room for activations and the allocator, as the engine's default budget does


def weight_bytes(config) -> dict[str, int]:
    c = config
    h, d = c.hidden_size, c.head_dim
    per_layer = h * (c.num_heads + 2 * c.num_kv_heads) * d + c.num_heads * d * h + 3 * h * c.intermediate_size
    emb = c.vocab_size * h
    return {
        "linears (Q4_1)": int(c.num_layers * per_layer * INT4_BYTES),
        "embedding (Q8_0)": int(emb * INT8_BYTES),
        "lm_head (Q8_0)": 0 if c.tie_word_embeddings else int(emb * INT8_BYTES),
    }


@dataclass(frozen=True)
class PlanArgs:
    model: str | None
    context: int | None  # None: the model's context length
    batch: int | None
    memory: str | None
    mean_tokens: int | None
    options: EngineOptions  # block size and KV dtype, validated like every other command's
    json_out: bool = False


@dataclass(frozen=True)
class KVFit:
    """What one KV format makes of a KV budget (shared by `plan` and `inspect`)."""

    kv_dtype: str
    bytes_per_token: int  # K and V over all layers, scales included
    tokens_fit: int
    requests_contiguous: int  # each preallocating `context` tokens in whole blocks
    requests_paged: int  # each holding `mean` tokens in whole blocks

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def kv_fit(config, kv_dtype: str, kv_budget: int, context: int, mean: int, block_size: int) -> KVFit:
    per_tok = config.kv_bytes_per_token(kv_dtype)
    budget = max(kv_budget, 0)
    return KVFit(str(kv_dtype), per_tok, budget // per_tok,
                 budget // (per_tok * blocks_for(context, block_size) * block_size),
                 budget // paged_kv_held(config, kv_dtype, mean, block_size, EngineOptions.max_num_batched_tokens))


def paged_kv_held(config, kv_dtype: str, tokens: int, block_size: int, step_tokens: int) -> int:
    """KV bytes the paged layout holds for one request of `tokens` tokens, in whole blocks: every block of every
    layer, unless layers slide: where every layer slides (Mistral) the blocks before the window go back as the
    request advances; where some do (Gemma 2 / 3) each group of layers keeps its own table and the windowed
    groups hold only their window's blocks (kvcache/kv_groups.py)."""
    groups = kv_groups_of(config)
    per_layer_token = kv_dtype_of(kv_dtype).bytes_per_token(1, config.num_kv_heads, config.head_dim)
    return groups.pages_held(tokens, block_size, step_tokens) * groups.slots * block_size * per_layer_token


KV_DTYPE_NAMES = ("fp32", "fp16", "bf16", "int8", "fp8")


def kv_fits(config, kv_budget: int, context: int, mean: int, block_size: int) -> list[KVFit]:
    return [kv_fit(config, name, kv_budget, context, mean, block_size) for name in KV_DTYPE_NAMES]


def kv_dtype_table(config, kv_budget: int, context: int, mean: int, block_size: int, chosen: str) -> Table:
    """The same budget under every KV format, side by side (scales included in int8's and fp8's bytes)."""
    t = Table(title=f"per KV dtype, same {human_bytes(kv_budget)} KV budget", title_justify="left")
    for col in ("KV dtype", "B/token", "vs fp16", "tokens/GiB", "tokens fit", "req. contig.", "req. paged"):
        t.add_column(col, justify="left" if col == "KV dtype" else "right")
    fp16 = config.kv_bytes_per_token("fp16")
    for f in kv_fits(config, kv_budget, context, mean, block_size):
        t.add_row(f.kv_dtype + (" *" if f.kv_dtype == chosen else ""), f"{f.bytes_per_token:,}",
                  f"{f.bytes_per_token / fp16:.2f}x", f"{(1 << 30) // f.bytes_per_token:,}", f"{f.tokens_fit:,}",
                  f"{f.requests_contiguous:,}", f"{f.requests_paged:,}")
    return t


def run_plan(a: PlanArgs, fail: Fail) -> int:
    context, batch, mean_tokens = a.context, a.batch, a.mean_tokens
    block_size = a.options.block_size
    for flag, value in (("--context", context), ("--batch", batch), ("--mean-tokens", mean_tokens)):
        if value is not None and value <= 0:
            fail(f"{flag} must be a positive integer (got {value})")
    if mean_tokens is not None and context is not None and mean_tokens > context:
        fail(f"--mean-tokens {mean_tokens:,} is more than --context {context:,}: a request holds at most the context")
    # plan assumes INT4-resident weights (weight_bytes), so the KV dtype the engine picks for them here
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kv_dtype = a.options.resolve_kv_dtype(device, backend=pick_backend(a.options.attention_backend, device).name,
                                          quantized_weights=True, native_attention=native_attention_available)
    try:
        config = load_config(a.model)
        if a.memory:
            mem = parse_bytes(a.memory, "--memory")
        elif torch.cuda.is_available():
            mem = torch.cuda.get_device_properties(0).total_memory
        else:
            mem = 24 * 2**30
    except (ModelLoadError, ConfigError) as e:
        fail(str(e))
    if context is None:
        context = config.max_position_embeddings
        if mean_tokens is not None and mean_tokens > context:
            fail(f"--mean-tokens {mean_tokens:,} is more than the model's {context:,}-token context: a request holds "
                 "at most the context")
    if context > config.max_position_embeddings:
        Console(stderr=True).print(f"[yellow]note: --context {context} exceeds the model's "
                                   f"{config.max_position_embeddings}-token limit[/yellow]")
    mean = mean_tokens or max(1, context // 4)
    per_tok = config.kv_bytes_per_token(kv_dtype)
    weights = weight_bytes(config)
    w_total = sum(weights.values())
    tables = rotary_table_bytes(config)
    kv_budget = int(mem * USABLE) - w_total - tables
    dtype_name = str(kv_dtype).removeprefix("torch.")
    step = EngineOptions.max_num_batched_tokens
    held, held_note = None, None  # what the paged layout holds of one request where layers slide
    if sliding_window_of(config):  # every layer slides: the paged layout gives back what is before the window
        held_tokens = paged_kv_held(config, dtype_name, context, block_size, step) // per_tok
        held = per_tok * held_tokens
        held_note = (f"{held_tokens:,} tokens at most: the blocks before the {sliding_window_of(config):,}-token "
                     "window go back")
        mean = min(mean, held_tokens)
    elif kv_groups_of(config).hybrid:  # some layers slide: their groups' tables hold only the window
        held = paged_kv_held(config, dtype_name, context, block_size, step)
        windowed = sum(len(g.layers) for g in kv_groups_of(config).groups if g.window)
        held_note = (f"{held / max(per_tok * context, 1):.2f}x: the {windowed} windowed layers keep their own block "
                     "tables and hold only their window")
    fit = kv_fit(config, dtype_name, kv_budget, context, mean, block_size) if kv_budget > 0 else None
    fits = {} if fit is None or batch is None else {"contiguous": batch <= fit.requests_contiguous,
                                                    "paged": batch <= fit.requests_paged}
    code = 1 if fit is None else 0 if batch is None or any(fits.values()) else 2
    if a.json_out:
        print(json.dumps({
            "model": config.name, "memory_bytes": mem, "kv_dtype": dtype_name, "block_size": block_size,
            "weight_bytes": w_total, "weights": weights, "rotary_table_bytes": tables,
            "kv_bytes_per_token": per_tok, "context": context, "kv_bytes_per_request": per_tok * context,
            "kv_bytes_held_paged": held, "kv_budget_bytes": max(kv_budget, 0), "mean_tokens": mean,
            "mean_tokens_assumed": mean_tokens is None, "batch": batch, "batch_fits": fits or None,
            "fit": None if fit is None else fit.as_dict(),
            "per_kv_dtype": [f.as_dict() for f in kv_fits(config, kv_budget, context, mean, block_size)]
            if fit is not None else [],
            "exit_status": code}, indent=2))
        return code
    t = Table(title=f"kvcli plan · {config.name} · {human_bytes(mem)} memory · KV {dtype_name} · "
                    f"block {block_size}", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(justify="right")
    t.add_row("weights (INT4)", human_bytes(w_total), ", ".join(f"{k} {human_bytes(v)}" for k, v in weights.items()))
    t.add_row("rotary tables", human_bytes(tables), f"cos and sin, fp32, for all {config.max_position_embeddings:,} "
                                                    "positions of the model's context")
    t.add_row("KV per token", human_bytes(per_tok),
              f"2 x {config.num_layers} layers x {config.num_kv_heads} KV heads x {config.head_dim}")
    t.add_row("KV per request", human_bytes(per_tok * context), f"at --context {context:,}")
    if held is not None:
        t.add_row("  held, paged", human_bytes(held), held_note)
    if fit is None:
        t.add_row("KV budget", "none", f"the weights and tables alone exceed {USABLE:.0%} of memory")
        Console().print(t)
        return code
    t.add_row("KV budget", human_bytes(kv_budget), f"{USABLE:.0%} of memory minus weights and tables")
    t.add_row("tokens that fit", f"{fit.tokens_fit:,}", "")
    t.add_row("requests, contiguous", f"{fit.requests_contiguous:,}", f"each preallocates {context:,} tokens")
    assumed = "--mean-tokens" if mean_tokens else "assumed: context / 4; set --mean-tokens"
    t.add_row("requests, paged", f"{fit.requests_paged:,}", f"each holds ~{mean:,} tokens on average ({assumed}) in "
                                                            "blocks")
    for name, ok in fits.items():
        most = fit.requests_contiguous if name == "contiguous" else fit.requests_paged
        t.add_row(f"--batch {batch} {name}", "fits" if ok else f"does not fit ({most:,} max)", "")
    Console().print(t)
    Console().print(kv_dtype_table(config, kv_budget, context, mean, block_size, dtype_name))
    return code

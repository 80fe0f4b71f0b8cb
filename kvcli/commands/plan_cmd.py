"""`kvcli plan`: will it fit? Weight and KV arithmetic from a model's config, paged vs contiguous."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvcli.commands.common import Fail
from kvcli.engine.llm_engine import ConfigError, parse_bytes
from kvcli.kvcache.block_manager import blocks_for
from kvcli.model.loader import ModelLoadError, load_config
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


def run_plan(model: str | None, context: int, batch: int | None, memory: str | None, mean_tokens: int | None,
             kv_dtype: str, block_size: int, fail: Fail) -> int:
    import torch

    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    if kv_dtype not in dtypes:
        fail(f"--kv-dtype must be fp16, bf16 or fp32 (got {kv_dtype})")
    if context <= 0 or (batch is not None and batch <= 0) or (mean_tokens is not None and mean_tokens <= 0):
        fail("--context, --batch and --mean-tokens must be > 0")
    try:
        config = load_config(model)
        if memory:
            mem = parse_bytes(memory)
        elif torch.cuda.is_available():
            mem = torch.cuda.get_device_properties(0).total_memory
        else:
            mem = 24 * 2**30
    except (ModelLoadError, ConfigError) as e:
        fail(str(e))
    if context > config.max_position_embeddings:
        Console(stderr=True).print(f"[yellow]note: --context {context} exceeds the model's "
                                   f"{config.max_position_embeddings}-token limit[/yellow]")
    mean = mean_tokens or max(1, context // 4)
    per_tok = config.kv_bytes_per_token(dtypes[kv_dtype])
    weights = weight_bytes(config)
    w_total = sum(weights.values())
    kv_budget = int(mem * USABLE) - w_total
    t = Table(title=f"kvcli plan · {config.name} · {human_bytes(mem)} memory · KV {kv_dtype} · "
                    f"block {block_size}", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(justify="right")
    t.add_row("weights (INT4)", human_bytes(w_total), ", ".join(f"{k} {human_bytes(v)}" for k, v in weights.items()))
    t.add_row("KV per token", human_bytes(per_tok),
              f"2 x {config.num_layers} layers x {config.num_kv_heads} KV heads x {config.head_dim}")
    t.add_row("KV per request", human_bytes(per_tok * context), f"at --context {context:,}")
    if kv_budget <= 0:
        t.add_row("KV budget", "none", "the weights alone exceed 90% of memory")
        Console().print(t)
        return 1
    t.add_row("KV budget", human_bytes(kv_budget), f"{USABLE:.0%} of memory minus weights")
    tokens_fit = kv_budget // per_tok
    t.add_row("tokens that fit", f"{tokens_fit:,}", "")
    contiguous = kv_budget // (per_tok * blocks_for(context, block_size) * block_size)
    paged = kv_budget // (per_tok * blocks_for(mean, block_size) * block_size)
    t.add_row("requests, contiguous", f"{contiguous:,}", f"each preallocates {context:,} tokens")
    t.add_row("requests, paged", f"{paged:,}", f"each holds ~{mean:,} tokens (--mean-tokens) in blocks")
    if batch is not None:
        for name, fits in (("contiguous", contiguous), ("paged", paged)):
            verdict = "fits" if batch <= fits else f"does not fit ({fits:,} max)"
            t.add_row(f"--batch {batch} {name}", verdict, "")
    Console().print(t)
    return 0 if batch is None or batch <= max(paged, contiguous) else 2

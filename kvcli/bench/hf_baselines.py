"""transformers baselines for the throughput benchmark: the same GGUF weights, the same prompts and the same
per-request output lengths as kvcli, run three ways.

  sequential      `model.generate` one request at a time (greedy, batch 1)
  static          `model.generate` on static batches of `batch_size` requests in trace order, LEFT padding with
                  an attention mask; a batch runs to the longest request's max_tokens, so the shorter requests'
                  extra tokens (and the prompt padding) are computed but are waste and not counted
  generate_batch  transformers' continuous batching (paged cache, requests join and leave between steps), through
                  `continuous_batching_context_manager` + `add_request(max_new_tokens=m)`: the machinery that
                  `model.generate_batch` wraps. `generate_batch` itself takes one global `max_new_tokens` for all
                  requests, which would make every request as long as the longest; the manager takes it per request.

Every request must yield exactly its max_tokens new tokens: EOS is switched off (`eos_token_id=None` on the
generation config for `generate`, -1 for continuous batching) and the new tokens are counted, not assumed.
Wall time covers generation only (model load excluded; for continuous batching the cache allocation and warm-up
are timed separately and reported in the note).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

MODES = ("sequential", "static", "generate_batch")
PAD_TOKEN_ID = 0  # any id works: padded positions are masked out

Progress = Callable[[str, int, int], None]  # (mode, requests done, requests total)


@dataclass
class BaselineResult:
    mode: str
    wall_seconds: float | None
    output_tokens: int  # useful tokens: sum over requests of min(generated, max_tokens)
    tokens_per_s: float | None  # output_tokens / wall_seconds; None when the mode failed
    note: str = ""
    computed_tokens: int = 0  # every new token the model produced, waste (static-batch overrun) included
    token_ids: list[list[int]] = field(default_factory=list, repr=False)  # per request, its useful tokens


def load_hf_reference(gguf_path: str | Path):
    """transformers' model built from the GGUF (dequantized to fp32 by transformers' GGUF loader), offline."""
    from transformers import AutoModelForCausalLM

    path = Path(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 local_files_only=True)
    return model.eval()


def _greedy_config(**kw):
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=PAD_TOKEN_ID, **kw)


def _check(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> None:
    if len(prompts) != len(max_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
    if not prompts:
        raise ValueError("no requests")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    if any(m <= 0 for m in max_tokens):
        raise ValueError("max_tokens must be > 0")


def _cut_note(done: int, total: int, seconds: float | None) -> str:
    """What a run stopped at its time limit covered (its rate is over what it finished)."""
    return "" if done == total else f"; stopped at the {seconds:g} s limit after {done} of {total} requests"


def _sequential(model, prompts, max_tokens, progress, stop_at: float | None = None,
                seconds: float | None = None) -> BaselineResult:
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    for i, (ids, m) in enumerate(zip(prompts, max_tokens)):
        if stop_at is not None and i and time.perf_counter() >= stop_at:
            break
        x = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
        with torch.inference_mode():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=m, do_sample=False)
        new = y[0, len(ids):].tolist()
        if len(new) != m:
            raise RuntimeError(f"sequential: request {i} got {len(new)} new tokens, expected {m}")
        outs.append(new)
        if progress:
            progress("sequential", i + 1, len(prompts))
    wall = time.perf_counter() - t0
    n = sum(len(o) for o in outs)
    note = "model.generate, batch 1, greedy" + _cut_note(len(outs), len(prompts), seconds)
    return BaselineResult("sequential", wall, n, n / wall, note, n, outs)


def _static(model, prompts, max_tokens, batch_size, progress, stop_at: float | None = None,
            seconds: float | None = None) -> BaselineResult:
    outs: list[list[int]] = []
    computed = pad_prompt = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        if stop_at is not None and start and time.perf_counter() >= stop_at:
            break
        batch = [list(p) for p in prompts[start:start + batch_size]]
        lens = list(max_tokens[start:start + batch_size])
        width = max(len(p) for p in batch)
        x = torch.full((len(batch), width), PAD_TOKEN_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(batch):  # left padding: every prompt ends at the last column
            x[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p):] = 1
            pad_prompt += width - len(p)
        n_new = max(lens)
        with torch.inference_mode():
            y = model.generate(x.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=n_new,
                               do_sample=False)
        if y.shape[1] - width != n_new:
            raise RuntimeError(f"static: batch at {start} got {y.shape[1] - width} new tokens, expected {n_new}")
        computed += len(batch) * n_new
        outs.extend(y[r, width:width + m].tolist() for r, m in enumerate(lens))
        if progress:
            progress("static", min(start + batch_size, len(prompts)), len(prompts))
    wall = time.perf_counter() - t0
    n = sum(len(o) for o in outs)
    waste = computed - n
    note = (f"model.generate on static batches of {batch_size}, left padding; each batch runs to its longest "
            f"request: {waste} of {computed} generated tokens ({100 * waste / max(1, computed):.0f} %) are past "
            f"their request's max_tokens (waste, not counted); {pad_prompt} prompt pad tokens"
            + _cut_note(len(outs), len(prompts), seconds))
    return BaselineResult("static", wall, n, n / wall, note, computed, outs)


def _generate_batch(model, prompts, max_tokens, progress, kv_budget_bytes: int, page_size: int,
                    max_batch_tokens: int, stop_at: float | None = None, seconds: float | None = None
                    ) -> BaselineResult:
    import inspect

    import transformers

    if not hasattr(model, "generate_batch") or not hasattr(model, "continuous_batching_context_manager"):
        return BaselineResult("generate_batch", None, 0, None,
                              f"not available in transformers {transformers.__version__}")
    from transformers import GenerationConfig

    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError as e:
        return BaselineResult("generate_batch", None, 0, None,
                              f"not available in transformers {transformers.__version__}: {e}")

    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    elem = torch.empty((), dtype=model.dtype).element_size()
    bytes_per_block = 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem * page_size
    num_blocks = max(1, kv_budget_bytes // bytes_per_block)
    # sized like kvcli's pool: transformers' CPU default would take 60 % of free RAM in 256-token pages
    # the page size's keyword: page_size in transformers 5.25, block_size before
    page_kw = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cb_config = ContinuousBatchingConfig(**{page_kw: page_size}, num_blocks=num_blocks,
                                         max_batch_tokens=max_batch_tokens)
    # eos_token_id=-1 never matches a token (init_continuous_batching substitutes it for None, with a warning)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_TOKEN_ID,
                                  max_new_tokens=max(max_tokens))
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                          max_generated_length=max(max_tokens), num_requests=len(prompts))

    results: dict[str, object] = {}
    ids = [f"r{i}" for i in range(len(prompts))]
    t_setup = time.perf_counter()
    wall = None
    setup = None
    try:
        with model.continuous_batching_context_manager(generation_config=gen_config,
                                                       continuous_batching_config=cb_config, block=True, timeout=5,
                                                       warmup=True, workload_hints=hints) as manager:
            setup = time.perf_counter() - t_setup
            t0 = time.perf_counter()
            for rid, p, m in zip(ids, prompts, max_tokens):
                manager.add_request(list(p), request_id=rid, max_new_tokens=m, eos_token_id=-1)
            while len(results) < len(ids):
                if stop_at is not None and time.perf_counter() >= stop_at:
                    break
                out = manager.get_result(timeout=1)
                if out is None:
                    if not manager.is_running():
                        break
                    continue
                if out.is_finished():
                    results[out.request_id] = out
                    if progress:
                        progress("generate_batch", len(results), len(ids))
            wall = time.perf_counter() - t0
            resolved = manager.continuous_batching_config
            attn = model.config._attn_implementation
    except Exception as e:  # noqa: BLE001 - a failing baseline is reported, not fatal
        return BaselineResult("generate_batch", None, 0, None, f"failed: {type(e).__name__}: {e}")

    outs: list[list[int]] = []
    problems: list[str] = []
    computed = 0
    cut = stop_at is not None and len(results) < len(ids)
    for rid, m in zip(ids, max_tokens):
        out = results.get(rid)
        if out is None:
            if not cut:
                problems.append(f"{rid} missing")
            outs.append([])
            continue
        if out.error is not None:
            problems.append(f"{rid} error: {out.error}")
        toks = list(out.generated_tokens)
        computed += len(toks)
        if len(toks) != m:
            problems.append(f"{rid} got {len(toks)} tokens, expected {m}")
        outs.append(toks[:m])
    n = sum(len(o) for o in outs)
    note = (f"continuous batching via continuous_batching_context_manager + add_request(max_new_tokens=m) "
            f"(generate_batch takes one global max_new_tokens); attn {attn}, page_size {page_size}, "
            f"{resolved.num_blocks} blocks ({kv_budget_bytes / 2**20:.0f} MiB), max_batch_tokens "
            f"{resolved.max_batch_tokens}; cache setup + warm-up {setup:.2f} s not timed"
            + (f"; stopped at the {seconds:g} s limit with {len(results)} of {len(ids)} requests finished (the "
               "rate counts finished requests' tokens only)" if cut else ""))
    if problems:
        shown = "; ".join(problems[:3]) + (f"; … {len(problems) - 3} more" if len(problems) > 3 else "")
        return BaselineResult("generate_batch", wall, n, None, f"{note}; INCOMPLETE: {shown}", computed, outs)
    return BaselineResult("generate_batch", wall, n, n / wall, note, computed, outs)


def run_hf_baselines(
    model,
    prompts: list[list[int]],
    max_tokens: list[int],
    batch_size: int = 16,
    modes: Sequence[str] = MODES,
    progress: Progress | None = None,
    *,
    kv_budget_bytes: int = 256 << 20,
    page_size: int = 16,
    max_batch_tokens: int = 512,
    warmup: bool = True,
    seconds_per_mode: float | None = None,
) -> dict[str, BaselineResult]:
    """Run `prompts` (token ids) through transformers in each of `modes`; request i yields max_tokens[i] tokens.

    kv_budget_bytes / page_size / max_batch_tokens size the continuous-batching cache like kvcli's pool
    (`--kv-budget`, block size 16, `max_num_batched_tokens` 512); transformers' defaults on CPU would take 60 % of
    free RAM and 256-token pages (one page per request at least). `warmup` runs one untimed 2-token `generate`
    on the first prompt first, so one-off costs (first-call allocations, lazy imports) stay out of the timings.
    `seconds_per_mode`: a mode stops starting requests (sequential), batches (static) or waiting (continuous
    batching) after this long; its rate is then over what it finished, and its note says how much that was.
    Inputs go to the model's device (a CUDA model runs on CUDA)."""
    _check(prompts, max_tokens)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown} (choose from {', '.join(MODES)})")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    saved = model.generation_config
    model.generation_config = _greedy_config()  # generate falls back to the model's config for EOS otherwise
    try:
        if warmup:
            x = torch.tensor([list(prompts[0])], dtype=torch.long, device=model.device)
            with torch.inference_mode():
                model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=2, do_sample=False)
        out: dict[str, BaselineResult] = {}
        for mode in modes:
            limit = dict(stop_at=None if seconds_per_mode is None else time.perf_counter() + seconds_per_mode,
                         seconds=seconds_per_mode)
            if mode == "sequential":
                out[mode] = _sequential(model, prompts, max_tokens, progress, **limit)
            elif mode == "static":
                out[mode] = _static(model, prompts, max_tokens, batch_size, progress, **limit)
            else:
                out[mode] = _generate_batch(model, prompts, max_tokens, progress, kv_budget_bytes, page_size,
                                            max_batch_tokens, **limit)
        return out
    finally:
        model.generation_config = saved

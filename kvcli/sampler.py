"""Next-token choice from logits: greedy, or temperature with top-k / top-p, seeded per request."""

from __future__ import annotations

import torch

from kvcli.config import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] float32."""
    if params.greedy:
        return argmax(logits)
    return int(torch.multinomial(probs(logits, params).cpu(), 1, generator=generator))


def argmax(logits: torch.Tensor) -> int:
    """torch.argmax(logits) for one row: the first maximum, NaN counting as the maximum. A contiguous fp32
    CPU row goes through NumPy's argmax (a zero-copy view), which gives the same index and is the faster
    of the two over a 49k vocabulary on the CPUs measured (scripts/ab_step_overhead.py covers it)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 1 and logits.is_contiguous():
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy `sample` draws from: temperature, then top-k, then top-p."""
    x = logits / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
        drop = p.cumsum(-1) - p >= params.top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1)

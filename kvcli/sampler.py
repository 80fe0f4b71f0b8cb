"""Next-token choice from logits: greedy, or temperature with top-k / top-p, seeded per request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcli.config import SamplingParams


@dataclass(frozen=True)
class Penalties:
    """Repetition penalties, as vLLM and OpenAI define them: `presence` and `frequency` subtract
    presence + frequency x count from the logit of each token already generated (OpenAI's, -2..2);
    `repetition` divides a positive logit (multiplies a negative one) of each token in the prompt or
    the output by it (transformers' and vLLM's, > 0; 1 = off)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    prompt_ids: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0)


def apply_penalties(logits: torch.Tensor, pen: Penalties, output_ids: Sequence[int]) -> torch.Tensor:
    """logits: [vocab]; a penalized copy."""
    x = logits.clone()
    if pen.repetition != 1.0:
        seen = torch.tensor(sorted({*pen.prompt_ids, *output_ids}), dtype=torch.int64, device=x.device)
        if seen.numel():
            v = x[seen]
            x[seen] = torch.where(v > 0, v / pen.repetition, v * pen.repetition)
    if output_ids and (pen.presence or pen.frequency):
        ids, counts = torch.unique(torch.tensor(list(output_ids), dtype=torch.int64), return_counts=True)
        ids = ids.to(x.device)
        x[ids] -= (pen.frequency * counts.to(x.device, x.dtype) + pen.presence)
    return x


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


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """torch.argmax(logits, dim=-1) for [rows, vocab] logits, as a list: argmax's choice per row (the first maximum,
    NaN counting as the maximum). A contiguous fp32 CPU batch goes through NumPy, as a row does: torch's kernel
    took ~0.2-0.4 ms for a 6-row verification's 6 x 49k logits against NumPy's ~16 us (2-core Xeon)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous():
        return logits.numpy().argmax(-1).tolist()
    return torch.argmax(logits, dim=-1).tolist()


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


def penalize_verification_rows(rows: torch.Tensor, pen: Penalties, output_ids: Sequence[int],
                               guesses: Sequence[int]) -> torch.Tensor:
    """rows: [len(guesses) + 1, vocab], the logits a speculative step verifies: row j comes after
    guesses[:j], so it is penalized as if they were already output (it matters only if they are
    accepted, and then they are)."""
    return torch.stack([apply_penalties(rows[j], pen, [*output_ids, *guesses[:j]]) for j in range(len(guesses) + 1)])

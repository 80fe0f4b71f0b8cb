"""Verification of guesses against the model's own distribution at each guessed position.

`logits[i]` is the model's next-token distribution after the request's tokens and guesses 0..i-1;
row k (the last) follows all k guesses. Greedy: keep guesses while they equal the argmax, then add
the argmax at the first mismatch (or after the last guess): token for token what plain greedy
decoding produces. Sampling: the draft is deterministic (one guessed token, probability 1), so
speculative sampling's rule reduces to: accept guess g with the target's probability p(g); on a
rejection draw from p with g removed and renormalised, and stop. Every token then has exactly the
target distribution (Leviathan et al. 2023; Chen et al. 2023). Draws use the request's generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcli.config import SamplingParams
from kvcli.sampler import argmax_rows, probs, sample


def accept(logits: torch.Tensor, guesses: Sequence[int], params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """logits: [len(guesses) + 1, vocab]. Returns the accepted guesses then one token of the model's."""
    k = len(guesses)
    if params.greedy:
        targets = argmax_rows(logits)
        out: list[int] = []
        for i in range(k):
            out.append(targets[i])
            if targets[i] != guesses[i]:
                return out
        out.append(targets[k])
        return out
    out = []
    for i, g in enumerate(guesses):
        p = probs(logits[i], params).cpu()
        if float(torch.rand((), generator=generator)) < float(p[g]):
            out.append(g)
            continue
        p[g] = 0.0  # p(g) < 1 here (the draw is below 1), so something is left to draw from
        out.append(int(torch.multinomial(p / p.sum(), 1, generator=generator)))
        return out
    out.append(sample(logits[k], params, generator))
    return out

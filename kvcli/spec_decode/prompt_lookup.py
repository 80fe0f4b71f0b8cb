"""Prompt lookup: guess the next tokens of a request from its own context (proposals only).

The last n tokens (n from ngram_max down to ngram_min, longest first) are looked for earlier in the
request's prompt + output; the tokens that followed the most recent earlier occurrence are the guess.
Nothing here touches the model or the KV cache: the engine verifies guesses in its next step.

Per request the proposer keeps its own copy of the tokens and an index from every ngram_min-gram to
the positions right after it, both grown incrementally, so a proposal costs O(new tokens + the
candidates checked) rather than a scan of the whole context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MAX_CANDIDATES = 64  # most recent occurrences of the short n-gram checked for a longer match


@dataclass
class _Context:
    tokens: list[int] = field(default_factory=list)
    index: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> positions after it
    indexed: int = 0  # n-grams ending before this position are in the index


class PromptLookupProposer:
    def __init__(self, num_tokens: int, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max or num_tokens < 1:
            raise ValueError("need 1 <= ngram_min <= ngram_max and num_tokens >= 1")
        self.k = num_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._ctx: dict[str, _Context] = {}

    def _sync(self, req_id: str, num_tokens: int, token_slice: Callable[[int, int], list[int]]) -> _Context:
        ctx = self._ctx.setdefault(req_id, _Context())
        if len(ctx.tokens) > num_tokens:  # cannot happen for a live request; start over if it does
            ctx = self._ctx[req_id] = _Context()
        if len(ctx.tokens) < num_tokens:
            ctx.tokens.extend(token_slice(len(ctx.tokens), num_tokens))
        # Index every short n-gram that has a token after it (the one ending at the last token has none).
        n, toks = self.ngram_min, ctx.tokens
        for end in range(max(ctx.indexed, n), len(toks)):
            ctx.index.setdefault(tuple(toks[end - n:end]), []).append(end)
        ctx.indexed = max(ctx.indexed, len(toks))
        return ctx

    def propose(self, req_id: str, num_tokens: int, token_slice: Callable[[int, int], list[int]],
                max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) guesses for the tokens after the request's first `num_tokens`."""
        k = min(self.k, max_tokens)
        if k <= 0 or num_tokens <= self.ngram_min:
            return []
        ctx = self._sync(req_id, num_tokens, token_slice)
        toks = ctx.tokens
        cands = ctx.index.get(tuple(toks[num_tokens - self.ngram_min:]))
        if not cands:
            return []
        best_len, best_end = 0, -1
        for end in reversed(cands[-MAX_CANDIDATES:]):  # most recent first: ties keep the latest
            # Extend the match backwards, up to ngram_max tokens.
            m = self.ngram_min
            while m < self.ngram_max and end - m - 1 >= 0 and toks[end - m - 1] == toks[num_tokens - m - 1]:
                m += 1
            if m > best_len:
                best_len, best_end = m, end
                if m == self.ngram_max:
                    break
        return toks[best_end:best_end + k]

    def release(self, req_id: str) -> None:
        self._ctx.pop(req_id, None)

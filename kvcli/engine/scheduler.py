"""Iteration-level scheduling, and the one owner of request state.

`schedule()` decides how many tokens of each request to compute this step; `update_from_output()`
applies what the runner returned: it advances `num_computed_tokens`, indexes blocks that are full of
final tokens for the prefix cache, forks samples of one prompt, appends sampled tokens and ends
requests on a stop token or a length limit. Nothing else changes a request's counters or status:
requests that end on a stop string (found by output processing, engine/output_processor.py) are
ended here too (`finish_requests`), and `release` forgets a finished one. Teacher forcing goes
through here as well (`admit_scoring`, `schedule_scoring`, `finish_scoring`), so only the scheduler
admits and allocates on the KV layout.

Order per step: requests swapped out earlier come back first (when nothing was preempted), then
running requests get their tokens (one for a decode, a chunk for an unfinished prompt, all under
the step's token budget), then waiting requests are admitted under the KV layout's own rule (the
paged watermark, or a contiguous reservation that must fit in one hole). When a running request
cannot get a block, the most recently admitted running request is preempted: by recompute (blocks
freed, num_computed_tokens reset, back to the front of the queue) or by swap (its blocks copied to
host memory and freed; copied back later, nothing recomputed). Finished requests free their blocks
in the step they finish; new requests join the next step.

Speculative decoding (with a proposer): a running request whose share of the step reaches the end of
its tokens may also get up to k guessed tokens, appended to its chunk (`spec_token_ids`). They count
against the step's token budget and take KV slots through `KVLayout.allocate`; when those slots are
not free the request simply does not guess this step. `update_from_output` then appends the tokens
the runner accepted (the guesses the model agreed with, then the model's own next token), one by
one through the stop checks, advances `num_computed_tokens` over the accepted guesses only (their
K/V were written with a correct context; the model's own token has no K/V yet), gives the rejected
guesses' slots back with `KVLayout.truncate`, and only then indexes full blocks for the prefix cache.

A bounded cache (a KV layout with a `Retention`, kvcache/retention.py: --kv-window W, --sink-tokens S):
the layout owns what is kept and drops blocks inside `allocate`; the scheduler keeps counting text tokens
(num_computed_tokens: tokens of prompt + output computed or dropped) and asks the layout where they sit
(`cache_position`): a chunk's start_pos is a cache position, so the runner and every attention backend see
the compact cache. A windowed request is not capped by the context: its prompt may be longer and it ends
on max_tokens (or a stop), never on max_model_len. Its chunk (with any guesses) is at most W tokens, so a
drop never reaches a token not yet computed. A request marked `skip_to_window` (recompute preemption
sets it; so may its submitter) rebuilds only its sinks and its last W tokens: once its sinks are
computed, the layout counts the tokens between as dropped without computing them, positions compact.

A sliding-window model (a paged layout with `sliding_window` W: every layer attends only to its last W
keys) keeps true positions: the layout releases the blocks before a step's window inside `allocate` and
points their table entries at the null block, so nothing changes here but the accounting: a request can
run when ceil((W - 1 + step budget) / block_size) + 1 blocks fit (the layout's `step_tokens` is the step
budget), and a swap-out copies only the blocks still held (`trim` first, then the held blocks; the
readmission's held blocks, the same ones, take them back).

A request asking for its prompt's log probabilities (SamplingParams.prompt_logprobs) computes its whole
prompt: no prefix-cache hit, chunks of at most PROMPT_SCORE_CHUNK tokens, each carrying the next prompt
token of its rows (`prompt_targets`); the runner's log probabilities are appended to the request in
order. A recompute preemption before its prompt is scored starts the scoring over with the prompt; its
forks (n > 1) share the one list.
"""

from __future__ import annotations

import time
from collections import deque

from kvcli.engine.request import Request, RequestStatus
from kvcli.kvcache.interface import KVLayout
from kvcli.metrics.snapshot import RequestTiming
from kvcli.metrics.stats import RequestExtent, SchedulerStats, SpecStats
from kvcli.spec_decode.backoff import AdaptiveBackoff
from kvcli.spec_decode.draft_length import DraftLength
from kvcli.spec_decode.prompt_lookup import PromptLookupProposer
from kvcli.step import NewRequest, RunnerOutput, ScheduledChunk, SchedulerOutput

PROMPT_SCORE_CHUNK = 512  # prompt tokens per step of a request scoring its prompt: [rows, vocab] logits each


class KVBudgetTooSmall(RuntimeError):
    pass


class Scheduler:
    def __init__(self, kv: KVLayout, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 preempt: str = "recompute", swap_blocks: int = 0, eos_token_ids: tuple[int, ...] = (),
                 proposer: PromptLookupProposer | None = None, backoff: AdaptiveBackoff | None = None,
                 draft: DraftLength | None = None) -> None:
        if preempt not in ("recompute", "swap"):
            raise ValueError(f"unknown preemption mode {preempt!r} (recompute or swap)")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.preempt_mode = preempt
        self.swap_blocks_free = swap_blocks  # host swap space, in blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0
        self._forks: dict[str, list[Request]] = {}  # leader -> samples waiting for its prompt
        self._new: list[NewRequest] = []
        self._released: list[str] = []
        self.proposer = proposer
        self.backoff = backoff
        self.draft = draft  # None: every proposal up to the proposer's k
        # Speculation counters (SpecStats): guesses proposed / accepted, verifications, and every
        # request-step that sampled with the tokens it appended (mean tokens per step per request).
        self.spec_proposed = 0
        self.spec_accepted = 0
        self.spec_steps = 0
        self.sample_steps = 0
        self.sample_tokens = 0
        if getattr(kv, "sliding_window", 0):  # a windowed request holds its window and one step's tokens
            kv.step_tokens = max_num_batched_tokens

    # --- queue -----------------------------------------------------------------------------------
    @property
    def retention(self):
        return getattr(self.kv, "retention", None)

    def final_tokens(self, req: Request) -> int:
        if self.retention is not None:  # bounded by the window, not the context
            return req.num_prompt_tokens + req.params.max_tokens
        return min(req.num_prompt_tokens + req.params.max_tokens, self.max_model_len)

    def _cap(self, req: Request, n: int) -> int:
        """A windowed request's share of a step: at most W tokens, and for one rebuilding to its window,
        its sinks first on their own (the skip happens between them and the window). A request scoring
        its prompt: at most PROMPT_SCORE_CHUNK tokens (each of its rows is a vocabulary of logits)."""
        if req.scores_prompt:
            n = min(n, PROMPT_SCORE_CHUNK)
        r = self.retention
        if r is None:
            return n
        n = min(n, r.window)
        if req.skip_to_window and req.num_computed_tokens < r.sink_slots:
            n = min(n, r.sink_slots - req.num_computed_tokens)
        return n

    def _skip(self, req: Request) -> None:
        if req.skip_to_window and self.retention is not None:
            req.num_computed_tokens += self.kv.skip(req.req_id, req.num_computed_tokens, req.num_tokens)

    def add(self, req: Request, forks: list[Request] = ()) -> None:
        """Queue a request; `forks` are further samples of the same prompt, which share its blocks
        once its prompt is computed."""
        need = self.kv.blocks_to_admit(req.num_prompt_tokens + 1, self.final_tokens(req))
        if need > self.kv.num_blocks:
            raise KVBudgetTooSmall(self._too_big(need))
        if forks and not self.kv.supports_sharing:
            raise ValueError(f"n > 1 shares the prompt's blocks, which the {self.kv.name} layout cannot do")
        for r in (req, *forks):
            self.requests[r.req_id] = r
            self._new.append(NewRequest(r.req_id, r.params, tuple(r.prompt_token_ids)
                                        if r.params.repetition_penalty != 1.0 else ()))
        if forks:
            self._forks[req.req_id] = list(forks)
        self.waiting.append(req)

    def _too_big(self, need: int) -> str:
        """Why a request can never run here, in the terms of the flags that change it (the request's id is
        no help: continue and chat have one text, serve answers the request itself)."""
        have = f"the KV pool holds {self.kv.num_blocks:,} blocks of {self.kv.block_size} tokens"
        r = self.retention
        if r is not None:
            return (f"{have}; a request under --kv-window {r.window:,} needs {need:,} (its sink blocks, its window "
                    f"and a block of room): raise --kv-budget or lower --kv-window")
        return (f"{have}; this request needs {need:,} (its prompt and the tokens asked for): raise --kv-budget, "
                f"shorten the prompt or ask for fewer tokens")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # --- preemption ----------------------------------------------------------------------------------
    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        if self.preempt_mode == "swap" and getattr(self.kv, "sliding_window", 0):
            self.kv.trim(req.req_id, req.num_computed_tokens)  # blocks before the window: not worth a copy
        table = self.kv.held_blocks(req.req_id)
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req.req_id)
        swapped_in = next((i for i, (rid, _) in enumerate(out.swap_in) if rid == req.req_id), None)
        if swapped_in is not None:
            # Swapped in and out within one step: its host copy is still current, so undo the swap-in.
            del out.swap_in[swapped_in]
            self.kv.free(req.req_id, swapped=True)
            self.swap_blocks_free -= req.swapped_blocks
            req.status = RequestStatus.SWAPPED
            self.swapped.appendleft(req)
            return
        if self.preempt_mode == "swap" and len(table) <= self.swap_blocks_free:
            self.swap_blocks_free -= len(table)
            out.swap_out.append((req.req_id, table))
            self.kv.free(req.req_id, swapped=True)
            req.status = RequestStatus.SWAPPED
            req.swapped_blocks = len(table)
            self.swapped.append(req)
            return
        self.kv.free(req.req_id)
        req.num_computed_tokens = 0
        if req.scores_prompt:  # its prompt is computed again from the start: scored again with it
            req.prompt_logprobs.clear()
        req.skip_to_window = self.retention is not None  # rebuild the sinks and the window only
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # --- one step ------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([], new_requests=self._new, released=self._released)
        self._new, self._released = [], []

        # Swapped requests return first, each with blocks for the tokens it already computed.
        while self.swapped and len(self.running) < self.max_num_seqs:
            req = self.swapped[0]
            n = req.num_computed_tokens
            if not self.kv.admit(req.req_id, n, n, self.final_tokens(req)):
                break
            self.swapped.popleft()
            self.swap_blocks_free += req.swapped_blocks
            held = self.kv.held_blocks(req.req_id)
            out.swap_in.append((req.req_id, held[:req.swapped_blocks]))
            req.status = RequestStatus.RUNNING
            self.running.append(req)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            self._skip(req)
            n = self._cap(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if n == req.num_tokens - req.num_computed_tokens:
                room = budget - n if self.retention is None else min(budget, self.retention.window) - n
                guesses = self._propose(req, room)
                # Guess slots only when free, leaving a block for each request still to be scheduled:
                # a guess never causes a preemption.
                free = self.kv.num_free_blocks
                if guesses and self.kv.allocate(req.req_id, req.num_computed_tokens + n + len(guesses),
                                                req.num_computed_tokens):
                    if self.kv.num_free_blocks == free or self.kv.num_free_blocks >= len(self.running) - i - 1:
                        budget -= n + len(guesses)
                        i += 1
                        out.chunks.append(self._chunk(req, n, guesses))
                        continue
                    self.kv.truncate(req.req_id, req.num_computed_tokens + n)
            while not self.kv.allocate(req.req_id, req.num_computed_tokens + n, req.num_computed_tokens):
                if len(self.running) == 1 and not self.swapped:
                    # Alone and still out of blocks: the pool cannot hold this request's context, and
                    # preempting it would only loop. It ends here, its tokens so far kept.
                    self.finish(req, "kv_budget")
                    out.finished.append(req.req_id)
                    break
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                budget -= n
                i += 1
                out.chunks.append(self._chunk(req, n))

        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and not out.preempted and not self.swapped):
            req = self.waiting[0]
            if req.num_computed_tokens == 0 and not req.scores_prompt:  # a shared prefix's cached blocks (paged)
                req.num_computed_tokens = self.kv.match_prefix(req.req_id, req.all_token_ids)
                r = self.retention
                if (req.skip_to_window and r is not None and req.num_computed_tokens > r.sink_slots
                        and req.num_tokens > r.sink_slots + r.window):
                    # Rebuilding to the window: keep only the sink blocks of the hit, then skip.
                    self.kv.truncate(req.req_id, r.sink_slots)
                    req.num_computed_tokens = r.sink_slots
            self._skip(req)
            n = self._cap(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if not self.kv.admit(req.req_id, req.num_computed_tokens + n, req.num_computed_tokens,
                                 self.final_tokens(req)):
                # Not now. Prefix blocks taken above go back to the cache; the match is redone next time.
                self.kv.free(req.req_id)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= n
            out.chunks.append(self._chunk(req, n))

        out.block_copies.extend(self.kv.take_copies())
        if self.retention is not None:
            out.key_shifts.extend(self.kv.take_shifts())
        out.new_blocks.extend(self.kv.take_new_blocks())
        if not out.chunks and not self.running and (self.waiting or self.swapped):
            raise KVBudgetTooSmall(f"a request cannot get KV blocks even with the pool empty ({self.kv.num_blocks:,} "
                                   f"blocks of {self.kv.block_size} tokens): raise --kv-budget")
        return out

    def _propose(self, req: Request, room: int) -> list[int]:
        """Guesses for the tokens after `req`'s last one: at most `room` (the step's budget left) and
        one fewer than the tokens it may still produce (the model's own token comes after them)."""
        if self.proposer is None or req.req_id in self._forks:
            return []
        limit = min(room, self.final_tokens(req) - req.num_tokens - 1)
        if limit <= 0 or (self.backoff is not None and not self.backoff.should_propose(req.req_id)):
            return []
        if self.draft is not None:
            limit = min(limit, self.draft.length(req.req_id, self.proposer.k))
        return self.proposer.propose(req.req_id, req.num_tokens, req.token_slice, limit)

    def _chunk(self, req: Request, n: int, guesses: list[int] = ()) -> ScheduledChunk:
        start = req.num_computed_tokens
        sample = start + n == req.num_tokens
        targets: tuple[int, ...] = ()
        if req.scores_prompt and start == len(req.prompt_logprobs):  # rows start..: their next prompt token
            targets = tuple(req.prompt_token_ids[start + 1:min(start + n + 1, req.num_prompt_tokens)])
        tables = self.kv.group_tables(req.req_id)
        return ScheduledChunk(
            req_id=req.req_id,
            token_ids=req.token_slice(start, start + n) + list(guesses),
            start_pos=start if self.retention is None else self.kv.cache_position(req.req_id, start),
            block_table=list(tables[0]),
            group_tables=tuple(list(t) for t in tables[1:]),
            sample=sample,
            fork_ids=tuple(c.req_id for c in self._forks.get(req.req_id, ())) if sample else (),
            spec_token_ids=tuple(guesses),
            prompt_targets=targets,
        )

    # --- applying a step's results ---------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput,
                           now: float | None = None) -> list[tuple[Request, int]]:
        """Advance every scheduled request by the tokens computed and append the sampled ones.
        Returns the new tokens in order (request, token); a request may have finished on it."""
        now = time.perf_counter() if now is None else now
        verified: dict[str, ScheduledChunk] = {}
        scored = result.prompt_logprobs or {}
        for chunk in out.chunks:
            req = self.requests[chunk.req_id]
            if chunk.prompt_targets:
                req.prompt_logprobs.extend(scored.get(chunk.req_id, ()))  # (a simulated runner scores nothing)
            k = len(chunk.spec_token_ids)
            req.num_computed_tokens += len(chunk.token_ids) - k
            if k:
                verified[chunk.req_id] = chunk  # finished below, once the accepted guesses are appended
            else:
                # Every computed token is final: index its full blocks.
                self.kv.cache_blocks(req.req_id, req.token_slice, req.num_computed_tokens)
            for child in self._forks.pop(req.req_id, []) if chunk.fork_ids else ():
                self.kv.fork(req.req_id, child.req_id)
                child.num_computed_tokens = req.num_computed_tokens
                child.prompt_logprobs = req.prompt_logprobs  # one prompt, scored once
                child.status = RequestStatus.RUNNING
                self.running.append(child)
        new: list[tuple[Request, int]] = []
        for rid, tokens in result.sampled.items():
            req = self.requests[rid]
            appended = 0
            for tok in tokens:
                if req.finished:
                    break
                self._append(req, tok, now)
                new.append((req, tok))
                appended += 1
            self.sample_steps += 1
            self.sample_tokens += appended
            chunk = verified.get(rid)
            if chunk is not None:
                self._verified(req, chunk, accepted=len(tokens) - 1)
        return new

    def _verified(self, req: Request, chunk: ScheduledChunk, accepted: int) -> None:
        """After a verification: the accepted guesses' K/V are final; the rejected ones' slots go back
        before the prefix cache indexes anything (it never hashes a guess)."""
        k = len(chunk.spec_token_ids)
        self.spec_steps += 1
        self.spec_proposed += k
        self.spec_accepted += accepted
        if req.finished:  # its blocks are already free, its back-off and draft state released
            return
        if self.backoff is not None:
            self.backoff.record(req.req_id, k, accepted)
        if self.draft is not None:
            self.draft.record(req.req_id, k, accepted, self.proposer.k)
        req.num_computed_tokens += accepted
        self.kv.truncate(req.req_id, req.num_computed_tokens)
        self.kv.cache_blocks(req.req_id, req.token_slice, req.num_computed_tokens)

    def _append(self, req: Request, tok: int, now: float) -> None:
        req.output_token_ids.append(tok)
        req.token_times.append(now)
        if req.first_token_time is None:
            req.first_token_time = now
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            self.finish(req, "stop")
        elif len(req.output_token_ids) >= p.max_tokens or (req.num_tokens >= self.max_model_len
                                                          and self.retention is None):
            self.finish(req, "length")

    def finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        req.dropped_tokens = self.dropped_tokens(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.swapped:
            self.swapped.remove(req)
            self.swap_blocks_free += req.swapped_blocks
        self.kv.free(req.req_id)
        self._released.append(req.req_id)
        if self.proposer is not None:
            self.proposer.release(req.req_id)
        if self.backoff is not None:
            self.backoff.release(req.req_id)
        if self.draft is not None:
            self.draft.release(req.req_id)

    def dropped_tokens(self, req: Request) -> int:
        """Text tokens of a request its bounded cache holds no KV for (0 without a retention rule)."""
        if self.retention is None or req.finished:
            return req.dropped_tokens
        return self.kv.dropped_tokens(req.req_id)

    def finish_requests(self, req_ids: list[str], reason: str) -> None:
        """End requests that something outside ended (output processing: a stop string)."""
        for rid in req_ids:
            self.finish(self.requests[rid], reason)

    def abort(self, req_id: str) -> None:
        """End a request (and samples of it not forked yet) wherever it is."""
        for req in [self.requests[req_id], *self._forks.pop(req_id, [])]:
            self.finish(req, "abort")

    def release(self, req_id: str) -> bool:
        """Forget a finished request (its blocks are already free); False when there is no finished
        request of that id (unknown, already released, or still live)."""
        req = self.requests.get(req_id)
        if req is None or not req.finished:
            return False
        del self.requests[req_id]
        return True

    # --- teacher forcing -------------------------------------------------------------------------------
    # A scored sequence is not a request: it has no sampling, no output and no runner state, and the
    # scheduler must be idle. It is prefilled in chunks of the step budget, through the KV layout.
    def scoring_chunk(self) -> int:
        """Tokens per scoring step: the step budget, and under a retention rule at most W."""
        r = self.retention
        return self.max_num_batched_tokens if r is None else min(self.max_num_batched_tokens, r.window)

    def admit_scoring(self, req_id: str, num_tokens: int) -> bool:
        """Take KV space for a sequence of num_tokens to score (False: the pool cannot hold it)."""
        return self.kv.admit(req_id, min(num_tokens, self.scoring_chunk()), 0, num_tokens)

    def schedule_scoring(self, req_id: str, token_ids: list[int], pos: int) -> SchedulerOutput | None:
        """The step that computes token_ids[pos:pos + budget] (each position's logits wanted), or None
        when the pool has no slots for it. Under a retention rule the sequence streams through the window."""
        n = min(self.scoring_chunk(), len(token_ids) - pos)
        if not self.kv.allocate(req_id, pos + n, pos):
            return None
        start = pos if self.retention is None else self.kv.cache_position(req_id, pos)
        tables = self.kv.group_tables(req_id)
        chunk = ScheduledChunk(req_id, token_ids[pos:pos + n], start, tables[0], True, group_tables=tables[1:])
        return SchedulerOutput([chunk],
                               new_blocks=self.kv.take_new_blocks(), block_copies=self.kv.take_copies(),
                               key_shifts=self.kv.take_shifts() if self.retention is not None else [])

    def finish_scoring(self, req_id: str) -> None:
        self.kv.free(req_id)

    # --- statistics ------------------------------------------------------------------------------------
    def extent(self, req: Request) -> RequestExtent:
        """A request's extent in KV slots: under a retention rule its compact cache, not its text."""
        r = self.retention
        if r is None:
            return RequestExtent(req.req_id, req.num_computed_tokens, self.final_tokens(req))
        d = self.kv.dropped_tokens(req.req_id)
        return RequestExtent(req.req_id, req.num_computed_tokens - d, min(self.final_tokens(req) - d, r.max_slots))

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=len(self.swapped),
            num_preemptions=self.num_preemptions, running=tuple(self.extent(r) for r in self.running),
            next_waiting=self.final_tokens(self.waiting[0]) if self.waiting else None)

    def request_timings(self) -> tuple[RequestTiming, ...]:
        """When each request that has produced a token got its tokens (requests not released yet)."""
        out = []
        for r in self.requests.values():
            if r.first_token_time is None:
                continue
            t = r.token_times
            out.append(RequestTiming(r.req_id, r.num_prompt_tokens, len(r.output_token_ids),
                                     r.first_token_time - r.arrival_time, tuple(b - a for a, b in zip(t, t[1:]))))
        return tuple(out)

    def spec_stats(self) -> SpecStats:
        return SpecStats(
            enabled=self.proposer is not None, proposed=self.spec_proposed, accepted=self.spec_accepted,
            verifications=self.spec_steps, request_steps=self.sample_steps, request_step_tokens=self.sample_tokens,
            paused=sum(1 for r in self.running if self.backoff is not None and self.backoff.paused(r.req_id)))

"""Turns a SchedulerOutput into tensors (ids, positions, slot mapping, block tables), runs the model
and samples the next token of the requests that sample this step. A request carrying guesses gets
logits at its last token and at each guess, and the guesses are verified here (spec_decode/acceptance.py):
the runner returns the accepted guesses followed by the model's own next token."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvcli.attention.base import AttentionBackend, AttentionMetadata
from kvcli.config import SamplingParams
from kvcli.step import RunnerOutput, SchedulerOutput, TokenLogprob
from kvcli.kvcache.interface import NULL_BLOCK
from kvcli.kvcache.kv_cache import HostBlocks, KVCache
from kvcli.model.llama import LlamaModel
from kvcli.runner.cuda_graphs import DecodeGraphs
from kvcli.sampler import Penalties, apply_penalties, penalize_verification_rows, sample
from kvcli.spec_decode.acceptance import accept


def build_metadata(out: SchedulerOutput, block_size: int, device: torch.device, sliding_window: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """The step's tensors, each made by one torch.tensor call from Python lists (per-row tensors and
    per-token generators cost more than the lists at decode batch sizes), and the rows that get logits:
    first every scoring chunk's prompt rows (`prompt_targets`), then each sampling chunk's last token and
    guesses. With KV groups (chunks carrying `group_tables`) each further group gets its own slots and
    tables in `meta.groups`, the rest shared."""
    chunks = out.chunks
    ids: list[int] = []
    positions: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    q_lens: list[int] = []
    logit_rows: list[int] = []
    prompt_rows: list[int] = []
    for c in chunks:
        n = len(c.token_ids)
        start = c.start_pos
        end = start + n
        ids.extend(c.token_ids)
        if n == 1:  # a decode: one position
            positions.append(start)
        else:
            positions.extend(range(start, end))
        cu.append(cu[-1] + n)
        seq_lens.append(end)
        q_lens.append(n)
        if c.prompt_targets:  # its first rows, scored against the next prompt token
            prompt_rows.extend(range(cu[-2], cu[-2] + len(c.prompt_targets)))
        if c.sample:  # the last real token, then each guess
            logit_rows.extend(range(cu[-1] - 1 - len(c.spec_token_ids), cu[-1]))
    slots, tables = _slots_and_tables(chunks, [c.block_table for c in chunks], block_size, device)
    meta = AttentionMetadata(
        slot_mapping=slots,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        max_seqlen_q=max(q_lens),
        max_seq_len=max(seq_lens),
        seq_lens_list=tuple(seq_lens),
        query_lens_list=tuple(q_lens),
        sliding_window=sliding_window,
    )
    if chunks[0].group_tables:
        groups = []
        for g in range(len(chunks[0].group_tables)):
            gs, gt = _slots_and_tables(chunks, [c.group_tables[g] for c in chunks], block_size, device)
            groups.append(replace(meta, slot_mapping=gs, block_tables=gt))
        meta = replace(meta, groups=tuple(groups))
    return (torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device), meta, prompt_rows + logit_rows)


def _slots_and_tables(chunks, tables: list[list[int]], block_size: int, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each step token's cache slot through its request's table, and the tables padded with the null block."""
    slots: list[int] = []
    width = max(len(t) for t in tables)
    pad = [NULL_BLOCK] * width
    padded: list[list[int]] = []
    for c, table in zip(chunks, tables):
        start, n = c.start_pos, len(c.token_ids)
        if n == 1:
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            slots.extend([table[p // block_size] * block_size + p % block_size for p in range(start, start + n)])
        padded.append([*table, *pad[len(table):]])
    return (torch.tensor(slots, dtype=torch.int64, device=device),
            torch.tensor(padded, dtype=torch.int32, device=device))


class ModelRunner:
    """Executes a SchedulerOutput on the model: block traffic, one forward pass, sampling. Keeps what
    it needs per request (sampling params and seeded generators, host copies of swapped blocks)
    from the scheduler's `new_requests` until the request shows up in `released`."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, backend: AttentionBackend,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.graphs = graphs  # decode steps replayed from CUDA graphs (runner/cuda_graphs.py), or None: eager
        self.device = model.device
        self.params: dict[str, SamplingParams] = {}
        self.generators: dict[str, torch.Generator | None] = {}
        self.swapped: dict[str, HostBlocks] = {}
        self.want_logprobs: dict[str, int] = {}  # req id -> how many top entries (0: the sampled token's only)
        self.penalties: dict[str, Penalties] = {}  # req id -> its penalties (requests that have any)
        self.penalized_out: dict[str, list[int]] = {}  # their output tokens so far, as sampled here

    @property
    def swapped_bytes(self) -> int:
        return sum(h.nbytes for h in self.swapped.values())

    def _track(self, out: SchedulerOutput) -> None:
        for r in out.new_requests:
            p = r.params
            self.params[r.req_id] = p
            self.generators[r.req_id] = None if p.seed is None else torch.Generator().manual_seed(p.seed)
            if p.logprobs is not None:
                self.want_logprobs[r.req_id] = p.logprobs
            if p.penalized:
                self.penalties[r.req_id] = Penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                                                     r.prompt_ids)
                self.penalized_out[r.req_id] = []
        for rid in out.released:
            self.params.pop(rid, None)
            self.generators.pop(rid, None)
            self.swapped.pop(rid, None)
            self.want_logprobs.pop(rid, None)
            self.penalties.pop(rid, None)
            self.penalized_out.pop(rid, None)

    def move_blocks(self, out: SchedulerOutput) -> None:
        """Block traffic the scheduler decided on, before any of this step's KV writes: blocks used
        for the first time are zeroed, then swap-outs (their blocks may be reused this step),
        swap-ins, and copy-on-write copies."""
        cache = self.kv_cache
        if out.new_blocks:
            cache.zero_blocks(out.new_blocks)
        for req_id, blocks in out.swap_out:
            self.swapped[req_id] = cache.swap_out(blocks)
        for req_id, blocks in out.swap_in:
            cache.swap_in(blocks, self.swapped.pop(req_id))
        if out.block_copies:
            cache.copy_blocks(out.block_copies)
        for shift in out.key_shifts:  # a bounded cache dropped blocks: kept keys move down (kvcache/retention.py)
            cache.rotate_keys(list(shift.blocks),
                              lambda k, layer, d=shift.delta: self.model.layers[layer].rotary.shift_keys(k, d))

    def execute(self, out: SchedulerOutput, all_logits: bool = False) -> RunnerOutput:
        """Run one step and sample. With all_logits (teacher forcing), return logits for every
        scheduled token instead of sampling."""
        self._track(out)
        self.move_blocks(out)
        if not out.chunks:
            return RunnerOutput({})
        if self.graphs is not None and not all_logits:
            logits = self.graphs.run(out.chunks)
            if logits is not None:  # a decode step: one row per request, in chunk order
                return self._sample(out.chunks, logits, None)
        ids, positions, meta, rows = build_metadata(out, self.kv_cache.block_size, self.device,
                                                   self.model.config.sliding_window or 0)
        if all_logits:
            return RunnerOutput({}, self.model.forward(ids, positions, self.kv_cache, meta, self.backend))
        sampling = [c for c in out.chunks if c.sample]
        scoring = [c for c in out.chunks if c.prompt_targets]  # their rows come first in `rows`
        if not rows:  # a step of prefill chunks only: no lm_head at all
            self.model.forward(ids, positions, self.kv_cache, meta, self.backend,
                               torch.empty(0, dtype=torch.int64, device=self.device))
            return RunnerOutput({})
        rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        logits = self.model.forward(ids, positions, self.kv_cache, meta, self.backend, rows_t)
        prompt_lps = None
        if scoring:
            scored = sum(len(c.prompt_targets) for c in scoring)
            prompt_lps = self._prompt_logprobs(scoring, logits[:scored])
            logits = logits[scored:]
        if not sampling:
            return RunnerOutput({}, prompt_logprobs=prompt_lps)
        return self._sample(sampling, logits, prompt_lps)

    def _sample(self, sampling, logits: torch.Tensor, prompt_lps) -> RunnerOutput:
        """The sampling chunks' next tokens (and verified guesses) from their logits rows: each chunk's last
        token's row, then one per guess, in chunk order."""
        sampled: dict[str, list[int]] = {}
        row = 0
        pen = self.penalties
        # Off the CPU, one argmax for every row and one copy to the host (a row at a time syncs once per row).
        top = logits.argmax(-1).tolist() if logits.device.type != "cpu" else None
        for c in sampling:
            k = len(c.spec_token_ids)
            if k:
                rid = c.req_id
                rows = logits[row:row + k + 1]
                if rid in pen:
                    rows = penalize_verification_rows(rows, pen[rid], self.penalized_out[rid], c.spec_token_ids)
                sampled[rid] = accept(rows, c.spec_token_ids, self.params[rid], self.generators[rid])
            else:
                for rid in (c.req_id, *c.fork_ids):
                    if top is not None and rid not in pen and self.params[rid].greedy:
                        sampled[rid] = [top[row]]
                        continue
                    x = logits[row] if rid not in pen else apply_penalties(logits[row], pen[rid],
                                                                           self.penalized_out[rid])
                    sampled[rid] = [sample(x, self.params[rid], self.generators[rid])]
            row += k + 1
        for rid in pen.keys() & sampled.keys():
            self.penalized_out[rid].extend(sampled[rid])
        return RunnerOutput(sampled, logprobs=self._logprobs(sampling, logits, sampled) if self.want_logprobs else None,
                            prompt_logprobs=prompt_lps)

    def _prompt_logprobs(self, scoring, logits: torch.Tensor) -> dict[str, list[TokenLogprob]]:
        """Each scoring chunk's rows in order: the log probability of the prompt token after each row."""
        out: dict[str, list[TokenLogprob]] = {}
        row = 0
        for c in scoring:
            k = len(c.prompt_targets)
            out[c.req_id] = token_logprobs(logits[row:row + k], c.prompt_targets,
                                           self.params[c.req_id].prompt_logprobs or 0)
            row += k
        return out

    def _logprobs(self, sampling, logits: torch.Tensor, sampled: dict[str, list[int]]) -> dict[str, list[TokenLogprob]]:
        """Token i of a request's sampled list was drawn from its logits row `row + i` (the guesses
        before it were verified on the rows before); a fork samples from its parent's row."""
        out: dict[str, list[TokenLogprob]] = {}
        row = 0
        for c in sampling:
            k = len(c.spec_token_ids)
            for rid in (c.req_id, *c.fork_ids):
                top = self.want_logprobs.get(rid)
                if top is None or rid not in sampled:
                    continue
                toks = sampled[rid]
                out[rid] = token_logprobs(logits[row:row + len(toks)], toks, top)
            row += k + 1
        return out


def token_logprobs(logits: torch.Tensor, tokens, top: int) -> list[TokenLogprob]:
    """Row i's log-softmax at tokens[i], and its `top` most likely (token id, log probability)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp[torch.arange(len(tokens), device=lp.device), torch.tensor(list(tokens), device=lp.device)].tolist()
    if top:
        vals, idx = torch.topk(lp, top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(p, t) for p, t in zip(picked, tops)]

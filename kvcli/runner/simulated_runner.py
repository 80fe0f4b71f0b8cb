"""The runner of a simulated engine: no model, no KV tensors. Every request that samples gets token
0, so lengths come from max_tokens (traces set ignore_eos) and the scheduler and KV layout run
exactly as they would with a model: memory figures for any configuration, in seconds. Guesses are
verified greedily against that model: guesses of 0 are accepted up to the first other one."""

from __future__ import annotations

from kvcli.step import RunnerOutput, SchedulerOutput


class SimulatedRunner:
    kv_cache = None

    def execute(self, out: SchedulerOutput, all_logits: bool = False) -> RunnerOutput:
        sampled: dict[str, list[int]] = {}
        for c in out.chunks:
            if c.sample:
                for rid in (c.req_id, *c.fork_ids):
                    sampled[rid] = [0]
                for g in c.spec_token_ids:
                    if g != 0:
                        break
                    sampled[c.req_id].append(0)
        return RunnerOutput(sampled)

    @property
    def swapped_bytes(self) -> int:
        return 0

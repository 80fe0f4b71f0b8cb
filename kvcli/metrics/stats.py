"""Engine counters and the immutable snapshot the CLI summary (and later the live view) reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSnapshot:
    step: int
    num_running: int
    num_waiting: int
    num_blocks: int
    block_size: int
    blocks_used: int
    peak_blocks_used: int
    tokens_in_cache: int  # token states actually held
    bytes_per_block: int
    kv_pool_bytes: int
    weight_bytes: int
    prompt_tokens: int  # prompt tokens computed (prefill work)
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    num_preemptions: int
    decode_tokens: int  # tokens sampled in decode-only steps
    peak_shared_blocks: int = 0  # blocks not allocated thanks to sharing (forks, prefix hits), at peak

    @property
    def kv_used_bytes(self) -> int:
        return self.blocks_used * self.bytes_per_block

    @property
    def peak_kv_bytes(self) -> int:
        return self.peak_blocks_used * self.bytes_per_block

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first token of each request comes out of its last prefill step.
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

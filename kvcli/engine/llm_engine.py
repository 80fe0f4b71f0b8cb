"""The engine loop: schedule -> run the model -> sample -> update requests -> snapshot metrics."""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import torch

from kvcli.attention.base import AttentionBackend
from kvcli.config import SamplingParams, SchedulerConfig
from kvcli.engine.detokenizer import IncrementalDetokenizer
from kvcli.engine.outputs import CompletionOutput, RequestOutput
from kvcli.engine.request import Request, RequestStatus
from kvcli.engine.scheduler import Scheduler
from kvcli.kvcache.block_manager import KVCacheManager
from kvcli.kvcache.contiguous import ContiguousAllocator
from kvcli.kvcache.block_pool import BlockPool
from kvcli.kvcache.kv_cache import KVCache, allocate_kv_cache, bytes_per_block, num_blocks_for_budget
from kvcli.metrics.collector import MetricsCollector
from kvcli.metrics.stats import EngineSnapshot
from kvcli.model.llama import LlamaModel
from kvcli.model.loader import LoadedWeights
from kvcli.model.quant import QuantTensor
from kvcli.model.tokenizer import Tokenizer
from kvcli.runner.model_runner import ModelRunner, RunnerOutput
from kvcli.sampler import sample


class ConfigError(ValueError):
    """Engine options that cannot work together; the message is meant for the user as is."""


@dataclass(frozen=True)
class EngineOptions:
    device: str | None = None  # None: cuda when available, else cpu
    block_size: int = 16
    kv_budget: str | None = None  # "2GiB", "512MB", a fraction of free memory "0.5", or None (auto)
    dequantize: bool = False  # dense fp32 weights: exact, 8x the bytes
    max_model_len: int | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    attention_backend: str = "auto"  # auto | torch | triton
    kv_layout: str = "paged"  # paged | contiguous (preallocated region per request, for comparison)
    reserve: str = "max-len"  # contiguous only: max-len | request (prompt + max_tokens)
    preempt: str = "recompute"  # recompute | swap
    swap_space: str = "4GiB"  # host memory for swapped-out blocks
    dtype: str | None = None  # compute dtype; default fp32 on CPU, bf16 (fp16 if unsupported) on CUDA
    kv_dtype: str | None = None  # default: the compute dtype
    prefix_caching: bool = True  # reuse full blocks of shared prefixes across requests


SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)
DEFAULT_CPU_KV_BUDGET = 1 << 30


def parse_bytes(text: str) -> int:
    units = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
             "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a size (e.g. 2GiB, 512MB)") from None
    if unit not in units or value <= 0:
        raise ConfigError(f"cannot read {text!r} as a size (e.g. 2GiB, 512MB)")
    return int(value * units[unit])


def parse_kv_budget(spec: str) -> tuple[int | None, float]:
    """`--kv-budget`: (bytes, 0) for a size ("2GiB", "512MB", or a plain number above 1), or
    (None, fraction) for a share of free memory in (0, 1]."""
    try:
        frac = float(spec)
    except ValueError:
        frac = 2.0  # not a number: read it as a size below
    if frac > 1:
        try:
            return parse_bytes(spec), 0.0
        except ConfigError as e:
            raise ConfigError(f"--kv-budget: {e}") from None
    if frac <= 0:
        raise ConfigError(f"--kv-budget {spec}: must be a size (2GiB, 512MB, bytes) or a fraction in (0, 1]")
    return None, frac


def resolve_device(device: str | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for, but torch sees no CUDA device")
    return dev


def pick_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "torch":
        from kvcli.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        # On CPU only under Triton's interpreter (tests and debugging; about a second per launch).
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("--attention-backend triton needs a CUDA device (the CPU uses the torch path)")
        from kvcli.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ConfigError(f"unknown attention backend {name!r} (choose auto, torch or triton)")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class LLMEngine:
    """Owns the model, the KV pool, the scheduler and the requests. With `loaded=None` the engine
    simulates: the same scheduler and block manager run, no model (each request's output length
    is its max_tokens), so memory figures for big models and budgets come out exact in seconds."""

    def __init__(self, loaded: LoadedWeights | None, options: EngineOptions = EngineOptions(),
                 config=None, model: LlamaModel | None = None) -> None:
        self.options = options
        self.simulated = loaded is None
        self.config = config if loaded is None else loaded.config
        self.tokenizer: Tokenizer | None = None if loaded is None else loaded.tokenizer
        self.source = "simulation" if loaded is None else loaded.source
        self.load_seconds = 0.0 if loaded is None else loaded.load_seconds
        self.device = torch.device("cpu") if loaded is None else resolve_device(options.device)
        if options.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ConfigError(f"--block-size must be one of {', '.join(map(str, SUPPORTED_BLOCK_SIZES))} "
                              f"(got {options.block_size})")
        if options.kv_layout not in ("paged", "contiguous"):
            raise ConfigError(f"unknown --kv-layout {options.kv_layout!r} (paged or contiguous)")
        cpu = self.device.type == "cpu"
        default = torch.float32 if cpu else (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
        dtype = _parse_dtype(options.dtype, default, "dtype")
        kv_dtype = _parse_dtype(options.kv_dtype, dtype, "kv-dtype")
        c = self.config
        self.max_model_len = min(options.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
        self.model = None
        self.linear_mode = "none"
        self.formats: dict[str, int] = {}
        if loaded is not None:
            self.backend = pick_backend(options.attention_backend, self.device)
            if model is None:
                self._build_model(loaded, dtype, cpu)
            else:  # a second engine over the same weights (profile --compare), no second load
                self.model, self.linear_mode = model, getattr(model, "linear_mode", "shared")

        budget = self._kv_budget_bytes(options.kv_budget, kv_dtype)
        bs = options.block_size
        num_blocks = num_blocks_for_budget(c, bs, kv_dtype, budget)
        per_block = bytes_per_block(c, bs, kv_dtype)
        if num_blocks < 1:
            raise ConfigError(f"--kv-budget {budget} B holds no KV block: one block of {bs} tokens over "
                              f"{c.num_layers} layers needs {per_block} B")
        self.bytes_per_block = per_block
        self.kv_dtype = kv_dtype
        self.kv_cache: KVCache | None = None
        if loaded is not None:
            self.kv_cache = allocate_kv_cache(c, num_blocks, bs, kv_dtype, self.device)
            self.runner = ModelRunner(self.model, self.kv_cache, self.backend)
        if options.kv_layout == "paged":
            self.pool: BlockPool | None = BlockPool(num_blocks)
            self.kv = KVCacheManager(self.pool, bs, prefix_caching=options.prefix_caching)
        else:
            self.pool = None
            self.kv = ContiguousAllocator(num_blocks, bs)
        self.num_blocks = num_blocks
        swap_blocks = parse_bytes(options.swap_space) // per_block if options.preempt == "swap" else 0
        try:
            self.scheduler = Scheduler(
                SchedulerConfig(options.max_num_seqs, options.max_num_batched_tokens, self.max_model_len),
                self.kv, preempt=options.preempt, reserve=options.reserve, swap_blocks=swap_blocks)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._gens: dict[str, torch.Generator | None] = {}
        self._forks: dict[str, list[Request]] = {}  # leader -> samples waiting for its prompt
        self._ids = itertools.count()
        self._step = 0
        self._peak_blocks = 0
        self._peak_shared = 0
        self._prompt_tokens = 0
        self._generated = 0
        self._decode_tokens = 0
        self._prefill_s = 0.0
        self._decode_s = 0.0
        self.metrics = MetricsCollector(self)

    def _build_model(self, loaded: LoadedWeights, dtype: torch.dtype, cpu: bool) -> None:
        has_int4 = any(isinstance(w, QuantTensor) and w.kind == "q4" for w in loaded.weights.values())
        if self.options.dequantize or not (has_int4 or loaded.dense_linears == "nf4"):
            mode, head_dtype = "dense", dtype
        elif loaded.dense_linears == "nf4":
            mode, head_dtype = "nf4", dtype
        elif cpu:
            # The INT4 CPU kernel runs in bf16; the vocabulary projection follows it (half of fp32's bytes).
            mode, head_dtype = "int4-cpu", torch.bfloat16
        else:
            mode, head_dtype = ("triton" if self.backend.name == "triton" else "int4-torch"), dtype
        self.linear_mode = mode
        self.formats = dict(loaded.formats)
        try:
            self.model = LlamaModel(loaded.config, loaded.weights, linear_mode=mode, dtype=dtype,
                                    device=self.device, lm_head_dtype=head_dtype)
        except KeyError as e:
            raise ConfigError(f"{loaded.source}: missing weight {e.args[0]}") from None
        self.model.linear_mode = mode

    def _kv_budget_bytes(self, spec: str | None, dtype: torch.dtype) -> int:
        if spec is None or spec == "auto":
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                return int(free * 0.9)
            # Enough for a few full contexts of this model, at most 1 GiB.
            return min(DEFAULT_CPU_KV_BUDGET, 4 * self.max_model_len * self.config.kv_bytes_per_token(dtype))
        size, frac = parse_kv_budget(spec)
        if size is not None:
            return size
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(free * frac)

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, req_id: str | None = None,
                    arrival_time: float | None = None) -> Request:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("a simulated engine takes token ids, not text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ConfigError("empty prompt")
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len}")
        if params.n > 1 and self.kv.layout != "paged":
            raise ConfigError("n > 1 shares the prompt's blocks, which needs the paged layout")
        rid = req_id or f"r{next(self._ids)}"
        req = Request(rid, ids, params.with_(n=1))
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.scheduler.add(req)
        self._register(req, params.seed)
        if params.n > 1:
            # The other samples wait for the leader's prompt, then share its blocks (fork).
            self._forks[rid] = [Request(f"{rid}.{i}", ids, params.with_(n=1), parent_id=rid,
                                        arrival_time=req.arrival_time) for i in range(1, params.n)]
            for i, child in enumerate(self._forks[rid], start=1):
                self._register(child, None if params.seed is None else params.seed + i)
        return req

    def _register(self, req: Request, seed: int | None) -> None:
        self.requests[req.req_id] = req
        if self.tokenizer is not None:
            self._detok[req.req_id] = IncrementalDetokenizer(self.tokenizer)
        self._gens[req.req_id] = torch.Generator().manual_seed(seed) if seed is not None else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, req_id: str) -> None:
        for req in [self.requests[req_id], *self._forks.pop(req_id, [])]:
            if not req.finished:
                self.scheduler.finish(req, "abort")
                if not self.simulated:
                    self.runner.drop_swapped(req.req_id)

    # --- one iteration ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        t0 = time.perf_counter()
        if self.simulated:
            result = RunnerOutput([c.req_id for c in out.chunks if c.sample], None)
        else:
            result = self.runner.execute(out)
        outputs: list[RequestOutput] = []
        decode_only = True
        for chunk in out.chunks:
            req = self.requests[chunk.req_id]
            req.num_computed_tokens += len(chunk.token_ids)
            self.kv.cache_blocks(req.req_id, req.token_slice, req.num_computed_tokens)
            if chunk.start_pos < req.num_prompt_tokens:
                decode_only = False
                self._prompt_tokens += min(req.num_prompt_tokens, chunk.start_pos + len(chunk.token_ids)) - chunk.start_pos
        now = time.perf_counter()
        for row, rid in enumerate(result.req_ids):
            req = self.requests[rid]
            logits = None if result.logits is None else result.logits[row]
            for child in self._forks.pop(rid, []):
                self._fork(req, child)
                outputs.append(self._append(child, self._sample(child, logits), now))
            outputs.append(self._append(req, self._sample(req, logits), now))
        dt = time.perf_counter() - t0
        if decode_only:
            self._decode_s += dt
            self._decode_tokens += len(result.req_ids)
        else:
            self._prefill_s += dt
        self._step += 1
        self._peak_blocks = max(self._peak_blocks, self.kv.num_blocks - self.kv.num_free_blocks)
        self._peak_shared = max(self._peak_shared, self.kv.shared_saved_blocks())
        self.metrics.record(out)
        return outputs

    def _sample(self, req: Request, logits: torch.Tensor | None) -> int:
        if logits is None:  # simulation: any token will do; lengths come from max_tokens
            return 0
        return sample(logits, req.params, self._gens[req.req_id])

    def _fork(self, leader: Request, child: Request) -> None:
        self.kv.fork(leader.req_id, child.req_id)
        child.num_computed_tokens = leader.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.scheduler.running.append(child)

    def _append(self, req: Request, tok: int, now: float) -> RequestOutput:
        req.output_token_ids.append(tok)
        req.token_times.append(now)
        if req.first_token_time is None:
            req.first_token_time = now
        self._generated += 1
        p = req.params
        reason = None
        text = ""
        if tok in p.stop_token_ids or (not p.ignore_eos and self.tokenizer is not None
                                        and tok in self.tokenizer.eos_token_ids):
            reason = "stop"
        elif self.tokenizer is not None:
            text = self._detok[req.req_id].push(tok)
            if p.stop:
                joined = req.output_text + text
                hits = [joined.find(s, max(0, len(req.output_text) - len(s))) for s in p.stop]
                hits = [h for h in hits if h >= 0]
                if hits:
                    cut = min(hits)
                    text = joined[len(req.output_text):cut] if cut >= len(req.output_text) else ""
                    req.output_text = joined[:cut]
                    reason = "stop"
            if reason is None:
                req.output_text += text
        if reason is None and (len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason:
            self.scheduler.finish(req, reason)
        return RequestOutput(req.req_id, (tok,), text, reason is not None, reason)

    # --- results and metrics --------------------------------------------------------------------------
    def completion(self, req_id: str) -> CompletionOutput:
        r = self.requests[req_id]
        ttft = None if r.first_token_time is None else r.first_token_time - r.arrival_time
        return CompletionOutput(r.req_id, r.prompt_token_ids, list(r.output_token_ids), r.output_text,
                                r.finish_reason, ttft, r.num_preemptions)

    def weight_bytes(self) -> dict[str, int]:
        return self.model.weight_bytes() if self.model is not None else {}

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def snapshot(self) -> EngineSnapshot:
        tokens = sum(r.num_computed_tokens for r in self.scheduler.running)
        return EngineSnapshot(
            step=self._step,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=self.num_blocks,
            block_size=self.kv.block_size,
            blocks_used=self.kv.num_blocks - self.kv.num_free_blocks,
            peak_blocks_used=self._peak_blocks,
            tokens_in_cache=tokens,
            bytes_per_block=self.bytes_per_block,
            kv_pool_bytes=self.kv_pool_bytes,
            weight_bytes=sum(self.weight_bytes().values()),
            prompt_tokens=self._prompt_tokens,
            generated_tokens=self._generated,
            prefill_seconds=self._prefill_s,
            decode_seconds=self._decode_s,
            num_preemptions=self.scheduler.num_preemptions,
            decode_tokens=self._decode_tokens,
            peak_shared_blocks=self._peak_shared,
        )


def _parse_dtype(name: str | None, default: torch.dtype, flag: str) -> torch.dtype:
    if name is None:
        return default
    table = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
             "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ConfigError(f"unknown --{flag} {name!r} (fp32, fp16 or bf16)")
    return table[name]

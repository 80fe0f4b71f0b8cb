"""The engine loop: schedule -> run the model -> sample -> update requests -> snapshot metrics."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from kvcli.attention.base import AttentionBackend
from kvcli.config import ModelConfig, SamplingParams
from kvcli.engine.output_processor import OutputProcessor
from kvcli.engine.outputs import CompletionOutput, RequestOutput
from kvcli.engine.request import Request
from kvcli.engine.scheduler import Scheduler
from kvcli.kvcache.block_manager import PagedKVManager, sliding_window_of
from kvcli.kvcache.hybrid import HybridKVManager
from kvcli.kvcache.kv_groups import kv_groups_of, single_group
from kvcli.kvcache.contiguous import ContiguousArena, reservation_split
from kvcli.kvcache.interface import KVLayout, blocks_for
from kvcli.kvcache.kv_cache import KVCache, bytes_per_block, usable_blocks_for_budget
from kvcli.kvcache.retention import Retention
from kvcli.metrics.collector import MetricsCollector
from kvcli.metrics.memory import keep_step_buffers_in_heap, return_freed_heap
from kvcli.metrics.snapshot import KVBreakdown, MemorySnapshot, Snapshot, SpecSummary
from kvcli.metrics.stats import EngineFacts, RequestExtent, RunStats
from kvcli.model.llama import LlamaModel, UnreadWeights
from kvcli.model.loader import LoadedWeights
from kvcli.model.tokenizer import Tokenizer
from kvcli.model.weight_plan import plan_loaded
from kvcli.native import registry
from kvcli.options import ConfigError, EngineOptions, parse_kv_budget, parse_kv_dtype
from kvcli.runner.cuda_graphs import DecodeGraphs
from kvcli.runner.model_runner import ModelRunner
from kvcli.runner.simulated_runner import SimulatedRunner
from kvcli.runner.threads import ThreadTuner
from kvcli.spec_decode.backoff import AdaptiveBackoff
from kvcli.spec_decode.draft_length import DraftLength
from kvcli.spec_decode.prompt_lookup import PromptLookupProposer

__all__ = ["ConfigError", "EngineOptions", "LLMEngine"]


DEFAULT_CPU_KV_BUDGET = 1 << 30


def available_memory(device: torch.device) -> int:
    """Bytes a KV pool could take now: free device memory on CUDA, available RAM on the host."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info["MemFree"])
    except (OSError, KeyError, ValueError, IndexError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pick_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "torch":
        from kvcli.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "invariant":  # batch-invariant rows, for bit-identical outputs across batch shapes
        if device.type != "cpu":
            raise ConfigError("--attention-backend invariant runs on the CPU only (use --device cpu)")
        from kvcli.attention.invariant_backend import InvariantAttentionBackend

        return InvariantAttentionBackend()
    if name == "triton":
        # On CPU only under Triton's interpreter (tests and debugging; about a second per launch).
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("--attention-backend triton needs a CUDA device (the CPU uses the torch path)")
        from kvcli.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ConfigError(f"unknown attention backend {name!r} (choose auto, torch, triton or invariant)")


def native_attention_available() -> bool:
    """Whether kvcli's C decode-attention kernel runs here, a fact the auto KV dtype reads (the engine, plan
    and inspect ask it here). The first ask builds the kernel."""
    return registry.library("attention") is not None


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class LLMEngine:
    """Owns the model, the KV cache, the KV layout, the scheduler and the runner. With `loaded=None`
    the engine simulates: the same scheduler and KV layout run over a SimulatedRunner (no model), so
    memory figures for big models and budgets come out exact in seconds."""

    def __init__(self, loaded: LoadedWeights | None, options: EngineOptions = EngineOptions(),
                 config: ModelConfig | None = None, model: LlamaModel | None = None) -> None:
        t_build = time.perf_counter()
        self.options = options
        self.simulated = loaded is None
        c = config if loaded is None else loaded.config
        if c is None:
            raise ConfigError("a simulated engine needs a model config")
        self.config = c
        self.tokenizer: Tokenizer | None = None if loaded is None else loaded.tokenizer
        self.source = "simulation" if loaded is None else loaded.source
        self.load_seconds = 0.0 if loaded is None else loaded.load_seconds
        self.device = torch.device("cpu") if loaded is None else options.resolve_device()
        dtype = options.compute_dtype(self.device)
        self.max_model_len = min(options.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
        self.model: LlamaModel | None = None
        self.linear_mode = "none"
        self.formats: dict[str, int] = {}
        if loaded is not None:
            self.backend = pick_backend(options.attention_backend, self.device)
            requested = parse_kv_dtype(options.kv_dtype)  # fp8 is never auto: checked before the model build
            if requested is not None and requested.name == "fp8" and self.device.type == "cuda" \
                    and self.backend.name == "triton":
                cap = torch.cuda.get_device_capability(self.device)
                if cap < (8, 9):
                    raise ConfigError(f"--kv-dtype fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper) for "
                                      f"the Triton kernels; this one is {cap[0]}.{cap[1]}: use --kv-dtype int8")
            if model is None:
                self._build_model(loaded, dtype)
            else:  # a second engine over the same weights (profile --compare), no second load
                if model.row_invariant != (self.backend.name == "invariant") and model.plan.has_row_routes:
                    raise ConfigError("a model shared by engines is planned for one attention backend: build each "
                                      "engine's own model to mix --attention-backend invariant with another")
                if self.max_model_len > model.positions:
                    raise ConfigError(f"a model shared by engines holds rotary tables for {model.positions:,} "
                                      f"positions; this engine's --max-model-len is {self.max_model_len:,}")
                self.model, self.linear_mode = model, model.linear_mode
        # The KV format, once the backend and the weight plan are known: kvcli.kvcache.kv_dtype.resolve_kv_dtype
        # decides auto.
        self.kv_dtype = options.resolve_kv_dtype(
            self.device, backend=self.backend.name if loaded is not None else None,
            quantized_weights=self.model is not None and self.model.plan.kvcli_quantized,
            native_attention=native_attention_available)

        self._build_kv()
        # CPU threads (runner/threads.py): --threads N set once; auto tuned by timing decode steps.
        self.threads = ThreadTuner.for_option(options.threads, may_tune=self.backend.name != "invariant") \
            if self.device.type == "cpu" and not self.simulated else ThreadTuner(torch.get_num_threads(), tune=False)
        self.threads.apply()
        self.output = OutputProcessor(self.tokenizer)  # detokenizers and output text, per request
        self._ids = itertools.count()
        # Run counters (the engine's own statistics, published through stats()).
        self.step_count = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.decode_tokens = 0
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        # What a user waits for: reading the file and tokenizer, then the model build (weight packing)
        # and the KV pool allocation here.
        self.load_seconds += time.perf_counter() - t_build

    def _build_kv(self) -> None:
        """The KV side, from the options: the retention rule, the KV groups, the pool (its budget, the KVCache
        on the device), the runner over it, the layout, the scheduler and the metrics' fixed figures."""
        c, options = self.config, self.options
        bs = options.block_size
        self.retention = self._retention(self.options, c)
        # KV groups (kvcache/kv_groups.py): where some layers slide and some attend to everything (Gemma 2 / 3),
        # the paged layout keeps one table per group, so the windowed layers hold only their window's blocks.
        # A bounded cache (--kv-window) bounds every layer alike, and the contiguous layout reserves every
        # layer's max-length region, as engines without per-layer caches do: one table there.
        self.kv_groups = kv_groups_of(c) if options.kv_layout == "paged" and self.retention is None \
            and options.kv_groups else single_group(c.num_layers)
        self.bytes_per_block = bytes_per_block(c, bs, self.kv_dtype, self.kv_groups)
        budget = self._kv_budget_bytes()
        num_blocks = usable_blocks_for_budget(c, bs, self.kv_dtype, budget, self.kv_groups)
        if num_blocks < 1:
            raise ConfigError(f"--kv-budget {budget:,} B holds no KV block: one block of {bs} tokens over "
                              f"{self.kv_groups.slots} layers needs {self.bytes_per_block:,} B, and the pool needs two "
                              f"(one pads block tables)")
        self.num_blocks = num_blocks
        self.kv_cache: KVCache | None = None
        if not self.simulated:
            try:
                self.kv_cache = KVCache(c, num_blocks, bs, self.kv_dtype, self.device, self.kv_groups)
            except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
                raise ConfigError(f"--kv-budget: cannot allocate {budget:,} B of KV cache on {self.device} "
                                  f"({type(e).__name__}); try a smaller budget") from None
            self.runner: ModelRunner | SimulatedRunner = ModelRunner(self.model, self.kv_cache, self.backend,
                                                                     self._decode_graphs(self.options))
        else:
            self.runner = SimulatedRunner()
        self.kv: KVLayout
        if self.kv_groups.hybrid:
            self.kv = HybridKVManager(num_blocks, bs, self.kv_groups, prefix_caching=options.prefix_caching,
                                      watermark=options.watermark)
        elif options.kv_layout == "paged":
            self.kv = PagedKVManager(num_blocks, bs, prefix_caching=options.prefix_caching,
                                     watermark=options.watermark, retention=self.retention,
                                     sliding_window=0 if self.retention else sliding_window_of(c))
        else:
            self.kv = ContiguousArena(num_blocks, bs, reserve=options.reserve, max_model_len=self.max_model_len,
                                      retention=self.retention)
        swap_blocks = options.swap_space_bytes() // self.bytes_per_block if options.preempt == "swap" else 0
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=options.max_num_seqs, max_num_batched_tokens=options.max_num_batched_tokens,
            max_model_len=self.max_model_len, preempt=options.preempt, swap_blocks=swap_blocks,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids) if self.tokenizer is not None else (),
            **self._speculation(self.options))
        self.metrics = MetricsCollector(EngineFacts(
            block_size=bs, bytes_per_block=self.bytes_per_block, kv_pool_bytes=self.kv_pool_bytes,
            token_bytes=c.kv_bytes_per_token(self.kv_dtype),
            kv_dtype=str(self.kv_dtype).removeprefix("torch."), max_model_len=self.max_model_len,
            weight_bytes=tuple(self.weight_bytes().items()), speculate=options.speculate,
            num_speculative_tokens=options.num_speculative_tokens, draft_length=options.draft_length))

    def unbounded_for_kv_groups(self) -> bool:
        """--kv-window auto on a model with KV groups (Gemma 2 / 3), before any request, for a run whose text and
        generation fit the context (continue knows it once the text is tokenized): the bounded cache's one table
        would keep every layer's tokens, the KV groups only the windows' in the windowed layers. Rebuilds the KV
        side without the bounded cache and returns True; False (nothing changed) where it does not apply."""
        if self.options.kv_window != "auto" or self.retention is None or self.scheduler.requests \
                or self.options.kv_layout != "paged" or not self.options.kv_groups or not kv_groups_of(self.config).hybrid:
            return False
        self.options = replace(self.options, kv_window=None)
        self.kv_cache = self.runner = None  # the old pool goes before the new one is allocated
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._build_kv()
        return True

    def _retention(self, options: EngineOptions, c: ModelConfig) -> Retention | None:
        """The bounded cache's rule (kvcache/retention.py), checked against this context."""
        w = options.window_tokens(self.max_model_len)
        if w is None:
            return None
        # A model whose every layer slides (Mistral) bounds its KV already, by true positions: continue's and chat's
        # default keeps that (exact). An explicit window there is the bounded cache as on any model, which must then
        # fit inside the model's own window (cache positions are compact, so every kept key, the sinks included,
        # stays in the layers' sight), and the layout releases by the retention rule alone. Where only some layers
        # slide (Gemma 2 / 3) the sliding layers see their window in cache positions, which the retention rule
        # keeps compact, and each layer's keys shift by its own rotary.
        model_window = sliding_window_of(c)
        if model_window and options.kv_window == "auto":
            return None
        r = Retention(options.sink_tokens, max(w, 1), options.block_size)
        if options.kv_window == "auto" and (w < 1 or r.max_slots > self.max_model_len):
            room = max(options.kv_window_margin, options.block_size)
            if options.kv_window_margin >= self.max_model_len > r.sink_slots + options.block_size:
                # the output alone is past a context that would hold a shorter one
                longer = (", or raise --max-model-len" if self.max_model_len < c.max_position_embeddings else "")
                raise ConfigError(f"--max-tokens {options.kv_window_margin:,} is past the {self.max_model_len:,}-token "
                                  f"context: the automatic window keeps room for the whole output beside "
                                  f"{r.sink_slots} sink slots and a window of at least 1, so at most "
                                  f"{max(0, self.max_model_len - r.sink_slots - 1):,}; lower -n, or give a window "
                                  f"(e.g. --kv-window 2048) that slides on while it generates{longer}")
            raise ConfigError(f"a {self.max_model_len:,}-token context is too short to stream a text past it: the "
                              f"bounded cache needs {r.sink_slots} sink slots (--sink-tokens {options.sink_tokens} "
                              f"in whole blocks) + room for generation ({room:,}: --max-tokens, at least one block) "
                              f"+ a window of at least 1, so {r.sink_slots + room + 1:,} tokens; raise "
                              f"--max-model-len, or pass --kv-window none to stop at the context's end")
        if w < 1 or r.max_slots > self.max_model_len:
            raise ConfigError(f"--kv-window {options.kv_window}: {r.sink_slots} sink slots (--sink-tokens "
                              f"{options.sink_tokens} in whole blocks) + the window + one block must fit the "
                              f"{self.max_model_len:,}-token context: at most "
                              f"{self.max_model_len - r.sink_slots - options.block_size + 1:,}")
        if model_window and r.max_slots > model_window:
            raise ConfigError(f"--kv-window {options.kv_window}: every layer of this model attends to its last "
                              f"{model_window:,} tokens, so {r.sink_slots} sink slots + the window + one block "
                              f"must fit in them (or the sinks fall out of sight): at most "
                              f"{max(0, model_window - r.sink_slots - options.block_size + 1):,}")
        return r

    def _decode_graphs(self, options: EngineOptions) -> DecodeGraphs | None:
        """CUDA graphs for decode steps (runner/cuda_graphs.py) where they can run: --cuda-graphs, a CUDA
        device, a backend whose decode steps can be captured (Triton)."""
        if not options.cuda_graphs or self.device.type != "cuda" or self.backend.decode_graph_key(
                1, 1, self.kv_cache.layers[0], self.config.num_heads, self.model.dtype) is None:
            return None
        return DecodeGraphs(self.model, self.kv_cache, self.backend, options.max_num_seqs,
                            blocks_for(self.max_model_len, options.block_size))

    @property
    def cuda_graphs(self) -> str:
        """How decode steps run, for the summary: CUDA graphs on (and how many), off and why, or eager."""
        graphs = getattr(self.runner, "graphs", None)
        if graphs is not None:
            return graphs.status
        if self.device.type != "cuda":
            return "n/a (CPU)"
        return "off (--no-cuda-graphs)" if not self.options.cuda_graphs else f"off ({self.backend.name} backend)"

    @staticmethod
    def _speculation(options: EngineOptions) -> dict:
        if options.speculate == "none":
            return {}
        return {"proposer": PromptLookupProposer(options.num_speculative_tokens, options.ngram_min, options.ngram_max),
                "backoff": AdaptiveBackoff(), "draft": DraftLength() if options.draft_length == "adaptive" else None}

    def _build_model(self, loaded: LoadedWeights, dtype: torch.dtype) -> None:
        """The model as the weight plan says (kvcli/model/weight_plan.py: how every weight runs, decided once)."""
        self.formats = dict(loaded.formats)
        if self.device.type == "cpu":
            keep_step_buffers_in_heap()  # prefill's MB-sized outputs reused, not page-faulted in afresh each step
        try:
            plan = plan_loaded(loaded, dequantize=self.options.dequantize, device=self.device, dtype=dtype,
                               backend=self.backend.name)
            self._check_rotary_tables(loaded.config)
            self.model = LlamaModel(loaded.config, loaded.weights, plan=plan, device=self.device,
                                    positions=self.max_model_len)
        except KeyError as e:
            raise ConfigError(f"{loaded.source}: missing weight {e.args[0]}") from None
        except UnreadWeights as e:
            raise ConfigError(f"{loaded.source}: {e}") from None
        return_freed_heap()  # the load-time forms the build freed: else RSS stays ~2x the weights
        # What the layers really run: e.g. "int4-cpu+int4x2-cpu" for a Q4_K_M file (Q6_K parts).
        self.linear_mode = self.model.linear_mode

    def _check_rotary_tables(self, c: ModelConfig) -> None:
        """The rotary tables hold every position a request can reach (max_model_len). A file may declare a context
        far past any machine's memory (2^32 tokens: 2 TiB of tables); refused in one line before anything is
        allocated, naming the flag that bounds it."""
        from kvcli.model.layers import rotary_table_bytes

        need, avail = rotary_table_bytes(c, self.max_model_len), available_memory(self.device)
        if need > avail // 4:
            flag = "a smaller --max-model-len" if self.options.max_model_len else "--max-model-len (e.g. 8192)"
            raise ConfigError(f"a {self.max_model_len:,}-token context needs {need / 2**30:,.1f} GiB of rotary tables "
                              f"(cos and sin for every position), more than a quarter of the "
                              f"{avail / 2**30:,.1f} GiB available on {self.device}: pass {flag}")

    def _kv_budget_bytes(self) -> int:
        spec = self.options.kv_budget
        if self.simulated:  # no memory is taken: any size is a valid what-if
            if spec is None or spec == "auto":
                return DEFAULT_CPU_KV_BUDGET
            size, frac = parse_kv_budget(spec)
            return size if size is not None else int(available_memory(self.device) * frac)
        avail = available_memory(self.device)
        if spec is None or spec == "auto":
            if self.device.type == "cuda":
                return int(avail * 0.9)
            # Enough for a few full contexts of this model, at most 1 GiB.
            return min(DEFAULT_CPU_KV_BUDGET, 4 * self.max_model_len * self.config.kv_bytes_per_token(self.kv_dtype),
                       int(avail * 0.5))
        size, frac = parse_kv_budget(spec)
        if size is None:
            return int(avail * frac)
        if size > avail:
            raise ConfigError(f"--kv-budget {spec} is more than the {avail / 2**30:.1f} GiB of memory available "
                              f"on {self.device} now (use a smaller size or a fraction such as 0.5)")
        return size

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, req_id: str | None = None,
                    arrival_time: float | None = None, skip_to_window: bool = False) -> Request:
        """Queue a prompt (text or token ids). Everything about how it is sampled, penalties and
        log probabilities included, is in `params`."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("a simulated engine takes token ids, not text")
            from kvcli.model.tokenizer import document_ids

            ids = document_ids(self.tokenizer, prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ConfigError("empty prompt")
        self._check_vocabulary(ids)
        if len(ids) >= self.max_model_len and self.retention is None:
            raise ConfigError(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len}")
        if params.n > 1 and not self.kv.supports_sharing:
            raise ConfigError("n > 1 shares the prompt's blocks, which needs the paged layout")
        rid = req_id or f"r{next(self._ids)}"
        # skip_to_window (a bounded cache only): compute the sinks and the last W tokens of the prompt, not the
        # tokens between (chat's turns past the window; kvcache/retention.py).
        req = Request(rid, ids, params.with_(n=1), skip_to_window=skip_to_window and self.retention is not None)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        # Further samples of the prompt get their own seeds (seed + i) and share its blocks once computed.
        forks = [Request(f"{rid}.{i}", ids, params.with_(n=1, seed=None if params.seed is None else params.seed + i),
                         parent_id=rid, arrival_time=req.arrival_time) for i in range(1, params.n)]
        self.scheduler.add(req, forks)
        for r in (req, *forks):
            self.output.add(r.req_id)
        return req

    @property
    def requests(self) -> dict[str, Request]:
        return self.scheduler.requests

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)

    def release(self, req_id: str) -> None:
        """Forget a finished request (its blocks are already free). `completion()` needs the record,
        so batch callers keep it; a long-running server releases each one as it finishes."""
        if self.scheduler.release(req_id):
            self.output.release(req_id)

    # --- one iteration ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        self.threads.apply()
        t0 = time.perf_counter()
        result = self.runner.execute(out)
        decode_only = True
        for chunk in out.chunks:
            req = self.scheduler.requests[chunk.req_id]
            if req.num_cached_tokens is None:  # its first chunk starts after the prefix-cache hit
                req.num_cached_tokens = min(chunk.start_pos, req.num_prompt_tokens)
            start = req.num_computed_tokens  # in text tokens (start_pos is a cache position under --kv-window)
            if start < req.num_prompt_tokens:
                decode_only = False
                self.prompt_tokens += min(req.num_prompt_tokens, start + len(chunk.token_ids)) - start
        new_tokens = self.scheduler.update_from_output(out, result, time.perf_counter())
        outputs, stopped = self.output.process(new_tokens, result.logprobs)
        if stopped:
            self.scheduler.finish_requests(stopped, "stop")
        dt = time.perf_counter() - t0
        self.threads.observe(decode_only and out.num_tokens > 0, out.num_tokens, len(out.chunks), dt)
        if decode_only:
            self.decode_seconds += dt
            self.decode_tokens += len(new_tokens)
            if self.scheduler.draft is not None and out.num_tokens:  # what a step of that many rows costs
                self.scheduler.draft.costs.observe(out.num_tokens, dt)
        else:
            self.prefill_seconds += dt
        self.generated_tokens += len(new_tokens)
        self.step_count += 1
        s = self.scheduler.stats()
        self.metrics.record(self.stats(), s, self.kv.stats(s.running, s.next_waiting), out.num_tokens,
                            sum(len(c.spec_token_ids) for c in out.chunks))
        return outputs

    # --- teacher forcing -------------------------------------------------------------------------------
    def score(self, token_ids: list[int], first_scored: int = 1,
              on_progress: Callable[[int], None] | None = None) -> torch.Tensor:
        """Negative log-likelihood (float64) of token_ids[first_scored:], each given every token before
        it: the sequence is prefilled in chunks of the step budget through the KV layout and the cache,
        as the scheduler would issue them, and each chunk's logits are reduced to the targets' log
        probabilities before the next chunk runs (never [tokens, vocab] for the whole text).
        `on_progress(n)` after each chunk of n tokens. The engine must be idle."""
        if self.simulated:
            raise ConfigError("a simulated engine has no model to score with")
        if self.has_unfinished():
            raise RuntimeError("score() needs an idle engine")
        if not 1 <= first_scored < len(token_ids):
            raise ConfigError(f"nothing to score: {len(token_ids)} tokens, scoring from {first_scored}")
        self._check_vocabulary(token_ids)
        if len(token_ids) > self.max_model_len and self.retention is None:
            raise ConfigError(f"{len(token_ids)} tokens do not fit the {self.max_model_len}-token context")
        if self.retention is not None:
            self.kv.peak_slots = 0  # kv_tokens_peak of this sequence, measured by the layout at each step
        req = f"score{next(self._ids)}"
        sched = self.scheduler
        if not sched.admit_scoring(req, len(token_ids)):
            raise ConfigError(self._pool_too_small(len(token_ids)))
        targets = torch.tensor(token_ids[1:], dtype=torch.int64)
        nll = []
        pos = 0
        try:
            while pos < len(token_ids):
                step = sched.schedule_scoring(req, token_ids, pos)
                if step is None:
                    raise ConfigError(self._pool_too_small(len(token_ids)))
                n = len(step.chunks[0].token_ids)
                t0 = time.perf_counter()
                logits = self.runner.execute(step, all_logits=True).logits
                rows = slice(max(pos, first_scored - 1) - pos, min(n, len(token_ids) - 1 - pos))
                if rows.start < rows.stop:
                    logp = logits[rows].float().log_softmax(-1)
                    tgt = targets[pos + rows.start:pos + rows.stop].to(logp.device)
                    nll.append(-logp.gather(1, tgt[:, None])[:, 0].double().cpu())
                self.prefill_seconds += time.perf_counter() - t0
                self.prompt_tokens += n
                pos += n
                if on_progress is not None:
                    on_progress(n)
        finally:
            sched.finish_scoring(req)
        return torch.cat(nll)

    # --- results and statistics ----------------------------------------------------------------------
    def completion(self, req_id: str) -> CompletionOutput:
        """A request's result; a prompt sampled n > 1 times carries its forks (`{id}.1`, ...) in .samples."""
        r = self.scheduler.requests[req_id]
        ttft = None if r.first_token_time is None else r.first_token_time - r.arrival_time
        forks = []
        while r.parent_id is None and f"{req_id}.{len(forks) + 1}" in self.scheduler.requests:
            forks.append(self.completion(f"{req_id}.{len(forks) + 1}"))
        return CompletionOutput(r.req_id, r.prompt_token_ids, list(r.output_token_ids), self.output.text(req_id),
                                r.finish_reason, ttft, r.num_preemptions, tuple(forks))

    def output_text(self, req_id: str) -> str:
        """A request's text so far (cut before a stop string); "" without a tokenizer."""
        return self.output.text(req_id)

    def weight_bytes(self) -> dict[str, int]:
        return self.model.weight_bytes() if self.model is not None else {}

    def _check_vocabulary(self, ids: Sequence[int]) -> None:
        """Token ids the model has embeddings for: a tokenizer with tokens added past the embedding table (added
        without resizing it) gives ids the model cannot read. (A simulated engine's ids are placeholders.)"""
        if self.simulated:
            return
        top, low = max(ids), min(ids)
        if top >= self.config.vocab_size or low < 0:
            bad = top if top >= self.config.vocab_size else low
            what = ""
            if self.tokenizer is not None:
                try:
                    what = f" ({self.tokenizer.decode([bad])!r})"
                except Exception:
                    what = ""
            raise ConfigError(f"token id {bad}{what} is outside the model's {self.config.vocab_size:,}-token vocabulary "
                              "(its tokenizer has tokens the model has no embeddings for)")

    def _pool_too_small(self, tokens: int) -> str:
        """perplexity's refusal when its text does not fit the pool: how much does, and what to change."""
        return (f"--kv-budget: the KV pool holds {self.request_capacity:,} tokens of one sequence, not {tokens:,}: "
                "raise --kv-budget, or score in windows (--window / --stride) or through a bounded cache (--kv-window)")

    @property
    def request_capacity(self) -> int:
        """The most tokens one request can reach with the pool to itself (at most max_model_len): a request whose
        prompt plus max_tokens is longer cannot finish, whatever else runs; the scheduler would cut it short with
        finish reason "length". The KV layout's own admission rule decides (a bounded cache's window, a sliding
        window's blocks, contiguous regions)."""
        lo, hi = 0, self.max_model_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.kv.blocks_to_admit(mid, mid) <= self.kv.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def kv_pool_bytes(self) -> int:
        """The KV cache's memory: the usable blocks and the null block."""
        return (self.num_blocks + 1) * self.bytes_per_block

    def stats(self) -> RunStats:
        on_cpu = self.device.type == "cpu" and not self.simulated
        return RunStats(step=self.step_count, prompt_tokens=self.prompt_tokens,
                        generated_tokens=self.generated_tokens, decode_tokens=self.decode_tokens,
                        prefill_seconds=self.prefill_seconds, decode_seconds=self.decode_seconds,
                        cpu_threads=self.threads.current if on_cpu else 0, threads_auto=self.threads.tune,
                        thread_switches=self.threads.switches)

    def snapshot(self, memory: MemorySnapshot | None = None, *, block_map: bool = False) -> Snapshot:
        """The one record views read; the block map and a memory probe only when asked for."""
        sched = self.scheduler
        s = sched.stats()
        kv = self.kv.stats(s.running, s.next_waiting)
        whatif = None
        if kv.layout == "paged":
            whatif = contiguous_whatif(s.running, kv.num_blocks * self.bytes_per_block, kv.block_size,
                                       self.max_model_len, self.config.kv_bytes_per_token(self.kv_dtype))
        return self.metrics.snapshot(self.stats(), s, kv, sched.spec_stats(), sched.request_timings(), whatif=whatif,
                                     blocks=self.kv.block_map(s.running) if block_map else None, memory=memory)

    def spec_summary(self) -> SpecSummary:
        """Speculative decoding so far, as the views show it."""
        return self.metrics.spec_summary(self.scheduler.spec_stats())


def contiguous_whatif(running: Sequence[RequestExtent], pool_bytes: int, block_size: int, max_model_len: int,
                      token_bytes: int) -> tuple[KVBreakdown, int]:
    """The given live requests under max-length contiguous preallocation in a pool of the same bytes (every
    layer's K/V for each reserved token: `token_bytes`), and how many max-length regions that pool holds."""
    region = blocks_for(max_model_len, block_size) * block_size
    tokens = reserved = internal = 0
    for r in running:
        res, inter = reservation_split(region, r.num_tokens, r.final_tokens)
        tokens += r.num_tokens
        reserved += res
        internal += inter
    used = (tokens + reserved + internal) * token_bytes
    return KVBreakdown(tokens * token_bytes, reserved * token_bytes, internal * token_bytes, 0,
                       max(0, pool_bytes - used)), pool_bytes // (region * token_bytes)

"""The engines a figure compares, behind one small interface, on the same weights and the same token ids.

  KvcliEngine      kvcli in process (kvcli.llm.LLM)
  HFEngine         transformers `generate` on the same GGUF, dequantized to fp32 by its GGUF loader
  LlamaCppEngine   llama.cpp (llama-cpp-python built by scripts/build_llama_cpp.sh) in its own process:
                   kvcli/bench/llama_cpp_worker.py, a JSON job in, one JSON result out (kvcli/bench/llama_cpp_runner.py)

Interface (batch 1, greedy, EOS ignored):
  generate(ids, n)    one whole generation of n tokens (for figures timing whole calls)
  timed(ids, m)       (seconds to the first token, seconds from it to the last) inside ONE generation of m tokens
  weight_bytes()      resident bytes of the weights
llama.cpp's worker runs whole jobs (a process per round); `timed_many` gives its per-context times.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Engine:
    name = "engine"

    def generate(self, ids: Sequence[int], n: int) -> None:
        raise NotImplementedError

    def timed(self, ids: Sequence[int], m: int) -> tuple[float, float]:
        raise NotImplementedError

    def weight_bytes(self) -> int:
        return 0


class KvcliEngine(Engine):
    """kvcli.llm.LLM with the given options (prefix caching off by default: a warm-up would otherwise leave
    the prompt cached, and every later run would prefill a few tokens where the others prefill all)."""

    name = "kvcli"

    def __init__(self, name: str = "kvcli", **opts) -> None:
        from kvcli.llm import LLM

        opts.setdefault("prefix_caching", False)
        self.name = name
        self.llm = LLM(**opts)
        self.tokenizer = self.llm.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenizer.encode(text)

    def generate(self, ids: Sequence[int], n: int) -> None:
        from kvcli.config import SamplingParams

        self.llm.generate([list(ids)], SamplingParams(max_tokens=n, ignore_eos=True))

    def timed(self, ids: Sequence[int], m: int) -> tuple[float, float]:
        from kvcli.config import SamplingParams

        eng = self.llm.engine
        t0 = time.perf_counter()
        eng.add_request(list(ids), SamplingParams(max_tokens=m, ignore_eos=True))
        first = None
        while eng.has_unfinished():
            outs = eng.step()
            if first is None and any(o.new_token_ids for o in outs):
                first = time.perf_counter()
        assert first is not None
        return first - t0, time.perf_counter() - first

    def weight_bytes(self) -> int:
        return sum(self.llm.engine.weight_bytes().values())

    @property
    def linear_mode(self) -> str:
        return self.llm.engine.linear_mode

    @property
    def kv_dtype(self) -> str:
        return self.llm.engine.kv_dtype.name


class HFEngine(Engine):
    """transformers `generate`, greedy, EOS off, on the bundled GGUF (or `path`) dequantized to fp32."""

    name = "transformers"

    def __init__(self, path=None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        from kvcli.model.loader import bundled_gguf_path

        path = path or bundled_gguf_path()
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()
        self.model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)

    def _run(self, ids: Sequence[int], n: int, streamer=None) -> None:
        x = self.torch.tensor([list(ids)])
        with self.torch.inference_mode():
            self.model.generate(x, attention_mask=self.torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, streamer=streamer)

    def generate(self, ids: Sequence[int], n: int) -> None:
        self._run(ids, n)

    def timed(self, ids: Sequence[int], m: int) -> tuple[float, float]:
        stamps: list[float] = []  # put() gets the prompt first, then each new token

        class Clock:
            def put(self, _value) -> None:
                stamps.append(time.perf_counter())

            def end(self) -> None:
                pass

        t0 = time.perf_counter()
        self._run(ids, m, Clock())
        return stamps[1] - t0, stamps[-1] - stamps[1]

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


class LlamaCppEngine(Engine):
    """llama.cpp through its worker process; `available` is False (with `note`) where it is not built."""

    name = "llama.cpp"

    def __init__(self, isa: str | None = None, threads: int | None = None, path=None) -> None:
        from kvcli.bench import llama_cpp_runner as llama_cpp
        from kvcli.model.loader import bundled_gguf_path

        self.isa = isa or llama_cpp.bench_isa()
        self.path = str(path or bundled_gguf_path())
        if threads is None:
            import torch

            threads = torch.get_num_threads()
        self.threads = threads
        self.note = ""
        self.version = ""
        self.available = llama_cpp.python_for(self.isa) is not None
        if not self.available:
            self.note = llama_cpp.not_built_note(self.isa)

    def job(self, job: dict) -> dict | None:
        """Run one worker job; None (and `note`, `available` False) when it fails."""
        from kvcli.bench import llama_cpp_runner as llama_cpp

        job = {"model": self.path, "threads": self.threads, **job}
        res, note = llama_cpp.run(job, self.isa)
        if res is None:
            self.note, self.available = note, False
            return None
        self.version = (f"llama.cpp: llama-cpp-python {res['llama_cpp_version']}; "
                        f"{res['system_info'].strip()}")
        return res

    def timed_many(self, prompt_ids: Sequence[int], contexts: Sequence[int], m: int,
                   repeats: int = 1) -> dict[int, tuple[float, float]] | None:
        """{context: (prefill seconds, seconds of the m decode calls)}: one worker process, warmed up on
        each context first."""
        res = self.job({"contexts": list(contexts), "new_tokens": m, "repeats": repeats,
                        "prompt_ids": list(prompt_ids[:max(contexts)])})
        if res is None:
            return None
        return {r["context"]: (r["context"] / r["prefill_tok_s"], m / r["decode_tok_s"]) for r in res["batch1"]}

    def trace(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], parallel: int,
              n_ctx: int) -> dict | None:
        res = self.job({"parallel": parallel, "n_ctx": n_ctx,
                        "trace": [{"prompt": list(p), "max_tokens": m} for p, m in zip(prompts, max_tokens)]})
        return None if res is None else {**res["trace"], "llama_cpp_version": res["llama_cpp_version"]}

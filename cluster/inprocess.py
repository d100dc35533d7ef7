"""The `local` launcher: a stage call runs in the driver's own process, so models stay warm
between iterations (`rlpipe.cluster.launchers` for the others)."""

from __future__ import annotations

import sys

from rlpipe.schemas import Manifest
from rlpipe.stages import StageCall, get_stage


class InProcessLauncher:
    """The local launcher: the stage runs in this process. Before a training stage ('ranks'
    scaling) a vLLM engine a rollout left in this process makes room: on GPUs it sleeps (weights
    and KV cache freed, so optimize gets the memory) and the next rollout wakes it and loads the new
    policy in place (`rlpipe.stages.rollout.vllm_engine.make_room`)."""

    def __call__(self, call: StageCall, *, force: bool = False) -> Manifest:
        if get_stage(call.name).scaling == "ranks":
            make_room_here()
        return get_stage(call.name).run(call.config, force=force)

    def close(self, *, wait: bool = False) -> None:
        pass


def make_room_here() -> str:
    """Free the GPU memory of the vLLM engine a rollout left in this process, for a training stage
    on the same GPUs (`rlpipe.stages.rollout.vllm_engine.make_room`: 'slept', 'released', 'kept');
    'none' when no rollout here imported vLLM (nothing is imported to find out). Called by the
    in-process launcher and by resident members on a make-room order (`launch.share_gpus`)."""
    engine = sys.modules.get("rlpipe.stages.rollout.vllm_engine")
    return "none" if engine is None else engine.make_room()


run_in_process = InProcessLauncher()

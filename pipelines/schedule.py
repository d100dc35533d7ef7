"""Asynchronous iterations, overlapped: with `async: {staleness: S}` rollout k samples from the
policy optimize k-1-S wrote (pipelines/plan.py), so once that policy exists, rollout k, its score,
reference and advantage can run while optimize k-1, ..., k-S train.

Two lanes run the iterations' calls, each in order:

    lane A (the driver's thread):  [wait for optimize k-1-S; finish k-1-S] rollout k, score k, ..., advantage k
    lane B (a thread):             [wait for lane A's k] optimize k

"finish" is everything after an iteration's optimize: its evaluation (in lane A, which runs every
in-process stage, so no two in-process stages ever run at once), its record, the report and the
prune. Lane B only calls optimize, which must run in processes of its own for this schedule
(`Pipeline.overlaps`); so at most S iterations of lane A are ahead of optimize.

The schedule decides when a stage runs, never what it computes: each call's config is the plan's,
whatever the timing, so an overlapped run and the same preset run in order give the same
artifacts, and a killed one resumes to them.
"""

from __future__ import annotations

import contextvars
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlpipe.pipelines.runner import Pipeline
    from rlpipe.stages import StageCall

#: How often a waiting lane looks for the other lane's failure (s).
_LOOK_S = 0.1


class _LaneB:
    """Lane B: optimize k once lane A has handed it over; a failure is kept for lane A to raise."""

    def __init__(self, pipeline: Pipeline, iterations: int):
        self.pipeline = pipeline
        self.calls: dict[int, StageCall] = {}
        self.seconds: dict[int, dict[str, float]] = {}
        self.handed = [threading.Event() for _ in range(iterations)]
        self.trained = [threading.Event() for _ in range(iterations)]
        self.stop = threading.Event()
        self.error: BaseException | None = None
        # (a copy of the driver's context: a Prefect flow's run context reaches the tasks it calls)
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run,),
                                       name="rlpipe-lane-optimize", daemon=True)

    def _run(self) -> None:
        try:
            for k in range(len(self.handed)):
                while not self.handed[k].wait(_LOOK_S):
                    if self.stop.is_set():
                        return
                self.pipeline.execute(self.calls[k], self.seconds[k])
                self.trained[k].set()
        except BaseException as e:
            self.error = e

    def wait_trained(self, k: int) -> None:
        """Until optimize k is done; its failure is raised here."""
        while not self.trained[k].wait(_LOOK_S):
            alive = self.thread.is_alive()  # (looked at first: an error set as it ends is seen below)
            if self.error is not None:
                raise self.error
            if not alive:
                raise RuntimeError(f"the optimize lane stopped before iteration {k}")


def run_overlapped(pipeline: Pipeline) -> None:
    """Run the iterations of `pipeline` in two lanes (see the module doc)."""
    n, S = pipeline.preset.iterations, pipeline.plan.staleness
    lane = _LaneB(pipeline, n)
    evaluations: dict[int, list[StageCall]] = {}

    def finish(j: int) -> None:
        lane.wait_trained(j)
        for call in evaluations.pop(j):
            pipeline.execute(call, lane.seconds[j])
        pipeline.finish(j, lane.seconds[j])

    lane.thread.start()
    try:
        for k in range(n):
            if k - 1 - S >= 0:
                finish(k - 1 - S)  # its policy is the one rollout k samples from
            calls = pipeline.plan.iteration(k)
            seconds: dict[str, float] = {}
            for call in calls:
                if call.name not in ("optimize", "evaluate"):
                    pipeline.execute(call, seconds)
            (optimize,) = [c for c in calls if c.name == "optimize"]
            evaluations[k] = [c for c in calls if c.name == "evaluate"]
            lane.calls[k], lane.seconds[k] = optimize, seconds
            lane.handed[k].set()
        for j in sorted(evaluations):
            finish(j)
    except BaseException:
        lane.stop.set()
        # Optimize may be mid-call on its resident workers (runs overlap only then, Pipeline.overlaps):
        # stopping the launcher's groups ends that call.
        pipeline.launcher.close()
        lane.thread.join()
        raise
    lane.thread.join()

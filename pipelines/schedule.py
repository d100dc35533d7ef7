"""Asynchronous iterations, overlapped: with `async: {staleness: S}` rollout k samples from the
policy optimize k-1-S wrote (pipelines/plan.py), so once that policy exists, rollout k, its score,
reference and advantage can run while optimize k-1, ..., k-S train.

Two lanes run the iterations' calls, each in order:

    driver lane (the driver's thread):  [wait for optimize k-1-S; finish k-1-S] rollout k, score k, ..., advantage k
    optimize lane (a thread):           [wait for the driver lane's k] optimize k

"finish" is everything after an iteration's optimize: its evaluation (in the driver lane, which
runs every in-process stage, so no two in-process stages ever run at once), its record, the report
and the prune. The optimize lane only calls optimize, which must run in processes of its own for
this schedule (`Pipeline.overlaps`); so at most S iterations of the driver lane are ahead of
optimize.

The schedule decides when a stage runs, never what it computes: each call's config is the plan's,
whatever the timing, so an overlapped run and the same preset run in order give the same
artifacts, and a killed one resumes to them. It runs the calls it is given with what the runner
gives it (`Pipeline.execute`, `Pipeline.finish`, ...), never the runner itself.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable

from rlpipe.schemas import Manifest
from rlpipe.stages import StageCall

#: Runs one stage call, adding its time to the iteration's seconds (`Pipeline.execute`).
Execute = Callable[[StageCall, dict[str, float]], Manifest]

#: How often a waiting lane looks for the other lane's failure (s).
_LOOK_S = 0.1


class _OptimizeLane:
    """The optimize lane: optimize k once the driver lane has handed it over; a failure is kept
    for the driver lane to raise."""

    def __init__(self, execute: Execute, iterations: int):
        self.execute = execute
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
                self.execute(self.calls[k], self.seconds[k])
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


def run_overlapped(iterations: int, staleness: int, *, calls: Callable[[int], list[StageCall]],
                   execute: Execute, finish: Callable[[int, dict[str, float]], None],
                   interrupt: Callable[[], None]) -> None:
    """Run `iterations` iterations in two lanes (see the module doc).

    Args:
        staleness: S of `async: {staleness: S}`.
        calls: iteration k's stage calls, in order (`Plan.iteration`).
        execute: runs one call, adding its time to the seconds given (`Pipeline.execute`).
        finish: iteration k is complete, with its seconds (`Pipeline.finish`).
        interrupt: ends the optimize call under way, on a failure of the driver lane (stops the
            launcher's resident groups).
    """
    n, S = iterations, staleness
    lane = _OptimizeLane(execute, n)
    evaluations: dict[int, list[StageCall]] = {}

    def finish_iteration(j: int) -> None:
        lane.wait_trained(j)
        for call in evaluations.pop(j):
            execute(call, lane.seconds[j])
        finish(j, lane.seconds[j])

    lane.thread.start()
    try:
        for k in range(n):
            if k - 1 - S >= 0:
                finish_iteration(k - 1 - S)  # its policy is the one rollout k samples from
            iteration = calls(k)
            seconds: dict[str, float] = {}
            for call in iteration:
                if call.name not in ("optimize", "evaluate"):
                    execute(call, seconds)
            (optimize,) = [c for c in iteration if c.name == "optimize"]
            evaluations[k] = [c for c in iteration if c.name == "evaluate"]
            lane.calls[k], lane.seconds[k] = optimize, seconds
            lane.handed[k].set()
        for j in sorted(evaluations):
            finish_iteration(j)
    except BaseException:
        lane.stop.set()
        # Optimize may be mid-call on its resident workers (runs overlap only then, Pipeline.overlaps):
        # stopping the launcher's groups ends that call.
        interrupt()
        lane.thread.join()
        raise
    lane.thread.join()

"""A resident worker: one member of a placed stage's worker group, alive for the whole run.

    python -m rlpipe.cluster.worker --group runs/<run>/workers/<stage>-<token> [--member I --members N]

The launchers start it (N local processes, torchrun ranks, one srun step, a Kubernetes Job, a
Prefect flow run; `rlpipe.cluster.resident`). It takes the group's work orders in turn
(`rlpipe.cluster.workorders`), runs each exactly as `rlpipe stage <name> -c <saved config>`
would, in this process, so engines stay warm between iterations (a rollout engine loads each new
policy in place, optimize keeps its DeepSpeed engines, fp32 masters and AdamW moments), and
answers with the exit code. The artifact's manifest stays the completion signal: memory is only a
cache of what the files say, so killing every worker and rerunning gives the same artifacts.

Each order's output goes to the log the order names (`runs/<run>/logs/<iter>/<stage>[.<i>].log`,
as a per-call launch writes it); the worker's own output (start-up, between orders) to the log its
launcher gave it (`runs/<run>/logs/workers/`). A failed order ends the worker with the stage's exit
code (2: a user error, 1: a bug; 143 when a SIGTERM from outside interrupted it): the driver starts
a fresh group for the next call. A member its scheduler starts again (a pod, a task) goes on from
the first order it has not answered. A watchdog thread ends the worker when the driver is gone or
has abandoned the group (`DriverWatch`), so no worker outlives its run.

Identity: `--member/--members` when given (worker processes, srun tasks and pods of 'shards'
stages), else the rank and world size of a multi-rank launch (torchrun, srun), else 0 of 1.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlpipe.cluster.workorders import (
    POLL_S,
    Doorbell,
    DriverWatch,
    GroupDir,
    read_json,
    this_process,
)
from rlpipe.stages import get_stage
from rlpipe.stages.common.interrupt import exit_on_signals
from rlpipe.stages.common.log import configure_logging

_log = logging.getLogger("rlpipe.cluster.worker")  # (not __name__: run as __main__)

#: Seconds between a member's heartbeats (and its looks at the driver).
BEAT_S = 1.0
#: After the watchdog's SIGTERM, seconds to unwind before the process is ended regardless
#: (a main thread blocked in a collective never runs the signal handler).
GRACE_S = 10.0


def identity(member: int | None, members: int | None) -> tuple[int, int]:
    """(member, members) from the arguments, else the multi-rank launch's RANK / WORLD_SIZE."""
    from rlpipe.stages.common.distributed import launched_env

    if member is not None and members is not None:
        return member, members
    launched = launched_env()
    if launched is not None:
        return int(launched["RANK"]), int(launched["WORLD_SIZE"])
    return 0, 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlpipe.cluster.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", type=Path, required=True, help="the group's folder (runs/<run>/workers/...)")
    p.add_argument("--member", type=int, help="this worker's index (default: the launch's rank)")
    p.add_argument("--members", type=int, help="the group's size (default: the launch's world size)")
    a = p.parse_args(argv)
    from rlpipe.stages.common.allocator import keep_freed_memory
    from rlpipe.stages.common.background import allow_background
    from rlpipe.stages.common.cli import own_cache_dirs
    from rlpipe.stages.common.models import keep_saved_checkpoints

    own_cache_dirs()
    keep_saved_checkpoints(False)  # this process serves one stage: no later stage reads its checkpoints
    allow_background()  # a train state is written while the run goes on; waited for at the next order, or the stop
    malloc = keep_freed_memory()  # (each order would otherwise fault in its step's memory afresh)
    group = GroupDir(a.group.absolute())
    member, members = identity(a.member, a.members)
    stage = group.info["stage"]
    # every member, a rank of one job too, writes its orders' output to a log of its own
    configure_logging(all_ranks=True)
    group.member_started(member, {**this_process(), "time": time.time()})
    _log.info(f"[rlpipe worker {stage}.{member}] pid {os.getpid()} on host {socket.gethostname()} serving {group.path}; "
              f"malloc {malloc}")
    threading.Thread(target=_watchdog, args=(group, member), daemon=True, name="rlpipe-watchdog").start()
    try:
        with exit_on_signals(f"worker {stage}.{member}"):
            _import_stage(stage)
            if group.info.get("weight_channel") and get_stage(stage).weights == "receive":
                from rlpipe.stages.common.channel_end import (
                    CHANNEL,  # (torch: imported with the stage)
                )

                CHANNEL.receive(group.path.parent, group.path.name, member)  # (joins once optimize sends)
            group.member_ready(member)
            return serve(group, stage, member, members)
    finally:
        with contextlib.suppress(OSError):  # (the group's folder removed by its driver)
            group.member_exited(member)


def _import_stage(stage: str) -> None:
    """Import the stage's modules (torch, transformers, ...) before the first order: seconds of
    silent work that the driver's stall timeout does not count (it starts once every member is
    ready), and that the first order then does not pay."""
    import importlib

    started = time.perf_counter()
    importlib.import_module(f"{get_stage(stage).module}.run")
    _log.info(f"[rlpipe worker {stage}] ready ({time.perf_counter() - started:.1f} s of imports)")


def serve(group: GroupDir, stage: str, member: int, members: int) -> int:
    """Take the orders in turn, from the first one this member has not answered (a restarted
    member: a pod or task its scheduler started again), until a stop order (0) or a failed one
    (its exit code). The ranks of one job take every order together: they go on from the first
    order one of them has not answered."""
    from rlpipe.stages.common.background import BACKGROUND, wait_for_background

    # a write in the background that fails (a full disk) is the driver's to know at once: it may be
    # waiting for that artifact (the policy this member answered with), not for this member
    BACKGROUND.on_failure.append(lambda what, error: group.background_failed(member, what, error))
    together = list(range(members)) if get_stage(stage).scaling == "ranks" else [member]
    seq = group.first_unanswered(together)
    if seq > 1:
        _log.info(f"[rlpipe worker {stage}.{member}] restarted: going on from order {seq}")
    bell = group.bell(member).listen()
    try:
        while True:
            order = _next_order(group, seq, bell)
            if order.get("stop"):  # answered too: the driver learns whether the last background save failed
                code = _finish_background(wait_for_background)
                group.answer(seq, member, {"exit_code": code, "pid": os.getpid(), "seconds": 0.0})
                return code
            started = time.perf_counter()
            with _profiled(f"{stage}.{member}.{seq}"):
                code, writing = ((make_room(stage, order, member), {}) if order.get("make_room")
                                 else run_order(stage, order, member, members))
            group.answer(seq, member, {"exit_code": code, "pid": os.getpid(),
                                       "seconds": round(time.perf_counter() - started, 3),
                                       **({"writing": writing} if writing else {})})
            if code != 0:
                return code
            seq += 1
    finally:
        bell.close()


@contextlib.contextmanager
def _profiled(name: str) -> Iterator[None]:
    """With RLPIPE_PROFILE_DIR set (a contributor's knob, docs/contributing.md), each order runs
    under cProfile and its statistics go to `<dir>/<stage>.<member>.<order>.prof`."""
    folder = os.environ.get("RLPIPE_PROFILE_DIR")
    if not folder:
        yield
        return
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            profile.dump_stats(Path(folder) / f"{name}.prof")
        except OSError as e:  # (a profile that cannot be written does not fail the order)
            _log.warning(f"[rlpipe worker] RLPIPE_PROFILE_DIR: could not write {name}.prof in {folder}: {e}")


def _finish_background(wait: Any) -> int:
    """Wait for what this worker writes in the background (the last train state); its exit code:
    0, or the failure's as a stage would report it (2 for a full disk, 1 for a bug)."""
    from rlpipe.stages.common.cli import report_failure

    try:
        wait()
        return 0
    except Exception as e:
        return report_failure(e, False, lambda text: print(text, file=sys.stderr, flush=True))


def _next_order(group: GroupDir, seq: int, bell: Doorbell) -> dict[str, Any]:
    while (order := read_json(group.order_file(seq))) is None:
        bell.wait(POLL_S)  # (rung by the driver's order: at once on its machine)
    return order


def run_order(stage: str, order: dict[str, Any], member: int, members: int) -> tuple[int, dict[str, str]]:
    """Run the stage on the order's saved config, as its command line would; returns the exit code
    and the outputs it is still writing in the background (`_still_writing`). A sending stage's
    order names the receiving group (`weight_channel`): rank 0 sends the new policy to it; a
    receiving member first takes the checkpoints that came over the channel."""
    from rlpipe.stages.common.channel_end import CHANNEL
    from rlpipe.stages.common.cli import run_stage, stage_main

    to = order.get("weight_channel")  # {"folder": runs/<run>/workers, "group": its name, "members": N}
    CHANNEL.order_sends_to(Path(to["folder"]) if to else None, (to["members"], to["group"]) if to else None, member)
    overrides = ([f"worker_index={member}", f"worker_count={members}"]
                 if get_stage(stage).scaling == "shards" and members > 1 else [])
    force = bool(order.get("force"))
    with _output_to(Path(order["logs"][str(member)])):
        _log.info(f"[rlpipe worker {stage}.{member}] pid {os.getpid()}: -c {order['config_file']} "
                  f"{' '.join(overrides)}{' --force' if force else ''}")
        try:
            config = _config(stage, order["config_file"], overrides)
            if config is None:  # (its command line reports why, exit code 2)
                return stage_main(stage, ["-c", order["config_file"], *overrides, *(["--force"] if force else [])]), {}
            if CHANNEL.receiver is not None:
                CHANNEL.take(_checkpoint_inputs(config))
            code = run_stage(stage, config, force=force)
            return code, _still_writing(stage, config) if code == 0 else {}
        except SystemExit as e:  # the stage's SIGINT / SIGTERM exit (130 / 143)
            return (0 if e.code is None else e.code if isinstance(e.code, int) else 1), {}
        except BaseException:  # a bug: the traceback goes to the order's log, as a launched stage's would
            traceback.print_exc()
            return 1, {}


def _config(stage: str, config_file: str, overrides: list[str]) -> Any:
    """The order's saved config, parsed once for the whole order (None: it does not parse)."""
    from rlpipe.schemas.config_files import load_config
    from rlpipe.schemas.errors import UserError

    try:
        return load_config(get_stage(stage).config_class(), config_file, overrides)
    except (UserError, OSError):
        return None


def _checkpoint_inputs(config: Any) -> list[Path]:
    """The checkpoints the order's stage reads (the policy a rollout samples from)."""
    return [Path(p) for name, p in config.inputs().items() if config.input_kind(name) == "checkpoint"]


def _still_writing(stage: str, config: Any) -> dict[str, str]:
    """The order's outputs this process is still writing in the background whose manifest is
    decided (path -> manifest JSON): the policy sent over the weight channel. The driver knows
    them by these manifests until their files are complete (schemas/pending.py)."""
    from rlpipe.schemas.pending import pending_manifest

    if get_stage(stage).weights != "send":
        return {}
    decided = {str(p): pending_manifest(p) for p in config.outputs().values()}
    return {p: m.model_dump_json() for p, m in decided.items() if m is not None}


def make_room(stage: str, order: dict[str, Any], member: int) -> int:
    """A make-room order (`launch.share_gpus`, before a training stage on this member's GPUs): free
    the GPU memory this process's engine holds, as the in-process launcher does before one (a vLLM
    engine sleeps; the next rollout order wakes it with the new policy). Returns the exit code."""
    from rlpipe.cluster.inprocess import make_room_here

    with _output_to(Path(order["logs"][str(member)])):
        try:
            did = make_room_here()
        except BaseException:  # (a bug: its traceback in the log, as a failed order's)
            traceback.print_exc()
            return 1
        _log.info(f"[rlpipe worker {stage}.{member}] made room for training on its GPUs: {did}")
        return 0


@contextlib.contextmanager
def _output_to(log: Path) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so native libraries'
    output too) to `log` for the block, appended (the ranks of a group share one log)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def _watchdog(group: GroupDir, member: int) -> None:
    """Beat, and end this process once the driver is gone: SIGTERM (unwinds like Ctrl-C, nothing
    partial stays), then a hard exit after GRACE_S."""
    watch, count = DriverWatch(group), 0
    while True:
        count += 1
        with contextlib.suppress(OSError):  # a run folder being removed after the run
            group.beat(count, member)
        why = watch.gone()
        if why is not None:
            _log.warning(f"[rlpipe worker] {why}: leaving")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(GRACE_S)
            os._exit(1)
        time.sleep(BEAT_S)


if __name__ == "__main__":
    from rlpipe.stages.common.cli import exit_process

    exit_process(main())

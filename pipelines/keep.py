"""What a run keeps on disk: the preset's `keep:` section, and the rule that picks what goes.

    keep:
      train_states: 2          # the last N complete train states
      checkpoints_every: 10    # the policy (and critic) of every M-th iteration (0: none by period)
      best: accuracy           # and of the best held-out evaluation by this metric (null: none)
      tables: true             # rollouts, scores, reference, advantages (small): all kept

An iteration writes a policy checkpoint (and a critic, PPO) and a train state (fp32 masters and
AdamW moments: ~12 bytes per parameter); kept forever they fill any disk (~115 GB per iteration
at 7B). After every iteration the runner deletes what the rule no longer keeps (`prune_run`), each
deletion logged with its size; `rlpipe prune RUN [--dry-run]` applies it to a run directory.

Never deleted, whatever the setting, because a resume, an extension or a replay reads it: the last
iteration's policy and critic (the next iteration starts from them), the last complete train state
and every checkpoint after it (a resumed run replays those optimize steps when `state_every` > 1,
and their tables with them), the set-up artifacts (models/, data/), evaluations and optimize
metrics, and anything incomplete. An artifact goes only once the one that supersedes it is
complete: train states count only complete ones, so one being written keeps its predecessors.
A policy this process is still writing in the background (its manifest decided: `schemas.pending`)
counts as the last one: killed before it lands, the run reruns its optimize from what stays for a
complete one (its input policy, its tables, the state and replays before it), and a train state
never lands before the policy of its iteration (background saves finish in order). So what is
pruned after iteration k does not depend on how fast policy k reaches the disk.
A pruned artifact leaves its record (`rlpipe.schemas.pruning`): the run resumes and extends past
it as cache hits, and only a stage that must recompute from it fails, naming it and this section.

Order of deletion (`prune_artifact`), so that a crash anywhere leaves a complete artifact or a
pruned one, never something that looks like either but is not: the record is written (atomically)
into the directory, then the manifest is removed, then the other files.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from rlpipe.schemas.atomic import atomic_write_bytes
from rlpipe.schemas.errors import UserError
from rlpipe.schemas.manifest import MANIFEST_NAME
from rlpipe.schemas.pending import pending_manifest
from rlpipe.schemas.pruning import PRUNED_NAME, Pruned
from rlpipe.schemas.reading import exists, read_manifest
from rlpipe.schemas.runs import iteration_dirs

_log = logging.getLogger(__name__)

#: Table artifacts of an iteration that `tables: false` prunes (metrics and evaluations stay: the
#: report reads them).
TABLES = ("rollouts", "scores", "filtered_scores", "reference", "advantages")
#: Checkpoints of an iteration that the policy rule prunes.
CHECKPOINTS = ("policy", "critic")


class Keep(BaseModel):
    """Which artifacts of a run stay on disk (see the module doc for what always stays)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    train_states: int | None = Field(2, ge=1)
    """The last N complete train states (optimize's fp32 masters, AdamW moments, LR schedule);
    null: every one."""
    checkpoints_every: int = Field(10, ge=0)
    """Keep the policy and critic checkpoints of every M-th iteration (iterations M-1, 2M-1, ...,
    counted from 0; 1: every one); 0: none by period (the last and the best still stay)."""
    best: str | None = "accuracy"
    """Keep the policy and critic of the iteration whose held-out evaluation scored highest on
    this metric of the evaluate stage (accuracy, reward_mean, ...); null: none."""
    tables: bool = True
    """Keep every iteration's rollouts, scores, reference and advantages (a few MB each); false:
    only those a resumed run replays."""


@dataclass(frozen=True)
class Deletion:
    """An artifact the rule deletes now, and why (the keep setting that lets it go)."""

    path: Path
    reason: str


def deletions(run_dir: Path, keep: Keep, *, staleness: int = 0) -> list[Deletion]:
    """The complete artifacts of `run_dir` that `keep` no longer keeps (see the module doc).

    Args:
        staleness: the run's rollouts sample from the policy this many iterations back, which
            therefore stay.
    """
    iters = dict(iteration_dirs(run_dir))
    done = [k for k, d in iters.items() if exists(d / "policy") or pending_manifest(d / "policy") is not None]
    if not done:
        return []
    last = max(done)
    states = sorted(k for k, d in iters.items() if exists(d / "train_state"))
    kept_states = set(states if keep.train_states is None else states[-keep.train_states:])
    # The next optimize continues from the last complete state and replays the runs after it, each
    # on its inputs: the checkpoints from that state's iteration on (the first replayed run's input
    # policy is that iteration's), the tables after it.
    chain = states[-1] if states else 0
    since = chain + 1 if states else 0
    out = [Deletion(iters[k] / "train_state", f"keep.train_states={keep.train_states}: only the last "
                    f"{keep.train_states} train state(s) stay") for k in states if k not in kept_states]
    kept = {last, *range(chain, last + 1), *range(max(0, last - staleness), last + 1)}
    if keep.checkpoints_every:
        kept |= {k for k in done if (k + 1) % keep.checkpoints_every == 0}
    best = _best(iters, keep.best) if keep.best else None
    if best is not None:
        kept.add(best)
    why = (f"keep.checkpoints_every={keep.checkpoints_every}, keep.best={keep.best or 'null'}: not the last, "
           "a kept period or the best evaluation")
    out += [Deletion(iters[k] / name, why) for k in sorted(iters) if k not in kept and k < last
            for name in CHECKPOINTS if exists(iters[k] / name)]
    if not keep.tables:
        out += [Deletion(iters[k] / name, "keep.tables=false: only the tables a resumed run replays stay")
                for k in sorted(iters) if k < min(since, last - staleness) for name in TABLES
                if exists(iters[k] / name)]
    return out


def _best(iters: dict[int, Path], metric: str) -> int | None:
    """The iteration whose evaluation scored highest on `metric` (the earliest of equals)."""
    from rlpipe.pipelines.report import eval_metrics

    scores = {}
    for k, d in sorted(iters.items()):
        if exists(d / "eval"):
            metrics = eval_metrics(d / "eval")
            if metric not in metrics:
                raise UserError(f"keep.best: {metric!r} is not a metric of the evaluate stage ({d / 'eval'} has "
                                f"{', '.join(sorted(metrics))}); set keep.best to one of them, or null")
            scores[k] = metrics[metric]
    return max(scores, key=lambda k: (scores[k], -k)) if scores else None


def prune_run(run_dir: Path, keep: Keep, *, staleness: int = 0, dry_run: bool = False,
              log: Callable[[str], None] | None = None) -> int:
    """Delete what `keep` no longer keeps (`deletions`), logging each with its size; returns the
    bytes freed (or that would be, with `dry_run`); `log`: default the `rlpipe.pipelines.keep` logger."""
    freed, log = 0, log or _log.info
    for deletion in deletions(run_dir, keep, staleness=staleness):
        path, reason = deletion.path, deletion.reason
        size = artifact_bytes(path) if dry_run else prune_artifact(path, reason)
        freed += size
        log(f"{'would prune' if dry_run else 'pruned'} {path.relative_to(run_dir)} ({_mb(size)}; {reason})")
    # A prune killed after an artifact's record was written left some of its files: finish it.
    for record in run_dir.glob(f"*/*/{PRUNED_NAME}"):
        left = [f for f in record.parent.rglob("*") if f.is_file() and f != record]
        if left:
            size = sum(f.stat().st_size for f in left)
            if not dry_run:
                remove_pruned_files(record.parent)
            freed += size
            log(f"{'would remove' if dry_run else 'removed'} what an interrupted prune left in "
                f"{record.parent.relative_to(run_dir)} ({_mb(size)})")
    return freed


def artifact_bytes(path: Path | str) -> int:
    """Bytes of every file under `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def prune_artifact(path: Path | str, reason: str) -> int:
    """Delete the artifact at `path`, leaving its record (`rlpipe.schemas.pruning`; the order of
    the steps: see the module doc); returns the bytes freed. The artifact must be complete."""
    path = Path(path)
    manifest = read_manifest(path)
    size = artifact_bytes(path)
    record = Pruned(manifest=manifest, reason=reason, bytes=size,
                    pruned_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    atomic_write_bytes(path / PRUNED_NAME, record.model_dump_json(indent=1).encode(), fsync=True)
    (path / MANIFEST_NAME).unlink()  # from here on it is pruned, not an artifact
    remove_pruned_files(path)
    return size


def remove_pruned_files(path: Path) -> None:
    """Remove everything but the record under a pruned artifact (what a crash left is removed
    by the next prune)."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            if Path(root) != path or name != PRUNED_NAME:
                os.unlink(os.path.join(root, name))
        for name in dirs:
            os.rmdir(os.path.join(root, name))


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"

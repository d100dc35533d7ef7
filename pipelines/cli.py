"""The `rlpipe` command line: look at schemas and artifacts, check them, run one stage.

    rlpipe schema [NAME]        the artifact schemas, or one schema's documented columns
    rlpipe validate PATH        check an artifact (manifest, hashes, shard schemas); exit 1 if bad
    rlpipe inspect PATH         summarise a table artifact, a checkpoint or a whole run directory
    rlpipe stage NAME [ARGS]    run one stage on saved artifacts (`rlpipe stage NAME --help`)
    rlpipe run [PRESET] [k=v]   run a pipeline preset end to end (no PRESET: the built-in demo)
    rlpipe prune RUN [k=v]      delete the checkpoints and train states a run's `keep` no longer keeps
    rlpipe data import SRC OUT  import prompts or preference pairs (JSONL, CSV, Parquet, datasets)
    rlpipe model import SRC OUT import a pretrained model from a GGUF file as a checkpoint
    rlpipe submit slurm|k8s PRESET [k=v]   a whole run as one Slurm allocation / Kubernetes Jobs

Each command is one function on the module-level `app`; adding a command is adding a function.
Start-up stays light: pyarrow, polars and torch are imported inside the commands that use them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlpipe.pipelines import builtin_presets
from rlpipe.pipelines.cli_imports import data_app, model_app
from rlpipe.pipelines.cli_output import console as _console
from rlpipe.pipelines.cli_output import fail as _fail
from rlpipe.pipelines.cli_output import failed as _failed

app = typer.Typer(
    name="rlpipe",
    help="RL training for language models as a pipeline of stages exchanging typed Parquet artifacts.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


@app.callback()
def _options(
    log_level: Annotated[str | None, typer.Option(
        "--log-level", metavar="LEVEL",
        help="DEBUG, INFO, WARNING or ERROR for rlpipe's diagnostics (default: $RLPIPE_LOG_LEVEL, else INFO); "
             "command output and errors always show.")] = None,
) -> None:
    from rlpipe.stages.common.log import configure_logging

    try:
        configure_logging(log_level)
    except ValueError as e:
        raise _fail(f"--log-level: {e}", 2) from None




@app.command()
def schema(
    name: Annotated[str | None, typer.Argument(help="Schema name; omit to list all schemas.")] = None,
) -> None:
    """List the artifact schemas, or print one schema's columns with their documentation."""
    from rich.table import Table

    from rlpipe.schemas import SCHEMAS

    console = _console()
    if name is None:
        table = Table(title="artifact schemas", title_justify="left")
        for col in ("schema", "version", "columns", "description"):
            table.add_column(col, overflow="fold")
        for s in SCHEMAS.values():
            table.add_row(s.name, str(s.version), str(len(s.columns)), s.doc)
        console.print(table)
        return
    if name not in SCHEMAS:
        raise _fail(f"unknown schema {name!r}; known schemas: {', '.join(SCHEMAS)}", 2)
    s = SCHEMAS[name]
    key = f"; key: {', '.join(s.key)}" if s.key else ""
    table = Table(title=f"{s.name} (version {s.version}){key}\n{s.doc}", title_justify="left")
    table.add_column("column", no_wrap=True, style="bold")
    table.add_column("arrow type", overflow="fold")
    table.add_column("nullable")
    table.add_column("description", overflow="fold")
    for row in s.describe():
        table.add_row(*row)
    console.print(table)


@app.command()
def validate(
    path: Annotated[Path, typer.Argument(help="Artifact directory (the one holding _manifest.json).")],
    schema_name: Annotated[str | None, typer.Option(
        "--schema", "-s", help="Expected schema (default: the one the manifest names).")] = None,
) -> None:
    """Check an artifact: manifest, file hashes, stray shards, every shard's schema and nulls.

    Exit code 0 when valid, 1 with the list of problems otherwise.
    """
    from rlpipe.schemas import SCHEMAS, read_manifest, validate_artifact

    if schema_name is not None and schema_name not in SCHEMAS:
        raise _fail(f"unknown schema {schema_name!r}; known schemas: {', '.join(SCHEMAS)}", 2)
    problems = validate_artifact(path, schema_name)
    if problems:
        err = _console(stderr=True)
        err.print(f"INVALID {path}: {len(problems)} problem(s)", style="bold red")
        for p in problems:
            err.print(f"- {p}", markup=False)
        raise typer.Exit(1)
    m = read_manifest(path)
    if m.kind == "table":
        what = f"table {m.schema_name} v{m.schema_version}, {m.rows} rows in {len(m.shard_names)} shard(s)"
    else:
        what = f"checkpoint, {len(m.files)} files"
    _console().print(f"OK {path}: {what}, stage {m.stage}, content {m.content_hash[:12]}", markup=False)


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="A table artifact, a checkpoint artifact or a run directory.")],
    rows: Annotated[int, typer.Option("--rows", "-n", min=0, help="Sample rows to show (table artifacts).")] = 3,
    metric: Annotated[list[str] | None, typer.Option(
        "--metric", "-m", help="Extra metric to show per iteration (run directories); repeatable.")] = None,
    samples: Annotated[int, typer.Option(
        "--samples", min=0, help="Run directories: print this many sample completions with their rewards.")] = 0,
    iteration: Annotated[int | None, typer.Option(
        "--iteration", min=1, help="With --samples: the iteration (as shown, 1 = iter_0000; default the latest).")] = None,
    decode: Annotated[bool, typer.Option(
        "--decode", help="Rollouts: the sample rows' token ids as the model read and wrote them (chat template "
                         "and special tokens included), decoded with the policy's tokenizer.")] = False,
    tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", help="With --decode: the checkpoint folder whose tokenizer to use (default: the one the "
                            "rollouts were sampled from, or the run's newest).")] = None,
) -> None:
    """Summarise an artifact (rows, schema, statistics, sample rows) or a run (one row per iteration)."""
    from rlpipe.pipelines import inspect as insp
    from rlpipe.schemas import ArtifactError
    from rlpipe.schemas.errors import UserError

    try:
        insp.inspect_path(path, _console(), sample_rows=rows, metrics=metric or (), samples=samples,
                          iteration=iteration, decode=decode, tokenizer=tokenizer)
    except (ArtifactError, FileNotFoundError, NotADirectoryError, UserError) as e:
        raise _fail(str(e), 1) from None


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def stage(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Argument(help="Stage name.")] = None,
) -> None:
    """Run one stage on saved artifacts: rlpipe stage NAME [-c FILE] [key=value ...] [--force].

    Everything after NAME goes to the stage's own command line (`rlpipe stage NAME --help`).
    """
    from rlpipe.stages import STAGES
    from rlpipe.stages.common.cli import stage_main

    if name is None or name in ("-h", "--help"):
        console = _console()
        console.print(ctx.get_help(), markup=False)
        console.print("\nstages:", markup=False)
        for s in STAGES.values():
            console.print(f"  {s.name:<13} {s.summary}", markup=False)
        raise typer.Exit(0 if name else 2)
    if name not in STAGES:
        raise _fail(f"unknown stage {name!r}; stages: {', '.join(STAGES)}", 2)
    raise typer.Exit(stage_main(name, list(ctx.args)))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    preset: Annotated[str, typer.Argument(help=f"Built-in preset name ({', '.join(builtin_presets())}) or a YAML file.")] = "demo",
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Run directory (default runs/<preset name>).")] = None,
    local: Annotated[bool, typer.Option("--local", help="Run the plain-Python pipeline, without Prefect.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of a user error.")] = False,
) -> None:
    """Run a pipeline preset: data, optional SFT and reward model, then RL iterations.

    Extra `key=value` arguments override preset keys (e.g. `iterations=5 rollout.temperature=0.8`).
    Rerunning the same command resumes: finished stages are skipped by their cache keys.
    """
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.schemas.staging import discard_open_staging
    from rlpipe.stages.common.interrupt import exit_on_signals

    with exit_on_signals(f"run {run_dir or preset}"):
        try:
            spec = load_preset(preset, list(ctx.args))
            _quiet_libraries()
            if local:
                from rlpipe.pipelines.runner import Pipeline

                Pipeline(spec, run_dir).run()
            else:
                from rlpipe.flows.run_flow import run_flow

                run_flow(spec, str(run_dir) if run_dir else None)
        except Exception as e:
            discard_open_staging()  # nothing partial stays behind
            raise _failed(e, debug) from None


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def prune(
    ctx: typer.Context,
    run_dir: Annotated[Path, typer.Argument(help="A run directory (runs/<name>).")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would go; delete nothing.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of a user error.")] = False,
) -> None:
    """Apply the run's `keep` section (from its preset.yaml) to its directory: delete the
    checkpoints and train states it no longer keeps, printing each with its size, and the total.

    Extra `keep.KEY=VALUE` arguments override the run's setting (e.g. `keep.train_states=1`); what a
    resume, an extension or a replay of the run reads is never deleted (docs/design.md#keep).
    """
    from rlpipe.pipelines.keep import Keep, prune_run
    from rlpipe.pipelines.lock import run_lock
    from rlpipe.pipelines.preset_spec import AsyncSpec
    from rlpipe.schemas.config_files import apply_overrides, load_yaml, parse_config
    from rlpipe.schemas.errors import UserError

    preset_file = run_dir / "preset.yaml"
    try:
        if not preset_file.is_file():
            raise UserError(f"{run_dir} is not a run directory (no preset.yaml): give runs/<name> of a run")
        overrides = list(ctx.args)
        bad = [o for o in overrides if not o.startswith("keep.")]
        if bad:
            raise UserError(f"only keep.KEY=VALUE overrides apply to prune, got {', '.join(bad)}")
        preset = load_yaml(preset_file)
        data = apply_overrides({"keep": preset.get("keep") or {}}, overrides)
        keep = parse_config(Keep, data["keep"], f"{preset_file} (keep)")
        # an async run's next rollout samples an older policy: the same ones stay as in the run
        staleness = parse_config(AsyncSpec, preset.get("async") or {}, f"{preset_file} (async)").staleness
        console = _console()
        with run_lock(run_dir, log=lambda line: console.print(line, markup=False)) as writable:
            if not writable and not dry_run:
                raise UserError(f"{run_dir} is not writable: nothing can be pruned (try --dry-run)")
            freed = prune_run(run_dir, keep, staleness=staleness, dry_run=dry_run,
                              log=lambda line: console.print(line, markup=False))
    except Exception as e:
        raise _failed(e, debug) from None
    console.print(f"{'would free' if dry_run else 'freed'} {freed / 1e6:.1f} MB in {run_dir}", markup=False)


app.add_typer(data_app, name="data")
app.add_typer(model_app, name="model")


submit_app = typer.Typer(help="Submit a whole run to a cluster: one Slurm allocation, or Kubernetes Jobs.",
                         no_args_is_help=True, rich_markup_mode=None)
app.add_typer(submit_app, name="submit")


@submit_app.command("slurm", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def submit_slurm(
    ctx: typer.Context,
    preset: Annotated[str, typer.Argument(help="Built-in preset name or a YAML file; its `launch` section places the stages.")],
    nodes: Annotated[int, typer.Option("--nodes", min=1, help="Nodes of the allocation; the driver runs on the first.")] = 1,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Run directory on a shared filesystem (default runs/<preset name>).")] = None,
    time: Annotated[str, typer.Option("--time", help="Slurm time limit.")] = "01:00:00",
    partition: Annotated[str | None, typer.Option("--partition")] = None,
    account: Annotated[str | None, typer.Option("--account")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait for the run to end (sbatch --wait); exit with its code.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the sbatch script instead of submitting it.")] = False,
) -> None:
    """One allocation for a whole run: the driver (`rlpipe run ... --local`, launcher slurm) runs
    in the batch step on the first node, every stage the preset places runs as an srun step.

    Extra `key=value` arguments override preset keys (e.g. `launch.rollout.workers=4`).
    """
    import subprocess

    from rlpipe.cluster.submit import render_run_slurm, write_run_preset
    from rlpipe.pipelines.layout import RunLayout
    from rlpipe.pipelines.plan import Plan
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.schemas.errors import UserError

    try:
        spec = load_preset(preset, list(ctx.args))
        where = run_dir or Path("runs") / spec.name
        iterations = Plan(spec, RunLayout(where)).iteration_stages()
        script_text = render_run_slurm(spec, write_run_preset(spec, where, "slurm"), where, iterations,
                                       nodes=nodes, time=time, partition=partition, account=account)
    except (UserError, ValueError) as e:
        raise _fail(str(e), 2) from None
    script = where.absolute() / "submit" / "run.sbatch"
    script.write_text(script_text)
    if dry_run:
        _console().print(script_text, markup=False, end="")
        return
    done = subprocess.run(["sbatch", "--parsable", *(["--wait"] if wait else []), str(script)],
                          capture_output=True, text=True)
    job = done.stdout.strip().split(";")[0]
    log = where.absolute() / "logs" / f"driver-{job}.out"
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if job and log.is_file() else ""
        raise _fail(f"sbatch {script} failed (exit code {done.returncode}): {done.stderr.strip()}"
                    + (f"\nlast lines of {log}:\n{tail}" if tail else ""), 1)
    _console().print(f"{'finished' if wait else 'submitted'} job {job}: driver log {log}", markup=False)


@submit_app.command("k8s", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def submit_k8s(
    ctx: typer.Context,
    preset: Annotated[str, typer.Argument(help="Built-in preset name or a YAML file; its `launch` section places the stages.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for driver.yaml and stages/*.yaml.")] = Path("k8s"),
    apply: Annotated[bool, typer.Option("--apply", help="kubectl apply -f <out>/driver.yaml after rendering.")] = False,
) -> None:
    """Render a whole run for Kubernetes: the driver Job with its RBAC (and the preset as a
    ConfigMap) in driver.yaml, and the Jobs the driver will create for the placed stages of the
    first iteration in stages/ (for review). Image, namespace and volume: `launch.kubernetes.*`.
    """
    import subprocess

    from rlpipe.cluster.kubernetes import mounted_run_dir, render_run
    from rlpipe.pipelines.layout import RunLayout
    from rlpipe.pipelines.plan import Plan
    from rlpipe.pipelines.preset import load_preset
    from rlpipe.schemas.errors import UserError

    try:
        spec = load_preset(preset, list(ctx.args))
        plan = Plan(spec, RunLayout(mounted_run_dir(spec)))
        written = render_run(spec, out, plan.setup(), plan.iteration(0))
    except (UserError, ValueError) as e:
        raise _fail(str(e), 2) from None
    for path in written:
        _console().print(str(path), markup=False)
    if apply:
        done = subprocess.run(["kubectl", "apply", "-f", str(written[0])], capture_output=True, text=True)
        if done.returncode != 0:
            raise _fail(f"kubectl apply -f {written[0]} failed: {done.stderr.strip()}", 1)
        _console().print(done.stdout.strip(), markup=False)


def _quiet_libraries() -> None:
    """Silence per-load progress bars and info logs that would drown the run's own display."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def main() -> None:
    """Entry point of the installed `rlpipe` script."""
    from rlpipe.stages.common.cli import exit_process, own_cache_dirs

    own_cache_dirs()  # (before any library makes its cache in the temporary directory)
    try:
        app()
    except SystemExit as e:
        exit_process(e.code)
    exit_process(0)


if __name__ == "__main__":
    main()

"""`rlpipe data import` and `rlpipe model import`: a user's own data and model as artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlpipe.pipelines.cli_output import console, fail, failed

data_app = typer.Typer(help="Bring your own data: import files as artifacts.", no_args_is_help=True)


@data_app.command("import")
def data_import(
    source: Annotated[Path, typer.Argument(help="A .jsonl/.json, .csv/.tsv or .parquet file, a `datasets` directory, a "
                                                "folder of data files, or a Hub dataset id org/name[@revision].")],
    output: Annotated[Path, typer.Argument(help="The artifact directory to write.")],
    kind: Annotated[str, typer.Option(help="What the rows are: prompts or preferences (chosen/rejected pairs).")] = "prompts",
    prompt: Annotated[str | None, typer.Option(help="Column with the prompt text (default: prompt).")] = None,
    messages: Annotated[str | None, typer.Option(help="Column with chat turns [{role, content}] (default: messages).")] = None,
    answer: Annotated[str | None, typer.Option(help="Column with the reference answer (default: answer).")] = None,
    id: Annotated[str | None, typer.Option("--id", help="Column with unique ids (default: prompt_id/pair_id/id; else generated from content).")] = None,
    chosen: Annotated[str | None, typer.Option(help="Preferences: column with the preferred response (default: chosen).")] = None,
    rejected: Annotated[str | None, typer.Option(help="Preferences: column with the dispreferred response (default: rejected).")] = None,
    margin: Annotated[str | None, typer.Option(help="Preferences: column with a per-pair margin (default: margin).")] = None,
    split: Annotated[str | None, typer.Option(help="The split of a `datasets` directory or Hub dataset holding several "
                                                   "(default: the only one, else train).")] = None,
    data_files: Annotated[list[str] | None, typer.Option("--data-files", help="A data folder or Hub dataset: the files "
                                                         "to read (a glob; repeat for several).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Import again even if the artifact is up to date.")] = False,
) -> None:
    """Import prompts or preference pairs as an artifact; other columns of a prompt go to its metadata.

    Rows with repeated ids, empty prompts or text that is not UTF-8 are refused with their line or
    row numbers. The same as `rlpipe stage import_data source=SRC prompts=OUT ...`.
    """
    from rlpipe.schemas.config_files import ConfigError, parse_config
    from rlpipe.schemas.errors import UserError
    from rlpipe.stages import get_stage
    from rlpipe.stages.common.hub import resolve_hub_inputs
    from rlpipe.stages.import_data.sources import DataImportError

    if kind not in ("prompts", "preferences"):
        raise fail(f"--kind must be prompts or preferences, got {kind!r}", 2)
    mapping = {k: v for k, v in dict(prompt=prompt, messages=messages, answer=answer, id=id, chosen=chosen,
                                     rejected=rejected, margin=margin, split=split,
                                     data_files=data_files[0] if data_files and len(data_files) == 1 else data_files,
                                     ).items() if v is not None}
    stage = get_stage("import_data")
    try:
        config = parse_config(stage.config_class(), {"source": source, kind: output, **mapping}, "rlpipe data import")
        m = stage.run(resolve_hub_inputs(config), force=force)  # (a Hub dataset id: its snapshot)
    except ConfigError as e:
        raise fail(str(e), 2) from None
    except (DataImportError, UserError) as e:  # a user mistake in the file, like a bad option: exit code 2
        raise failed(e, False) from None
    extra = m.extra
    kept = extra.get("metadata_columns") or extra.get("ignored_columns") or []
    kept_what = "metadata" if kind == "prompts" else "ignored"
    console().print(f"imported {m.rows} {kind} from {source} into {output} (ids: {extra['ids']}; "
                    f"{kept_what}: {', '.join(kept) or 'none'}; content {m.content_hash[:12]})", markup=False)


model_app = typer.Typer(help="Bring your own model: import a pretrained one as a checkpoint.", no_args_is_help=True)


@model_app.command("import")
def model_import(
    source: Annotated[Path, typer.Argument(help="A .gguf file, or a directory holding one.")],
    output: Annotated[Path, typer.Argument(help="The checkpoint directory to write.")],
    dtype: Annotated[str, typer.Option(help="Weights saved as float32, bfloat16 or float16.")] = "bfloat16",
    force: Annotated[bool, typer.Option("--force", help="Import again even if the checkpoint is up to date.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of a user error.")] = False,
) -> None:
    """Import a pretrained model from a GGUF file (llama.cpp's format: weights, tokenizer and chat
    template in one file) as a Hugging Face checkpoint: use it as `model.base=OUT`. The same as
    `rlpipe stage import_model source=SRC output=OUT`.
    """
    from rlpipe.stages import get_stage, stage_config

    try:  # (a bad --dtype is a ConfigError: a user error, exit 2, as the stage's own failures)
        m = get_stage("import_model").run(stage_config("import_model", {"dtype": dtype}, "rlpipe model import",
                                                       source=source, output=output), force=force)
    except Exception as e:
        raise failed(e, debug) from None
    extra = m.extra
    template = "with its chat template" if extra.get("chat_template") else "no chat template"
    console().print(f"imported {extra['architecture']} ({extra['parameters'] / 1e6:.1f}M parameters, vocabulary "
                    f"{extra['vocab_size']}, {template}) from {source} into {output} as {dtype} "
                    f"(content {m.content_hash[:12]})", markup=False)

"""Token ids as the model read them: `rlpipe inspect ROLLOUTS --decode`.

A rollout keeps the prompt's token ids (`prompt_token_ids`: the chat template's rendering when the
rollout applied one) beside the plain `prompt` text; decoding them with the policy's tokenizer,
special tokens kept, shows exactly what the model read (`<|im_start|>user ... <|im_start|>assistant`)
and wrote (its end-of-turn token, an episode's inserted replies).

The tokenizer is the one of the checkpoint the rollouts were sampled from (the manifest's
`checkpoint` input, its path as recorded, relative to the directory the run was started from);
when that checkpoint is gone (pruned), the newest checkpoint of the same run: RL never changes a
tokenizer. `--tokenizer DIR` names one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlpipe.pipelines.display import printable
from rlpipe.schemas import ArtifactNotFound, Manifest, exists
from rlpipe.schemas.errors import UserError
from rlpipe.schemas.runs import iteration_dirs

#: The token-id columns decoded, and the name each is shown under.
DECODED = {"prompt_token_ids": "prompt as read", "response_token_ids": "response as written"}


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer_config.json").is_file()


def find_tokenizer(artifact: Path, manifest: Manifest) -> Path | None:
    """The checkpoint folder whose tokenizer decodes `artifact`'s ids (None: none is left)."""
    source = manifest.inputs.get("checkpoint")
    if source is not None:
        recorded = Path(source.path)
        # relative paths are the run's starting directory's: one of the artifact's ancestors
        for base in [Path.cwd(), *artifact.resolve().parents]:
            if _has_tokenizer(base / recorded):
                return base / recorded
    for run in artifact.resolve().parents:  # the run directory: iter_*/ and models/ below it
        iterations = iteration_dirs(run)
        if iterations or (run / "models").is_dir():
            found = [d / "policy" for _, d in reversed(iterations) if exists(d / "policy")]
            found += sorted(p.parent for p in (run / "models").glob("*/tokenizer_config.json"))
            return next((p for p in found if _has_tokenizer(p)), None)
    return None


def _tokenizer(folder: Path) -> Any:
    """The checkpoint's tokenizer as every stage loads it (`tiny.load_tokenizer`)."""
    from rlpipe.stages.common.tiny import load_tokenizer

    try:
        return load_tokenizer(folder)
    except (OSError, ValueError) as e:
        raise UserError(f"{folder}: no tokenizer could be read from it ({type(e).__name__}: {e}); "
                        "pass --tokenizer with a checkpoint folder of the same model") from None


def decoded_rows(rows: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, str]]:
    """Each row's token-id columns decoded, special tokens kept."""
    return [{shown: tokenizer.decode(row[column] or [], skip_special_tokens=False)
             for column, shown in DECODED.items() if column in row} for row in rows]


def show_decoded(path: Path, m: Manifest, rows: list[dict[str, Any]], console: Console,
                 tokenizer: Path | None) -> None:
    """The rows' token ids decoded with the policy's tokenizer, special tokens kept, in full."""
    if tokenizer is not None and not _has_tokenizer(tokenizer):
        raise UserError(f"--tokenizer {tokenizer}: no tokenizer_config.json in it; give a checkpoint folder of the "
                        "model that sampled the rollouts")
    folder = tokenizer or find_tokenizer(path, m)
    if folder is None:
        raise ArtifactNotFound(f"{path}: the checkpoint it was sampled from is gone and its run has no other; "
                               "pass --tokenizer with a checkpoint folder of the same model")
    t = Table(title=f"token ids decoded with the tokenizer of {folder}", title_justify="left")
    t.add_column("column", style="bold", no_wrap=True)
    for i in range(len(rows)):
        t.add_column(f"row {i}", overflow="fold")
    decoded = decoded_rows(rows, _tokenizer(folder))
    for shown in decoded[0] if decoded else ():
        t.add_row(shown, *(escape(printable(d[shown])) for d in decoded))
    console.print(t)

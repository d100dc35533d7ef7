"""The prompts a rollout samples from, checked once per content in a process.

Every iteration's rollout reads the same prompts artifact: a resident rollout worker (and the
local runner) turned every row into Python and checked every row again each time (0.8 ms at the
demo's 900 prompts, ~0.1 s at 100,000), for the few hundred rows an iteration samples. The read
itself stays what every read is (the file verified against its manifest, by the memo of verified
files; the decode skipped where this process holds the table: schemas/table_memory.py), so a
changed or damaged file is still refused; what is kept is that the rows of this content hash
passed the checks (`check_prompts`), and each iteration turns only the rows it samples into
Python (`pa.Table.take`).

Process-wide state: `PROMPT_MEMORY`, reset with the other process-wide objects
(stages/common/process_state.py).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from rlpipe.schemas import PROMPTS, read_table_artifact
from rlpipe.schemas.errors import DataError
from rlpipe.schemas.prompts import duplicate_ids, duplicates_text, empty_prompts, rows_text
from rlpipe.stages.common.process_state import register


class PromptMemory:
    """The content hash of the prompts artifact whose rows this process checked last."""

    def __init__(self) -> None:
        self.checked: str | None = None
        """That content hash (None: none checked)."""

    def read(self, path: Path, content_hash: str) -> pa.Table:
        """Prompts artifact `path` (its manifest's content hash `content_hash`), read and
        verified; its rows checked unless this content's were."""
        table = read_table_artifact(path, PROMPTS)
        if table.num_rows == 0:
            raise DataError(f"prompts artifact {path} has no rows: nothing to sample")
        if self.checked != content_hash:
            check_prompts(table, path)
            self.checked = content_hash
        return table

    def reset(self) -> None:
        self.checked = None


def check_prompts(table: pa.Table, path: Path) -> None:
    """Refuse prompts that would give rows another prompt's tokens (a repeated prompt_id: tokens
    are looked up by id) or sample from nothing (an empty prompt)."""
    dups = duplicate_ids(table["prompt_id"].to_pylist())
    if dups:
        raise DataError(f"prompts artifact {path}: column 'prompt_id' repeats ids ({duplicates_text(dups)}; "
                         "rows counted from 0 in artifact order): give every prompt its own id")
    empty = empty_prompts(table["prompt"].to_pylist(), table["messages"].to_pylist())
    if empty:
        raise DataError(f"prompts artifact {path}: empty prompts (column 'prompt' blank and no "
                         f"'messages' with content) at rows {rows_text(empty)} (counted from 0 in "
                         "artifact order): remove them or fill them in")


#: What this process checked (see the module doc).
PROMPT_MEMORY = register(PromptMemory())

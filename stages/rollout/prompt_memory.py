"""The prompts a rollout samples from, read and checked once per content in a process.

Every iteration's rollout reads the same prompts artifact: a resident rollout worker (and the
local runner) would decode it, turn every row into Python and check every row again each time
(0.8 ms at the demo's 900 prompts, ~0.1 s at 100,000), for the few hundred rows an iteration
samples. Here the artifact is read and checked once per content hash (what the stage's inputs name
it by), kept as its Arrow table, and each iteration turns only the rows it samples into Python
(`pa.Table.take`). A changed artifact has another content hash, so it is read and checked again.

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
    """The prompts artifact this process read last, checked, by its content hash."""

    def __init__(self) -> None:
        self.content_hash: str | None = None
        """The content hash of the artifact held (None: none)."""
        self.table: pa.Table | None = None
        """Its rows, checked (`check_prompts`)."""

    def read(self, path: Path, content_hash: str) -> pa.Table:
        """Prompts artifact `path`, whose content hash is `content_hash`, checked: read and
        checked only when it is not the artifact held."""
        if self.content_hash != content_hash or self.table is None:
            table = read_table_artifact(path, PROMPTS)
            if table.num_rows == 0:
                raise DataError(f"prompts artifact {path} has no rows: nothing to sample")
            check_prompts(table, path)
            self.content_hash, self.table = content_hash, table
        return self.table

    def reset(self) -> None:
        self.content_hash = self.table = None


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


#: This process's prompts (see the module doc).
PROMPT_MEMORY = register(PromptMemory())

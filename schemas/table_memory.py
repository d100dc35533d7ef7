"""Shards this process wrote or read, kept in memory by content: a later read of one decodes nothing.

In one process the stages of an iteration read what the stage before them just wrote: score the
rollouts, advantage the scores and rollouts, optimize both, the driver's summary all three; with
resident workers the driver reads a member's rollouts and metrics several times. The file stays
the contract (every read still verifies the file against its manifest entry, by the memo of
verified files or by hashing it: a changed file is still an IntegrityError); what is skipped is the
Parquet decode, since the bytes verified are the bytes this process encoded from the table it
holds, or decoded into it before (a whole shard's read). Keyed by the file's tagged digest, so a
shard renamed from staging into its artifact, or rewritten with other content, is found or missed
exactly as its content says.

Process-wide state: `TABLES` (a `TableMemory`), reset with every other process-wide object
(rlpipe.stages.common.process_state).
"""

from __future__ import annotations

from collections import OrderedDict

import pyarrow as pa

#: Bytes of tables kept at most (the oldest go first); a larger table is not kept.
MAX_BYTES = 256 << 20


class TableMemory:
    """The tables of shards this process wrote or read whole, by the tagged digest of their file."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.tables: OrderedDict[str, pa.Table] = OrderedDict()
        """Tagged digest -> the table its file encodes (as written, conformed to its schema; or as decoded)."""
        self.bytes = 0

    def remember(self, digest: str, table: pa.Table) -> None:
        size = table.nbytes
        if size > self.max_bytes // 4 or digest in self.tables:
            return
        while self.tables and self.bytes + size > self.max_bytes:
            self.bytes -= self.tables.popitem(last=False)[1].nbytes
        self.tables[digest] = table
        self.bytes += size

    def get(self, digest: str) -> pa.Table | None:
        return self.tables.get(digest)

    def reset(self) -> None:
        self.tables.clear()
        self.bytes = 0


#: This process's written tables (see the module doc).
TABLES = TableMemory()

"""Content hashes: xxh3-128 recorded for new files, hashed as the bytes are written; manifests
written with sha256 still verify; a file verified by one process is not hashed again by another
on the same machine (schemas/hashing.py, schemas/verify.py)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time

import pytest
import xxhash

from rlpipe.schemas import ROLLOUTS, read_manifest, read_table_artifact, write_table_artifact
from rlpipe.schemas import verify as V
from rlpipe.schemas.errors import IntegrityError
from rlpipe.schemas.examples import example_table
from rlpipe.schemas.manifest import FileInfo, content_hash


@pytest.fixture
def rollouts(tmp_path, monkeypatch):
    monkeypatch.setenv("RLPIPE_VERIFIED_DIR", str(tmp_path / "verified"))
    V._VERIFIED.clear()
    out = tmp_path / "rollouts"
    write_table_artifact(out, ROLLOUTS, example_table(ROLLOUTS, 6, seed=0), stage="test")
    yield out
    V._VERIFIED.clear()


def test_new_files_record_xxh3_128_of_their_bytes(rollouts):
    [info] = read_manifest(rollouts).files
    data = (rollouts / info.name).read_bytes()
    assert info.algorithm == "xxh3_128" and info.sha256 is None
    assert info.xxh3_128 == xxhash.xxh3_128(data).hexdigest() and info.bytes == len(data)


def test_a_manifest_written_with_sha256_still_verifies_and_catches_a_change(rollouts):
    mpath = rollouts / "_manifest.json"
    m = json.loads(mpath.read_text())
    shard = rollouts / m["files"][0]["name"]
    m["files"][0].update(sha256=hashlib.sha256(shard.read_bytes()).hexdigest(), xxh3_128=None)
    files = [FileInfo(**f) for f in m["files"]]
    m["content_hash"] = content_hash(files)
    # the content hash of an old manifest is what the releases before wrote: name \0 sha256
    assert m["content_hash"] == hashlib.sha256(f"{shard.name}\0{files[0].sha256}\n".encode()).hexdigest()
    mpath.write_text(json.dumps(m))
    assert read_table_artifact(rollouts).num_rows == 6
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        read_table_artifact(rollouts)


def test_a_file_verified_by_one_process_is_not_hashed_again_by_another(rollouts):
    shard = next(rollouts.glob("part-*.parquet"))
    time.sleep(1.1)  # past the racy window: a verification may be remembered
    code = "from rlpipe.schemas import read_table_artifact; import sys; read_table_artifact(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(rollouts)], check=True)
    V._VERIFIED.clear()  # nothing this process verified itself
    assert V.known_hash(shard) == "xxh3_128:" + read_manifest(rollouts).files[0].xxh3_128
    data = bytearray(shard.read_bytes())  # a change (same size, same inode) is still caught
    data[len(data) // 2] ^= 0x01
    with open(shard, "r+b") as f:
        f.write(bytes(data))
    assert V.known_hash(shard) is None
    with pytest.raises(IntegrityError, match=str(shard)):
        read_table_artifact(rollouts)


def test_the_machine_memo_is_ignored_in_a_folder_others_can_write(rollouts, tmp_path):
    shard = next(rollouts.glob("part-*.parquet"))
    time.sleep(1.1)
    read_table_artifact(rollouts)
    V._VERIFIED.clear()
    assert V.known_hash(shard) is not None
    V._VERIFIED.clear()
    (tmp_path / "verified").chmod(0o777)
    assert V.known_hash(shard) is None

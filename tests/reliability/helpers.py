"""What the reliability catalogue compares: artifacts by content hash, what exists, what is partial."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "_manifest.json"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def hashes(run_dir: Path) -> dict[str, str]:
    """Content hash of every complete artifact (a directory with a manifest), by relative path."""
    return {str(m.parent.relative_to(run_dir)): json.loads(m.read_text())["content_hash"]
            for m in sorted(run_dir.rglob(MANIFEST)) if not _hidden(m.relative_to(run_dir))}


def created(run_dir: Path) -> dict[str, str]:
    """Each manifest's text (its creation time included): unchanged text, not rewritten."""
    return {str(m.parent.relative_to(run_dir)): m.read_text()
            for m in sorted(run_dir.rglob(MANIFEST)) if not _hidden(m.relative_to(run_dir))}


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def partial_artifacts(run_dir: Path) -> list[str]:
    """Visible directories holding files but no manifest: what a reader could take for an artifact
    that is not one (staging directories are hidden; report/ and configs/ are not artifacts; the
    folders inside a committed artifact, such as a train state's, are its parts)."""
    out = []
    for d in sorted(p for p in run_dir.rglob("*") if p.is_dir()):
        rel = d.relative_to(run_dir)
        if _hidden(rel) or rel.parts[0] == "report" or d.name == "configs":
            continue
        if any((run_dir / Path(*rel.parts[:i]) / MANIFEST).is_file() for i in range(1, len(rel.parts))):
            continue
        files = [f for f in d.iterdir() if f.is_file() and not f.name.startswith(".")]
        if files and not (d / MANIFEST).is_file():
            out.append(str(rel))
    return out


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under `path` (hidden ones included), by relative path."""
    path = Path(path)
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}

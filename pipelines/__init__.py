"""The pipeline layer: presets, the plan, the runner, the command line, the report.

The built-in presets' folder is named here, so the command line lists them without importing the
preset machinery (pipelines/preset.py)."""

from pathlib import Path

PRESETS_DIR = Path(__file__).parent / "presets"


def builtin_presets() -> list[str]:
    """The built-in presets' names (their files under pipelines/presets/)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))

"""The explicit package list in pyproject.toml must match the folders (else the wheel misses code)."""

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_package_list_matches_folders():
    cfg = _pyproject()
    dirs = cfg["package-dir"]
    found = set()
    for pkg, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([pkg, *rel.parts]))
    listed = set(cfg["packages"])
    assert found - listed == set(), f"folders with __init__.py missing from pyproject packages: {sorted(found - listed)}"
    # The other listed packages are data folders: no Python in them, their files in package-data.
    for pkg in sorted(listed - found):
        parent, _, name = pkg.rpartition(".")
        folder = ROOT / dirs[parent] / name
        assert folder.is_dir(), f"pyproject package {pkg} has no folder ({folder})"
        assert not list(folder.glob("*.py")), f"{folder} holds Python files but no __init__.py"
        patterns = cfg["package-data"].get(pkg)
        assert patterns, f"data package {pkg} has no package-data entry: its files would not ship"
        files = {f for p in patterns for f in folder.glob(p) if f.is_file()}
        assert files == {f for f in folder.iterdir() if f.is_file()}, f"package-data of {pkg} misses files"


def test_every_top_level_folder_is_mapped():
    dirs = _pyproject()["package-dir"]
    assert set(dirs) == {f"rlpipe.{n}" for n in ("schemas", "stages", "pipelines", "flows", "cluster")}
    assert all(k == f"rlpipe.{v}" for k, v in dirs.items())


def test_schemas_import_no_heavy_libraries():
    import subprocess

    code = ("import sys, rlpipe.schemas; heavy = [m for m in ('torch', 'transformers', 'polars', 'deepspeed') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)

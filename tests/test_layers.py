"""The house's layers import one way (docs/design.md#layers): schemas -> stages -> cluster ->
pipelines -> flows, each importing only its own layer and the ones before it, and no two modules
importing each other, however far round the circle. Read from the source with `ast`, so an import
inside a function or under `if TYPE_CHECKING:` counts as much as one at the top of a file: a
function-level import hides a circle from Python at import time, not from the design.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The layers, lowest first. Inside `stages`, `stages.common` and the registry (`rlpipe.stages`)
# sit below the stages themselves: a stage may use them, never the reverse. (A stage may use
# another stage's pieces, evaluate runs rollout and score, so long as no circle forms.)
LAYERS = ("schemas", "stages", "cluster", "pipelines", "flows")
#: The command line sits on all of them: `rlpipe run` hands a plan to the in-process runner
#: (pipelines) or to the Prefect flow (flows), so it is the one module that may import both.
COMMAND_LINE = "rlpipe.pipelines.cli"


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package, `rlpipe.<folder>...` -> its file."""
    modules = {}
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(("rlpipe", *parts))] = path
    return modules


def _is_package(module: str, modules: dict[str, Path]) -> bool:
    return modules[module].name == "__init__.py"


def imports_of(module: str, modules: dict[str, Path]) -> dict[str, int]:
    """The package modules `module` imports anywhere in its file -> the first line doing so.
    `from P import name` is an import of the submodule `P.name` when there is one, else of `P`."""
    path = modules[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if _is_package(module, modules) else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        # The deepest package module named by `target` (an `import a.b.c` of a non-module `c`
        # cannot happen, but `from a.b import c` of a function `c` names module `a.b`).
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != module:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rlpipe."):
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("rlpipe"):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in modules else source, node.lineno)
    return found


def import_graph(root: Path = ROOT) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    modules = package_modules(root)
    return {m: imports_of(m, modules) for m in modules}, modules


def rank(module: str) -> tuple[int, int]:
    """(layer, sub-layer): inside `stages`, the registry and `stages.common` are sub-layer 0 and
    the stages themselves 1; the command line is above every layer."""
    if module == COMMAND_LINE:
        return len(LAYERS), 0
    parts = module.split(".")
    layer = LAYERS.index(parts[1])
    if parts[1] == "stages":
        return layer, 0 if len(parts) == 2 or parts[2] == "common" else 1
    return layer, 0


def upward_imports(graph, modules, root: Path = ROOT) -> list[str]:
    """Each import of a higher layer (or sub-layer) as 'file:line: a imports b'."""
    bad = []
    for module, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            if rank(target) > rank(module):
                where = modules[module].relative_to(root)
                bad.append(f"{where}:{line}: {module} imports {target}")
    return bad


def circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each
    sorted: every module in one can reach every other by imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        # Iterative depth-first search: the graph has a few hundred modules, well within the
        # recursion limit, but an iterative walk keeps the test independent of it.
        work = [(node, iter(sorted(graph[node])))]
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        while work:
            current, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[current])
                if low[current] == index[current]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == current:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[current] = min(low[current], index[child])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def describe_circle(component: list[str], graph, modules) -> str:
    members = set(component)
    edges = [
        f"    {modules[a].relative_to(ROOT)}:{line} imports {b}"
        for a in component
        for b, line in sorted(graph[a].items())
        if b in members
    ]
    return "circle of " + ", ".join(component) + ":\n" + "\n".join(edges)


def test_no_import_runs_up_the_layers():
    graph, modules = import_graph()
    bad = upward_imports(graph, modules)
    assert not bad, "imports against the layers (docs/design.md#layers):\n" + "\n".join(bad)


def test_no_modules_import_each_other():
    graph, modules = import_graph()
    found = circles(graph)
    assert not found, "\n".join(describe_circle(c, graph, modules) for c in found)


# The checks themselves, on a small tree written here: each must see what it is for, or the two
# tests above could pass on anything.


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
        (tmp_path / layer / "__init__.py").write_text("")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_function_level_circle_is_found(tmp_path):
    root = _tree(tmp_path, {
        "schemas/a.py": "def f():\n    from rlpipe.schemas import b\n",
        "schemas/b.py": "from rlpipe.schemas.c import x\n",
        "schemas/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\nx = 1\n",
        "schemas/d.py": "from rlpipe.schemas import a\n",
    })
    graph, _ = import_graph(root)
    assert circles(graph) == [["rlpipe.schemas.a", "rlpipe.schemas.b", "rlpipe.schemas.c"]]


def test_an_upward_import_is_found(tmp_path):
    root = _tree(tmp_path, {
        "cluster/launch.py": "def go():\n    from rlpipe.pipelines.plan import Plan\n",
        "pipelines/plan.py": "from rlpipe.cluster import launch\nPlan = 1\n",
        "stages/common/io.py": "from rlpipe.stages.optimize import run\n",
        "stages/optimize/run.py": "from rlpipe.stages.common import io\n",
        "stages/score/run.py": "from ..optimize.run import x\n",
        "pipelines/cli.py": "from rlpipe.flows import run_flow\n",
        "pipelines/runner.py": "from rlpipe.flows import run_flow\n",
        "flows/run_flow.py": "from rlpipe.pipelines import runner\n",
    })
    graph, modules = import_graph(root)
    found = [line.split(": ", 1)[1] for line in upward_imports(graph, modules, root)]
    assert found == [
        "rlpipe.cluster.launch imports rlpipe.pipelines.plan",
        "rlpipe.pipelines.runner imports rlpipe.flows.run_flow",
        "rlpipe.stages.common.io imports rlpipe.stages.optimize.run",
    ]


@pytest.mark.parametrize("text", ["import rlpipe.schemas.b\n", "from . import b\n", "from .b import y\n"])
def test_each_import_form_is_an_edge(tmp_path, text):
    root = _tree(tmp_path, {"schemas/a.py": text, "schemas/b.py": "y = 1\n"})
    graph, _ = import_graph(root)
    assert graph["rlpipe.schemas.a"] == {"rlpipe.schemas.b": 1}

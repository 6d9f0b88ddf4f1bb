"""lclm's import graph runs one way: errors -> hardware (what a chip is) -> platforms (the
probe that chooses JAX's platform) -> storage -> writes -> the model families' declarations
(lclm.families: no JAX, read by the config's presets and choices) -> config -> logs/cli ->
ops -> parallel -> models -> hf -> data -> workdir (what a run's directory holds: checkpoints,
the train state's layout, resume rules, locks) -> eval -> generate -> train (the training
library and its program, whose stage gates score RULER with evaluation's code) -> extend ->
the checker, planner and converter CLIs. No module imports a higher layer, none imports lclm
inside a function (the old way to dodge a cycle), and so there are no cycles. Read from the
source (AST), nothing is imported."""

import ast
import os
import pathlib
import re
import subprocess
import sys

from support import ROOT

LAYERS = [
    "lclm.errors",
    "lclm.hardware",
    "lclm.platforms",
    "lclm.storage",
    "lclm.writes",
    "lclm.families",
    "lclm.config",
    "lclm.logs",
    "lclm.cli",
    "lclm.ops",
    "lclm.parallel",
    "lclm.models",
    "lclm.hf",
    "lclm.data",
    "lclm.workdir",
    "lclm.eval",
    "lclm.generate",
    "lclm.train",
    "lclm.extend",
    "lclm.check",
    "lclm.plan",
    "lclm.convert",
]


def _layer(module: str) -> int | None:
    """The layer of `module`: its longest prefix in LAYERS."""
    found = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS.index(max(found, key=len)) if found else None


def _modules():
    """(module name, its AST) of every file in lclm/."""
    for path in sorted(pathlib.Path(ROOT, "lclm").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        yield name, ast.parse(path.read_text())


def _lclm_imports(node) -> list[str]:
    """The lclm modules an import statement may load (`from lclm import hf` -> lclm.hf)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("lclm")]
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lclm"):
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def test_every_module_has_a_layer():
    assert [name for name, _ in _modules() if name != "lclm" and _layer(name) is None] == []


def test_imports_only_go_down_the_layers():
    upward = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            targets = [_layer(t) for t in _lclm_imports(node) if _layer(t) is not None]
            if targets and _layer(name) is not None and max(targets) > _layer(name):
                upward.append((name, node.lineno))
    assert upward == []


def test_no_lclm_import_inside_a_function():
    inside = []
    for name, tree in _modules():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside += [(name, n.lineno) for n in ast.walk(fn) if _lclm_imports(n)]
    assert inside == []


def test_no_import_cycles():
    graph = {name: {t for n in tree.body for t in _lclm_imports(n)} for name, tree in _modules()}
    graph = {k: {t for t in v if t in graph and t != k} for k, v in graph.items()}

    def reaches(start):
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        return seen

    assert [m for m in graph if m in reaches(m)] == []


# flax is the optional [nnx] extra: only the NNX view imports it (its old name imports the view)
def test_only_the_nnx_view_imports_flax():
    importers = {
        name
        for name, tree in _modules()
        for node in ast.walk(tree)
        if (
            isinstance(node, ast.Import) and any(a.name.split(".")[0] == "flax" for a in node.names)
        )
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flax")
    }
    assert importers == {"lclm.models.nnx_decoder"}


# `python -m lclm.train` runs the training program: the same one-line error and status as
# train.py
def test_python_m_lclm_train_runs_the_training_program(tmp_path):
    missing = str(tmp_path / "missing.py")
    runs = [
        subprocess.run(
            [sys.executable, *door, "--config", missing],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        for door in (["-m", "lclm.train"], ["train.py"])
    ]
    assert [r.returncode for r in runs] == [2, 2]
    assert runs[0].stderr == runs[1].stderr
    assert runs[0].stderr.count("\n") == 1 and runs[0].stderr.startswith("error: ")


def test_the_readme_lists_the_layers_as_this_file_holds_them():
    readme = pathlib.Path(ROOT, "README.md").read_text()
    listed = re.search(r"imports only go down: ([a-z_, ]+)\)", readme)
    assert listed, "README.md's line on tests/test_imports.py no longer lists the layers"
    assert listed.group(1).split(", ") == [layer.removeprefix("lclm.") for layer in LAYERS]

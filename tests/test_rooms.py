"""Rooms: who may import whom inside `workbench` (DESIGN.md), checked by parsing every module's imports.

`config` <- `models` <- `data`, `io`, `probes`, `train`, `evals`, `laws` <- `experiments` <- `viz`, `pipeline`, `cli`.
Every import counts, at module level or inside a function (a lazy import is still a dependency);
relative imports are resolved against the file's package. The checker is tested on a synthetic
package first, so a broken checker cannot pass the real one silently.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "workbench"

# rank of each room: a module may import its own room and lower ranks only (DESIGN.md "Rooms")
RANK = {"": 0, "config": 0, "models": 1, "data": 2, "io": 2, "locking": 2, "probes": 2, "train": 2, "optim": 2,
        "evals": 2, "laws": 2, "stats": 2, "experiments": 3, "viz": 4, "pipeline": 4, "cli": 4}
# stricter rules for three rooms (issue 12, item 3)
ONLY = {"config": {"config"}, "models": {"config", "models"},
        "probes": {"config", "models", "probes", "io", "data"}}
NEVER = {"viz": {"train", "experiments", "pipeline", "cli"}}


def module_name(path: Path, root: Path) -> tuple[str, str]:
    """Return (dotted module name, dotted package it lives in) of a file under the package folder `root`."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """Return (line, absolute module) for every import in the file that names a module of the package `root`.

    `from X import name` counts as X.name when that is a module or package of the tree, else as X.
    """
    top = root.name
    _, pkg = module_name(path, root)
    found = []

    def is_module(dotted: str) -> bool:
        rel = Path(*dotted.split(".")[1:])
        return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = pkg.split(".")
                if node.level - 1 >= len(base_parts):
                    raise ValueError(f"{path}:{node.lineno}: relative import beyond the package")
                base = ".".join(base_parts[:len(base_parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if base.split(".")[0] == top and is_module(sub) else base))
    return [(ln, m) for ln, m in found if m == top or m.startswith(top + ".")]


def room_of(module: str) -> str:
    """Return the room of a dotted module: its first component under the package ('' for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(root: Path) -> list[str]:
    """Return one line per forbidden import in the package at `root`: file, line, import and the rule it breaks."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        mod, _ = module_name(path, root)
        room = room_of(mod)
        if room == "":
            continue  # the package's own __init__: the public facade
        rel = path.relative_to(root.parent).as_posix()
        for line, target in imports_of(path, root):
            to = room_of(target)
            if to == room:
                continue
            why = None
            if room in ONLY and to not in ONLY[room]:
                why = f"{room}/ may import only {', '.join(sorted(ONLY[room]))}"
            elif to in NEVER.get(room, ()):
                why = f"{room}/ never imports {', '.join(sorted(NEVER[room]))}"
            elif to not in RANK or room not in RANK:
                why = f"room {to or room!r} has no place in the order; add it to RANK"
            elif RANK[to] > RANK[room]:
                why = f"{room} (rank {RANK[room]}) imports the higher room {to} (rank {RANK[to]})"
            if why:
                out.append(f"{rel}:{line}: imports {target}: {why}")
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Return {module: the package's modules it imports} for every file under `root` (lazy imports included)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        mod, _ = module_name(path, root)
        graph.setdefault(mod, set()).update(t for _, t in imports_of(path, root) if t != mod)
    return graph


def circles(root: Path) -> list[list[str]]:
    """Return every import circle of the package at `root`: each a sorted list of modules that reach one another.

    Strongly connected components of the import graph (Tarjan's algorithm), so a circle through any
    number of modules is found once, with all its members. A lazy import inside a function counts:
    it hides a circle from Python's import machinery, not from the design.
    """
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


# ---- the checker itself, on a synthetic package -------------------------------------------------------------
def write(root: Path, rel: str, text: str = "") -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))


@pytest.fixture
def fake(tmp_path):
    root = tmp_path / "workbench"
    for rel in ("__init__.py", "config.py", "io.py", "train.py", "pipeline.py", "experiments.py", "models/__init__.py",
                "models/layers.py", "probes/__init__.py", "viz/__init__.py", "data/__init__.py", "data/corpus.py"):
        write(root, rel)
    return root


def test_relative_imports_resolve_against_the_files_package(fake):
    write(fake, "models/looped.py", """\
        from . import layers
        from .layers import Block
        from .. import config
        from ..config import LoopConfig
        from ..data.corpus import Tokenizer
        import workbench.train as t
        from workbench import pipeline, __version__
        import numpy
        def lazy():
            from ..experiments import run
        """)
    got = imports_of(fake / "models" / "looped.py", fake)
    assert got == [(1, "workbench.models.layers"), (2, "workbench.models.layers"), (3, "workbench.config"),
                   (4, "workbench.config"), (5, "workbench.data.corpus"), (6, "workbench.train"),
                   (7, "workbench.pipeline"), (7, "workbench"), (10, "workbench.experiments")]
    write(fake, "models/__init__.py", "from .layers import Block\nfrom .. import io\n")
    assert imports_of(fake / "models" / "__init__.py", fake) == [(1, "workbench.models.layers"), (2, "workbench.io")]


def test_checker_lists_every_offending_file_and_import(fake):
    assert violations(fake) == []  # empty modules break no rule
    write(fake, "models/looped.py", "from ..config import X\nfrom . import layers\nfrom ..io import save\n")
    write(fake, "probes/lens.py", "from ..models import layers\nfrom ..io import provenance\n"
                                  "def f():\n    from ..train import Trainer\n")
    write(fake, "viz/explorer.py", "from ..probes import lens\nfrom ..experiments import run\n")
    write(fake, "data/corpus.py", "from .. import experiments\n")
    write(fake, "config.py", "import workbench.models\n")
    write(fake, "pipeline.py", "from .experiments import run\nfrom .viz import explorer\n")  # same rank: fine
    assert violations(fake) == [
        "workbench/config.py:1: imports workbench.models: config/ may import only config",
        "workbench/data/corpus.py:1: imports workbench.experiments: data (rank 2) imports the higher room "
        "experiments (rank 3)",
        "workbench/models/looped.py:3: imports workbench.io: models/ may import only config, models",
        "workbench/probes/lens.py:4: imports workbench.train: probes/ may import only config, data, io, models, "
        "probes",
        "workbench/viz/explorer.py:2: imports workbench.experiments: viz/ never imports cli, experiments, "
        "pipeline, train",
    ]


def test_an_unknown_room_is_reported_rather_than_allowed(fake):
    write(fake, "newroom.py")
    write(fake, "models/looped.py", "from ..newroom import x\n")
    write(fake, "train.py", "from .newroom import x\n")
    assert violations(fake) == [
        "workbench/models/looped.py:1: imports workbench.newroom: models/ may import only config, models",
        "workbench/train.py:1: imports workbench.newroom: room 'newroom' has no place in the order; add it to RANK",
    ]


def test_circles_are_found_through_lazy_imports_and_longer_rings(fake):
    assert circles(fake) == []
    write(fake, "models/looped.py", "from .layers import Block\n")
    write(fake, "models/layers.py", "def f():\n    from .looped import LoopLM\n")  # lazy: still a circle
    write(fake, "data/corpus.py", "from ..io import save\n")
    write(fake, "io.py", "from .train import x\n")
    write(fake, "train.py", "def g():\n    from .data.corpus import Tokenizer\n")  # a ring of three
    write(fake, "probes/__init__.py", "from ..models import layers\n")  # one way only: no circle
    assert circles(fake) == [["workbench.data.corpus", "workbench.io", "workbench.train"],
                             ["workbench.models.layers", "workbench.models.looped"]]


# ---- the real package ----------------------------------------------------------------------------------------
def test_no_module_imports_itself_back():
    found = circles(PACKAGE)
    assert not found, "import circles (each module reaches the others):\n  " + "\n  ".join(map(" <-> ".join, found))


def test_every_room_imports_only_what_it_may():
    found = violations(PACKAGE)
    assert not found, "imports that break the rooms (DESIGN.md):\n  " + "\n  ".join(found)


def test_the_real_package_is_parsed():
    mods = {module_name(p, PACKAGE)[0] for p in PACKAGE.rglob("*.py")}
    assert {"workbench.config", "workbench.models.looped", "workbench.probes", "workbench.viz.explorer"} <= mods
    assert any(m == "workbench.config" for _, m in imports_of(PACKAGE / "models" / "looped.py", PACKAGE))


# ---- one owner for the run folder: only io.RunDir spells a run file's name (issue 28) ----------------------
# The names RunDir owns, and the two suffixes of the folders beside a run. A Hugging Face folder's own
# config.json, model.safetensors and tokenizer.json are that library's names, not a run folder's: models/hf*.py
# write or read them.
RUN_FILE_NAMES = ("config.json", "tokenizer.json", "latest.json", "metrics.nc", "results.nc", "progress.json",
                  "run.json", "notebook.ipynb", "notebook.html", "experiment.json", "model.safetensors",
                  "optim.safetensors", "state.json", "kernel.log", ".partial", ".lock", ".attempt")
# (and a datasets save_to_disk folder's state.json, which data/sources.py recognises, and a model folder's
# tokenizer.json, which data/tokenizers.py reads)
HF_LAYOUT = {"workbench/models/hf.py": {"config.json", "tokenizer.json"}, "workbench/models/hf_looped.py": {"config.json", "model.safetensors"},
             "workbench/data/sources.py": {"state.json"}, "workbench/data/tokenizers.py": {"tokenizer.json"}}


def spelled_run_files(text: str, filename: str = "<text>") -> list[tuple[int, str]]:
    """Return (line, literal) for every string literal of Python source that spells a run file's name.

    A literal spells one when it is the name, ends with /name or .name (an f-string's tail, a suffix),
    so prose that mentions a file ("is it a finished run with results.nc?") in a message or docstring passes.
    """
    found = []
    tree = ast.parse(text, filename=filename)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            s = node.value.strip()
            for name in RUN_FILE_NAMES:
                if s == name or s.endswith("/" + name) or (name.startswith(".") and s.endswith(name)):
                    found.append((node.lineno, name))
    return sorted(found)


def test_the_spelling_check_finds_paths_f_strings_and_suffixes_but_not_prose():
    src = ('"""Reads results.nc."""\np = d / "results.nc"\nq = f"{d}/metrics.nc"\nr = d.with_name(d.name + ".partial")\n'
           'msg = "is it a finished run with results.nc?"\ndef f():\n    """Writes run.json."""\n    return "run.json"\n')
    assert spelled_run_files(src) == [(2, "results.nc"), (3, "metrics.nc"), (4, ".partial"), (8, "run.json")]
    assert spelled_run_files('x = "results.nc.bak"\ny = ".partially"\n') == []


def test_no_module_but_io_spells_a_run_file_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel == "workbench/io.py" or "__pycache__" in path.parts:
            continue
        for line, name in spelled_run_files(path.read_text(), rel):
            if name not in HF_LAYOUT.get(rel, ()):
                found.append(f"{rel}:{line}: {name}")
    assert not found, "run file names spelled outside io.RunDir:\n  " + "\n  ".join(found)


def test_notebooks_reach_run_files_through_the_library():
    import json

    found = []
    for nb in sorted((PACKAGE.parent / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "code":
                src = "".join(cell["source"])
                if not src.lstrip().startswith(("%", "!")):
                    found += [f"{nb.name} cell {i} line {ln}: {name}" for ln, name in spelled_run_files(src, nb.name)]
    assert not found, "notebooks spelling run file names (use workbench.io.RunDir / save_results):\n  " + "\n  ".join(found)


def test_no_module_is_over_700_lines():
    """One file reads as one thing (issue 28): a module past 700 lines is split by concept, as laws/, train/ and pipeline/ were."""
    long = {p.relative_to(PACKAGE.parent).as_posix(): n for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts and (n := len(p.read_text().splitlines())) > 700}
    assert not long, f"modules over 700 lines: {long}"

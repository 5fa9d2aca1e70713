"""The package's layering: its top-level pieces stand on floors, and no module imports one on a higher
floor than its own (`FLOORS`), nor one that leads back to it (no import circle). Every import statement
counts, at module level, inside a function (a deferred import is still a dependency) or under
TYPE_CHECKING, so that each module can be read, tested and moved with only what sits below it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tinydet"

# The floors, ground first: a piece (a top-level module or package of tinydet; "__init__" is the
# package's own) imports from its own floor and the ones below, never from a higher one.
FLOORS = (
    # the ground: errors, where files go, strict JSON, the config, hashes, the exact arithmetic
    ("errors", "paths", "jsonfile", "config", "hashing", "numerics", "__init__"),
    # pure functions over those: RoPE's frequencies, sampling, log-probabilities, text in and out
    ("rope", "sampling", "logprobs", "tokenizer", "chat", "structured"),
    ("arch",),  # architectures as data
    ("formats",),  # model files in, read through the specs
    ("registry",),  # known models' names to files, fetched and checked
    ("packing",),  # a checkpoint's matrices packed into panels, for either backend
    ("backends",),  # the forward pass on a device
    ("memory", "engine"),  # whether a load fits; the step-wise engine
    ("api",),
    ("tools",),  # verify, trace, golden, bench, convert
    ("serve",),
    ("cli", "__main__"),
)


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py under `root` (a package's is its __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports. `from P import n` names the submodule P.n where one
    exists, else P itself; importing a submodule's parent packages on the way is not counted (every
    module does that)."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # `import tinydet.a.b.c` of an attribute path: its module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def place(module: str) -> str:
    """The top-level piece of the package a module belongs to ("__init__" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def unplaced(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """The pieces of the graph's modules that stand on no floor."""
    listed = {p for floor in floors for p in floor}
    return sorted({place(m) for m in graph} - listed)


def upward(graph: dict[str, set[str]], floors=FLOORS) -> list[tuple[str, str]]:
    """(importer, imported) for every import of a module on a higher floor than the importer's."""
    level = {p: i for i, floor in enumerate(floors) for p in floor}
    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if level.get(place(t), -1) > level.get(place(m), len(floors)))


def test_the_checker_sees_a_circle(tmp_path):
    """A deferred import and a TYPE_CHECKING one close circles too; a parent importing its children
    does not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import g\n")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import g\n")
    (pkg / "sub" / "leaf.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n"
                                         "def g():\n    pass\n")
    (pkg / "b.py").write_text("import pkg.sub.leaf\nfrom .sub.leaf import g\n")
    graph = import_graph(pkg)
    assert graph["pkg.b"] == {"pkg.sub.leaf"}
    assert graph["pkg"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.leaf"]]


def test_the_checker_sees_an_import_running_up(tmp_path):
    """A deferred import and a TYPE_CHECKING one run up a floor too, from a package's module and from
    its __init__; an import down a floor or within one does not, and a piece on no floor is named."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("def f():\n    from ..high import h\n")
    (pkg / "low" / "leaf.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.high\n"
                                         "from .. import side\n")
    (pkg / "side.py").write_text("")
    (pkg / "high.py").write_text("from .low.leaf import g\nfrom . import side\ndef h():\n    pass\n")
    (pkg / "stray.py").write_text("from . import high\n")
    floors = (("__init__", "low", "side"), ("high",))
    graph = import_graph(pkg)
    assert upward(graph, floors) == [("pkg.low", "pkg.high"), ("pkg.low.leaf", "pkg.high")]
    assert unplaced(graph, floors) == ["stray"]
    assert upward(graph, (("__init__", "low", "side", "high"),)) == []  # one floor: nothing runs up


def test_no_import_circle_in_the_package():
    assert circles(import_graph()) == []


def test_no_import_runs_up_a_floor_in_the_package():
    graph = import_graph()
    assert unplaced(graph) == []
    assert upward(graph) == []
    listed = [p for floor in FLOORS for p in floor]
    assert len(listed) == len(set(listed)) and set(listed) <= {place(m) for m in graph}  # each piece once, none gone


def test_names_need_no_kernels():
    """The dtypes and type names (`packing/names.py`) import without numba, and the command line takes
    them from there: it imports neither the packers nor the CPU kernels (numba it imports anyway, for the
    engine's log-probabilities and the thread count)."""
    code = ("import sys, tinydet.packing.names\n"
            "print('numba' in sys.modules)\n"
            "import tinydet.cli\n"
            "print(sorted(m for m in sys.modules if m.startswith(('tinydet.packing', 'tinydet.backends.cpu'))))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["False", "['tinydet.packing', 'tinydet.packing.names']"]

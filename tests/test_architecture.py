"""The house rules of docs/ARCHITECTURE.md, checked by reading the source (``ast``; nothing is imported).

The module graph has an edge ``a -> b`` for every ``import``/``from ... import`` in ``a`` that names
``b``, at module level or inside a function (a lazy import is still a dependency), with these rules:

* ``from pkg import name`` depends on the submodule ``pkg.name`` when that file exists, else on
  ``pkg`` itself (its ``__init__``: the name is read from the package module, so its ``__init__``
  must have bound it first, even if it only re-exports it from a sibling).
* ``import pkg.sub`` depends on ``pkg.sub`` only. Python runs ``pkg/__init__.py`` first, but that
  implicit step is not an edge: counting it would make every submodule of a package whose
  ``__init__`` re-exports its submodules look like a cycle. A submodule that takes a name from its
  own package's ``__init__`` (``from pkg import NAME``) does get the edge ``pkg.sub -> pkg``: it is
  real, and a cycle through it fails as soon as the ``__init__`` imports that submodule first.
* Imports under ``if __name__ == "__main__":`` (entry points) and ``if TYPE_CHECKING:`` (type
  hints) are not dependencies and are left out; their ``else:`` branches count.
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ddtrain"
ROOT = "ddtrain"
MAX_TOP_LEVEL_MODULES = 5

# Package-level layering: the rule `cli -> training, bench, report, cluster -> reliability, observe,
# sync -> comm -> distributed -> errors`, with config, costmodel, models and data placed where they belong
# and the order inside a tier written out. A package ("ddtrain" is ddtrain/__init__.py, the library
# facade; "config", "errors", "__main__" are the top-level modules) may import only what its line
# names. Anything else is a violation; a new package fails until it is given a line here.
LIBRARIES = {"training", "bench", "report", "cluster", "config", "reliability", "observe", "sync", "comm",
             "costmodel", "models", "data", "recipe", "distributed", "errors", "version"}
ALLOWED: dict[str, tuple[set[str], str]] = {
    "__main__": ({"cli", "distributed"}, "python -m ddtrain runs the command table; a launched rank exits via dist.launch"),
    "ddtrain": ({"training", "config", "distributed", "errors"}, "the facade re-exports init, prepare, fit, TrainConfig"),
    "cli": (LIBRARIES | {"ddtrain"}, "every command is a thin front end over the libraries (and prints __version__)"),
    "report": ({"bench", "observe", "sync", "costmodel", "config", "distributed", "errors"},
               "renders what bench and observe wrote, with a strategy's cost formula beside it"),
    "bench": ({"training", "cluster", "config", "reliability", "observe", "sync", "comm", "costmodel", "models",
               "data", "distributed", "errors"}, "times the real loop and collectives; the emulated link rate scales busbw"),
    "training": ({"config", "reliability", "observe", "sync", "comm", "costmodel", "models", "data", "recipe",
                  "distributed", "errors"},
                 "the loop composes the strategy, the reliability components, the monitors, the model, the data, the recipe"),
    "cluster": ({"distributed", "errors"}, "emulated nodes launch ranks like real ones; nothing here knows about training"),
    # data and recipe are leaves so that config can nest their sections: the recipe's settings and code
    # are no part of training (which config lies below), only used by it
    "config": ({"data", "recipe", "reliability", "observe", "sync", "distributed", "errors"},
               "TrainConfig gathers the sections these own; data and recipe are leaves (they import only errors)"),
    "sync": ({"reliability", "observe", "comm", "costmodel", "distributed", "errors"},
             "strategies over the collectives; the parameter servers call fault-injection points"),
    "reliability": ({"observe", "comm", "distributed", "errors"},
                    "checks replicas over comm, writes its records through observe.files"),
    "observe": ({"comm", "distributed", "errors"}, "traffic counters come from comm; files are written by rank 0"),
    "comm": ({"distributed", "errors"}, "collectives over point-to-point of the process group; nothing about training"),
    "costmodel": ({"comm", "distributed", "errors"}, "000 Table 5.1, and predictions from the cost formula each "
                  "comm algorithm owns"),
    "models": ({"errors"}, "one module per family; nothing about distribution"),
    "data": ({"errors"}, "one module per format; sharding is arithmetic on indices, not on process groups"),
    "recipe": ({"errors"}, "batch arithmetic, optimizer, lr schedule, clipping over torch; knows no distribution, "
               "no loop"),
    "distributed": ({"errors"}, "launcher environment and runtime: the bottom of the stack above errors"),
    "errors": (set(), "the exception types; imports nothing of ddtrain"),
    "version": (set(), "the version string, named by records and checkpoints; imports nothing"),
}
for _deps, _ in ALLOWED.values():  # like errors, the version string may be named from anywhere
    if _deps is not LIBRARIES:
        _deps.add("version")


def _modules(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``src`` (a package is its __init__.py)."""
    modules = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_exempt_block(node: ast.If) -> bool:
    """``if __name__ == "__main__":`` or ``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:``."""
    test = node.test
    if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
        return True
    if isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
        return True
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom in the tree, at any depth, except inside the exempt blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_exempt_block(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _edges(modules: dict[str, Path]) -> tuple[dict[str, dict[str, int]], list[str]]:
    """module -> {imported module: first line number}, and the ddtrain imports that name no module."""
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    unresolved, root = [], min(modules, key=len)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.append(submodule if submodule in modules else source)
            for target in targets:
                if target.split(".")[0] != root:
                    continue
                if target not in modules:
                    unresolved.append(f"{name} (line {node.lineno}) imports {target}")
                    continue
                if target != name:
                    graph[name][target] = min(node.lineno, graph[name].get(target, node.lineno))
    return graph, unresolved


def _cycles(graph: dict[str, dict[str, int]]) -> list[tuple[list[str], set[str]]]:
    """Per strongly connected component (Tarjan): one cycle (a module chain, first == last), the component."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # shortest way from the first member back to itself, inside the component
        start = min(component)
        paths, seen, cycle = [[start]], {start}, None
        while paths and cycle is None:
            nxt = []
            for path in paths:
                for w in sorted(graph[path[-1]]):
                    if w == start:
                        cycle = path + [start]
                        break
                    if w in component and w not in seen:
                        seen.add(w)
                        nxt.append(path + [w])
                if cycle:
                    break
            paths = nxt
        cycles.append((cycle, component))
    return cycles


def _describe(cycle: list[str], component: set[str], graph: dict[str, dict[str, int]]) -> str:
    """``a (line 3) -> b (line 9) -> a``: each module with the line of its import of the next."""
    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    text = " -> ".join(steps + [cycle[-1]])
    others = sorted(component - set(cycle))
    return text + (f"\n      (the same knot also holds: {', '.join(others)})" if others else "")


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def test_every_ddtrain_import_names_a_module():
    _, unresolved = _edges(_modules())
    assert not unresolved, "imports of ddtrain modules that do not exist:\n  " + "\n  ".join(unresolved)


def test_no_import_cycle_between_modules():
    graph, _ = _edges(_modules())
    cycles = _cycles(graph)
    assert not cycles, ("import cycles, each module with the line of its import of the next (a lazy import "
                        "counts; to break one, import the name from the submodule that defines it, or move the "
                        "shared thing down):\n  " + "\n  ".join(_describe(c, k, graph) for c, k in cycles))


def test_argparse_lives_only_in_cli():
    offenders = []
    for name, path in _modules().items():
        if _package(name) == "cli":
            continue
        for node in _import_nodes(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n.split(".")[0] == "argparse" for n in names):
                offenders.append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
    assert not offenders, "argparse imported outside src/ddtrain/cli/: " + ", ".join(offenders)


def test_few_modules_at_the_top():
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules at the top of src/ddtrain (at most " \
        f"{MAX_TOP_LEVEL_MODULES}; put the rest in the package of their role): {', '.join(top)}"


def test_every_package_has_a_place_in_the_layering():
    packages = {_package(name) for name in _modules()}
    assert packages <= set(ALLOWED), f"packages with no line in ALLOWED: {sorted(packages - set(ALLOWED))}"


def test_packages_import_only_downwards():
    graph, _ = _edges(_modules())
    violations = []
    for module, targets in sorted(graph.items()):
        source = _package(module)
        allowed = ALLOWED.get(source, (set(), ""))[0]
        for target, line in sorted(targets.items()):
            if _package(target) not in allowed | {source}:
                violations.append(f"{source} -> {_package(target)}: {module} (line {line}) imports {target}")
    assert not violations, "imports against the layering of docs/ARCHITECTURE.md:\n  " + "\n  ".join(violations)


# The checker itself, on small made-up packages: strict where the dependency is real, silent where not.

def _package_tree(tmp_path: Path, files: dict[str, str]) -> dict[str, dict[str, int]]:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    graph, unresolved = _edges(_modules(tmp_path / "pkg"))
    assert not unresolved
    return graph


def test_checker_a_reexporting_init_is_no_cycle(tmp_path):
    graph = _package_tree(tmp_path, {
        "__init__.py": "from pkg.sub.a import A\nfrom pkg.sub.b import B\n",
        "sub/__init__.py": "from pkg.sub.a import A\nfrom pkg.sub.b import B\n",
        "sub/a.py": "A = 1\n",
        "sub/b.py": "from pkg.sub.a import A\nfrom pkg.sub import a\nB = A\n"})
    assert graph["pkg.sub.b"] == {"pkg.sub.a": 1}      # the implicit run of pkg/sub/__init__.py is no edge
    assert _cycles(graph) == []


def test_checker_a_name_taken_from_its_own_init_is_a_cycle(tmp_path):
    graph = _package_tree(tmp_path, {
        "__init__.py": "LIMIT = 3\nfrom pkg.b import run\n",
        "b.py": "def run():\n    from pkg import LIMIT\n    return LIMIT\n"})
    cycles = _cycles(graph)
    assert [c for c, _ in cycles] == [["pkg", "pkg.b", "pkg"]]
    assert _describe(*cycles[0], graph) == "pkg (line 2) -> pkg.b (line 2) -> pkg"


def test_checker_entry_points_and_type_hints_are_no_dependencies(tmp_path):
    graph = _package_tree(tmp_path, {
        "__init__.py": "",
        "cli.py": "from pkg import lib\n",
        "lib.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.cli import X\n"
                   "else:\n    from pkg import other\n"
                   "if __name__ == '__main__':\n    from pkg.cli import main\n"),
        "other.py": ""})
    assert graph["pkg.lib"] == {"pkg.other": 5}
    assert _cycles(graph) == []

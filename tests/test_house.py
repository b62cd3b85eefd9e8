"""The house's shape: no import cycles (imports inside functions and type-only imports
count), no file over 800 lines, no function over 80 and no class over 400 (but the known
offenders, which may only shrink), no private name used across modules. The layers themselves are import-linter's contract in pyproject.toml, run by .ci/run
and by the last tests here."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import networkx as nx

try:
    import tomllib
except ImportError:  # Python 3.10: import-linter's own dependency reads TOML there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autopar"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule; `from pkg import name` the package
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for target in _imports(name, path, modules):
            graph.add_edge(name, target)
    return graph


def test_no_import_cycles():
    graph = import_graph()
    assert graph.number_of_edges() > 50  # the graph was read
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert cycles == [], f"import cycles: {cycles}"


# Today's files over 800 lines and functions over 80 (path: lines): each may only shrink, and
# leaves this list once it is under the limit.
LONG_FILES: dict[str, int] = {}
LONG_FUNCTIONS: dict[str, int] = {}
MAX_FILE_LINES, MAX_FUNCTION_LINES = 800, 80


def function_lengths(path: Path) -> dict[str, int]:
    """Lines of every function in the file (def line to last line), by qualified name."""
    out = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return out


def _over_the_limits() -> tuple[dict[str, int], dict[str, int]]:
    files, functions = {}, {}
    for path in PACKAGE.rglob("*.py"):
        where = str(path.relative_to(ROOT))
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES:
            files[where] = n
        functions.update({f"{where}:{name}": n for name, n in function_lengths(path).items()
                          if n > MAX_FUNCTION_LINES})
    return files, functions


def test_no_file_over_800_lines_and_no_function_over_80():
    files, functions = _over_the_limits()
    for found, known, what in [(files, LONG_FILES, "file"), (functions, LONG_FUNCTIONS,
                                                                 "function")]:
        new = {k: n for k, n in found.items() if k not in known}
        assert new == {}, f"{what}s over the limit (split them into well-named helpers): {new}"
        grown = {k: (n, known[k]) for k, n in found.items() if n > known[k]}
        assert grown == {}, f"known long {what}s may only shrink (now, then): {grown}"
        done = sorted(set(known) - set(found))
        assert done == [], f"{done} now within the limit: take them off the known list"


def test_function_lengths_count_methods_and_nested_functions(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("class C:\n    def m(self):\n        def inner():\n            pass\n"
                 "        return 1\n\n\ndef f():\n    pass\n")
    assert function_lengths(a) == {"C.m": 4, "C.m.inner": 2, "f": 2}


def test_no_class_over_400_lines():
    big = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                big[f"{path.relative_to(ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert big == {}


def test_cycle_finder_sees_imports_inside_functions(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from autopar import b\n")
    assert _imports("autopar.a", a, {"autopar.a": a, "autopar.b": a}) == {"autopar.b"}
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import autopar.b\n")
    assert _imports("autopar.a", a, {"autopar.a": a, "autopar.b": a}) == {"autopar.b"}


def private_imports(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """`from autopar.x import _name` and `x._name` (x an autopar module bound by an import)
    in module `name`, each as 'line: what'."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base == name:
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    bound.add(alias.asname or alias.name)
                elif base in modules and alias.name.startswith("_"):
                    found.append(f"{node.lineno}: from {base} import {alias.name}")
        elif isinstance(node, ast.Import):
            bound.update(a.asname for a in node.names if a.asname and a.name in modules)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in bound and node.attr.startswith("_") and \
                not node.attr.startswith("__"):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_names_across_modules():
    modules = _modules()
    offenders = {name: hits for name, path in modules.items()
                 if (hits := private_imports(name, path, modules))}
    assert offenders == {}, "private names used across modules (give them a public name): " \
                            f"{offenders}"


def test_private_name_finder_sees_imports_and_attributes(tmp_path):
    a = tmp_path / "a.py"
    mods = {"autopar.a": a, "autopar.b": a}
    a.write_text("from autopar.b import _hidden, shown\n")
    assert private_imports("autopar.a", a, mods) == ["1: from autopar.b import _hidden"]
    a.write_text("from . import b\nimport autopar.b as bee\nb._x, bee._y, b.__name__, b.z\n")
    assert sorted(private_imports("autopar.a", a, mods)) == ["3: b._x", "3: bee._y"]
    a.write_text("from autopar.a import _mine\n")  # a module's own names are its own
    assert private_imports("autopar.a", a, mods) == []


def test_layers_contract_holds():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    done = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 1 kept, 0 broken" in done.stdout


def _layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = config["contracts"]
    assert config["exclude_type_checking_imports"] is False  # type-only imports obey too
    return [layer.split(" | ") for layer in contract["layers"]]


def test_layers_read_top_down():
    """The report sits above the planner and runtime it describes, and the model zoo above
    the kernels and cost model that run and price its layers."""
    where = {name: i for i, names in enumerate(_layers()) for name in names}
    for upper, lower in [("report", "search"), ("report", "runtime"), ("report", "plans"),
                         ("models", "kernels"), ("models", "cost")]:
        assert where[f"autopar.{upper}"] < where[f"autopar.{lower}"], (upper, lower)


def test_only_the_cli_and_the_planner_import_the_zoo():
    """The zoo is a user of the house (its MoE layer's routing lives in kernels/): the kernels,
    the cost model and everything else below the planner price and run any model without it."""
    graph = import_graph()
    users = {src for src, dst in graph.edges
             if dst.startswith("autopar.models") and not src.startswith("autopar.models")}
    assert users == {"autopar.cli", "autopar.search.planner"}

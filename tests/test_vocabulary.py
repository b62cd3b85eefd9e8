"""autopar/modes.py is the only place the spellings of mesh axes, tensor and sequence modes,
recompute modes, schedules and precisions live: everywhere else a lookup, comparison,
default or table entry names the constant (`mesh[CP]`, never `mesh["cp"]`).

The rule, on every autopar module but modes.py: a string constant equal to one of those
spellings fails, unless it is prose, that is
  - a docstring (of the module, a class or a function),
  - the literal text of an f-string (`f"cp={mesh[CP]}"`: "cp=" is prose, the lookup is not),
  - part of a `raise` statement (an error sentence may name a mode as users write it);
or one of ALLOWED, a word of another vocabulary that shares a spelling (with its reason)."""

import ast
from pathlib import Path

from autopar import modes

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autopar"

# Every str constant modes.py names (PP, TP_1D, RING, NO_RECOMPUTE, FP32, ...).
SPELLINGS = {value for name, value in vars(modes).items()
             if name.isupper() and isinstance(value, str)}

# (file, spelling): why that file's literal is not the mode of the same name.
ALLOWED = {
    ("autopar/cost/comm.py", modes.RING):
        "the ring collective algorithm (alpha-beta pricing), not ring attention",
    ("autopar/cost/hardware.py", modes.RING):
        "a profile's collective algorithms: ring, tree, hierarchical",
    ("autopar/cost/calibrate.py", modes.RING):
        "the collective algorithm a calibration fits, not ring attention",
    ("autopar/runtime/pipeline.py", modes.FULL):
        "torch pipelining's backward_type (input, weight or full), not full recomputation",
}


def _prose(tree: ast.AST) -> set[int]:
    """ids of the constants that are prose: docstrings, f-string text, raise statements."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
        elif isinstance(node, ast.JoinedStr):
            out.update(id(part) for part in node.values if isinstance(part, ast.Constant))
        elif isinstance(node, ast.Raise):
            out.update(id(inner) for inner in ast.walk(node))
    return out


def spelled_out(source: str, where: str) -> list[str]:
    """'line: spelling' for every mode spelled as a string literal in `source` (the module
    at `where`, relative to the repository) outside prose and ALLOWED."""
    tree = ast.parse(source)
    prose = _prose(tree)
    return [f"{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in SPELLINGS and id(node) not in prose
            and (where, node.value) not in ALLOWED]


def test_the_spellings_cover_every_vocabulary():
    for name in ("PP", "DP", "CP", "TP", "EP", "TP_1D", "TP_25D", "RING", "ULYSSES", "ZIGZAG",
                 "MEGATRON_SP", "NO_RECOMPUTE", "SELECTIVE", "FULL", "GPIPE", "ZERO_BUBBLE",
                 "FP32", "BF16", "FP16", "FP8"):
        assert getattr(modes, name) in SPELLINGS


def test_modes_are_spelled_only_in_modes_py():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where != "autopar/modes.py" and (hits := spelled_out(path.read_text(), where)):
            found[where] = hits
    assert found == {}, f"name the constant from autopar.modes instead: {found}"


def test_a_planted_literal_is_found_and_prose_is_not():
    planted = '''
def f(mesh, recompute="none"):
    """Splits over "cp"."""
    if mesh["cp"] > 1 and recompute in ("selective", "full"):
        raise ValueError("cp")
    return f"cp={mesh[CP]}", {"bf16": 2}, "ring"
'''
    assert sorted(spelled_out(planted, "autopar/x.py")) == [
        "2: 'none'", "4: 'cp'", "4: 'full'", "4: 'selective'", "6: 'bf16'", "6: 'ring'"]
    # the allowance is per file: the collective algorithm in comm.py, nowhere else
    assert "6: 'ring'" not in spelled_out(planted, "autopar/cost/comm.py")


def test_every_allowance_is_still_needed():
    for where, spelling in ALLOWED:
        source = (ROOT / where).read_text()
        tree = ast.parse(source)
        prose = _prose(tree)
        assert any(isinstance(n, ast.Constant) and n.value == spelling and id(n) not in prose
                   for n in ast.walk(tree)), f"{where} no longer spells {spelling!r}: drop it"

"""The README's first command block works as written: its explain command, its test command."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _first_command_block() -> list[str]:
    """The commands of the README's first fenced block, split on `&&`, in order."""
    block = re.search(r"^```[^\n]*\n(.*?)^```", (ROOT / "README.md").read_text(),
                      re.DOTALL | re.MULTILINE)
    assert block, "README.md has no fenced command block"
    return [part.strip() for line in block.group(1).splitlines() if line.strip()
            for part in line.split("&&")]


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_readme_explain_command_runs_and_names_mesh_and_layers():
    explain = [c for c in _first_command_block() if c.startswith("autopar explain ")]
    assert explain, "the README's first block has no `autopar explain ...` command"
    argv = shlex.split(explain[0])[1:]
    done = subprocess.run([sys.executable, "-m", "autopar.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    mesh = re.search(r"\bmesh\s+pp=(\d+)\s+(?:x\s+)?dp=(\d+)\s+(?:x\s+)?cp=(\d+)\s+"
                     r"(?:x\s+)?tp=(\d+)", out)
    assert mesh, f"the output names no mesh:\n{out}"
    pp, dp, cp, tp = map(int, mesh.groups())
    if _option(argv, "--world"):
        assert pp * dp * cp * tp == int(_option(argv, "--world")), mesh.group(0)
    if _option(argv, "--tp"):
        assert tp == int(_option(argv, "--tp")), mesh.group(0)
    # a row per layer (or per run of repeated layers), named by module path: blocks.0 ...
    first_words = [line.split()[0] for line in out.splitlines()
                   if line.startswith("  ") and line.strip()]
    layers = [w for w in first_words if re.fullmatch(r"[A-Za-z_][\w.]*\.\d+", w)]
    assert layers, f"the output names no layers:\n{out}"


def test_readme_test_command_is_the_one_ci_runs():
    readme = [c for c in _first_command_block() if "pytest" in c]
    assert readme == ["python -m pytest -q"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if "pytest" in line and not line.lstrip().startswith(("#", "echo"))]
    assert ci == readme


def _python_block_after(heading: str) -> str:
    """The first ```python block of the README section under `heading`."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n{heading}\n")
    block = re.search(r"^```python\n(.*?)^```", text[start:], re.DOTALL | re.MULTILINE)
    assert block, f"README.md has no python block under {heading}"
    return block.group(1)


def test_readme_checkpoint_snippet_runs(tmp_path):
    """The Checkpoints snippet runs as written (in a scratch directory) and leaves a
    published checkpoint that `latest` names."""
    done = subprocess.run([sys.executable, "-c", _python_block_after("### Checkpoints")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000001"
    assert (tmp_path / "checkpoints" / "step-00000001" / ".metadata").is_file()

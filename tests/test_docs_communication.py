"""Every command of docs/communication.md runs as written.

```bash lines are commands run from the repository root (torchrun's 4 processes too, which
check measured == predicted on every rank); ```python blocks are scripts, run in this
process.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "communication.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", PAGE, flags=re.S)
COMMANDS = [line for kind, text in BLOCKS if kind == "bash" for line in text.splitlines()
            if line.strip()]


def test_the_page_has_commands_and_scripts():
    assert len(COMMANDS) == 2 and any(kind == "python" for kind, _ in BLOCKS)


@pytest.mark.parametrize("line", COMMANDS)
def test_each_command_succeeds(line):
    argv = shlex.split(line)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run"] + argv[1:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "every rank: measured equals predicted" in done.stdout


@pytest.mark.parametrize("script", [text for kind, text in BLOCKS if kind == "python"])
def test_each_script_runs(script):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script, "docs/communication.md", "exec"), {})
    assert out.getvalue().strip() == "{} {}"

"""Every command of docs/planning.md runs as written.

```bash lines are `autopar` commands that succeed; ```text blocks hold `$ autopar ...`
lines, each followed by the one line it must print on stderr (a refusal, exit status 2);
```python blocks are scripts, run in this process.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from autopar.cli import main

PAGE = (Path(__file__).resolve().parent.parent / "docs" / "planning.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", PAGE, flags=re.S)


def _commands(lang: str) -> list[str]:
    return [line for kind, text in BLOCKS if kind == lang for line in text.splitlines()
            if line.strip()]


@pytest.mark.parametrize("line", _commands("bash"))
def test_each_command_succeeds(line, capsys):
    argv = shlex.split(line)
    assert argv[0] == "autopar"
    assert main(argv[1:]) == 0
    assert "autopar plan for" in capsys.readouterr().out


REFUSALS = [(lines[i][2:], lines[i + 1]) for lines in
            ([ln for ln in text.splitlines() if ln.strip()] for kind, text in BLOCKS
             if kind == "text") for i in range(0, len(lines), 2)]


@pytest.mark.parametrize("command, message", REFUSALS, ids=[c for c, _ in REFUSALS])
def test_each_refusal_prints_what_the_page_shows(command, message, capsys):
    argv = shlex.split(command)
    assert argv[0] == "autopar"
    assert main(argv[1:]) == 2
    assert capsys.readouterr().err == message + "\n"


@pytest.mark.parametrize("script", [text for kind, text in BLOCKS if kind == "python"])
def test_each_script_runs(script):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script, "docs/planning.md", "exec"), {})
    assert "6.71e+11 parameters" in out.getvalue()
    assert "out_features=576" in out.getvalue()

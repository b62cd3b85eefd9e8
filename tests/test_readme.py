"""Every command and snippet of the documentation runs as written.

The documentation is README.md and every page docs/*.md (found by glob, so a page added
there is run too). Its fenced blocks are read from the pages, so a command added there is
run here. Each line of a ```bash block is a command (`&&` separates more than one); each
```python block is a script; each ```text block under Troubleshooting is an error message.
Commands run in a scratch directory that links the repository's examples/, benchmarks/ and
docs/, so they read the repository's scripts and write nothing into it: `autopar` is
autopar.cli.main (what the console script calls), `python` this interpreter (Python
scripts run in children forked from the test pools' preloaded fork server: tests/forked.py),
`torchrun --standalone` one such child per rank with the variables torchrun gives its
workers (tests/forked.py's stand-in, checked against a real torchrun by
test_the_torchrun_stand_in_sets_what_torchrun_sets). Each run is checked on what it prints
or writes, not only its exit status.

The exceptions, each with its own test: the install lines (pip, apt-get) must be the ones
.ci/run executes, since CI runs .ci/run from a bare Python; `python -m pytest -q` must be
the command .ci/run calls; the benchmarks and the screenshot script take minutes, so they
must exist and answer --help with the options the pages give them. A command of any
other kind fails `test_every_command_is_covered`.

The README stays a newcomer's page: at most 300 lines, linking every docs/ page, and every
page opens with its title and a one-line purpose.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from forked import TORCHRUN_OWN, run_script, run_scripts, run_torchrun, torchrun_env

import autopar
from autopar.cli import main as autopar_main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = {p.relative_to(ROOT).as_posix(): p.read_text() for p in PAGES}
README = TEXT["README.md"]
README_MAX_LINES = 300
LINKED = ("examples", "benchmarks", "docs")  # repository folders commands name
LONG_SCRIPTS = ("benchmarks/", "docs/")  # minutes each: --help only
TIMEOUT = 900  # the machine may be shared: generous


@dataclass(frozen=True)
class Block:
    page: str  # README.md or docs/<topic>.md
    lang: str
    text: str
    heading: str  # the nearest heading above the block
    line: int

    @property
    def id(self) -> str:
        return f"{self.heading} ({self.page}:{self.line})"


def _headings(text: str) -> list[tuple[int, int, str]]:
    """(line, level, title) of each heading, outside fenced blocks (where `# ` is a comment)."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^(#+) (.+)$", line)):
            out.append((number, len(m.group(1)), m.group(2)))
    return out


HEADINGS = {page: _headings(text) for page, text in TEXT.items()}


def _blocks(page: str) -> list[Block]:
    out, text = [], TEXT[page]
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        line = text[:m.start()].count("\n") + 1
        above = [title for number, _, title in HEADINGS[page] if number < line]
        out.append(Block(page, m.group(1), m.group(2), above[-1] if above else "", line))
    return out


BLOCKS = [b for page in TEXT for b in _blocks(page)]


def _section(name: str, page: str | None = None) -> list[Block]:
    """The blocks from the heading `name` (on `page`, or the one page that has it) to the
    next heading of its level or higher."""
    found = [(p, number, level) for p, headings in HEADINGS.items() if page in (None, p)
             for number, level, title in headings if title == name]
    assert len(found) == 1, f"{len(found)} headings {name!r} in {page or 'the pages'}"
    (page, first, level), = found
    last = next((number for number, lv, _ in HEADINGS[page] if number > first and lv <= level),
                TEXT[page].count("\n") + 2)
    return [b for b in BLOCKS if b.page == page and first < b.line < last]


def _commands(block: Block) -> list[list[str]]:
    """The commands of a bash block, each as argv, in order."""
    out = []
    for line in block.text.splitlines():
        argv = shlex.split(line, comments=True)
        while argv:
            cut = argv.index("&&") if "&&" in argv else len(argv)
            out.append(argv[:cut])
            argv = argv[cut + 1:]
    return out


def _kind(argv: list[str]) -> str | None:
    """What a README command is, for this file; None: not covered."""
    if argv[:2] == ["pip", "install"]:
        return "pip"
    if argv[:2] == ["apt-get", "install"]:
        return "apt"
    if argv[:3] == ["python", "-m", "pytest"]:
        return "pytest"
    if argv[:1] == ["python"] and len(argv) > 1 and argv[1].startswith(LONG_SCRIPTS):
        return "long"
    if argv[:2] in (["autopar", "explain"], ["autopar", "search"]):
        return "plan"
    if argv[:2] == ["autopar", "calibrate"]:
        return "calibrate"
    if argv[:1] == ["torchrun"]:
        return "torchrun"
    if argv[:1] == ["python"] and len(argv) > 1 and argv[1] in EXAMPLE_CHECKS:
        return "example"
    return None


# what each example script other than train_gpt.py prints when it did its job
EXAMPLE_CHECKS = {
    "examples/check_comm.py": lambda out: "every rank: measured equals predicted" in out,
    "examples/train_long.py": lambda out: re.search(r"^step \d+ \| loss [\d.]+ \|", out,
                                                    re.MULTILINE) is not None,
}


BASH = [b for b in BLOCKS if b.lang == "bash"]
ALL_COMMANDS = [(b, argv) for b in BASH for argv in _commands(b)]
RUN_KINDS = ("plan", "calibrate", "torchrun", "example")  # run by test_bash_block


# ---------------------------------------------------------------- the pages' shape


def test_readme_is_a_newcomers_page():
    lines = len(README.splitlines())
    assert lines <= README_MAX_LINES, \
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move a topic to docs/"


def _links(page: str) -> list[str]:
    """The targets of the page's markdown links and images, outside fenced blocks."""
    prose = re.sub(r"^```.*?^```", "", TEXT[page], flags=re.DOTALL | re.MULTILINE)
    return re.findall(r"\]\(([^)\s]+)\)", prose)


def _anchor(title: str) -> str:
    """The anchor a heading gets: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_readme_links_every_docs_page():
    linked = {(ROOT / target.split("#")[0]).resolve() for target in _links("README.md")}
    missing = [p.relative_to(ROOT).as_posix() for p in PAGES[1:] if p.resolve() not in linked]
    assert PAGES[1:] and not missing, f"README.md links no {missing}: add a line under Documentation"


def test_every_page_opens_with_a_title_and_a_one_line_purpose():
    for page, text in TEXT.items():
        lines = text.splitlines()
        assert re.match(r"^# \S", lines[0]) and lines[1] == "", \
            f"{page}: the first line is no `# Title` followed by a blank line"
        if page != "README.md":
            assert lines[2].strip() and lines[3] == "", \
                f"{page}: the title is not followed by one line that says what the page is for"


def test_every_relative_link_resolves():
    """Each link to a file of the repository names one that exists, and each #anchor a
    heading of its page."""
    for page in TEXT:
        for target in _links(page):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            file = (ROOT / page).parent / path if path else ROOT / page
            assert file.exists(), f"{page}: the link {target} names no file"
            if anchor:
                linked = file.resolve().relative_to(ROOT.resolve()).as_posix()
                titles = [_anchor(title) for _, _, title in HEADINGS.get(linked, [])]
                assert anchor in titles, f"{page}: the link {target} names no heading of {linked}"


def test_every_block_is_bash_python_or_text():
    for b in BLOCKS:
        assert b.lang in ("bash", "python", "text", ""), \
            f"{b.id}: a ```{b.lang} block is run by no test; use bash or python"
        if b.lang in ("", "text"):
            first = b.text.split(None, 1)[0] if b.text.strip() else ""
            assert first not in ("autopar", "python", "torchrun", "pip", "apt-get"), \
                f"{b.id}: a command in a ```{b.lang} block; put it in a ```bash block"


def test_every_command_is_covered():
    assert ALL_COMMANDS, "the pages have no ```bash block"
    for b, argv in ALL_COMMANDS:
        assert _kind(argv), \
            f"{b.id}: `{shlex.join(argv)}` is run by no test in tests/test_readme.py"


def test_quickstart_is_one_install_line_and_two_commands():
    (block,) = [b for b in _section("Quickstart", "README.md") if b.lang == "bash"]
    kinds = [_kind(argv) for argv in _commands(block)]
    assert kinds == ["pip", "pip", "plan", "torchrun"], kinds
    assert len(block.text.strip().splitlines()) == 3


def test_checkpoints_heading_holds_the_checkpoint_snippet():
    assert [b.lang for b in _section("Checkpoints")] == ["python"]
    assert "engine.save(" in _section("Checkpoints")[0].text


# ---------------------------------------------------------------- the exceptions


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith(("#", "echo"))]


def _pip(argv: list[str]) -> list[str]:
    """`python -m pip install X` and `pip install X` alike, as argv from `install`."""
    if argv[:3] == ["python", "-m", "pip"]:
        argv = argv[2:]
    return argv[1:] if argv[:1] == ["pip"] else []


def test_install_lines_are_what_ci_runs():
    """CI (.ci/run) installs from a bare Python: the pages' pip installs are its pip
    installs (less its pip upgrade), in its order; the pages' apt-get packages are ones it
    installs."""
    pages = [argv[1:] for _, argv in ALL_COMMANDS if _kind(argv) == "pip"]
    ci = [_pip(shlex.split(line)) for line in _ci_lines()]
    ci = [argv for argv in ci if argv[:1] == ["install"] and "--upgrade" not in argv]
    assert pages and pages == ci, (pages, ci)
    apt = {p for _, argv in ALL_COMMANDS if _kind(argv) == "apt" for p in argv[2:]
           if not p.startswith("-")}
    ci_apt = {p for line in _ci_lines() if "apt-get install" in line
              for p in shlex.split(line.split("apt-get install", 1)[1]) if not p.startswith("-")
              and not p.startswith(">")}
    assert apt <= ci_apt, (apt, ci_apt)


def test_test_command_is_the_one_ci_runs():
    """The README names the test command once, the pages name no other, and it is the
    command .ci/run calls."""
    readme = [shlex.join(argv) for b, argv in ALL_COMMANDS
              if _kind(argv) == "pytest" and b.page == "README.md"]
    everywhere = {shlex.join(argv) for _, argv in ALL_COMMANDS if _kind(argv) == "pytest"}
    assert readme == ["python -m pytest -q"] and everywhere == set(readme), everywhere
    assert [line for line in _ci_lines() if "pytest" in line] == readme


def _addopts() -> list[str]:
    """The options pyproject.toml gives every pytest run."""
    section = (ROOT / "pyproject.toml").read_text().split("[tool.pytest.ini_options]", 1)[1]
    addopts = re.search(r'^addopts = "([^"]*)"$', section.split("\n[", 1)[0], re.MULTILINE)
    assert addopts, "pyproject.toml's [tool.pytest.ini_options] has no addopts"
    return shlex.split(addopts.group(1))


def test_ci_prints_the_20_slowest_tests():
    """CI's command adds no options, so pytest's own from pyproject.toml hold."""
    assert "--durations=20" in _addopts()


def test_long_scripts_exist_and_answer_help():
    """Benchmarks and the screenshot script take minutes: each exists, answers --help, and
    takes every option a page gives it. Each script's help is asked once, in a child forked
    from the preloaded server (tests/forked.py)."""
    options: dict[str, set[str]] = {}
    for _, argv in ALL_COMMANDS:
        if _kind(argv) == "long":
            options.setdefault(argv[1], set()).update(a for a in argv[2:] if a.startswith("--"))
    assert options
    for script in options:
        assert (ROOT / script).is_file(), script

    # two at a time from this one thread: a second thread starting a child while the first
    # waits on its own races in multiprocessing's bookkeeping (Process.start reaps the
    # process's other children, reading the exit status the waiting thread then misses: 255)
    done, scripts = {}, list(options)
    for i in range(0, len(scripts), 2):
        pair = scripts[i:i + 2]
        done.update(zip(pair, run_scripts([(ROOT / script, ["--help"]) for script in pair],
                                          cwd=ROOT, timeout=TIMEOUT)))
    for script, help_ in done.items():
        assert help_.returncode == 0 and help_.stdout.startswith("usage:"), \
            f"{script} --help: {help_.stderr}"
        for option in sorted(options[script]):
            assert option in help_.stdout, f"{script} has no option {option}"


def _declared_options(path: Path) -> set[str]:
    """The --options a script declares with argparse, read from its source."""
    return {arg.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
            for arg in node.args
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}


def test_every_option_the_pages_name_exists(capsys):
    """Each --option a page names, in prose or command, is one the command line, torchrun
    or a script of the repository declares."""
    from torch.distributed.run import get_args_parser

    known = set(re.findall(r"--[a-z][a-z0-9-]*", get_args_parser().format_help()))
    for sub in ("explain", "search", "calibrate"):
        with pytest.raises(SystemExit):
            autopar_main([sub, "--help"])
        known |= set(re.findall(r"--[a-z][a-z0-9-]*", capsys.readouterr().out))
    for folder in LINKED:
        for script in (ROOT / folder).glob("*.py"):
            known |= _declared_options(script)
    known |= {option.split("=")[0] for option in _addopts()}  # pytest's, as CI runs it
    for page, text in TEXT.items():
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
        assert named - known == set(), f"{page} names options nothing declares: {named - known}"


# ---------------------------------------------------------------- running commands


def _env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    """A working directory for the pages' commands, with the repository's script folders."""
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _mesh(text: str) -> dict[str, int]:
    m = re.search(r"\bmesh\s+pp=(\d+)\s+dp=(\d+)\s+cp=(\d+)\s+tp=(\d+)", text)
    assert m, f"the output names no mesh:\n{text}"
    return dict(zip(("pp", "dp", "cp", "tp"), map(int, m.groups())))


def _layer_rows(text: str) -> list[str]:
    """The layer table's rows: `  blocks.0  1 1d ...` or `  blocks.1 .. blocks.95  95 ...`."""
    table = text.split("\n  layers ", 1)[-1]  # the summary rows above it are not layers
    return re.findall(r"^  ([A-Za-z_][\w.]*(?: \.\. [\w.]+)?)\s+\d+ ", table, re.MULTILINE)


def _run_plan(argv: list[str], capsys) -> None:
    """`autopar explain|search ...`: the report names a mesh of the world asked for, the
    sizes fixed, a layer table; what -o writes is read back."""
    rc = autopar_main(argv[1:])
    out, err = capsys.readouterr()
    assert rc == 0, err
    fmt, output = _option(argv, "--format") or "text", _option(argv, "-o")
    if argv[1] == "explain" and output:
        report = Path(output).read_text()
    else:
        report = out
    plan_file = _option(argv, "--plan")
    world = int(_option(argv, "--world") or
                (autopar.Plan.load(plan_file).world_size if plan_file else 8))
    if fmt == "html":  # one page, charts inline, titled with the model and world
        assert report.startswith("<!DOCTYPE html>") and "<svg" in report
        assert re.search(rf"<title>autopar plan: {re.escape(argv[2])} on {world} x ", report)
        mesh = None
    elif fmt == "json":
        data = json.loads(report)
        mesh = data["mesh"]
        assert data["layers"] and data["predicted"]["step_time_s"] > 0
    else:
        mesh = _mesh(report)
        rows = _layer_rows(report)
        assert rows, f"no layer rows:\n{report}"
        if _option(argv, "--top"):
            assert len(rows) <= int(_option(argv, "--top")), rows
        if _option(argv, "--min-throughput"):
            rate = float(re.search(r"([\d.]+) tokens/s", report).group(1))
            assert rate >= float(_option(argv, "--min-throughput"))
    if mesh is not None:
        devices = math.prod(mesh.values())
        if "--min-devices" in argv:
            assert devices <= world
        else:
            assert devices == world, mesh
        for axis in ("tp", "pp", "dp", "cp"):
            if _option(argv, f"--{axis}"):
                assert mesh[axis] == int(_option(argv, f"--{axis}")), mesh
        if plan_file:
            assert mesh == autopar.Plan.load(plan_file).mesh
    if argv[1] == "search" and output:
        saved = autopar.Plan.load(output)
        assert saved.world_size == world and saved.predicted["step_time_s"] > 0
        if mesh is not None:
            assert saved.mesh == mesh
        if "--executable" in argv:
            assert saved.unsupported() == []


def _check_profile(path: str, ranks: int) -> None:
    profile = json.loads(Path(path).read_text())
    assert "measured by `autopar calibrate`" in profile["source"], profile["source"]
    assert f"{ranks} ranks" in profile["source"] or ranks == 1, profile["source"]
    assert profile["peak_flops"]["fp32"] > 0 and profile["memory_bandwidth"] > 0


def _losses(text: str) -> list[float]:
    """Per-step losses from `step N: loss X` lines or `N  X  Y` table rows (first number)."""
    found = re.findall(r"^step \d+: loss ([\d.]+)$", text, re.MULTILINE) or \
        re.findall(r"^\s*\d+\s+([\d.]+)\s+[\d.]+$", text, re.MULTILINE)
    return [float(v) for v in found]


def _run_torchrun(argv: list[str]) -> None:
    """`torchrun --standalone ...` run by tests/forked.py's stand-in: its ranks forked from
    the preloaded server with torchrun's variables (test_the_torchrun_stand_in_sets_what_
    torchrun_sets), not a launcher and N interpreters importing torch and autopar again."""
    nproc = int(_option(argv, "--nproc-per-node"))
    done = run_torchrun(argv[1:], os.getcwd(), TIMEOUT, environ=_env())
    assert done.returncode == 0, f"`{shlex.join(argv)}` failed:\n{done.stdout}\n{done.stderr}"
    out = done.stdout
    if "-m" in argv and argv[argv.index("-m") + 1] == "autopar.cli":
        assert argv[argv.index("-m") + 2] == "calibrate", argv
        _check_profile(_option(argv, "-o"), nproc)
        return
    script = next(a for a in argv[1:] if a.endswith(".py"))
    if script in EXAMPLE_CHECKS:
        assert EXAMPLE_CHECKS[script](out), out
        return
    losses = _losses(out)
    assert len(losses) >= 2 and all(math.isfinite(v) for v in losses), out
    assert losses[-1] < losses[0], f"the loss did not fall:\n{out}"
    assert f"on {nproc} processes" in out, out
    if script == "examples/train_gpt.py":
        assert "the losses match one device's" in out, out
        plan_file = _option(argv, "--plan")
        if plan_file:
            mesh = autopar.Plan.load(plan_file).mesh
            assert f"plan ({plan_file})" in out, out
            assert "mesh " + " ".join(f"{a}={v}" for a, v in mesh.items()) in out, out


def _run_calibrate(argv: list[str]) -> None:
    """`autopar calibrate ...` as `python -m autopar.cli`, forked from the preloaded server
    (with --world N it spawns its N processes itself, as the command does)."""
    done = run_script("autopar.cli", argv[1:], os.getcwd(), TIMEOUT, environ=_env(),
                      module=True)
    assert done.returncode == 0, f"`{shlex.join(argv)}` failed:\n{done.stdout}\n{done.stderr}"
    _check_profile(_option(argv, "-o"), int(_option(argv, "--world") or 1))


def _runnable(block: Block) -> bool:
    return any(_kind(argv) in RUN_KINDS for argv in _commands(block))


@pytest.mark.parametrize("block", [b for b in BASH if _runnable(b)], ids=lambda b: b.id)
def test_bash_block(block, scratch, capsys):
    """The block's commands, in order, in one scratch directory: each succeeds and prints
    or writes what the page says. Install, test and benchmark lines are checked by the
    exception tests above."""
    for argv in _commands(block):
        kind = _kind(argv)
        if kind == "plan":
            _run_plan(argv, capsys)
        elif kind == "calibrate":
            _run_calibrate(argv)
        elif kind == "torchrun":
            _run_torchrun(argv)
        elif kind == "example":  # `python examples/x.py ...`, forked as the snippets are
            done = run_script(argv[1], argv[2:], cwd=os.getcwd(), timeout=TIMEOUT)
            assert done.returncode == 0, f"`{shlex.join(argv)}` failed:\n{done.stdout}\n" \
                f"{done.stderr}"
            assert EXAMPLE_CHECKS[argv[1]](done.stdout), done.stdout
        else:
            assert kind in ("pip", "apt", "pytest", "long"), shlex.join(argv)


ENV_SCRIPT = ("import json, os\nwith open(os.environ['OUT'] + os.environ['RANK'], 'w') as f:\n"
              "    json.dump(dict(os.environ), f)\n")


def test_the_torchrun_stand_in_sets_what_torchrun_sets(scratch):
    """The pages' torchrun lines run under tests/forked.py's stand-in; a real torchrun (its
    workers import nothing) sets, on each rank, the same variables to the same values, but
    the store's address and port, the run's id and the error file (TORCHRUN_OWN)."""
    (scratch / "env.py").write_text(ENV_SCRIPT)
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "env.py"]
    env = {**_env(), "OUT": str(scratch / "real")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], env=env,
                   check=True, capture_output=True, timeout=TIMEOUT)
    ours = run_torchrun(args, scratch, TIMEOUT, environ={**env, "OUT": str(scratch / "ours")})
    assert ours.returncode == 0, ours.stderr
    real_ranks, our_ranks = ([json.loads((scratch / f"{who}{rank}").read_text())
                              for rank in range(2)] for who in ("real", "ours"))
    for rank, (theirs, mine) in enumerate(zip(real_ranks, our_ranks)):
        added = {k: v for k, v in theirs.items() if env.get(k) != v and k != "PWD"}
        assert set(added) == set(torchrun_env(2, rank, 0, "")), added
        assert all(k in mine for k in added), (added, mine)
        shared = sorted(set(added) - set(TORCHRUN_OWN))
        assert {k: mine[k] for k in shared} == {k: added[k] for k in shared}, (added, mine)


# ---------------------------------------------------------------- python snippets


def _is_plan_dicts(block: Block) -> bool:
    """A block of `dict(...)` expressions: the Colossal-AI style plans."""
    body = ast.parse(block.text).body
    return bool(body) and all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                              and getattr(s.value.func, "id", None) == "dict" for s in body)


PYTHON = [b for b in BLOCKS if b.lang == "python"]
PLAN_DICTS = [b for b in PYTHON if _is_plan_dicts(b)]
SCRIPTS = [b for b in PYTHON if not _is_plan_dicts(b)]

# run after a snippet, in its namespace: what its names hold
AFTER = """
import math as _math, autopar as _autopar
from autopar.runtime.engine import Engine as _Engine
_seen = globals()
if "engine" in _seen:
    assert isinstance(engine, _Engine)
    assert engine.plan.world_size == 1
if "loss" in _seen:
    assert isinstance(loss, float) and _math.isfinite(loss), loss
if isinstance(_seen.get("plan"), _autopar.Plan):
    assert plan.predicted["step_time_s"] > 0
print("SNIPPET DONE")
"""


@pytest.mark.parametrize("block", SCRIPTS, ids=lambda b: b.id)
def test_python_block(block, scratch):
    """The snippet runs as written, as a script in a fresh process (world 1: no launcher;
    forked from the preloaded server), then the names it made are checked; what it writes
    is read back."""
    (scratch / "snippet.py").write_text(block.text + AFTER)
    done = run_script(scratch / "snippet.py", [], cwd=scratch, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("SNIPPET DONE"), done.stdout
    for name in re.findall(r"\.save\(\"([^\"]+\.json)\"\)", block.text):  # a plan file
        saved = autopar.Plan.load(scratch / name)
        fixed = re.search(r"constraints=(\{[^}]*\})", block.text)
        for axis, size in (ast.literal_eval(fixed.group(1)) if fixed else {}).items():
            assert saved.mesh[axis] == size, saved.mesh
    if "engine.save(\"checkpoints\")" in block.text:
        assert (scratch / "checkpoints" / "latest").read_text().strip() == "step-00000001"
        assert (scratch / "checkpoints" / "step-00000001" / ".metadata").is_file()


def _executable_world(spec: dict) -> int:
    """The smallest world of at most 64 devices on which the dict makes a plan the runtime
    executes; fails when there is none."""
    errors = []
    for world in (1, 2, 4, 8, 16, 32, 64):
        try:
            plan = autopar.Plan.from_dict(spec, world)
            plan.check_grid()
            plan.check_sequence_parallel()
        except autopar.errors.PlanError as e:
            errors.append(f"{world}: {e}")
            continue
        assert plan.unsupported() == [], (spec, plan.unsupported())
        data = spec.get("data")
        if isinstance(data, dict):  # HSDP: dict(size=8, shard=4)
            assert (plan.mesh["dp"], plan.dp_shard) == (data["size"], data["shard"])
        elif data is not None:
            assert plan.mesh["dp"] == data
        return world
    raise AssertionError(f"{spec} makes no plan on 1 to 64 devices: {errors}")


@pytest.mark.parametrize("block", PLAN_DICTS, ids=lambda b: b.id)
def test_plan_dicts_make_plans_the_runtime_executes(block):
    specs = [eval(compile(ast.Expression(s.value), block.page, "eval"), {"dict": dict})
             for s in ast.parse(block.text).body]
    assert specs
    worlds = [_executable_world(spec) for spec in specs]
    assert max(worlds) > 1


def test_the_colossal_ai_section_shows_plan_dicts():
    assert any(b in PLAN_DICTS for b in _section("Colossal-AI style config"))


# ---------------------------------------------------------------- troubleshooting

TRIGGERS = textwrap.dedent('''
    import json, functools, torch, torch.nn.functional as F, autopar
    from autopar.models import build
    from autopar.kernels.collectives import AxisGroup
    from autopar.runtime.engine import Engine
    from autopar.runtime.mesh import axis_groups

    messages = []
    def record(make):
        try:
            make()
        except autopar.errors.AutoparError as e:
            messages.append(f"{type(e).__module__}.{type(e).__name__}: {e}")
            return
        raise AssertionError(f"{make} raised nothing")

    lm = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())
    adamw = functools.partial(torch.optim.AdamW, lr=3e-4)
    def run(world, plan, spec="gpt-tiny", seq=None):
        model, (x,) = build(spec, batch=8, seq=seq, device="cpu", seed=0)
        return autopar.parallelize(model, world, example_inputs=(x,), loss_fn=lm,
                                   optimizer=adamw, plan=plan)

    record(lambda: run(4, dict(data=4)))
    record(lambda: run(2, autopar.Plan(mesh={"dp": 2, "tp": 2})))
    record(lambda: run(6, dict(tensor=dict(size=6, mode="2d"))))
    record(lambda: run(4, dict(sequence=dict(size=4, mode="ring")), seq=20))
    record(lambda: run(4, dict(tensor=dict(size=4, mode="1d", sequence_parallel=True)),
                       seq=30))
    record(lambda: run(4, dict(tensor=dict(size=2), zero_stage=1)))

    def heads():  # solved in one process with a tp group of 2 that is never called
        model, (x,) = build("gpt:layers=2,hidden=48,heads=3,vocab=256,seq=32", batch=2,
                            device="cpu", seed=0)
        groups = axis_groups({"dp": 1, "tp": 1})
        groups["tp"] = AxisGroup("tp", 2, 0, None, groups["tp"].log)
        Engine(model, autopar.Plan(mesh={"tp": 2}, tp_mode="1d"), groups, (x,), None, None)
    record(heads)

    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
        def forward(self, x):
            if x.sum() > 0:
                return self.linear(x)
            return x
    record(lambda: autopar.parallelize(Gate(), 1, example_inputs=(torch.randn(4, 8),),
                                       loss_fn=F.mse_loss, plan=dict(data=1)))

    model, (x,) = build("gpt-tiny", batch=8, device="cpu", seed=0)
    record(lambda: run(1, dict(data=1)).train_step(x + 1000, x))
    record(lambda: autopar.parallelize(model, 1, example_inputs=(torch.zeros(2, 64).long(),),
                                       loss_fn=lm, optimizer=adamw, plan=dict(data=1)))
    record(lambda: autopar.parallelize(model, 1, example_inputs=(x,), loss_fn=lm,
                                       optimizer=torch.optim.AdamW(model.parameters())))
    record(lambda: autopar.parallelize(model, 1, example_inputs=(x,), optimizer=adamw,
                                       loss_fn=torch.nn.CrossEntropyLoss))

    run(1, dict(data=1)).save("gpt-checkpoint")
    record(lambda: run(1, dict(data=1), "llama-tiny").load("gpt-checkpoint"))
    record(lambda: run(1, dict(data=1), "gpt:layers=2,hidden=32,heads=8,vocab=256,seq=32")
           .load("gpt-checkpoint"))

    import torch.distributed as dist  # last: a job of one process
    dist.init_process_group("gloo", init_method="file://" + __import__("os").path.abspath(
        "store"), rank=0, world_size=1)
    record(lambda: run(2, None))
    print(json.dumps(messages))
''')

CLI_TRIGGERS = [
    ["explain", "gpt3-175b", "--world", "8", "--batch", "8"],
    ["explain", "gpt3", "--world", "8"],
    ["explain", "gpt-tiny", "--world", "8", "--device", "a100"],
    ["explain", "gpt-tiny", "--world", "8", "--tp", "3"],
    ["explain", "gpt-tiny", "--world", "4", "--plan", "plan.json"],
    ["explain", "gpt-tiny", "--sp", "megatron", "--tp", "1"],
    ["search", "gpt-tiny", "-o", "missing/plan.json"],
]


def _matches(quoted: str, message: str) -> bool:
    """`...` in the page's quote stands for any text."""
    pattern = ".*?".join(re.escape(part) for part in quoted.strip().split("..."))
    return re.fullmatch(pattern, message.strip(), re.DOTALL) is not None


def test_troubleshooting_quotes_the_messages_autopar_prints(scratch, capsys):
    """Each error the section quotes is triggered here and matches what autopar prints, and
    each error triggered here is quoted."""
    (scratch / "triggers.py").write_text(TRIGGERS)  # a file: tracebacks name its lines
    done = run_script(scratch / "triggers.py", [], cwd=scratch, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    for argv in CLI_TRIGGERS:
        assert autopar_main(argv) == 2, argv
        err = capsys.readouterr().err
        printed.append(next(part for line in err.splitlines() for part in line.split("\r")
                            if part.startswith("autopar: ")))
    quoted = [b.text for b in _section("Troubleshooting") if b.lang == "text"]
    assert quoted
    for text in quoted:
        assert any(_matches(text, m) for m in printed), \
            f"the page quotes an error autopar does not print:\n{text}\nprinted:\n" + \
            "\n".join(printed)
    for message in printed:
        assert any(_matches(text, message) for text in quoted), \
            f"autopar prints an error the page does not quote:\n{message}"

"""Run a Python script as `python SCRIPT ARGS...` would, in a child forked from the test
pools' fork server (tests/distributed.py), which imported torch, autopar and transformers'
GPT-2 once: a child starts in milliseconds where a fresh interpreter spends seconds of CPU
importing them, which is most of a short script's time on a shared two-core machine.

The child takes the test process's environment, runs in the directory given, with the
script's folder first on sys.path and `sys.argv` as given, and its stdout and stderr go
to files read back here, so it behaves as the command does, with one difference: torch's
thread pools have the fork server's sizes (one thread).
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

from distributed import fork_context

_STARTING = threading.Lock()  # the server starts in tests/: chdir is process-wide


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str


def _child(script: str, args: list[str], cwd: str, environ: dict, out: str,
           err: str) -> None:
    os.environ.clear()
    os.environ.update(environ)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_script(script: str | Path, args: list[str], cwd: str | Path, *,
                 environ: dict | None = None, out: str = os.devnull, err: str = os.devnull):
    """Start `python script *args` in `cwd` with `environ` (default: this process's), forked
    from the preloaded server, its stdout and stderr written to `out` and `err`; the started
    multiprocessing Process (join, is_alive, kill, exitcode)."""
    with _STARTING:
        here = os.getcwd()
        os.chdir(os.path.dirname(os.path.abspath(__file__)))  # not a test's scratch
        try:
            context = fork_context()
        finally:
            os.chdir(here)
    child = context.Process(target=_child, args=(str(script), list(args), str(cwd),
                                                 dict(os.environ if environ is None else environ),
                                                 out, err))
    child.start()
    return child


def run_script(script: str | Path, args: list[str], cwd: str | Path, timeout: float) -> Done:
    """`python script *args` in `cwd`, forked from the preloaded server; its exit status and
    what it printed. A child still running after `timeout` seconds is killed and fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        child = start_script(script, args, cwd, out=out, err=err)
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise TimeoutError(f"`python {script} {' '.join(args)}` ran past {timeout} s")
        return Done(child.exitcode, Path(out).read_text(), Path(err).read_text())

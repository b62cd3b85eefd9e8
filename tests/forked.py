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
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from distributed import find_free_port, fork_context

_STARTING = threading.Lock()  # the server starts in tests/: chdir is process-wide


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str


def _child(script: str, args: list[str], cwd: str, environ: dict, out: str,
           err: str, module: bool = False) -> None:
    os.environ.clear()
    os.environ.update(environ)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    os.chdir(cwd)
    sys.argv = [script, *args]
    # `python -m` puts the working directory first on sys.path, `python script` its folder
    sys.path.insert(0, cwd if module else os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
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
                 environ: dict | None = None, out: str = os.devnull, err: str = os.devnull,
                 module: bool = False):
    """Start `python script *args` (`python -m script *args` with `module`) in `cwd` with
    `environ` (default: this process's), forked from the preloaded server, its stdout and
    stderr written to `out` and `err`; the started multiprocessing Process (join, is_alive,
    kill, exitcode)."""
    with _STARTING:
        here = os.getcwd()
        os.chdir(os.path.dirname(os.path.abspath(__file__)))  # not a test's scratch
        try:
            context = fork_context()
        finally:
            os.chdir(here)
    child = context.Process(target=_child, args=(str(script), list(args), str(cwd),
                                                 dict(os.environ if environ is None else environ),
                                                 out, err, module))
    child.start()
    return child


def run_script(script: str | Path, args: list[str], cwd: str | Path, timeout: float, *,
               environ: dict | None = None, module: bool = False) -> Done:
    """`python script *args` (`python -m script *args` with `module`) in `cwd`, forked from
    the preloaded server; its exit status and what it printed. A child still running after
    `timeout` seconds is killed and fails."""
    return run_scripts([(script, args)], cwd, timeout, environ=environ, module=module)[0]


def run_scripts(commands: list[tuple[str | Path, list[str]]], cwd: str | Path, timeout: float,
                *, environ: dict | None = None, module: bool = False) -> list[Done]:
    """`run_script` of each (script, args), all started at once from this thread, then each
    waited for; their exit statuses and what they printed, in order. Call it from one
    thread: multiprocessing's Process.start reaps the process's finished children, so a
    start in one thread can read the exit status another thread is waiting for (which then
    reads 255)."""
    with tempfile.TemporaryDirectory() as tmp:
        children = []
        for i, (script, args) in enumerate(commands):
            out, err = os.path.join(tmp, f"out{i}"), os.path.join(tmp, f"err{i}")
            children.append((start_script(script, args, cwd, out=out, err=err, environ=environ,
                                          module=module), out, err))
        deadline = time.monotonic() + timeout
        for child, _, _ in children:
            child.join(max(0.0, deadline - time.monotonic()))
        late = [(script, args) for (script, args), (child, _, _) in zip(commands, children)
                if child.is_alive()]
        for child, _, _ in children:
            if child.is_alive():
                child.kill()
                child.join()
        if late:
            raise TimeoutError("; ".join(f"`python {script} {' '.join(args)}`"
                                         for script, args in late) + f" ran past {timeout} s")
        return [Done(child.exitcode, Path(out).read_text(), Path(err).read_text())
                for child, out, err in children]


# What a stand-in for torchrun gives its ranks otherwise than torchrun does, by design: the
# workers host the store themselves at a port of their own, on the loopback address, and
# write an error file (torch's @record) where the stand-in says.
TORCHRUN_OWN = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")


def torchrun_env(nproc: int, rank: int, port: int, error_file: str,
                 max_restarts: int = 0) -> dict[str, str]:
    """The variables torchrun gives worker `rank` of a one-node job of `nproc` processes
    (its launcher's and its local agent's), the workers hosting the store themselves (rank 0
    at MASTER_PORT). tests/test_readme.py's test_the_torchrun_stand_in_sets_what_torchrun_sets
    checks them against a real torchrun."""
    env = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "ROLE_RANK": rank,
           "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": nproc, "WORLD_SIZE": nproc,
           "GROUP_WORLD_SIZE": 1, "ROLE_WORLD_SIZE": nproc, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": 0,
           "TORCHELASTIC_MAX_RESTARTS": max_restarts, "TORCHELASTIC_RUN_ID": "stand-in",
           "TORCHELASTIC_USE_AGENT_STORE": False, "TORCHELASTIC_ERROR_FILE": error_file,
           "TORCHELASTIC_SIGNALS_TO_HANDLE": os.environ.get(
               "TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
               "TORCH_NCCL_ASYNC_ERROR_HANDLING", 1)}
    if nproc > 1 or "OMP_NUM_THREADS" in os.environ:  # torchrun's default: one thread each
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", 1)
    return {k: str(v) for k, v in env.items()}


def run_torchrun(args: list[str], cwd: str | Path, timeout: float,
                 environ: dict | None = None) -> Done:
    """`torchrun *args` for a one-node (`--standalone`) job: the arguments read by torchrun's
    own parser, then one child per process forked from the preloaded server with the
    variables torchrun gives its workers (`torchrun_env`), where torchrun starts a launcher
    and `--nproc-per-node` fresh interpreters that each import torch and autopar again. The
    stdout of the ranks in rank order, as torchrun passes them through; the first failing
    rank's exit status (a job that fails here fails, restarts or not)."""
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    nproc = int(parsed.nproc_per_node)
    assert parsed.standalone and nproc >= 1, f"`torchrun {' '.join(args)}`: one node only"
    port = find_free_port()
    base = dict(os.environ if environ is None else environ)
    with tempfile.TemporaryDirectory() as tmp:
        children = []
        for rank in range(nproc):
            out, err = os.path.join(tmp, f"out{rank}"), os.path.join(tmp, f"err{rank}")
            env = {**base, **torchrun_env(nproc, rank, port, os.path.join(tmp, f"error{rank}"),
                                          parsed.max_restarts)}
            children.append((start_script(parsed.training_script, parsed.training_script_args,
                                          cwd, environ=env, out=out, err=err,
                                          module=parsed.module), out, err))
        deadline = time.monotonic() + timeout
        # as torchrun's agent: a rank that fails ends the others (they may wait on it)
        while any(c.is_alive() for c, _, _ in children) and time.monotonic() < deadline \
                and not any(c.exitcode for c, _, _ in children):
            time.sleep(0.05)
        late = [c for c, _, _ in children if c.is_alive()]
        failed = any(c.exitcode for c, _, _ in children)
        for child in late:
            child.kill()
            child.join()
        if late and not failed:
            raise TimeoutError(f"`torchrun {' '.join(args)}` ran past {timeout} s")
        codes = [child.exitcode for child, _, _ in children]
        return Done(next((c for c in codes if c), 0),
                    "".join(Path(out).read_text() for _, out, _ in children),
                    "".join(Path(err).read_text() for _, _, err in children))

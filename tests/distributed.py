"""Persistent multi-process gloo worlds for distributed tests.

A :class:`DistPool` starts ``world_size`` worker processes once, initialises
``torch.distributed`` (gloo backend, loopback TCP rendezvous) in each of them
once, and then runs functions sent to it on every rank at the same time.
Workers are forked from multiprocessing's fork server, which imported torch,
autopar and the rest of ``tests/pool_preload.py`` once for the whole session
(spawned, where there is no fork server)::

    from distributed import DistPool

    def allreduce_rank(scale):          # module level: pickled by reference
        import torch, torch.distributed as dist
        t = torch.tensor([float(dist.get_rank()) * scale])
        dist.all_reduce(t)
        return t.item()

    with DistPool(4) as pool:
        assert pool.run(allreduce_rank, 2.0) == [12.0] * 4   # index = rank

House rule: distributed tests take their pool from a fixture made with
:func:`dist_pool_fixture`; every module gets the session's world of that size, reset
for it (see :meth:`DistPool.reset`), so a world starts and warms up once a run::

    pool4 = dist_pool_fixture(4)        # at module level of a test module

    def test_something(pool4):
        assert pool4.run(allreduce_rank, 1.0) == [6.0] * 4

Rules of the road
-----------------
* ``fn`` must be a module-level function of an importable module (a test
  module is fine: the workers have the repository root and ``tests/`` on
  ``sys.path``).  Arguments and results travel with :mod:`pickle`; keep them
  to plain data and CPU tensors.
* Workers import the test module again, so nothing at import time of
  a test module may start a pool: create pools in fixtures or in tests only.
* Any failure on any rank (an exception, a dead worker, a timeout) tears the
  whole pool down, because the other ranks may be blocked in a collective.
  Later ``run`` calls raise :class:`DistPoolBrokenError` naming the first
  failure.  A test that *expects* a rank to fail must therefore use a pool of
  its own (``with DistPool(2, timeout_s=...) as pool:``), not the shared one.
* The pool adds no collectives of its own between calls and leaves RNG state
  alone within a module; worker state (module globals, process groups created
  by tests) persists from one call to the next. Between modules a reset puts
  back torch's and numpy's generators, the default dtype, grad mode, autopar's
  module globals, and the test process's environment and directory, and destroys
  every process group but the world's (autopar's group cache emptied with them).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable

__all__ = [
    "DistPool",
    "DistPoolBrokenError",
    "DistPoolError",
    "DistPoolTimeoutError",
    "DistWorkerDiedError",
    "DistWorkerError",
    "dist_pool_fixture",
    "find_free_port",
]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

_LOOPBACK = "127.0.0.1"
# After the first failing rank reports, give the others this long to report
# too (they may all fail the same way) before tearing the pool down.
_FAILURE_GRACE_S = 0.5
# While waiting for answers, wake up at least this often to check liveness.
_POLL_S = 0.2
_JOIN_S = 3.0
# A pool asked to stop waits this long for its workers to exit before
# terminating them: they stop at once, but a forked worker's exit reaches the
# test process through the fork server, late on a heavily loaded machine.
_STOP_S = 15.0
# Set in pool workers: a DistPool created there means a test module starts a
# pool at import time (the workers import test modules to find ``fn``).
_IN_WORKER = False
# Workers are forked from multiprocessing's fork server, which imports this
# module (tests/pool_preload.py: torch, torch.export's tracer, autopar,
# transformers' GPT-2 and BERT) once: a spawned worker imported them itself,
# several seconds of CPU each, for some 130 workers a suite run on two cores.
_PRELOAD = ["pool_preload"]


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class DistPoolError(RuntimeError):
    """Base class of the errors raised by :class:`DistPool`."""


class DistWorkerError(DistPoolError):
    """``fn`` raised on a rank.  The message holds the worker's traceback.

    Attributes: ``rank``, ``exc_type`` (qualified name of the worker's
    exception class), ``worker_traceback`` (formatted text), ``failures``
    (``{rank: traceback text}`` for every rank that reported an error).
    When the worker's exception could be pickled it is also chained as
    ``__cause__``.
    """

    def __init__(self, message: str, *, rank: int, exc_type: str = "",
                 worker_traceback: str = "", failures: dict | None = None):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.worker_traceback = worker_traceback
        self.failures = dict(failures or {})


class DistWorkerDiedError(DistWorkerError):
    """A worker process exited while the pool expected an answer from it.

    ``exitcode`` is the process exit code (negative: killed by that signal).
    """

    def __init__(self, message: str, *, rank: int, exitcode: int | None,
                 failures: dict | None = None):
        super().__init__(message, rank=rank, failures=failures)
        self.exitcode = exitcode


class DistPoolTimeoutError(DistPoolError, TimeoutError):
    """Some ranks did not answer within ``timeout_s``; ``ranks`` lists them."""

    def __init__(self, message: str, *, ranks: list[int]):
        super().__init__(message)
        self.ranks = list(ranks)


class DistPoolBrokenError(DistPoolError):
    """The pool was torn down by an earlier failure (or closed)."""


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def find_free_port() -> int:
    """Return a TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_LOOPBACK, 0))
        return s.getsockname()[1]


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"exit code {exitcode} (killed by {name})"
    return f"exit code {exitcode}"


def _fn_name(fn: Callable) -> str:
    module = getattr(fn, "__module__", None) or "?"
    qualname = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{qualname}"


def _indent(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line for line in text.rstrip().splitlines(True))


def _terminate(processes: list, conns: list) -> None:
    """Stop worker processes hard: SIGTERM, short join, then SIGKILL."""
    for p in processes:
        if p.is_alive():
            try:
                p.terminate()
            except Exception:
                pass
    deadline = time.monotonic() + _JOIN_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            try:
                p.kill()
            except Exception:
                pass
            p.join(_JOIN_S)
    for c in conns:
        try:
            c.close()
        except Exception:
            pass


def _shutdown(processes: list, conns: list) -> None:
    """Graceful stop (used by close() and the garbage/exit finalizer)."""
    stop = pickle.dumps(("stop",))
    for p, c in zip(processes, conns):
        if p.is_alive():
            try:
                c.send_bytes(stop)
            except Exception:
                pass
    deadline = time.monotonic() + _STOP_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    _terminate(processes, conns)


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    # Never outlive the test process (e.g. when it is SIGKILLed while this
    # worker is blocked in a collective and nobody can terminate us). A forked
    # worker's parent is the fork server, which exits with the test process.
    first_ppid = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != first_ppid:
            os._exit(70)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(70)
        except OSError:
            pass


def _error_payload(exc: BaseException, tb_text: str) -> bytes:
    exc_type = f"{type(exc).__module__}.{type(exc).__qualname__}"
    try:
        exc_bytes = pickle.dumps(exc)
        pickle.loads(exc_bytes)  # some exceptions pickle but do not unpickle
    except Exception:
        exc_bytes = None
    return pickle.dumps(("err", exc_type, tb_text, exc_bytes))


def _worker_main(rank: int, world_size: int, port: int, paths: list[str],
                 conn, parent_pid: int, pg_timeout_s: float,
                 environ: dict | None = None, cwd: str | None = None,
                 forked_here: bool = False) -> None:
    global _IN_WORKER
    _IN_WORKER = True
    # A forked worker starts with the fork server's environment and directory:
    # take the test process's, as a spawned worker would.
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    if cwd is not None:
        try:
            os.chdir(cwd)
        except OSError:
            pass
    # Ctrl-C goes to the whole process group; the parent tears us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="autopar-parent-watch").start()

    for p in reversed(paths):
        while p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)

    _rank_environ(rank, world_size, port)

    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://{_LOOPBACK}:{port}",
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
    except BaseException as exc:  # report start-up failures with traceback
        conn.send_bytes(_error_payload(exc, traceback.format_exc()))
        conn.close()
        return

    fresh = _Fresh()
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # parent went away
            break
        try:
            msg = pickle.loads(data)
        except BaseException as exc:  # e.g. fn's module not importable here
            conn.send_bytes(_error_payload(exc, traceback.format_exc()))
            continue
        if msg[0] == "stop":
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:
                pass
            try:
                conn.send_bytes(pickle.dumps(("bye",)))
            except Exception:
                pass
            break
        if msg[0] == "reset":
            try:
                fresh.restore(*msg[1:])
                _rank_environ(rank, world_size, port)
            except BaseException as exc:
                conn.send_bytes(_error_payload(exc, traceback.format_exc()))
            else:
                conn.send_bytes(pickle.dumps(("ok", None)))
            continue
        _, fn, args, kwargs = msg
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            payload = _error_payload(exc, traceback.format_exc())
        else:
            try:
                payload = pickle.dumps(("ok", result))
            except BaseException as exc:
                tb_text = traceback.format_exc()
                payload = _error_payload(
                    exc,
                    f"result of {_fn_name(fn)} could not be pickled "
                    f"(type {type(result).__qualname__}):\n{tb_text}",
                )
        conn.send_bytes(payload)
    conn.close()
    if forked_here:  # the test process's exit handlers are its own (its pools' finalizers)
        os._exit(0)
    _fast_exit(0)


def _rank_environ(rank: int, world_size: int, port: int) -> None:
    os.environ.update({
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": _LOOPBACK,
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    })
    # Keep gloo on the loopback interface.
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.isdir("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


class _Fresh:
    """What a worker holds when it starts, so that a shared pool can hand the next test
    module a worker as a new one would be: the random generators' states (torch's and numpy's;
    Python's is seeded afresh in every forked process, a new worker's is random), torch's default dtype and grad mode, and the global names of every autopar
    module (a test that sets a module constant or wraps a module function leaves it set:
    ``losses.CHUNK_BYTES = ...``), and no process group but the world's
    (`_release_groups`). Environment and working directory come from the test process at each
    reset, as at start-up."""

    def __init__(self):
        import torch

        self.torch_rng = torch.get_rng_state()
        numpy = sys.modules.get("numpy")
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.names = {name: dict(vars(module)) for name, module in list(sys.modules.items())
                      if module is not None and name.split(".")[0] == "autopar"}

    def restore(self, environ: dict, cwd: str) -> None:
        import torch

        os.environ.clear()
        os.environ.update(environ)
        try:
            os.chdir(cwd)
        except OSError:
            pass
        torch.set_rng_state(self.torch_rng)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy_rng is not None:
            numpy.random.set_state(self.numpy_rng)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        _release_groups()
        for name, names in self.names.items():
            module = sys.modules.get(name)
            if module is None:
                continue
            now = vars(module)
            for key, value in names.items():
                if now.get(key, _MISSING) is not value:
                    setattr(module, key, value)
        import gc

        gc.collect()


_MISSING = object()


def _release_groups() -> int:
    """Destroy every process group but the world's, and empty autopar's group cache
    (`autopar.runtime.mesh._SHARED`, which holds them and the device meshes over them): a
    gloo group keeps its transport threads, which poll while the worker idles (a world-8
    worker held some 40 groups after a few modules, and the idle world-8 pool took a fifth
    of a core for the rest of the run). The next module makes the groups it needs. Every
    rank does the same at the same reset, so the group names stay in step. The number of
    groups destroyed."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    mesh = sys.modules.get("autopar.runtime.mesh")
    if mesh is not None:
        mesh._SHARED.clear()
    if not dist.is_initialized():
        return 0
    world = dist.group.WORLD
    groups = [pg for pg in list(distributed_c10d._world.pg_map) if pg is not world]
    for pg in groups:  # its threads stop with its last reference (restore's gc.collect)
        dist.destroy_process_group(pg)
    return len(groups)


def _fast_exit(code: int) -> None:
    """Exit without the interpreter's slow module teardown (~0.5 s per
    process with torch loaded, several seconds for a pool on two cores), but
    still run atexit handlers (coverage, multiprocessing clean-up)."""
    try:
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


def _context():
    """The fork server's context, its server started with ``_PRELOAD`` imported
    (spawn where there is no fork server)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    # The server is a fresh interpreter that finds modules on PYTHONPATH (before
    # Python 3.12 it ignores the sys.path it is handed), and loads torch's thread
    # pools under the thread counts a worker sets. A running server is kept.
    path = os.environ.get("PYTHONPATH")
    env = {"PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO_ROOT] + ([path] if path else [])),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


class DistPool:
    """World of `world_size` worker processes, each with gloo initialised once, running functions sent to it.

    ``timeout_s`` bounds every :meth:`run` call; ``start_timeout_s`` bounds
    start-up (spawning, importing torch, rendezvous; default
    ``max(timeout_s, 180)`` because up to 8 processes import torch on a
    couple of cores).  Use as a context manager or call :meth:`close`.
    ``fork=True`` forks the workers from the test process instead of the fork server: they
    start with what it holds (what it imported, traced or computed), which is how work that
    does not pickle is done once for every rank (tests/test_families.py traces there). The
    workers run torch on one thread, as a forked child must once its parent used OpenMP.
    """

    def __init__(self, world_size: int, *, timeout_s: float = 300.0,
                 start_timeout_s: float | None = None, pg_timeout_s: float | None = None,
                 fork: bool = False):
        if _IN_WORKER:
            raise RuntimeError(
                "DistPool created inside a DistPool worker: a module imported by the "
                "workers (probably a test module) starts a pool at import time. "
                "Create pools in fixtures (dist_pool_fixture) or inside tests only.")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = int(world_size)
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(
            start_timeout_s if start_timeout_s is not None else max(self.timeout_s, 180.0))
        self.pg_timeout_s = pg_timeout_s
        self.fork = bool(fork)
        self.port: int | None = None
        self._processes: list = []
        self._conns: list = []
        self._broken: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._finalizer = None

        last_exc: Exception | None = None
        for _attempt in range(3):
            try:
                self._start()
                return
            except DistPoolError as exc:
                last_exc = exc
                # Another process may have grabbed the free port between our
                # probe and rank 0's bind: retry with a fresh port.
                text = str(exc).lower()
                if "address already in use" not in text and "eaddrinuse" not in text:
                    break
        self._broken = f"start-up failed: {last_exc}"
        raise last_exc

    # -- lifecycle --------------------------------------------------------

    def _start(self) -> None:
        # fork=True: the workers are forked from the test process itself and start with what
        # it holds (e.g. traced graphs, which do not pickle); else from the fork server.
        # A test process that joined a process group itself passes it on to a forked child,
        # which could not join the pool's: its workers come from the fork server then.
        dist = sys.modules.get("torch.distributed")
        joined = dist is not None and dist.is_available() and dist.is_initialized()
        forked = self.fork and not joined
        ctx = mp.get_context("fork") if forked else _context()
        self._broken = None
        self.port = find_free_port()
        paths = [REPO_ROOT, TESTS_DIR]
        pg_timeout_s = self.pg_timeout_s or max(self.timeout_s, self.start_timeout_s) + 60.0
        processes, conns = [], []
        try:
            for rank in range(self.world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                p = ctx.Process(
                    target=_worker_main,
                    args=(rank, self.world_size, self.port, paths, child_conn,
                          os.getpid(), pg_timeout_s, dict(os.environ), os.getcwd(),
                          forked),
                    name=f"DistPool-w{self.world_size}-rank{rank}",
                    daemon=False,  # workers may start processes of their own
                )
                p.start()
                child_conn.close()
                processes.append(p)
                conns.append(parent_conn)
        except BaseException:
            _terminate(processes, conns)
            raise
        self._processes, self._conns = processes, conns
        # Ensure workers die with the pool object or at interpreter exit.
        self._finalizer = weakref.finalize(self, _shutdown, processes, conns)

        try:
            replies = self._collect(list(range(self.world_size)),
                                    self.start_timeout_s, what="start-up")
        except BaseException:  # incl. KeyboardInterrupt while waiting
            self._tear_down()
            raise
        for rank, (kind, *_rest) in enumerate(replies):
            assert kind == "ready", (rank, kind)

    def close(self) -> None:
        """Stop the workers (destroy_process_group, join, terminate). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._finalizer is not None and self._finalizer.alive:
                self._finalizer()  # runs _shutdown once
            else:
                _terminate(self._processes, self._conns)

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "broken" if self._broken else "ready"
        return f"DistPool(world_size={self.world_size}, port={self.port}, {state})"

    # -- introspection ----------------------------------------------------

    @property
    def processes(self) -> tuple:
        """The worker ``multiprocessing.Process`` objects, index = rank."""
        return tuple(self._processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    @property
    def broken(self) -> str | None:
        """Why the pool can no longer run functions, or None if it can."""
        return self._broken

    # -- running ----------------------------------------------------------

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank at once; return the
        per-rank results, index = rank.

        Raises :class:`DistWorkerError` (first failing rank, with its
        traceback; other failed ranks are summarised),
        :class:`DistWorkerDiedError` (with the exit code) or
        :class:`DistPoolTimeoutError` (a ``TimeoutError``); each of these
        tears the pool down.  :class:`DistPoolBrokenError` if the pool was
        already torn down or closed.  ``TypeError`` (pool left intact) if
        ``fn`` or the arguments cannot be pickled.
        """
        with self._lock:
            if self._closed:
                raise DistPoolBrokenError(
                    f"DistPool(world_size={self.world_size}) is closed; cannot run "
                    f"{_fn_name(fn)}")
            if self._broken is not None:
                raise DistPoolBrokenError(
                    f"DistPool(world_size={self.world_size}) is broken because of an "
                    f"earlier failure and cannot run {_fn_name(fn)}: {self._broken}\n"
                    "Later calls on this pool all fail; tests that expect a rank to "
                    "fail should use a pool of their own.")
            try:
                payload = pickle.dumps(("run", fn, args, kwargs))
            except Exception as exc:
                # Nothing was sent: the pool is still healthy.
                raise TypeError(
                    f"cannot send {_fn_name(fn)} to the workers: {exc!r}. fn must be a "
                    "module-level function of an importable module (no lambdas, "
                    "closures or functions defined in __main__) and its arguments "
                    "must be picklable.") from exc
            for c in self._conns:
                try:
                    c.send_bytes(payload)
                except (OSError, EOFError):
                    pass  # dead worker: reported by _collect with its exit code
            try:
                replies = self._collect(list(range(self.world_size)), self.timeout_s,
                                        what=_fn_name(fn))
            except BaseException as exc:
                if self._broken is None:  # e.g. KeyboardInterrupt while waiting
                    self._tear_down()
                    self._broken = f"interrupted by {type(exc).__name__} while running {_fn_name(fn)}"
                raise
            return [reply[1] for reply in replies]

    def reset(self) -> None:
        """Hand the workers to a new test module as new ones: the test process's environment
        and working directory, and the state each worker started with (random generators,
        default dtype, grad mode, autopar's module globals, only the world's process group;
        see ``_Fresh``). Module globals of test modules stay. A failure breaks the pool."""
        with self._lock:
            if self._closed or self._broken is not None:
                raise DistPoolBrokenError(
                    f"DistPool(world_size={self.world_size}) cannot be reset: "
                    f"{'closed' if self._closed else self._broken}")
            payload = pickle.dumps(("reset", dict(os.environ), os.getcwd()))
            for c in self._conns:
                try:
                    c.send_bytes(payload)
                except (OSError, EOFError):
                    pass
            self._collect(list(range(self.world_size)), self.timeout_s, what="reset")

    def _collect(self, ranks: list[int], timeout_s: float, what: str) -> list:
        """Wait for one message from each of ``ranks``.  On any failure tear
        the pool down, mark it broken and raise."""
        start = time.monotonic()
        deadline = start + timeout_s
        replies: dict[int, tuple] = {}
        errors: dict[int, tuple] = {}  # rank -> ("err", type, tb, exc_bytes)
        deaths: dict[int, int | None] = {}  # rank -> exit code
        pending = set(ranks)

        def receive(rank: int) -> None:
            try:
                msg = pickle.loads(self._conns[rank].recv_bytes())
            except (EOFError, OSError):
                p = self._processes[rank]
                p.join(1.0)
                deaths[rank] = p.exitcode
            except Exception as exc:  # result could not be unpickled here
                errors[rank] = ("err", type(exc).__qualname__,
                                f"result from rank {rank} could not be unpickled "
                                f"in the parent:\n{traceback.format_exc()}", None)
            else:
                if msg[0] == "err":
                    errors[rank] = msg
                else:
                    replies[rank] = msg
            pending.discard(rank)

        first_failure: float | None = None
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            by_handle = {}
            for rank in pending:
                by_handle[self._conns[rank]] = rank
                by_handle[self._processes[rank].sentinel] = rank
            ready = mp_connection.wait(list(by_handle),
                                       timeout=min(_POLL_S, deadline - now))
            for rank in sorted({by_handle[h] for h in ready}):
                conn, proc = self._conns[rank], self._processes[rank]
                if conn.poll():
                    # A message (or EOF) is waiting: prefer it to the death
                    # notice, a worker may report an error and then exit.
                    receive(rank)
                elif not proc.is_alive():
                    proc.join(1.0)
                    deaths[rank] = proc.exitcode
                    pending.discard(rank)
            if first_failure is None and (errors or deaths):
                first_failure = time.monotonic()
                deadline = min(deadline, first_failure + _FAILURE_GRACE_S)

        if not (errors or deaths or pending):
            return [replies[r] for r in ranks]

        elapsed = time.monotonic() - start
        self._tear_down()
        exc = self._failure(what, errors, deaths, sorted(pending), elapsed, timeout_s)
        self._broken = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        cause = None
        if isinstance(exc, DistWorkerError) and exc.rank in errors:
            exc_bytes = errors[exc.rank][3]
            if exc_bytes is not None:
                try:
                    cause = pickle.loads(exc_bytes)
                except Exception:
                    cause = None
        if cause is not None:
            raise exc from cause
        raise exc

    def _tear_down(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        _terminate(self._processes, self._conns)

    def _failure(self, what: str, errors: dict, deaths: dict, pending: list,
                 elapsed: float, timeout_s: float) -> DistPoolError:
        """Build the exception for a failed ``_collect``.

        ``errors`` and ``deaths`` are in arrival order.  The reported
        ("primary") rank is the first worker that died, else the first rank
        whose error arrived: when a peer dies or raises, the others often fail
        in reaction (connection reset in a collective) a moment later.
        """
        ws = self.world_size
        if not errors and not deaths:
            return DistPoolTimeoutError(
                f"ranks {pending} of world_size={ws} did not answer within "
                f"{timeout_s:g} s while running {what} (waited {elapsed:.1f} s); "
                f"the pool has been terminated.",
                ranks=pending)

        failures = {r: f"worker died with {_describe_exit(c)}" for r, c in deaths.items()}
        failures.update({r: e[2] for r, e in errors.items()})
        rank = next(iter(deaths)) if deaths else next(iter(errors))
        notes = []
        for other in sorted(failures):
            if other == rank:
                continue
            lines = failures[other].strip().splitlines() or ["?"]
            notes.append(f"rank {other} also failed: {lines[-1]}")
        if pending:
            notes.append(f"ranks {pending} did not answer (probably blocked in a "
                         "collective waiting for the failed rank)")
        notes.append(f"The pool (world_size={ws}) has been terminated.")
        tail = "\n" + "\n".join(notes)
        if rank in deaths:
            return DistWorkerDiedError(
                f"rank {rank} (pid {self._processes[rank].pid}) of world_size={ws} died "
                f"with {_describe_exit(deaths[rank])} while running {what} (its stderr, "
                f"captured with the test's output, may say why){tail}",
                rank=rank, exitcode=deaths[rank], failures=failures)
        _, exc_type, tb_text, _ = errors[rank]
        return DistWorkerError(
            f"{exc_type} on rank {rank} of world_size={ws} while running {what}"
            f"{tail}\n\nTraceback on rank {rank}:\n{_indent(tb_text)}",
            rank=rank, exc_type=exc_type, worker_traceback=tb_text, failures=failures)


# --------------------------------------------------------------------------
# pytest integration
# --------------------------------------------------------------------------


# The worlds every test module shares (world size -> pool), started by the first module
# that asks and kept for the session; closed at exit.
_SHARED: dict[int, DistPool] = {}
# Their process groups' collective timeout: the longest a module's calls may take.
_SHARED_PG_TIMEOUT_S = 3660.0


def shared_pool(world_size: int, *, timeout_s: float = 300.0) -> DistPool:
    """The session's pool of `world_size` ranks, reset for a new module (``DistPool.reset``),
    its calls bounded by `timeout_s`; a new pool where there is none yet or the last one
    broke (a failure in one module leaves the next a healthy world)."""
    pool = _SHARED.get(world_size)
    if pool is not None and pool.broken is None:
        pool.timeout_s = float(timeout_s)
        try:
            pool.reset()
            return pool
        except DistPoolError:
            pool.close()
    pool = DistPool(world_size, timeout_s=timeout_s, pg_timeout_s=_SHARED_PG_TIMEOUT_S)
    _SHARED[world_size] = pool
    return pool


def dist_pool_fixture(world_size: int, *, timeout_s: float = 300.0,
                      scope: str = "module", **pool_kwargs: Any):
    """Make a pytest fixture yielding a :class:`DistPool`, one per ``scope``.

    In a test module::

        pool4 = dist_pool_fixture(4)          # fixture named "pool4"

        def test_sum(pool4):
            assert pool4.run(some_module_level_fn) == [...]

    The pool is handed out when the first test of the module asks for it. With the default
    module scope and no other pool options, every module gets the session's world of that
    size (:func:`shared_pool`): started once, reset for each module so that its workers
    start as new ones would, replaced when a failure broke it. Starting a world and warming
    its workers up (torch's first trace in a process loads and builds more than a second's
    worth) was paid again by every module. Nothing starts at import time.
    """
    import pytest

    if scope == "module" and not pool_kwargs:
        @pytest.fixture(scope=scope)
        def _shared_pool_fixture():
            yield shared_pool(world_size, timeout_s=timeout_s)

        return _shared_pool_fixture

    @pytest.fixture(scope=scope)
    def _dist_pool_fixture():
        with DistPool(world_size, timeout_s=timeout_s, **pool_kwargs) as pool:
            yield pool

    return _dist_pool_fixture


def fork_context():
    """The multiprocessing context DistPool's workers come from: children forked from the
    fork server that imported ``_PRELOAD`` once (spawn where there is no fork server).
    tests/forked.py runs the documentation's scripts in such children."""
    return _context()

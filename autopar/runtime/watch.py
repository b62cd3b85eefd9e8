"""No rank waits forever: every process group a job uses gets a bounded timeout, each rank
leaves its position (which engine, which step, which phase) in the job's store, and a
thread stamps the store every second while the process lives. When a collective times out
or loses a peer, the rank reads every other rank's position and stamp and raises
`RankStoppedError` with one sentence naming the rank that stopped and where, so that a
launcher such as `torchrun --max-restarts` can start the job again.

Under gloo a collective whose peer never comes raises after the group's timeout, and one
whose peer died raises at once ("Connection closed by peer"). Under NCCL torch's watchdog
ends the process after the same timeout (set here on every group) instead of raising."""

from __future__ import annotations

import atexit
import datetime
import itertools
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

from autopar.errors import PlanError, RankStoppedError

DEFAULT_TIMEOUT = 300.0  # seconds: a few minutes, never torch's 30
STAMP_EVERY = 0.5  # seconds between two liveness stamps of a process
# At exit the main thread lets go of the GIL this long, so that the collective backends'
# worker threads can drop the last collectives they ran (see _Stamper.stop).
SETTLE = 0.1
_PREFIX = "autopar-watch/"
_ENGINES = itertools.count(1)  # every rank builds its engines in the same order
# Error texts of a collective that lost its peer or ran out of time (gloo, NCCL, the store).
_LOST = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
         "connection refused", "socket closed")


def check_timeout(timeout) -> float | None:
    """Seconds from `timeout` (a number of seconds, a timedelta or None for torch's own
    default), refused in one sentence when it is not a positive duration."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise PlanError(f"timeout must be a positive number of seconds (or a timedelta, or "
                        f"None for torch's default), not {timeout!r}.")
    return float(timeout)


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective (or store call) that timed out or lost a peer."""
    if isinstance(error, RankStoppedError):
        return False
    backend_error = getattr(dist, "DistBackendError", None)
    if backend_error is not None and isinstance(error, backend_error):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(t in text for t in _LOST)


class _Stamper:
    """The process's liveness: a counter in the store, raised every STAMP_EVERY seconds by a
    daemon thread (a counter, not a clock, so clocks of different hosts never matter). The
    thread also publishes the position of the watch that moved last when it changed, so a
    step writes its position only once itself (`Watch.at`).

    The thread is stopped and joined when the interpreter exits (`stop`, run by atexit):
    a daemon thread still inside a store call when Python finalizes is ended from under its
    C++ frames, which aborts the process ("terminate called without an active exception")
    and turns a finished rank into a failed one for its launcher.

    The same abort comes from gloo's worker threads (`pt_gloo_runloop`): a worker drops a
    collective it ran a moment after the rank's wait for it returns, and when the rank let
    go of the tensors meanwhile, dropping them takes the GIL; a worker that asks for the GIL
    once finalization began is ended the same way (a rank whose last act is a collective,
    such as `full_state_dict` before it exits: of 25 two-rank jobs whose ranks exit right
    after their last collective, 10 aborted under load, none with the wait below). So the exit also waits SETTLE seconds with the GIL released.
    `destroy_process_group` is no cure: it leaves a group's workers running while anything
    still holds the group."""

    def __init__(self, store, rank: int):
        self.store, self.rank, self.count = store, rank, 0
        self.watch: Watch | None = None  # whose position this process publishes
        self.published = ""  # the position the store holds
        self.lock = threading.Lock()  # one position write at a time, the newest last
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="autopar-alive", daemon=True)
        self.thread.start()
        atexit.register(self.stop, SETTLE)

    def _run(self) -> None:
        try:
            while not self.done.is_set():
                self.count += 1
                self.store.set(f"alive/{self.rank}", str(self.count))
                self.publish()
                self.done.wait(STAMP_EVERY)
            self.publish()  # where a process that ends normally stopped
        except Exception:  # noqa: BLE001 - the store went away: the job is ending
            return

    def publish(self) -> None:
        """Write the position of `self.watch` unless the store holds it already."""
        with self.lock:
            watch = self.watch
            if watch is None:
                return
            value = f"{watch.number} {watch.position[0]} {watch.position[1]}"
            if value != self.published:
                self.store.set(f"at/{self.rank}", value)
                self.published = value

    def stop(self, settle: float = 0.0) -> None:
        """End the thread and wait for its store call in flight (bounded: a store whose host
        is gone answers within its own timeout, and exit never waits longer than 5 s); then,
        at exit, give the backends' workers `settle` seconds to drop their last collectives."""
        self.done.set()
        atexit.unregister(self.stop)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)
        if settle > 0:
            time.sleep(settle)


_STAMPERS: dict[int, _Stamper] = {}  # id of the default group's store -> its stamper


class Watch:
    """This rank's position in the job, kept in the default group's store, and the sentence
    that names a stopped rank. One per engine (`number` orders the engines of a job)."""

    def __init__(self, timeout: float | None, size: int):
        self.timeout, self.number, self.store = timeout, 0, None
        self.stamper: _Stamper | None = None
        if size > 1 and dist.is_available() and dist.is_initialized():
            self.number = next(_ENGINES)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.store = dist.PrefixStore(_PREFIX, dist.distributed_c10d._get_default_store())
            key = id(dist.group.WORLD)
            if key not in _STAMPERS:
                for old in _STAMPERS.values():  # a new default group: the old store's thread
                    old.stop()
                _STAMPERS.clear()
                _STAMPERS[key] = _Stamper(self.store, self.rank)
            self.stamper = _STAMPERS[key]
        self.position = (-1, "startup")

    def bound(self, groups) -> None:
        """Give every process group in `groups` (and the default group) this watch's timeout."""
        if self.store is None or self.timeout is None:
            return
        delta = datetime.timedelta(seconds=self.timeout)
        seen = set()
        for group in [dist.group.WORLD, *groups]:
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                dist.distributed_c10d._set_pg_timeout(delta, group)

    def at(self, step: int, phase: str, publish: bool = False) -> None:
        """This rank is now at `phase` of step `step` (0-based; -1 while starting). With
        `publish` (where a step or parallelize begins) the position is written to the store
        at once, a round trip to the store's host; else the liveness thread writes it within
        STAMP_EVERY, so a step costs one write however many phases it names."""
        self.position = (step, phase)
        if self.stamper is not None:
            self.stamper.watch = self
            if publish:
                try:
                    self.stamper.publish()
                except Exception:  # noqa: BLE001 - the store's host died; the next collective says so
                    pass

    @contextmanager
    def guard(self, step: int, phase: str):
        """Run a block at (step, phase); a lost peer or a timeout inside becomes one sentence
        naming the rank that stopped."""
        self.at(step, phase, publish=True)
        started = time.monotonic()
        try:
            yield
        except Exception as e:
            if self.store is None or not lost_peer(e):
                raise
            raise RankStoppedError(self.stopped(time.monotonic() - started)) from e

    def _read(self) -> tuple[dict[int, tuple], dict[int, int]]:
        positions, alive = {}, {}
        for r in range(self.world):
            for kind, out in (("at", positions), ("alive", alive)):
                key = f"{kind}/{r}"
                if self.store.check([key]):
                    value = self.store.get(key).decode()
                    out[r] = value.split(" ", 2) if kind == "at" else int(value)
        return ({r: (int(n), int(s), p) for r, (n, s, p) in positions.items()}, alive)

    def stopped(self, waited: float) -> str:
        """One sentence: which ranks stopped, and at which step and phase."""
        here = f"rank {self.rank} waited {waited:.0f} s {_where(*self.position)}"
        try:
            positions, before = self._read()
            time.sleep(3 * STAMP_EVERY)
            _, after = self._read()
        except Exception:  # noqa: BLE001 - the store lived with a rank that is gone
            return (f"{here} and lost the job's store: the rank that hosts it (rank 0 unless "
                    "a launcher hosts it) stopped; restart the job (torchrun --max-restarts).")
        dead = [r for r in range(self.world) if r != self.rank and
                before.get(r) is not None and after.get(r) == before.get(r)]
        if dead:
            return (f"{here}: {_ranks(dead)} stopped running ({_last(dead, positions, self)}); "
                    "restart the job (torchrun --max-restarts) to resume from the last "
                    "checkpoint.")
        missing = [r for r in range(self.world)
                   if r not in positions or positions[r][0] < self.number]
        if missing:
            return (f"{here}: {_ranks(missing)} never reached this parallelize call; start "
                    "every rank with the same script and arguments.")
        step = self.position[0]
        behind = [r for r in range(self.world) if positions[r][1] < step]
        if behind:
            return (f"{here}: {_ranks(behind)} stopped calling train_step "
                    f"({_last(behind, positions, self)}) while the others went on; every rank "
                    "must run the same steps.")
        return (f"{here}: no rank answered within the timeout "
                f"({_last(range(self.world), positions, self)}); a rank is stuck inside the "
                "step (raise parallelize's timeout if it is only slow).")


def _where(step: int, phase: str) -> str:
    if step < 0:
        return f"in {phase}"
    return f"after step {step}" if phase == "done" else f"in step {step} ({phase})"


def _ranks(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _last(ranks, positions: dict, watch: Watch) -> str:
    parts = []
    for r in ranks:
        if r == watch.rank:
            continue
        if r not in positions:
            parts.append(f"rank {r} never reached parallelize")
            continue
        number, step, phase = positions[r]
        parts.append(f"rank {r} last {_where(step, phase)}" if number == watch.number
                     else f"rank {r} last in an earlier parallelize call")
    if len(parts) == 1:  # "rank 3 stopped ... (last after step 4)"
        return parts[0].split(" ", 2)[2]
    return "; ".join(parts)

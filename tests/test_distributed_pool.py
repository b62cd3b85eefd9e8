"""Tests of the multi-process gloo test harness (tests/distributed.py).

The functions sent to the workers live at module level: the workers import
this module again (so nothing here may start a pool at import time).
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
from distributed import (
    DistPool,
    DistPoolBrokenError,
    DistPoolTimeoutError,
    DistWorkerDiedError,
    DistWorkerError,
    dist_pool_fixture,
)

pool2 = dist_pool_fixture(2, timeout_s=60)
pool4 = dist_pool_fixture(4, timeout_s=60)

# Per-worker state that must survive from one run() to the next.
_STATE: dict = {}


# --------------------------------------------------------------------------
# Functions run on the workers
# --------------------------------------------------------------------------


def _all_reduce_sum(offset, *, scale=1.0):
    rank = dist.get_rank()
    t = torch.tensor([rank + offset, scale * rank * rank], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def _describe_rank():
    rank = dist.get_rank()
    return {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "pid": os.getpid(),
        "env": {k: os.environ.get(k) for k in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT")},
        "num_threads": torch.get_num_threads(),
        "tensors": {"full": torch.full((3,), float(rank)),
                    "arange": torch.arange(rank + 1)},
    }


def _remember(key, value):
    _STATE[key] = value * (dist.get_rank() + 1)
    _STATE["calls"] = _STATE.get("calls", 0) + 1
    return sorted(_STATE)


def _recall(key):
    _STATE["calls"] = _STATE.get("calls", 0) + 1
    return _STATE[key], _STATE["calls"], os.getpid()


def _device_mesh_sums():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    return list(mesh.get_coordinate()), t.item()


def _fail_on_rank1(message):
    if dist.get_rank() == 1:
        raise ValueError(message)
    # The other ranks block here, waiting for rank 1 forever.
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _rank0_waits_for_nothing():
    if dist.get_rank() == 0:
        t = torch.zeros(1)
        dist.recv(t, src=1)  # rank 1 never sends
    return dist.get_rank()


def _rank1_exits(code):
    if dist.get_rank() == 1:
        os._exit(code)
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits on the dying peer
    return t.item()


def _rank():
    return dist.get_rank()


# --------------------------------------------------------------------------
# Shared (module-scoped) pools
# --------------------------------------------------------------------------


@pytest.mark.parametrize("pool_name, world", [("pool2", 2), ("pool4", 4)])
def test_all_reduce_sum_on_every_rank(request, pool_name, world):
    pool = request.getfixturevalue(pool_name)
    results = pool.run(_all_reduce_sum, 10.0, scale=0.5)
    expected = [float(sum(r + 10.0 for r in range(world))),
                0.5 * sum(r * r for r in range(world))]
    assert results == [expected] * world


@pytest.mark.parametrize("pool_name, world", [("pool2", 2), ("pool4", 4)])
def test_results_ordered_by_rank(request, pool_name, world):
    pool = request.getfixturevalue(pool_name)
    results = pool.run(_describe_rank)
    assert isinstance(results, list) and len(results) == world
    assert [r["rank"] for r in results] == list(range(world))
    assert [r["pid"] for r in results] == pool.pids
    for rank, r in enumerate(results):
        assert r["world_size"] == world
        assert r["backend"] == "gloo"
        assert r["num_threads"] == 1
        assert r["env"] == {
            "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(pool.port)}
        assert torch.equal(r["tensors"]["full"], torch.full((3,), float(rank)))
        assert torch.equal(r["tensors"]["arange"], torch.arange(rank + 1))


def test_same_pool_serves_several_calls_and_keeps_state(pool4):
    pids = pool4.pids
    assert pool4.run(_remember, "x", 7) == [["calls", "x"]] * 4
    first = pool4.run(_recall, "x")
    second = pool4.run(_recall, "x")
    assert [v for v, _, _ in first] == [7, 14, 21, 28]
    assert [pid for _, _, pid in second] == pids
    # Each call bumped the per-worker counter exactly once.
    assert [c2 - c1 for (_, c1, _), (_, c2, _) in zip(first, second)] == [1] * 4
    assert pool4.run(_all_reduce_sum, 0.0) == [[6.0, 14.0]] * 4
    assert pool4.pids == pids and pool4.broken is None


def test_device_mesh_uses_the_pool_world(pool4):
    results = pool4.run(_device_mesh_sums)
    coords = [c for c, _ in results]
    assert coords == [[0, 0], [0, 1], [1, 0], [1, 1]]
    # tp groups are {0, 1} and {2, 3}
    assert [s for _, s in results] == [1.0, 1.0, 5.0, 5.0]


def _environ_and_cwd(key):
    return os.environ.get(key), os.getcwd()


def test_workers_start_with_the_test_process_environment_and_directory(tmp_path,
                                                                       monkeypatch):
    """Workers are forked from a fork server started earlier, in another environment: they
    take the variables and working directory the test process has when the pool starts."""
    monkeypatch.setenv("AUTOPAR_POOL_PROBE", "set after the fork server started")
    monkeypatch.chdir(tmp_path)
    with DistPool(2, timeout_s=60) as pool:
        got = pool.run(_environ_and_cwd, "AUTOPAR_POOL_PROBE")
    assert got == [("set after the fork server started", os.getcwd())] * 2


# What another module's fixture is: the same call, made again.
other_module_pool2 = dist_pool_fixture(2, timeout_s=60)


def _draw_and_patch(rank):
    """Leave state behind as a test might: draws from torch's generator (rank `rank` more),
    float64 by default, no grad, an autopar constant changed."""
    from autopar.graph import losses

    for _ in range(1 + (dist.get_rank() == rank)):
        torch.rand(3)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    losses.CHUNK_BYTES = 7


def _fresh_state():
    from autopar.graph import losses

    return (torch.rand(3).tolist(), torch.get_default_dtype(),
            torch.is_grad_enabled(), losses.CHUNK_BYTES, os.environ.get("AUTOPAR_POOL_PROBE"),
            os.getcwd(), os.environ["RANK"])


def test_modules_share_one_world_each_module_finds_as_new(pool2, request, tmp_path,
                                                          monkeypatch):
    """Every module gets the session's world of its size (no start-up, no warm-up again), and
    finds its workers as new ones: what an earlier module left behind is reset, and the
    environment and directory are the test process's at the module's start."""
    with DistPool(2, timeout_s=60) as new:
        fresh = new.run(_fresh_state)
    pids = pool2.pids
    pool2.run(_draw_and_patch, 1)
    monkeypatch.setenv("AUTOPAR_POOL_PROBE", "set for the next module")
    monkeypatch.chdir(tmp_path)
    next_module = request.getfixturevalue("other_module_pool2")
    assert next_module.pids == pids
    got = next_module.run(_fresh_state)
    assert [g[:4] + g[6:] for g in got] == [f[:4] + f[6:] for f in fresh]
    assert [g[4:6] for g in got] == [("set for the next module", str(tmp_path))] * 2


def _groups_held():
    """This worker's process groups, autopar's cached groups and its threads."""
    from torch.distributed import distributed_c10d

    from autopar.runtime import mesh

    return (len(distributed_c10d._world.pg_map), len(mesh._SHARED),
            len(os.listdir("/proc/self/task")))


def _make_groups(n):
    """Leave process groups behind as a module's tests do: `n` made directly (one kept in a
    module global) and one through autopar's group cache, each used once."""
    from autopar.runtime.mesh import shared_group

    groups = [dist.new_group([0, 1]) for _ in range(n)]
    groups.append(shared_group(("probe",), lambda: dist.new_group([0, 1])))
    for g in groups:
        dist.all_reduce(torch.ones(1), group=g)
    _STATE["group"] = groups[0]
    return _groups_held()


def _sum_in_new_group():
    g = dist.new_group([0, 1])
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=g)
    return t.item()


def test_a_reset_destroys_the_groups_a_module_made(pool2, request):
    """Each gloo group keeps transport threads that poll while the worker idles: the next
    module finds only the world's group, autopar's group cache empty and the threads gone,
    and makes groups of its own as before."""
    before = pool2.run(_groups_held)
    made = pool2.run(_make_groups, 4)
    assert [m[:2] for m in made] == [(before[0][0] + 5, 2)] * 2  # 5 groups; probe + world
    assert all(m[2] > b[2] for m, b in zip(made, before))
    next_module = request.getfixturevalue("third_module_pool2")
    after = next_module.run(_groups_held)
    assert [a[:2] for a in after] == [(1, 0)] * 2
    assert all(a[2] < m[2] for a, m in zip(after, made))
    assert next_module.run(_sum_in_new_group) == [1.0, 1.0]


third_module_pool2 = dist_pool_fixture(2, timeout_s=60)


def _held_here(key):
    return _STATE[key](), torch.get_num_threads(), _all_reduce_sum(0.0), os.getppid()


def test_a_forked_pool_starts_with_what_the_test_process_holds():
    """fork=True: the workers are the test process's own children and hold what it held when
    the pool started (here a function, which does not pickle), with torch on one thread."""
    _STATE["made here"] = lambda: "made in the test process"
    try:
        with DistPool(2, timeout_s=60, fork=True) as pool:
            got = pool.run(_held_here, "made here")
    finally:
        del _STATE["made here"]
    assert got == [("made in the test process", 1, [1.0, 1.0], os.getpid())] * 2


def test_unpicklable_fn_fails_in_parent_and_pool_survives(pool2):
    with pytest.raises(TypeError, match="module-level function"):
        pool2.run(lambda: 1)
    assert pool2.broken is None
    assert pool2.run(_rank) == [0, 1]


# --------------------------------------------------------------------------
# Failures: each test gets a pool of its own, since failures break the pool
# --------------------------------------------------------------------------


def _assert_workers_gone(pool):
    assert pool.processes
    for p in pool.processes:
        assert not p.is_alive()
        assert p.exitcode is not None
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)


def test_exception_on_rank1_is_reraised_and_pool_breaks():
    with DistPool(4, timeout_s=60) as pool:
        t0 = time.monotonic()
        with pytest.raises(DistWorkerError) as info:
            pool.run(_fail_on_rank1, "boom from rank 1")
        assert time.monotonic() - t0 < 10
        err = info.value
        text = str(err)
        assert err.rank == 1
        assert err.exc_type == "builtins.ValueError"
        assert "ValueError on rank 1 of world_size=4" in text
        assert "Traceback on rank 1" in text
        assert "Traceback (most recent call last)" in text
        assert "in _fail_on_rank1" in text
        assert "raise ValueError(message)" in text
        assert "ValueError: boom from rank 1" in text
        assert "[0, 2, 3] did not answer" in text
        assert isinstance(err.__cause__, ValueError)
        assert str(err.__cause__) == "boom from rank 1"
        _assert_workers_gone(pool)

        t0 = time.monotonic()
        with pytest.raises(DistPoolBrokenError, match="broken because of an earlier failure") as later:
            pool.run(_rank)
        assert time.monotonic() - t0 < 1.0
        assert "ValueError on rank 1" in str(later.value)


def test_hang_on_rank0_times_out_and_workers_are_gone():
    with DistPool(2, timeout_s=5) as pool:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            pool.run(_rank0_waits_for_nothing)
        elapsed = time.monotonic() - t0
        assert 4.9 <= elapsed < 12
        assert isinstance(info.value, DistPoolTimeoutError)
        assert info.value.ranks == [0]
        assert "ranks [0] of world_size=2 did not answer within 5 s" in str(info.value)
        _assert_workers_gone(pool)
        with pytest.raises(DistPoolBrokenError, match="TimeoutError"):
            pool.run(_rank)


def test_worker_exit_is_reported_with_exit_code():
    with DistPool(2, timeout_s=60) as pool:
        t0 = time.monotonic()
        with pytest.raises(DistWorkerDiedError) as info:
            pool.run(_rank1_exits, 3)
        assert time.monotonic() - t0 < 10
        err = info.value
        assert err.rank == 1
        assert err.exitcode == 3
        assert "rank 1" in str(err) and "exit code 3" in str(err)
        _assert_workers_gone(pool)
        with pytest.raises(DistPoolBrokenError, match="exit code 3"):
            pool.run(_rank)


def test_close_is_idempotent_and_stops_workers():
    pool = DistPool(2, timeout_s=60)
    assert pool.run(_rank) == [0, 1]
    pool.close()
    _assert_workers_gone(pool)
    assert [p.exitcode for p in pool.processes] == [0, 0]  # clean exit
    pool.close()
    with pytest.raises(DistPoolBrokenError, match="closed"):
        pool.run(_rank)

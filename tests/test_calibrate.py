"""Tests of `autopar calibrate` (autopar/cost/calibrate.py): fits, world 1 and world 2."""

import argparse
import json
import math

import pytest
import torch.distributed as dist
from distributed import dist_pool_fixture

import autopar
from autopar.cost import calibrate as cal
from autopar.cost.comm import OPS, SYMBOLS, collective_expr, single_link
from autopar.cost.hardware import load_hardware
from autopar.errors import WorldError

pool2 = dist_pool_fixture(2, timeout_s=120)


def cli(*argv):
    parser = argparse.ArgumentParser(prog="autopar")
    cal.add_parser(parser.add_subparsers(dest="command", required=True))
    return cal.run(parser.parse_args(["calibrate", *argv]))


def positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_compute(hw):
    assert all(positive(v) for v in hw.peak_flops.values())
    assert positive(hw.memory_bandwidth)
    assert math.isfinite(hw.gemm_half_flops) and hw.gemm_half_flops >= 0
    assert 0 < hw.gemm_efficiency <= 1
    m = hw.extra["matmul"]
    assert len(m["seconds"]) == len(m["dims"]) >= 3
    assert all(positive(s) for s in m["seconds"])
    assert positive(hw.extra["copy"]["seconds"])


# ----------------------------------------------------------------------------- fits


def test_fit_gemm_recovers_the_efficiency_curve():
    peak, eff, half = 2e12, 0.7, 5e8
    flops = [1e6, 1e8, 1e10, 1e12]
    seconds = [f / (peak * eff * f / (f + half)) for f in flops]
    got_peak, got_eff, got_half = cal.fit_gemm(flops, seconds)
    assert got_half == pytest.approx(half, rel=1e-6)
    assert got_eff <= 1
    for f, s in zip(flops, seconds):  # the fitted curve predicts every measurement
        assert f / (got_peak * got_eff * f / (f + got_half)) == pytest.approx(s, rel=1e-6)


def test_fit_gemm_keeps_efficiency_below_one_when_big_matmuls_slow_down():
    flops = [1e6, 1e8, 1e10]
    seconds = [f / r for f, r in zip(flops, [1e9, 8e9, 5e9])]  # out of cache at the top
    peak, eff, _ = cal.fit_gemm(flops, seconds)
    assert peak == pytest.approx(8e9) and 0 < eff < 1


def test_fit_alpha_beta_recovers_the_link():
    alpha, beta, world = 3e-5, 1 / 4e9, 4
    samples = []
    for op in OPS:
        expr = single_link(collective_expr(op, cal.FIT_ALGORITHM[op]))
        for n in (1e3, 1e5, 1e7):
            t = float(expr.subs({SYMBOLS.n: n, SYMBOLS.p: world, SYMBOLS.alpha: alpha,
                                 SYMBOLS.beta: beta}))
            samples.append((op, n, t))
    got_alpha, got_beta = cal.fit_alpha_beta(samples, world)
    assert got_alpha == pytest.approx(alpha, rel=1e-6)
    assert got_beta == pytest.approx(beta, rel=1e-6)


def test_fit_alpha_beta_never_returns_zero():
    # time that does not grow with size: the fit pins beta at zero, the bound replaces it
    alpha, beta = cal.fit_alpha_beta([("p2p", 1e3, 1e-4), ("p2p", 1e6, 1e-4)], 2)
    assert positive(alpha) and positive(beta)
    assert alpha + 1e6 * beta >= 1e-4


def test_compute_share_is_the_cores_each_rank_gets_when_all_compute():
    assert cal.compute_share(4, threads=1, cores=2) == 0.5
    assert cal.compute_share(2, threads=2, cores=2) == 0.5
    assert cal.compute_share(2, threads=1, cores=2) == 1.0
    assert cal.compute_share(4, threads=2, cores=16) == 1.0  # enough cores: no sharing
    assert 0 < cal.compute_share(64) <= 1  # this machine's cores and threads


# ----------------------------------------------------------------------------- world 1


def test_world1_cli_writes_a_profile_that_loads(tmp_path, capsys):
    path = str(tmp_path / "one.json")
    assert cli("-o", path, "--quick", "--name", "here") == 0
    assert f"wrote {path}: here: fp32" in capsys.readouterr().out
    hw = load_hardware(path)
    assert hw.name == "here"
    check_compute(hw)
    base = load_hardware("cpu")
    assert hw.intra_node_bandwidth == base.intra_node_bandwidth  # not measured at world 1
    assert hw.memory_bytes == base.memory_bytes
    assert "one rank" in hw.extra["links"] and "collectives" not in hw.extra
    assert hw.collectives == {}  # not measured: every collective sees the link's figures
    # a CPU's host is its own memory: offloading copies at the measured copy rate
    assert hw.host_bandwidth == pytest.approx(hw.memory_bandwidth / 2)
    assert 0 < hw.compute_share <= 1
    assert autopar.World(4, device=path).profile == hw


def test_cli_refuses_impossible_requests(tmp_path, monkeypatch):
    with pytest.raises(WorldError, match="unknown device 'tpu-v9'"):
        cli("-o", str(tmp_path / "x.json"), "--base", "tpu-v9")
    with pytest.raises(WorldError, match="--world must be at least 1"):
        cli("-o", str(tmp_path / "x.json"), "--world", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(WorldError, match="drop --world under torchrun"):
        cli("-o", str(tmp_path / "x.json"), "--world", "2")


# ----------------------------------------------------------------------------- world 2


def test_world2_spawned_by_the_cli_measures_every_collective(tmp_path):
    path = str(tmp_path / "two.json")
    assert cli("-o", path, "--quick", "--world", "2") == 0
    with open(path) as f:
        raw = json.load(f)
    hw = load_hardware(path)
    assert hw.to_json() == raw
    check_compute(hw)
    assert hw.extra["calibration"]["world"] == 2
    assert hw.extra["calibration"]["backend"] == "gloo"
    assert set(hw.extra["collectives"]) == set(OPS)
    for op, record in hw.extra["collectives"].items():
        assert len(record["bytes"]) == len(cal.QUICK.message_bytes), op
        assert all(positive(s) for s in record["seconds"]), op
        assert positive(record["alpha"]) and positive(record["beta"]), op
    for field in ("intra_node_latency", "intra_node_bandwidth", "inter_node_latency",
                  "inter_node_bandwidth"):
        assert positive(getattr(hw, field)), field
    assert hw.inter_node_bandwidth == hw.intra_node_bandwidth
    # each collective's own fit goes into the profile, for the planner to price it by
    assert set(hw.collectives) == set(OPS)
    for op, fit in hw.collectives.items():
        record = hw.extra["collectives"][op]
        assert fit == {"algorithm": cal.FIT_ALGORITHM[op], "alpha": record["alpha"],
                       "beta": record["beta"]}, op
    assert autopar.World(4, device=path).profile.intra_node_latency == hw.intra_node_latency


def _calibrate_on_every_rank():
    return cal.calibrate(quick=True, sizes=(2 ** 10, 2 ** 16)).to_json()


def _refused_collective():
    def refuse(numel, world, rank, device):
        def call():
            raise RuntimeError(f"{dist.get_backend()} cannot broadcast here")
        return call

    good = {"all_reduce": cal.COLLECTIVES["all_reduce"], "broadcast": refuse}
    return cal.measure_collectives((2 ** 10,), cal._device(), cal.QUICK, collectives=good)


def test_every_rank_agrees_on_the_profile(pool2):
    first, second = pool2.run(_calibrate_on_every_rank)
    assert first == second
    assert first["extra"]["collectives"]["p2p"]["bytes"] == [2 ** 10, 2 ** 16]


def test_a_collective_the_backend_refuses_is_recorded_and_skipped(pool2):
    for record in pool2.run(_refused_collective):
        assert record["broadcast"] == {"skipped": "gloo does not run broadcast: gloo cannot "
                                                  "broadcast here"}
        assert positive(record["all_reduce"]["seconds"][0])

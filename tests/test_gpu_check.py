"""benchmarks/gpu_check.py off the GPU: its command line, its no-GPU note, its judging
helpers, and the same checks run end to end on CPU processes over gloo at world 2.

The command line and the no-GPU note are its main() in this process (no interpreter of its
own); the world-2 run is the command, forked from the preloaded server (tests/forked.py),
whose two ranks the script spawns (a rank's memory check counts every tensor its process
holds, so it needs a process of its own)."""

import json
import os
import sys

import pytest
import torch
from forked import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_check  # noqa: E402


def test_help_names_the_options(capsys):
    with pytest.raises(SystemExit) as done:
        gpu_check.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--world", "--device", "--backend", "--quick"):
        assert flag in out


def test_without_a_gpu_it_says_so_and_succeeds(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert gpu_check.main([]) == 0
    assert "no GPU" in capsys.readouterr().out


def test_plans_fit_the_world():
    assert list(gpu_check.plans_for(1)) == ["data 1"]
    assert list(gpu_check.plans_for(2)) == ["data 2", "tensor 2", "zero3 2",
                                            "pipeline 2 x data 1"]
    assert "pipeline" not in " ".join(gpu_check.plans_for(3))
    assert gpu_check.plans_for(4)["pipeline 2 x data 2"]["data"] == 2


def test_judging_names_each_mismatch_and_ignores_times():
    assert gpu_check.loss_error([1.0, 2.5], [1.0, 2.0]) == 0.25
    rows = [{"check": "equal", "name": "a", "value": 0.01},
            {"check": "equal", "name": "b", "value": 0.5},
            {"check": "equal", "name": "c", "value": float("nan")},
            {"check": "memory", "name": "m", "value": 1.05},
            {"check": "memory", "name": "n", "value": 1.3},
            {"check": "time", "name": "t", "value": 9.0}]
    bad = gpu_check.judge(rows)
    assert [line.split(":")[0] for line in bad] == ["b", "c", "n"]
    worst = gpu_check.merge([[{"check": "equal", "name": "a", "value": 0.1}],
                             [{"check": "equal", "name": "a", "value": 0.3}]])
    assert worst == [{"check": "equal", "name": "a", "value": 0.3, "rank": 1}]


def test_the_checks_run_on_cpu_over_gloo():
    out = run_script(SCRIPT, ["--device", "cpu", "--backend", "gloo", "--world", "2", "--quick",
                              "--steps", "2", "--timing-steps", "1"],
                     cwd=ROOT, timeout=600, environ={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stdout + out.stderr
    with open(os.path.join(ROOT, "benchmarks", "results", "gpu_check.json")) as f:
        result = json.load(f)
    checks = [row["check"] for row in result["rows"]]
    assert checks.count("equal") == 4 and checks.count("memory") == 1
    assert checks.count("time") == 2 and result["failed"] == []

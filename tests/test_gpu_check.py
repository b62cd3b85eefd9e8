"""benchmarks/gpu_check.py off the GPU: its command line, its no-GPU note, its judging
helpers, and the same checks run end to end on CPU processes over gloo at world 2."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_check  # noqa: E402


def _run(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})


def test_help_names_the_options():
    out = _run("--help")
    assert out.returncode == 0, out.stderr
    for flag in ("--world", "--device", "--backend", "--quick"):
        assert flag in out.stdout


def test_without_a_gpu_it_says_so_and_succeeds():
    out = _run(env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    assert "no GPU" in out.stdout


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
    out = _run("--device", "cpu", "--backend", "gloo", "--world", "2", "--quick",
               "--steps", "2", "--timing-steps", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    with open(os.path.join(ROOT, "benchmarks", "results", "gpu_check.json")) as f:
        result = json.load(f)
    checks = [row["check"] for row in result["rows"]]
    assert checks.count("equal") == 4 and checks.count("memory") == 1
    assert checks.count("time") == 2 and result["failed"] == []

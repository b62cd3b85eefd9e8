"""benchmarks/gpu_truth.py off the GPU: its refusals, its table, and every section run end to
end on the CPU on tiny models (`--device cpu --quick`), so the script that a GPU session
runs first has run here before."""

import json
import os
import subprocess
import sys

import pytest
from forked import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_truth.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_truth  # noqa: E402


def _run(*args, env=None, timeout=900):
    """`python benchmarks/gpu_truth.py ARGS`, forked from the preloaded server (tests/forked.py):
    the sections it starts are interpreters of their own, as on a GPU machine."""
    return run_script(SCRIPT, list(args), cwd=ROOT, timeout=timeout,
                      environ={**os.environ, "PYTHONPATH": ROOT, **(env or {})})


def _main(capsys, *args) -> subprocess.CompletedProcess:
    """The script's main in this process (what it decides before its first section needs
    no interpreter of its own; test_every_section_runs_on_the_cpu runs it as a command)."""
    code = gpu_truth.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_without_a_gpu_it_says_so_and_succeeds(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_truth.torch.cuda, "is_available", lambda: False)  # a CPU machine
    out = _main(capsys, "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "no GPU" in out.stdout


def test_it_refuses_a_budget_it_cannot_finish_in(tmp_path, capsys):
    out = _main(capsys, "--device", "cpu", "--quick", "--budget-s", "20", "--out",
                str(tmp_path))
    assert out.returncode == 2
    need = sum(q for _, q in gpu_truth.ESTIMATE_S.values())
    assert out.stderr.strip() == (
        f"gpu_truth: the sections calibrate, predict, overhead, ranks need about {need} s but "
        "--budget-s is 20 s; pass fewer --sections or a larger budget.")
    out = _main(capsys, "--device", "cpu", "--sections", "calibrate,nope", "--out",
                str(tmp_path))
    assert out.returncode == 2
    assert "unknown section 'nope'" in out.stderr


def test_gemm_shapes_are_one_tensor_rank_of_llama3_8b():
    whole, tp8 = gpu_truth.gemm_shapes(8192, 1), gpu_truth.gemm_shapes(8192, 8)
    assert whole["qkv"] == (8192, 4096, 6144) and tp8["qkv"] == (8192, 4096, 768)
    assert whole["down"] == (8192, 14336, 4096) and tp8["down"] == (8192, 1792, 4096)
    assert tp8["head"] == (8192, 4096, 128256 // 8)


def test_the_table_puts_each_prediction_beside_its_measurement():
    results = {
        "calibrate": {"facts": [{"what": "memory_bandwidth", "builtin": 4.8,
                                 "measured": 4.0}]},
        "predict": {"models": [
            {"model": "m", "measured_step_s": 2.0, "predicted_step_s": 1.8,
             "calibrated_step_s": 2.1, "measured_peak_bytes": 100,
             "predicted_memory_bytes": 104},
            {"model": "bad", "error": "RuntimeError: no"}]},
        "overhead": {"model": "m", "step_s": {"eager": 1.0, "autopar": 1.02,
                                              "autopar (recorder off)": 1.01,
                                              "torch.compile": 0.8}},
        "ranks": {"plans": {"tensor 2": {"losses": [5.0], "reference": [5.05],
                                         "error_rel": 0.0099, "devices": ["cuda"]}}},
    }
    rows = {r["what"]: r for r in gpu_truth.summarize(results)}
    assert rows["memory_bandwidth"]["ratio"] == pytest.approx(1.2)
    assert rows["m built-in profile"]["ratio"] == pytest.approx(0.9)
    assert rows["m calibrated profile"]["ratio"] == pytest.approx(1.05)
    assert rows["m peak"]["ratio"] == pytest.approx(1.04)
    assert rows["bad: RuntimeError: no"]["failed"]
    assert rows["autopar / eager (m)"]["ratio"] == pytest.approx(1.02)
    assert rows["tensor 2 on cuda vs one device (loss)"]["ratio"] == pytest.approx(1.0099)


def test_every_section_runs_on_the_cpu(tmp_path):
    out = _run("--device", "cpu", "--quick", "--compile-backend", "eager", "--budget-s",
               "900", "--out", str(tmp_path), timeout=1200)
    assert out.returncode == 0, out.stdout + out.stderr
    with open(tmp_path / "gpu_truth.json") as f:
        result = json.load(f)
    sections = result["sections"]
    assert [s for s, r in sections.items() if "error" in r] == []
    assert {s for s in sections} == set(gpu_truth.SECTIONS)
    # calibration wrote a profile the planner accepts, with the attention fit in it
    from autopar.world import World
    World(devices=1, per_node=1, device=str(tmp_path / "calibrated_profile.json"))
    assert sections["calibrate"]["calibrated_profile"]["extra"]["attention"]["rows"]
    assert len(sections["calibrate"]["gemm_shapes"]) == 4 * 5
    for model in sections["predict"]["models"]:
        assert "error" not in model, model.get("traceback")
        assert model["predicted_step_s"] > 0 and model["measured_step_s"] > 0
        assert model["calibrated_step_s"] > 0
        blocks = [r for r in model["layers"] if r["layer"].startswith("blocks.")]
        assert len(blocks) == 2 and all(r["measured_s"] > 0 for r in blocks)
    assert set(sections["overhead"]["step_s"]) == {"eager", "torch.compile", "autopar",
                                                  "autopar (recorder off)",
                                                  "compile_first_step_s"}
    for name, plan in sections["ranks"]["plans"].items():
        assert plan["error_rel"] <= gpu_truth.LOSS_TOLERANCE, name
        assert plan["comm_bytes"] > 0, name
    z3 = sections["ranks"]["zero3_compiled"]  # compiled ZeRO-3 beside eager: equal losses
    assert "error" not in z3, z3.get("traceback")
    assert z3["losses"] == sections["ranks"]["plans"]["zero3 dp 2"]["losses"]
    assert z3["regions"] > 0
    assert z3["step_s"]["compiled"] > 0 and z3["step_s"]["eager"] > 0 and z3["ratio"] > 0
    assert "gpu_truth on cpu" in out.stdout

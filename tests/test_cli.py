"""The command line of the planner: explain, search, the JSON contract, errors, --min-devices."""

from __future__ import annotations

import json

import pytest

from autopar import Plan
from autopar.cli import main

SMALL = "gpt:layers=4,hidden=256,heads=8,vocab=1024,seq=256"


def _json(capsys, argv) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_explain_json_has_the_public_fields(capsys):
    data = _json(capsys, ["explain", SMALL, "--world", "16", "--batch", "32", "--format", "json"])
    assert data["version"] == 1
    assert data["world"] == {"devices": 16, "per_node": 8, "device": "a100-80gb"}
    mesh = data["mesh"]
    assert mesh["pp"] * mesh["dp"] * mesh["cp"] * mesh["tp"] == 16
    for key in ("step_time_s", "compute_s", "comm_s", "bubble_s", "memory_per_device_bytes",
                "comm_bytes_per_device", "model_flops_per_step", "mfu"):
        assert key in data["predicted"], key
    assert data["predicted"]["step_time_s"] > 0 and 0 < data["predicted"]["mfu"] < 1
    assert data["search"]["candidates"] > 0 and data["search"]["time_s"] >= 0
    assert {"schedule", "microbatches", "micro_batch_size"} <= set(data["pipeline"])
    assert [lp["name"] for lp in data["layers"]].count("blocks.3") == 1
    assert all({"name", "tp_mode", "sp", "recompute", "stage"} <= set(lp) for lp in data["layers"])
    # every alternative says why it lost
    assert all(alt["reason"] for alt in data["search"]["alternatives"])


def test_fixed_choices_are_kept(capsys):
    data = _json(capsys, ["explain", SMALL, "--world", "8", "--batch", "16", "--tp", "2",
                          "--pp", "2", "--zero", "1", "--recompute", "full", "--schedule",
                          "1f1b", "--format", "json"])
    assert data["mesh"] == {"pp": 2, "dp": 2, "cp": 1, "tp": 2}
    assert data["zero"]["stage"] == 1
    assert data["pipeline"]["schedule"] == "1f1b"
    blocks = [lp for lp in data["layers"] if lp["name"].startswith("blocks.")]
    assert {lp["recompute"] for lp in blocks} == {"full"}
    assert {lp["stage"] for lp in data["layers"]} == {0, 1}


def test_search_writes_a_plan_that_explain_reprices(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["search", SMALL, "--world", "8", "--batch", "16", "-o", str(out)]) == 0
    capsys.readouterr()
    plan = Plan.load(out)
    assert plan.world_size == 8 and plan.predicted["step_time_s"] > 0
    again = _json(capsys, ["explain", SMALL, "--world", "8", "--batch", "16", "--plan", str(out),
                           "--format", "json"])
    assert again["mesh"] == plan.mesh
    assert again["predicted"]["step_time_s"] == pytest.approx(plan.predicted["step_time_s"])


def test_text_report_reads_top_to_bottom(capsys):
    assert main(["explain", SMALL, "--world", "8", "--batch", "16", "--tp", "4"]) == 0
    text = capsys.readouterr().out
    for phrase in ("autopar plan for 8 x a100-80gb", "predicted step", "memory per device",
                   "blocks.0 .. blocks.3", "why this plan"):
        assert phrase in text, phrase


@pytest.mark.parametrize("argv, message", [
    (["--world", "8", "--device", "a100"], "Did you mean 'a100-80gb'"),
    (["--world", "8", "--tp", "3"], "cannot tile a world of 8"),
    (["--world", "8", "--dp", "8", "--batch", "3"], "does not split over any data-parallel size"),
])
def test_bad_requests_exit_2_with_one_sentence(capsys, argv, message):
    assert main(["explain", SMALL, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("autopar: ")


def test_a_model_that_fits_nowhere_names_the_closest_plan(capsys):
    assert main(["explain", "gpt3-175b", "--world", "2", "--batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "no plan fits in memory on 2 x a100-80gb" in err
    assert "devices would be needed" in err


def test_min_devices_finds_the_fewest(capsys):
    data = _json(capsys, ["explain", "llama2-7b", "--world", "64", "--batch", "64", "--seq",
                          "4096", "--device", "a100-40gb", "--min-devices", "--format", "json"])
    n = data["min_devices"]["devices"]
    assert data["world"]["devices"] == n and 1 < n <= 64
    # one device fewer (the next smaller size tried) did not fit
    assert data["min_devices"]["tried"], "smaller worlds were tried first"


def test_executable_search_keeps_to_what_parallelize_runs(tmp_path, capsys):
    """--executable searches only what parallelize runs and says what it left out; without
    it nothing is left out (with cp and tp fixed the winner was, when written, Megatron-SP
    beside the cp axis, which the runtime refuses)."""
    fixed = [SMALL, "--world", "8", "--batch", "16", "--cp", "2", "--tp", "2"]
    free, runnable = tmp_path / "free.json", tmp_path / "runnable.json"
    assert main(["search", *fixed, "-o", str(free)]) == 0
    assert main(["search", *fixed, "--executable", "-o", str(runnable)]) == 0
    capsys.readouterr()
    assert Plan.load(free).search["left_out"] == []
    plan = Plan.load(runnable)
    assert plan.unsupported() == []
    assert plan.mesh == {"pp": 1, "dp": 2, "cp": 2, "tp": 2}
    assert any("recomputation" in note for note in plan.search["left_out"])


def test_explain_with_a_plan_file_takes_its_world_batch_and_dtype(tmp_path, capsys):
    """`explain MODEL --plan FILE` with nothing else prices the plan on the world, device,
    batch and dtype it was searched for; what the command line gives still wins."""
    out = tmp_path / "plan.json"
    assert main(["search", SMALL, "--world", "4", "--device", "a100-40gb", "--per-node", "4",
                 "--batch", "12", "--dtype", "fp32", "-o", str(out)]) == 0
    capsys.readouterr()
    data = _json(capsys, ["explain", SMALL, "--plan", str(out), "--format", "json"])
    assert data["world"] == {"devices": 4, "per_node": 4, "device": "a100-40gb"}
    assert data["search"]["global_batch"] == 12 and data["search"]["dtype"] == "fp32"
    assert data["mesh"] == Plan.load(out).mesh
    data = _json(capsys, ["explain", SMALL, "--plan", str(out), "--batch", "24", "--format",
                          "json"])
    assert data["search"]["global_batch"] == 24


def test_defaults_without_a_plan_file(capsys):
    data = _json(capsys, ["explain", SMALL, "--format", "json"])
    assert data["world"] == {"devices": 8, "per_node": 8, "device": "a100-80gb"}
    assert data["search"]["global_batch"] == 8 and data["search"]["dtype"] == "bf16"

"""The command line of the planner: explain, search, the JSON contract, errors, --min-devices."""

from __future__ import annotations

import json
import sys

import pytest

from autopar import Plan
from autopar.cli import main
from autopar.modes import CP, MEGATRON_SP, TP

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


def test_explain_keeps_a_saved_plans_sequence_parallel_choice_beside_cp(tmp_path, capsys):
    """A cp x tp plan with Megatron-SP: explaining it keeps the layers' sequence-parallel
    choice (and its cp mode) and reports the time the search priced."""
    out = tmp_path / "plan.json"
    assert main(["search", SMALL, "--world", "8", "--batch", "16", "--cp", "2", "--tp", "2",
                 "--sp", "megatron", "-o", str(out)]) == 0
    capsys.readouterr()
    plan = Plan.load(out)
    assert plan.mesh[CP] == 2 and plan.mesh[TP] == 2 and plan.sequence_parallel
    again = _json(capsys, ["explain", SMALL, "--plan", str(out), "--format", "json"])
    assert again["mesh"] == plan.mesh
    assert {lp["sp"] for lp in again["layers"] if lp["name"].startswith("blocks.")} == \
        {MEGATRON_SP}
    assert again["sequence"]["mode"] == plan.sequence_mode
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
    it nothing is left out (with cp and tp fixed, the recomputation the runtime refuses)."""
    fixed = [SMALL, "--world", "8", "--batch", "16", "--cp", "2", "--tp", "2"]
    free, runnable = tmp_path / "free.json", tmp_path / "runnable.json"
    assert main(["search", *fixed, "-o", str(free)]) == 0
    assert main(["search", *fixed, "--executable", "-o", str(runnable)]) == 0
    capsys.readouterr()
    assert Plan.load(free).search["left_out"] == []
    plan = Plan.load(runnable)
    assert plan.unsupported() == []
    assert plan.mesh == {"pp": 1, "dp": 2, "cp": 2, "tp": 2}
    assert not any("recomputation" in note for note in plan.search["left_out"])


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


def test_the_fp8_recipe_is_priced_recorded_and_read_back(tmp_path, capsys):
    """--fp8-recipe picks the scaling the planner prices: tensorwise sends one amax
    all-reduce over tp per fp8 matmul input, rowwise none (its scales are per row of the
    rank's own piece); the plan file records it and `explain --plan` prices it again."""
    fixed = ["--world", "4", "--device", "h100-80gb", "--batch", "8", "--dtype", "fp8",
             "--tp", "2", "--dp", "2", "--format", "json"]
    tensorwise = _json(capsys, ["explain", SMALL, *fixed])
    rowwise = _json(capsys, ["explain", SMALL, *fixed, "--fp8-recipe", "rowwise"])
    assert tensorwise["search"]["fp8_recipe"] == "tensorwise"  # the default
    assert rowwise["search"]["fp8_recipe"] == "rowwise"
    assert rowwise["mesh"] == tensorwise["mesh"]
    assert "per tensor" in tensorwise["fp8"]["gemms"] and "per row" in rowwise["fp8"]["gemms"]
    sent = [d["predicted"]["comm_bytes_per_device"] for d in (rowwise, tensorwise)]
    assert sent[0] < sent[1]  # the amax all-reduces, priced only under tensorwise
    out = tmp_path / "plan.json"
    assert main(["search", SMALL, *fixed, "--fp8-recipe", "rowwise", "-o", str(out)]) == 0
    capsys.readouterr()
    again = _json(capsys, ["explain", SMALL, "--plan", str(out), "--format", "json"])
    assert again["search"]["fp8_recipe"] == "rowwise"
    assert again["predicted"]["comm_bytes_per_device"] == sent[0]


def test_an_fp8_recipe_without_fp8_is_refused_before_work(capsys):
    assert main(["explain", SMALL, "--fp8-recipe", "rowwise"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: --fp8-recipe rowwise scales fp8 matmuls, but --dtype is "
                          "bf16;")


def test_defaults_without_a_plan_file(capsys):
    data = _json(capsys, ["explain", SMALL, "--format", "json"])
    assert data["world"] == {"devices": 8, "per_node": 8, "device": "a100-80gb"}
    assert data["search"]["global_batch"] == 8 and data["search"]["dtype"] == "bf16"


FACTORIES = '''
import torch
from torch import nn

CALLS = []


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.out = nn.Linear(32, 64)

    def forward(self, ids):
        return self.out(self.emb(ids))


def make(batch, seq=16):
    CALLS.append({"batch": batch, "seq": seq})
    return Net(), torch.zeros(batch, seq, dtype=torch.long)


def fixed():
    return Net(), torch.zeros(4, 16, dtype=torch.long)


def nothing():
    return 3


def llama(seq):
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                      num_attention_heads=8, num_key_value_heads=4,
                                      vocab_size=256, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    PARAMETERS.append(sum(p.numel() for p in model.parameters()))
    return model


PARAMETERS = []
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """A module of factories in a fresh directory, the working directory there."""
    (tmp_path / "h3_factories.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path / "h3_factories.py"
    sys.modules.pop("h3_factories", None)


def test_a_factory_by_module_name_gets_batch_and_seq(capsys, factories):
    """`module:factory` with no dot in the module is an import path, not a zoo family."""
    data = _json(capsys, ["explain", "h3_factories:make", "--world", "4", "--batch", "8",
                          "--seq", "24", "--format", "json"])
    assert sys.modules["h3_factories"].CALLS == [{"batch": 8, "seq": 24}]
    assert data["model"]["tokens_per_sample"] == 24
    assert data["model"]["parameters"] == 64 * 32 + 32 * 64 + 64


def test_a_factory_by_file_path(capsys, factories):
    data = _json(capsys, ["explain", f"{factories}:fixed", "--world", "4", "--format", "json"])
    assert data["model"]["tokens_per_sample"] == 16


def test_a_factory_returning_a_transformers_model_alone_is_planned_with_its_loss(capsys,
                                                                                 factories):
    """Its inputs and loss come from its config; two of its six blocks are traced, all six
    counted."""
    data = _json(capsys, ["explain", "h3_factories:llama", "--world", "2", "--seq", "16",
                          "--format", "json"])
    assert data["model"] == {"parameters": sys.modules["h3_factories"].PARAMETERS[0],
                             "tokens_per_sample": 16}
    assert [lp["name"] for lp in data["layers"] if ".layers." in lp["name"]] == \
        [f"model.layers.{i}" for i in range(6)]
    assert any(lp["name"] == "loss" for lp in data["layers"])
    assert data["notes"] == []


@pytest.mark.parametrize("spec, extra, message", [
    ("{file}:fixed", ["--seq", "32"], "takes no seq argument"),
    ("{dir}/absent.py:make", [], "does not exist"),
    ("h3_no_such_module:make", [], "cannot import module h3_no_such_module"),
    ("{file}:absent", [], "has no attribute absent"),
    ("{file}:nothing", [], "returned int, not a model or (model, example_inputs)"),
])
def test_bad_factories_exit_2_with_one_sentence(capsys, factories, spec, extra, message):
    spec = spec.format(file=factories, dir=factories.parent)
    assert main(["explain", spec, "--world", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: ") and message in err


def test_offload_can_be_forced_on_and_off(capsys):
    """LLaMA-2 7B's 16 bytes per parameter (112 GB) fit 2 x 40 GB only with the optimizer
    state on the host: the search offloads, --no-offload leaves nothing that fits."""
    argv = ["explain", "llama2-7b", "--world", "2", "--device", "a100-40gb", "--seq", "512",
            "--format", "json"]
    assert _json(capsys, argv)["zero"]["offload"] is True
    assert main([*argv, "--no-offload"]) == 2
    assert "no plan fits in memory" in capsys.readouterr().err
    on = _json(capsys, ["explain", SMALL, "--world", "8", "--zero", "1", "--offload",
                        "--format", "json"])
    assert on["zero"]["offload"] is True


def test_a_mesh_size_in_the_vocabulary_gets_its_flag_check_and_constraint(monkeypatch, capsys):
    """An axis added to modes.MESH_SIZES needs no edit here: its flag, its range check and
    its constraint follow."""
    import argparse

    from autopar import cli
    from autopar.modes import MESH_SIZES, MeshSize

    monkeypatch.setattr(cli, "MESH_SIZES", (*MESH_SIZES, MeshSize("xp", "a test axis")))
    parser = argparse.ArgumentParser()
    cli.add_plan_arguments(parser)
    assert "a test axis" in parser.format_help()
    args = parser.parse_args([SMALL, "--xp", "3", "--tp", "2"])
    assert cli.constraints_of(args) == {"xp": 3, "tp": 2}
    with pytest.raises(cli.AutoparError, match="--xp 0 is out of range"):
        cli.validate_args(parser.parse_args([SMALL, "--xp", "0"]))


@pytest.mark.parametrize("world,batch,most", [(10**9, 8, 198656), (10**9, 2**21, None)])
def test_an_absurd_world_is_refused_in_one_sentence(capsys, world, batch, most):
    """10^9 devices: more than GPT-3 can use at this batch, said with each axis's largest
    size (dp dividing both the batch and the world), never planned device by device."""
    rc = main(["explain", "gpt3-175b", "--world", str(world), "--batch", str(batch),
               "--device", "h100-80gb"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith(f"autopar: a world of {world} devices is more than this model can "
                          f"use at a global batch of {batch}: at most ")
    if most is not None:
        assert f"at most {most} (dp 8 x pp " in err
    assert err.count(".") <= 2 and err.endswith("or a larger global batch.")

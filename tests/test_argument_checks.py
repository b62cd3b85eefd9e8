"""Every planning argument is checked before work: one sentence each, nothing planned.

`repeat`, `top`, `World(device=...)`, a sequence past the model's longest, hardware profile
files field by field (nested tables too) and plan files with unknown nested keys; the
command line refuses them before it loads the model, the Python API before it searches.
"""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.cli import main
from autopar.cost.hardware import load_hardware
from autopar.errors import PlanError, WorldError
from autopar.models import build, check_seq
from autopar.plans import Plan
from autopar.search import planner

SMALL = "gpt:layers=2,hidden=64,heads=8,vocab=256,seq=32"


def _fail(*args, **kwargs):
    pytest.fail("work started on a wrong input")


@pytest.fixture
def no_work(monkeypatch):
    """Loading the model or searching fails the test: refusals must come first."""
    import autopar.cli as cli

    monkeypatch.setattr(cli, "load_model", _fail)
    monkeypatch.setattr(planner, "search", _fail)


def _profile(tmp_path, **changes) -> str:
    data = load_hardware("a100-80gb").to_json()
    data.update(changes)
    path = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}.json"  # loaded once per path
    path.write_text(json.dumps(data))
    return str(path)


def _plan_file(tmp_path, change) -> str:
    data = Plan(mesh={"dp": 8}).to_json()
    change(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


A100 = load_hardware("a100-80gb").to_json()
PROFILES = {  # case -> (changed fields, key words)
    "peak rates as a list": (dict(peak_flops=[3.12e14]), ["peak_flops", "JSON object"]),
    "peak rates empty": (dict(peak_flops={}), ["peak_flops", "at least one dtype"]),
    "peak rate of an unknown dtype": (dict(peak_flops={"bf17": 3e14}),
                                      ["peak_flops", "'bf17'", "bf16"]),
    "peak rate as a string": (dict(peak_flops={"bf16": "312e12"}),
                              ["peak_flops.bf16", "'312e12'", "positive"]),
    "collectives as a list": (dict(collectives=["ring"]), ["collectives", "JSON object"]),
    "collective of an unknown op": (
        dict(collectives={"allreduce": {"algorithm": "ring", "alpha": 1e-5, "beta": 1e-10}}),
        ["'allreduce'", "all_reduce"]),
    "collective fit of an unknown algorithm": (
        dict(collectives={"all_reduce": {"algorithm": "rings", "alpha": 1e-5, "beta": 1e-10}}),
        ["collectives.all_reduce.algorithm", "'rings'", "ring, tree, hierarchical"]),
    "collective fit without beta": (
        dict(collectives={"all_reduce": {"algorithm": "ring", "alpha": 1e-5}}),
        ["collectives.all_reduce", "algorithm, alpha and beta"]),
    "collective fit with a negative alpha": (
        dict(collectives={"all_gather": {"algorithm": "ring", "alpha": -1.0, "beta": 1e-10}}),
        ["collectives.all_gather.alpha", "-1.0", ">= 0"]),
    "attention kernel without half_tokens": (
        dict(attention_kernels={"flash1": {"efficiency": 0.2}}),
        ["attention_kernels.flash1", "efficiency and half_tokens"]),
    "attention kernel efficiency above 1": (
        dict(attention_kernels={"flash1": {"efficiency": 22.0, "half_tokens": 263}}),
        ["attention_kernels.flash1.efficiency", "(0, 1]"]),
    "per_node a fraction": (dict(per_node=8.5), ["per_node", "8.5", "whole number"]),
    "memory as a string": (dict(memory_bytes="80GB"), ["memory_bytes", "'80GB'"]),
    "name not a string": (dict(name=7), ["field name is 7", "a string"]),
    "extra not an object": (dict(extra="notes"), ["field extra", "JSON object"]),
}


@pytest.mark.parametrize("case", sorted(PROFILES))
def test_a_hardware_profile_is_checked_field_by_field(tmp_path, case):
    changes, words = PROFILES[case]
    path = _profile(tmp_path, **changes)
    with pytest.raises(WorldError) as caught:
        load_hardware(path)
    text = str(caught.value)
    assert text.count(". ") == 0 and text.startswith(path), text  # one sentence, the file named
    for w in words:
        assert w in text, (w, text)


def test_every_built_in_profile_passes_the_checks():
    for name in ("a100-40gb", "a100-80gb", "cpu", "h100-80gb", "h200"):
        load_hardware(name).check()


PLAN_FILES = {  # case -> (change, key words)
    "unknown top-level key": (lambda d: d.update(tensr={}), ["'tensr'", "valid keys"]),
    "unknown key under tensor": (lambda d: d["tensor"].update(sise=2),
                                 ["['sise'] under 'tensor'", "sequence_parallel"]),
    "unknown key under pipeline": (lambda d: d["pipeline"].update(micro_batches=4),
                                   ["['micro_batches'] under 'pipeline'", "microbatches"]),
    "unknown key under zero": (lambda d: d["zero"].update(offlaod=True),
                               ["['offlaod'] under 'zero'", "offload"]),
    "unknown key under sequence": (lambda d: d["sequence"].update(size=2),
                                   ["['size'] under 'sequence'", "layout"]),
    "unknown key in a layer": (lambda d: d.update(layers=[{"name": "blocks.0", "tp": "1d"}]),
                               ["['tp'] under 'layers'", "tp_mode"]),
    "unknown key under world": (lambda d: d.update(world={"devices": 8, "gpus": 8}),
                                ["['gpus'] under 'world'", "per_node"]),
}


@pytest.mark.parametrize("case", sorted(PLAN_FILES))
def test_a_plan_file_refuses_unknown_nested_keys(tmp_path, case):
    change, words = PLAN_FILES[case]
    with pytest.raises(PlanError) as caught:
        Plan.load(_plan_file(tmp_path, change))
    for w in words:
        assert w in str(caught.value), (w, str(caught.value))


CLI = [  # (argv, key words)
    (["explain", "llama3-8b", "--seq", "131072"],
     ["seq=131072", "llama3-8b", "8192 at most", "llama3.1-8b", "up to 131072"]),
    (["explain", "llama3-70b", "--seq", "16384", "--world", "64"],
     ["8192 at most", "llama3.1-70b"]),
    (["explain", "vit-tiny", "--seq", "64"], ["vit models take no sequence length"]),
    (["explain", SMALL, "--top-alternatives", "0"], ["--top-alternatives 0", ">= 1"]),
    (["explain", SMALL, "--device", "{peak_list}"], ["peak_flops", "JSON object"]),
    (["explain", SMALL, "--device", "{bad_fit}"], ["collectives.all_reduce.algorithm"]),
    (["explain", SMALL, "--plan", "{nested}"], ["['sise'] under 'tensor'"]),
]


@pytest.mark.parametrize("argv, words", CLI, ids=[" ".join(c[0][1:]) for c in CLI])
def test_the_command_line_refuses_before_loading_the_model(tmp_path, capsys, no_work, argv,
                                                           words):
    files = {"peak_list": lambda: _profile(tmp_path, peak_flops=[1.0]),
             "bad_fit": lambda: _profile(tmp_path, collectives={
                 "all_reduce": {"algorithm": "rings", "alpha": 0.0, "beta": 1e-9}}),
             "nested": lambda: _plan_file(tmp_path, lambda d: d["tensor"].update(sise=2))}
    argv = [a.format(**{k: make() for k, make in files.items() if "{" + k + "}" in a})
            for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


@pytest.fixture(scope="module")
def gpt():
    model, inputs = build(SMALL, batch=2)
    return model, inputs


API = {  # case -> (call, error type, key words)
    "repeat names no layer": (lambda m, x: autopar.plan(m, x, 8, repeat={"blocks.9": 3}),
                              PlanError, ["'blocks.9'", "not a layer", "closest 'blocks.1'", "wte"]),
    "repeat of zero copies": (lambda m, x: autopar.plan(m, x, 8, repeat={"blocks.1": 0}),
                              PlanError, ["repeat['blocks.1'] is 0", "whole number"]),
    "repeat of a fraction": (lambda m, x: autopar.plan(m, x, 8, repeat={"blocks.1": 2.5}),
                             PlanError, ["2.5", "whole number"]),
    "repeat as a list": (lambda m, x: autopar.plan(m, x, 8, repeat=["blocks.1"]),
                         PlanError, ["repeat must map layer names", "list"]),
    "top 0": (lambda m, x: autopar.plan(m, x, 8, top=0), PlanError, ["top=0", ">= 1"]),
    "top as a string": (lambda m, x: autopar.plan(m, x, 8, top="3"), PlanError, ["top='3'"]),
    "device as a dict": (lambda m, x: autopar.World(8, device={"name": "a100-80gb"}),
                         WorldError, ["not a dict", "a100-80gb", "path"]),
    "device as a number": (lambda m, x: autopar.World(8, device=80), WorldError,
                           ["not a int", "profile JSON"]),
    "explain top 0": (lambda m, x: Plan(mesh={"dp": 8}).explain(top=0), PlanError,
                      ["top=0", "layer rows"]),
    "seq past the longest": (lambda m, x: check_seq("llama3-70b", 131072), ValueError,
                             ["8192 at most", "llama3.1-70b"]),
    "seq 0": (lambda m, x: check_seq("gpt-tiny", 0), ValueError, ["seq=0", "1 <= seq <= 32"]),
}


@pytest.mark.parametrize("case", sorted(API))
def test_the_python_api_refuses_before_searching(gpt, monkeypatch, case):
    monkeypatch.setattr(planner, "search", _fail)
    call, error, words = API[case]
    with pytest.raises(error) as caught:
        call(*gpt)
    text = str(caught.value)
    for w in words:
        assert w in text, (w, text)
    assert "--" not in text, f"the Python API names a CLI flag: {text}"


def test_a_repeat_that_names_a_layer_plans(gpt):
    model, x = gpt
    plain = autopar.plan(model, x, 8)
    plan = autopar.plan(model, x, 8, repeat={"blocks.1": 47})  # 48 blocks in all
    assert len(plan.layers) == len(plain.layers) + 46
    assert plan.predicted["model_flops_per_step"] > plain.predicted["model_flops_per_step"]

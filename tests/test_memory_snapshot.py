"""`engine.memory_snapshot(path)`: this rank's live tensors by layer and kind, as a text
table, JSON, or the allocator snapshot form torch's memory_viz tools read; the bytes add up
to what the engine holds (parameters, optimizer state), ZeRO's pieces included."""

import json
import pickle

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture
from torch.cuda import _memory_viz

import autopar
from autopar.errors import PlanError
from autopar.models import build
from autopar.runtime.measure import measure_state_bytes

pool2 = dist_pool_fixture(2)
SPEC = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"


def _lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _engine(world: int, plan=None):
    model, example = build(SPEC, batch=4, device="cpu", seed=0)
    engine = autopar.parallelize(model, world, example_inputs=example, loss_fn=_lm_loss,
                                 plan=plan, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        engine.train_step(x, x)
    return engine


@pytest.fixture(scope="module")
def engine():
    return _engine(1)


def _sums(table: dict) -> dict:
    rows = table["layers"]
    return {k: sum(r[k] for r in rows if r["layer"] != "other")
            for k in ("parameters", "gradients", "optimizer", "buffers")}


def test_the_table_adds_up_to_the_engines_state(engine, tmp_path):
    table = engine.memory_snapshot(tmp_path / "memory.json")
    assert json.loads((tmp_path / "memory.json").read_text()) == table
    held = measure_state_bytes(engine)
    sums = _sums(table)
    assert sums["parameters"] == held.parameters
    assert sums["optimizer"] == held.optimizer
    layers = {r["layer"] for r in table["layers"]}
    assert {"blocks.0", "blocks.1", "wte", "other"} <= layers
    blocks = {r["layer"]: r for r in table["layers"]}
    # the two blocks are alike: the same bytes of weights and moments, and activations saved
    assert blocks["blocks.0"]["parameters"] == blocks["blocks.1"]["parameters"] > 0
    # AdamW: two moments as large as the weights, and a 4-byte step count per tensor
    assert 0 < blocks["blocks.0"]["optimizer"] - 2 * blocks["blocks.0"]["parameters"] <= 4 * 16
    assert blocks["blocks.0"]["saved_activations"] > 0
    assert table["live_bytes"] == sum(r["live"] for r in table["layers"])


def test_the_text_table_names_every_layer(engine, tmp_path):
    engine.memory_snapshot(tmp_path / "memory.txt")
    text = (tmp_path / "memory.txt").read_text()
    assert text.startswith("live tensors of this rank on cpu, MiB")
    assert "blocks.0" in text and "saved_activations" in text
    assert text.rstrip().splitlines()[-1].startswith("total live: ")


def test_the_pickle_is_a_snapshot_torchs_memory_viz_reads(engine, tmp_path):
    table = engine.memory_snapshot(tmp_path / "memory.pickle")
    with open(tmp_path / "memory.pickle", "rb") as f:
        snapshot = pickle.load(f)
    summary = _memory_viz.segsum(snapshot)  # checks every segment's bytes add up
    assert f"segments: {len(snapshot['segments'])}" in summary
    lines = _memory_viz.memory(snapshot, format_flamegraph=lambda text: text)
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines.splitlines()) == table["live_bytes"]
    assert any("blocks.1:0:parameters blocks.1." in line for line in lines.splitlines())


def test_an_unknown_suffix_is_refused(engine, tmp_path):
    with pytest.raises(PlanError, match=r"^memory_snapshot writes \.pickle"):
        engine.memory_snapshot(tmp_path / "memory.png")


def _zero_sums(stage: int) -> dict:
    import tempfile
    engine = _engine(2, dict(data=2, zero=dict(stage=stage)))
    with tempfile.TemporaryDirectory() as d:
        return _sums(engine.memory_snapshot(f"{d}/m.json"))


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_pieces_count_as_their_layers_state(pool2, engine, tmp_path, stage):
    whole = _sums(engine.memory_snapshot(tmp_path / "whole.json"))
    for r in pool2.run(_zero_sums, stage):  # each of 2 ranks holds about half the moments
        assert r["optimizer"] == pytest.approx(whole["optimizer"] / 2, rel=0.05)
        if stage == 3:  # ... and half the weights (the pieces; the whole ones are freed)
            assert r["parameters"] == pytest.approx(whole["parameters"] / 2, rel=0.05)

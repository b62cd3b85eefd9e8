"""Context (sequence) parallelism over a "cp" mesh axis: ring attention and Ulysses.

Token inputs and targets are split on the sequence dim (contiguous layout) over cp; norms,
MLPs, residuals and embeddings follow the split per token, learned positions and RoPE
tables are cut to this rank's global positions, attention runs `SequenceAttention`, weight
gradients are summed over cp. Each run equals the single-device run
(tests/equivalence.py's `compare`: 5 AdamW steps) and measured communication equals the
plan's, the sequence kernels' p2p / all_to_all records included.
"""

import pytest
import torch
from distributed import dist_pool_fixture
from equivalence import build, compare

import autopar
from autopar.errors import PlanError

pool2 = dist_pool_fixture(2)
pool4 = dist_pool_fixture(4)

CP = lambda mode, size=2, **more: {"sequence": {"size": size, "mode": mode}, **more}  # noqa


def _check(result):
    assert result["keys_equal"]
    assert result["loss"] < 1e-5, result["loss"]
    assert result["weights"] < 1e-5, result["weights"]
    assert result["measured"] == result["predicted"]


def _cp_records(result, op):
    return result["measured"].get((op, "cp"), 0)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_cp2_equals_single_device(pool2, name, mode):
    results = pool2.run(compare, name, CP(mode))
    for r in results:
        _check(r)
        assert _cp_records(r, "p2p" if mode == "ring" else "all_to_all") > 0
    assert results[0]["measured"] == results[1]["measured"]


def _positions_probe(engine, inputs, target):
    """Every 2-D tensor split over cp in the training graph (the position tables): the whole
    tensor that went in and this rank's block that came out."""
    import torch.fx as fx

    from autopar.runtime.sequence import sequence_positions

    seen = {}

    class Spy(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_module" and n.target.startswith("cp_split") and \
                    isinstance(out, torch.Tensor) and out.dim() == 2:
                seen[n.args[0].name] = (self.env[n.args[0]].detach().clone(),
                                        out.detach().clone())
            return out

    *local, local_target = engine._local_batch(tuple(inputs) + (target,))
    local = engine._cut_sequence(tuple(local) + (local_target,), engine.train_graph)
    engine.comm_log.enabled = False
    try:
        Spy(engine.train_gm).run(*local)
    finally:
        engine.comm_log.enabled = True
    return {"positions": sequence_positions(32, engine._cp.size, engine._cp.rank).tolist(),
            "seen": seen}


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny"])
def test_cp_positions_are_global(pool2, name):
    """The position tensor (RoPE tables, learned position embeddings of arange(S)) is whole
    in the graph; the split before the sequence-split product or add keeps exactly this
    rank's global positions (the contiguous block)."""
    results = pool2.run(compare, name, CP("ring"), steps=1, probe=_positions_probe)
    model, _, _, _ = build(name, 8)
    for rank, r in enumerate(results):
        pos = r["probe"]["positions"]
        assert pos == list(range(rank * 16, rank * 16 + 16))
        seen = r["probe"]["seen"]
        assert seen, "no position table was split over cp"
        for whole, block in seen.values():
            assert whole.shape[0] == 32 and block.shape[0] == 16
            assert torch.equal(block, whole[pos])
        if name == "llama-tiny":  # the RoPE tables of positions 0..31, cut to this rank's
            tables = [model.rope_cos[:32], model.rope_sin[:32]]
            for whole, block in seen.values():
                assert any(torch.equal(whole, t) for t in tables)
                assert any(torch.equal(block, t[pos]) for t in tables)


def test_cp_refuses_bad_plans():
    model, (x,), _, loss_fn = build("gpt-tiny", 8)
    with pytest.raises(PlanError, match="does not divide by 3"):
        autopar.parallelize(model, 3, example_inputs=(x[:2],), loss_fn=loss_fn,
                            plan=CP("ring", size=3))


def test_cp_ulysses_refuses_heads_that_do_not_divide():
    """3 heads over a sequence size of 2: Ulysses cannot split them; the error names ring.
    Solved on one process with a size-2 cp group that is never called."""
    from autopar.models.gpt import GPT, GPTConfig
    from autopar.runtime.collectives import AxisGroup
    from autopar.runtime.engine import Engine
    from autopar.runtime.mesh import axis_groups

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=3, n_embd=24))
    x = torch.randint(0, 64, (2, 16))
    groups = axis_groups({"dp": 1, "tp": 1})
    groups["cp"] = AxisGroup("cp", 2, 0, None, groups["tp"].log)
    plan = autopar.Plan(mesh={"cp": 2}, sequence_mode="ulysses")
    with pytest.raises(PlanError, match=r"3 attention heads .* mode='ring'"):
        Engine(model, plan, groups, (x,), None, None)


def test_cp_with_grid_tensor_parallelism_is_refused():
    """cp runs beside 1d tensor layers only: 2d (and Megatron sequence parallelism) with a
    cp axis are refused before any process work."""
    model, (x,), _, loss_fn = build("gpt-tiny", 8)
    with pytest.raises(PlanError, match="together with 2d tensor parallelism"):
        autopar.parallelize(model, 8, example_inputs=(x[:2],), loss_fn=loss_fn,
                            plan=CP("ring", tensor=dict(size=4, mode="2d")))
    with pytest.raises(PlanError, match="together with Megatron sequence parallelism"):
        autopar.parallelize(model, 4, example_inputs=(x[:2],), loss_fn=loss_fn,
                            plan=CP("ring", tensor=dict(size=2, mode="1d",
                                                        sequence_parallel=True)))


@pytest.mark.parametrize("name,mode", [("gpt-tiny", "ring"), ("llama-tiny", "ulysses")])
def test_cp2_tp2_equals_single_device(pool4, name, mode):
    """cp2 x tp2 (1d): heads split over tp, each rank's heads run the sequence kernel over cp;
    row linears all-reduce this rank's block of the tokens over tp, and weight gradients
    (tp slices) are summed over cp, those of row-split weights included."""
    results = pool4.run(compare, name, CP(mode, tensor=dict(size=2, mode="1d")))
    for r in results:
        _check(r)
        assert _cp_records(r, "p2p" if mode == "ring" else "all_to_all") > 0
        assert ("all_reduce", "tp") in r["measured"] and ("all_reduce", "cp") in r["measured"]
    assert all(r["measured"] == results[0]["measured"] for r in results)


def test_cp2_dp2_ulysses_llama(pool4):
    results = pool4.run(compare, "llama-tiny", CP("ulysses"))
    for r in results:
        _check(r)
        assert ("all_reduce", "dp") in r["measured"]

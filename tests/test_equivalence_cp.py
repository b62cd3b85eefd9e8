"""Context (sequence) parallelism over a "cp" mesh axis: ring attention and Ulysses.

Token inputs and targets are split on the sequence dim (contiguous layout) over cp; norms,
MLPs, residuals and embeddings follow the split per token, learned positions and RoPE
tables are cut to this rank's global positions, attention runs `SequenceAttention`, weight
gradients are summed over cp. Each run equals the single-device run
(tests/equivalence.py's `compare`: 2 AdamW steps, the second on the state the first left)
and measured communication equals the plan's, the sequence kernels' p2p / all_to_all
records included.
"""

import pytest
import torch
from equivalence import build, compare
from pretraced import forked_pool_fixture

import autopar
from autopar.errors import PlanError

STEPS = 2
GQA2 = "llama:layers=2,hidden=64,heads=8,kv_heads=2,ffn=128,vocab=256,seq=32"
# each world forked from the test process once it traced the world's models (tests/pretraced.py)
pool2 = forked_pool_fixture(2, ["gpt-tiny", "llama-tiny", "hf-gpt2"])
pool4 = forked_pool_fixture(4, ["gpt-tiny", "llama-tiny", "hf-gpt2", GQA2])
CP = lambda mode, size=2, **more: {"sequence": {"size": size, "mode": mode}, **more}  # noqa


def _check(result):
    assert result["keys_equal"]
    assert result["loss"] < 1e-5, result["loss"]
    assert result["weights"] < 1e-5, result["weights"]
    assert result["measured"] == result["predicted"]


def _cp_records(result, op):
    return result["measured"].get((op, "cp"), 0)


def _cp_collectives(engine, inputs, target):
    """(op, phase) of every collective the training plan runs on cp."""
    return sorted({(c.op, c.phase) for c in engine.train_solution.comm if c.axis == "cp"})


def _check_kernels(results, mode):
    """The sequence kernels ran (ring shifts or all-to-alls on cp) and the forward pass
    gathered nothing over cp: not the attention's keys and values, not the logits before
    the loss (each rank takes the loss of its own tokens), not a mask. (A backward
    all-gather is allowed: the gradient of a whole position table's lookup, S x hidden.)"""
    for r in results:
        _check(r)
        assert _cp_records(r, "p2p" if mode == "ring" else "all_to_all") > 0
        assert ("all_gather", "forward") not in r["probe"], r["probe"]
        assert ("all_reduce", "forward") in r["probe"]  # the loss sum and token count
    assert all(r["measured"] == results[0]["measured"] for r in results)


# One run per (model, plan) at world 2: the position test reads the ring runs (the zigzag
# layout, ring's default) the equivalence test made, with both probes, instead of training
# the same plan again; a test run alone makes its own.
_RUNS: dict = {}


def _run2(pool2, name: str, plan: dict) -> list[dict]:
    key = (name, repr(plan))
    if key not in _RUNS:
        _RUNS[key] = pool2.run(compare, name, plan, STEPS, probe=_both_probes)
    return _RUNS[key]


def _both_probes(engine, inputs, target):
    return {"cp": _cp_collectives(engine, inputs, target),
            "positions": _positions_probe(engine, inputs, target)}


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "hf-gpt2"])
def test_cp2_equals_single_device(pool2, name, mode):
    """transformers' GPT-2 passes a causal mask it builds from positions; it is recognised
    (`autopar.graph.masks`) and the kernels run with is_causal."""
    results = _run2(pool2, name, _ring_plan("zigzag") if mode == "ring" else CP(mode))
    _check_kernels([{**r, "probe": r["probe"]["cp"]} for r in results], mode)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "hf-gpt2"])
def test_cp4_equals_single_device(pool4, name, mode):
    """Four sequence shards (llama-tiny's 4 key/value heads: one per rank under Ulysses)."""
    _check_kernels(pool4.run(compare, name, CP(mode, size=4), STEPS, probe=_cp_collectives),
                   mode)



@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_cp4_grouped_query_attention_with_fewer_kv_heads_than_cp(pool4, mode):
    """2 key/value heads over cp 4: Ulysses repeats them twice before its all-to-all (the
    plan prices f = 2 repeated k, v, and the log agrees); ring sends the 2 heads as they
    are."""
    _check_kernels(pool4.run(compare, GQA2, CP(mode, size=4), STEPS, probe=_cp_collectives),
                   mode)


def _positions_probe(engine, inputs, target):
    """Every 2-D tensor split over cp in the training graph (the position tables): the whole
    tensor that went in and this rank's block that came out (a forward of the training
    graph with the log off, after the first step: what the next step trains is unchanged)."""
    import torch.fx as fx

    from autopar import modes
    from autopar.kernels.sequence import sequence_positions

    seen = {}

    class Spy(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_module" and n.target.startswith("cp_split") and \
                    isinstance(out, torch.Tensor) and out.dim() == 2:
                seen[n.args[0].name] = (self.env[n.args[0]].detach().clone(),
                                        out.detach().clone())
            return out

    *local, local_target = engine.batches.local(tuple(inputs) + (target,))
    local = engine.batches.tokens(tuple(local) + (local_target,), engine.train_graph)
    engine.comm_log.enabled = False
    try:
        Spy(engine.train_gm).run(*local)
    finally:
        engine.comm_log.enabled = True
    layout = engine.plan.cp_layout()
    cp = engine.groups[modes.CP]
    return {"positions": sequence_positions(32, cp.size, cp.rank, layout).tolist(),
            "layout": layout, "seen": seen}


def _ring_plan(layout: str) -> dict:
    return {"sequence": {"size": 2, "mode": "ring", "layout": layout}}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny"])
def test_cp_positions_are_global(pool2, name, layout):
    """The position tensor (RoPE tables, learned position embeddings of arange(S)) is whole
    in the graph; the split before the sequence-split product or add keeps exactly this
    rank's global positions: the contiguous block, or under ring attention's default
    zigzag layout chunks r and 3 - r of 4."""
    results = _run2(pool2, name, _ring_plan(layout))
    for r in results:
        _check(r)
    model, _, _, _ = build(name, 8)
    for rank, probe in enumerate(r["probe"]["positions"] for r in results):
        pos = probe["positions"]
        if layout == "contiguous":
            assert pos == list(range(rank * 16, rank * 16 + 16))
        else:
            chunks = (rank, 3 - rank)
            assert pos == [c * 8 + i for c in chunks for i in range(8)]
        seen = probe["seen"]
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
    with pytest.raises(PlanError, match="does not divide by 3: use a sequence length of 30 "
                                        "or 33, or a sequence size that divides 32"):
        autopar.parallelize(model, 3, example_inputs=(x[:2],), loss_fn=loss_fn,
                            plan=CP("ulysses", size=3))
    with pytest.raises(PlanError, match=r"zigzag layout \(2 x 3 chunks\), and 32 does not "
                                        r"divide by 6: .* or layout='contiguous'"):
        autopar.parallelize(model, 3, example_inputs=(x[:2],), loss_fn=loss_fn,
                            plan=CP("ring", size=3))
    with pytest.raises(PlanError, match="sequence layout"):
        autopar.parallelize(model, 2, example_inputs=(x[:2],), loss_fn=loss_fn,
                            plan={"sequence": {"size": 2, "mode": "ring", "layout": "striped"}})


def test_cp_ulysses_refuses_heads_that_do_not_divide():
    """3 heads over a sequence size of 2: Ulysses cannot split them; the error names ring.
    Solved on one process with a size-2 cp group that is never called."""
    from autopar.kernels.collectives import AxisGroup
    from autopar.models.gpt import GPT, GPTConfig
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


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "hf-gpt2"])
def test_cp2_tp2_equals_single_device(pool4, name, mode):
    """cp2 x tp2 (1d): heads split over tp, each rank's heads run the sequence kernel over cp;
    row linears all-reduce this rank's block of the tokens over tp, and weight gradients
    (tp slices) are summed over cp, those of row-split weights included."""
    results = pool4.run(compare, name, CP(mode, tensor=dict(size=2, mode="1d")), STEPS)
    for r in results:
        _check(r)
        assert _cp_records(r, "p2p" if mode == "ring" else "all_to_all") > 0
        assert ("all_reduce", "tp") in r["measured"] and ("all_reduce", "cp") in r["measured"]
    assert all(r["measured"] == results[0]["measured"] for r in results)


@pytest.mark.parametrize("name,mode", [("llama-tiny", "ulysses"), ("gpt-tiny", "ring"),
                                       ("hf-gpt2", "ring")])
def test_cp2_dp2_equals_single_device(pool4, name, mode):
    results = pool4.run(compare, name, CP(mode), STEPS)
    for r in results:
        _check(r)
        assert ("all_reduce", "dp") in r["measured"]


def _dropout_run():
    """cp2 x tp2 training of a GPT with dropout 0.1: this rank's (cp, tp) coordinates, its
    copies of the parameters that are whole on every rank after three steps, and the first
    draws of each random stream after them."""
    import torch.distributed as dist
    from equivalence import _lm_loss

    from autopar import modes
    from autopar.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32,
                          dropout=0.1))
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    engine = autopar.parallelize(model, dist.get_world_size(), example_inputs=(x[:2],),
                                 loss_fn=_lm_loss, optimizer=torch.optim.AdamW,
                                 plan=CP("ring", tensor=dict(size=2, mode="1d")))
    losses = [engine.train_step((x,), y) for _ in range(3)]
    params = engine.params
    whole = {params.names[k][0]: p.detach().clone() for k, p in params.local.items()
             if params.layouts[k] is not None and params.layouts[k].is_replicated}
    draws = {s: torch.rand(8, generator=engine.streams.get(s))
             for s in ("replicated", "split", "tokens", "split+tokens")}
    cp, tp = engine.groups[modes.CP], engine.groups[modes.TP]
    return {"coords": (cp.rank, tp.rank), "whole": whole, "draws": draws,
            "losses": losses}


def test_dropout_streams_follow_what_splits_each_tensor(pool4):
    """A residual dropout on this rank's tokens (split over cp, whole on tp) draws the same
    mask on the two tensor ranks holding those tokens, so the norm weights, whole on every
    rank, stay equal everywhere; each cp rank draws its own; a head-split attention dropout
    (whole on cp: the attention ran with the sequence gathered) the same across cp."""
    results = pool4.run(_dropout_run)
    by = {r["coords"]: r for r in results}
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results)
    first = results[0]["whole"]
    assert any("ln" in name for name in first)
    for r in results[1:]:
        assert r["whole"].keys() == first.keys()
        for name, value in r["whole"].items():
            assert torch.equal(value, first[name]), name

    def same(stream, a, b):
        return torch.equal(by[a]["draws"][stream], by[b]["draws"][stream])

    assert all(same("replicated", (0, 0), c) for c in by)
    assert same("tokens", (0, 0), (0, 1)) and same("tokens", (1, 0), (1, 1))
    assert not same("tokens", (0, 0), (1, 0))
    assert same("split", (0, 0), (1, 0)) and not same("split", (0, 0), (0, 1))
    assert len({tuple(r["draws"]["split+tokens"].tolist()) for r in results}) == 4

"""A batch x sequence dimension flattened into one splits on the sequence like the unflattened
one, under Megatron-SP and context parallelism.

transformers' OPT reshapes its [B, S, H] residual to [B*S, H] before the MLP block (norm, fc1,
fc2, dropout, residual add) and back after it. A split of S over P ranks is not a block split
of B*S: rank r holds rows b*S + r*S/P ... b*S + (r+1)*S/P - 1 of every sample b. The layout
says so (`S(tp)/16`: runs of 16 tokens per sample, each run split), the norm and the residual
add follow it per row, fc1 gathers it (all-gather forward, reduce-scatter backward) and fc2's
partial sum is reduce-scattered into it, exactly as on the unflattened [B, S, H].

Runs train tiny OPT configs for 4 AdamW steps against one device (tests/equivalence.py's
`compare`). In fp32 an element of a bias whose one-device gradient is ~1e-6 of its tensor's
largest (here out_proj.bias of the last layer) moves by AdamW-amplified rounding in any
split of the sums (data parallelism too), so the context-parallel runs, which split every
token sum, are checked in fp64 to 1e-10, where rounding cannot hide a wrong layout.
"""

from __future__ import annotations

import pytest
import torch
from distributed import dist_pool_fixture
from equivalence import _lm_loss, compare

from autopar.graph.analysis import OpKind
from autopar.graph.ir import BATCH
from autopar.sharding.layout import Shard
from autopar.sharding.rules.views import reshape_shard

pool2 = dist_pool_fixture(2)
pool4 = dist_pool_fixture(4)

VOCAB, SEQ = 64, 16


def opt(batch):
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=64, dropout=0.0,
                    attention_dropout=0.0, word_embed_proj_dim=32)
    x = torch.randint(0, VOCAB, (batch, SEQ))
    return OPTForCausalLM(cfg), (x,), torch.randint(0, VOCAB, (batch, SEQ)), _lm_loss


def opt64(batch):
    model, inputs, target, loss_fn = opt(batch)
    return model.double(), inputs, target, loss_fn


def _flat_norms(engine, inputs, target):
    """The layouts of the norms that read a flattened [B*S, H] input, and the collectives
    (op, axis, phase) of the training plan."""
    solution = engine.train_solution
    norms = {n.name: repr(solution.layouts[n]) for n in engine.train_graph.graph.nodes
             if n.op == "call_function" and n.meta.get("autopar") is not None
             and n.meta["autopar"].kind is OpKind.NORM and len(n.meta["autopar"].shape) == 2}
    return {"norms": norms,
            "comm": sorted({(c.op, c.axis, c.phase) for c in solution.comm})}


def _check(results, tol, loss_tol=None):
    """`loss_tol`: train_step reports the loss as a float32 number, fp64 runs too."""
    for r in results:
        assert r["keys_equal"]
        assert r["loss"] <= (loss_tol or tol), r["loss"]
        assert r["weights"] <= tol, r["weights"]
        assert r["noise_abs"] <= 1e-6, r["noise_abs"]
        assert r["measured"] == r["predicted"]
    assert all(r["measured"] == results[0]["measured"] for r in results)


def test_reshape_keeps_a_sequence_split_as_per_sample_runs():
    """[B, 16, 32] split on the sequence flattened to [B*16, 32]: runs of 16 per sample, each
    split (groups -16), on tp only when asked (the view rule asks under Megatron-SP); and
    back."""
    flat = reshape_shard((BATCH, 16, 32), (16 * BATCH, 32), Shard(1, "tp"), 2, flatten=("tp",))
    assert flat == (Shard(0, "tp", -16), None)
    assert reshape_shard((BATCH, 16, 32), (16 * BATCH, 32), Shard(1, "tp"), 2) == (None, None)
    back = reshape_shard((16 * BATCH, 32), (BATCH, 16, 32), Shard(0, "tp", -16), 2)
    assert back == (Shard(1, "tp", 1), None)


@pytest.mark.parametrize("world", [2, 4])
def test_opt_under_megatron_sp_splits_the_flattened_tokens(pool2, pool4, world):
    """Refused before ("dropout_1 reads a partial sum of shape (16*B, 32) with no sequence
    dim of 16 tokens"): now every norm of a flattened [B*S, H] holds this rank's rows of each
    sample, fc2's partial sums are reduce-scattered into them, and training equals one
    device."""
    pool = pool2 if world == 2 else pool4
    plan = {"tensor": {"size": world, "mode": "1d", "sequence_parallel": True}}
    results = pool.run(compare, opt, plan, steps=4, probe=_flat_norms)
    _check(results, 1e-4)
    for r in results:
        norms = r["probe"]["norms"]
        assert len(norms) == 2, norms  # each layer's final_layer_norm
        assert all(lay == "S(tp)/16 R" for lay in norms.values()), norms
        assert ("reduce_scatter", "tp", "forward") in r["probe"]["comm"]
        assert ("all_gather", "tp", "forward") in r["probe"]["comm"]


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_opt_under_context_parallelism_splits_the_flattened_tokens(pool2, mode):
    """cp keeps the sequence split through OPT's flatten the same way (`S(cp)/16`); fp64."""
    plan = {"sequence": {"size": 2, "mode": mode}}
    results = pool2.run(compare, opt64, plan, steps=4, probe=_flat_norms)
    _check(results, 1e-10, loss_tol=1e-6)
    for r in results:
        norms = r["probe"]["norms"]
        assert len(norms) == 2 and all(lay == "S(cp)/16 R" for lay in norms.values()), norms

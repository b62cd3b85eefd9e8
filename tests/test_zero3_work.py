"""Work a ZeRO-3 step does not do: the forward's gathers of a training graph's last layers
kept for the backward, which begins with them (the final norm and the last block gathered
once a step, not twice, as FSDP2 keeps its root and torchtitan its last block); the
reduce-scattered gradients scaled in place and handed over as views, not copied; and the
chunked loss's classifier gradient written by its first chunk's GEMM, with no zero-filled
table before it. Losses and weights stay equal to one device and the plan predicts every
collective's bytes."""

import pytest
import torch
from distributed import dist_pool_fixture
from equivalence import assert_equal, compare

pool2 = dist_pool_fixture(2)

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
GPT4 = "gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16"
ZERO3 = {"data": 2, "zero": {"stage": 3}}


def _gathers_by_layer(name: str, compile: bool) -> dict:
    """In a second step: each unit's all-gathers for the forward and for the backward, by
    its layer; the bytes the step logged beside the plan's prediction."""
    from equivalence import stepped_once

    engine, _, inputs, target = stepped_once(name, ZERO3, compile=compile)
    zero, counts = engine.zero, {"forward": {}, "backward": {}}
    finish = zero._finish

    def counted(u, phase):
        layer = zero.units[u].layer
        counts[phase][layer] = counts[phase].get(layer, 0) + 1
        return finish(u, phase)

    zero._finish = counted
    engine.comm_log.clear()
    engine.train_step(inputs, target)
    return {"counts": counts, "layers": [u.layer for u in zero.units],
            "measured": engine.comm_log.totals(phases=("forward", "backward", "step")),
            "predicted": engine.predicted_comm(8)}


@pytest.mark.parametrize("compiled", [False, True])
def test_zero3_keeps_the_last_block_for_the_backward(pool2, compiled):
    """A 4-block GPT: the forward gathers every unit once; the backward gathers again the
    blocks but the last (and neither the final norm nor the tied embedding), and the plan
    predicts the bytes, eager and compiled."""
    for r in pool2.run(_gathers_by_layer, GPT4, compiled):
        blocks = [layer for layer in r["layers"] if layer.startswith("blocks.")]
        assert len(blocks) == 4, r
        assert all(r["counts"]["forward"][layer] == 1 for layer in r["layers"]), r
        assert r["counts"]["backward"] == {layer: 1 for layer in blocks[:-1]}, r
        assert r["measured"] == r["predicted"], r


def test_zero3_keeping_the_last_block_trains_equal_to_one_device(pool2):
    results = pool2.run(compare, GPT4, ZERO3, 2)
    assert_equal(results)


def test_kept_after_forward_fits_the_biggest_unit_beside_the_last():
    from autopar.runtime.zero3 import kept_after_forward

    # an embedding held to the classifier, four blocks, a final norm
    order, held = [0, 1, 2, 3, 4, 5], [True, False, False, False, False, False]
    sizes = [100, 10, 10, 10, 10, 1]
    assert kept_after_forward(order, held, sizes) == [5, 4]
    # a big last unit (an untied classifier) keeps blocks while they fit in it
    assert kept_after_forward([0, 1, 2, 3], [False] * 4, [10, 10, 10, 25]) == [3, 2, 1]
    assert kept_after_forward([7], [False], [3]) == [7]
    assert kept_after_forward([], [], []) == []


def _reduce_writes(name: str) -> dict:
    """The ops (views aside) one reduce-scatter of each unit's gradients runs, by kind, and
    their elements, overlapped and landed into the pieces' gradients."""
    from equivalence import counting_writes, stepped_once

    engine, _, _, _ = stepped_once(name, ZERO3)  # (held: the engine owns what zero reads)
    zero, written = engine.zero, {}
    for shard in zero.shards:
        shard.grad = None
    with counting_writes(written):
        for u, unit in enumerate(zero.units):
            zero.reduce(u, tuple(torch.ones(zero.shapes[i]) for i in unit.members))
        zero._land_reduced()
    grads = [s.grad for s in zero.shards]
    return {"written": written, "pieces": sum(zero.chunks),
            "landed": all(g is not None and torch.all(g == 1) for g in grads)}


def test_zero3_reduced_gradients_scaled_in_place_not_copied(pool2):
    """Each unit's reduce-scattered piece is divided by dp in place and each member's
    gradient is a view of it: no second tensor of the pieces' size (an out-of-place `div`
    and a `clone` of every member). The mean over dp of ones is one."""
    for r in pool2.run(_reduce_writes, GPT):
        assert r["landed"], r
        assert "clone" not in r["written"] and "div" not in r["written"], r
        assert r["written"]["div_"] == r["pieces"], r


def test_chunked_loss_weight_gradient_not_zero_filled():
    """The classifier's weight gradient is the first chunk's GEMM, the others added to it:
    no zero-filled table of the weight's size first (one chunk and several), and the
    gradients equal aten's."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.kernels.chunked_loss import ChunkedCrossEntropy

    torch.manual_seed(0)
    x = torch.randn(2, 13, 8).requires_grad_()
    w = torch.randn(40, 8).requires_grad_()
    b = torch.randn(40).requires_grad_()
    t = torch.randint(0, 40, (26,))
    filled = []

    class Fills(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ("fill_", "zero_", "zeros", "zeros_like") \
                    and isinstance(out, torch.Tensor) and out.shape == w.shape:
                filled.append(func)
            return out

    for rows in (26, 3):
        module = ChunkedCrossEntropy(None, 1, -100, chunk_bytes=rows * 40 * 4)
        loss = module(x, w, t, b)
        with Fills():
            grads = torch.autograd.grad(loss, (x, w, b))
        assert filled == [], (rows, filled)
        expected = torch.autograd.grad(F.cross_entropy((x @ w.t() + b).reshape(-1, 40), t),
                                       (x, w, b))
        for g, e in zip(grads, expected):
            assert torch.allclose(g, e, rtol=1e-5, atol=1e-6), rows


def _sent_as_they_lie(name: str) -> dict:
    """After a step: whether each unit's shards are views of its flat piece (the gather's
    input); after one shard's data is replaced (as a load may), whether the gather still
    sends the new values (copied into a send buffer, the flat piece no longer its input)."""
    from equivalence import stepped_once

    from autopar.runtime.zero3 import send_piece

    engine, _, inputs, target = stepped_once(name, ZERO3)
    zero = engine.zero
    views = all(send_piece(zero, unit) is unit.flat and all(
        zero.shards[i].untyped_storage().data_ptr() == unit.flat.untyped_storage().data_ptr()
        for i in unit.members) for unit in zero.units)
    u = max(range(len(zero.units)), key=lambda k: zero.units[k].numel)
    i = zero.units[u].members[0]
    zero.shards[i].data = zero.shards[i].data.clone() + 1
    replaced = send_piece(zero, zero.units[u]) is None
    whole = zero._finish(u, "forward")[:zero.numels[i]]
    return {"views": views, "replaced": replaced,
            "whole": torch.equal(whole, zero.whole(zero.params[i]).reshape(-1))}


def test_zero3_sends_its_pieces_as_they_lie(pool2):
    for r in pool2.run(_sent_as_they_lie, GPT):
        assert r == {"views": True, "replaced": True, "whole": True}, r

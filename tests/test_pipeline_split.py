"""The pipeline split pass (`autopar.passes.pipeline.split_stages`), on one process.

Running the stages one after another, each fed what the previous one returned, gives the
loss and every parameter gradient of the whole training graph. Only tensors cross stage
boundaries; size-derived values (the batch size, causal masks, position tables) are
rebuilt by each stage that reads them; a tied embedding is reported as shared. With the
targets split off, the loss is a module of its own and no integer tensor crosses a stage.
"""

import pytest
import sympy
import torch
from equivalence import build

from autopar.errors import PlanError
from autopar.graph.trace import BATCH, trace
from autopar.passes.pipeline import contiguous_stages as _contiguous
from autopar.passes.pipeline import split_stages

GPT4 = "gpt:layers=4,hidden=64,heads=4,vocab=256,seq=32"
LLAMA4 = "llama:layers=4,hidden=64,heads=8,kv_heads=4,ffn=128,vocab=256,seq=32"


def _traced(name: str, batch: int = 4):
    model, inputs, target, loss_fn = build(name, batch)
    return trace(model, inputs, loss_fn=loss_fn, example_target=target, train=True), \
        inputs, target


def _run(stages, inputs, target):
    out = stages.modules[0](*inputs, target)
    for module in stages.modules[1:]:
        out = module(*out)
    return out[0] if isinstance(out, (tuple, list)) else out


def _grads(gm, run):
    for p in gm.parameters():
        p.grad = None
    loss = run()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in gm.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("name,n", [("gpt-tiny", 2), ("llama-tiny", 2), ("hf-gpt2", 2),
                                    (GPT4, 4), (LLAMA4, 4)])
def test_stages_in_sequence_equal_the_whole_graph(name, n):
    traced, inputs, target = _traced(name)
    stages = split_stages(traced.gm, _contiguous([layer.name for layer in traced.layers], n), n)
    assert len(stages.modules) == n
    loss, grads = _grads(traced.gm, lambda: _run(stages, inputs, target))
    ref_loss, ref_grads = _grads(traced.gm, lambda: _whole(traced, inputs, target))
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and grads
    for key, g in grads.items():
        torch.testing.assert_close(g, ref_grads[key], rtol=1e-6, atol=1e-7)
    # what crosses a boundary: tensors with a batch dim (activations and the target)
    for k in range(1, n):
        assert stages.inputs[k] == stages.outputs[k - 1]
        for value in stages.modules[k].graph.nodes:
            if value.op == "placeholder":
                shape = value.meta["autopar"].shape
                assert shape and sympy.sympify(shape[0]).free_symbols == {BATCH}, value.name


def _run_with_loss(stages, inputs, target):
    out = stages.modules[0](*inputs)
    for module in stages.modules[1:]:
        out = module(*out)
    loss = stages.loss(*out, target)
    return loss[0] if isinstance(loss, (tuple, list)) else loss


@pytest.mark.parametrize("name,n", [("gpt-tiny", 2), ("hf-gpt2", 2), (LLAMA4, 4)])
def test_targets_stay_with_the_loss_and_never_cross_a_stage(name, n):
    """With the target split off, stage 0 takes the token ids only, every boundary carries
    floating-point activations only (a pipeline schedule infers their shapes by running
    stages on made-up values, which integer ids would not survive), and the loss module
    on the last stage's outputs and the target gives the whole graph's loss and gradients."""
    traced, inputs, target = _traced(name)
    stages = split_stages(traced.gm, _contiguous([layer.name for layer in traced.layers], n),
                          n, targets=1)
    assert stages.loss is not None and len(stages.inputs[0]) == len(inputs)
    for k in range(1, n):
        for value in stages.modules[k].graph.nodes:
            if value.op == "placeholder":
                assert value.meta["autopar"].dtype.is_floating_point, value.name
    loss, grads = _grads(traced.gm, lambda: _run_with_loss(stages, inputs, target))
    ref_loss, ref_grads = _grads(traced.gm, lambda: _whole(traced, inputs, target))
    assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys()
    for key, g in grads.items():
        torch.testing.assert_close(g, ref_grads[key], rtol=1e-6, atol=1e-7)
    if name == "gpt-tiny":  # the classifier (tied to the embedding) is read by the loss side
        assert stages.shared == {"model.lm_head.weight": [0, 1]}


def _whole(traced, inputs, target):
    out = traced.gm(*inputs, target)
    return out[0] if isinstance(out, (tuple, list)) else out


def test_gpt2_causal_mask_and_positions_are_rebuilt_not_sent():
    """transformers' GPT-2 builds a [B, 1, S, S] mask at the start and reads it in every
    block: each stage rebuilds it from its inputs' sizes; only the residual stream and the
    target cross the boundary."""
    traced, inputs, target = _traced("hf-gpt2")
    stages = split_stages(traced.gm, _contiguous([layer.name for layer in traced.layers], 2), 2)
    assert len(stages.inputs[1]) == 2 and stages.inputs[1][0] == "a1"  # the target
    later = {n.target for n in stages.modules[1].graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.cumsum.default in later and torch.ops.aten.arange.default in later
    assert stages.shared == {"model.lm_head.weight": [0, 1]}  # wte tied to lm_head


def test_a_later_stage_reads_the_batch_size_from_what_it_receives():
    """The graph was traced for batch 4; the stages run batch 3, and the second stage's
    reshapes take the batch from its received activation, not from the input ids it never
    sees."""
    traced, inputs, target = _traced("hf-gpt2")
    stages = split_stages(traced.gm, _contiguous([layer.name for layer in traced.layers], 2), 2)
    small = tuple(t[:3] for t in inputs)
    assert torch.equal(_run(stages, small, target[:3]), _whole(traced, small, target[:3]))


def test_tied_embedding_is_shared_and_untied_models_share_nothing():
    gpt, _, _ = _traced(GPT4)
    llama, _, _ = _traced(LLAMA4)
    layers = lambda t: [layer.name for layer in t.layers]  # noqa: E731
    gpt_stages = split_stages(gpt.gm, _contiguous(layers(gpt), 4), 4)
    assert list(gpt_stages.shared.values()) == [[0, 3]]
    assert split_stages(llama.gm, _contiguous(layers(llama), 4), 4).shared == {}
    assert all(gpt_stages.params[k] for k in range(4))


def test_layers_placed_out_of_order_are_refused():
    traced, _, _ = _traced(GPT4)
    mapping = _contiguous([layer.name for layer in traced.layers], 2)
    mapping["blocks.1"], mapping["blocks.2"] = 1, 0
    with pytest.raises(PlanError, match="blocks.2 is placed on stage 0 .* follow the order"):
        split_stages(traced.gm, mapping, 2)
    mapping = _contiguous([layer.name for layer in traced.layers], 2)
    mapping["loss"] = 2
    with pytest.raises(PlanError, match="layer loss is placed on stage 2; a 2-stage pipeline "
                                        "has stages 0 to 1"):
        split_stages(traced.gm, mapping, 2)


def test_contiguous_stages_refuses_more_stages_than_blocks():
    with pytest.raises(PlanError, match="a 4-stage pipeline needs at least 4 blocks; the "
                                        "model has 2: use 2 stages or fewer"):
        _contiguous(["wte", "blocks.0", "blocks.1", "ln_f", "loss"], 4)

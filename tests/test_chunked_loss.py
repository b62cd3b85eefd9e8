"""The chunked cross-entropy (autopar.kernels.chunked_loss, autopar.passes.chunked_loss):
the kernel against aten, the fused training graph against the unfused one and one device
under data, 1D tensor (vocabulary-parallel), Megatron-SP, pipeline (zero-bubble too) and
ZeRO-3 plans on the
zoo GPT and a transformers Llama whose loss is its own `loss_function`; the switch; the
memory model's named effect and the peak memory it predicts against the measured fall."""

import contextlib
import functools
import io

import pytest
import torch
import torch.nn.functional as F
from equivalence import compare
from pretraced import forked_pool_fixture

from autopar.graph import losses
from autopar.kernels.chunked_loss import ChunkedCrossEntropy

SMALL_CHUNKS = 4 * 64 * 4  # 4 tokens of a 64-class (hf-llama) or 16 of a 256/16 slice


def hf_llama(batch: int):
    """A tiny transformers Llama trained on its own loss function (ForCausalLMLoss: fp32
    upcast, labels shifted by one with -100 padding, mean over the counted tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    x = torch.randint(0, 64, (batch, 8))

    def loss_fn(out, target):
        return model.loss_function(out.logits, target, cfg.vocab_size)

    return model, (x,), torch.randint(0, 64, (batch, 8)), loss_fn


class _WithLabels(torch.nn.Module):
    """A transformers model called with labels=: the loss inside its forward."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


def hf_llama_labels(batch: int):
    model, (x,), target, _ = hf_llama(batch)
    return _WithLabels(model), (x, target), target, _own_loss


def _own_loss(loss, target):
    return loss


ZERO_BUBBLE_GPT = "gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16"
# a world forked from the test process once it traced the models (tests/pretraced.py); the
# chunked loss rewrites the traced graph, so the traces are the same with it on or off
# (hf_llama's loss closes over its model: only its inference graph is shared)
pool2 = forked_pool_fixture(2, ["gpt-tiny", hf_llama, hf_llama_labels, ZERO_BUBBLE_GPT])


def test_kernel_equals_aten_in_many_chunks():
    torch.manual_seed(0)
    x = torch.randn(2, 13, 8, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(40, 8).requires_grad_()
    b = torch.randn(40).requires_grad_()
    t = torch.randint(0, 40, (26,))
    t[3] = -100
    for reduction, name in ((1, "mean"), (2, "sum")):
        module = ChunkedCrossEntropy(None, reduction, -100, chunk_bytes=3 * 40 * 4)  # 3 rows
        got = module(x, w, t, b)
        grads = torch.autograd.grad(got, (x, w, b))
        want = F.cross_entropy((x @ w.t() + b).reshape(-1, 40), t, reduction=name)
        expected = torch.autograd.grad(want, (x, w, b))
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
        for g, e in zip(grads, expected):
            assert torch.allclose(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", [False, True])
def test_kernel_keeps_a_single_chunk_and_makes_no_logits_again(split):
    """Where the tokens fit one chunk the forward keeps its logits and the backward turns
    them into the gradient: its GEMMs are the input's and the weight's gradients alone (two
    of 2 x tokens x hidden x classes FLOPs each), three in several chunks (the logits made
    again); a split loss's weight half still makes them (its input half keeps them). The
    loss and gradients equal aten's either way."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    x = torch.randn(2, 13, 8).requires_grad_()
    w = torch.randn(40, 8).requires_grad_()
    b = torch.randn(40).requires_grad_()
    t = torch.randint(0, 40, (26,))
    t[3] = -100
    gemm = 2 * 26 * 8 * 40

    def addmm_(out, a, b_, *_, **__):  # (the counter has no formula for the in-place one)
        return 2 * a[0] * a[1] * b_[1]

    for rows, again in ((26, 0), (3, 1)):
        module = ChunkedCrossEntropy(None, 1, -100, chunk_bytes=rows * 40 * 4, split=split)
        got = module(x, w, t, b)
        with FlopCounterMode(display=False,
                             custom_mapping={torch.ops.aten.addmm_: addmm_}) as counter:
            grads = torch.autograd.grad(got, (x, w, b))
        remade = again + split  # (the weight half makes them once more, from one chunk too)
        assert counter.get_total_flops() == (2 + remade) * gemm, (rows, split)
        want = F.cross_entropy((x @ w.t() + b).reshape(-1, 40), t)
        expected = torch.autograd.grad(want, (x, w, b))
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
        for g, e in zip(grads, expected):
            assert torch.allclose(g, e, rtol=1e-5, atol=1e-6)


def _chunked_run(name, plan, chunked: bool) -> dict:
    """compare() with small chunks (several per local batch), plus how many losses fused."""
    losses.CHUNK_BYTES = SMALL_CHUNKS
    model = {"hf-llama": hf_llama, "hf-llama-labels": hf_llama_labels}.get(name, name)
    return compare(model, plan, steps=3, probe=_fused, chunked_loss=chunked)


def _fused(engine, inputs, target) -> int:
    return engine.chunked_losses


PLANS = {"data": {"data": 2},
         "tensor": {"tensor": {"size": 2, "mode": "1d"}},
         "megatron-sp": {"tensor": {"size": 2, "mode": "1d", "sequence_parallel": True}},
         "pipeline": {"pipeline": 2},
         "zero3": {"data": 2, "zero": {"stage": 3}}}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("model", ["gpt-tiny", "hf-llama"])
def test_chunked_equals_one_device(pool2, model, plan):
    for r in pool2.run(_chunked_run, model, PLANS[plan], True):
        assert r["probe"] == 1, r["probe"]  # the loss ran chunked
        assert r["loss"] <= 1e-4 and r["weights"] <= 1e-4, (r["loss"], r["weights"])
        assert r["measured"] == r["predicted"]


@pytest.mark.parametrize("plan", ["data", "tensor"])
def test_loss_inside_the_forward_is_chunked(pool2, plan):
    for r in pool2.run(_chunked_run, "hf-llama-labels", PLANS[plan], True):
        assert r["probe"] == 1
        assert r["loss"] <= 1e-4 and r["weights"] <= 1e-4, (r["loss"], r["weights"])
        assert r["measured"] == r["predicted"]


def test_zero_bubble_runs_the_loss_chunked(pool2):
    """ZB-V splits each backward into B (input gradient) and W (weight gradient) through
    autograd's graph: the fused loss gives each its own node, and trains as one device."""
    plan = {"pipeline": {"size": 2, "schedule": "zero_bubble", "microbatches": 4}}
    for r in pool2.run(_chunked_run, ZERO_BUBBLE_GPT, plan,
                       True):
        assert r["probe"] == 1
        assert r["loss"] <= 1e-4 and r["weights"] <= 1e-4, (r["loss"], r["weights"])


def test_split_kernel_gives_each_gradient_its_own_node():
    """The split form: the same loss and gradients as the fused one, the input gradient
    computed without the weight's node running, and the weight's without the input's."""
    torch.manual_seed(0)
    x = torch.randn(2, 13, 8, requires_grad=True)
    w = torch.randn(40, 8, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    t = torch.randint(0, 40, (26,))
    whole = ChunkedCrossEntropy(None, chunk_bytes=3 * 40 * 4)
    split = ChunkedCrossEntropy(None, chunk_bytes=3 * 40 * 4, split=True)
    want = whole(x, w, t, b)
    expected = torch.autograd.grad(want, (x, w, b))
    got = split(x, w, t, b)
    assert torch.equal(got, want)
    (dx,) = torch.autograd.grad(got, (x,), retain_graph=True)
    weight_node = got.grad_fn.next_functions[1][0]
    assert type(weight_node).__name__ == "_WeightHalfBackward"
    assert weight_node.next_functions[0][0] is None  # x enters detached
    dw, db = torch.autograd.grad(got, (w, b))
    for g, e in zip((dx, dw, db), expected):
        assert torch.allclose(g, e, rtol=1e-6, atol=1e-6)


def test_switch_off_keeps_the_traced_loss(pool2):
    for r in pool2.run(_chunked_run, "gpt-tiny", PLANS["tensor"], False):
        assert r["probe"] == 0
        assert r["loss"] <= 1e-5 and r["weights"] <= 1e-5


def test_switch_must_be_a_bool():
    import autopar
    from autopar.models import build

    model, (x,) = build("gpt-tiny", batch=2, device="cpu", seed=0)
    with pytest.raises(autopar.PlanError, match="chunked_loss must be True or False"):
        autopar.parallelize(model, 1, example_inputs=(x,), chunked_loss="yes",
                            optimizer=functools.partial(torch.optim.SGD, lr=0.1))


def _lm_loss(out, target):
    """The language model's cross-entropy over every token: one function for every model
    and engine of the module, so a model traced once (an engine's start, the planner) is
    found in the trace cache by the next (its key names a loss function by identity; a
    lambda made per call traced the same graph again: 5 traces of the 1-layer GPT at Llama
    3's vocabulary where 2 serve)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _peak_fall(vocab: int, seq: int, plan: dict) -> dict:
    """Per rank: the live tensor bytes a step makes at its peak with the chunked loss off
    and on, and the fall the memory model names for this rank's graph."""
    import torch.distributed as dist

    import autopar
    from autopar.cost.chunked_loss import effect
    from autopar.models.gpt import GPT, GPTConfig
    from autopar.runtime.measure import measure_transient_bytes

    world = dist.get_world_size() if dist.is_initialized() else 1
    peaks, said = {}, None
    for chunked in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=vocab, n_layer=1, n_head=2, n_embd=32, block_size=seq))
        x, y = torch.randint(0, vocab, (1, seq)), torch.randint(0, vocab, (1, seq))
        engine = autopar.parallelize(model, world, example_inputs=(x,), plan=plan,
                                     loss_fn=_lm_loss,
                                     optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                     chunked_loss=chunked)
        engine.train_step(x, y)
        peaks[chunked] = measure_transient_bytes(functools.partial(engine.train_step, x, y))
        if chunked:
            solution = engine.train_solution if engine.plan.mesh["tp"] > 1 else None
            said = effect(engine.train_graph, solution, 1)
    return {"fall": peaks[False] - peaks[True], "said": said}


def test_vocab_parallel_peak_falls_by_what_the_memory_model_says(pool2):
    for r in pool2.run(_peak_fall, 32000, 512, PLANS["tensor"]):
        assert r["said"]["losses"][0] == {"layer": "loss", "tokens": 512, "vocab": 16000,
                                          "kernel": "vocab_parallel", "whole_buffers": 4}
        assert abs(r["fall"] - r["said"]["saving_bytes"]) <= \
            0.10 * r["said"]["saving_bytes"], r


def test_peak_falls_by_what_the_plan_says():
    """Llama 3's vocabulary at 2048 tokens: the step's peak falls by the named effect, and
    the plan's memory per device counts the loss's peak (one chunk's logits chunked;
    unchunked, its whole buffers beyond the saved logits), so it falls as much; within 10%."""
    import autopar
    from autopar.models.gpt import GPT, GPTConfig

    vocab, seq = 128256, 2048
    r = _peak_fall(vocab, seq, {"data": 1})
    measured = r["fall"]
    assert r["said"]["losses"][0]["kernel"] == "aten"
    assert abs(measured - r["said"]["saving_bytes"]) <= 0.10 * r["said"]["saving_bytes"], r
    model = GPT(GPTConfig(vocab_size=vocab, n_layer=1, n_head=2, n_embd=32, block_size=seq))
    x = torch.randint(0, vocab, (1, seq))
    plans = {c: autopar.plan(model, (x,), autopar.World(1, device="a100-80gb"),
                             chunked_loss=c, example_target=x, global_batch=1,
                             loss_fn=_lm_loss)
             for c in (True, False)}
    buffers = {c: p.predicted["memory_breakdown_bytes"]["buffers"] for c, p in plans.items()}
    chunk = losses.chunk_rows(vocab) * vocab * 4
    assert buffers[True] >= chunk  # the chunk's transient logits are in the plan
    said = plans[False].predicted["memory_per_device_bytes"] - \
        plans[True].predicted["memory_per_device_bytes"]
    assert abs(measured - said) <= 0.10 * said, (measured, said)


@pytest.mark.parametrize("chunks", ["many", "one"])
def test_activations_lose_the_saved_logits(monkeypatch, chunks):
    """The saved fp32 logits leave the loss's activations for their log-sum-exp; where they
    are a single chunk (128 tokens under the default chunk), the forward keeps that chunk
    and its row max instead, and holds nothing more while it runs."""
    from autopar.cost.chunked_loss import held_while_running
    from autopar.cost.memory import activation_bytes
    from autopar.graph.trace import trace
    from autopar.models.gpt import GPT, GPTConfig

    if chunks == "many":
        monkeypatch.setattr(losses, "CHUNK_BYTES", 16 * 1000 * 4)  # 16 tokens a chunk
    model = GPT(GPTConfig(vocab_size=1000, n_layer=1, n_head=2, n_embd=32, block_size=64))
    x = torch.randint(0, 1000, (2, 64))
    traced = trace(model, (x,), loss_fn=_lm_loss, example_target=x, train=True)
    whole = activation_bytes(traced, micro_batch=2, chunked_loss=False)
    chunked = activation_bytes(traced, micro_batch=2)
    tokens = 2 * 64
    running = held_while_running(traced, None, 2, True)["loss"]
    if chunks == "many":
        assert whole["loss"] - chunked["loss"] == tokens * 1000 * 4 - tokens * 4
        assert running == 16 * 1000 * 4
    else:  # the chunk (as many bytes as the fp32 logits), its row max and the lse
        assert chunked["loss"] - whole["loss"] == 2 * tokens * 4
        assert running == 0
    assert {k: v for k, v in whole.items() if k != "loss"} == \
        {k: v for k, v in chunked.items() if k != "loss"}


def test_explain_names_the_effect():
    import autopar
    from autopar.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=1000, n_layer=1, n_head=2, n_embd=32, block_size=64))
    x = torch.randint(0, 1000, (4, 64))
    plan = autopar.plan(model, (x,), autopar.World(2, device="a100-80gb"),
                        constraints={"tp": 2}, loss_fn=_lm_loss, example_target=x)
    text = plan.explain()
    assert "chunked cross-entropy: peak -" in text and "arXiv 2410.10989" in text, text
    effect = plan.detail["chunked_loss"]
    assert effect["losses"][0]["vocab"] == 500 and effect["losses"][0]["whole_buffers"] == 4


def test_the_planner_prices_the_loss_unchunked_when_told(monkeypatch):
    import autopar
    from autopar.cli import main
    from autopar.models.gpt import GPT, GPTConfig

    # 16 tokens a chunk: the 256 tokens' logits in several chunks, none kept (a single chunk
    # would be kept for the backward, as many bytes as the unchunked loss saves)
    monkeypatch.setattr(losses, "CHUNK_BYTES", 16 * 1000 * 4)
    model = GPT(GPTConfig(vocab_size=1000, n_layer=1, n_head=2, n_embd=32, block_size=64))
    x = torch.randint(0, 1000, (4, 64))
    plans = {c: autopar.plan(model, (x,), autopar.World(1, device="a100-80gb"),
                             chunked_loss=c, example_target=x, loss_fn=_lm_loss)
             for c in (True, False)}
    acts = {c: p.predicted["memory_breakdown_bytes"]["activations"] for c, p in plans.items()}
    assert acts[False] - acts[True] == 4 * 64 * (1000 - 1) * 4
    assert plans[False].detail["chunked_loss"] is None
    assert "chunked cross-entropy" not in plans[False].explain()
    spec = "gpt:layers=1,hidden=64,heads=2,vocab=4096"
    for flag, seen in (([], True), (["--no-chunked-loss"], False)):
        with io.StringIO() as out, contextlib.redirect_stdout(out):
            assert main(["explain", spec, "--world", "1", "--seq", "128", *flag]) == 0
            assert ("chunked cross-entropy: peak -" in out.getvalue()) is seen


def _gpt_lm(vocab: int, seq: int, hidden: int, layers: int):
    from autopar.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=vocab, n_layer=layers, n_head=2, n_embd=hidden,
                          block_size=seq))
    return model, _lm_loss


def _remade_s(flops: int, chunk: tuple, hw, dtype: str, kept: bool = True) -> float:
    """Seconds of logits made again: GEMMs of the chunk's shape, each moving its operands,
    and the upcast and log-sum-exp subtraction's bytes (cost.chunked_loss.REMADE_SOURCE);
    `kept` as remade_work's (False: a zero-bubble weight half, which makes one chunk too)."""
    from autopar.cost.chunked_loss import remade_work
    from autopar.cost.model import ITEMSIZE, gemm_time, memory_time

    n, (rows, k, v), moved = remade_work(flops, chunk, ITEMSIZE[dtype], kept)
    return n * gemm_time(2 * rows * k * v, hw, dtype, (rows, k, v), ITEMSIZE[dtype]) + \
        memory_time(moved, hw)


def _effects(plan) -> dict:
    return {e["effect"]: e["seconds"] for e in plan.detail["effects"]}


def test_zero_bubble_prices_the_classifier_matmul_its_split_backward_adds(monkeypatch):
    """Under zero-bubble the split loss makes its logits once more (one more classifier GEMM
    per micro-batch on the last stage, in chunks as the backward makes them): the search
    adds its seconds to that stage, so the step grows by (m + (p - 1)/6) of them (ZB-V's
    closed form), and explain names the effect; 1F1B, and zero-bubble with the loss
    unchunked, have none of it (1F1B has the logits remade once, as every schedule). At 256
    tokens of 8192 classes the logits are a single chunk: the input half (and 1F1B's
    one-node backward) keeps it, nothing remade there; the weight half makes them again."""
    import autopar
    import autopar.search.prepared
    from autopar.cost.chunked_loss import REMADE_NAME, SPLIT_NAME, loss_logits
    from autopar.graph.trace import trace

    vocab, seq, hidden, m, p = 8192, 128, 64, 4, 2
    model, loss_fn = _gpt_lm(vocab, seq, hidden, 4)
    x = torch.randint(0, vocab, (8, seq))
    traced = trace(model, (x[:1],), loss_fn=loss_fn, example_target=x[:1], train=True)
    (one,) = loss_logits(traced, micro_batch=2)
    assert one.hidden == hidden and one.logits_flops == 2 * (2 * seq) * hidden * vocab
    world = autopar.World(p, device="a100-80gb")

    def planned(schedule, chunked=True):
        return autopar.plan(model, (x,), world, global_batch=8, loss_fn=loss_fn,
                            example_target=x, chunked_loss=chunked,
                            constraints={"pp": p, "microbatches": m, "micro_batch_size": 2,
                                         "schedule": schedule, "recompute": "none"})

    zb, ofob, unchunked = planned("zero_bubble"), planned("1f1b"), planned("zero_bubble", False)
    matmul = _remade_s(one.logits_flops, (losses.chunk_rows(vocab), hidden, vocab),
                       world.profile, zb.search.get("dtype", "bf16"), kept=False)
    assert _effects(zb)[SPLIT_NAME] == pytest.approx(m * matmul, rel=1e-6)
    # (was m * matmul before a single chunk was kept)
    assert _effects(zb).get(REMADE_NAME, 0.0) == 0.0
    assert SPLIT_NAME not in _effects(ofob) and SPLIT_NAME not in _effects(unchunked)
    assert _effects(ofob).get(REMADE_NAME, 0.0) == 0.0 and \
        REMADE_NAME not in _effects(unchunked)
    assert SPLIT_NAME in zb.explain() and SPLIT_NAME not in ofob.explain()
    split_table = autopar.search.prepared.Prepared._tables

    def unsplit(self, search):  # the split's seconds left out of the search's tables
        split_table(self, search)
        self.split_table = self.split_table * 0
    monkeypatch.setattr(autopar.search.prepared.Prepared, "_tables", unsplit)
    unpriced = planned("zero_bubble")
    assert [lp.stage for lp in unpriced.layers] == [lp.stage for lp in zb.layers]
    grown = zb.predicted["step_time_s"] - unpriced.predicted["step_time_s"]
    assert grown == pytest.approx((m + (p - 1) / 6) * matmul, rel=1e-6)


def _step_flops(engine, x, y) -> int:
    """GEMM FLOPs of one train_step, counted by torch's FLOP counter over the ops that run;
    the counter has no formula for the in-place addmm_ the chunked backward folds each
    chunk's weight gradient with, so it is given one (2 M K N, as addmm's)."""
    from torch.utils.flop_counter import FlopCounterMode

    def addmm_(out, a, b, *_, **__):
        return 2 * a[0] * a[1] * b[1]

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}) as c:
        engine.train_step(x, y)
    return c.get_total_flops()


@pytest.mark.parametrize("chunks", ["many", "one"])
def test_the_backward_remakes_the_logits_priced_as_counted(monkeypatch, chunks):
    """The chunked loss keeps no logits: its backward makes each chunk's again, one more
    classifier GEMM per step than the unchunked loss, which the FLOP counter sees over the
    real kernels and the plan names (REMADE_NAME, its FLOPs and seconds in the step) under
    every schedule; unchunked, none of it. Where the logits are a single chunk (here the
    128 tokens under the default 16 MiB chunk) the forward keeps it: no GEMM more than the
    unchunked loss, and the plan prices none."""
    import autopar
    from autopar.cost.chunked_loss import REMADE_NAME

    vocab, seq, hidden = 1000, 64, 32
    if chunks == "many":
        monkeypatch.setattr(losses, "CHUNK_BYTES", 16 * vocab * 4)  # 8 chunks of 16 tokens
    x, y = torch.randint(0, vocab, (2, seq)), torch.randint(0, vocab, (2, seq))
    flops = {}
    for chunked in (False, True):
        torch.manual_seed(0)
        model, loss_fn = _gpt_lm(vocab, seq, hidden, 1)
        engine = autopar.parallelize(model, 1, example_inputs=(x,), loss_fn=loss_fn,
                                     optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                     chunked_loss=chunked)
        engine.train_step(x, y)
        flops[chunked] = _step_flops(engine, x, y)
    world = autopar.World(1, device="a100-80gb")
    plans = {c: autopar.plan(model, (x,), world, global_batch=2, loss_fn=loss_fn,
                             example_target=y, chunked_loss=c) for c in (True, False)}
    said = plans[True].detail["chunked_loss"]["remade_flops"]
    assert said == (2 * (2 * seq) * hidden * vocab if chunks == "many" else 0)
    assert flops[True] - flops[False] == said, flops
    if chunks == "one":
        assert _effects(plans[True]).get(REMADE_NAME, 0.0) == 0.0
        assert plans[True].predicted["step_time_s"] == \
            pytest.approx(plans[False].predicted["step_time_s"], rel=1e-9)
        return
    seconds = _remade_s(said, (losses.chunk_rows(vocab), hidden, vocab), world.profile,
                       plans[True].search.get("dtype", "bf16"))
    assert _effects(plans[True])[REMADE_NAME] == pytest.approx(seconds, rel=1e-9)
    assert REMADE_NAME not in _effects(plans[False])
    grown = plans[True].predicted["step_time_s"] - plans[False].predicted["step_time_s"]
    assert grown == pytest.approx(seconds, rel=1e-6)
    text = plans[True].explain()
    assert REMADE_NAME in text and "autopar.kernels.chunked_loss" in text, text


def _zero_bubble_stages(vocab: int) -> tuple[list[int], list[int]]:
    """A ZB-V plan's stage per layer, and the stages its layers' times alone would give."""
    import autopar
    from autopar.search.partition import balance

    model, loss_fn = _gpt_lm(vocab, 128, 64, 6)
    x = torch.randint(0, vocab, (8, 128))
    plan = autopar.plan(model, (x,), autopar.World(2, device="a100-80gb"), global_batch=8,
                        loss_fn=loss_fn, example_target=x,
                        constraints={"pp": 2, "microbatches": 4, "micro_batch_size": 2,
                                     "schedule": "zero_bubble", "recompute": "none"})
    rows = plan.detail["layers"]
    return [r["stage"] for r in rows], balance([r["time_s"] for r in rows], 4)


def test_zero_bubble_stages_hold_the_classifier_matmul():
    """The stage split balances the time zero-bubble adds to the last stage (the classifier's
    logits made once more): at a large vocabulary that stage takes fewer layers than the
    layers' times alone would give it; at a small one the split is theirs."""
    stages, by_time = _zero_bubble_stages(32768)
    assert stages != by_time
    assert stages.count(3) < by_time.count(3), (stages, by_time)
    stages, by_time = _zero_bubble_stages(1024)
    assert stages == by_time


def _explained_zero_bubble() -> dict:
    """A ZB-V pipeline over two ranks trained three steps, its logits in several chunks (as
    `_chunked_run` leaves them; a single chunk would be kept, not made again in B); this
    rank's explain()."""
    import autopar

    losses.CHUNK_BYTES = SMALL_CHUNKS
    vocab = 2048
    torch.manual_seed(0)
    model, loss_fn = _gpt_lm(vocab, 32, 32, 4)
    x, y = torch.randint(0, vocab, (4, 32)), torch.randint(0, vocab, (4, 32))
    engine = autopar.parallelize(
        model, 2, example_inputs=(x,), loss_fn=loss_fn,
        plan={"pipeline": {"size": 2, "schedule": "zero_bubble", "microbatches": 4}},
        optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    for _ in range(3):
        engine.train_step(x, y)
    return {"json": engine.explain(format="json"), "text": engine.explain(),
            "loss_here": "loss" in engine.pipeline_layers()}


def test_explain_measures_the_logits_remade_beside_their_price(pool2):
    """Under zero-bubble the rank holding the loss runs its logits twice more per micro-batch
    (once in B, once more in W): explain() puts the seconds the kernel timed making them
    beside the plan's two named effects; the other rank has none."""
    from autopar.cost.chunked_loss import REMADE_NAME, SPLIT_NAME

    results = pool2.run(_explained_zero_bubble)
    assert sorted(r["loss_here"] for r in results) == [False, True]
    for r in results:
        rows = {e["effect"]: e for e in r["json"]["logits_remade"]}
        if not r["loss_here"]:
            assert rows == {}
            continue
        assert set(rows) == {REMADE_NAME, SPLIT_NAME}, rows
        for e in rows.values():
            assert e["predicted_s"] > 0 and e["measured_s"] > 0, e
        assert "logits made again" in r["text"] and SPLIT_NAME in r["text"], r["text"]


def test_a_compiled_engine_times_the_logits_remade(monkeypatch):
    """compile=True leaves the chunked loss eager (autopar's own module): explain() still
    puts the kernel's time making the logits again beside the plan's effect (the logits in
    8 chunks: a single one would be kept, not made again)."""
    import autopar
    from autopar.cost.chunked_loss import REMADE_NAME

    vocab = 1000
    monkeypatch.setattr(losses, "CHUNK_BYTES", 16 * vocab * 4)
    torch.manual_seed(0)
    model, loss_fn = _gpt_lm(vocab, 64, 32, 1)
    x, y = torch.randint(0, vocab, (2, 64)), torch.randint(0, vocab, (2, 64))
    engine = autopar.parallelize(model, 1, example_inputs=(x,), loss_fn=loss_fn,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                 compile=True)
    for _ in range(3):
        engine.train_step(x, y)
    assert engine.chunked_losses == 1 and engine.regions.compiled >= 1
    (row,) = engine.explain(format="json")["logits_remade"]
    assert row["effect"] == REMADE_NAME and row["predicted_s"] > 0 and row["measured_s"] > 0

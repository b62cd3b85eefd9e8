"""Float8 training (`parallelize(..., precision="fp8")`, autopar.kernels.float8,
autopar.passes.float8): the linears' three GEMMs in float8 with tensorwise power-of-two
scales, bf16 elsewhere, fp32 masters.

Tolerances. Against fp8 on one device (the same recipe, `parallelize(model, 1, ...)`), a
layout changes only where bf16 rounds (a row-split linear's partial products, a data rank's
half-batch gradient) and, with power-of-two scales, float8's rounding not at all outside
the subnormals: so the bounds are bf16's (tests/test_precision.py): losses within 1e-2
relative, all weights together within 2e-3 relative after 3 SGD steps. Against fp32
(plain torch on one device), float8 rounds every GEMM operand to 3 (e4m3) or 2 (e5m2)
mantissa bits: losses within 5e-2 relative, weights within 2e-2 relative.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from pretraced import forked_pool_fixture, pretracing
from torch import nn

import autopar
from autopar.kernels.float8 import (
    E4M3,
    E5M2,
    ROWWISE,
    TENSORWISE,
    Float8Linear,
    _Float8Matmul,
    _RowwiseMatmul,
    quantize,
    scale_for,
)
from autopar.passes.float8 import MULTI_D_KEPT, OUTPUT_PROJECTION

LOSS_TOL, MODEL_TOL = 1e-2, 2e-3  # against fp8 on one device
FP32_LOSS_TOL, FP32_MODEL_TOL = 5e-2, 2e-2  # against fp32 on one device


def _lm_loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def hf_gpt2(batch: int):
    """A tiny transformers GPT-2 whose linears all fit the fp8 kernels (dims of 16s)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    x = torch.randint(0, 128, (batch, 16))
    return model, (x,), x.roll(-1, 1), _lm_loss


def hf_llama(batch: int):
    """A tiny transformers Llama (nn.Linear everywhere, RMSNorm, rotary)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=16)
    model = LlamaForCausalLM(cfg)
    x = torch.randint(0, 128, (batch, 16))
    return model, (x,), x.roll(-1, 1), _lm_loss


# each world forked from the test process once it traced the world's models (tests/pretraced.py)
pool2 = forked_pool_fixture(2, [hf_gpt2, ("moe-tiny", {"data": 2, "expert": 2})])
pool4 = forked_pool_fixture(4, [hf_llama])


# ------------------------------------------------------------------ the kernel alone

def _emulated(x, w, dy):
    """The recipe by hand in fp32: operands rounded through float8 at their scales."""
    def through(t, dtype):
        s = scale_for(t.abs().max(), dtype)
        return quantize(t, s, dtype).float() / s
    xe, we, ge = through(x, E4M3), through(w, E4M3), through(dy, E5M2)
    return xe @ we.t(), ge @ we, ge.t() @ xe


@pytest.mark.parametrize("rows", [32, 20])  # 20: padded to 32 inside, exactly
def test_the_three_gemms_follow_the_recipe(rows):
    torch.manual_seed(0)
    x = torch.randn(rows, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, 48, dtype=torch.bfloat16)
    y = _Float8Matmul.apply(x, w, None, (), False)
    y.backward(dy)
    ref_y, ref_dx, ref_dw = _emulated(x.detach().float(), w.detach().float(), dy.float())
    for got, want in ((y, ref_y), (x.grad, ref_dx), (w.grad, ref_dw)):
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max())
    # and float8 is coarser than bf16: the forward differs from the bf16 product
    plain = x.detach().float() @ w.detach().float().t()
    assert 1e-3 < float((y.float() - plain).norm() / plain.norm()) < 5e-2


def test_power_of_two_scales_round_alike_whatever_the_amax():
    """A tensor scaled from a larger amax (another rank's, or the whole tensor's) rounds to
    the same values: why layouts match one device."""
    torch.manual_seed(0)
    x = torch.randn(256)
    s_own, s_big = scale_for(x.abs().max(), E4M3), scale_for(10 * x.abs().max(), E4M3)
    assert s_own != s_big and torch.log2(s_own) == torch.floor(torch.log2(s_own))
    normal = x.abs() > 1e-2  # outside e4m3's subnormals at either scale
    own = quantize(x, s_own, E4M3).float() / s_own
    big = quantize(x, s_big, E4M3).float() / s_big
    assert torch.equal(own[normal], big[normal])


def _rowwise_emulated(x, w, dy):
    """The rowwise recipe by hand in fp32: every operand in e4m3 at a power-of-two scale per
    slice along the dim its GEMM keeps (rows of the left operand, columns of the right)."""
    def through(t, dim):
        s = scale_for(t.abs().amax(dim=dim, keepdim=True), E4M3)
        return quantize(t, s, E4M3).float() / s
    return (through(x, 1) @ through(w, 1).t(), through(dy, 1) @ through(w, 0),
            through(dy, 0).t() @ through(x, 0))


@pytest.mark.parametrize("rows", [32, 20])
def test_the_rowwise_gemms_follow_their_recipe(rows):
    """Rowwise scales on `torch._scaled_mm` (a [m, 1] and a [1, n] scale) equal the recipe
    emulated in fp32; a row far smaller than the rest keeps its precision, where one scale
    for the whole tensor flushes it to zero."""
    torch.manual_seed(0)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    x[3] *= 2.0 ** -20  # a token whose activations sit below e4m3's range at the tensor's scale
    x[5] = 0.0  # a row of zeros (a padded token): a finite scale, zeros out, no NaN
    x.requires_grad_(True)
    w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, 48, dtype=torch.bfloat16)
    y = _RowwiseMatmul.apply(x, w, False)
    y.backward(dy)
    ref = _rowwise_emulated(x.detach().float(), w.detach().float(), dy.float())
    for got, want in zip((y, x.grad, w.grad), ref):
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max())
    exact = x.detach()[3].float() @ w.detach().float().t()
    tensorwise = _Float8Matmul.apply(x.detach(), w.detach(), None, (), False)[3]
    assert float((y[3].detach().float() - exact).norm() / exact.norm()) < 5e-2
    assert float(tensorwise.float().norm()) == 0.0
    assert torch.equal(y[5].detach(), torch.zeros_like(y[5]))
    assert all(torch.isfinite(t).all() for t in (y, x.grad, w.grad))


def test_an_unknown_recipe_is_refused_with_the_names_that_exist():
    with pytest.raises(ValueError, match="'rowwise', 'tensorwise'|'tensorwise', 'rowwise'"):
        autopar.parallelize(nn.Linear(16, 16), 1, example_inputs=(torch.randn(4, 16),),
                            loss_fn=F.mse_loss, precision="fp8", fp8_recipe="blockwise")


@pytest.mark.parametrize("mode", ["2d", "2.5d", "3d"])
def test_multi_d_linears_are_named_as_kept_in_bf16(mode):
    """The float8 pass leaves a 2D/2.5D/3D linear (a GridLinear of the tensor-parallel pass)
    in bf16 and its report says why."""
    import torch.fx as fx

    from autopar.kernels.modules import GridLinear
    from autopar.passes.float8 import float8_linears

    root = nn.Module()
    root.proj = GridLinear(mode, ("a", "b", "c") if mode != "2d" else ("a", "b"))
    root.w = nn.Parameter(torch.zeros(16, 16))
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_module("proj", (x, graph.get_attr("w"))))
    gm = fx.GraphModule(root, graph)
    _, report = float8_linears(gm, {}, "tp", {"a": 2, "b": 2, "c": 2})
    assert report.converted == []
    assert report.kept == {"proj": MULTI_D_KEPT.format(mode=mode)}


def test_the_transposed_form_is_conv1d():
    torch.manual_seed(0)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    w = torch.randn(32, 48, dtype=torch.bfloat16)  # [in, out]
    layer = Float8Linear("tp", transposed=True)
    assert torch.equal(layer(x, w), _Float8Matmul.apply(x, w.t().contiguous(), None, (), False))


# ------------------------------------------------------------------ one device

def test_fp8_trains_linears_in_float8_and_explain_names_those_kept_in_bf16():
    """A linear with 24 out features (not a multiple of 16) stays bf16 and explain says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 24), nn.GELU(),
                          nn.Linear(24, 16))
    x, y = torch.randn(32, 32), torch.randn(32, 16)
    engine = autopar.parallelize(model, 1, example_inputs=(x,), loss_fn=F.mse_loss,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                 precision="fp8")
    losses = [engine.train_step(x, y) for _ in range(3)]
    assert losses[-1] < losses[0]
    kinds = [type(m).__name__ for m in engine.train_gm.modules()]
    assert kinds.count("Float8Linear") == 1
    assert engine.float8.converted == ["0"]
    assert set(engine.float8.kept) == {"2", "4"}  # ("4" is the output projection too)
    text = engine.explain()
    assert "1 linear modules in float8" in text
    assert "stayed bf16: 2: its local weight has 64 in and 24 out features" in text
    assert all(p.dtype == torch.float32 for p in engine.parameters())


# ------------------------------------------------------------------ layouts vs one device

def _train(engine, inputs, target, steps):
    return [engine.train_step(inputs, target) for _ in range(steps)]


def _one_device(build, steps: int, batch: int, recipe: str) -> dict:
    """`build`'s model trained at fp8 on one device (`recipe`'s scales) and in fp32 with
    plain torch; the losses and the final weights of each, flattened over the floating-point
    state whose norm is not 0."""
    model, inputs, target, loss_fn = build(batch)
    fp32 = copy.deepcopy(model)
    opt = functools.partial(torch.optim.SGD, lr=0.2)
    one = autopar.parallelize(model, 1, example_inputs=tuple(t[:2] for t in inputs),
                              loss_fn=loss_fn, optimizer=opt, plan={}, precision="fp8",
                              fp8_recipe=recipe)
    losses = _train(one, inputs, target, steps)
    fp32_opt, fp32_losses = opt(fp32.parameters()), []
    for _ in range(steps):
        fp32_opt.zero_grad()
        loss = loss_fn(fp32(*inputs), target)
        loss.backward()
        fp32_opt.step()
        fp32_losses.append(loss.item())
    exact = fp32.state_dict()
    keys = [k for k in exact if exact[k].dtype.is_floating_point and exact[k].norm() > 1e-6]
    return {"keys": keys, "losses": losses, "flat": _flat(one.full_state_dict(), keys),
            "fp32_losses": fp32_losses, "fp32_flat": _flat(exact, keys)}


def _flat(state: dict, keys: list[str]) -> torch.Tensor:
    return torch.cat([state[k].reshape(-1).float() for k in keys])


# The one-device runs a layout is measured against, per (model, steps, batch, recipe): the
# same for every plan, so trained once per module, in the test process (on one thread, as a
# rank runs it, from the graphs the module's pools pretraced), not on every rank of a world.
_REFERENCES: dict = {}


def reference(build, steps: int = 3, batch: int = 8, recipe: str = ROWWISE) -> dict:
    key = (build.__name__, steps, batch, recipe)
    if key not in _REFERENCES:
        with pretracing():
            _REFERENCES[key] = _one_device(build, steps, batch, recipe)
    return _REFERENCES[key]


def compare_fp8(build, plan, ref: dict, steps: int = 3, batch: int = 8,
                recipe: str = ROWWISE) -> dict:
    """Train under `plan` at fp8 (`recipe`'s scales); its relative differences from `ref`
    (`reference`: the same steps at fp8 on one device and in fp32 with plain torch), and
    the first step's bytes measured and predicted."""
    import torch.distributed as dist
    from equivalence import relative

    model, inputs, target, loss_fn = build(batch)
    opt = functools.partial(torch.optim.SGD, lr=0.2)
    engine = autopar.parallelize(model, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 optimizer=opt, plan=plan, precision="fp8", fp8_recipe=recipe)
    engine.comm_log.clear()
    losses = [engine.train_step(inputs, target)]
    measured = engine.comm_log.totals(phases=("forward", "backward", "step"))
    predicted = engine.predicted_comm(batch)
    losses += _train(engine, inputs, target, steps - 1)
    full = _flat(engine.full_state_dict(), ref["keys"])
    rel = lambda a, b: max(abs(p - q) / abs(q) for p, q in zip(a, b))  # noqa: E731
    return {"loss": rel(losses, ref["losses"]), "model": relative(full, ref["flat"]),
            "fp32_loss": rel(losses, ref["fp32_losses"]),
            "fp32_model": relative(full, ref["fp32_flat"]),
            "measured": measured, "predicted": predicted,
            "converted": len(engine.float8.converted), "kept": dict(engine.float8.kept),
            "split": sum(bool(m.split) for m in engine.train_gm.modules()
                         if isinstance(m, Float8Linear))}


# One run per (model, plan, recipe): the tensor-parallel amax test reads the rowwise tp 2
# run the equivalence test made instead of training it again; a test run alone makes its own.
_RUNS: dict = {}


def run_fp8(pool, build, plan_name: str, recipe: str = ROWWISE) -> list[dict]:
    key = (build.__name__, plan_name, recipe)
    if key not in _RUNS:
        plan = PLANS2.get(plan_name) or PLANS4[plan_name]
        _RUNS[key] = pool.run(compare_fp8, build, plan,
                              reference(build, recipe=recipe), recipe=recipe)
    return _RUNS[key]


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["loss"] <= LOSS_TOL and r["model"] <= MODEL_TOL, r
        assert r["fp32_loss"] <= FP32_LOSS_TOL and r["fp32_model"] <= FP32_MODEL_TOL, r
        assert r["measured"] == r["predicted"]
        # every linear in float8 but the output projection (lm_head), kept in bf16
        assert r["converted"] > 0 and list(r["kept"].values()) == [OUTPUT_PROJECTION], r


PLANS2 = {"dp2": {"data": 2},
          "tp2": {"tensor": {"size": 2, "mode": "1d"}},
          "tp2-sp": {"tensor": {"size": 2, "mode": "1d", "sequence_parallel": True}},
          "zero1": {"data": 2, "zero": {"stage": 1}},
          "zero2": {"data": 2, "zero": {"stage": 2}},
          "zero3": {"data": 2, "zero": {"stage": 3}},
          "pp2": {"pipeline": {"size": 2, "microbatches": 2}}}


@pytest.mark.parametrize("plan", PLANS2)
def test_fp8_gpt2_equals_fp8_on_one_device_at_world_2(pool2, plan):
    _check(run_fp8(pool2, hf_gpt2, plan))


def test_fp8_tensor_parallel_reduces_the_amax_of_split_operands(pool2):
    """Under tp 2 and tensorwise scales every float8 linear whose weight is split all-reduces
    4 bytes per split operand, two in all: a column-parallel one its weight's (forward) and
    its output gradient's (backward), a row-parallel one its input's and its weight's
    (forward). Rowwise scales come from each rank's piece of a row: no all-reduce. Both
    equal fp8 on one device."""
    tensorwise = run_fp8(pool2, hf_gpt2, "tp2", TENSORWISE)
    rowwise = run_fp8(pool2, hf_gpt2, "tp2")
    fp32 = pool2.run(_tp_bytes_without_fp8)
    _check(tensorwise)
    for r, row, plain in zip(tensorwise, rowwise, fp32):
        extra = r["measured"][("all_reduce", "tp")] - plain
        assert r["split"] > 0 and extra == r["split"] * 2 * 4, (extra, r["split"])
        assert row["measured"] == row["predicted"]
        assert row["split"] == r["split"] and row["measured"][("all_reduce", "tp")] == plain


def _tp_bytes_without_fp8() -> int:
    import torch.distributed as dist

    model, inputs, target, loss_fn = hf_gpt2(8)
    engine = autopar.parallelize(model, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.2),
                                 plan=PLANS2["tp2"], precision="bf16")
    engine.comm_log.clear()
    engine.train_step(inputs, target)
    return engine.comm_log.totals(phases=("forward", "backward", "step"))[("all_reduce", "tp")]


PLANS4 = {"tp2-zero3": {"tensor": {"size": 2, "mode": "1d"}, "data": 2, "zero": {"stage": 3}},
          "pp2-tp2": {"pipeline": 2, "tensor": {"size": 2, "mode": "1d"}}}


@pytest.mark.parametrize("plan", PLANS4)
def test_fp8_llama_equals_fp8_on_one_device_at_world_4(pool4, plan):
    _check(run_fp8(pool4, hf_llama, plan))


def _zero3_gathers(precision: str) -> dict:
    """One step of GPT-2 under ZeRO-3 over dp 2: bytes gathered and amaxes all-reduced."""
    import torch.distributed as dist

    model, inputs, target, loss_fn = hf_gpt2(8)
    engine = autopar.parallelize(model, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.2),
                                 plan=PLANS2["zero3"], precision=precision)
    engine.train_step(inputs, target)
    engine.comm_log.clear()
    engine.train_step(inputs, target)
    measured = engine.comm_log.totals(phases=("forward", "backward", "step"))
    zero = engine.zero
    return {"gathered": measured[("all_gather", "dp")],
            "all_reduce": measured[("all_reduce", "dp")],
            "float8_members": sum(sum(u.float8 or ()) for u in zero.units),
            "equal": measured == engine.predicted_comm(8)}


def test_zero3_gathers_float8_weights_in_one_byte(pool2):
    """Under fp8 ZeRO-3 gathers each float8 linear's weight in e4m3 with its scale (about
    half of bf16's bytes: the tied embedding and lm_head, biases and norms stay bf16), after one
    all-reduce of the weights' amaxes per gather; the prediction counts both."""
    fp8, bf16 = pool2.run(_zero3_gathers, "fp8"), pool2.run(_zero3_gathers, "bf16")
    for a, b in zip(fp8, bf16):
        assert a["equal"] and b["equal"], (a, b)
        # 4 linears x 2 blocks (the lm_head, tied to the embedding, stays bf16)
        assert a["float8_members"] == 8 and b["float8_members"] == 0, (a, b)
        assert 0.5 < a["gathered"] / b["gathered"] < 0.65, (a, b)
        assert a["all_reduce"] > b["all_reduce"]


def _experts_fp8() -> dict:
    """Three fp8 steps of the zoo's tiny MoE with experts split over ep 2."""
    import torch.distributed as dist
    from equivalence import build

    model, inputs, target, loss_fn = build("moe-tiny", 8)
    engine = autopar.parallelize(model, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                                 plan={"data": 2, "expert": 2}, precision="fp8")
    losses = []
    for _ in range(3):
        engine.comm_log.clear()
        losses.append(engine.train_step(inputs, target))
    measured = engine.comm_log.totals(phases=("forward", "backward", "step"))
    return {"losses": losses, "kept": dict(engine.float8.kept),
            "moe": sorted(engine.moe_layers), "equal": measured == engine.predicted_comm(8)}


def test_fp8_experts_keep_their_gemms_in_bf16_and_explain_says_so(pool2):
    from autopar.passes.float8 import EXPERTS_KEPT

    for r in pool2.run(_experts_fp8):
        assert r["moe"] and all(r["kept"][name] == EXPERTS_KEPT for name in r["moe"]), r
        assert r["equal"] and r["losses"][-1] < r["losses"][0], r


# ------------------------------------------------------------------ 100 steps on real text

def _text_batches(steps: int, batch: int, seq: int):
    """Byte windows of English text shipped with Python (pydoc's topics)."""
    from pydoc_data.topics import topics

    data = torch.tensor(list("\n".join(topics.values()).encode("ascii", "replace")))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        start = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        window = torch.stack([data[s:s + seq + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]


def _byte_loss(out, y):  # one function for both curves: the trace cache names a loss by identity
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _curve(precision: str, steps: int, lr: float = 1e-3) -> list[float]:
    from autopar.models import build

    # on the CPU, so that both curves start from the same weights (a meta model would take
    # its initialization from the random state of the moment)
    model, _ = build("gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32", batch=2, device="cpu",
                     seed=0)
    x0, _ = next(_text_batches(1, 16, 32))
    engine = autopar.parallelize(model, 1, example_inputs=(x0[:2],), loss_fn=_byte_loss,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=lr),
                                 plan={}, precision=precision)
    return [engine.train_step(x, y) for x, y in _text_batches(steps, 16, 32)]


def test_fp8_loss_curve_follows_bf16_over_100_steps():
    """A byte-level GPT on real text, 100 AdamW steps from the same weights: both curves fall
    well below the first step's loss, and fp8's (the default rowwise recipe) last-10 mean
    ends within 2% of bf16's (issue #32). Measured with one thread, model seeds 0-2: rowwise
    -0.18% to +0.17%, tensorwise -0.26% to +0.19%, fp32 beside bf16 0.00% (seed 0;
    docs/fp8-training.md has the table). The rate is 1e-3: at 3e-3 the earlier 5.2% was
    this model's instability, not float8's bias (the same fp8 run ended 7% apart with one
    thread or two, bf16's 1.2%; over seeds fp8 ended from 4% below bf16 to 10% above)."""
    threads = torch.get_num_threads()
    # one thread, as measured: on these tiny GEMMs a second thread only spins, which cost
    # most of the test's CPU (its waits for the other thread, longest on a loaded machine)
    torch.set_num_threads(1)
    try:
        bf16, fp8 = _curve("bf16", 100), _curve("fp8", 100)
    finally:
        torch.set_num_threads(threads)
    end_bf16, end_fp8 = sum(bf16[-10:]) / 10, sum(fp8[-10:]) / 10
    assert end_bf16 < 0.7 * bf16[0] and end_fp8 < 0.7 * fp8[0], (bf16[0], end_bf16, end_fp8)
    assert abs(end_fp8 - end_bf16) / end_bf16 < 0.02, (end_bf16, end_fp8)

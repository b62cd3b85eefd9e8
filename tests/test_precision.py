"""Mixed precision (`parallelize(..., precision="bf16" | "fp16")`, autopar.passes.precision,
autopar.runtime.scaler): forward and backward in 16 bits on fp32 master weights, the loss in
fp32, dynamic loss scaling for fp16.

The reference is one device running the same policy written out with plain torch: every
parameter (each name of a tied weight separately, as the pass casts once per reading
layer) and floating input cast with `.to(dtype)`, the model called on the casts
(`torch.func.functional_call`), the logits cast back to fp32 for the loss, and fp16 scaled
by torch's own `torch.amp.GradScaler`. On one device the pass gives that reference's loss
and gradients bit for bit.

Tolerances against the sharded runs. bf16 keeps 8 significant bits (a relative rounding of
2**-9 = 0.2%), fp16 11 bits (0.05%). Sharding changes where 16-bit values are rounded: a
row-split linear rounds each rank's partial product to bf16 before the all-reduce adds
them, a data-parallel rank computes its half batch's gradient in 16 bits where one device
rounds the whole batch's once. Those are roundings of the size bf16 makes anyway, so the
yardstick is bf16 itself: the same single device trained in fp32 differs from the bf16
reference by the "gap" of each tensor, and a sharded run may differ from the bf16
reference by at most twice that gap (+1e-4 for tensors whose gap is ~0, such as norm
weights), and by 1e-3 relative over the whole model. Losses (means over 128 tokens) stay
within 1e-2 relative. Gradients that are sums with cancellation (a bias's, over every
token) lose most, several percent relative in bf16 on one device already, which is why a
fixed per-tensor bound would be either loose or flaky. The optimizer is plain SGD: Adam
divides each gradient element by its running magnitude, so an element whose gradient is
rounding noise takes a full lr-sized step in a random direction, which would hide a real
error under amplified noise; SGD's update is the gradient times lr, so weight differences
measure gradient differences. fp32 runs of the same plans agree to 1e-5
(tests/equivalence.py): anything beyond these bounds is a bug, not rounding.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture
from torch import nn

import autopar
from autopar.errors import PlanError
from autopar.graph.trace import trace
from autopar.passes.precision import CAST, cast_precision

pool2 = dist_pool_fixture(2)
pool4 = dist_pool_fixture(4)

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
GPT4 = "gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_TOL = 1e-2
MODEL_TOL = 1e-3  # relative difference of all weights together
GAP_FACTOR, GAP_FLOOR = 2.0, 1e-4  # per tensor: within 2 x (fp32 vs bf16 on one device)


# ------------------------------------------------------------------ the pass alone

class _Net(nn.Module):
    """Linear, LayerNorm, a float made inside forward, an explicit .float(), a float buffer."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 10)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 32))

    def forward(self, x):
        h = self.norm(self.fc1(x)).float()  # a no-op in the fp32 trace: runs in 16 bits
        h = F.gelu(h) * self.gain + torch.ones(32)
        return self.fc2(h)


def _net_reference(net: _Net, x, y, dtype):
    """The same net under the policy, by hand: params, buffer and input cast, loss in fp32."""
    p = {n: t.to(dtype) for n, t in net.named_parameters()}
    h = F.linear(x.to(dtype), p["fc1.weight"], p["fc1.bias"])
    h = F.layer_norm(h, (32,), p["norm.weight"], p["norm.bias"])
    h = F.gelu(h) * net.gain.to(dtype) + torch.ones(32).to(dtype)
    logits = F.linear(h, p["fc2.weight"], p["fc2.bias"])
    return F.cross_entropy(logits.float(), y)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_pass_alone_equals_the_hand_written_policy(precision):
    dtype = DTYPES[precision]
    torch.manual_seed(0)
    net = _Net()
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    traced = trace(net, (x,), loss_fn=F.cross_entropy, example_target=y)
    gm = cast_precision(traced.gm, dtype)
    loss = gm(x, y)
    assert loss.dtype == torch.float32
    loss.backward()
    reference = copy.deepcopy(net)
    ref_loss = _net_reference(reference, x, y, dtype)
    ref_loss.backward()
    assert loss.item() == ref_loss.item()
    for (name, ref_param), target in zip(reference.named_parameters(),
                                        [t for t, p in traced.params.items() if p.is_parameter]):
        param = gm.get_parameter(target)
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, name
        assert torch.equal(param.grad, ref_param.grad), name
    # the model part reads every parameter and the buffer through a 16-bit cast, and the
    # cross-entropy reads fp32 logits
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            assert {u.target for u in node.users} == {torch.ops.aten._to_copy.default}
            assert all(u.kwargs["dtype"] == dtype for u in node.users)
        if node.op == "call_function" and node.meta["autopar"].layer == "loss" and \
                node.meta.get(CAST) is None:
            for arg in node.all_input_nodes:
                if arg.op != "placeholder" and arg.meta["autopar"].dtype.is_floating_point:
                    assert arg.meta["autopar"].dtype == torch.float32, (node, arg)
    # the traced graph itself is left as it was (passes are pure)
    assert all(node.meta.get(CAST) is None for node in traced.gm.graph.nodes)


class _Rotary(nn.Module):
    """Angles from float positions (beyond 256, which bf16 cannot count exactly) and a
    frequency buffer, applied to the activations."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / 100.0 ** (torch.arange(8) / 8))

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device).float()
        angles = pos[:, None] * self.inv_freq
        return self.fc(x * torch.cos(angles))


def test_values_made_from_positions_stay_fp32_until_the_model_reads_them():
    """The angles are computed from exact fp32 positions and cast to bf16 where they meet
    the activations, as a bf16 model's own `.to(x.dtype)` would: not from positions
    rounded to bf16 (which would give positions 257 and 256 the same angle)."""
    torch.manual_seed(0)
    net = _Rotary()
    x = torch.randn(2, 300, 8)
    traced = trace(net, (x,), train=False)
    gm = cast_precision(traced.gm, torch.bfloat16)
    out = gm(x)
    p = {n: t.to(torch.bfloat16) for n, t in net.named_parameters()}
    angles = torch.arange(300).float()[:, None] * net.inv_freq
    ref = F.linear(x.to(torch.bfloat16) * torch.cos(angles).to(torch.bfloat16),
                   p["fc.weight"], p["fc.bias"]).float()
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    wrong = torch.arange(300).to(torch.bfloat16)[:, None] * net.inv_freq.to(torch.bfloat16)
    assert not torch.equal(torch.cos(wrong), torch.cos(angles).to(torch.bfloat16))


def test_a_loss_that_casts_the_logits_to_fp32_trains_in_bf16():
    """A loss written as most training loops write it, `cross_entropy(logits.float(), y)`:
    the traced `.float()` leaves a dtype assert in the loss part, which reads the logits
    cast back to fp32, so the assert keeps fp32 (it was retargeted to bf16 and failed with
    "Tensor dtype mismatch"). The step equals the same loss without the cast."""
    from autopar.models import build

    def cast_loss(logits, target):
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def plain_loss(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    losses = []
    for loss_fn in (cast_loss, plain_loss):
        model, (x,) = build(GPT, batch=2, device="cpu", seed=0)
        engine = autopar.parallelize(model, 1, example_inputs=(x,), plan={"data": 1},
                                     loss_fn=loss_fn, precision="bf16",
                                     optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        losses.append([engine.train_step(x, x.roll(-1, 1)) for _ in range(2)])
    assert losses[0] == losses[1]


def test_inference_returns_the_traced_dtype_and_a_bad_precision_is_refused():
    from autopar.models import build

    model, (x,) = build(GPT, batch=2, device="cpu", seed=0)
    engine = autopar.parallelize(model, 1, example_inputs=(x,), plan={"data": 1},
                                 precision="bf16")
    assert engine.precision == "bf16" and engine.loss_scale == 1.0
    out = engine(x)
    assert out.dtype == torch.float32
    with torch.no_grad():  # within bf16's rounding of the fp32 model's logits
        ref = model(x)
    assert float((out.detach() - ref).norm() / ref.norm()) < 2e-2
    with pytest.raises(PlanError, match=r"^precision must be one of 'fp32', 'bf16', 'fp16', "
                                        r"'fp8', not 'fp4'\.$"):
        autopar.parallelize(model, 1, example_inputs=(x,), precision="fp4")


# ------------------------------------------------------------------ against one device

def _logits(out):
    return getattr(out, "logits", out)


def _reference_step(model, opt, scaler, inputs, target, loss_fn, dtype, max_grad_norm):
    """One step of the policy on one device with plain torch; returns (loss, grad norm)."""
    low = {n: p.to(dtype) for n, p in model.named_parameters(remove_duplicate=False)}
    low.update({n: b.to(dtype) if b.is_floating_point() else b
                for n, b in model.named_buffers(remove_duplicate=False)})
    x = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    out = torch.func.functional_call(model, low, x, tie_weights=False)
    loss = loss_fn(_logits(out).float(), target)
    opt.zero_grad()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.unscale_(opt)
    norm = None
    if max_grad_norm is not None:
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return loss.item(), norm


def compare_precision(name: str, plan, precision: str, steps: int = 5, batch: int = 8,
                      max_grad_norm: float | None = None) -> dict:
    """Train `name` under `plan` at `precision` on this pool's world and the same policy on
    one device (every rank runs both); the largest relative loss and weight differences,
    the first step's bytes measured and predicted, loss scales and grad norms."""
    import torch.distributed as dist
    from equivalence import build, relative

    dtype = DTYPES[precision]
    model, inputs, target, loss_fn = build(name, batch)
    reference, fp32 = copy.deepcopy(model), copy.deepcopy(model)
    opt = functools.partial(torch.optim.SGD, lr=0.2)
    engine = autopar.parallelize(model, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 optimizer=opt, plan=plan, precision=precision,
                                 max_grad_norm=max_grad_norm)
    ref_opt, fp32_opt = opt(reference.parameters()), opt(fp32.parameters())
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    losses, scales, norms, measured, predicted = [], [], [], {}, {}
    for step in range(steps):
        engine.comm_log.clear()
        loss = engine.train_step(inputs, target)
        if step == 0:
            measured = engine.comm_log.totals(phases=("forward", "backward", "step"))
            predicted = engine.predicted_comm(batch)
        ref_loss, ref_norm = _reference_step(reference, ref_opt, scaler, inputs, target,
                                             loss_fn, dtype, max_grad_norm)
        losses.append(abs(loss - ref_loss) / abs(ref_loss))
        fp32_opt.zero_grad()
        loss_fn(fp32(*inputs), target).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(fp32.parameters(), max_grad_norm)
        fp32_opt.step()
        scales.append((engine.loss_scale, scaler.get_scale() if scaler else 1.0))
        norms.append((engine.last_grad_norm, ref_norm))
    full, ref_state, fp32_state = engine.full_state_dict(), reference.state_dict(), \
        fp32.state_dict()
    floats = [k for k in ref_state if ref_state[k].dtype.is_floating_point
              and ref_state[k].norm() > 1e-6]
    flat = lambda state: torch.cat([state[k].reshape(-1) for k in floats])  # noqa: E731
    return {"loss": max(losses), "model": relative(flat(full), flat(ref_state)),
            "weights": {k: (relative(full[k], ref_state[k]), relative(fp32_state[k],
                                                                      ref_state[k]))
                        for k in floats},
            "dtypes": {str(full[k].dtype) for k in floats}, "measured": measured,
            "predicted": predicted, "scales": scales, "norms": norms,
            "skipped": engine.skipped_steps,
            "numel": sum(p.numel() for p in engine.parameters() if p.requires_grad)}


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["loss"] <= LOSS_TOL, r["loss"]
        assert r["model"] <= MODEL_TOL, r["model"]
        for name, (ours, gap) in r["weights"].items():
            assert ours <= GAP_FACTOR * gap + GAP_FLOOR, (name, ours, gap)
        assert r["dtypes"] == {"torch.float32"}  # the masters stay fp32
        assert r["measured"] == r["predicted"]
    assert len({str(r["scales"]) for r in results}) == 1  # every rank alike


@pytest.mark.parametrize("plan", [{"data": 2}, {"tensor": {"size": 2, "mode": "1d"}},
                                  {"sequence": {"size": 2, "mode": "ring"}}],
                         ids=["dp2", "tp2", "cp2-ring"])
def test_bf16_equals_one_device_at_world_2(pool2, plan):
    """(Ring attention passes k, v blocks in bf16 and its dk, dv accumulators in fp32; the
    prediction says so.)"""
    results = pool2.run(compare_precision, GPT, plan, "bf16")
    _check(results)
    for r in results:
        if "data" in plan:  # the gradient all-reduce stays fp32: 4 bytes a parameter, the loss
            assert r["measured"][("all_reduce", "dp")] == 4 * r["numel"] + 4


def test_bf16_halves_tensor_parallel_bytes(pool2):
    """Under 1D tensor parallelism the activations' all-reduces move bf16, half of fp32's
    bytes, and the vocabulary-parallel cross-entropy's three all-reduces of one value per
    token (row max, sum of exponentials, target logit) stay fp32 with the loss."""
    from equivalence import compare

    plan = {"tensor": {"size": 2, "mode": "1d"}}
    fp32 = pool2.run(compare, GPT, plan, 1)
    bf16 = pool2.run(compare_precision, GPT, plan, "bf16", 1)
    loss_bytes = 3 * 8 * 16 * 4  # batch 8 x 16 tokens, fp32
    for full, half in zip(fp32, bf16):
        key = ("all_reduce", "tp")
        assert 2 * half["measured"][key] - full["measured"][key] == loss_bytes


@pytest.mark.parametrize("plan", [
    {"data": 2, "tensor": {"size": 2, "mode": "1d"}, "zero": {"stage": 1}},
    {"data": 2, "tensor": {"size": 2, "mode": "1d"}, "zero": {"stage": 3}},
    {"tensor": {"size": 4, "mode": "2d"}},
], ids=["dp2-tp2-zero1", "dp2-tp2-zero3", "2d"])
def test_bf16_equals_one_device_at_world_4(pool4, plan):
    """(2D broadcasts the bf16 casts of the weights: the casts come before the kernels.)"""
    _check(pool4.run(compare_precision, GPT, plan, "bf16"))


def test_fp16_with_loss_scaling_equals_one_device_at_dp2(pool2):
    results = pool2.run(compare_precision, GPT, {"data": 2}, "fp16")
    _check(results)
    for r in results:
        assert r["skipped"] == 0
        assert all(ours == theirs == 2.0 ** 16 for ours, theirs in r["scales"])


def test_fp16_clipping_acts_on_unscaled_gradients(pool2):
    """The norm each step reports and clips by is the true gradient's (torch's GradScaler
    unscales before clip_grad_norm_ in the reference), not 2**16 times it."""
    limit = 0.05
    results = pool2.run(compare_precision, GPT, {"data": 2}, "fp16", 3, 8, limit)
    _check(results)
    for r in results:
        for ours, theirs in r["norms"]:
            assert theirs > limit  # the limit bites
            assert ours == pytest.approx(theirs, rel=LOSS_TOL)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pipeline_equals_one_device(pool2, precision):
    """The schedule's loss function scales what it differentiates (fp16); the stages pass
    16-bit activations; a tied embedding is cast on each stage that reads it."""
    _check(pool2.run(compare_precision, GPT4, {"pipeline": {"size": 2, "microbatches": 2}},
                     precision, 3))


# ------------------------------------------------------------------ the loss scaler

def _overflow_on_one_rank() -> dict:
    """ZeRO-1 at dp2: rank 0 poisons one element of one gradient with inf, in the piece
    rank 0 owns, so rank 1's own pieces stay finite. Every rank must still skip: weights
    unchanged, scale halved, the step counted as skipped. Then clean steps grow the scale
    after `growth_interval` of them."""
    import torch.distributed as dist
    from equivalence import build

    model, inputs, target, loss_fn = build(GPT, 8)
    engine = autopar.parallelize(model, 2, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, plan={"data": 2, "zero": {"stage": 1}},
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                 precision="fp16")
    engine.train_step(inputs, target)  # builds the training graph
    before = engine.full_state_dict()
    scale = engine.loss_scale
    param = next(p for p in engine.parameters() if p.requires_grad)

    def poison(grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    handle = param.register_hook(poison) if dist.get_rank() == 0 else None
    local_finite, unscale = [], engine.scaler.unscale_

    def spy(grads, sum_over_world):  # whether this rank's own pieces were finite
        local_finite.append(all(bool(torch.isfinite(g).all()) for g in grads))
        return unscale(grads, sum_over_world)

    engine.scaler.unscale_ = spy
    engine.comm_log.clear()
    engine.train_step(inputs, target)
    flags = [r for r in engine.comm_log if r.axis == "world"]
    engine.scaler.unscale_ = unscale
    if handle is not None:
        handle.remove()
    after_skip = engine.full_state_dict()
    unchanged = all(torch.equal(before[k], after_skip[k]) for k in before)
    skipped = (engine.skipped_steps, engine.loss_scale / scale)
    engine.scaler.growth_interval = 3
    scales = []
    for _ in range(3):
        engine.train_step(inputs, target)
        scales.append(engine.loss_scale)
    moved = any(not torch.equal(after_skip[k], v) for k, v in engine.full_state_dict().items())
    return {"unchanged": unchanged, "skipped": skipped, "scales": scales, "moved": moved,
            "flag_bytes": [r.bytes for r in flags], "local_finite": local_finite,
            "start": scale}


def test_a_huge_scale_overflows_in_fp16_and_the_step_is_skipped():
    """Forced to 2**120 the scaled loss is still finite in fp32 (about 7e36), but the fp16
    backward overflows: the step is skipped (weights and optimizer state untouched) and the
    scale halved; the loss reported is the unscaled one."""
    from equivalence import build

    model, inputs, target, loss_fn = build(GPT, 8)
    engine = autopar.parallelize(model, 1, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, plan={"data": 1}, precision="fp16",
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    engine.scaler.scale = 2.0 ** 120
    before = engine.full_state_dict()
    loss = engine.train_step(inputs, target)
    assert 0 < loss < 10  # unscaled: cross-entropy over 64 classes starts near log(64)
    assert engine.skipped_steps == 1 and engine.loss_scale == 2.0 ** 119
    assert not engine.optimizer.state  # AdamW never stepped
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in engine.parameters())


def test_an_overflow_on_one_rank_skips_the_step_everywhere(pool2):
    results = pool2.run(_overflow_on_one_rank)
    # rank 1's pieces were finite: only the flag summed over the world makes it skip
    assert [r["local_finite"] for r in results] == [[False], [True]]
    for r in results:
        assert r["unchanged"], r  # no rank stepped, ZeRO pieces included
        assert r["skipped"] == (1, 0.5), r
        assert r["flag_bytes"] == [4], r  # one float32 flag over the world
        half = r["start"] / 2
        assert r["scales"] == [half, half, 2 * half], r  # doubled after 3 good steps
        assert r["moved"], r
    assert results[0]["scales"] == results[1]["scales"]


def _zero3_bf16_gathers() -> dict:
    """ZeRO-3 under bf16, after a step: bytes of one forward's gathers and of the layers
    the backward gathered again (which it does only if the weights the linears save are
    the gathered bf16 buffers, not copies kept whole to the backward)."""
    import torch.distributed as dist
    from equivalence import build

    model, inputs, target, loss_fn = build(GPT, 8)
    engine = autopar.parallelize(model, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                 plan={"data": 2, "zero": {"stage": 3}}, precision="bf16")
    engine.comm_log.clear()
    engine.train_step(inputs, target)
    zero = engine.zero
    return {"gather_dtype": str(zero.gather_dtype),
            "forward": sum(zero.gather_bytes(u) for u in engine.train_units),
            "fp32_forward": sum(zero.unit_bytes(u) for u in engine.train_units),
            "regathered": len(zero.backward_gathers),
            "measured": engine.comm_log.totals(phases=("forward", "backward"))}


def test_zero3_gathers_bf16_layers_and_gathers_them_again_for_the_backward(pool2):
    """Under bf16 ZeRO-3 gathers each layer in bf16 (half the bytes) and the graph's cast
    of a gathered weight is dropped, so what the backward needs is gathered again rather
    than kept: the memory of ZeRO-3 holds under mixed precision."""
    for r in pool2.run(_zero3_bf16_gathers):
        assert r["gather_dtype"] == "torch.bfloat16", r
        assert 2 * r["forward"] == r["fp32_forward"], r
        assert r["regathered"] > 0, r
        assert r["measured"][("all_gather", "dp")] > r["forward"], r

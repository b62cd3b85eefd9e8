"""fp32 master weights for a bf16 model (autopar.runtime.master): a model whose parameters are
bf16 (what `--dtype bf16` traces, or `model.to(torch.bfloat16)`) is planned at 2 + 2 bytes of
weights and gradients and 4 + 8 of fp32 master and moments a parameter
(`autopar.cost.precision.precision_of`), and the engine holds exactly that per rank under
every ZeRO stage: bf16 parameters and gradients, the optimizer's fp32 master and moments
sharded over dp as the stage says.

The reference is one device running the same scheme with plain torch: the bf16 model's
forward and backward, each bf16 gradient cast to fp32 for an AdamW over fp32 copies of the
parameters, the updated copies written back to the bf16 parameters. On one device the engine
gives that reference's losses, bf16 weights and fp32 masters bit for bit.

Tolerances at dp 2. Each rank's gradient is its half batch's, rounded to bf16, and the two
are added in bf16 (one more rounding, 2**-9 relative) before the mean, where one device
rounds the whole batch's once: the gradients differ by bf16 roundings. AdamW divides each
gradient by its running magnitude, so a rounding difference in an element can move that
element's master by up to about lr per step in either direction: over `STEPS` steps the
masters may differ by 2 x lr x STEPS absolutely per element (each run moves at most ~lr a
step; torch's AdamW step is lr x m_hat / (sqrt(v_hat) + eps), whose size is <= lr for
gradients of steady sign and rarely a few lr). That is the per-element bound; over the whole
model the relative difference of the masters stays within 1e-3 and the bf16 weights, which
are the masters rounded, within 2e-3 (2**-9 of rounding on top). Losses are bf16 values
(the loss part runs in the traced dtype), 8 significant bits: within 2**-7 relative (two
roundings of the loss and one of the logits). The ZeRO stages at dp 2 reduce the same two
bf16 gradients (a + b rounds alike in either order), so ZeRO-1's and ZeRO-2's masters equal
ZeRO-0's to fp32 (1e-4 relative): there the reduction order allows it. ZeRO-3 reduces each
layer's gradients as its backward makes them and adds a weight two layers read (the tied
embedding) in its bf16 piece, a different order of bf16 additions, so it is held to the
one-device bounds only.
"""

import copy
import functools

import pytest
import torch
from distributed import dist_pool_fixture

import autopar

pool2 = dist_pool_fixture(2)

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
LR, STEPS, BATCH = 1e-3, 4, 8
LOSS_TOL = 2.0 ** -7
MASTER_TOL, WEIGHT_TOL = 1e-3, 2e-3


def _bf16_model(batch: int = BATCH):
    from equivalence import build

    model, inputs, target, loss_fn = build(GPT, batch)
    return model.to(torch.bfloat16), inputs, target, loss_fn


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


class _Reference:
    """One device, plain torch: bf16 model, fp32 masters stepped by AdamW, written back."""

    def __init__(self, model, factory=_adamw):
        self.model = copy.deepcopy(model)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.masters = [p.detach().float().clone().requires_grad_()
                        for p in self.model.parameters()]
        self.opt = factory(self.masters)

    def step(self, inputs, target, loss_fn) -> float:
        for p in self.model.parameters():
            p.grad = None
        loss = loss_fn(self.model(*inputs), target)
        loss.backward()
        for p, m in zip(self.model.parameters(), self.masters):
            m.grad = p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.masters):
                p.copy_(m)
        return loss.item()

    def master_state(self) -> dict[str, torch.Tensor]:
        return {n: m.detach() for n, m in zip(self.names, self.masters)}


def _plan(model, inputs, target, loss_fn, world: int, zero: int):
    from autopar.world import World

    constraints = {"dp": world, "tp": 1, "pp": 1, "zero": zero, "offload": False,
                   "recompute": "none"}
    return autopar.plan(model, tuple(t[:2] for t in inputs), World(world, device="cpu"),
                        global_batch=BATCH, constraints=constraints, loss_fn=loss_fn,
                        example_target=target[:2])


def _engine(model, inputs, loss_fn, world: int, plan):
    return autopar.parallelize(model, world, example_inputs=tuple(t[:2] for t in inputs),
                               loss_fn=loss_fn, plan=plan, precision="bf16", optimizer=_adamw)


def _masters(engine, path) -> dict[str, torch.Tensor]:
    """The whole fp32 masters, read back from a checkpoint of the engine."""
    from autopar.runtime.checkpoint import load_full_optimizer_state

    engine.save(path)
    return {k: v["master"] for k, v in load_full_optimizer_state(path).items()}


def _relative(a: dict, b: dict) -> float:
    keys = sorted(b)
    x = torch.cat([a[k].float().reshape(-1) for k in keys])
    y = torch.cat([b[k].float().reshape(-1) for k in keys])
    return float((x - y).norm() / y.norm())


# ------------------------------------------------------------------ what a rank holds

def _held(zero: int) -> dict:
    """This rank's state bytes after a step of a bf16 model under ZeRO `zero` at dp 2, beside
    the plan's, and the dtypes and sizes of what it holds."""
    import torch.distributed as dist

    from autopar.runtime.measure import measure_state_bytes

    model, inputs, target, loss_fn = _bf16_model()
    world = dist.get_world_size()
    plan = _plan(model, inputs, target, loss_fn, world, zero)
    engine = _engine(model, inputs, loss_fn, world, plan)
    engine.comm_log.clear()
    measured = measure_state_bytes(engine, lambda: engine.train_step(inputs, target))
    comm = engine.comm_log.totals(phases=("forward", "backward", "step"))
    state = [(k, v) for per in engine.optimizer.state.values() for k, v in per.items()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    held = [s for s in engine.zero.shards] if engine.zero is not None else \
        list(engine.parameters())
    return {"predicted": plan.predicted["memory_breakdown_bytes"],
            "precision": plan.search["precision"],
            "parameter_bytes": sum(h for h, _ in engine.parameter_bytes().values()),
            "pieces": sum(p.numel() * p.element_size() for p in held),
            "measured": measured.to_json(),
            "state": sum(v.numel() * v.element_size() for _, v in state),
            "state_dtypes": sorted({(k, str(v.dtype)) for k, v in state}),
            "param_dtypes": {str(p.dtype) for p in engine.parameters()},
            "master_numel": sum(v.numel() for k, v in state if k == "master"),
            "piece_numel": sum(p.numel() for p in held),
            "comm": comm, "predicted_comm": engine.predicted_comm(BATCH)}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_bf16_plan_holds_what_it_prices_per_rank(pool2, zero):
    """Before: the engine held bf16 moments and no master (4 bytes a parameter of optimizer
    state where the plan priced 12)."""
    for r in pool2.run(_held, zero):
        p = r["predicted"]
        assert r["precision"]["weights"] == 2 and r["precision"]["master"] == 4, r
        assert r["param_dtypes"] == {"torch.bfloat16"}, r
        assert r["state_dtypes"] == [("exp_avg", "torch.float32"),
                                     ("exp_avg_sq", "torch.float32"),
                                     ("master", "torch.float32")], r
        # the master (and the moments with it) is sharded exactly as the optimizer's pieces
        assert r["master_numel"] == r["piece_numel"], r
        assert r["state"] == p["optimizer"], r  # fp32 master + moments, 12 bytes a piece
        assert r["measured"]["gradients"] == p["gradients"], r
        assert r["measured"]["parameters"] == p["parameters"], r
        if zero < 3:  # (under ZeRO-3 parameter_bytes gives the slices the layers gather)
            assert r["parameter_bytes"] == p["parameters"], r
        else:
            assert r["pieces"] == p["parameters"] < r["parameter_bytes"], r
        assert r["comm"] == r["predicted_comm"], r  # bf16 gradients reduced as priced


# ------------------------------------------------------------------ against one device

def test_one_device_equals_the_plain_torch_scheme_bit_for_bit(tmp_path):
    model, inputs, target, loss_fn = _bf16_model()
    reference = _Reference(model)
    engine = _engine(model, inputs, loss_fn, 1, {"data": 1})
    for _ in range(STEPS):
        assert engine.train_step(inputs, target) == reference.step(inputs, target, loss_fn)
    full, ref = engine.full_state_dict(), reference.model.state_dict()
    assert all(torch.equal(full[k], ref[k]) for k in ref)
    masters = _masters(engine, tmp_path / "ckpt")
    assert all(torch.equal(masters[k], v) for k, v in reference.master_state().items())


def _train(zero: int, path: str) -> dict:
    """Train the bf16 model under ZeRO `zero` at dp 2 and the plain-torch scheme on one
    device; losses, bf16 weights and fp32 masters of both."""
    import torch.distributed as dist

    model, inputs, target, loss_fn = _bf16_model()
    reference = _Reference(model)
    plan = {"data": dist.get_world_size(), "zero": {"stage": zero}}
    engine = _engine(model, inputs, loss_fn, dist.get_world_size(), plan)
    losses = [(engine.train_step(inputs, target), reference.step(inputs, target, loss_fn))
              for _ in range(STEPS)]
    return {"losses": losses, "weights": engine.full_state_dict(),
            "ref_weights": reference.model.state_dict(), "masters": _masters(engine, path),
            "ref_masters": reference.master_state()}


def test_dp2_trains_equal_to_one_device_under_every_zero_stage(pool2, tmp_path):
    runs = {z: pool2.run(_train, z, str(tmp_path / f"zero{z}"))[0] for z in (0, 1, 2, 3)}
    for z, r in runs.items():
        for ours, theirs in r["losses"]:
            assert abs(ours - theirs) <= LOSS_TOL * abs(theirs), (z, r["losses"])
        assert _relative(r["masters"], r["ref_masters"]) <= MASTER_TOL, z
        assert _relative(r["weights"], r["ref_weights"]) <= WEIGHT_TOL, z
        for k, m in r["masters"].items():
            assert float((m - r["ref_masters"][k]).abs().max()) <= 2 * LR * STEPS, (z, k)
        if z in (1, 2):  # the same two bf16 gradients reduced: masters equal ZeRO-0's
            assert _relative(r["masters"], runs[0]["masters"]) <= 1e-4, z
        assert all(m.dtype == torch.float32 for m in r["masters"].values())


def _lamb(zero: int, path: str) -> dict:
    """A bf16 model stepped by autopar.optim's LAMB under ZeRO `zero` at dp 2 (the ranks
    hold pieces, whose trust ratios need the whole parameters' norms), and plain torch on
    one device; masters of both, and the comm log beside the plan's."""
    import torch.distributed as dist

    from autopar.optim import LAMB

    factory = functools.partial(LAMB, lr=LR, weight_decay=0.01)
    model, inputs, target, loss_fn = _bf16_model()
    reference = _Reference(model, factory)
    plan = {"data": dist.get_world_size(), "zero": {"stage": zero}}
    engine = autopar.parallelize(model, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 plan=plan, precision="bf16", optimizer=factory)
    engine.comm_log.clear()
    for _ in range(STEPS):
        engine.train_step(inputs, target)
        reference.step(inputs, target, loss_fn)
    comm = engine.comm_log.totals(phases=("forward", "backward", "step"))
    return {"comm": comm, "predicted": {k: v * STEPS
                                        for k, v in engine.predicted_comm(BATCH).items()},
            "masters": _masters(engine, path),
            "ref_masters": reference.master_state()}


def test_lamb_on_a_bf16_model_takes_the_whole_parameters_norms(pool2, tmp_path):
    """The engine gives LAMB the whole parameters' norms through the masters' optimizer:
    its norm all-reduces run as priced, and the masters follow one device's."""
    r = pool2.run(_lamb, 1, str(tmp_path / "lamb"))[0]
    assert r["comm"] == r["predicted"]
    assert _relative(r["masters"], r["ref_masters"]) <= MASTER_TOL


# ------------------------------------------------------------------ checkpoints

def _resume(zero: int, path: str) -> dict:
    """Two steps, save, two more; then a fresh engine loads the save and runs the same two:
    losses, bf16 weights and fp32 masters of both continuations."""
    import torch.distributed as dist

    model, inputs, target, loss_fn = _bf16_model()
    fresh = copy.deepcopy(model)
    world = dist.get_world_size()
    plan = {"data": world, "zero": {"stage": zero}}
    engine = _engine(model, inputs, loss_fn, world, plan)
    for _ in range(2):
        engine.train_step(inputs, target)
    engine.save(path + "/run")
    first = [engine.train_step(inputs, target) for _ in range(2)]
    again = _engine(fresh, inputs, loss_fn, world, plan)
    again.load(path + "/run")
    second = [again.train_step(inputs, target) for _ in range(2)]
    return {"losses": (first, second),
            "weights": (engine.full_state_dict(), again.full_state_dict()),
            "masters": (_masters(engine, path + "/a"), _masters(again, path + "/b"))}


@pytest.mark.parametrize("zero", [1, 3])
def test_a_checkpoint_resumes_the_masters_bit_for_bit(pool2, tmp_path, zero):
    for r in pool2.run(_resume, zero, str(tmp_path)):
        first, second = r["losses"]
        assert first == second
        for a, b in (r["weights"], r["masters"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_fp32_model_keeps_its_own_optimizer():
    """fp32 parameters are their own masters: the factory's optimizer as it is."""
    from equivalence import build

    model, inputs, target, loss_fn = build(GPT, BATCH)
    engine = autopar.parallelize(model, 1, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, plan={"data": 1}, precision="bf16",
                                 optimizer=functools.partial(torch.optim.AdamW, lr=LR))
    engine.train_step(inputs, target)
    assert type(engine.optimizer) is torch.optim.AdamW
    assert all("master" not in s for s in engine.optimizer.state.values())


# ------------------------------------------------------------------ fp8's scaling recipe

def _fp8_tp2(recipe: str) -> dict:
    """A bf16 GPT-2 planned and run at fp8 with `recipe` over tp 2: the plan's tp bytes and
    amax effect, and the bytes the step's comm log holds."""
    from test_fp8_runtime import hf_gpt2

    from autopar.world import World

    model, inputs, target, loss_fn = hf_gpt2(BATCH)
    model = model.to(torch.bfloat16)
    small = tuple(t[:2] for t in inputs)
    constraints = {"tp": 2, "dp": 1, "pp": 1, "tp_mode": "1d", "sp": "none",
                   "recompute": "none", "zero": 0}
    plan = autopar.plan(model, small, World(2, per_node=2, device="h100-80gb"),
                        global_batch=BATCH, loss_fn=loss_fn, example_target=target[:2],
                        precision="fp8", fp8_recipe=recipe, constraints=constraints)
    engine = autopar.parallelize(model, 2, example_inputs=small, loss_fn=loss_fn, plan=plan,
                                 precision="fp8", fp8_recipe=recipe,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    engine.train_step(inputs, target)
    engine.comm_log.clear()
    engine.train_step(inputs, target)
    return {"planned": plan.detail["comm_by_axis"]["tp"]["bytes"],
            "per_device": plan.predicted["comm_bytes_per_device"],
            "measured": engine.comm_log.totals(phases=("forward", "backward", "step")),
            "effects": {e["effect"] for e in plan.detail["effects"]},
            "recipe": plan.search["fp8_recipe"]}


def test_the_rowwise_fp8_plan_prices_the_tp_bytes_the_runtime_sends(pool2):
    """Rowwise scales come from each rank's piece of a row, so no amax is all-reduced over
    tp: the plan prices none (it priced tensorwise's), and its tp bytes are the comm log's
    (at tp 2 a ring all-reduce sends its tensor's bytes once; the cross-entropy's three
    statistics per token travel in fp32 whatever the logits' dtype). Tensorwise prices
    its amaxes on top."""
    rowwise, tensorwise = pool2.run(_fp8_tp2, "rowwise")[0], pool2.run(_fp8_tp2, "tensorwise")[0]
    assert rowwise["recipe"] == "rowwise" and tensorwise["recipe"] == "tensorwise"
    assert rowwise["measured"] == {("all_reduce", "tp"): rowwise["planned"]}
    assert rowwise["per_device"] == rowwise["planned"]
    assert "fp8 amax all-reduce (tp)" not in rowwise["effects"]
    assert "fp8 amax all-reduce (tp)" in tensorwise["effects"]
    assert tensorwise["planned"] > rowwise["planned"]

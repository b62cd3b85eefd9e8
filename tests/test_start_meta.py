"""Starting from the meta device at world 2 (gloo): a zoo model built on meta gets, on every
rank, only its own slices of the values one device gets from the same construction under
the same seed; trained, its losses equal the single-device run; while the slices are made
a rank holds less than the whole model (under ZeRO-3 its pieces, not its whole slices)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

pool2 = dist_pool_fixture(2)

SPEC = "gpt-tiny"
PLANS = {"tensor": {"tensor": {"size": 2, "mode": "1d"}},
         "zero3": {"data": 2, "zero": {"stage": 3}},
         "pipeline": {"pipeline": {"size": 2, "schedule": "1f1b", "microbatches": 2}}}


def _loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


class _LiveBytes(TorchDispatchMode):
    """The most bytes of real (non-meta) storage made under it and alive at once."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                s = t.untyped_storage()
                self.storages.setdefault(StorageWeakRef(s).cdata, (StorageWeakRef(s), s.nbytes()))
        self.storages = {k: v for k, v in self.storages.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.storages.values()))
        return out


def _held_bytes(engine) -> int:
    """Bytes of real storage behind this rank's parameters (placeholders hold one element)."""
    storages = {StorageWeakRef(p.untyped_storage()).cdata: p.untyped_storage().nbytes()
                for p in engine.parameters()}
    return sum(storages.values())


def _start_from_meta(plan: dict, seed: int, steps: int = 3, check_start: bool = True) -> dict:
    """Start `plan` from meta beside the seeded single-device build; `check_start`: compare
    the whole state right after parallelize (a pipeline then makes every slice)."""
    import autopar
    from autopar.models import build
    from autopar.runtime import startup

    reference, (x,) = build(SPEC, batch=8, device="cpu", seed=seed)
    meta, _ = build(SPEC, batch=8)
    assert all(p.is_meta for p in meta.parameters())
    target = torch.randint(0, reference.config.vocab_size, x.shape,
                           generator=torch.Generator().manual_seed(1))
    opt = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)
    live, slices = _LiveBytes(), startup.Startup.slices

    def counted(self, *args, **kwargs):
        with live:
            return slices(self, *args, **kwargs)

    startup.Startup.slices = counted
    try:
        engine = autopar.parallelize(meta, 2, example_inputs=(x[:2],), loss_fn=_loss,
                                     optimizer=opt, plan=plan, seed=seed)
        held = {"start": _held_bytes(engine)}
        ref_state = reference.state_dict()
        full = engine.full_state_dict() if check_start else ref_state
        differ = [k for k in ref_state if not torch.equal(full[k], ref_state[k])]
        first = engine.train_step(x, target)  # a pipeline cuts its stages here
        held["step"] = _held_bytes(engine)
    finally:
        startup.Startup.slices = slices
    ref_opt = opt(reference.parameters())
    losses = []
    for i in range(steps):
        loss = first if i == 0 else engine.train_step(x, target)
        ref_opt.zero_grad()
        ref_loss = _loss(reference(x), target)
        ref_loss.backward()
        ref_opt.step()
        losses.append(abs(loss - ref_loss.item()) / ref_loss.item())
    return {"keys": sorted(full) == sorted(ref_state), "differ": differ,
            "loss": max(losses), "peak": live.peak, "zero": type(engine.zero).__name__,
            "held": held, "mine": engine.pipeline_layers() if engine.pipeline else None,
            "model": sum(t.numel() * t.element_size() for t in ref_state.values())}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_meta_start_equals_the_seeded_single_device_build(pool2, plan):
    for r in pool2.run(_start_from_meta, PLANS[plan], 5):
        assert r["keys"] and r["differ"] == []
        assert r["loss"] < 1e-5, r["loss"]
        # a rank's half (its tp slices or ZeRO-3 pieces) plus one module's full values;
        # (a pipeline rank asked for the whole state before its first step makes it all)
        assert 0 < r["peak"] < r["model"] or plan == "pipeline", (r["peak"], r["model"])


def test_a_pipeline_rank_makes_only_its_own_stages_slices(pool2):
    """Started from meta under pp 2, a rank holds no parameter's values after parallelize
    and only its stages' once the first step has cut them; it trains as one device does."""
    first, last = pool2.run(_start_from_meta, PLANS["pipeline"], 5, 3, False)
    for r in (first, last):
        assert r["loss"] < 1e-5, r["loss"]
        assert r["held"]["start"] < 0.01 * r["model"], r["held"]
        # its stages' slices (the tied embedding on both ends): well under the whole model
        assert 0 < r["held"]["step"] < 0.75 * r["model"], (r["held"], r["model"])
        # what it made at once: its stages' slices plus one module's full values
        assert r["peak"] < 0.75 * r["model"], (r["peak"], r["model"])
    assert not first["mine"] & last["mine"]


def test_weights_replace_a_real_models_values_and_export_keeps_the_last_on_failure(
        tmp_path, monkeypatch):
    """weights= given with a model built on the CPU: the engine starts from the weights;
    an export that fails midway raises on every rank and leaves the previous one whole."""
    import autopar
    from autopar.errors import WeightsError
    from autopar.models import build
    from autopar.runtime import export
    from autopar.runtime.weights import open_weights

    model, (x,) = build(SPEC, batch=4, device="cpu", seed=0)
    other, _ = build(SPEC, batch=4, device="cpu", seed=1)
    stored = other.state_dict()
    engine = autopar.parallelize(model, 1, example_inputs=(x,), loss_fn=_loss,
                                 weights=stored)
    full = engine.full_state_dict()
    assert [k for k in stored if not torch.equal(full[k], stored[k])] == []
    out = tmp_path / "export"
    engine.export(out, max_shard_bytes=100_000)
    first = sorted(p.name for p in out.iterdir())
    assert len(first) > 2  # several shards and the index
    with open_weights(out) as source:
        assert all(torch.equal(source.read(k), full[k]) for k in source.keys())

    def broken(self, name, tensor):
        raise OSError("disk full")

    monkeypatch.setattr(export.SafetensorsWriter, "add", broken)
    with pytest.raises(WeightsError, match="disk full"):
        engine.export(out)
    assert sorted(p.name for p in out.iterdir()) == first


def test_a_meta_model_starts_from_an_autopar_checkpoint(tmp_path):
    """weights= an engine.save directory: the trained weights, read through DCP."""
    import autopar
    from autopar.models import build

    model, (x,) = build(SPEC, batch=4, device="cpu", seed=2)
    engine = autopar.parallelize(model, 1, example_inputs=(x,), loss_fn=_loss,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    engine.train_step(x, x.roll(-1, 1))
    engine.save(tmp_path / "ckpt")
    meta, _ = build(SPEC, batch=4)
    started = autopar.parallelize(meta, 1, example_inputs=(x,), loss_fn=_loss,
                                  weights=tmp_path / "ckpt")
    saved, full = engine.full_state_dict(), started.full_state_dict()
    assert sorted(saved) == sorted(full)
    assert [k for k in saved if not torch.equal(saved[k], full[k])] == []

"""Distributed checkpoints (`autopar.runtime.checkpoint`, `Engine.save` / `Engine.load`).

A checkpoint written under one plan and world is loaded under another: the loaded
weights and optimizer states are exactly the saved ones (saved again straight after the
load, every whole tensor is bit-equal), they equal a single-device run's at the saving
step (fp32, within 1e-5), and training continued from them gives the losses and final
weights of an uninterrupted single-device run. Plans: 1D, 2D, data parallelism, ZeRO 1, 2
and 3 (pieces of tensor-parallel slices too) and pipelines (whose optimizer exists only
after the first step). The boxes each rank writes are checked against `local_slice` for
every layout kind. Saves are atomic (a save that fails half way leaves `latest` and the
last good checkpoint as they were), keep the newest two, and a checkpoint's weights load
into the original model. tests/kill_train.py is a training script that kills one of its
ranks under torchrun and resumes from the last checkpoint.
"""

import functools
import json
import os

import pytest
import torch
from equivalence import build
from pretraced import forked_pool_fixture

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
BATCH = 8

# each world forked from the test process once it traced GPT (tests/pretraced.py)
pool2 = forked_pool_fixture(2, [GPT])
pool4 = forked_pool_fixture(4, [GPT])


def _batch(step: int):
    """The global batch of a training step, the same for every run that reaches it."""
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, 64, (BATCH, 16), generator=gen),
            torch.randint(0, 64, (BATCH, 16), generator=gen))


def _engine(name: str, plan, seed: int = 0):
    import torch.distributed as dist

    import autopar

    model, inputs, _, loss_fn = build(name, BATCH, seed=seed)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return autopar.parallelize(model, world, example_inputs=tuple(t[:2] for t in inputs),
                               loss_fn=loss_fn, plan=plan,
                               optimizer=functools.partial(torch.optim.AdamW, lr=1e-3,
                                                           eps=1e-5))


def _train_and_save(name: str, plan, steps: int, root: str) -> dict:
    engine = _engine(name, plan)
    losses = [engine.train_step(*_batch(s)) for s in range(steps)]
    published = engine.save(root)
    return {"losses": losses, "published": published, "steps": engine.steps}


def _load_and_continue(name: str, plan, root: str, steps: int, resaved: str) -> dict:
    """Load into an engine built from other weights, save again at once (the round trip
    through this plan), then train on from the loaded step."""
    engine = _engine(name, plan, seed=1)
    logged = len(engine.comm_log)
    loaded = engine.load(root)
    start = engine.steps
    engine.save(resaved)
    logged = len(engine.comm_log) - logged  # DCP's own collectives: not training traffic
    losses = [engine.train_step(*_batch(s)) for s in range(start, start + steps)]
    return {"loaded": loaded, "start": start, "losses": losses, "logged": logged,
            "full": engine.full_state_dict()}


def _reference(name: str, steps: int) -> list[dict]:
    """One device, uninterrupted: after each step, the loss, the weights and the AdamW state
    per parameter name."""
    model, _, _, loss_fn = build(name, BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for s in range(steps):
        x, y = _batch(s)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        out.append({"loss": loss.item(),
                    "weights": {k: v.clone() for k, v in model.state_dict().items()},
                    "optimizer": {names[id(p)]: {k: v.clone() for k, v in st.items()}
                                  for p, st in opt.state.items()}})
    return out


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> bool:
    """fp32 agreement: relative in norm, absolute for tensors that hold only rounding
    noise (a key bias, whose exact gradient is 0; see tests/equivalence.py)."""
    a, b = a.double(), b.double()
    if b.norm() < 1e-6:
        return float((a - b).abs().max()) <= 1e-8
    return float((a - b).norm() / b.norm()) <= rtol


def _check_against_reference(root: str, ref: dict) -> None:
    """The checkpoint's whole weights and optimizer states equal one device's."""
    from autopar.runtime.checkpoint import load_full_optimizer_state, load_full_state_dict

    weights = load_full_state_dict(root)
    assert list(weights) == list(ref["weights"])
    for k, v in ref["weights"].items():
        assert v.shape == weights[k].shape and _close(weights[k], v), k
    state = load_full_optimizer_state(root)
    assert set(state) == set(ref["optimizer"])
    for name, per in ref["optimizer"].items():
        assert set(state[name]) == set(per), name
        for key, v in per.items():
            assert _close(state[name][key], v), (name, key)


def _assert_same_checkpoint(a: str, b: str) -> None:
    """Every whole tensor of two checkpoints is bit-equal (max abs difference 0)."""
    from autopar.runtime.checkpoint import load_full_optimizer_state, load_full_state_dict

    wa, wb = load_full_state_dict(a), load_full_state_dict(b)
    assert list(wa) == list(wb)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = load_full_optimizer_state(a), load_full_optimizer_state(b)
    assert set(sa) == set(sb)
    for name in sa:
        assert set(sa[name]) == set(sb[name])
        for key, v in sa[name].items():
            assert torch.equal(v, sb[name][key]) if isinstance(v, torch.Tensor) \
                else v == sb[name][key], (name, key)


def _reshard(tmp_path, save_pool, save_plan, load_pool, load_plan, name=GPT,
             before: int = 2, after: int = 1) -> None:
    """Train `before` steps under one plan and save; load under another, save again, train
    `after` more: states, losses and final weights as one uninterrupted device (the step
    after the load runs on the loaded AdamW moments, a wrong one moves every weight)."""
    root, resaved = str(tmp_path / "ckpt"), str(tmp_path / "resaved")
    ref = _reference(name, before + after)
    saved = save_pool.run(_train_and_save, name, save_plan, before, root)
    for r in saved:
        assert r["published"] == os.path.join(root, f"step-{before:08d}")
        for got, want in zip(r["losses"], ref):
            assert abs(got - want["loss"]) <= 1e-5 * abs(want["loss"])
    assert open(os.path.join(root, "latest")).read().strip() == f"step-{before:08d}"
    _check_against_reference(root, ref[before - 1])
    meta = json.load(open(os.path.join(root, f"step-{before:08d}", "autopar.json")))
    assert meta["step"] == before and meta["world"] == save_pool.world_size
    loaded = load_pool.run(_load_and_continue, name, load_plan, root, after, resaved)
    _assert_same_checkpoint(root, resaved)
    for r in loaded:
        assert r["start"] == before and r["logged"] == 0
        assert r["loaded"] == os.path.join(root, f"step-{before:08d}")
        for got, want in zip(r["losses"], ref[before:]):
            assert abs(got - want["loss"]) <= 1e-5 * abs(want["loss"]), (got, want["loss"])
        final = ref[-1]["weights"]
        assert list(r["full"]) == list(final)
        for k, v in final.items():
            assert _close(r["full"][k], v), k


def test_tensor4_checkpoint_loads_under_data2(tmp_path, pool4, pool2):
    _reshard(tmp_path, pool4, {"tensor": {"size": 4, "mode": "1d"}}, pool2, {"data": 2})


def test_2d_checkpoint_loads_under_1d_tensor2(tmp_path, pool4, pool2):
    _reshard(tmp_path, pool4, {"tensor": {"size": 4, "mode": "2d"}},
             pool2, {"tensor": {"size": 2, "mode": "1d"}})


def test_zero1_pieces_of_tensor_slices_load_under_zero2(tmp_path, pool4, pool2):
    """ZeRO-1 over dp 2 of 1D slices over tp 2: each rank writes a flat piece of its slice;
    read back as the pieces of whole tensors of ZeRO-2 over dp 2."""
    _reshard(tmp_path, pool4, {"data": 2, "tensor": {"size": 2, "mode": "1d"},
                               "zero": {"stage": 1}},
             pool2, {"data": 2, "zero": {"stage": 2}})


def test_zero_checkpoint_loads_under_tensor_parallelism(tmp_path, pool4, pool2):
    _reshard(tmp_path, pool4, {"data": 4, "zero": {"stage": 1}},
             pool2, {"tensor": {"size": 2, "mode": "1d"}})


def test_pipeline_with_zero_pieces_loads_into_a_pipeline_of_whole_slices(tmp_path, pool4,
                                                                         pool2):
    """Each pipeline rank writes the weights and states of its stages (from its ZeRO
    pieces); a pipeline rank builds its optimizer for its stages at the first step, so
    the state loaded before then is held and handed over there."""
    _reshard(tmp_path, pool4, {"pipeline": {"size": 2, "microbatches": 2}, "data": 2,
                               "zero": {"stage": 1}},
             pool2, {"pipeline": {"size": 2, "microbatches": 2}})


def test_pipeline_checkpoint_loads_into_zero_pieces_of_a_pipeline(tmp_path, pool2, pool4):
    """The held state is cut to the ZeRO pieces the pipeline's optimizer is built for."""
    _reshard(tmp_path, pool2, {"pipeline": {"size": 2, "microbatches": 2}},
             pool4, {"pipeline": {"size": 2, "microbatches": 2}, "data": 2,
                     "zero": {"stage": 2}})


def _boxes_hold(full, region) -> bool:
    """Every box of a region is the whole tensor's values at its offsets."""
    return all(torch.equal(full[tuple(slice(o, o + n) for o, n in zip(off, v.shape))], v)
               for off, v in region.boxes)


def test_boxes_are_what_local_slice_cuts():
    """The boxes a rank writes are exactly the elements `local_slice` gives it: 1D with
    blocks (fused QKV), 2D and 3D composites cut component by component, and the flat
    ZeRO pieces of each slice at dp 2, 3 and 4."""
    import itertools
    import math

    from autopar.passes.tensor_parallel import local_slice
    from autopar.runtime import regions as ck
    from autopar.sharding.axes import TensorMesh
    from autopar.sharding.layout import Layout, Shard

    cases = [(TensorMesh.one_d("tp", 4), Layout(2, (Shard(0, "tp", 3),)), (24, 5)),
             (TensorMesh.one_d("tp", 4), Layout(2, (Shard(1, "tp"),)), (3, 8)),
             (TensorMesh.one_d("tp", 4), None, (3, 7))]
    m2, m3 = TensorMesh.for_mode("2d", 4), TensorMesh.for_mode("3d", 8)
    cases += [(m2, Layout(2, (Shard(1, ax, 3),)), (4, 24)) for ax in m2.axes]
    cases += [(m2, Layout(2, (Shard(0, "tp_i"), Shard(1, "tp_j"))), (4, 6))]
    cases += [(m3, Layout(2, (Shard(0, a), Shard(1, b))), (8, 16))
              for a, b in itertools.permutations(m3.axes, 2) if not m3.overlap(a, b)]
    for mesh, layout, shape in cases:
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        for index in itertools.product(*[range(n) for _, n in mesh.dims]):
            coords = dict(zip(mesh.physical, index))
            local = local_slice(full, layout, coords, mesh)
            runs = ck.slice_runs(layout, mesh, coords, shape)
            assert ck.whole_shape(local.shape, layout, mesh) == shape
            region = ck.slice_region(local, runs, shape)
            assert sum(v.numel() for _, v in region.boxes) == local.numel()
            assert _boxes_hold(full, region), (layout, coords)
            for dp in (2, 3, 4):
                k = -(-local.numel() // dp)
                for r in range(dp):
                    piece = local.reshape(-1)[r * k:r * k + k]
                    region = ck.piece_region(piece, r * k, tuple(local.shape), runs, shape)
                    assert sum(v.numel() for _, v in region.boxes) == piece.numel()
                    assert _boxes_hold(full, region), (layout, coords, dp, r)


def _crash_mid_save(root: str) -> dict:
    """Save at step 1, then at step 2 with DCP's final metadata write failing (the data
    files are written, the checkpoint is not), then with the pointer update failing (the
    directory published, `latest` not moved): each time the last good checkpoint stays
    the one `latest` names and loads. Then three good saves: only the newest two stay."""
    from unittest import mock

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from autopar.errors import CheckpointError
    from autopar.runtime import checkpoint

    engine = _engine(GPT, {"data": 2})
    engine.train_step(*_batch(0))
    first = engine.save(root)
    good = engine.full_state_dict()
    engine.train_step(*_batch(1))
    out = {"first": first}

    def disk_full(self, metadata, results):
        raise OSError("no space left on device")

    with mock.patch.object(dcp.FileSystemWriter, "finish", disk_full):
        try:
            engine.save(root)
            out["raised"] = None
        except CheckpointError as e:
            out["raised"] = str(e)
    dist.barrier()
    out["after_crash"] = sorted(os.listdir(root))
    out["tmp_files"] = sorted(os.listdir(os.path.join(root, ".tmp-step-00000002")))
    out["latest"] = open(os.path.join(root, "latest")).read().strip()
    # rank 0's next save clears leftovers of crashed saves: every rank reads them first
    dist.barrier()

    def pointer_lost(path, text):
        raise OSError("killed before the pointer moved")

    with mock.patch.object(checkpoint, "_write_atomic", pointer_lost):
        try:
            engine.save(root)
            out["raised_pointer"] = None
        except CheckpointError as e:
            out["raised_pointer"] = str(e)
    out["after_pointer"] = sorted(os.listdir(root))
    out["latest_pointer"] = open(os.path.join(root, "latest")).read().strip()
    dist.barrier()

    fresh = _engine(GPT, {"data": 2}, seed=1)
    out["loaded"] = fresh.load(root)
    out["loaded_step"] = fresh.steps
    now = fresh.full_state_dict()
    out["max_diff"] = max(float((now[k] - good[k]).abs().max()) for k in good)
    for s in range(3):
        fresh.train_step(*_batch(1 + s))
        fresh.save(root)
    out["kept"] = sorted(os.listdir(root))
    out["latest_final"] = open(os.path.join(root, "latest")).read().strip()
    return out


def test_a_crash_mid_save_keeps_the_last_checkpoint(tmp_path, pool2):
    root = str(tmp_path / "ckpt")
    for r in pool2.run(_crash_mid_save, root):
        assert r["first"] == os.path.join(root, "step-00000001")
        assert r["raised"].startswith("writing the checkpoint of step 2 into ")
        assert r["raised"].endswith("failed on rank 0 (OSError: no space left on device); "
                                    "`latest` still names the last complete checkpoint.")
        # partly written: data files, no DCP metadata, never published
        assert any(f.endswith(".distcp") for f in r["tmp_files"])
        assert ".metadata" not in r["tmp_files"]
        assert r["after_crash"] == [".tmp-step-00000002", "latest", "step-00000001"]
        assert r["latest"] == "step-00000001"
        assert "killed before the pointer moved" in r["raised_pointer"]
        assert r["after_pointer"] == ["latest", "step-00000001", "step-00000002"]
        assert r["latest_pointer"] == "step-00000001"
        assert r["loaded"] == os.path.join(root, "step-00000001")
        assert r["loaded_step"] == 1 and r["max_diff"] == 0.0
        # steps 2 (a second save of step 2 gets its own name), 3 and 4; the newest two stay
        assert r["kept"] == ["latest", "step-00000003", "step-00000004"]
        assert r["latest_final"] == "step-00000004"


def test_checkpoint_weights_load_into_the_original_model(tmp_path):
    """One process (world 1): the checkpoint's weights as a plain state_dict, loaded by
    the model class the engine was made from, give the engine's outputs."""
    from autopar.runtime.checkpoint import load_full_state_dict

    engine = _engine(GPT, None)
    for s in range(2):
        engine.train_step(*_batch(s))
    engine.save(tmp_path / "ckpt")
    model, inputs, _, _ = build(GPT, BATCH, seed=1)
    model.load_state_dict(load_full_state_dict(tmp_path / "ckpt"))
    whole = engine.full_state_dict()
    assert all(torch.equal(model.state_dict()[k], whole[k]) for k in whole)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(inputs[0]), engine(inputs[0]), atol=1e-6)


def test_fp16_loss_scale_resumes_where_it_was(tmp_path):
    """The fp16 loss scaler's state travels with the checkpoint: a resumed run keeps the
    scale it reached (and its count of good and skipped steps)."""
    import autopar

    def fp16_engine():
        model, inputs, _, loss_fn = build(GPT, BATCH)
        return autopar.parallelize(model, 1, example_inputs=tuple(t[:2] for t in inputs),
                                   loss_fn=loss_fn, precision="fp16",
                                   optimizer=functools.partial(torch.optim.SGD, lr=0.1))

    engine = fp16_engine()
    engine.train_step(*_batch(0))
    engine.scaler.scale, engine.scaler.good_steps, engine.scaler.skipped_steps = 1024.0, 7, 3
    engine.save(tmp_path / "ckpt")
    resumed = fp16_engine()
    assert resumed.loss_scale == 2.0 ** 16
    resumed.load(tmp_path / "ckpt")
    assert (resumed.loss_scale, resumed.scaler.good_steps, resumed.skipped_steps) == \
        (1024.0, 7, 3)


def test_errors_name_the_cause(tmp_path):
    from autopar.errors import PlanError

    engine = _engine(GPT, None)
    with pytest.raises(PlanError, match="there is no checkpoint directory"):
        engine.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlanError, match="holds no complete checkpoint"):
        engine.load(tmp_path / "empty")
    engine.train_step(*_batch(0))
    engine.save(tmp_path / "gpt")
    wider = _engine("gpt:layers=2,hidden=64,heads=4,vocab=64,seq=16", None)
    with pytest.raises(PlanError, match=r"the checkpoint's \S+ has shape \(\d+, 32\) but the "
                                       r"model's has \(\d+, 64\); load a checkpoint"):
        wider.load(tmp_path / "gpt")
    deeper = _engine("gpt:layers=3,hidden=32,heads=4,vocab=64,seq=16", None)
    with pytest.raises(PlanError, match="the checkpoint has no weight blocks.2"):
        deeper.load(tmp_path / "gpt")
    deeper.save(tmp_path / "deeper")
    with pytest.raises(PlanError, match="the checkpoint holds blocks.2"):
        engine.load(tmp_path / "deeper")


def test_killed_rank_resumes_from_the_last_checkpoint():
    """torchrun with one restart: rank 1 SIGKILLs itself inside step 6 (after the step-4
    checkpoint); the group restarts, loads step 4 and trains to step 8. The final weights
    equal one uninterrupted device's, and the resumed step is the last checkpoint's."""
    from kill_train import launched  # one job for this test and the automatic resume's

    steps = 8  # its defaults: a checkpoint every 2 steps, rank 1 killed inside step 6
    done, out = launched("manual")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["attempt"] == 1  # the run that finished is the restarted one
    assert report["resumed_from"] == 4  # the last checkpoint before the kill in step 6
    assert report["steps"] == steps
    final = torch.load(out / "final.pt")
    from kill_train import reference

    want = reference(steps)
    assert list(final) == list(want)
    for k, v in want.items():
        assert _close(final[k], v), k


def test_zero3_pieces_save_and_load_at_another_dp(tmp_path, pool4, pool2):
    """ZeRO-3 keeps only pieces (the whole local parameters are emptied between steps):
    weights and states are written from the pieces and read back into other pieces."""
    _reshard(tmp_path, pool4, {"data": 4, "zero": {"stage": 3}},
             pool2, {"data": 2, "zero": {"stage": 3}})

"""Checkpoints a long job leaves to autopar: saves in the background (`engine.save(...,
asynchronous=True)`, `parallelize(checkpoint_dir=..., checkpoint_every=...)`) and automatic
resume. A background save writes the state as it was when the save returned, overlaps the
steps after it, never leaves a half-written checkpoint where `latest` points, and a job
restarted by torchrun after a lost rank goes on from its last complete checkpoint."""

import functools
import json
import os
import sys
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from distributed import REPO_ROOT

import autopar
from autopar.errors import CheckpointError, PlanError
from autopar.models import build
from autopar.runtime.checkpoint import load_full_state_dict

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 64, (4, 16), generator=gen)
    return x, x.roll(-1, 1)


def _engine(**kw):
    model, (x,) = build(GPT, batch=4, device="cpu", seed=0)
    return autopar.parallelize(model, 1, example_inputs=(x,), loss_fn=_loss, optimizer=ADAMW,
                               plan={"data": 1}, **kw)


def _run(engine, steps):
    while engine.steps < steps:
        engine.train_step(*_batch(engine.steps))


class _HeldWriter(dcp.FileSystemWriter):
    """Writes only once the test lets it (`gate`), or fails (`fail`)."""

    gate = threading.Event()
    fail = False

    def write_data(self, plan, planner):
        assert self.gate.wait(60)
        if self.fail:
            raise OSError("disk full")
        return super().write_data(plan, planner)


@pytest.fixture
def held_writer(monkeypatch):
    _HeldWriter.gate = threading.Event()
    _HeldWriter.fail = False
    monkeypatch.setattr(dcp, "FileSystemWriter", _HeldWriter)
    return _HeldWriter


def test_a_background_save_writes_the_state_of_its_step_while_training_goes_on(
        tmp_path, held_writer):
    engine = _engine()
    _run(engine, 2)
    want = {k: v.clone() for k, v in engine.full_state_dict().items()}
    handle = engine.save(tmp_path / "ckpt", asynchronous=True)
    # returned with the state staged; nothing written or published yet
    assert not handle.done() and not (tmp_path / "ckpt" / "latest").exists()
    _run(engine, 4)  # the steps go on while the write waits
    held_writer.gate.set()
    published = engine.wait_for_checkpoint()
    assert os.path.basename(published) == "step-00000002"
    got = load_full_state_dict(tmp_path / "ckpt")
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)  # step 2's, not step 4's
    assert engine.wait_for_checkpoint() is None  # nothing in flight any more


def test_a_failed_background_write_keeps_the_last_checkpoint(tmp_path, held_writer):
    engine = _engine()
    _run(engine, 1)
    held_writer.gate.set()
    engine.save(tmp_path / "ckpt", asynchronous=True)
    assert os.path.basename(engine.wait_for_checkpoint()) == "step-00000001"
    _run(engine, 2)
    held_writer.fail = True
    engine.save(tmp_path / "ckpt", asynchronous=True)
    with pytest.raises(CheckpointError, match="disk full.*`latest` still names the last"):
        engine.wait_for_checkpoint()
    resumed = _engine(checkpoint_dir=tmp_path / "ckpt")
    assert resumed.steps == 1


def test_checkpoint_dir_saves_every_n_steps_and_resumes_where_it_stopped(tmp_path):
    whole = _engine()
    _run(whole, 6)
    first = _engine(checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
    assert first.steps == 0  # an empty directory: a fresh start
    _run(first, 5)
    first.wait_for_checkpoint()
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == ["latest", "step-00000002", "step-00000004"]
    second = _engine(checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
    assert second.steps == 4  # the loop goes on from here
    _run(second, 6)
    second.wait_for_checkpoint()
    want, got = whole.full_state_dict(), second.full_state_dict()
    assert all(torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-7) for k in want)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step-00000004",
                                                    "step-00000006"]


def test_bad_checkpointing_arguments_are_refused_in_one_sentence(tmp_path):
    with pytest.raises(PlanError, match="checkpoint_every must be a whole number >= 1"):
        _engine(checkpoint_dir=tmp_path, checkpoint_every=0)
    with pytest.raises(PlanError, match="checkpoint_dir must be a directory path"):
        _engine(checkpoint_dir=3)
    with pytest.raises(PlanError, match="checkpoint_async must be True or False"):
        _engine(checkpoint_dir=tmp_path, checkpoint_async="yes")


def test_a_killed_rank_resumes_by_itself_under_torchrun():
    """torchrun --max-restarts 1: rank 1 SIGKILLs itself inside step 6; the restarted job's
    parallelize(checkpoint_dir=...) loads the last complete background save (step 4, or
    step 2 if step 4's was still being written: never a partial one) and trains to step 8.
    The final weights equal one uninterrupted device's."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))
    from kill_train import launched, reference

    done, out = launched("auto")  # one job for this test and the manual resume's
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["attempt"] == 1 and report["steps"] == 8
    assert report["resumed_from"] in (2, 4)
    final = torch.load(out / "final.pt")
    want = reference(8)
    for k, v in want.items():
        a, b = final[k].double(), v.double()
        ok = float((a - b).abs().max()) <= 1e-8 if b.norm() < 1e-6 else \
            float((a - b).norm() / b.norm()) <= 1e-5
        assert ok, k

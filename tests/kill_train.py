"""Train a tiny GPT under torchrun, checkpointing every few steps, and survive a killed rank.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        tests/kill_train.py --out DIR [--steps 8] [--every 2] [--kill-at 6] \\
        [--variants auto,manual]

Plan: 1D tensor parallelism over the 2 ranks. Each variant is an engine of its own, its
files under DIR/<variant>: `manual` saves every `--every` steps with engine.save and, after
a restart, loads with engine.load; `auto` passes parallelize(checkpoint_dir=...,
checkpoint_every=...), which resumes and saves (in the background) by itself. The variants
train side by side, a step of each in turn, in the order given. On the first attempt
(TORCHELASTIC_RESTART_COUNT 0) rank 1 sends itself SIGKILL in the middle of the first
variant's step `--kill-at` (after that step's backward, just before its optimizer step),
as a machine that dies would: no clean-up, no exception; the variants after it have then
finished step `--kill-at` - 1. torchrun sees the dead worker, stops the other one (blocked
in a collective) and starts both again; each variant then resumes from its latest
checkpoint and trains on to `--steps`. At the end rank 0 writes each variant's final whole
weights to DIR/<variant>/final.pt and DIR/<variant>/report.json (the attempt that finished,
the step it resumed from). `launched(variant)` runs the job once for every test that reads
it (a job is two launcher and four worker interpreters); `reference(steps)` is the same
training, uninterrupted, on one device: tests/test_checkpoint.py and
tests/test_checkpoint_async.py compare the two.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import autopar  # noqa: E402
from autopar.models import build  # noqa: E402

SPEC = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
BATCH = 8
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def batch(step: int):
    """The global batch of step `step` (0-based): the same in every attempt."""
    gen = torch.Generator().manual_seed(2000 + step)
    return (torch.randint(0, 64, (BATCH, 16), generator=gen),
            torch.randint(0, 64, (BATCH, 16), generator=gen))


def reference(steps: int) -> dict[str, torch.Tensor]:
    """The final state_dict of the same training on one device, never interrupted."""
    model, _ = build(SPEC, batch=BATCH, device="cpu", seed=0)
    opt = OPTIMIZER(model.parameters())
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


VARIANTS = ("auto", "manual")  # auto first: the kill lands in its step, manual is one behind


def launch(out, steps: int = 8, every: int = 2, kill_at: int = 6,
           variants: tuple[str, ...] = VARIANTS):
    """This script under torchrun: 2 processes, one restart allowed (what the tests run)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    if os.path.isdir("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.5",
           os.path.abspath(__file__), "--out", str(out), "--steps", str(steps),
           "--every", str(every), "--kill-at", str(kill_at), "--variants", ",".join(variants)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=root)


@functools.cache
def _launched_once():
    out = tempfile.mkdtemp(prefix="kill_train-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return launch(out), out


def launched(variant: str):
    """(the finished job, the variant's folder) of one job with the default steps, run for
    the first test that asks and read by the others."""
    done, out = _launched_once()
    return done, Path(out) / variant


def _engine(variant: str, world: int, ckpt: str, every: int):
    model, (x,) = build(SPEC, batch=BATCH, device="cpu", seed=0)
    auto = dict(checkpoint_dir=ckpt, checkpoint_every=every) if variant == "auto" else {}
    engine = autopar.parallelize(model, world, example_inputs=(x[:2],), loss_fn=lm_loss,
                                 optimizer=OPTIMIZER,
                                 plan={"tensor": {"size": world, "mode": "1d"}}, **auto)
    resumed = engine.steps if variant == "auto" and engine.steps else None
    if variant == "manual" and os.path.exists(os.path.join(ckpt, "latest")):
        engine.load(ckpt)
        resumed = engine.steps
    return engine, resumed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=6)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="engines trained side by side, in this order: auto (parallelize "
                             "resumes and saves in the background by itself) and manual "
                             "(engine.save every --every steps, engine.load after a restart)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    assert variants and set(variants) <= set(VARIANTS), variants
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # parallelize joins torchrun's group (each restart under its own store prefix)
    engines = {}
    for variant in variants:
        folder = os.path.join(args.out, variant)
        os.makedirs(folder, exist_ok=True)
        engines[variant] = (*_engine(variant, world, os.path.join(folder, "ckpt"), args.every),
                            folder)
    if attempt == 0 and rank == 1:
        first = engines[variants[0]][0]

        def die(optimizer, *_):
            if first.steps + 1 == args.kill_at:  # inside step kill_at, before its update
                os.kill(os.getpid(), signal.SIGKILL)
        first.optimizer.register_step_pre_hook(die)
    while any(engine.steps < args.steps for engine, _, _ in engines.values()):
        for variant, (engine, _, folder) in engines.items():
            if engine.steps < args.steps:
                engine.train_step(*batch(engine.steps))
                if variant == "manual" and engine.steps % args.every == 0:
                    engine.save(os.path.join(folder, "ckpt"))
    for engine, resumed, folder in engines.values():
        engine.wait_for_checkpoint()
        final = engine.full_state_dict()
        if rank == 0:
            torch.save(final, os.path.join(folder, "final.pt"))
            with open(os.path.join(folder, "report.json"), "w") as f:
                json.dump({"attempt": attempt, "resumed_from": resumed,
                           "steps": engine.steps}, f)


if __name__ == "__main__":
    main()

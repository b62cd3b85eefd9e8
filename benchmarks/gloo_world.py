"""Shared by the multi-process benchmarks: a local gloo (or NCCL) world and where results
go."""

from __future__ import annotations

import gc
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lm_loss(logits, target):
    """Next-token cross-entropy of a language model's logits, the benchmarks' loss."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def eager_step(module, optimizer, x, y, report):
    """A plain torch training step of `module` on (x, y), as a callable returning
    report(loss): the peers' steps beside autopar's."""
    def step():
        loss = lm_loss(module(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return report(loss)
    return step


def world_mean(loss: torch.Tensor) -> float:
    """The loss averaged over every rank of the world (a data-parallel peer's report)."""
    value = loss.detach().reshape(1).clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def results_path(name: str) -> str:
    """benchmarks/results/<name>, the folder made if missing (it is gitignored)."""
    out_dir = os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    return os.path.join(out_dir, name)


def write_and_judge(name: str, data: dict, rows: list[dict], label: str,
                    tolerance: float) -> int:
    """Write `data` to benchmarks/results/<name>; 1 (naming them) if any row's
    error_percent is beyond `tolerance`, else 0: a benchmark's exit status."""
    with open(results_path(name), "w") as f:
        json.dump(data, f, indent=2)
    bad = [r[label] for r in rows if abs(r["error_percent"]) > tolerance]
    if bad:
        print(f"off by more than {tolerance:.0f}%: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _entry(rank: int, port: int, world: int, fn, args, backend: str = "gloo") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_world(fn, args: tuple, world: int, backend: str = "gloo") -> None:
    """Run fn(rank, *args) on `world` local processes joined in one process group (gloo;
    "nccl": rank r on cuda:r). Gloo's ranks are forked, with torch and the benchmark
    already imported (a spawned rank imports them again: 3-4 CPU s each); NCCL's spawned, as
    CUDA needs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_entry, args=(port, world, fn, args, backend), nprocs=world,
                       start_method="spawn" if backend == "nccl" else "fork")


def live_tensor_bytes() -> int:
    """Bytes of every real tensor storage the garbage collector reaches, each once."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.is_meta:
                continue
            storage = obj.untyped_storage()
            key = storage.data_ptr()
        except (RuntimeError, ReferenceError, NotImplementedError):
            continue  # no storage of its own (DTensor: its local tensor counts)
        if key and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def dtensor_tensor_parallel(model, mesh, world: int):
    """The zoo LLaMA's blocks split by DTensor's `parallelize_module` the Megatron way
    (Colwise q, k, v and w1, w3; Rowwise wo and w2), each rank computing its heads."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
        block.attention.n_head //= world  # the heads this rank computes
        block.attention.n_kv_head //= world
    return model

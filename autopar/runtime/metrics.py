"""Per-step metrics of a training engine, measured beside the plan's prediction.

Every rank measures its step time, peak memory and bytes sent; one small all-gather per
step (logged on axis "world", phase "metrics") brings them to rank 0, which writes one JSON
line per step (and TensorBoard scalars when the `tensorboard` package is installed) and
prints a line a person reads every `every` steps.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Callable

import torch

from autopar.errors import PlanError
from autopar.kernels.collectives import world_group
from autopar.modes import DP

PHASE = "metrics"  # the phase of the comm log's records these metrics add
FIELDS = 5  # per rank: peak bytes, step seconds, bytes sent, bytes sent on dp, tokens


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: the CUDA allocator's on a GPU, else the resident set's (the
    kernel's high-water mark, ru_maxrss, in KiB on Linux and bytes on macOS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def batch_tokens(inputs) -> tuple[int, int]:
    """(samples, tokens) of a global batch: the first input's batch dim, and for integer
    token ids (batch, sequence, ...) the ids it holds."""
    first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    samples = int(first.shape[0]) if first.dim() else 1
    tokens = first.numel() if not first.is_floating_point() and first.dim() >= 2 else samples
    return samples, int(tokens)


class StepMetrics:
    """Where the metrics go (`sink`: a JSON-lines path, or a callable given each step's dict)
    and how often a console line is printed (`every` steps; 0: never)."""

    def __init__(self, sink, every: int = 10, stream=None):
        if isinstance(sink, bool) or not (isinstance(sink, (str, os.PathLike)) or
                                          callable(sink)):
            raise PlanError(f"metrics must be a file path or a callable taking each step's "
                             f"dict, not {sink!r}.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise PlanError(f"metrics_every must be a whole number >= 0, not {every!r}.")
        self.path = os.fspath(sink) if isinstance(sink, (str, os.PathLike)) else None
        self.callback: Callable | None = None if self.path else sink
        self.every = every
        self.stream = stream
        self.prediction: dict | None = None
        self._writer = None  # TensorBoard's, once rank 0 writes

    # ------------------------------------------------------------------ measuring
    def gather(self, engine, step_s: float, sent: dict[str, int], tokens: int) -> list[list]:
        """Every rank's [peak bytes, step seconds, bytes sent, bytes on dp, tokens]."""
        mine = torch.tensor([peak_memory_bytes(engine.device), step_s, sum(sent.values()),
                             sent.get(DP, 0), tokens], dtype=torch.float64)
        world = world_group(engine.comm_log)  # (logged on axis "world", at one rank too)
        every = world.all_gather(mine, 0, 1, PHASE)
        return every.view(world.size, FIELDS).tolist()

    def record(self, engine, step: int, loss: float, step_s: float, inputs,
               sent: dict[str, int], grad_norm: float | None) -> dict | None:
        """One step's line (rank 0 writes it and returns it; other ranks return None)."""
        samples, tokens = batch_tokens(inputs)
        ranks = self.gather(engine, step_s, sent, tokens)
        if engine.global_rank() != 0:
            return None
        if self.prediction is None:
            self.prediction = engine.step_prediction()
        pred = self.prediction
        slowest = max(r[1] for r in ranks)  # the step ends when the last rank's does
        world = len(ranks)
        flops, peak = pred.get("model_flops_per_step"), pred.get("peak_flops")
        row = {
            "step": step, "loss": loss, "step_s": slowest,
            "step_s_predicted": pred.get("step_time_s"),
            "samples_per_s": samples / slowest, "tokens_per_s": tokens / slowest,
            "mfu": flops / (slowest * world * peak) if flops and peak else None,
            "mfu_predicted": (flops / (pred["step_time_s"] * world * peak)
                              if flops and peak and pred.get("step_time_s") else None),
            "peak_memory_bytes": [int(r[0]) for r in ranks],
            "peak_memory_bytes_predicted": pred.get("memory_per_device_bytes"),
            "grad_norm": grad_norm,
            "sent_bytes": {axis: n for axis, n in sorted(sent.items())},
            "sent_bytes_per_rank": [int(r[2]) for r in ranks],
            "device": pred.get("device"),
        }
        self._write(row)
        if self.every and step % self.every == 0:
            print(console_line(row), file=self.stream or sys.stdout, flush=True)
        return row

    # ------------------------------------------------------------------ writing
    def _write(self, row: dict) -> None:
        if self.callback is not None:
            self.callback(row)
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        writer = self._tensorboard()
        if writer is not None:
            for key in ("loss", "step_s", "step_s_predicted", "tokens_per_s", "mfu",
                        "mfu_predicted", "grad_norm"):
                if row.get(key) is not None:
                    writer.add_scalar(key, row[key], row["step"])
            writer.add_scalar("peak_memory_bytes", max(row["peak_memory_bytes"]), row["step"])
            writer.flush()

    def _tensorboard(self):
        """TensorBoard's writer beside the JSON file (`<file>.tb/`), when the package is
        installed (the optional extra `autopar[metrics]`)."""
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional: the JSON lines are the record
                self._writer = False
                return None
            self._writer = SummaryWriter(log_dir=self.path + ".tb")
        return self._writer or None

    def close(self) -> None:
        if self._writer:
            self._writer.close()


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _bytes(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def console_line(row: dict) -> str:
    """A step's metrics as one line a person reads."""
    parts = [f"step {row['step']}", f"loss {row['loss']:.4f}",
             f"{_si(row['tokens_per_s'])} tok/s"]
    pred = row.get("step_s_predicted")
    parts.append(f"{row['step_s'] * 1e3:.1f} ms" +
                 (f" (plan {pred * 1e3:.1f} ms)" if pred else ""))
    if row.get("mfu") is not None:
        parts.append(f"MFU {row['mfu']:.1%}" + (f" (plan {row['mfu_predicted']:.1%})"
                                                  if row.get("mfu_predicted") else ""))
    planned = row.get("peak_memory_bytes_predicted")
    parts.append(f"peak {_bytes(max(row['peak_memory_bytes']))}" +
                 (f" (plan {_bytes(planned)})" if planned else ""))
    if row.get("grad_norm") is not None:
        parts.append(f"grad norm {row['grad_norm']:.3g}")
    return " | ".join(parts)

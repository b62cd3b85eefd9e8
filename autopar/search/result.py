"""What a search returns: each priced plan (`Candidate`) and the winner with its
alternatives (`SearchResult`), made from a leaf's figures (`candidate_of`) or its bound alone
(`bound_candidate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autopar.cost.precision import Precision
from autopar.kernels.float8 import TENSORWISE
from autopar.modes import CP, DP, INTERLEAVED, NO_PIPELINE, NO_SP, PP, TP

__all__ = ["Candidate", "SearchResult", "better", "bound_candidate", "candidate_of", "result_of"]


@dataclass(kw_only=True)
class Candidate:
    """One priced plan: its choices, its step seconds by part and its worst device's memory."""

    mesh: dict
    micro_batch: int
    microbatches: int
    schedule: str
    chunks: int
    zero: int
    offload: bool
    cp_mode: str | None
    states: list  # LayerState per layer of the chain
    stages: list  # stage (device) per layer
    step_time: float
    compute_s: float = 0.0
    comm_s: float = 0.0
    bubble_s: float = 0.0
    dp_comm_s: float = 0.0
    optimizer_s: float = 0.0
    memory: dict = field(default_factory=dict)  # worst device: bytes by kind
    memory_per_device: float = 0.0
    step_workspace: float = 0.0  # worst device: the optimizer step's temporaries (bytes)
    comm_bytes_per_device: float = 0.0
    fits: bool = True
    host_per_device: float = 0.0  # bytes offloaded to the host per device (ZeRO-Offload)
    ep: int = 1  # experts split over ep ranks inside the dp x cp ranks
    ep_comm_s: float = 0.0  # of comm_s: the all-to-alls on the ep axis
    dp_shard: int | None = None  # HSDP: ZeRO over this many dp ranks (None: all of dp)

    def describe(self) -> str:
        m = self.mesh
        modes = sorted({str(s.mode) for s in self.states if s.mode.size > 1}) or ["-"]
        rc = sorted({s.recompute for s in self.states})
        sp = sorted({s.sp for s in self.states} - {NO_SP})
        parts = [f"pp{m[PP]} dp{m[DP]} cp{m[CP]} tp{m[TP]}"
                 + (f" ep{self.ep}" if self.ep > 1 else ""), f"tp {'/'.join(modes)}"]
        if sp:
            parts.append("sp " + "/".join(sp))
        if self.cp_mode:
            parts.append(f"cp {self.cp_mode}")
        if m[PP] > 1:
            parts.append(f"{self.schedule}" + (f"x{self.chunks}" if self.schedule == INTERLEAVED
                                               else ""))
        parts.append(f"mb {self.micro_batch}x{self.microbatches}")
        parts.append(f"zero {self.zero}" + ("+offload" if self.offload else "")
                     + (f" shard {self.dp_shard}" if self.dp_shard else ""))
        parts.append("recompute " + "/".join(rc))
        return ", ".join(parts)


@dataclass
class SearchResult:
    best: Candidate | None
    alternatives: list  # (Candidate, reason) best first
    candidates: int
    time_s: float
    left_out: list[str] = field(default_factory=list)
    attention_kernel: str = "flash"
    precision: Precision | None = None  # the state bytes per parameter it priced
    compile: bool = False  # priced as parallelize(compile=True) runs it
    fp8_recipe: str = TENSORWISE  # under fp8, the scaling recipe it priced


def candidate_of(leaf, zero, offload, shard, chosen, step, total, parts, step_dev, host, wire,
               step_time, fits, memory) -> Candidate:
    """`Priced.candidate`: the whole Candidate of what `search.Search._priced` worked out."""
    prep, mesh, device_of = leaf.prep, leaf.mesh, leaf.fast.device_of
    on_slow = np.flatnonzero(device_of == int(np.argmax(step["per_rank_s"])))  # slowest

    def slow_sum(table) -> float:  # in layer order, as a running sum
        return sum(table[on_slow, chosen[on_slow]].tolist())

    worst_dev = int(np.argmax(total))
    return Candidate(
        mesh=dict(mesh), micro_batch=leaf.b, microbatches=leaf.m,
        schedule=leaf.schedule if mesh[PP] > 1 else NO_PIPELINE, chunks=leaf.v, zero=zero,
        offload=offload, cp_mode=leaf.cp_mode, states=prep.states_of(chosen.tolist()),
        stages=leaf.stage_of, step_time=step_time,
        compute_s=leaf.m * slow_sum(prep.compute_table),
        comm_s=leaf.m * slow_sum(prep.comm_table),
        bubble_s=step["bubble_s"], dp_comm_s=step["dp_s"], optimizer_s=step["optimizer_s"],
        memory={k: float(v[worst_dev]) for k, v in parts.items()},
        memory_per_device=memory, step_workspace=float(step_dev[worst_dev]),
        comm_bytes_per_device=leaf.m * slow_sum(prep.comm_bytes_table) + wire,
        fits=fits, host_per_device=host, ep=leaf.split.ep if leaf.split is not None else 1,
        ep_comm_s=leaf.m * slow_sum(prep.ep_comm_table), dp_shard=shard)


def bound_candidate(leaf) -> Candidate:
    """A leaf only bounded, as a Candidate: its mesh and choices, its fastest states and its
    bound for step time."""
    prep = leaf.prep.build()
    return Candidate(mesh=dict(leaf.mesh), micro_batch=leaf.b, microbatches=leaf.m,
                     schedule=leaf.schedule, chunks=leaf.v, zero=0, offload=False,
                     cp_mode=leaf.cp_mode, states=prep.states_of(prep.fast), stages=[],
                     step_time=leaf.bound, ep=leaf.split.ep if leaf.split else 1)


def better(a: Candidate, b: Candidate) -> bool:
    """Whether `a` beats `b`: fitting first, then the faster, else the smaller."""
    if a.fits != b.fits:
        return a.fits
    if a.fits:
        return a.step_time < b.step_time
    return a.memory_per_device < b.memory_per_device


def result_of(search, per_mesh: dict, bounds: dict, seconds: float) -> SearchResult:
    """The winner (the fastest fitting candidate of every mesh) and the alternatives with
    why each lost, then the meshes only bounded (at least how much slower), `top` in all."""
    ranked = sorted(per_mesh.values(), key=lambda c: (not c.fits, c.step_time if c.fits
                                                      else c.memory_per_device))
    winner = ranked[0] if ranked and ranked[0].fits else None
    alternatives = [(c, search.reason(c, winner)) for c in ranked[(1 if winner else 0):]]
    for key, leaf in bounds.items():
        if len(alternatives) >= search.opt.top:
            break  # the rest would be cut below
        if key not in per_mesh and winner is not None:
            alternatives.append((bound_candidate(leaf),
                                 f"at least {100 * (leaf.bound / winner.step_time - 1):.1f}% "
                                 "slower (lower bound: never fully priced)"))
    return SearchResult(winner, alternatives[: search.opt.top], search.candidates, seconds,
                        search.left_out, search.opt.attention_kernel, search.precision,
                        search.opt.compile, search.opt.fp8_recipe)

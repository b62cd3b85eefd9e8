"""Hardware profiles as data: what one accelerator and its links can do.

Profiles live as JSON files in ``autopar/cost/profiles/``; ``autopar calibrate`` writes
a file of the same shape for the machine it runs on, and every place that takes a
device name (``World(device=...)``, ``--device``) also takes such a file's path.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import asdict, dataclass, field
from importlib import resources

from autopar.errors import WorldError

GiB = 1024 ** 3


@dataclass(frozen=True)
class Hardware:
    """Facts of one accelerator kind and the machines it sits in.

    Bandwidths are bytes per second in one direction per device; latencies are seconds
    per message (the alpha of an alpha-beta model). Matrix multiplications reach
    ``gemm_efficiency`` of peak for large problems and half of that at
    ``gemm_half_flops`` FLOPs (efficiency = max * F / (F + half)); memory-bound ops reach
    ``memory_efficiency`` of ``memory_bandwidth``. A calibrated profile may carry each
    collective's own fitted alpha and beta (``collectives``, see
    :func:`autopar.cost.comm.collective_time`) and, for CPU ranks sharing fewer cores,
    ``compute_share`` (see :func:`autopar.cost.schedule.time_shared`).
    """

    name: str
    memory_bytes: int
    peak_flops: dict  # dtype name ("fp32", "tf32", "bf16", "fp16") -> dense FLOP/s
    memory_bandwidth: float
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    per_node: int = 8
    gemm_efficiency: float = 0.8
    gemm_half_flops: float = 1e9
    memory_efficiency: float = 0.8
    host_bandwidth: float = 25e9  # device <-> host (offload), bytes/s per device
    host_memory_bytes: int = 1024 * GiB  # per node
    # op -> {"algorithm", "alpha", "beta"}: a collective's own latency and seconds per
    # byte inside a node, fitted by `autopar calibrate` to its formula (backends run
    # collectives unequally well); empty: every collective sees the link's alpha and beta
    collectives: dict = field(default_factory=dict)
    # the share of one device's full speed it computes at while every device of its node
    # computes: 1 for accelerators; cores / (ranks x threads) for CPU ranks that outnumber
    # the cores they share. Peak FLOP/s and bandwidths are the rates with all busy.
    compute_share: float = 1.0
    source: str = ""
    extra: dict = field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        if dtype in self.peak_flops:
            return float(self.peak_flops[dtype])
        raise WorldError(f"device '{self.name}' has no peak FLOP/s for dtype '{dtype}'; it knows "
                         f"{', '.join(sorted(self.peak_flops))}.")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Hardware:
        names = set(cls.__dataclass_fields__)
        unknown = set(data) - names
        if unknown:
            raise WorldError(f"unknown hardware profile field(s) {sorted(unknown)}; valid fields "
                             f"are {sorted(names)}.")
        try:
            return cls(**data)
        except TypeError as e:
            raise WorldError(f"malformed hardware profile: {e}.") from e

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)


def builtin_names() -> list[str]:
    folder = resources.files("autopar.cost") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


_CACHE: dict[str, Hardware] = {}


def load_hardware(name_or_path: str) -> Hardware:
    """A built-in profile by name (``a100-80gb``) or a profile JSON file by path."""
    if name_or_path in _CACHE:
        return _CACHE[name_or_path]
    if name_or_path.endswith(".json") or os.sep in name_or_path:
        if not os.path.exists(name_or_path):
            raise WorldError(f"no hardware profile file at {name_or_path}; write one with "
                             "`autopar calibrate -o profile.json`.")
        with open(name_or_path) as f:
            try:
                hw = Hardware.from_json(json.load(f))
            except json.JSONDecodeError as e:
                raise WorldError(f"{name_or_path} is not valid JSON ({e}).") from e
    else:
        names = builtin_names()
        if name_or_path not in names:
            close = difflib.get_close_matches(name_or_path, names, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise WorldError(f"unknown device '{name_or_path}'; known devices are "
                             f"{', '.join(names)}, or a profile file written by "
                             f"`autopar calibrate`.{hint}")
        text = (resources.files("autopar.cost") / "profiles" / f"{name_or_path}.json").read_text()
        hw = Hardware.from_json(json.loads(text))
    _CACHE[name_or_path] = hw
    return hw

"""The devices a plan is for: how many, how many per node, and which hardware profile."""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass

from autopar.errors import WorldError


@dataclass(frozen=True)
class DeviceProfile:
    """Facts of one accelerator, from its data sheet."""

    name: str
    memory_bytes: int
    peak_flops: dict  # dtype name -> FLOP/s (dense)


GiB = 1024 ** 3

# Peak dense FLOP/s and memory from the vendors' data sheets (NVIDIA A100, H100 SXM, H200).
PROFILES = {
    "a100-40gb": DeviceProfile("a100-40gb", 40 * GiB, {"fp32": 19.5e12, "tf32": 156e12,
                                                       "bf16": 312e12, "fp16": 312e12}),
    "a100-80gb": DeviceProfile("a100-80gb", 80 * GiB, {"fp32": 19.5e12, "tf32": 156e12,
                                                       "bf16": 312e12, "fp16": 312e12}),
    "h100-80gb": DeviceProfile("h100-80gb", 80 * GiB, {"fp32": 67e12, "tf32": 494.5e12,
                                                       "bf16": 989.5e12, "fp16": 989.5e12}),
    "h200": DeviceProfile("h200", 141 * GiB, {"fp32": 67e12, "tf32": 494.5e12,
                                              "bf16": 989.5e12, "fp16": 989.5e12}),
    "cpu": DeviceProfile("cpu", 24 * GiB, {"fp32": 50e9, "bf16": 50e9, "fp16": 50e9}),
}


def profile(name: str) -> DeviceProfile:
    if name in PROFILES:
        return PROFILES[name]
    close = difflib.get_close_matches(name, PROFILES, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise WorldError(f"unknown device '{name}'; known devices are {', '.join(sorted(PROFILES))}."
                     + hint)


@dataclass(frozen=True)
class World:
    """`devices` accelerators, `per_node` of them in each node, all of kind `device`."""

    devices: int
    per_node: int = 8
    device: str = "a100-80gb"

    def __post_init__(self):
        if not isinstance(self.devices, int) or self.devices < 1:
            raise WorldError(f"a world needs a positive whole number of devices, not {self.devices!r}.")
        if not isinstance(self.per_node, int) or self.per_node < 1:
            raise WorldError(f"per_node must be a positive whole number, not {self.per_node!r}.")
        profile(self.device)

    @property
    def nodes(self) -> int:
        return -(-self.devices // self.per_node)

    @property
    def profile(self) -> DeviceProfile:
        return profile(self.device)

    def to_json(self) -> dict:
        return asdict(self)

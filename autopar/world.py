"""The devices a plan is for: how many, how many per node, and which hardware profile."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from autopar.cost.hardware import GiB, Hardware, builtin_names, load_hardware  # noqa: F401
from autopar.errors import WorldError


def profile(name: str) -> Hardware:
    """The hardware profile named `name` (or a profile JSON file's path)."""
    return load_hardware(name)


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
        if not isinstance(self.device, str):
            raise WorldError(f"device names a hardware profile ({', '.join(builtin_names())}) or "
                             f"a profile JSON file's path, not a {type(self.device).__name__}; "
                             "save a custom profile to a file and pass its path.")
        profile(self.device)

    @property
    def nodes(self) -> int:
        return -(-self.devices // self.per_node)

    @property
    def profile(self) -> Hardware:
        return profile(self.device)

    def to_json(self) -> dict:
        return asdict(self)


def local_device() -> str:
    """The device profile of the accelerator this process runs on ("cpu" without one)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    if "H200" in name:
        return "h200"
    if "H100" in name:
        return "h100-80gb"
    if "A100" in name:
        total = torch.cuda.get_device_properties(0).total_memory
        return "a100-80gb" if total > 50 * 1024 ** 3 else "a100-40gb"
    return "a100-80gb"

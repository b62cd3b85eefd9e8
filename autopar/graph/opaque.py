"""Opaque ops that stand for a whole module in a traced graph, and what they stand for.

An op's arguments are tensors and scalars, so an op standing for a module (the engine's
`autopar::moe`, one MoE layer: autopar.kernels.moe_layers) names its description (an
`MoESpec`) by an integer key registered here; the graph analysis and the cost model read
the description back from the node's key argument (the same key in every process).
"""

from __future__ import annotations

import hashlib

MOE_OP_NAME = "autopar::moe"  # moe(x, gate, experts, shared, key, with_aux) -> (out, loss)
MOE_KEY_ARG = 4  # the position of the description's key among the op's arguments

_DESCRIPTIONS: dict[int, object] = {}


def register(description: object) -> int:
    """The integer key of `description` (a hash of its repr), registered."""
    key = int(hashlib.sha256(repr(description).encode()).hexdigest()[:15], 16)
    _DESCRIPTIONS[key] = description
    return key


def described(key: int) -> object:
    """The description registered under `key`."""
    return _DESCRIPTIONS[key]


STANDS_FOR = "autopar_stands_for"
"""The attribute naming the description's key on a module's stand-in forward (set while
tracing): the trace cache keys such a forward by what it stands for, not by its identity."""


def stand_in(forward, key: int):
    """`forward`, marked as standing for the module that `key` describes."""
    setattr(forward, STANDS_FOR, key)
    return forward

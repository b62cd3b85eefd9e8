"""Layouts: how one tensor lies on the named axes of a device mesh.

A layout is a small immutable value. Each tensor dimension is either replicated (R) or
split over one mesh axis (S(tp)); a tensor can also be a partial sum over an axis (P(tp)),
waiting for a reduction. Several dimensions may be split over different axes (2D tensor
parallelism splits an activation's batch over `tp_i` and its hidden dim over `tp_j`); an
axis that spans several physical mesh dims is a composite (see `autopar.sharding.axes`).
A split dimension may carry `groups`: the dimension is read as `groups` equal blocks and
each block is split separately, which is how a fused QKV projection keeps q, k and v of
the same heads on one rank (`S(tp)x3`). A negative `groups`, -r, marks a batch-major
flattening whose block count is the batch, known only at run time: [B, S, ...] split on S
and flattened to [B*S, ...] reads as runs of r = S*... elements per sample, each run split
(`S(cp)/r`; the language-model loss takes its logits and targets this way under context
parallelism). `block_count` turns it into the number of blocks of a concrete tensor.

    >>> Layout.replicated(3).with_shard(2, "tp")
    R R S(tp)
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from autopar.modes import CP, CP_TP, TP


@dataclass(frozen=True, order=True)
class Shard:
    """Dimension `dim` split over mesh axis `axis`, blockwise in `groups` blocks."""

    dim: int
    axis: str
    groups: int = 1


@dataclass(frozen=True)
class Layout:
    ndim: int
    shards: tuple[Shard, ...] = ()
    partial: tuple[str, ...] = ()

    @staticmethod
    def replicated(ndim: int) -> Layout:
        return Layout(ndim)

    def __repr__(self) -> str:
        dims = []
        for d in range(self.ndim):
            shard = self.shard_of_dim(d)
            if shard is None:
                dims.append("R")
            elif shard.groups < 0:
                dims.append(f"S({shard.axis})/{-shard.groups}")
            else:
                dims.append(f"S({shard.axis})" + (f"x{shard.groups}" if shard.groups > 1 else ""))
        text = " ".join(dims) if dims else "scalar"
        return text + "".join(f" P({a})" for a in self.partial)

    @property
    def is_replicated(self) -> bool:
        return not self.shards and not self.partial

    def shard_of_dim(self, dim: int) -> Shard | None:
        for shard in self.shards:
            if shard.dim == dim:
                return shard
        return None

    def shard_on(self, axis: str) -> Shard | None:
        for shard in self.shards:
            if shard.axis == axis:
                return shard
        return None

    def with_shard(self, dim: int, axis: str, groups: int = 1) -> Layout:
        dim = dim % self.ndim if self.ndim else dim
        kept = tuple(s for s in self.shards if s.axis != axis and s.dim != dim)
        return Layout(self.ndim, tuple(sorted(kept + (Shard(dim, axis, groups),))), self.partial)

    def without(self, axis: str) -> Layout:
        return Layout(self.ndim, tuple(s for s in self.shards if s.axis != axis),
                      tuple(a for a in self.partial if a != axis))

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis the layout splits or sums over, shards in dim order first."""
        out = [s.axis for s in sorted(self.shards, key=lambda s: s.dim)]
        return tuple(dict.fromkeys(out + list(self.partial)))

    def restricted(self, axes) -> Layout:
        """The same layout with only the shards and partial sums on `axes`."""
        if not self.shards and not self.partial:  # (most values: nothing to drop)
            return self
        axes = set(axes)
        return Layout(self.ndim, tuple(s for s in self.shards if s.axis in axes),
                      tuple(a for a in self.partial if a in axes))

    def with_partial(self, axis: str) -> Layout:
        return Layout(self.ndim, self.shards, tuple(sorted(set(self.partial) | {axis})))

    def with_ndim(self, ndim: int, shards: tuple[Shard, ...]) -> Layout:
        return Layout(ndim, tuple(sorted(shards)), self.partial)

    def local_shape(self, shape, sizes: dict[str, int]) -> tuple:
        """The shape each rank holds, given the global shape and the mesh axis sizes."""
        out = list(shape)
        for shard in self.shards:
            out[shard.dim] = out[shard.dim] / sizes[shard.axis] \
                if isinstance(out[shard.dim], sympy.Basic) else out[shard.dim] // sizes[shard.axis]
        return tuple(out)

    def parts(self, sizes: dict[str, int]) -> int:
        """Into how many pieces the shards cut the tensor (the share one rank holds is 1/parts)."""
        out = 1
        for shard in self.shards:
            out *= sizes[shard.axis]
        return out

    def to_json(self) -> str:
        return repr(self)


def tokens_seen_on(layout: Layout, axis: str) -> Layout:
    """`layout` as a rule working on `axis` alone sees it: a split over `CP_TP` (a rank's cp
    block of the tokens, split again over tp) reads as a split over cp, or over tp."""
    if axis not in (CP, TP) or all(s.axis != CP_TP for s in layout.shards):
        return layout
    return Layout(layout.ndim, tuple(Shard(s.dim, axis, s.groups) if s.axis == CP_TP else s
                                     for s in layout.shards), layout.partial)


def joined_tokens(a: Shard, b: Shard) -> Shard | None:
    """One dim split over cp and over tp (each axis's rule split the tokens, whole or
    flattened batch-major alike): the split over `CP_TP`; None for any other pair."""
    if a.dim == b.dim and a.groups == b.groups and a.groups in (1,) + ((a.groups,) if
                                                                       a.groups < 0 else ()) \
            and {a.axis, b.axis} == {CP, TP}:
        return Shard(a.dim, CP_TP, a.groups)
    return None


def block_count(groups: int, length: int, parts: int, whole: bool) -> int:
    """The number of blocks of a split dimension of `length` elements: `groups` itself, or,
    for a batch-major flattening (groups = -r, runs of r elements per sample), the number
    of samples. `whole`: `length` is the gathered dim (else one rank's part of it)."""
    if groups > 0:
        return groups
    run = -groups if whole else -groups // parts
    if run <= 0 or length % run:
        raise ValueError(f"a dim of {length} elements is not a whole number of per-sample "
                         f"runs of {run}")
    return length // run


def divisible(size, parts: int) -> bool:
    """True when a (possibly symbolic) size splits into `parts` equal integer pieces."""
    size = sympy.sympify(size)
    if not size.is_number:
        return False
    return int(size) % parts == 0

"""Where a rank's tensors sit in the whole ones they belong to: a slice of a tensor split
over the mesh, or a ZeRO piece of a flat parameter, as runs of whole-tensor indices and as
boxes (offsets, sizes) with the local data behind each (`Region`). Checkpoints write and
read these boxes; startup reads a rank's slices of whole weights through them."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from autopar.passes.tensor_parallel import shard_steps


@dataclass
class Region:
    """Where one local tensor lies in the whole tensor of `shape`: boxes, each the global
    offsets of a box and the view of the local tensor that holds it."""

    shape: tuple[int, ...]
    boxes: list[tuple[tuple[int, ...], torch.Tensor]]

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.size())
                for o, v in self.boxes]

    def find(self, index: MetadataIndex) -> torch.Tensor:
        """The view of the box at `index.offset` (`index.index`, when given, is its position
        in `boxes`: a load may ask for overlapping boxes of two local tensors)."""
        i = index.index
        if i is not None and i < len(self.boxes) and \
                torch.Size(self.boxes[i][0]) == index.offset:
            return self.boxes[i][1]
        for offsets, view in self.boxes:
            if torch.Size(offsets) == index.offset:
                return view
        raise KeyError(f"{index.fqn} has no box at {tuple(index.offset)} on this rank")


def slice_runs(layout, mesh, coords: dict[str, int], shape: tuple[int, ...]) -> list[list]:
    """Per dim of the whole tensor of `shape`, the (global start, length) runs this rank's
    slice holds, in the slice's order: the cuts of `local_slice`, followed on positions."""
    runs = [[(0, n)] for n in shape]
    if layout is None:
        return runs
    for shard in layout.shards:
        for axis, groups in shard_steps(shard, mesh):
            parts, index = mesh.size(axis), mesh.index(axis, coords)
            held = runs[shard.dim]
            m = sum(n for _, n in held) // (groups * parts)
            picked = []
            for b in range(groups):  # this rank's m positions of every block
                picked += take_run(held, (b * parts + index) * m, m)
            runs[shard.dim] = merge_runs(picked)
    return runs


def expert_runs(runs: list, parts: int, index: int) -> list:
    """The runs of a stacked expert weight after the ep cut: the `index`-th of `parts`
    equal blocks of the positions dim 0's `runs` hold (ShardedParams' own experts)."""
    m = sum(n for _, n in runs[0]) // parts
    return [merge_runs(take_run(runs[0], index * m, m))] + [list(r) for r in runs[1:]]


def take_run(runs: list, start: int, length: int) -> list:
    """The global runs of local positions [start, start + length) of a dim held as `runs`."""
    out, pos = [], 0
    for g, n in runs:
        lo, hi = max(start, pos), min(start + length, pos + n)
        if lo < hi:
            out.append((g + lo - pos, hi - lo))
        pos += n
    return out


def merge_runs(runs: list) -> list:
    out = []
    for g, n in runs:
        if out and out[-1][0] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((g, n))
    return out


def whole_shape(local_shape, layout, mesh) -> tuple[int, ...]:
    """The whole tensor's shape, from a slice's shape and its layout."""
    shape = list(local_shape)
    if layout is not None:
        for shard in layout.shards:
            for axis, _ in shard_steps(shard, mesh):
                shape[shard.dim] *= mesh.size(axis)
    return tuple(shape)


def place_runs(runs: list, shape: tuple[int, ...], local_boxes) -> Region:
    """The region of local boxes ((offsets in the slice), view) through the slice's runs:
    each local box splits where a dim's runs break."""
    boxes = []
    for offsets, view in local_boxes:
        per_dim = []
        for d, (o, n) in enumerate(zip(offsets, view.shape)):
            cuts, pos = [], 0  # (offset in the view, global start, length)
            for g, length in runs[d]:
                lo, hi = max(o, pos), min(o + n, pos + length)
                if lo < hi:
                    cuts.append((lo - o, g + lo - pos, hi - lo))
                pos += length
            per_dim.append(cuts)
        for combo in itertools.product(*per_dim):
            part = view
            for d, (rel, _, length) in enumerate(combo):
                part = part.narrow(d, rel, length)
            boxes.append((tuple(g for _, g, _ in combo), part))
    return Region(tuple(shape), boxes)


def slice_region(tensor: torch.Tensor, runs: list, shape) -> Region:
    """A tensor shaped like this rank's slice: one local box, the whole of it."""
    if tensor.numel() == 0 and math.prod(shape) > 0:
        return Region(tuple(shape), [])
    return place_runs(runs, shape, [((0,) * tensor.dim(), tensor)])


def flat_boxes(start: int, stop: int, shape: tuple[int, ...]) -> list:
    """Boxes (offsets, sizes) covering the row-major flat positions [start, stop) of a
    tensor of `shape`, in order; each is a contiguous run of the flat order (a partial
    row, whole rows, a partial row, recursively)."""
    if start >= stop or math.prod(shape) == 0:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    rest = tuple(shape[1:])

    def row(i, lo, hi):
        return [((i,) + o, (1,) + s) for o, s in flat_boxes(lo, hi, rest)]

    if first == last:
        return row(first, start - first * inner, stop - first * inner)
    out, head = [], first
    if start % inner:
        out += row(first, start % inner, inner)
        head += 1
    tail = last + 1 if stop % inner == 0 else last
    if tail > head:
        out.append(((head,) + (0,) * len(rest), (tail - head,) + rest))
    if stop % inner:
        out += row(last, 0, stop % inner)
    return out


def piece_region(piece: torch.Tensor, start: int, local_shape, runs: list,
                  shape) -> Region:
    """A ZeRO piece (flat positions [start, start + len) of this rank's slice, of
    `local_shape`) as boxes of the whole tensor: used for the weights and for every
    optimizer state of the piece alike."""
    strides = [math.prod(local_shape[d + 1:]) for d in range(len(local_shape))]
    local = []
    for offsets, sizes in flat_boxes(start, start + piece.numel(), tuple(local_shape)):
        flat = sum(o * s for o, s in zip(offsets, strides)) - start
        local.append((offsets, piece.reshape(-1)[flat:flat + math.prod(sizes)].view(sizes)))
    return place_runs(runs, shape, local)



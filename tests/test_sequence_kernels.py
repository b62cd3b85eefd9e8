"""Sequence-parallel attention kernels (autopar.kernels.sequence) against dense attention.

Every rank draws the same float64 q, k, v and upstream gradient from one seed, runs torch's
`scaled_dot_product_attention` on the whole sequence with autograd, runs ring attention or
Ulysses on its block of the sequence (contiguous or zigzag layout, causal or not, 4, 2 or 1
kv heads for 4 query heads), reassembles output and gradients with `assemble_sequence` and
compares them with the reference (relative error 1e-10). Worlds of 2 and 4 ranks, one axis
"cp" over the whole world. S = 24 (not a power of two) splits into 2c chunks for zigzag.
Ring attention also runs with tiles of 5 and 2 rows (the default, 512, covers whole blocks
here), so block pairs are cut into several tiles, ragged last ones included (S_local 6 or
12, zigzag chunks 3 or 6).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import dist_pool_fixture
from numerics import leaf, max_rel, rand64
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.kernels.collectives import AxisGroup, CommLog, bind
from autopar.kernels.sequence import (
    SequenceAttention,
    assemble_sequence,
    cut_sequence,
    merge_sequence,
    ring_attention,
    sequence_attention,
    sequence_chunks,
    sequence_positions,
    ulysses_attention,
    ulysses_kv_replication,
)

pool2 = dist_pool_fixture(2, timeout_s=120)
pool4 = dist_pool_fixture(4, timeout_s=120)

# batch, query heads, sequence, q/k head dim, v head dim; f64 bytes. B*H = 8 < S, so any
# tensor dim of size >= S can only be a whole-sequence dim.
B, H, S, D, DV, E = 2, 4, 24, 4, 3, 8
TOL = 1e-10
KERNELS = {"ring": ring_attention, "ulysses": ulysses_attention}
CASES = [(mode, layout, causal, hkv, scale, tile)
         for mode in ("ring", "ulysses") for layout in ("contiguous", "zigzag")
         for causal in (False, True) for hkv in (4, 2, 1)
         for scale in ((None, 0.3) if hkv == 2 else (None,))
         for tile in ((None, 5, 2) if mode == "ring" else (None,))]
FOOT_D = 7  # q/k/v head dim of the footprint check: no other dim of its tensors is 7

# ----------------------------------------------------------------------------------------
# Worker side (runs on every rank of a pool)
# ----------------------------------------------------------------------------------------


def _group(log: CommLog) -> AxisGroup:
    return AxisGroup("cp", dist.get_world_size(), dist.get_rank(), dist.group.WORLD, log)


def _inputs(gen, hkv: int, d: int = D, dv: int = DV):
    return rand64(gen, B, H, S, d), rand64(gen, B, hkv, S, d), rand64(gen, B, hkv, S, dv), \
        rand64(gen, B, H, S, dv)


def _kernel(mode: str, tile: int | None):
    if mode == "ring":
        return lambda *a, **kw: ring_attention(*a, tile=tile, **kw)
    assert tile is None
    return KERNELS[mode]


def _check_case(g: AxisGroup, gen, mode, layout, causal, hkv, scale,
                tile) -> dict[str, float]:
    q, k, v, dout = _inputs(gen, hkv)
    full = [leaf(t) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal, scale=scale,
                                         enable_gqa=hkv != H)
    ref.backward(dout)
    local = [leaf(cut_sequence(t, g, 2, layout)) for t in (q, k, v)]
    out = _kernel(mode, tile)(*local, g, causal=causal, scale=scale, layout=layout)
    out.backward(cut_sequence(dout, g, 2, layout))
    name = (f"{mode}.{layout}.{'causal' if causal else 'full'}.kv{hkv}.scale{scale}"
            f".tile{tile}")
    errs = {f"{name}.out": max_rel(assemble_sequence(out, g, 2, layout), ref)}
    for n, lt, ft in zip("qkv", local, full):
        errs[f"{name}.d{n}"] = max_rel(assemble_sequence(lt.grad, g, 2, layout), ft.grad)
    return errs


def _run_cases() -> dict[str, float]:
    g = _group(CommLog())
    gen = torch.Generator().manual_seed(1234)
    errs: dict[str, float] = {}
    for case in CASES:
        errs.update(_check_case(g, gen, *case))
    return errs


def _comm(mode: str, layout: str, causal: bool, hkv: int) -> list[tuple]:
    """CommLog of one forward and backward."""
    log = CommLog()
    g = _group(log)
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (cut_sequence(t, g, 2, layout) for t in _inputs(gen, hkv))
    q, k, v = leaf(q), leaf(k), leaf(v)
    KERNELS[mode](q, k, v, g, causal=causal, layout=layout).backward(dout)
    return [(r.op, r.axis, r.bytes, r.phase) for r in log]


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in pytree.tree_leaves(out)
                        if isinstance(t, torch.Tensor)]
        return out


def _ring_footprint(layout: str, causal: bool, hkv: int, tile: int | None) -> dict:
    """Shapes of every tensor the ring kernel creates (forward and backward) and saves, with
    q/k/v head dims FOOT_D, so that the tensors with no dim FOOT_D are the score-like ones
    (scores, probabilities, dP, dS, masks and their temporaries; also the per-row
    statistics, B*H*S_local elements)."""
    g = _group(CommLog())
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (cut_sequence(t, g, 2, layout)
                     for t in _inputs(gen, hkv, FOOT_D, FOOT_D))
    q, k, v = leaf(q), leaf(k), leaf(v)
    saved: list[tuple] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    mode = _Shapes()
    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ring_attention(q, k, v, g, causal=causal, layout=layout, tile=tile)
        out.backward(dout)
    made = [s for s in mode.shapes if len(s) >= 2]
    scores = [s for s in made if FOOT_D not in s]
    return {"largest_dim": max(max(s) for s in made),
            "largest_score": max(math.prod(s) for s in scores),
            "largest_score_shape": max(scores, key=math.prod),
            "saved": saved, "s_local": q.shape[2]}


# ----------------------------------------------------------------------------------------
# Tests (parent side)
# ----------------------------------------------------------------------------------------


def _assert_cases(results: list[dict]) -> None:
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, (rank, bad)
        assert len(errs) == 4 * len(CASES)


def test_sequence_kernels_match_dense_world2(pool2):
    _assert_cases(pool2.run(_run_cases))


def test_sequence_kernels_match_dense_world4(pool4):
    _assert_cases(pool4.run(_run_cases))


def _ring_expected(c: int, hkv: int) -> dict:
    """Module docstring: K = B*Hkv*S_local*D*e, V = B*Hkv*S_local*Dv*e; forward c-1 hops of
    K+V, backward c-1 hops of K+V and c hops of dK+dV (float64: same bytes)."""
    s_local = S // c
    kv = B * hkv * s_local * (D + DV) * E
    return {"forward": [("p2p", "cp", kv, "forward")] * (c - 1),
            "backward": [("p2p", "cp", kv, "backward")] * (2 * c - 1)}


def _ulysses_expected(c: int, hkv: int) -> dict:
    """Q = B*H*S_local*D*e, O = B*H*S_local*Dv*e, kv heads repeated f = c/gcd(Hkv, c) times:
    forward all_to_all Q, f*K, f*V, O; backward O, then Q, f*K, f*V."""
    s_local, f = S // c, ulysses_kv_replication(hkv, c)
    qb, ob = B * H * s_local * D * E, B * H * s_local * DV * E
    kb, vb = f * B * hkv * s_local * D * E, f * B * hkv * s_local * DV * E
    return {"forward": [("all_to_all", "cp", n, "forward") for n in (qb, kb, vb, ob)],
            "backward": sorted(("all_to_all", "cp", n, "backward") for n in (ob, qb, kb, vb))}


@pytest.mark.parametrize("world", [2, 4])
def test_comm_bytes(world, pool2, pool4):
    pool = pool2 if world == 2 else pool4
    c = world
    # worked numbers for c = 4, Hkv = 2: S_local = 6, K + V = 2*2*6*(4+3)*8 = 1344 bytes;
    # ring 3 + 7 hops; Ulysses f = 2: Q = 1536, f*K = 1536, f*V = 1152, O = 1152.
    if c == 4:
        assert _ring_expected(4, 2)["forward"][0][2] == 1344
        assert [r[2] for r in _ulysses_expected(4, 2)["forward"]] == [1536, 1536, 1152, 1152]
    for hkv in (4, 2, 1):
        for layout, causal in (("contiguous", False), ("zigzag", True)):
            want = _ring_expected(c, hkv)
            for got in pool.run(_comm, "ring", layout, causal, hkv):
                assert [r for r in got if r[3] == "forward"] == want["forward"]
                assert [r for r in got if r[3] == "backward"] == want["backward"]
                assert sum(r[2] for r in got) == (3 * c - 2) * want["forward"][0][2]
            want = _ulysses_expected(c, hkv)
            for got in pool.run(_comm, "ulysses", layout, causal, hkv):
                assert [r for r in got if r[3] == "forward"] == want["forward"]
                assert sorted(r for r in got if r[3] == "backward") == want["backward"]


def test_ring_never_materialises_the_sequence(pool4):
    """No tensor of the ring kernel (forward or backward, saved or temporary) has a dim of
    the whole sequence's length, and no score-like tensor has more than B*H*tile*S_local
    elements: exactly B*H*max(t^2, S_local), t = min(tile, chunk), the larger of one tile's
    scores and the per-row statistics (with the default tile, 512, one tile is a whole
    block: B*H*S_local^2 at S_local = 6)."""
    for layout, causal, hkv, tile in (("contiguous", False, 4, 5), ("contiguous", True, 1, 5),
                                      ("zigzag", True, 2, 2), ("zigzag", False, 1, 4),
                                      ("contiguous", True, 2, None)):
        for r in pool4.run(_ring_footprint, layout, causal, hkv, tile):
            s_local = r["s_local"]
            assert s_local == S // 4
            assert r["largest_dim"] < S, (layout, causal, r)
            chunk = s_local // 2 if layout == "zigzag" and causal else s_local
            t = min(tile or 512, chunk)
            assert r["largest_score"] <= B * H * (tile or 512) * s_local, (layout, r)
            assert r["largest_score"] == B * H * max(t * t, s_local), (layout, tile, r)
            assert r["saved"] and all(max(s) < S for s in r["saved"])


def test_layout_helpers():
    c, n = 3, 12
    assert sequence_chunks(c, 0, "zigzag") == (0, 5)
    assert sequence_chunks(c, 2, "zigzag") == (2, 3)
    assert sequence_positions(n, c, 1, "zigzag").tolist() == [2, 3, 8, 9]
    assert sequence_positions(n, c, 1, "contiguous").tolist() == [4, 5, 6, 7]
    full = torch.arange(2 * n * 3).reshape(2, n, 3)
    for layout in ("contiguous", "zigzag"):
        log = CommLog()
        blocks = [cut_sequence(full, AxisGroup("cp", c, r, None, log), 1, layout)
                  for r in range(c)]
        assert torch.equal(merge_sequence(blocks, 1, layout), full)
        pos = torch.cat([sequence_positions(n, c, r, layout) for r in range(c)])
        assert torch.equal(torch.cat(blocks, 1), full[:, pos])
    with pytest.raises(ValueError, match="does not split"):
        sequence_positions(10, 3, 0, "zigzag")
    with pytest.raises(ValueError, match="unknown sequence layout"):
        sequence_chunks(2, 0, "striped")


def test_size_one_axis_is_dense_attention():
    """c = 1 (no process group): both kernels are dense attention; the ring logs nothing,
    Ulysses its four all-to-alls each way; the graph module binds to axis "cp"."""
    log = CommLog()
    g = AxisGroup("cp", 1, 0, None, log)
    gen = torch.Generator().manual_seed(11)
    q, k, v, dout = _inputs(gen, 2)
    full = [leaf(t) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    for mode in ("ring", "ulysses"):
        module = SequenceAttention("cp", mode, is_causal=True, enable_gqa=True)
        bind(module, {"cp": g})
        local = [leaf(t) for t in (q, k, v)]
        out = module(*local)
        out.backward(dout)
        assert max_rel(out.detach(), ref.detach()) <= TOL
        for lt, ft in zip(local, full):
            assert max_rel(lt.grad, ft.grad) <= TOL
    assert [r.op for r in log] == ["all_to_all"] * 8


def test_unsupported_arguments_are_rejected():
    g = AxisGroup("cp", 4, 0, None, CommLog())
    q, k = torch.zeros(1, 6, 8, 2), torch.zeros(1, 2, 8, 2)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        ulysses_attention(q, k, k, g)
    with pytest.raises(ValueError, match="dropout"):
        sequence_attention(q, q, q, g, dropout_p=0.1)
    with pytest.raises(ValueError, match="attn_mask"):
        sequence_attention(q, q, q, g, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="enable_gqa"):
        sequence_attention(q, k, k, g)
    with pytest.raises(ValueError, match="odd"):
        ring_attention(torch.zeros(1, 2, 3, 2), torch.zeros(1, 2, 3, 2),
                       torch.zeros(1, 2, 3, 2), g, causal=True, layout="zigzag")
    assert [ulysses_kv_replication(h, 4) for h in (1, 2, 3, 4, 8)] == [4, 2, 4, 1, 1]

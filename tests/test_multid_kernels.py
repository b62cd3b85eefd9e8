"""2D, 2.5D and 3D tensor-parallel kernels (autopar.kernels.multid) against dense math.

Every rank draws the same float64 tensors from one seed, runs the dense reference with
autograd, runs the sharded kernel on its blocks with the matching block of a random
upstream gradient, reassembles outputs and gradients with `Grid.assemble` and compares them
with the reference (relative error 1e-10). Grids are built from torch's DeviceMesh:
2D on world 4 (q = 2), 2.5D and 3D on world 8 (q = d = 2; q = 2).

A DeviceMesh dim's group varies that dim's index, so on a (q, q) mesh named ("col", "row")
rank i*q + j gets group "col" = ranks sharing column j (its local rank is i) and group "row"
= ranks sharing row i (local rank j), which is what Grid2D expects.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture
from numerics import leaf, max_rel, rand64
from torch import nn

from autopar.kernels.collectives import AxisGroup, CommLog
from autopar.kernels.multid import (
    ClassifierCrossEntropy,
    Embedding,
    Grid2D,
    Grid2p5D,
    Grid3D,
    LayerNorm,
    Linear,
    RMSNorm,
    classifier_cross_entropy,
    embedding,
    layer_norm,
    linear,
    rms_norm,
)

pool4 = dist_pool_fixture(4, timeout_s=120)
pool8 = dist_pool_fixture(8, timeout_s=180)

# batch, sequence, hidden, out features, vocabulary; f64 bytes. B splits into q*d and q^2,
# N (and V) into q^2 for 3D; X != W != Y below so the byte counts tell the tensors apart.
B, S, H, N, V, E = 4, 3, 8, 20, 12, 8
Q, D = 2, 2
TOL = 1e-10

# ----------------------------------------------------------------------------------------
# Worker side (runs on every rank of a pool)
# ----------------------------------------------------------------------------------------

_MESHES: dict = {}


def _groups(shape: tuple, names: tuple, log: CommLog) -> dict[str, AxisGroup]:
    """One AxisGroup per DeviceMesh dim, labelled by the dim name (meshes cached per process)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    mesh = _MESHES[key]
    return {name: AxisGroup(name, size, mesh.get_local_rank(name), mesh.get_group(name), log)
            for name, size in zip(names, shape)}


def _grid(mode: str, log: CommLog, roles: tuple = ("x", "y", "z")):
    if mode == "2d":
        g = _groups((Q, Q), ("col", "row"), log)
        return Grid2D(g["row"], g["col"])
    if mode == "2.5d":
        g = _groups((D, Q, Q), ("dep", "col", "row"), log)  # rank = k*q*q + i*q + j
        return Grid2p5D(g["row"], g["col"], g["dep"])
    g = _groups((Q, Q, Q), ("x", "y", "z"), log)
    return Grid3D(*(g[r] for r in roles))


def _sl(n: int, index: int, parts: int) -> slice:
    return slice(index * n // parts, (index + 1) * n // parts)


def _documented_blocks(grid) -> dict[str, tuple]:
    """The blocks of the module docstring's table, written out by hand from the indices."""
    q = grid.q
    if isinstance(grid, Grid3D):
        a, b, c = grid.coords
        bx, by = _sl(B, b * q + a, q * q), _sl(B, b * q + c, q * q)
        return {"x": (bx, slice(None), _sl(H, c, q)), "ids": (bx, slice(None)),
                "weight": (_sl(N, a * q + b, q * q), _sl(H, c, q)), "bias": (_sl(N, a, q),),
                "y": (by, slice(None), _sl(N, a, q)), "target": (by, slice(None)),
                "norm": (_sl(H, c, q),), "embedding": (slice(None), _sl(H, c, q))}
    i, j = grid.coords[:2]
    bx = _sl(B, i, q) if isinstance(grid, Grid2D) else _sl(B, grid.dep.rank * q + i, grid.d * q)
    return {"x": (bx, slice(None), _sl(H, j, q)), "ids": (bx, slice(None)),
            "weight": (_sl(N, j, q), _sl(H, i, q)), "bias": (_sl(N, j, q),),
            "y": (bx, slice(None), _sl(N, j, q)), "target": (bx, slice(None)),
            "norm": (_sl(H, j, q),), "embedding": (slice(None), _sl(H, j, q))}


def _layout_checks(grid) -> dict[str, bool]:
    shapes = {"x": (B, S, H), "ids": (B, S), "weight": (N, H), "bias": (N,), "y": (B, S, N),
              "target": (B, S), "norm": (H,), "embedding": (V, H)}
    out = {}
    for role, expected in _documented_blocks(grid).items():
        full = torch.arange(torch.Size(shapes[role]).numel(), dtype=torch.float64)
        full = full.reshape(shapes[role])
        out[role] = torch.equal(grid.cut(full, role), full[expected])
    return out


def _check_linear(grid, gen, errs: dict, with_bias: bool) -> None:
    x, w, b, dy = rand64(gen, B, S, H), rand64(gen, N, H), rand64(gen, N), rand64(gen, B, S, N)
    xr, wr, br = leaf(x), leaf(w), leaf(b)
    yr = F.linear(xr, wr, br if with_bias else None)
    yr.backward(dy)
    xl, wl, bl = leaf(grid.cut(x, "x")), leaf(grid.cut(w, "weight")), leaf(grid.cut(b, "bias"))
    yl = linear(xl, wl, bl if with_bias else None, grid)
    yl.backward(grid.cut(dy, "y"))
    name = "linear" if with_bias else "linear_nobias"
    errs[f"{name}.y"] = max_rel(grid.assemble(yl, "y"), yr)
    errs[f"{name}.dx"] = max_rel(grid.assemble(xl.grad, "x"), xr.grad)
    errs[f"{name}.dW"] = max_rel(grid.assemble(wl.grad, "weight"), wr.grad)
    if with_bias:
        errs[f"{name}.db"] = max_rel(grid.assemble(bl.grad, "bias"), br.grad)
    else:
        errs[f"{name}.db_is_none"] = 0.0 if bl.grad is None else 1.0


def _check_norms(grid, gen, errs: dict) -> None:
    x, w, b, dy = rand64(gen, B, S, H) * 3 + 1, rand64(gen, H), rand64(gen, H), rand64(gen, B, S, H)
    for name in ("layer_norm", "rms_norm"):
        xr, wr, br = leaf(x), leaf(w), leaf(b)
        xl, wl, bl = leaf(grid.cut(x, "x")), leaf(grid.cut(w, "norm")), leaf(grid.cut(b, "norm"))
        if name == "layer_norm":
            yr = F.layer_norm(xr, (H,), wr, br, eps=1e-5)
            yl = layer_norm(xl, wl, bl, grid, eps=1e-5)
        else:
            yr = F.rms_norm(xr, (H,), wr, eps=1e-6)
            yl = rms_norm(xl, wl, grid, eps=1e-6)
        yr.backward(dy)
        yl.backward(grid.cut(dy, "x"))
        errs[f"{name}.y"] = max_rel(grid.assemble(yl, "x"), yr)
        errs[f"{name}.dx"] = max_rel(grid.assemble(xl.grad, "x"), xr.grad)
        errs[f"{name}.dw"] = max_rel(grid.assemble(wl.grad, "norm"), wr.grad)
        if name == "layer_norm":
            errs[f"{name}.db"] = max_rel(grid.assemble(bl.grad, "norm"), br.grad)


def _check_embedding(grid, gen, errs: dict) -> None:
    table, dy = rand64(gen, V, H), rand64(gen, B, S, H)
    ids = torch.randint(0, V, (B, S), generator=gen)
    ids[0, 0] = ids[-1, -1] = 1  # the padding row appears on more than one rank
    ids[1, 0] = ids[2, 1] = 5    # and so does a repeated token
    er = leaf(table)
    yr = F.embedding(ids, er, padding_idx=1)
    yr.backward(dy)
    el = leaf(grid.cut(table, "embedding"))
    yl = embedding(grid.cut(ids, "ids"), el, grid, padding_idx=1)
    yl.backward(grid.cut(dy, "x"))
    errs["embedding.y"] = max_rel(grid.assemble(yl, "x"), yr)
    errs["embedding.dE"] = max_rel(grid.assemble(el.grad, "embedding"), er.grad)


def _check_cross_entropy(grid, gen, errs: dict) -> None:
    x, table = rand64(gen, B, S, H), rand64(gen, V, H)
    target = torch.randint(0, V, (B, S), generator=gen)
    target[0, 1] = target[B - 1, 0] = target[B - 1, 2] = -100  # ignored rows on two ranks
    scale = 1.3  # upstream gradient of the loss
    xr, er = leaf(x), leaf(table)
    lr = F.cross_entropy((xr @ er.T).reshape(-1, V), target.reshape(-1), ignore_index=-100)
    (lr * scale).backward()
    xl, el = leaf(grid.cut(x, "x")), leaf(grid.cut(table, "weight"))
    ll = classifier_cross_entropy(xl, el, grid.cut(target, "target"), grid)
    (ll * scale).backward()
    errs["cross_entropy.loss"] = max_rel(ll.detach(), lr.detach())
    errs["cross_entropy.dx"] = max_rel(grid.assemble(xl.grad, "x"), xr.grad)
    errs["cross_entropy.dE"] = max_rel(grid.assemble(el.grad, "weight"), er.grad)


def _check_block(grid, gen, errs: dict) -> None:
    """Embedding -> RMSNorm -> MLP (H -> 4H -> H) with residual -> LayerNorm -> classifier
    loss, through the nn.Module wrappers. The second linear runs on `grid.out_grid` (in 3D
    the input and output roles swapped) and its output is added to the residual stream
    block by block: no re-layout anywhere."""
    emb = nn.Embedding(V, H, dtype=torch.float64)
    norm1 = nn.RMSNorm(H, eps=1e-6, dtype=torch.float64)
    fc1 = nn.Linear(H, 4 * H, dtype=torch.float64)
    fc2 = nn.Linear(4 * H, H, dtype=torch.float64)
    norm2 = nn.LayerNorm(H, dtype=torch.float64)
    head = nn.Parameter(rand64(gen, V, H))
    for p in [*emb.parameters(), *norm1.parameters(), *fc1.parameters(),
              *fc2.parameters(), *norm2.parameters()]:
        p.data.copy_(rand64(gen, *p.shape))
    ids = torch.randint(0, V, (B, S), generator=gen)
    target = torch.randint(0, V, (B, S), generator=gen)
    target[1, 1] = -100

    h = emb(ids)
    h = h + fc2(F.gelu(fc1(norm1(h))))
    loss = F.cross_entropy((norm2(h) @ head.T).reshape(-1, V), target.reshape(-1))
    loss.backward()

    g2 = grid.out_grid
    s_emb, s_norm1 = Embedding.from_dense(emb, grid), RMSNorm.from_dense(norm1, grid)
    s_fc1, s_fc2 = Linear.from_dense(fc1, grid), Linear.from_dense(fc2, g2)
    s_norm2 = LayerNorm.from_dense(norm2, grid)
    s_head = ClassifierCrossEntropy.from_dense(head, grid)
    errs["block.relayout_free"] = float(g2.slices("y", (B, S, H)) != grid.slices("x", (B, S, H)))
    hl = s_emb(grid.cut(ids, "ids"))
    hl = hl + s_fc2(F.gelu(s_fc1(s_norm1(hl))))
    ll = s_head(s_norm2(hl), grid.cut(target, "target"))
    ll.backward()
    errs["block.loss"] = max_rel(ll.detach(), loss.detach())
    pairs = [(s_emb.weight, emb.weight, "embedding", grid),
             (s_norm1.weight, norm1.weight, "norm", grid),
             (s_fc1.weight, fc1.weight, "weight", grid), (s_fc1.bias, fc1.bias, "bias", grid),
             (s_fc2.weight, fc2.weight, "weight", g2), (s_fc2.bias, fc2.bias, "bias", g2),
             (s_norm2.weight, norm2.weight, "norm", grid), (s_norm2.bias, norm2.bias, "norm", grid),
             (s_head.weight, head, "weight", grid)]
    for n, (local, full, role, g) in enumerate(pairs):
        errs[f"block.grad{n}.{role}"] = max_rel(g.assemble(local.grad, role), full.grad)


def _run_kernels(mode: str, roles: tuple = ("x", "y", "z")) -> dict:
    """Every kernel of one mode, forward and backward, against the dense reference."""
    log = CommLog()
    grid = _grid(mode, log, roles)
    gen = torch.Generator().manual_seed(1234)
    errs: dict[str, float] = {}
    _check_linear(grid, gen, errs, with_bias=True)
    _check_linear(grid, gen, errs, with_bias=False)
    _check_norms(grid, gen, errs)
    _check_embedding(grid, gen, errs)
    _check_cross_entropy(grid, gen, errs)
    return {"layout": _layout_checks(grid), "errors": errs, "phases": {r.phase for r in log}}


def _run_block(mode: str, roles: tuple = ("x", "y", "z")) -> dict:
    grid = _grid(mode, CommLog(), roles)
    errs: dict[str, float] = {}
    _check_block(grid, torch.Generator().manual_seed(99), errs)
    return errs


def _linear_comm(mode: str) -> dict:
    """CommLog totals of one linear with bias, forward then backward."""
    log = CommLog()
    grid = _grid(mode, log)
    gen = torch.Generator().manual_seed(7)
    x, w, b = (leaf(grid.cut(t, r)) for t, r in ((rand64(gen, B, S, H), "x"),
                                                     (rand64(gen, N, H), "weight"),
                                                     (rand64(gen, N), "bias")))
    y = linear(x, w, b, grid)
    y.backward(torch.ones_like(y))
    return {phase: {f"{op} {axis}": n for (op, axis), n in log.totals([phase]).items()}
            for phase in ("forward", "backward")}


def _broadcast_reduce() -> dict:
    """AxisGroup.broadcast / reduce take indices within the group, not global ranks."""
    log = CommLog()
    g = _groups((Q, Q), ("col", "row"), log)
    rank = torch.distributed.get_rank()
    got = g["row"].broadcast(torch.tensor([float(rank)], dtype=torch.float64), 1, "forward")
    red = g["col"].reduce(torch.tensor([float(rank)], dtype=torch.float64), 0, "backward")
    return {"broadcast": got.item(), "reduce": red.item() if g["col"].rank == 0 else None,
            "log": [(r.op, r.axis, r.bytes, r.phase) for r in log]}


# ----------------------------------------------------------------------------------------
# Tests (parent side)
# ----------------------------------------------------------------------------------------


def _assert_kernels(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert all(r["layout"].values()), (rank, r["layout"])
        bad = {k: v for k, v in r["errors"].items() if not v <= TOL}
        assert not bad, (rank, bad)
        assert r["phases"] <= {"forward", "backward", "state"}
    assert len(results[0]["errors"]) >= 20


def _assert_block(results: list[dict]) -> None:
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, (rank, bad)
        assert len(errs) == 11


def test_axis_group_broadcast_and_reduce(pool4):
    results = pool4.run(_broadcast_reduce)
    for rank, r in enumerate(results):
        i, j = divmod(rank, Q)
        assert r["broadcast"] == i * Q + 1  # from member 1 of row i: rank (i, 1)
        if i == 0:
            assert r["reduce"] == j + (Q + j)  # sum of ranks (0, j) and (1, j)
        assert r["log"] == [("broadcast", "row", 8, "forward"), ("reduce", "col", 8, "backward")]


def test_2d_kernels_match_dense(pool4):
    _assert_kernels(pool4.run(_run_kernels, "2d"))
    _assert_block(pool4.run(_run_block, "2d"))


def test_2d_linear_comm_bytes(pool4):
    """Per rank, with X = x block = (B/q)*S*(H/q)*e, W = weight block = (N/q)*(H/q)*e and
    b = bias block = (N/q)*e (each collective logs the bytes this rank passes):
    forward  SUMMA, q steps:            broadcast row q*X, broadcast col q*W
    backward dx = dy W:                 broadcast col q*W, reduce row q*X
             dW = dy^T x:               broadcast row q*X, reduce col q*W
             db:                        all_reduce col b
    """
    q, e = Q, E
    x, w, b = (B // q) * S * (H // q) * e, (N // q) * (H // q) * e, (N // q) * e
    expected = {"forward": {"broadcast row": q * x, "broadcast col": q * w},
                "backward": {"broadcast col": q * w, "reduce row": q * x,
                             "broadcast row": q * x, "reduce col": q * w, "all_reduce col": b}}
    assert expected == {"forward": {"broadcast row": 384, "broadcast col": 640},  # X=192, W=320
                        "backward": {"broadcast col": 640, "reduce row": 384,
                                     "broadcast row": 384, "reduce col": 640,
                                     "all_reduce col": 80}}
    for got in pool4.run(_linear_comm, "2d"):
        assert got == expected


def test_2p5d_kernels_match_dense(pool8):
    _assert_kernels(pool8.run(_run_kernels, "2.5d"))
    _assert_block(pool8.run(_run_block, "2.5d"))


def test_2p5d_linear_comm_bytes(pool8):
    """As 2D with X = (B/(d*q))*S*(H/q)*e, plus the weight and bias gradients all-reduced
    over depth: all_reduce dep W + b."""
    q, d, e = Q, D, E
    x, w, b = (B // (d * q)) * S * (H // q) * e, (N // q) * (H // q) * e, (N // q) * e
    expected = {"forward": {"broadcast row": q * x, "broadcast col": q * w},
                "backward": {"broadcast col": q * w, "reduce row": q * x,
                             "broadcast row": q * x, "reduce col": q * w,
                             "all_reduce col": b, "all_reduce dep": w + b}}
    for got in pool8.run(_linear_comm, "2.5d"):
        assert got == expected


def test_3d_kernels_match_dense(pool8):
    _assert_kernels(pool8.run(_run_kernels, "3d"))
    # another assignment of physical axes to the roles
    _assert_kernels(pool8.run(_run_kernels, "3d", ("z", "x", "y")))


def test_3d_mlp_chain_alternates_roles_without_relayout(pool8):
    _assert_block(pool8.run(_run_block, "3d"))
    _assert_block(pool8.run(_run_block, "3d", ("y", "z", "x")))


def test_3d_linear_comm_bytes(pool8):
    """Roles input = x, weight = y, output = z. X = (B/q^2)*S*(H/q)*e, W = (N/q^2)*(H/q)*e,
    Y = (B/q^2)*S*(N/q)*e, b = (N/q)*e; an all-gather logs its gathered output (q times the
    block), a reduce-scatter its input (q times the result):
    forward  all_gather x q*X, all_gather y q*W, reduce_scatter z q*Y
    backward all_gather z q*Y, reduce_scatter x q*X, reduce_scatter y q*W, all_reduce y b
    """
    q, e = Q, E
    x, w, y, b = ((B // q**2) * S * (H // q) * e, (N // q**2) * (H // q) * e,
                  (B // q**2) * S * (N // q) * e, (N // q) * e)
    expected = {"forward": {"all_gather x": q * x, "all_gather y": q * w,
                            "reduce_scatter z": q * y},
                "backward": {"all_gather z": q * y, "reduce_scatter x": q * x,
                             "reduce_scatter y": q * w, "all_reduce y": b}}
    for got in pool8.run(_linear_comm, "3d"):
        assert got == expected


def test_size_one_axes_need_no_process_group():
    """q = 1 (every group of size 1, no torch.distributed): the kernels are the dense ops and
    the size-1 collectives still log, as AxisGroup's other methods do."""
    log = CommLog()
    one = [AxisGroup(a, 1, 0, None, log) for a in ("a", "b", "c")]
    gen = torch.Generator().manual_seed(5)
    for grid in (Grid2D(one[0], one[1]), Grid2p5D(*one), Grid3D(*one)):
        x, w, b = leaf(rand64(gen, B, S, H)), leaf(rand64(gen, N, H)), leaf(rand64(gen, N))
        y = linear(x, w, b, grid)
        y.backward(torch.ones_like(y))
        xr, wr, br = leaf(x), leaf(w), leaf(b)
        F.linear(xr, wr, br).backward(torch.ones_like(y))
        for got, ref in ((y, F.linear(xr, wr, br)), (x.grad, xr.grad), (w.grad, wr.grad),
                         (b.grad, br.grad)):
            assert max_rel(got.detach(), ref.detach()) <= TOL
    ops = {r.op for r in log}
    assert {"broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce"} <= ops
    assert all(r.bytes > 0 for r in log)


def test_cut_rejects_uneven_splits():
    log = CommLog()
    grid = Grid2D(AxisGroup("row", 2, 0, None, log), AxisGroup("col", 2, 1, None, log))
    with pytest.raises(ValueError, match="do not split into 2 equal slices over row"):
        grid.cut(torch.zeros(4, 3, 7), "x")
    with pytest.raises(ValueError, match="unknown tensor role"):
        grid.spec("activations")

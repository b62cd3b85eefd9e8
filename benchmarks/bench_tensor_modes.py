"""Communication of one layer under 1D, 2D, 2.5D and 3D tensor parallelism.

    python benchmarks/bench_tensor_modes.py [--hidden 256] [--tokens 256]

The layer is an MLP of two h x h linear layers (the Megatron pair: column- then
row-split under 1D) on a micro-batch of M tokens, M = h, so the activation, weight and
output blocks of every linear are the same size A = M h e bytes and the published
per-layer shapes compare directly (Colossal-AI's papers, per linear layer, in units of A):

    1D    2(P-1)/P               (Shoeybi et al. 2019; one all-reduce per linear)
    2D    6(q-1)/q,  P = q^2     (Xu et al. 2021, arXiv 2104.05343)
    2.5D  3(q-1)(d+1)/(dq), P = q^2 d   (Wang et al. 2021, arXiv 2105.14500)
    3D    6(q-1)/q^3, P = q^3    (Bian et al. 2021, arXiv 2105.14450)

Three columns, forward plus backward, per linear and per device, in units of A:

- model: ``autopar.cost.model.state_cost`` on the traced MLP (the number the search
  uses), at P = 4, 8 and 64;
- published: the shapes above;
- measured: the runtime's kernels at P = 4 and 8 on gloo (1D through ``parallelize``,
  2D/2.5D/3D through ``autopar.kernels.multid.linear``), from ``CommLog``: each record's
  bytes converted to what one device receives, (p-1)/p of a gathered, scattered,
  broadcast or reduced tensor and 2(p-1)/p of an all-reduced one.

The published 2D and 2.5D shapes count a SUMMA broadcast as its root sending its block
to the q-1 others, q times per product: q times the volume one device receives, which
is what the model and the measurement count; the ratio column shows that factor (q for
2D, 1 for 1D and 3D). For 2.5D the model also counts the all-reduce of the weight
gradient over the d depth layers, 2(d-1)/(d q^2), which the published shape leaves out,
so its ratio is a little under q. Prints a table and writes
benchmarks/results/tensor_modes.json.
"""

import argparse
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import results_path, run_world  # noqa: E402

from autopar.cost.comm import placements  # noqa: E402
from autopar.cost.model import Context, LayerState, state_cost, tensor_modes  # noqa: E402
from autopar.modes import ORDER  # noqa: E402
from autopar.search import planner  # noqa: E402
from autopar.world import World  # noqa: E402

SIZES = (4, 8, 64)
MEASURED = (4, 8)


class Pair(nn.Module):
    """Two h x h linear layers: one layer of the model, as a transformer's MLP is. The gain
    in front makes the input's gradient needed, as it is inside a network."""

    def __init__(self, h: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(h))
        self.fc1 = nn.Linear(h, h, bias=False)
        self.fc2 = nn.Linear(h, h, bias=False)

    def forward(self, x):
        return self.fc2(self.fc1(x * self.gain))


def mlp(h: int) -> nn.Module:
    return nn.Sequential(Pair(h))


def published(mode) -> float:
    P, q, d = mode.size, mode.q, mode.d
    return {"1d": 2 * (P - 1) / P, "2d": 6 * (q - 1) / q,
            "2.5d": 3 * (q - 1) * (d + 1) / (d * q), "3d": 6 * (q - 1) / q ** 3}[mode.name]


def modelled(h: int, tokens: int) -> list[dict]:
    """Cost-model bytes per linear per device, in units of A, for every mode of each P."""
    model = mlp(h)
    x = torch.randn(1, tokens, h)
    chain = planner.prepare(model, (x,), tokens_per_sample=tokens, tp_sizes=SIZES)
    blocks = [lt for lt in chain.layers() if lt.is_block]
    linears = sum(g.weight for lt in blocks for g in lt.gemms)
    unit = tokens * h * chain.dtype_bytes
    rows = []
    for P in SIZES:
        world = World(P, per_node=P)
        pl = placements({"pp": 1, "dp": 1, "cp": 1, "tp": P}, ORDER, world.per_node)
        ctx = Context(world.profile, "fp32", pl["tp"], pl["cp"])
        for mode in tensor_modes(P):
            nbytes = sum(state_cost(lt, LayerState(mode), 1, ctx).comm_bytes for lt in blocks)
            rows.append({"P": P, "mode": mode.name, "q": mode.q, "d": mode.d,
                         "label": str(mode) if mode.name != "1d" else "1d",
                         "model": nbytes / linears / unit,
                         "published": published(mode)})
    return rows


# ------------------------------------------------------------------- measurement (gloo)

def _received(log, sizes: dict) -> float:
    """Bytes one device receives for the records of a CommLog (see the module docstring)."""
    total = 0.0
    for r in log:
        p = sizes[r.axis]
        total += r.bytes * (2 * (p - 1) / p if r.op == "all_reduce" else (p - 1) / p)
    return total


def _grid(mode: str, P: int, log):
    """This rank's grid for `mode` on a world of P, built on a DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.kernels.collectives import AxisGroup
    from autopar.kernels.multid import Grid2D, Grid2p5D, Grid3D

    def group(mesh, name):
        return AxisGroup(name, mesh.size(mesh.mesh_dim_names.index(name)),
                         mesh.get_local_rank(name), mesh.get_group(name), log)

    if mode == "2d":
        q = int(round(P ** 0.5))
        mesh = init_device_mesh("cpu", (q, q), mesh_dim_names=("i", "j"))
        return Grid2D(row=group(mesh, "j"), col=group(mesh, "i"))
    if mode == "2.5d":
        mesh = init_device_mesh("cpu", (P // 4, 2, 2), mesh_dim_names=("k", "i", "j"))
        return Grid2p5D(row=group(mesh, "j"), col=group(mesh, "i"), dep=group(mesh, "k"))
    q = int(round(P ** (1 / 3)))
    mesh = init_device_mesh("cpu", (q, q, q), mesh_dim_names=("b", "a", "c"))
    return Grid3D(input=group(mesh, "a"), weight=group(mesh, "b"), output=group(mesh, "c"))


def _measure_multid(mode: str, P: int, h: int, tokens: int) -> float:
    from autopar.kernels import multid
    from autopar.kernels.collectives import CommLog

    log = CommLog()
    grid = _grid(mode, P, log)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, h, generator=gen)
    w1, w2 = torch.randn(h, h, generator=gen), torch.randn(h, h, generator=gen)
    xb = grid.cut(x, "x").requires_grad_()
    w1b = grid.cut(w1, "weight").requires_grad_()
    second = grid.out_grid
    w2b = second.cut(w2, "weight").requires_grad_()
    y = multid.linear(multid.linear(xb, w1b, None, grid), w2b, None, second)
    y.backward(torch.ones_like(y))
    sizes = {r.axis: g.size for g in _groups(grid) for r in log if r.axis == g.axis}
    return _received(log, sizes) / 2  # per linear


def _groups(grid):
    return [getattr(grid, f) for f in ("row", "col", "dep", "input", "weight", "output")
            if hasattr(grid, f)]


def _measure_1d(P: int, h: int, tokens: int) -> float:
    import autopar

    model = mlp(h)
    x = torch.randn(1, tokens, h)
    engine = autopar.parallelize(model, P, example_inputs=(x,),
                                 loss_fn=lambda out, t: (out * t).sum(),
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.0),
                                 plan={"tensor": {"size": P, "mode": "1d"}})
    engine.train_step((x,), torch.ones(1, tokens, h))
    tp = [r for r in engine.comm_log if r.axis == "tp" and r.phase in ("forward", "backward")]
    return _received(tp, {"tp": P}) / 2


def worker(rank, P, h, tokens, out_path):
    rows = []
    for mode in tensor_modes(P):
        if mode.name == "1d":
            got = _measure_1d(P, h, tokens)
        else:
            got = _measure_multid(mode.name, P, h, tokens)
        every = [None] * P
        dist.all_gather_object(every, got)
        rows.append({"P": P, "mode": mode.name, "per_rank": every})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256, help="M, tokens per micro-batch")
    args = parser.parse_args()
    h, tokens = args.hidden, args.tokens
    rows = modelled(h, tokens)
    unit = tokens * h * 4  # the measurement runs in fp32
    measured = {}
    for P in MEASURED:
        path = results_path(f"tensor_modes_{P}.json")
        run_world(worker, (P, h, tokens, path), P)
        with open(path) as f:
            for r in json.load(f):
                measured[(r["P"], r["mode"])] = max(r["per_rank"]) / unit
        os.remove(path)
    print(f"one linear layer of an MLP (h = {h}, M = {tokens} tokens): forward + backward "
          "bytes per device, in units of A = M h e")
    head = f"{'P':>3} {'mode':<14} {'model':>8} {'published':>10} {'ratio':>7} {'measured':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        got = measured.get((r["P"], r["mode"]))
        if got is not None and r["mode"] == "2.5d" and (r["q"], r["d"]) != (2, r["P"] // 4):
            got = None
        r["measured"] = got
        cell = f"{got:9.4f}" if got is not None else f"{'-':>9}"
        print(f"{r['P']:>3} {r['label']:<14} {r['model']:8.4f} {r['published']:10.4f} "
              f"{r['published'] / r['model']:7.2f} {cell}")
    worst = max((abs(r["measured"] / r["model"] - 1) for r in rows if r["measured"]),
                default=0.0)
    print(f"largest |measured / model - 1|: {worst:.2%}")
    with open(results_path("tensor_modes.json"), "w") as f:
        json.dump({"hidden": h, "tokens": tokens, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

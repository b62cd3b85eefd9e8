"""What compile can take out of one ZeRO-3 block: CPU seconds of its forward and backward.

    python benchmarks/bench_compile_block.py [--hidden 768] [--tokens 256] [--dp 2]
                                             [--rounds 12] [--inductor JSON]

One process, one thread, no collectives: a GPT block's twelve parameters lie as a ZeRO-3
all-gather leaves them ([dp, chunk]: each rank's piece of every member, padded), and each
variant runs the block's forward and backward from that buffer to the reduce-scatter's
input (the same layout), as a step does between its gather and its reduce-scatter:

    eager      the gather's copy into whole parameters, the eager block, the gradients
               written padded into the reduce buffer (what a ZeRO-3 step runs)
    compiled   the same copies around the block compiled by inductor (`compile=True`)
    raw        one compiled graph from the buffer to the buffer: each rank's piece of a
               weight is a view, a linear is one GEMM per rank's rows (their outputs
               written into the concatenated activation), and the buffer's gradient is the
               reduce-scatter's input, with no copy of a whole parameter either way
    NAME       with --inductor '{"NAME": {option: value}}': compiled as `compiled`, with
               those inductor options (max_autotune, its GEMM backends, ...)

The variants take turns for --rounds rounds after their first (compiling) runs; the
ratios are medians over rounds of the pair's CPU seconds (process time). It also times the
copies alone (the copy into whole parameters and the padded write, per block), prints a
table, writes benchmarks/results/compile_block.json, and exits non-zero unless every
variant's gradients (of the input and of the buffer) equal eager's.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import results_path  # noqa: E402

from autopar.runtime.compile import cpu_options  # noqa: E402
from autopar.runtime.zero import read_padded, write_padded  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


class Layout:
    """A block's members as a ZeRO-3 gather lays them out: chunk k per rank each."""

    def __init__(self, hidden: int, dp: int):
        h = hidden
        self.hidden, self.dp = h, dp
        # ln1 w, b; qkv w, b; proj w, b; ln2 w, b; fc w, b; out w, b (a GPT block's order)
        self.shapes = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,),
                       (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
        self.numels = [torch.Size(s).numel() for s in self.shapes]
        self.chunks = [-(-n // dp) for n in self.numels]
        self.cols = [sum(self.chunks[:i]) for i in range(len(self.chunks))]
        self.chunk = sum(self.chunks)

    def gathered(self, params) -> torch.Tensor:
        buf = torch.empty(self.dp, self.chunk)
        for p, c, k in zip(params, self.cols, self.chunks):
            write_padded(buf[:, c:c + k], p, zero_padding=True)
        return buf

    def whole(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The gather's copy into whole parameters (ZeroThree._finish)."""
        out = torch.empty(sum(self.numels))
        views, off = [], 0
        for n, c, k, s in zip(self.numels, self.cols, self.chunks, self.shapes):
            read_padded(out[off:off + n], buf[:, c:c + k])
            views.append(out[off:off + n].view(s))
            off += n
        return views

    def reduce_input(self, grads) -> torch.Tensor:
        """The reduce-scatter's input, each gradient written padded (ZeroThree.reduce)."""
        buf = torch.empty(self.dp, self.chunk)
        for g, c, k in zip(grads, self.cols, self.chunks):
            write_padded(buf[:, c:c + k], g, zero_padding=True)
        return buf

    def members(self, buf: torch.Tensor) -> list:
        """Each member read from the buffer: a list of per-rank row blocks (views) where
        the pieces split it at rows, else the whole member (a copy, padding cut)."""
        rows = [row.split(self.chunks) for row in buf.unbind(0)]
        out = []
        for i, (n, k, s) in enumerate(zip(self.numels, self.chunks, self.shapes)):
            pieces = [rows[r][i] for r in range(self.dp)]
            if n == self.dp * k and s[0] % self.dp == 0:
                out.append([p.view(s[0] // self.dp, *s[1:]) for p in pieces])
            else:
                out.append(torch.cat(pieces)[:n].view(s))
        return out


def _linear(x, w, b):
    """x @ w.T + b, where w (and b) may be per-rank row blocks: one GEMM per block, the
    outputs concatenated (inductor writes each GEMM into its columns)."""
    if not isinstance(w, list):
        return F.linear(x, w, b)
    bs = b if isinstance(b, list) else [None] * len(w)
    return torch.cat([F.linear(x, wr, br) for wr, br in zip(w, bs)], -1)


def block(x, heads, ln1w, ln1b, qkvw, qkvb, pw, pb, ln2w, ln2b, fcw, fcb, ow, ob):
    """A GPT block as a traced graph runs it: 2-D linears over the batch's tokens."""
    bsz, seq, h = x.shape
    t = x.reshape(bsz * seq, h)
    a = F.layer_norm(t, (h,), _whole(ln1w), _whole(ln1b))
    q, k, v = (z.view(bsz, seq, heads, h // heads).transpose(1, 2)
               for z in _linear(a, qkvw, qkvb).split(h, -1))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t = t + _linear(a.transpose(1, 2).reshape(bsz * seq, h), pw, pb)
    a = F.gelu(_linear(F.layer_norm(t, (h,), _whole(ln2w), _whole(ln2b)), fcw, fcb))
    return (t + _linear(a, ow, ob)).view(bsz, seq, h)


def _whole(p):
    return torch.cat(p) if isinstance(p, list) else p


def _raw_block(x, buf, layout, heads):
    return block(x, heads, *layout.members(buf))


def variants(layout: Layout, heads: int, buf: torch.Tensor, x: torch.Tensor,
             options: dict | None = None) -> dict:
    base = cpu_options()  # as compile=True's regions: the vector width named
    compiled = torch.compile(block, fullgraph=True, dynamic=False, options=base)
    raw = torch.compile(_raw_block, fullgraph=True, dynamic=False, options=base)
    extra = {name: torch.compile(block, fullgraph=True, dynamic=False,
                                 options={**base, **opts})
             for name, opts in (options or {}).items()}

    def around(fn):
        def run():
            params = [p.requires_grad_() for p in layout.whole(buf)]
            xx = x.detach().requires_grad_()
            grads = torch.autograd.grad(fn(xx, heads, *params).sum(), [xx] + params)
            return grads[0], layout.reduce_input(grads[1:])
        return run

    def run_raw():
        b, xx = buf.detach().requires_grad_(), x.detach().requires_grad_()
        return torch.autograd.grad(raw(xx, b, layout, heads).sum(), [xx, b])

    return {"eager": around(block), "compiled": around(compiled), "raw": run_raw,
            **{name: around(fn) for name, fn in extra.items()}}


def _copies(layout: Layout, buf: torch.Tensor, grads) -> float:
    start = time.process_time()
    layout.whole(buf)
    layout.reduce_input(grads)
    return time.process_time() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=256, help="a rank's tokens (2 rows)")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--inductor", default="{}",
                        help="JSON {name: inductor options}: more compiled variants")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layout = Layout(args.hidden, args.dp)
    heads = max(1, args.hidden // 64)
    buf = layout.gathered([torch.randn(s) * 0.02 for s in layout.shapes])
    x = torch.randn(2, args.tokens // 2, args.hidden)
    runs = variants(layout, heads, buf, x, json.loads(args.inductor))
    first = {name: run() for name, run in runs.items()}  # compiles
    worst = 0.0
    for gx, gbuf in first.values():
        for got, want in ((gx, first["eager"][0]), (gbuf, first["eager"][1])):
            worst = max(worst, float(((got - want).abs() / (ATOL + RTOL * want.abs())).max()))
    names, cpu = list(runs), {name: [] for name in runs}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.process_time()
            runs[name]()
            cpu[name].append(time.process_time() - start)
    copies = statistics.median(_copies(layout, buf, [torch.randn(s) for s in layout.shapes])
                               for _ in range(args.rounds))
    eager = cpu["eager"]
    rows = [{"variant": name, "median_cpu_s": statistics.median(cpu[name]),
             "vs_eager": statistics.median(c / e for c, e in zip(cpu[name], eager)),
             "cpu_s": cpu[name]} for name in names]
    print(f"one GPT block, width {args.hidden}, {args.tokens} tokens, dp {args.dp} "
          f"(gathered layout), 1 thread; {args.rounds} rounds, CPU s per forward+backward")
    print(f"{'variant':<10} {'CPU s':>8} {'/eager':>7}")
    for row in rows:
        print(f"{row['variant']:<10} {row['median_cpu_s']:>8.4f} {row['vs_eager']:>7.3f}")
    print(f"copy into whole parameters + padded gradient write: {copies:.4f} s "
          f"({copies / rows[0]['median_cpu_s']:.1%} of eager's block)")
    equal = worst <= 1.0
    print(f"gradients equal to eager's: {'yes' if equal else 'no'} (worst |diff| / "
          f"(atol + rtol |eager|) = {worst:.2f}, rtol {RTOL:g}, atol {ATOL:g})")
    with open(results_path("compile_block.json"), "w") as f:
        json.dump({"hidden": args.hidden, "tokens": args.tokens, "dp": args.dp,
                   "rounds": args.rounds, "copies_cpu_s": copies, "rows": rows,
                   "gradients_equal": equal, "worst_relative_diff": worst}, f, indent=2)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())

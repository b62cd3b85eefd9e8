"""Peak memory per rank with the chunked cross-entropy on and off, beside what the plan says.

    python benchmarks/bench_chunked_loss.py [--vocab 128256] [--seq 2048] [--batch 1]
                                            [--plans data tensor]

A small GPT (2 layers, hidden 64) with a large vocabulary trains two steps per row under
`parallelize(..., chunked_loss=on/off)`, each row in fresh processes (a gloo world of 1 for
"data", of 2 for "tensor": 1D, the vocabulary split): per rank, the peak of the live tensor
bytes the second step made (autopar.runtime.measure.measure_transient_bytes) and the
process's peak resident memory (ru_maxrss). The plan's figure is the chunked loss's effect
(autopar.cost.chunked_loss.effect: the unchunked loss's whole fp32 logits buffers less one
chunk) for that rank's graph and solution; the measured fall is off minus on. Prints the
table and writes benchmarks/results/chunked_loss.json; exits 1 if a fall of live tensor
bytes is more than 10% off the plan.
"""

import argparse
import functools
import json
import os
import resource
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import lm_loss, run_world, write_and_judge  # noqa: E402

PLANS = {"data": (1, {"data": 1}), "tensor": (2, {"tensor": {"size": 2, "mode": "1d"}})}
MiB = 2**20


def _row(rank: int, vocab: int, seq: int, batch: int, plan: dict, chunked: bool,
         out: str) -> None:
    import autopar
    from autopar.cost.chunked_loss import effect
    from autopar.models.gpt import GPT, GPTConfig
    from autopar.runtime.measure import measure_transient_bytes

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, n_layer=2, n_head=2, n_embd=64, block_size=seq))
    x, y = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    engine = autopar.parallelize(model, int(os.environ["WORLD_SIZE"]), example_inputs=(x,),
                                 loss_fn=lm_loss, plan=plan, chunked_loss=chunked,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    loss = engine.train_step(x, y)
    live = measure_transient_bytes(lambda: engine.train_step(x, y))
    solution = engine.train_solution if engine.plan.mesh["tp"] > 1 else None
    said = effect(engine.train_graph, solution, batch // engine.plan.mesh["dp"])
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rank": rank, "loss": loss, "live_peak": live, "fused": engine.chunked_losses,
                   "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "plan_saving": said["saving_bytes"] if said else 0}, f)


def measure(vocab: int, seq: int, batch: int, name: str, chunked: bool) -> list[dict]:
    world, plan = PLANS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row")
        run_world(_row, (vocab, seq, batch, plan, chunked, out), world)
        return [json.load(open(f"{out}.{r}")) for r in range(world)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    args = parser.parse_args()
    rows = []
    print(f"GPT 2 x 64, vocab {args.vocab}, seq {args.seq}, batch {args.batch}; MiB per rank")
    print(f"{'plan':<8} {'rank':>4} {'live off':>9} {'live on':>8} {'fall':>8} {'rss off':>8} "
          f"{'rss on':>8} {'fall':>8} {'plan says':>9} {'live err':>8} {'rss err':>8} "
          f"{'loss off':>9} {'loss on':>9}")
    for name in args.plans:
        off, on = (measure(args.vocab, args.seq, args.batch, name, c) for c in (False, True))
        for a, b in zip(off, on):
            said = b["plan_saving"]
            live, rss = a["live_peak"] - b["live_peak"], a["rss_peak"] - b["rss_peak"]
            row = {"plan": name, "rank": a["rank"], "off": a, "on": b, "plan_saving": said,
                   "live_fall": live, "rss_fall": rss,
                   "error_percent": 100 * (live - said) / said,
                   "rss_error_percent": 100 * (rss - said) / said,
                   "label": f"{name} rank {a['rank']}"}
            rows.append(row)
            print(f"{name:<8} {a['rank']:>4} {a['live_peak'] / MiB:>9.1f} "
                  f"{b['live_peak'] / MiB:>8.1f} {live / MiB:>8.1f} {a['rss_peak'] / MiB:>8.1f} "
                  f"{b['rss_peak'] / MiB:>8.1f} {rss / MiB:>8.1f} {said / MiB:>9.1f} "
                  f"{row['error_percent']:>7.1f}% {row['rss_error_percent']:>7.1f}% "
                  f"{a['loss']:>9.5f} {b['loss']:>9.5f}")
    data = {"vocab": args.vocab, "seq": args.seq, "batch": args.batch, "rows": rows}
    return write_and_judge("chunked_loss.json", data, rows, "label", 10.0)


if __name__ == "__main__":
    sys.exit(main())

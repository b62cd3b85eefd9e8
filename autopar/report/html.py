"""The plan report as one self-contained HTML page: `autopar explain --format html`.

Inline CSS and SVG drawn here (no JavaScript): the step by part, each layer's strategy, the
pipeline schedule per rank (`autopar.cost.schedule.simulate`), memory per rank, traffic per
mesh axis and the runners-up, from `autopar.report.predicted.plan_report`'s data.
"""

from __future__ import annotations

import html
import math

from autopar.cost.schedule import simulate, stage_count
from autopar.modes import (
    AXES,
    CP,
    DP,
    EP,
    FULL,
    MEGATRON_SP,
    NO_RECOMPUTE,
    NO_SP,
    NO_TP,
    ONE_F_ONE_B,
    ORDER,
    PP,
    SELECTIVE,
    TP,
    TP_1D,
    TP_2D,
    TP_3D,
    TP_25D,
)
from autopar.report.predicted import MEMORY_KINDS, counted, seconds_text, size_text

GiB = 1024 ** 3
WIDTH = 1160  # px of the page's content: every chart is drawn to it (or to half of it)

# Colours are chosen per meaning and kept apart from each other's palettes where they sit
# side by side: work (forward blue, backward orange), memory kinds, mesh axes.
STAGE_COLOURS = ("#3a6fb0", "#e07b39", "#4f9d5d", "#c8474f", "#6bb3b0", "#d9b43c",
                 "#9468a8", "#e693a6", "#8a6a50", "#8e9aa6")
MODE_COLOURS = {TP_1D: "#4a4e9c", TP_2D: "#c2185b", TP_25D: "#7cb342", TP_3D: "#6d4c41",
                "replicate": "#8e9aa6", NO_TP: "#d5dae1"}
RECOMPUTE_COLOURS = {NO_RECOMPUTE: "#d5dae1", SELECTIVE: "#f0a35e", FULL: "#c4503c"}
SEQUENCE_COLOURS = ("#d5dae1", "#2a9d8f", "#6bb3b0", "#1f6f66", "#9fd3c7")
WORK_COLOURS = {"F": "#3a6fb0", "B": "#e07b39", "I": "#e07b39", "W": "#4f9d5d",
                "sync": "#8e9aa6", "optimizer": "#5b6470"}
WORK_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient",
              "sync": "data-parallel sync", "optimizer": "optimizer step"}
MEMORY_COLOURS = {"parameters": "#3a6fb0", "gradients": "#e07b39", "optimizer": "#9468a8",
                  "activations": "#4f9d5d", "buffers": "#8e9aa6",
                  "optimizer_step": "#c9a227"}
AXIS_COLOURS = {TP: "#3a6fb0", CP: "#2a9d8f", DP: "#e07b39", PP: "#9468a8",
                EP: "#c2477a"}
OTHER_AXIS_COLOUR = "#c0504d"  # an axis beyond AXIS_COLOURS (a new mode's) still draws
STEP_COLOURS = {"compute": "#3a6fb0", "tensor/sequence comm": "#2a9d8f",
                "pipeline bubble": "#d5dae1", "data-parallel sync": "#e07b39",
                "optimizer": "#5b6470", "transfers and conversions": "#9468a8"}

CSS = """
* { box-sizing: border-box; }
body { margin: 0; background: #f4f5f7; color: #1f2933;
       font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
main { width: %dpx; max-width: 100%%; margin: 0 auto; padding: 20px 0 40px; }
h1 { font-size: 22px; margin: 0 0 2px; }
h2 { font-size: 16px; margin: 0 0 8px; }
.sub { color: #52606d; margin-bottom: 14px; }
section { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 14px 16px;
          margin: 14px 0; }
.cards { display: grid; grid-template-columns: repeat(4, 1fr); gap: 10px; margin: 10px 0; }
.card { background: #f8f9fb; border: 1px solid #e4e7eb; border-radius: 5px; padding: 8px 10px; }
.card b { display: block; font-size: 18px; }
.card span { color: #52606d; font-size: 12px; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 14px; }
.pair section { margin: 0; }
svg.chart { display: block; max-width: 100%%; height: auto; }
svg text { font-family: inherit; fill: #323f4b; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12px; color: #52606d;
          margin-top: 6px; }
.legend i { display: inline-block; width: 11px; height: 11px; border-radius: 2px;
            margin-right: 4px; vertical-align: -1px; }
.caption { font-size: 12px; color: #52606d; margin-top: 6px; }
table { border-collapse: collapse; width: 100%%; font-size: 12.5px; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #e4e7eb;
         vertical-align: top; }
th { color: #52606d; font-weight: 600; }
td.num, th.num { text-align: right; white-space: nowrap; }
tr.chosen td { background: #eef5ee; font-weight: 600; }
ul { margin: 4px 0; padding-left: 20px; }
""" % WIDTH


def plan_html(data: dict, model: str | None = None) -> str:
    """The whole page for a report object (`plan.detail`, or a plan's JSON)."""
    world = data.get("world") or {}
    title = "autopar plan" + (f": {model}" if model else "") + (
        f" on {world['devices']} x {world['device']}" if world else "")
    body = [_header(data, model), _section("Predicted step", _step_chart(data)),
            _section("Strategy per layer", _strategy_chart(data)),
            _section("Pipeline schedule", _gantt_chart(data)),
            '<div class="pair">' + _section("Memory per device", _memory_chart(data))
            + _section("Communication by mesh axis", _comm_chart(data)) + "</div>",
            _section("Alternatives that lost", _alternatives(data)),
            *([_section("Expert layout", _experts_table(data))] if data.get("experts") else []),
            _section("Layers by kind", _kinds_table(data))]
    notes = _notes(data)
    if notes:
        body.append(_section("Notes", notes))
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{_esc(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<main>\n"
            + "\n".join(body) + "\n</main>\n</body>\n</html>\n")


# ----------------------------------------------------------------------------- drawing


class Svg:
    """An SVG drawing collected element by element; `render` wraps it in an <svg> with a
    stable id and the class "chart", which tests and stylesheets find it by."""

    def __init__(self, width: float, height: float):
        self.width, self.height, self.parts = width, height, []

    def rect(self, x, y, w, h, fill, title: str | None = None, **attrs) -> None:
        extra = "".join(f' {k.replace("_", "-")}="{_esc(v)}"' for k, v in attrs.items())
        head = (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0):.2f}" height="{max(h, 0):.2f}"'
                f' fill="{fill}"{extra}')
        self.parts.append(head + (f"><title>{_esc(title)}</title></rect>" if title else "/>"))

    def text(self, x, y, s: str, size: float = 11, anchor: str = "start", **attrs) -> None:
        extra = "".join(f' {k.replace("_", "-")}="{_esc(v)}"' for k, v in attrs.items())
        self.parts.append(f'<text x="{x:.2f}" y="{y:.2f}" font-size="{size}" '
                          f'text-anchor="{anchor}"{extra}>{_esc(s)}</text>')

    def line(self, x1, y1, x2, y2, stroke="#9aa5b1", dash: str | None = None) -> None:
        self.parts.append(f'<line x1="{x1:.2f}" y1="{y1:.2f}" x2="{x2:.2f}" y2="{y2:.2f}" '
                          f'stroke="{stroke}"' + (f' stroke-dasharray="{dash}"' if dash else "")
                          + "/>")

    def render(self, chart_id: str, label: str) -> str:
        return (f'<svg class="chart" id="{chart_id}" role="img" aria-label="{_esc(label)}" '
                f'width="{self.width:.0f}" height="{self.height:.0f}" '
                f'viewBox="0 0 {self.width:.0f} {self.height:.0f}">'
                + "".join(self.parts) + "</svg>")


def _legend(items) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{colour}"></i>{_esc(name)}</span>'
        for name, colour in items) + "</div>"


def _section(title: str, inner: str) -> str:
    return f"<section>\n<h2>{_esc(title)}</h2>\n{inner}\n</section>"


def _esc(value) -> str:
    return html.escape(str(value), quote=True)


def _ticks(top: float, count: int = 6) -> list[float]:
    """Round tick values from 0 to past `top` (steps of 1, 2 or 5 x a power of ten)."""
    if top <= 0:
        return [0.0]
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(k * power for k in (1, 2, 5, 10) if k * power >= raw)
    return [i * step for i in range(int(top / step + 1e-9) + 1)]


def _time_unit(top: float) -> tuple[float, str]:
    return (1.0, "s") if top >= 1 else (1e3, "ms") if top >= 1e-3 else (1e6, "us")


# ----------------------------------------------------------------------------- header



def _in_order(by_axis: dict, order: tuple) -> list[str]:
    """The axes of `by_axis` in `order`, then any other (a mode's axis outside the world's
    factorisation) as they come."""
    return [a for a in order if a in by_axis] + [a for a in by_axis if a not in order]


def _axis_colour(axis: str) -> str:
    return AXIS_COLOURS.get(axis, OTHER_AXIS_COLOUR)


def _header(data: dict, model: str | None) -> str:
    world, mesh, pred = data.get("world") or {}, data["mesh"], data["predicted"]
    pipe, zero, tensor = data["pipeline"], data["zero"], data["tensor"]
    search, seq = data.get("search", {}), data.get("sequence") or {}
    capacity = (data.get("memory_capacity") or {}).get("usable_bytes")
    mesh_text = " ".join(f"{axis}{mesh[axis]}" for axis in _in_order(mesh, AXES))
    tensor_text = tensor["mode"] + (f" depth {tensor['depth']}" if tensor["mode"] == TP_25D
                                    else "") + (" + Megatron-SP" if tensor["sequence_parallel"]
                                                else "")
    if seq.get("mode"):
        tensor_text += f", {seq['mode']} over cp"
    pipeline_text = (f"{pipe['schedule']}" + (f" x{pipe['chunks']}" if pipe.get("chunks", 1) > 1
                                              else "")) if mesh[PP] > 1 else "no pipeline"
    memory = size_text(pred.get("memory_per_device_bytes", 0))
    cards = [
        ("predicted step", seconds_text(pred.get("step_time_s", 0.0))),
        ("tokens per second", f"{pred.get('tokens_per_s', 0):,.0f}"),
        ("model FLOPs utilisation", f"{100 * pred.get('mfu', 0):.1f}%"),
        ("memory per device" + (f" of {size_text(capacity)} usable" if capacity else ""), memory),
        ("mesh (tp innermost)", mesh_text),
        ("tensor / sequence", tensor_text),
        ("pipeline", f"{pipeline_text}, {pipe['microbatches']} x {pipe['micro_batch_size']}"),
        ("ZeRO / recompute", f"stage {zero['stage']}" + (" + offload" if zero["offload"] else "")
         + f" / {data.get('recompute', NO_RECOMPUTE)}"),
    ]
    sub = []
    if world:
        sub.append(f"{world['devices']} x {world['device']} ({world['per_node']} per node)")
    if search.get("global_batch"):
        sub.append(f"global batch {search['global_batch']}")
    if search.get("dtype"):
        sub.append(search["dtype"])
    if "candidates" in search:
        sub.append(f"{search['candidates']} candidates searched in {search.get('time_s', 0):.2f} s")
    return ("<header>\n<h1>autopar plan" + (f": {_esc(model)}" if model else "") + "</h1>\n"
            f'<div class="sub">{_esc(" · ".join(sub))}</div>\n<div class="cards">'
            + "".join(f"<div class=\"card\"><b>{_esc(v)}</b><span>{_esc(k)}</span></div>"
                      for k, v in cards) + "</div>\n</header>")


def _step_chart(data: dict) -> str:
    """One bar: the step's seconds by what they are spent on, as the planner summed them."""
    pred = data["predicted"]
    step = pred.get("step_time_s", 0.0)
    parts = [("compute", pred.get("compute_s", 0.0)),
             ("tensor/sequence comm", pred.get("tp_comm_s", 0.0)),
             ("pipeline bubble", pred.get("bubble_s", 0.0)),
             ("data-parallel sync", pred.get("dp_comm_s", 0.0)),
             ("optimizer", pred.get("optimizer_s", 0.0))]
    rest = step - sum(v for _, v in parts)
    if rest > 1e-6 * step:  # stage-to-stage transfers and layout conversions on the slowest rank
        parts.append(("transfers and conversions", rest))
    total = max(step, sum(v for _, v in parts), 1e-30)
    svg = Svg(WIDTH - 34, 34)
    x, width = 0.0, WIDTH - 34
    for name, value in parts:
        w = width * value / total
        svg.rect(x, 2, w, 30, STEP_COLOURS[name],
                 f"{name}: {seconds_text(value)} ({100 * value / total:.1f}% of the step)")
        if w > 90:
            svg.text(x + 6, 21, f"{name} {seconds_text(value)}", 11, fill="#fff"
                     if name != "pipeline bubble" else "#323f4b")
        x += w
    return (svg.render("step", f"predicted step of {seconds_text(step)} by part")
            + _legend((f"{n} {seconds_text(v)}", STEP_COLOURS[n]) for n, v in parts))


# ----------------------------------------------------------------------------- strategy


def _sequence_label(layer: dict, data: dict) -> str:
    seq = (data.get("sequence") or {}).get("mode")
    parts = [layer["sp"]] if layer.get("sp", NO_SP) != NO_SP else []
    if seq and data["mesh"][CP] > 1:
        parts.append(f"{seq} over cp")
    return " + ".join(parts) or NO_SP


def _strategy_chart(data: dict) -> str:
    """A column per layer, a row per choice the planner made for it."""
    layers = data.get("layers") or []
    if not layers:
        return '<p class="caption">This report lists no layers.</p>'
    mesh = data["mesh"]
    owner = {st["stage"]: st["rank"] for st in data.get("stages", [])}
    seq_values = list(dict.fromkeys(_sequence_label(lp, data) for lp in layers))
    seq_colours = {v: SEQUENCE_COLOURS[0] if v == NO_SP else
                   SEQUENCE_COLOURS[1 + i % (len(SEQUENCE_COLOURS) - 1)]
                   for i, v in enumerate(v for v in seq_values if v != NO_SP)}
    seq_colours.setdefault(NO_SP, SEQUENCE_COLOURS[0])

    def mode_of(lp):
        return lp["tp_mode"] if mesh[TP] > 1 else NO_TP

    def rank_of(lp):  # the device holding the stage: with ZB-V stages s and 2p-1-s share one
        return owner.get(lp["stage"], lp["stage"])

    rows = [("pipeline stage", lambda lp: STAGE_COLOURS[rank_of(lp) % len(STAGE_COLOURS)]),
            (f"tensor (tp {mesh[TP]})", lambda lp: MODE_COLOURS.get(mode_of(lp), "#8e9aa6")),
            ("sequence", lambda lp: seq_colours[_sequence_label(lp, data)]),
            ("recompute", lambda lp: RECOMPUTE_COLOURS.get(lp["recompute"], "#8e9aa6"))]
    timed = all("time_s" in lp for lp in layers)
    left, top, row_h, bar_h = 112, 4, 20, 56
    n = len(layers)
    cell = (WIDTH - 34 - left) / n
    label_all = n <= 48  # else: label the first layer of each stage
    labels_h = 92
    height = top + len(rows) * (row_h + 3) + (bar_h + 8 if timed else 0) + labels_h
    svg = Svg(WIDTH - 34, height)
    slowest = max((lp.get("time_s", 0.0) for lp in layers), default=0.0) or 1.0
    for r, (name, _) in enumerate(rows):
        svg.text(left - 8, top + r * (row_h + 3) + 14, name, 11, "end")
    if timed:
        svg.text(left - 8, top + len(rows) * (row_h + 3) + bar_h / 2 + 4, "time / micro-batch",
                 11, "end")
    for i, lp in enumerate(layers):
        x = left + i * cell
        rank = owner.get(lp["stage"])
        tip = (f"{lp['name']}: stage {lp['stage']}" + (f" (rank {rank})" if rank is not None
                                                       else "")
               + f", tensor {mode_of(lp)}, sequence {_sequence_label(lp, data)}, recompute "
               f"{lp['recompute']}")
        if timed:
            tip += (f", {seconds_text(lp['time_s'])} per micro-batch (forward, backward, "
                    f"recompute, comm), activations {size_text(lp.get('activation_bytes', 0))},"
                    f" parameters {size_text(lp.get('param_bytes', 0))} per device")
        for r, (_, colour) in enumerate(rows):
            svg.rect(x + 0.5 if cell > 3 else x, top + r * (row_h + 3),
                     cell - 1 if cell > 3 else cell, row_h, colour(lp), tip)
        if timed:
            y0 = top + len(rows) * (row_h + 3)
            h = bar_h * lp["time_s"] / slowest
            svg.rect(x + 0.5 if cell > 3 else x, y0 + bar_h - h, cell - 1 if cell > 3 else cell,
                     h, "#52606d", tip)
        first_of_stage = i == 0 or layers[i - 1]["stage"] != lp["stage"]
        if label_all or first_of_stage:
            y = height - labels_h + 8
            svg.text(x + cell / 2, y, lp["name"], 10, "end",
                     transform=f"rotate(-55 {x + cell / 2:.2f} {y:.2f})")
            if not label_all:
                svg.line(x, top, x, y - 6, "#323f4b", "2 2")
    by_rank: dict = {}
    for lp in layers:
        by_rank.setdefault(rank_of(lp), set()).add(lp["stage"])
    legend = [((f"rank {r}: stage" if owner else "stage") + ("s " if len(st) > 1 else " ")
               + ",".join(map(str, sorted(st))), STAGE_COLOURS[r % len(STAGE_COLOURS)])
              for r, st in sorted(by_rank.items())][:len(STAGE_COLOURS)]
    legend += [(f"tensor {m}", MODE_COLOURS.get(m, "#8e9aa6"))
               for m in dict.fromkeys(mode_of(lp) for lp in layers)]
    legend += [(f"sequence {v}", seq_colours[v]) for v in seq_values]
    legend += [(f"recompute {v}", RECOMPUTE_COLOURS.get(v, "#8e9aa6"))
               for v in dict.fromkeys(lp["recompute"] for lp in layers)]
    caption = (f"{n} layers in order; hover a column for the layer's name and numbers. "
               "Stages are coloured by the pipeline rank that runs them"
               + (", ten colours round" if len(by_rank) > len(STAGE_COLOURS) else "") + "."
               + ("" if label_all else " Labels mark the first layer of each stage."))
    return (svg.render("strategy", f"strategy of {n} layers") + _legend(legend)
            + f'<div class="caption">{_esc(caption)}</div>')


# ----------------------------------------------------------------------------- schedule


def _play(data: dict):
    """(timeline, schedule, unit costs?) of the plan's pipeline, played with the stages'
    costs from the report, or with unit costs (forward 1, backward 2) without them."""
    mesh, pipe = data["mesh"], data["pipeline"]
    pp, m = mesh[PP], pipe["microbatches"]
    chunks = pipe.get("chunks", 1) or 1
    # one rank runs its micro-batches one after another: 1F1B on one stage is exactly that
    schedule = pipe["schedule"] if pp > 1 else ONE_F_ONE_B
    n = stage_count(schedule, pp, chunks)
    stages = data.get("stages") or []
    if len(stages) == n:
        forward = [st["forward_s"] for st in stages]
        backward = [st["backward_s"] for st in stages]
        p2p = ((data.get("comm_by_axis") or {}).get(PP) or {}).get("per_transfer_s", 0.0)
        return simulate(schedule, pp, m, chunks, forward=forward, backward=backward,
                        p2p=p2p), schedule, False
    return simulate(schedule, pp, m, chunks, forward=1.0, backward=2.0), schedule, True


def _gantt_chart(data: dict) -> str:
    """Each rank's forward, backward (or input and weight gradient) boxes per micro-batch
    over one step, then the step's data-parallel sync and optimizer update."""
    mesh, pipe, pred = data["mesh"], data["pipeline"], data["predicted"]
    pp, m = mesh[PP], pipe["microbatches"]
    timeline, schedule, unit = _play(data)
    tail = [] if unit else [("sync", pred.get("dp_comm_s", 0.0)),
                            ("optimizer", pred.get("optimizer_s", 0.0))]
    total = timeline.step_s + sum(d for _, d in tail) or 1.0
    scale, unit_name = (1.0, "units") if unit else _time_unit(total)
    left, top, lane, gap = 112, 6, 26, 6
    plot = WIDTH - 34 - left - 10
    height = top + pp * (lane + gap) + 34
    svg = Svg(WIDTH - 34, height)
    owner_stages = {r["rank"]: r["stages"] for r in data.get("ranks", [])}

    def x_of(t):
        return left + plot * t / total

    for tick in _ticks(total * scale):
        x = x_of(tick / scale)
        svg.line(x, top, x, top + pp * (lane + gap), "#e4e7eb")
        svg.text(x, top + pp * (lane + gap) + 14, f"{tick:g}", 10, "middle")
    svg.text(left + plot, top + pp * (lane + gap) + 28, f"time ({unit_name})", 10, "end")
    kinds = set()
    for r in range(pp):
        y = top + r * (lane + gap)
        svg.rect(left, y, plot, lane, "#f1f3f5")
        svg.text(left - 8, y + 12, f"rank {r}" if pp > 1 else "one device", 11, "end")
        if owner_stages.get(r):
            svg.text(left - 8, y + 23, "stages " + ",".join(map(str, owner_stages[r])), 9, "end",
                     fill="#7b8794")
        for kind, stage, micro, begin, end in timeline.spans[r]:
            kinds.add(kind)
            w = x_of(end) - x_of(begin)
            colour = WORK_COLOURS[kind]
            svg.rect(x_of(begin), y + 1, w, lane - 2, colour,
                     f"rank {r}: {WORK_NAMES[kind]} of micro-batch {micro} on stage {stage}, "
                     f"{begin * scale:.4g}-{end * scale:.4g} {unit_name}",
                     stroke="#fff", stroke_width="0.5",
                     **({"fill_opacity": "0.75"} if kind == "I" else {}))
            if w > 16:
                svg.text(x_of(begin) + w / 2, y + lane / 2 + 4, str(micro), 9, "middle",
                         fill="#fff")
        t = timeline.step_s
        for kind, d in tail:
            kinds.add(kind)
            svg.rect(x_of(t), y + 1, x_of(t + d) - x_of(t), lane - 2, WORK_COLOURS[kind],
                     f"rank {r}: {WORK_NAMES[kind]}, {seconds_text(d)}")
            t += d
    order = [k for k in ("F", "B", "I", "W", "sync", "optimizer") if k in kinds]
    legend = _legend([(WORK_NAMES[k], WORK_COLOURS[k]) for k in order]
                     + [("idle (bubble, waiting for a transfer)", "#f1f3f5")])
    idle = timeline.idle
    if pp > 1:
        caption = (f"{schedule} over {pp} ranks, {counted(m, 'micro-batch', 'micro-batches')} of "
                   f"{pipe['micro_batch_size']}; idle per rank "
                   + ", ".join(f"{100 * x:.0f}%" for x in idle) + ".")
    else:
        caption = (f"No pipeline: one stage holds every layer and runs its "
                   f"{counted(m, 'micro-batch', 'micro-batches')} one after another, "
                   "accumulating gradients.")
    if unit:
        caption += (" The report carries no per-stage costs, so the schedule is drawn with unit"
                    " costs (forward 1, backward 2).")
    else:
        closed = pred.get("step_time_s", 0.0) - sum(d for _, d in tail)
        caption += (f" Simulated pipeline {seconds_text(timeline.step_s)}, then data-parallel "
                    f"sync and optimizer: {seconds_text(total)} in all (the planner's closed "
                    f"form: pipeline {seconds_text(closed)}, step "
                    f"{seconds_text(pred.get('step_time_s', 0.0))}).")
    return (svg.render("gantt", f"{schedule} schedule of {m} micro-batches on {pp} ranks")
            + legend + f'<div class="caption">{_esc(caption)}</div>')


# ----------------------------------------------------------------------------- memory


def _memory_chart(data: dict) -> str:
    """A stacked bar per pipeline rank (every data, sequence and tensor rank of one
    pipeline rank holds the same), with the device's memory and the usable part of it."""
    ranks = data.get("ranks")
    if ranks:
        bars = [(f"rank {r['rank']}" if len(ranks) > 1 else "every device", r["memory_bytes"])
                for r in ranks]
        note = ""
    else:
        bars = [("worst device", data["predicted"].get("memory_breakdown_bytes", {}))]
        note = " The report holds the worst device's memory only."
    capacity = data.get("memory_capacity") or {}
    tallest = max([sum(b.values()) for _, b in bars] + [1])
    # the capacity lines join the scale when the bars reach a third of it; a small model
    # would otherwise be drawn as a flat line at the bottom
    shown = {k: capacity[k] for k in ("device_bytes", "usable_bytes")
             if k in capacity and capacity[k] <= 3 * tallest}
    top = max([tallest * 1.08, *shown.values()])
    width, height = (WIDTH - 34 - 14) / 2 - 34, 300
    left, bottom, head = 46, 40, 10
    plot_h = height - bottom - head
    svg = Svg(width, height)

    def y_of(nbytes):
        return head + plot_h * (1 - nbytes / top)

    for tick in _ticks(top / GiB, 5):
        y = y_of(tick * GiB)
        svg.line(left, y, width - 4, y, "#e4e7eb")
        svg.text(left - 6, y + 4, f"{tick:g}", 10, "end")
    svg.text(4, head + 2, "GiB", 10)
    slot = (width - left - 8) / len(bars)
    bar_w = min(60.0, slot * 0.7)
    for i, (name, kinds) in enumerate(bars):
        x = left + 4 + i * slot + (slot - bar_w) / 2
        level = 0.0
        for kind in MEMORY_KINDS:
            value = kinds.get(kind, 0)
            svg.rect(x, y_of(level + value), bar_w, y_of(level) - y_of(level + value),
                     MEMORY_COLOURS[kind], f"{name}: {kind} {size_text(value)}")
            level += value
        svg.text(x + bar_w / 2, y_of(level) - 4, f"{level / GiB:.1f}", 9, "middle")
        if len(bars) <= 16 or i % max(1, len(bars) // 16) == 0:
            svg.text(x + bar_w / 2, height - bottom + 14, name.replace("rank ", ""), 10,
                     "middle")
    svg.text(left + (width - left) / 2, height - 8, "pipeline rank" if len(bars) > 1 else "",
             10, "middle")
    for key, label, dash in (("device_bytes", "device", None), ("usable_bytes", "usable", "5 3")):
        if key in shown:
            y = y_of(capacity[key])
            svg.line(left, y, width - 4, y, "#c4503c", dash)
            svg.text(width - 6, y - 3, f"{label} {size_text(capacity[key])}", 10, "end",
                     fill="#c4503c")
    if capacity and not shown:
        note += (f" The device's {size_text(capacity['device_bytes'])} "
                 f"({size_text(capacity['usable_bytes'])} usable) lie far above this scale.")
    legend = _legend((k, MEMORY_COLOURS[k]) for k in MEMORY_KINDS)
    caption = ("Per device of each pipeline rank: parameters, gradients and optimizer states "
               "after ZeRO's sharding, activations of the micro-batches the schedule keeps in "
               "flight, communication buffers, and what the optimizer step's temporaries add "
               "beyond the activations and buffers the backward freed." + note)
    return (svg.render("memory", "memory per device by kind") + legend
            + f'<div class="caption">{_esc(caption)}</div>')


# ----------------------------------------------------------------------------- communication


def _comm_chart(data: dict) -> str:
    """Seconds per step on each mesh axis (bar), with the bytes a device sends (label)."""
    mesh, pred = data["mesh"], data["predicted"]
    comm = data.get("comm_by_axis")
    note = ""
    if not comm:
        note = (" The report has no per-axis detail: tp and cp are shown together, from the"
                " predicted totals.")
        comm = {TP: {"seconds": pred.get("tp_comm_s", 0.0), "bytes": 0, "size": mesh[TP],
                       "carries": "tensor and sequence parallelism"},
                DP: {"seconds": pred.get("dp_comm_s", 0.0), "bytes": 0, "size": mesh[DP],
                       "carries": "gradient sync"}}
    axes = _in_order(comm, ORDER)
    width, height = (WIDTH - 34 - 14) / 2 - 34, 300
    left, right, head, row = 70, 8, 16, (300 - 16 - 24) / max(1, len(axes))
    plot = width - left - right
    top = max([comm[a]["seconds"] for a in axes] + [1e-30])
    scale, unit_name = _time_unit(top)
    svg = Svg(width, height)
    for i, axis in enumerate(axes):
        entry = comm[axis]
        y = head + i * row
        bar = min(26.0, row * 0.45)
        svg.text(left - 8, y + bar / 2 + 4, f"{axis} x{entry['size']}", 12, "end")
        svg.rect(left, y, plot, bar, "#f1f3f5")
        w = plot * entry["seconds"] / top
        svg.rect(left, y, w, bar, _axis_colour(axis),
                 f"{axis}: {seconds_text(entry['seconds'])} and {size_text(entry['bytes'])} per "
                 f"device per step; {entry.get('carries', '')}")
        if entry["size"] == 1:
            label = "size 1: no traffic"
        elif entry["seconds"] == 0 and entry["bytes"] > 0:
            label = f"hidden behind compute, {size_text(entry['bytes'])} per step"
        else:
            label = f"{seconds_text(entry['seconds'])}, {size_text(entry['bytes'])} per step"
        svg.text(left + 4, y + bar + 13, label, 11)
        svg.text(left + 4, y + bar + 25, entry.get("carries", ""), 9, fill="#7b8794")
    svg.text(left, height - 4, f"seconds per step on the slowest rank (longest bar "
             f"{top * scale:.3g} {unit_name})", 10)
    caption = ("Time each axis's traffic adds to a step (what compute does not hide) and the "
               "bytes one device sends over it." + note)
    return (svg.render("comm", "communication per mesh axis")
            + _legend((a, _axis_colour(a)) for a in axes)
            + f'<div class="caption">{_esc(caption)}</div>')


# ----------------------------------------------------------------------------- tables


def _alternatives(data: dict) -> str:
    """The chosen plan, then each runner-up: its time, memory and why it lost."""
    search, pred = data.get("search", {}), data["predicted"]
    alternatives = search.get("alternatives") or []
    best = pred.get("step_time_s", 0.0)
    chosen = _esc(search.get("winner", "this plan"))
    rows = [f'<tr class="chosen"><td class="num">1</td><td>{chosen}</td>'
            f'<td class="num">{_esc(seconds_text(best))}</td><td class="num">-</td>'
            f'<td class="num">{_esc(size_text(pred.get("memory_per_device_bytes", 0)))}</td>'
            f"<td>chosen: fastest plan that fits</td></tr>"]
    for k, alt in enumerate(alternatives, 2):
        step, mem = alt.get("step_time_s"), alt.get("memory_per_device_bytes")
        slower = f"{100 * (step / best - 1):+.1f}%" if step and best and alt.get("fits", True) \
            else "-"
        rows.append(f'<tr><td class="num">{k}</td><td>{_esc(alt["plan"])}</td>'
                    f'<td class="num">{_esc(seconds_text(step) if step else "-")}</td>'
                    f'<td class="num">{_esc(slower)}</td>'
                    f'<td class="num">{_esc(size_text(mem) if mem else "-")}</td>'
                    f'<td>{_esc(alt["reason"])}</td></tr>')
    if not alternatives:
        rows.append('<tr><td></td><td colspan="5">No runner-up: every other plan was fixed '
                    'away by the constraints.</td></tr>')
    return ('<table id="alternatives"><thead><tr><th class="num">#</th><th>plan</th>'
            '<th class="num">step</th><th class="num">vs chosen</th>'
            '<th class="num">memory / device</th><th>why it lost</th></tr></thead><tbody>'
            + "".join(rows) + "</tbody></table>")


def _experts_table(data: dict) -> str:
    """The MoE layers' experts over the ep axis, tokens per expert and all-to-all traffic."""
    e = data["experts"]
    rows = [("experts per MoE layer (top-k)", f"{e['experts']} (top-{e['top_k']}), "
             f"{e['moe_layers']} layers"),
            *([("dense layers (no experts, no all-to-all)", e["dense_layers"])]
              if e.get("dense_layers") else []),
            ("expert-parallel size ep", e[EP]),
            ("experts per rank", e["experts_per_rank"]),
            ("expert weights per rank", size_text(e["expert_param_bytes_per_rank"])),
            ("tokens per expert per micro-batch (predicted, balanced)",
             f"{e['tokens_per_expert_per_microbatch']:,.0f}"),
            ("on the busiest rank (x routing imbalance)",
             f"{e['tokens_per_expert_busiest']:,.0f} (x{e['routing_imbalance']:.3f}, "
             f"{e['imbalance_source']})"),
            ("all-to-alls on ep per step (slowest rank)", e["all_to_alls_per_step"]),
            ("all-to-all bytes sent / seconds per step",
             f"{size_text(e['all_to_all_bytes_per_step'])} / "
             f"{seconds_text(e['all_to_all_s_per_step'])}")]
    return ('<table id="experts"><tbody>' + "".join(
        f"<tr><td>{_esc(k)}</td><td class=\"num\">{_esc(v)}</td></tr>" for k, v in rows)
        + "</tbody></table>")


def _kinds_table(data: dict) -> str:
    kinds = data.get("layer_kinds") or []
    if not kinds:
        return '<p class="caption">This report has no per-kind costs.</p>'
    rows = []
    for k in kinds:
        pm = k["per_micro_batch"]
        strategy = k["tp_mode"] + (" + SP" if k["sp"] == MEGATRON_SP else "") + (
            f", recompute {k['recompute']}" if k["recompute"] != NO_RECOMPUTE else "")
        detail = ", ".join(k.get("strategies") or [])
        colls = "; ".join(f"{c['phase']} {c['op']} on {c['axis']} {size_text(c['bytes'])}"
                          for c in k.get("collectives", []))
        compute = pm["forward_s"] + pm["backward_s"] + pm["recompute_s"]
        numbers = (k["layers"], seconds_text(compute),
                   seconds_text(pm["comm_s"]), size_text(pm["activation_bytes"]),
                   size_text(k["param_bytes_per_device"]))
        rows.append(f"<tr><td>{_esc(k['span'])}</td>"
                    + "".join(f'<td class="num">{_esc(v)}</td>' for v in numbers[:1])
                    + f"<td>{_esc(strategy)}</td>"
                    + "".join(f'<td class="num">{_esc(v)}</td>' for v in numbers[1:])
                    + f"<td>{_esc(detail)}" + (f"<br>{_esc(colls)}" if colls else "")
                    + "</td></tr>")
    return ('<table id="kinds"><thead><tr><th>layers</th><th class="num">n</th>'
            '<th>strategy</th><th class="num">compute / micro-batch</th>'
            '<th class="num">comm</th><th class="num">activations / device</th>'
            '<th class="num">parameters / device</th><th>ops and collectives</th></tr></thead>'
            "<tbody>" + "".join(rows) + "</tbody></table>")


def _notes(data: dict) -> str:
    items = [f"runs replicated: {g['op']}: {g['note']}" for g in data.get("replicated_groups", [])]
    items += list(data.get("notes", []))
    items += [f"left out of the search: {n}" for n in data.get("search", {}).get("left_out", [])]
    return ("<ul>" + "".join(f"<li>{_esc(n)}</li>" for n in items) + "</ul>") if items else ""

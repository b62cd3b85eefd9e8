"""`autopar explain --format html`: one self-contained page with the plan's charts.

Two plans, both quick to search: gpt-tiny on 4 devices without a pipeline, and an 8-block
GPT on 16 devices with a two-rank zero-bubble pipeline (forward, input-gradient and
weight-gradient boxes). The page is checked as text and through html.parser (every chart
drawn from the report's own numbers, nothing fetched from outside, tags balanced), and in
headless Chromium (every chart laid out with visible elements, no resource requested, a
screenshot with the charts' colours in it). Chromium is installed by .ci/run; without it
the browser tests fail and say how to install it.
"""

from __future__ import annotations

import html
import json
import re
from collections import Counter
from html.parser import HTMLParser

import pytest
from chromium import ChromiumMissing, find_chromium, probe, read_png, screenshot

from autopar.cli import main
from autopar.report.html import AXIS_COLOURS, MEMORY_COLOURS, WORK_COLOURS, plan_html

CHARTS = ("step", "strategy", "gantt", "memory", "comm")
PIPELINE_SPEC = "gpt:layers=8,hidden=256,heads=8,vocab=1024,seq=256"
PLANS = {
    "single": ["gpt-tiny", "--world", "4", "--batch", "8", "--pp", "1"],
    "pipeline": [PIPELINE_SPEC, "--world", "16", "--batch", "64", "--pp", "2", "--schedule",
                 "zero_bubble"],
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Per plan: the report data (`--format json`), the page drawn from it, its path."""
    out = tmp_path_factory.mktemp("reports")
    made = {}
    for name, argv in PLANS.items():
        data_path = out / f"{name}.json"
        assert main(["explain", *argv, "--format", "json", "-o", str(data_path)]) == 0
        data = json.loads(data_path.read_text())
        page = plan_html(data, model=argv[0])
        path = out / f"{name}.html"
        path.write_text(page)
        made[name] = (data, page, path)
    return made


class Page(HTMLParser):
    """The page's elements: tag nesting checked as it parses, each chart's elements
    counted, every attribute that names a resource kept."""

    VOID = {"meta", "br", "img", "link", "input", "hr", "source", "col", "wbr"}

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.stack, self.errors, self.tags = [], [], Counter()
        self.charts: dict[str, Counter] = {}
        self.titles: dict[str, list[str]] = {}
        self.links, self.chart, self.in_title = [], None, False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self._element(tag, dict(attrs))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self._element(tag, dict(attrs))

    def _element(self, tag, attrs):
        self.tags[tag] += 1
        self.links += [v for k, v in attrs.items() if k in ("src", "href", "xlink:href", "data")]
        if tag == "svg":
            assert self.chart is None, "charts do not nest"
            assert "chart" in attrs.get("class", "").split(), attrs
            self.chart = attrs["id"]
            self.charts[self.chart] = Counter()
            self.titles[self.chart] = []
        elif self.chart is not None:
            self.charts[self.chart][tag] += 1
        self.in_title = tag == "title" and self.chart is not None

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
            return
        self.stack.pop()
        if tag == "svg":
            self.chart = None
        self.in_title = False

    def handle_data(self, data):
        if self.in_title:
            self.titles[self.chart].append(data)


@pytest.mark.parametrize("name", PLANS)
def test_every_chart_is_drawn_and_the_page_parses(reports, name):
    data, page, _ = reports[name]
    parsed = Page(page)
    assert not parsed.errors and not parsed.stack, (parsed.errors, parsed.stack)
    assert page.startswith("<!DOCTYPE html>") and parsed.tags["style"] == 1
    assert set(parsed.charts) == set(CHARTS)
    for chart in CHARTS:
        assert parsed.charts[chart]["rect"] > 0, chart
        assert parsed.charts[chart]["text"] > 0, chart
    # one strategy column per layer, four choices each (+ a time bar), each named on hover
    strategy = parsed.titles["strategy"]
    assert len(strategy) == 5 * len(data["layers"])
    assert {t.split(":")[0] for t in strategy} == {lp["name"] for lp in data["layers"]}
    # the memory chart stacks the six kinds for every pipeline rank
    assert parsed.charts["memory"]["rect"] == 6 * data["mesh"]["pp"]
    assert parsed.tags["table"] == 2 and 'id="alternatives"' in page


@pytest.mark.parametrize("name", PLANS)
def test_the_page_needs_nothing_from_outside(reports, name):
    _, page, _ = reports[name]
    parsed = Page(page)
    assert parsed.links == [], parsed.links
    assert "http://" not in page and "https://" not in page
    assert parsed.tags["script"] == 0 and parsed.tags["link"] == 0 and parsed.tags["img"] == 0
    assert "@import" not in page and "url(" not in page


def test_the_gantt_chart_draws_every_action_of_the_schedule(reports):
    data, page, _ = reports["pipeline"]
    titles = Page(page).titles["gantt"]
    m = data["pipeline"]["microbatches"]
    assert data["mesh"]["pp"] == 2 and data["pipeline"]["schedule"] == "zero_bubble"
    for rank in (0, 1):
        mine = [t for t in titles if t.startswith(f"rank {rank}:")]
        kinds = Counter(t.split(": ")[1].split(" of ")[0] for t in mine)
        # ZB-V: two stages per rank, each micro-batch's backward split into I and W
        assert kinds["forward"] == kinds["input gradient"] == kinds["weight gradient"] == 2 * m
        assert "backward" not in kinds
        # after the pipeline: the step's data-parallel sync and optimizer update
        assert [t.split(": ")[1].split(",")[0] for t in mine[-2:]] == [
            "data-parallel sync", "optimizer step"]
    assert "zero_bubble over 2 ranks" in page


def test_without_a_pipeline_one_lane_runs_the_micro_batches_in_turn(reports):
    data, page, _ = reports["single"]
    assert data["mesh"]["pp"] == 1
    titles = Page(page).titles["gantt"]
    work = [t for t in titles if " of micro-batch " in t]
    m = data["pipeline"]["microbatches"]
    assert [t.split(": ")[1].split(" of ")[0] for t in work] == ["forward", "backward"] * m
    assert "No pipeline" in page and "one device" in page


@pytest.mark.parametrize("name", PLANS)
def test_the_per_rank_detail_adds_up_to_the_prediction(reports, name):
    """The charts' numbers are the search's: the worst rank's memory is the predicted
    breakdown, the axes' traffic is the predicted communication, and the stages' time on
    the slowest rank is its predicted compute and tensor communication."""
    data, _, _ = reports[name]
    pred = data["predicted"]
    worst = max(data["ranks"], key=lambda r: sum(r["memory_bytes"].values()))
    assert worst["memory_bytes"] == pred["memory_breakdown_bytes"]
    comm = data["comm_by_axis"]
    assert comm["tp"]["seconds"] + comm["cp"]["seconds"] == pytest.approx(pred["tp_comm_s"])
    assert comm["dp"]["seconds"] == pytest.approx(pred["dp_comm_s"])
    assert sum(comm[a]["bytes"] for a in ("tp", "cp", "dp")) == pytest.approx(
        pred["comm_bytes_per_device"], rel=1e-6)
    slow = max(data["ranks"], key=lambda r: r["time_per_microbatch_s"])
    stages = [s for s in data["stages"] if s["rank"] == slow["rank"]]
    m = data["pipeline"]["microbatches"]
    assert m * sum(s["forward_s"] + s["backward_s"] for s in stages) == pytest.approx(
        pred["compute_s"] + pred["tp_comm_s"])
    assert sum(s["layers"] for s in data["stages"]) == len(data["layers"])


def test_a_plan_file_without_stage_detail_still_renders(reports):
    """A saved plan's JSON (Plan.to_json) has no per-stage costs: the schedule is drawn with
    unit costs and memory as the worst device, and the page says so."""
    data, _, _ = reports["pipeline"]
    bare = {k: v for k, v in data.items()
            if k not in ("stages", "ranks", "comm_by_axis", "memory_capacity", "layer_kinds")}
    bare["layers"] = [{k: lp[k] for k in ("name", "tp_mode", "sp", "recompute", "stage")}
                      for lp in data["layers"]]
    page = plan_html(bare)
    parsed = Page(page)
    assert set(parsed.charts) == set(CHARTS) and not parsed.errors
    assert "unit costs" in page and "worst device" in page
    assert all(parsed.charts[c]["rect"] > 0 for c in CHARTS)


def test_the_alternatives_table_names_each_runner_up_and_why(reports):
    data, page, _ = reports["pipeline"]
    table = page[page.index('<table id="alternatives"'):]
    table = table[:table.index("</table>")]
    alternatives = data["search"]["alternatives"]
    assert alternatives
    for alt in alternatives:
        assert html.escape(alt["plan"]) in table and html.escape(alt["reason"]) in table
    assert table.count("<tr") == len(alternatives) + 2  # the header and the chosen plan


def test_explain_writes_html_to_stdout_and_text_shows_a_runners_up_table(capsys):
    argv = ["explain", *PLANS["single"]]
    assert main([*argv, "--format", "html"]) == 0
    page = capsys.readouterr().out
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert set(Page(page).charts) == set(CHARTS) and "gpt-tiny" in page
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert re.search(r"step\s+mem/dev\s+plan: why it lost", text)
    assert re.search(r"\d+(\.\d+)? (s|ms|us)\s+\d+\.\d+ [KMG]iB  .*: chosen", text)


# ----------------------------------------------------------------------------- browser


def _need_chromium() -> None:
    """Fail (never skip) without a browser: CI installs one, so its absence is a fault."""
    try:
        find_chromium()
    except ChromiumMissing as e:
        pytest.fail(str(e))


@pytest.mark.parametrize("name", PLANS)
def test_chromium_lays_out_every_chart(reports, name):
    _need_chromium()
    _, _, path = reports[name]
    laid_out = probe(path, 1200, 900)
    assert laid_out["resources"] == [], "the page fetched something"
    assert set(laid_out["charts"]) == set(CHARTS)
    for chart, box in laid_out["charts"].items():
        assert box["width"] > 300 and box["height"] > 30, (chart, box)
        assert box["drawn"] > 0 and box["rects"] > 0, (chart, box)
    gantt = laid_out["charts"]["gantt"]
    # every action's box has a size on screen (plus a lane per rank, sync and optimizer)
    actions = len([t for t in Page(reports[name][1]).titles["gantt"] if "micro-batch" in t])
    assert gantt["drawn"] >= actions


def test_the_screenshot_shows_the_charts(reports, tmp_path):
    """Not blank: many colours, much of the page drawn on, and the charts' own fills
    (forward boxes, the activations stack, the data-parallel bar) on screen."""
    _need_chromium()
    _, _, path = reports["pipeline"]
    laid_out = probe(path, 1200, 900)
    height = int(laid_out["sections"]["Alternatives that lost"])
    width, rows_h, rows = read_png(screenshot(path, tmp_path / "page.png", 1200, height))
    assert (width, rows_h) == (1200, height)
    pixels = Counter(row[i:i + 3] for row in rows[::2] for i in range(0, len(row), 6))
    total = sum(pixels.values())
    background = pixels.most_common(1)[0][1]
    assert len(pixels) > 200, "too few colours: a blank or unstyled page"
    assert background / total < 0.8, "the page is mostly one colour"
    for colour in (WORK_COLOURS["F"], MEMORY_COLOURS["activations"], AXIS_COLOURS["dp"]):
        rgb = bytes.fromhex(colour[1:])
        assert pixels[rgb] > 100, f"{colour} is hardly on screen ({pixels[rgb]} pixels)"

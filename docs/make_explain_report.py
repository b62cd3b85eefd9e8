"""Regenerate docs/explain-report.png, the picture of `autopar explain --format html`.

    python docs/make_explain_report.py            # GPT-3 175B on 1024 A100s, about a minute
    python docs/make_explain_report.py --keep report.html

Plans the showcase (the same command docs/planning-offline.md shows), writes the HTML report, lays it
out in headless Chromium (tests/chromium.py; `apt-get install -y chromium`) and takes a
screenshot of the page down to the runners-up table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from chromium import probe, screenshot  # noqa: E402  (tests/ is not a package)

from autopar.cli import main as autopar  # noqa: E402

SHOWCASE = ["explain", "gpt3-175b", "--world", "1024", "--batch", "1536", "--format", "html"]
WIDTH = 1200  # the report's content is 1160 px wide


def run(png: Path, keep: Path | None) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        page = keep or Path(tmp) / "report.html"
        if autopar([*SHOWCASE, "-o", str(page)]) != 0:
            raise SystemExit("autopar explain failed")
        laid_out = probe(page, WIDTH)
        # everything above the per-kind table: header, charts, alternatives
        height = int(laid_out["sections"].get("Layers by kind", laid_out["height"]))
        return screenshot(page, png, WIDTH, height)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "docs" / "explain-report.png")
    parser.add_argument("--keep", type=Path, default=None, help="also keep the HTML report here")
    args = parser.parse_args()
    print(f"wrote {run(args.output, args.keep)}")

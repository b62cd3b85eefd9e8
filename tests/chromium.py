"""Headless Chromium for tests that check what a browser draws, and a small PNG reader.

`tests/test_html_report.py` renders `autopar explain --format html` pages with it, and
`docs/make_explain_report.py` takes the screenshot in docs/planning-offline.md the same way.
Chromium runs with a throw-away profile and everything that could reach the network switched off, so
a page that asks for an outside resource cannot get it (and the tests notice).

PNG decoding (8-bit greyscale, RGB or RGBA, not interlaced: what Chromium writes) needs
only zlib and numpy, so the tests add no imaging dependency.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

import numpy as np

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--hide-scrollbars", "--mute-audio")
# Where layout measures each chart: appended to a copy of the page (the report itself runs
# no script), it writes what it found into a <pre id="probe"> that --dump-dom prints.
PROBE = """<script>
(() => {
  const charts = {};
  for (const svg of document.querySelectorAll("svg.chart")) {
    const box = svg.getBoundingClientRect();
    let drawn = 0, rects = 0;
    for (const el of svg.querySelectorAll("rect, line, text")) {
      const b = el.getBoundingClientRect();
      if (el.tagName === "rect") rects += 1;
      if (b.width > 0 && b.height > 0) drawn += 1;
    }
    charts[svg.id] = {width: box.width, height: box.height, top: box.top + window.scrollY,
                      drawn: drawn, rects: rects};
  }
  const sections = {};
  for (const h of document.querySelectorAll("section > h2")) {
    sections[h.textContent] = h.parentElement.getBoundingClientRect().top + window.scrollY;
  }
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({
    charts: charts, sections: sections,
    height: document.documentElement.scrollHeight,
    resources: performance.getEntriesByType("resource").map(r => r.name)});
  document.body.appendChild(out);
})();
</script>"""


class ChromiumMissing(RuntimeError):
    pass


def find_chromium() -> str:
    """The Chromium binary: $CHROMIUM, else /usr/bin/chromium or one on PATH."""
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise ChromiumMissing("headless Chromium is needed to render the HTML report and was not "
                          "found (looked at $CHROMIUM, /usr/bin/chromium and PATH); install it "
                          "with `apt-get install -y chromium`, as .ci/run does.")


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        done = subprocess.run([find_chromium(), *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited with {done.returncode}: "
                           f"{done.stderr.decode(errors='replace')[-2000:]}")
    return done


def probe(page: Path, width: int = 1200, height: int = 900, timeout_s: float = 180) -> dict:
    """Lay `page` out and return what PROBE measured (charts, section tops, page height,
    resources fetched)."""
    text = page.read_text()
    with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
        copy = Path(tmp) / page.name
        copy.write_text(text.replace("</body>", PROBE + "\n</body>", 1))
        dom = _run([f"--window-size={width},{height}", "--dump-dom", copy.as_uri()],
                   timeout_s).stdout.decode()
    start = dom.find('<pre id="probe">')
    if start < 0:
        raise RuntimeError(f"the probe did not run; chromium printed:\n{dom[:2000]}")
    body = dom[start + len('<pre id="probe">'):dom.index("</pre>", start)]
    return json.loads(body.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))


def screenshot(page: Path, png: Path, width: int, height: int, timeout_s: float = 180) -> Path:
    """A PNG of the top `width` x `height` pixels of `page`."""
    _run([f"--window-size={width},{height}", f"--screenshot={png}", page.resolve().as_uri()],
         timeout_s)
    if not png.exists():
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return png


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit, non-interlaced PNG."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG file")
    pos, idat = 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat.append(chunk)
        pos += 12 + length
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(colour)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"{path}: only 8-bit, non-interlaced grey/RGB(A) PNGs are read here")
    raw = zlib.decompress(b"".join(idat))
    stride = width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        line = raw[y * (stride + 1):(y + 1) * (stride + 1)]
        row = _unfilter(line[0], bytearray(line[1:]), previous, channels)
        rows.append(_rgb(row, channels))
        previous = row
    return width, height, rows


def _unfilter(kind: int, row: bytearray, above: bytearray, bpp: int) -> bytearray:
    """Undo one scanline's filter (PNG specification, section 9). The filters that depend
    only on the row above or on a running sum (most of Chromium's rows) go through numpy;
    average and Paeth read the byte just decoded, one at a time."""
    if kind == 0:
        return row
    if kind == 2:
        return bytearray(((np.frombuffer(row, np.uint8).astype(np.uint16)
                           + np.frombuffer(above, np.uint8)) & 0xFF).astype(np.uint8).tobytes())
    if kind == 1:
        pixels = np.frombuffer(row, np.uint8).reshape(-1, bpp).astype(np.int64)
        return bytearray((np.cumsum(pixels, axis=0) & 0xFF).astype(np.uint8).tobytes())
    for i in range(len(row)):
        left = row[i - bpp] if i >= bpp else 0
        up = above[i]
        corner = above[i - bpp] if i >= bpp else 0
        if kind == 3:
            row[i] = (row[i] + (left + up) // 2) & 0xFF
        elif kind == 4:
            p = left + up - corner
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
            pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
            row[i] = (row[i] + pred) & 0xFF
    return row


def _rgb(row: bytearray, channels: int) -> bytes:
    pixels = np.frombuffer(bytes(row), np.uint8).reshape(-1, channels)
    if channels >= 3:
        return pixels[:, :3].tobytes()
    return np.repeat(pixels[:, :1], 3, axis=1).tobytes()  # grey (+ alpha)

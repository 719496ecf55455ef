"""``bench text|mm --record``: keep the run's result in ``docs/bench-results/<kind>.json`` (with the commit it
measured) and redraw ``docs/benchmarks.png`` from every recorded result: per workload, rows/s and time to the first
batch, ours against verl. Drawn with Pillow (already a dependency), so recording needs nothing more."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "bench-results"
CHART = ROOT / "docs" / "benchmarks.png"
OURS, VERL, INK, GRID = (38, 110, 200), (160, 160, 160), (30, 30, 30), (225, 225, 225)
LAYOUT_NAMES = {"one_pool": "one pool", "decode_in_tokenizer": "decode in tokenizer", "decode_pool": "three pools"}


def commit() -> str:
    """The commit the working tree is at (with ``+`` when it has uncommitted changes)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
        return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def record(kind: str, result: dict) -> Path:
    """Save ``result`` as the current figures of ``kind`` and redraw the chart; returns the chart's path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{kind}.json").write_text(json.dumps({"kind": kind, "commit": commit(), **result}, indent=1) + "\n")
    return draw()


def workloads() -> list[dict]:
    """Every recorded (workload, ours, verl) triple, in a stable order: text sizes, then image sizes per layout."""
    rows = []
    for kind in ("text", "mm"):
        path = RESULTS / f"{kind}.json"
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        for size in doc["sizes"]:
            for layout in size.get("order", ["default"]):
                key = "ours" if layout in ("default", "decode_pool") else f"ours_{layout}"
                what = f"text, {size['rows']:,} rows" if kind == "text" else f"images, {size['rows']:,} rows"
                if kind == "mm":
                    what += f"\n{LAYOUT_NAMES.get(layout, layout)}"
                rows.append({"label": what, "ours": size[key], "verl": size.get("verl"), "commit": doc["commit"]})
    return rows


def draw(path: Path = CHART) -> Path:
    from PIL import Image, ImageDraw, ImageFont

    items = workloads()
    font = ImageFont.load_default(size=14)
    small = ImageFont.load_default(size=12)
    bar, gap, left, top, panel_w = 14, 22, 230, 56, 330
    height = top + len(items) * (2 * bar + gap) + 40
    image = Image.new("RGB", (left + 2 * panel_w + 60, max(height, 140)), "white")
    pen = ImageDraw.Draw(image)
    commits = sorted({item["commit"] for item in items})
    title = f"ours (blue) against verl 0.5.0 (grey), each workload on its own scale; commit {', '.join(commits)}"
    pen.text((10, 8), title, fill=INK, font=font)
    panels = (("rows/s (more is better)", "rows_per_s", "{:,.0f}"), ("first batch, s (less is better)",
              "time_to_first_batch_s", "{:.1f}"))  # fmt: skip
    for p, (title, key, fmt) in enumerate(panels):
        x0 = left + p * (panel_w + 30)
        pen.text((x0, top - 22), title, fill=INK, font=font)
        pen.line([(x0, top - 4), (x0, height - 30)], fill=GRID)
        for i, item in enumerate(items):
            y = top + i * (2 * bar + gap)
            if p == 0:
                pen.multiline_text((10, y - 2), item["label"], fill=INK, font=font, spacing=1)
            # each workload on its own scale: the bars compare ours with verl, not text rows with image rows
            values = [item[side][key] for side in ("ours", "verl") if item[side] and item[side][key]]
            scale = (panel_w - 70) / max(values or [1])
            for j, (side, colour) in enumerate((("ours", OURS), ("verl", VERL))):
                value = item[side][key] if item[side] else None
                if value is None:
                    continue
                y1 = y + j * bar
                pen.rectangle([x0, y1, x0 + max(1, value * scale), y1 + bar - 2], fill=colour)
                pen.text((x0 + value * scale + 4, y1), fmt.format(value), fill=INK, font=small)
            if p == 0 and item["verl"]:
                ratio = item["ours"]["rows_per_s"] / item["verl"]["rows_per_s"]
                pen.text((150, y - 2), f"{ratio:.2f}x verl", fill=OURS, font=small)
    image.save(path)
    return path

"""Draw the headline ratios of bench/RESULTS.md as a horizontal bar chart in SVG.

    python bench/plot_headlines.py [--results bench/RESULTS.md] [--output docs/img/headlines.svg]

The ratios, each TinyLoop's throughput over the same work done another way (right of the 1.0x
line: TinyLoop is faster): against ``transformers`` (``engine_vs_hf``: float32 at batch 1 and 8,
int8 and int4 weights against its float32), against llama.cpp where ``vs_llamacpp`` has a section
(each weights mode against llama.cpp's own format of it: float32/f32, int8/q8_0, int4/q4_0,
bf16/bf16; the ``q4_0 --pure`` and ``f16`` rows stay in the table), and the runtime against the
bare HTTP stack (``overhead``: requests/s and SSE events/s). Each group names the run its figures
come from. ``run_all.py`` calls this after writing RESULTS.md; the SVG is written by hand (no
plotting library) so the docs build needs nothing more.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from results import parse_sections, section_note, section_table

HERE = Path(__file__).resolve().parent
# a TinyLoop weights mode -> llama.cpp's format of the same weights
SAME_FORMAT = {"float32": "f32", "int8": "q8_0", "int4": "q4_0", "bf16": "bf16"}
MEASURES = {"tg b1": "decode, batch 1", "tg b8": "decode, batch 8", "pp": "prefill"}


@dataclass(frozen=True, slots=True)
class Bar:
    label: str
    ratio: float


@dataclass(frozen=True, slots=True)
class Group:
    title: str
    source: str  # the section's command and run: where the figures come from
    bars: list[Bar]


def _rows(table: str, header: str) -> list[str]:
    """The lines after ``header`` up to the next blank line."""
    lines = table.splitlines()
    start = lines.index(header) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def _ratio(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def transformers_bars(table: str) -> list[Bar]:
    """engine_vs_hf's ``ours/HF`` column (right-aligned under its header) in both its tables."""
    bars = []
    for header in (line for line in table.splitlines() if "ours/HF" in line):
        end = header.index("ours/HF") + len("ours/HF")
        for row in _rows(table, header):
            fields = row[:end].split()
            if len(fields) < 3 or (ratio := _ratio(fields[-1])) is None:
                continue
            if "HF layers" in header:  # loops, HF layers, batch, ours, HF, ratio
                bars.append(Bar(f"float32, loops {fields[0]}, batch {fields[2]}", ratio))
            else:  # loops, weights, ours, HF float32, ratio
                bars.append(Bar(f"{fields[1]} (HF float32), loops {fields[0]}, batch 1", ratio))
    return bars


def llamacpp_groups(table: str, source: str) -> list[Group]:
    """vs_llamacpp's ``ratio`` column, one group per measure, same-format rows only."""
    header = next((line for line in table.splitlines() if line.lstrip().startswith("loops |")
                   and "ratio" in line), None)
    if header is None:
        return []
    names = [c.strip() for c in header.split("|")]
    by_measure: dict[str, list[Bar]] = {}
    for row in _rows(table, header):
        cells = dict(zip(names, (c.strip() for c in row.split("|"))))
        ours, theirs, measure = cells.get("TinyLoop", ""), cells.get("llama.cpp", ""), cells.get("measure", "")
        if SAME_FORMAT.get(ours) != theirs or (ratio := _ratio(cells.get("ratio", ""))) is None:
            continue
        by_measure.setdefault(measure, []).append(Bar(f"{ours} / {theirs}, loops {cells.get('loops')}", ratio))
    return [Group(f"against llama.cpp: {MEASURES.get(m, m)}", source if i == 0 else "", bars)
            for i, (m, bars) in enumerate(by_measure.items())]


def overhead_bars(table: str) -> list[Bar]:
    """overhead's summary line: the runtime's rate as a share of the bare stack's."""
    m = re.search(r"ours / bare: requests (\d+)%.*SSE events (\d+)%", table)
    if m is None:
        return []
    return [Bar("HTTP /generate, requests/s", int(m.group(1)) / 100),
            Bar("SSE on one connection, events/s", int(m.group(2)) / 100)]


def headlines(results: str) -> list[Group]:
    """The groups of ratios RESULTS.md holds, in a fixed order; a bench without a section or
    without ratios gives none."""
    sections = parse_sections(results)
    groups = []
    if "engine_vs_hf" in sections and (bars := transformers_bars(section_table(sections["engine_vs_hf"]))):
        groups.append(Group("against transformers (same model, threads and dtype)",
                            section_note(sections["engine_vs_hf"]), bars))
    if "vs_llamacpp" in sections:
        section = sections["vs_llamacpp"]
        groups += llamacpp_groups(section_table(section), section_note(section))
    if "overhead" in sections and (bars := overhead_bars(section_table(sections["overhead"]))):
        groups.append(Group("the runtime against the bare HTTP stack (Quart-trio on hypercorn)",
                            section_note(sections["overhead"]), bars))
    return groups


def _text(x: float, y: float, text: str, **attrs: str) -> str:
    extra = "".join(f" {k.replace('_', '-')}={quoteattr(v)}" for k, v in attrs.items())
    return f'<text x="{x:.0f}" y="{y:.0f}"{extra}>{escape(text)}</text>'


def _ticks(lo: float, hi: float) -> list[float]:
    """The ratios the axis marks between ``lo`` and ``hi``: powers of two and 1.5 times them."""
    marks = sorted({m * 2.0**e for e in range(-6, 7) for m in (1.0, 1.5)})
    return [t for t in marks if lo <= t <= hi]


def svg(groups: list[Group], width: int = 860) -> str:
    """The chart: per group a title, its source and one bar per ratio from the 1.0x line (dashed),
    on a log scale so that 2x and 0.5x are as long; an axis under the last group. Bars at or past
    1.0x are blue and go right, under it orange and go left."""
    label_right, bar_left, bar_width, row = 330, 340, width - 340 - 56, 20
    ratios = [b.ratio for g in groups for b in g.bars] or [1.0]
    marks = _ticks(1e-3, 1e3)
    lo = max(t for t in marks if t <= min(0.5, min(ratios) / 1.1))
    hi = min(t for t in marks if t >= max(2.0, max(ratios) * 1.15))

    def x(ratio: float) -> float:
        return bar_left + bar_width * math.log(ratio / lo) / math.log(hi / lo)

    out = [_text(16, 26, "TinyLoop's throughput as a ratio of the same work done another way",
                 font_weight="bold", font_size="14"),
           _text(16, 44, "log scale; right of the 1.0x line TinyLoop is faster")]
    y = 58.0
    if not groups:
        out.append(_text(16, y + 8, "no headline ratios in bench/RESULTS.md yet: python bench/run_all.py"))
        y += row
    for group in groups:
        y += 22
        out.append(_text(16, y, group.title, font_weight="bold"))
        if group.source:
            out.append(_text(16, y + 15, group.source.replace("`", ""), fill="#666", font_size="10"))
            y += 15
        y += 6
        first = y
        for bar in group.bars:
            left, right = sorted((x(1), x(bar.ratio)))
            colour = "#1f77b4" if bar.ratio >= 1 else "#ff7f0e"
            out.append(_text(label_right, y + 12, bar.label, text_anchor="end"))
            out.append(f'<rect class="bar" x="{left:.1f}" y="{y + 2:.0f}" width="{max(right - left, 1):.1f}" '
                       f'height="13" fill="{colour}"><title>{escape(bar.label)}: {bar.ratio:.2f}x</title></rect>')
            out.append(_text(max(right, x(1)) + 4, y + 12, f"{bar.ratio:.2f}x", font_size="11"))
            y += row
        out.append(f'<line class="one" x1="{x(1):.1f}" y1="{first:.0f}" x2="{x(1):.1f}" y2="{y + 2:.0f}" '
                   'stroke="#333" stroke-dasharray="4 3"/>')
    y += 6
    out.append(f'<line x1="{bar_left}" y1="{y:.0f}" x2="{x(hi):.1f}" y2="{y:.0f}" stroke="#333"/>')
    for tick in _ticks(lo, hi):
        out.append(f'<line x1="{x(tick):.1f}" y1="{y:.0f}" x2="{x(tick):.1f}" y2="{y + 4:.0f}" stroke="#333"/>')
        out.append(_text(x(tick), y + 16, f"{tick:g}x", text_anchor="middle", font_size="11"))
    y += 40
    out.append(_text(16, y - 10, "From bench/RESULTS.md (python bench/run_all.py); drawn by bench/plot_headlines.py",
                     fill="#666", font_size="10"))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y:.0f}" '
            f'viewBox="0 0 {width} {y:.0f}" font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif" '
            f'font-size="12">\n<rect width="100%" height="100%" fill="#fff"/>\n' + "\n".join(out) + "\n</svg>\n")


def write_headlines(results: Path, output: Path) -> int:
    """Draw ``results``' ratios into ``output``; the number of bars."""
    groups = headlines(results.read_text(encoding="utf-8") if results.exists() else "")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(svg(groups), encoding="utf-8")
    return sum(len(g.bars) for g in groups)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    ap.add_argument("--output", type=Path, default=HERE.parent / "docs" / "img" / "headlines.svg")
    args = ap.parse_args()
    print(f"drew {write_headlines(args.results, args.output)} ratios into {args.output}")


if __name__ == "__main__":
    main()

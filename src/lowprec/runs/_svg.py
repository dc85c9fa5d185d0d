"""Tiny inline-SVG charts built as strings: a line chart with shaded bands, and a strip chart of values.

No plotting library and no external asset: every chart is one ``<svg>`` element, well-formed XML, with every
text escaped, so a report stays one self-contained HTML file.  Non-finite points break a line instead of
corrupting the path; values outside the y range are clipped to the frame (``clipPath``).
"""

from __future__ import annotations

import dataclasses
import html
import itertools
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
_ids = itertools.count()


def esc(text: object) -> str:
    """Escape for HTML text and attribute values (also valid XML)."""
    return html.escape(str(text), quote=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Line:
    label: str
    x: np.ndarray
    y: np.ndarray
    color: str
    width: float = 1.5
    dash: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Band:
    label: str
    x: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    color: str
    opacity: float = 0.25


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.4g}"


class _Frame:
    """Maps data coordinates to pixels inside the plot area."""

    def __init__(self, width: int, height: int, x: tuple[float, float], y: tuple[float, float]) -> None:
        self.l, self.r, self.t, self.b = 64, width - 16, 28, height - 40
        self.x0, self.x1 = x if x[1] > x[0] else (x[0] - 0.5, x[0] + 0.5)
        self.y0, self.y1 = y if y[1] > y[0] else (y[0] - 0.5, y[0] + 0.5)

    def px(self, x: npt.ArrayLike) -> np.ndarray:
        return self.l + (np.asarray(x, dtype=np.float64) - self.x0) / (self.x1 - self.x0) * (self.r - self.l)

    def py(self, y: npt.ArrayLike) -> np.ndarray:
        return self.b - (np.asarray(y, dtype=np.float64) - self.y0) / (self.y1 - self.y0) * (self.b - self.t)


def _segments(mask: np.ndarray) -> list[slice]:
    """Runs of True in ``mask`` as slices."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return [slice(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _points(xs: np.ndarray, ys: np.ndarray) -> str:
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys, strict=True))


def _axes(f: _Frame, title: str, x_label: str, y_label: str, width: int, height: int) -> list[str]:
    out = [f'<rect x="{f.l}" y="{f.t}" width="{f.r - f.l}" height="{f.b - f.t}" fill="#fff" stroke="#999"/>',
           f'<text x="{width / 2:.0f}" y="18" text-anchor="middle" font-weight="bold">{esc(title)}</text>',
           f'<text x="{(f.l + f.r) / 2:.0f}" y="{height - 6}" text-anchor="middle">{esc(x_label)}</text>',
           f'<text x="14" y="{(f.t + f.b) / 2:.0f}" text-anchor="middle" '
           f'transform="rotate(-90 14 {(f.t + f.b) / 2:.0f})">{esc(y_label)}</text>']
    for v in nice_ticks(f.x0, f.x1, 6):
        x = float(f.px(v))
        out.append(f'<line x1="{x:.1f}" y1="{f.b}" x2="{x:.1f}" y2="{f.b + 4}" stroke="#999"/>'
                   f'<text x="{x:.1f}" y="{f.b + 16}" text-anchor="middle">{esc(_fmt(v))}</text>')
    for v in nice_ticks(f.y0, f.y1, 5):
        y = float(f.py(v))
        out.append(f'<line x1="{f.l}" y1="{y:.1f}" x2="{f.r}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{f.l - 4}" y="{y + 4:.1f}" text-anchor="end">{esc(_fmt(v))}</text>')
    return out


def _legend(items: Sequence[tuple[str, str, str]], f: _Frame) -> list[str]:
    """(label, color, kind) with kind "line", "dash" or "band"; drawn at the top right inside the frame."""
    out = []
    for i, (label, color, kind) in enumerate(items):
        y = f.t + 14 + 15 * i
        x = f.r - 190
        if kind == "band":
            out.append(f'<rect x="{x}" y="{y - 8}" width="18" height="10" fill="{esc(color)}" opacity="0.3"/>')
        else:
            dash = ' stroke-dasharray="4 3"' if kind == "dash" else ""
            out.append(f'<line x1="{x}" y1="{y - 3}" x2="{x + 18}" y2="{y - 3}" stroke="{esc(color)}" '
                       f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{x + 24}" y="{y + 1}">{esc(label[:40])}</text>')
    return out


def line_chart(*, lines: Sequence[Line], bands: Sequence[Band] = (), title: str, x_label: str, y_label: str,
               y_range: tuple[float, float] | None = None, width: int = 760, height: int = 340) -> str:
    """One ``<svg>`` with ``bands`` (shaded, drawn first) and ``lines`` over them, axes, ticks and a legend.

    ``y_range`` default: the finite values of everything drawn, padded by 5%."""
    drawn: list[Line | Band] = [*lines, *bands]
    xs = [np.asarray(s.x, dtype=np.float64) for s in drawn]
    ally = [np.asarray(v, dtype=np.float64) for s in lines for v in (s.y,)]
    ally += [np.asarray(v, dtype=np.float64) for b in bands for v in (b.lo, b.hi)]
    fx = np.concatenate(xs) if xs else np.zeros(1)
    fy = np.concatenate(ally) if ally else np.zeros(1)
    fx, fy = fx[np.isfinite(fx)], fy[np.isfinite(fy)]
    xr = (float(fx.min()), float(fx.max())) if fx.size else (0.0, 1.0)
    if y_range is None:
        y_lo, y_hi = (float(fy.min()), float(fy.max())) if fy.size else (0.0, 1.0)
        pad = 0.05 * (y_hi - y_lo or abs(y_hi) or 1.0)
        y_range = (y_lo - pad, y_hi + pad)
    f = _Frame(width, height, xr, y_range)
    clip = f"clip{next(_ids)}"
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11" role="img">',
           f'<title>{esc(title)}</title>',
           f'<defs><clipPath id="{clip}"><rect x="{f.l}" y="{f.t}" width="{f.r - f.l}" '
           f'height="{f.b - f.t}"/></clipPath></defs>']
    out += _axes(f, title, x_label, y_label, width, height)
    out.append(f'<g clip-path="url(#{clip})">')
    for b in bands:
        x, lo, hi = (np.asarray(v, dtype=np.float64) for v in (b.x, b.lo, b.hi))
        for s in _segments(np.isfinite(x) & np.isfinite(lo) & np.isfinite(hi)):
            pts = _points(f.px(x[s]), f.py(hi[s])) + " " + _points(f.px(x[s])[::-1], f.py(lo[s])[::-1])
            out.append(f'<polygon points="{pts}" fill="{esc(b.color)}" opacity="{b.opacity}" stroke="none"/>')
    for ln in lines:
        x, y = np.asarray(ln.x, dtype=np.float64), np.asarray(ln.y, dtype=np.float64)
        dash = f' stroke-dasharray="{esc(ln.dash)}"' if ln.dash else ""
        for s in _segments(np.isfinite(x) & np.isfinite(y)):
            out.append(f'<polyline points="{_points(f.px(x[s]), f.py(y[s]))}" fill="none" '
                       f'stroke="{esc(ln.color)}" stroke-width="{ln.width}"{dash}/>')
    out.append("</g>")
    items = [(b.label, b.color, "band") for b in bands] + [
        (ln.label, ln.color, "dash" if ln.dash else "line") for ln in lines if ln.label]
    out += _legend(items[:12], f)
    out.append("</svg>")
    return "\n".join(out)


def strip_chart(*, rows: Sequence[tuple[str, Sequence[float], str]], title: str, x_label: str,
                width: int = 420) -> str:
    """One dot per value on a shared horizontal axis, one row per (label, values, color)."""
    height = 60 + 22 * len(rows)
    vals = np.asarray([v for _, vs, _ in rows for v in vs], dtype=np.float64)
    vals = vals[np.isfinite(vals)]
    lo, hi = (float(vals.min()), float(vals.max())) if vals.size else (0.0, 1.0)
    pad = 0.08 * (hi - lo or abs(hi) or 1.0)
    f = _Frame(width, height, (lo - pad, hi + pad), (0.0, float(len(rows))))
    f.l = 150
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11" role="img">',
           f'<title>{esc(title)}</title>',
           f'<text x="{width / 2:.0f}" y="18" text-anchor="middle" font-weight="bold">{esc(title)}</text>',
           f'<rect x="{f.l}" y="{f.t}" width="{f.r - f.l}" height="{f.b - f.t}" fill="#fff" stroke="#999"/>',
           f'<text x="{(f.l + f.r) / 2:.0f}" y="{height - 6}" text-anchor="middle">{esc(x_label)}</text>']
    for v in nice_ticks(f.x0, f.x1, 4):
        x = float(f.px(v))
        out.append(f'<line x1="{x:.1f}" y1="{f.t}" x2="{x:.1f}" y2="{f.b}" stroke="#eee"/>'
                   f'<text x="{x:.1f}" y="{f.b + 16}" text-anchor="middle">{esc(_fmt(v))}</text>')
    for i, (label, vs, color) in enumerate(rows):
        y = float(f.py(len(rows) - i - 0.5))
        out.append(f'<text x="{f.l - 6}" y="{y + 4:.1f}" text-anchor="end">{esc(label[:28])}</text>')
        for v in vs:
            if math.isfinite(v):
                out.append(f'<circle cx="{float(f.px(v)):.1f}" cy="{y:.1f}" r="4" fill="{esc(color)}" '
                           f'opacity="0.8"><title>{esc(label)}: {esc(_fmt(v))}</title></circle>')
            else:
                out.append(f'<text x="{f.r - 4}" y="{y + 4:.1f}" text-anchor="end" fill="#c00">{esc(v)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _ramp(t: float) -> str:
    """Color for ``t`` in [0, 1] on a dark-red (0, bad) -> yellow -> light-green (1, good) ramp."""
    stops = [(0.0, (165, 0, 38)), (0.5, (254, 224, 139)), (1.0, (26, 152, 80))]
    for (t0, c0), (t1, c1) in zip(stops, stops[1:], strict=False):
        if t <= t1:
            u = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
            return "#" + "".join(f"{round(a + (b - a) * u):02x}" for a, b in zip(c0, c1, strict=True))
    return "#{:02x}{:02x}{:02x}".format(*stops[-1][1])


def heatmap(*, rows: Sequence[str], cols: Sequence[int], values: np.ndarray, title: str, value_label: str,
            value_range: tuple[float, float], higher_is_better: bool, width: int = 760) -> str:
    """A rows x cols grid of colored cells (``values[i, j]``; NaN: grey "not sampled", inf: the best color).

    Colors run from red (worst) to green (best) over ``value_range``, clipped at its ends; each cell's tooltip
    shows its row, column and exact value.  Used for per-layer statistics over training steps."""
    vals = np.asarray(values, dtype=np.float64)
    if vals.shape != (len(rows), len(cols)):
        raise ValueError(f"heatmap values have shape {vals.shape}, expected {(len(rows), len(cols))}")
    left, top, cell_h, legend_h = 230, 30, 16, 34
    n_cols = max(len(cols), 1)
    cell_w = max(2.0, (width - left - 10) / n_cols)
    height = top + cell_h * len(rows) + legend_h + 20
    lo, hi = value_range
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11" role="img">',
           f'<title>{esc(title)}</title>',
           f'<text x="{width / 2:.0f}" y="18" text-anchor="middle" font-weight="bold">{esc(title)}</text>']
    for i, label in enumerate(rows):
        y = top + i * cell_h
        out.append(f'<text x="{left - 6}" y="{y + cell_h - 4}" text-anchor="end">{esc(label[:36])}</text>')
        for j, step in enumerate(cols):
            v = float(vals[i, j])
            if math.isnan(v):
                color, shown = "#dddddd", "not sampled"
            else:
                t = 1.0 if math.isinf(v) and (v > 0) == higher_is_better else 0.0 if math.isinf(v) else (
                    min(max((v - lo) / (hi - lo or 1.0), 0.0), 1.0))
                color, shown = _ramp(t if higher_is_better else 1.0 - t), _fmt(v) if math.isfinite(v) else str(v)
            out.append(f'<rect x="{left + j * cell_w:.1f}" y="{y}" width="{cell_w + 0.3:.1f}" height="{cell_h - 1}" '
                       f'fill="{color}"><title>{esc(label)} step {esc(step)}: {esc(value_label)} '
                       f'{esc(shown)}</title></rect>')
    y_axis = top + cell_h * len(rows) + 12
    for j in sorted({0, len(cols) // 2, len(cols) - 1} if cols else set()):
        out.append(f'<text x="{left + (j + 0.5) * cell_w:.1f}" y="{y_axis}" text-anchor="middle">'
                   f'step {esc(cols[j])}</text>')
    y_leg = y_axis + 10
    for k in range(50):  # the color scale
        t = k / 49
        out.append(f'<rect x="{left + k * 4}" y="{y_leg}" width="4" height="10" '
                   f'fill="{_ramp(t if higher_is_better else 1.0 - t)}"/>')
    out.append(f'<text x="{left - 6}" y="{y_leg + 9}" text-anchor="end">{esc(_fmt(lo))}</text>'
               f'<text x="{left + 206}" y="{y_leg + 9}">{esc(_fmt(hi))} {esc(value_label)}</text>')
    out.append("</svg>")
    return "\n".join(out)

"""Tiny inline-SVG charts built as strings: line charts with shaded bands, strip charts of values, heatmaps.

No plotting library and no external asset: every chart is one ``<svg>`` element, well-formed XML, with every
text escaped, so a report stays one self-contained HTML file.  Non-finite points break a line instead of
corrupting the path (a lone finite point is a dot); values outside the y range are clipped to the plot area
(``clipPath``); a log axis drops values <= 0 the same way.

Text never covers data: a line chart's legend sits outside its plot area (to the right or below), and every
margin is sized from the measured width of its labels (``text_width``: per-character advance widths of the wider
of DejaVu Sans and Liberation Sans, what ``sans-serif`` resolves to on most Linux machines, so the estimate is an
upper bound there and close to Arial/Helvetica elsewhere).  A label longer than its room is shortened with an
ellipsis and keeps its full text as a tooltip (``<title>``).  Hooks for tests and styling: the plot area is
``rect.plot-area``, the legend ``g.legend``, the clipped data ``g.data``; each polyline carries its label as a
``<title>``.
"""

from __future__ import annotations

import dataclasses
import html
import itertools
import math
import unicodedata
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .._errors import UsageError

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
_ids = itertools.count()
FONT_SIZE = 11
_ROW = 15  # legend row height

# Advance widths (1/1000 em) of " " .. "~": the wider of DejaVu Sans and Liberation Sans for each character.
_WIDTHS = (318, 401, 460, 838, 636, 950, 780, 275, 390, 390, 500, 838, 318, 361, 318, 337, 636, 636, 636, 636, 636,
           636, 636, 636, 636, 636, 337, 337, 838, 838, 838, 556, 1015, 684, 686, 722, 770, 667, 611, 778, 752, 295,
           500, 667, 557, 863, 748, 787, 667, 787, 722, 667, 611, 732, 684, 989, 685, 667, 685, 390, 337, 390, 838,
           556, 500, 613, 635, 550, 635, 615, 352, 635, 634, 278, 278, 579, 278, 974, 634, 612, 635, 635, 411, 521,
           392, 634, 592, 818, 592, 592, 525, 636, 337, 636, 838)
_BOLD = 1.12  # bold glyphs are about 10% wider in both fonts


def esc(text: object) -> str:
    """Escape for HTML text and attribute values (also valid XML)."""
    return html.escape(str(text), quote=True)


def text_width(text: object, size: float = FONT_SIZE, *, bold: bool = False) -> float:
    """Width in pixels of ``text`` set in ``sans-serif`` at ``size`` px (an upper-bound estimate: see the module
    docstring); East Asian wide characters count one em, combining marks nothing, other non-ASCII 0.8 em."""
    total = 0
    for ch in str(text):
        o = ord(ch)
        if 32 <= o < 127:
            total += _WIDTHS[o - 32]
        elif unicodedata.combining(ch):
            continue
        else:
            total += 1000 if unicodedata.east_asian_width(ch) in "WF" else 800
    return total * size / 1000 * (_BOLD if bold else 1.0)


def fit_text(text: object, room: float, size: float = FONT_SIZE, *, bold: bool = False) -> str:
    """``text`` when it fits in ``room`` pixels, else its longest prefix that fits with an ellipsis appended."""
    s = str(text)
    if text_width(s, size, bold=bold) <= room:
        return s
    lo, hi = 0, len(s)
    while lo < hi:  # the longest prefix p with width(p + "…") <= room
        mid = (lo + hi + 1) // 2
        if text_width(s[:mid] + "\u2026", size, bold=bold) <= room:
            lo = mid
        else:
            hi = mid - 1
    return s[:lo] + "\u2026"


def _text(x: float, y: float, text: object, room: float, *, anchor: str = "start", bold: bool = False,
          extra: str = "") -> str:
    """One ``<text>``, shortened to ``room`` pixels; a shortened text keeps its full content as a tooltip."""
    full = str(text)
    shown = fit_text(full, room, bold=bold)
    tip = f"<title>{esc(full)}</title>" if shown != full else ""
    weight = ' font-weight="bold"' if bold else ""
    anchor_attr = f' text-anchor="{anchor}"' if anchor != "start" else ""
    return f'<text x="{x:.1f}" y="{y:.1f}"{anchor_attr}{weight}{extra}>{esc(shown)}{tip}</text>'


@dataclasses.dataclass(frozen=True, kw_only=True)
class Line:
    label: str
    x: np.ndarray
    y: np.ndarray
    color: str
    width: float = 1.5
    dash: str | None = None
    markers: bool = False
    """A dot at every finite point (for sparse series such as eval metrics)."""
    opacity: float = 1.0
    in_legend: bool = True
    """False: no legend entry (e.g. every seed of a group after the first); the label stays the tooltip."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Band:
    label: str
    x: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    color: str
    opacity: float = 0.25


@dataclasses.dataclass(frozen=True, kw_only=True)
class Span:
    """A shaded range of x over the whole height of the plot area (e.g. the warm-up the judge does not judge)."""

    label: str
    x0: float
    x1: float
    color: str = "#000"
    opacity: float = 0.06


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strip:
    """One row of a strip chart: a dot per value, each dot's tooltip naming ``names[i]`` when given; ``mark``
    draws a short vertical tick (e.g. the row's mean)."""

    label: str
    values: Sequence[float]
    color: str
    names: Sequence[str] = ()
    mark: float | None = None


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values (data units, not logs) for a log axis over [10**lo, 10**hi]: powers of ten, with 2 and 5 times
    them when the range spans fewer than three decades; linear round ticks when it spans less than one tick."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [10.0 ** lo] if math.isfinite(lo) else []
    mults = (1.0,) if hi - lo > 3 else (1.0, 2.0, 5.0)
    out = [m * 10.0 ** d for d in range(math.floor(lo), math.ceil(hi) + 1) for m in mults
           if lo - 1e-9 <= d + math.log10(m) <= hi + 1e-9]
    if len(out) < 2:
        out = [v for v in nice_ticks(10.0 ** lo, 10.0 ** hi, 4) if v > 0]
    return out


def _fmt(v: float) -> str:
    return f"{v:.4g}"


class _Frame:
    """Maps data coordinates to pixels inside the plot area ``l..r`` x ``t..b`` (y in log10 when ``log``)."""

    def __init__(self, box: tuple[float, float, float, float], x: tuple[float, float], y: tuple[float, float],
                 *, log: bool = False) -> None:
        self.l, self.t, self.r, self.b = box
        self.log = log
        self.x0, self.x1 = x if x[1] > x[0] else (x[0] - 0.5, x[0] + 0.5)
        y = (math.log10(y[0]), math.log10(y[1])) if log else y
        self.y0, self.y1 = y if y[1] > y[0] else (y[0] - 0.5, y[0] + 0.5)

    def px(self, x: npt.ArrayLike) -> np.ndarray:
        return self.l + (np.asarray(x, dtype=np.float64) - self.x0) / (self.x1 - self.x0) * (self.r - self.l)

    def ty(self, y: npt.ArrayLike) -> np.ndarray:
        """``y`` on the axis's scale: itself, or its log10 (NaN for y <= 0) on a log axis."""
        v = np.asarray(y, dtype=np.float64)
        if not self.log:
            return v
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(v > 0, np.log10(np.where(v > 0, v, 1.0)), np.nan)

    def py(self, y: npt.ArrayLike) -> np.ndarray:
        return self.b - (self.ty(y) - self.y0) / (self.y1 - self.y0) * (self.b - self.t)

    def y_ticks(self) -> list[float]:
        return log_ticks(self.y0, self.y1) if self.log else nice_ticks(self.y0, self.y1, 5)


def _segments(mask: np.ndarray) -> list[slice]:
    """Runs of True in ``mask`` as slices."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return [slice(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _points(xs: np.ndarray, ys: np.ndarray) -> str:
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys, strict=True))


def _svg_open(width: float, height: float, title: str) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="{FONT_SIZE}" role="img">',
            f"<title>{esc(title)}</title>"]


def _legend_item(x: float, y: float, item: tuple[str, str, str, str | None, float], room: float) -> list[str]:
    """(label, color, kind, dash, width) with kind "line", "band" or "span"; ``y`` is the text baseline."""
    label, color, kind, dash, width = item
    out = []
    if kind in ("band", "span"):
        op = 0.35 if kind == "band" else 0.15
        out.append(f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="18" height="10" fill="{esc(color)}" opacity="{op}" '
                   f'stroke="{esc(color)}" stroke-opacity="0.5"/>')
    else:
        d = f' stroke-dasharray="{esc(dash)}"' if dash else ""
        out.append(f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 18:.1f}" y2="{y - 4:.1f}" stroke="{esc(color)}" '
                   f'stroke-width="{min(max(width, 1.5), 3.0):.1f}"{d}/>')
    out.append(_text(x + 24, y, label, room))
    return out


def line_chart(*, lines: Sequence[Line], bands: Sequence[Band] = (), spans: Sequence[Span] = (), title: str,
               x_label: str, y_label: str, y_range: tuple[float, float] | None = None, y_log: bool = False,
               width: int = 760, height: int = 340, legend: str | None = "right", legend_max: int = 30,
               legend_width: float | None = None) -> str:
    """One ``<svg>`` with ``spans`` and ``bands`` (shaded, drawn first) and ``lines`` over them, axes, ticks and a
    legend (``legend``: "right" of the plot area, "below" it, or None; at most ``legend_max`` entries, then a
    count of the rest; ``legend_width``: its width in pixels, e.g. to align the plot areas of several charts,
    default: its longest label's, at most 260).  The legend never overlaps the plot area: the svg grows to hold it.

    ``y_range`` default: the finite values of everything drawn (positive ones on a log axis), padded by 5%;
    ``y_log``: a log10 y axis (``y_range`` must then be positive)."""
    drawn: list[Line | Band] = [*lines, *bands]
    xs = [np.asarray(s.x, dtype=np.float64) for s in drawn]
    ally = [np.asarray(s.y, dtype=np.float64) for s in lines]
    ally += [np.asarray(v, dtype=np.float64) for b in bands for v in (b.lo, b.hi)]
    fx = np.concatenate(xs) if xs else np.zeros(1)
    fy = np.concatenate(ally) if ally else np.zeros(1)
    fx, fy = fx[np.isfinite(fx)], fy[np.isfinite(fy)]
    if y_log:
        fy = fy[fy > 0]
    xr = (float(fx.min()), float(fx.max())) if fx.size else (0.0, 1.0)
    if y_range is None:
        if y_log:
            y_lo, y_hi = (float(fy.min()), float(fy.max())) if fy.size else (1.0, 10.0)
            f = (y_hi / y_lo) ** 0.05 if y_hi > y_lo else 2.0
            y_range = (y_lo / f, y_hi * f)
        else:
            y_lo, y_hi = (float(fy.min()), float(fy.max())) if fy.size else (0.0, 1.0)
            pad = 0.05 * (y_hi - y_lo or abs(y_hi) or 1.0)
            y_range = (y_lo - pad, y_hi + pad)
    if y_log and not (y_range[0] > 0 and y_range[1] > 0):
        raise UsageError(f"a log axis needs a positive y range; got {y_range}")
    items: list[tuple[str, str, str, str | None, float]] = [(s.label, s.color, "span", None, 0.0) for s in spans
                                                            if s.label]
    items += [(b.label, b.color, "band", None, 0.0) for b in bands if b.label]
    items += [(ln.label, ln.color, "line", ln.dash, ln.width) for ln in lines if ln.label and ln.in_legend]
    more = len(items) - legend_max if len(items) > legend_max else 0
    if more:
        items = items[: legend_max - 1]
    labels = [it[0] for it in items] + ([f"+ {more + 1} more"] if more else [])
    leg_w = 0.0
    if legend and labels:
        leg_w = legend_width if legend_width is not None else min(max(text_width(s) for s in labels) + 30, 260.0)
    # plot-area box: the left margin holds the rotated y label and the widest tick label
    probe = _Frame((0, 0, 1, 1), xr, y_range, log=y_log)
    tick_w = max((text_width(_fmt(v)) for v in probe.y_ticks()), default=0.0)
    left = 24 + tick_w + 8
    right = width - 12 - (leg_w + 14 if legend == "right" and labels else 0)
    top, bottom = 28, height - 40
    n_rows = len(labels)
    extra_h = 0.0
    if legend == "right" and labels:
        height = max(height, int(top + 8 + _ROW * n_rows + 4))
    n_cols = 1
    if legend == "below" and labels:
        n_cols = max(1, int((width - 16) // (leg_w + 10)))
        extra_h = _ROW * math.ceil(n_rows / n_cols) + 8
    f = _Frame((left, top, right, bottom), xr, y_range, log=y_log)
    clip = f"clip{next(_ids)}"
    total_h = height + extra_h
    out = _svg_open(width, total_h, title)
    out.append(f'<defs><clipPath id="{clip}"><rect x="{f.l:.1f}" y="{f.t}" width="{f.r - f.l:.1f}" '
               f'height="{f.b - f.t}"/></clipPath></defs>')
    out.append(f'<rect class="plot-area" x="{f.l:.1f}" y="{f.t}" width="{f.r - f.l:.1f}" height="{f.b - f.t}" '
               f'fill="#fff" stroke="#999"/>')
    out.append(_text(width / 2, 18, title, width - 8, anchor="middle", bold=True))
    out.append(_text((f.l + f.r) / 2, bottom + 34, x_label, f.r - f.l, anchor="middle"))
    yc = (f.t + f.b) / 2
    out.append(_text(14, yc, y_label, f.b - f.t, anchor="middle", extra=f' transform="rotate(-90 14 {yc:.1f})"'))
    for v in nice_ticks(f.x0, f.x1, 6):
        x = float(f.px(v))
        out.append(f'<line x1="{x:.1f}" y1="{f.b}" x2="{x:.1f}" y2="{f.b + 4}" stroke="#999"/>'
                   f'<text x="{x:.1f}" y="{f.b + 16}" text-anchor="middle">{esc(_fmt(v))}</text>')
    for v in f.y_ticks():
        y = float(f.py(v))
        if not math.isfinite(y):
            continue
        out.append(f'<line x1="{f.l:.1f}" y1="{y:.1f}" x2="{f.r:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{f.l - 4:.1f}" y="{y + 4:.1f}" text-anchor="end">{esc(_fmt(v))}</text>')
    out.append(f'<g class="data" clip-path="url(#{clip})">')
    for s in spans:
        x0, x1 = float(f.px(s.x0)), float(f.px(s.x1))
        out.append(f'<rect x="{min(x0, x1):.1f}" y="{f.t}" width="{abs(x1 - x0):.1f}" height="{f.b - f.t}" '
                   f'fill="{esc(s.color)}" opacity="{s.opacity}"><title>{esc(s.label)}</title></rect>')
    for b in bands:
        bx = np.asarray(b.x, dtype=np.float64)
        ylo, yhi = f.py(b.lo), f.py(b.hi)
        for seg in _segments(np.isfinite(bx) & np.isfinite(ylo) & np.isfinite(yhi)):
            pts = _points(f.px(bx[seg]), yhi[seg]) + " " + _points(f.px(bx[seg])[::-1], ylo[seg][::-1])
            out.append(f'<polygon points="{pts}" fill="{esc(b.color)}" opacity="{b.opacity}" stroke="none"/>')
    for ln in lines:
        py = f.py(ln.y)
        px = f.px(ln.x)
        dash = f' stroke-dasharray="{esc(ln.dash)}"' if ln.dash else ""
        op = f' opacity="{ln.opacity}"' if ln.opacity != 1.0 else ""
        tip = f"<title>{esc(ln.label)}</title>" if ln.label else ""
        for seg in _segments(np.isfinite(px) & np.isfinite(py)):
            if seg.stop - seg.start == 1 and not ln.markers:  # a lone point: a dot, or it would not show
                out.append(f'<circle cx="{px[seg][0]:.1f}" cy="{py[seg][0]:.1f}" r="{max(2.0, ln.width):.1f}" '
                           f'fill="{esc(ln.color)}"{op}>{tip}</circle>')
                continue
            out.append(f'<polyline points="{_points(px[seg], py[seg])}" fill="none" '
                       f'stroke="{esc(ln.color)}" stroke-width="{ln.width}"{dash}{op}>{tip}</polyline>')
        if ln.markers:
            for cx, cy in zip(px, py, strict=True):
                if math.isfinite(cx) and math.isfinite(cy):
                    out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="2.5" fill="{esc(ln.color)}"{op}/>')
    out.append("</g>")
    if legend and labels:
        out.append('<g class="legend">')
        room = leg_w - 24
        if legend == "right":
            x0 = f.r + 14
            for i, it in enumerate(items):
                out += _legend_item(x0, f.t + 10 + _ROW * i, it, room)
        else:
            for i, it in enumerate(items):
                r, c = divmod(i, n_cols)
                out += _legend_item(8 + c * (leg_w + 10), height + 4 + _ROW * r, it, room)
        if more:
            i = len(items)
            x, y = (f.r + 14, f.t + 10 + _ROW * i) if legend == "right" else (
                8 + (i % n_cols) * (leg_w + 10), height + 4 + _ROW * (i // n_cols))
            out.append(_text(x + 24, y, f"+ {more + 1} more", room, extra=' fill="#666"'))
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def strip_chart(*, rows: Sequence[Strip | tuple[str, Sequence[float], str]], title: str, x_label: str,
                plot_width: int = 260, max_label: int = 300) -> str:
    """One dot per value on a shared horizontal axis, one row per ``Strip`` (or (label, values, color)); the left
    margin is as wide as the longest label, up to ``max_label`` pixels (longer labels are shortened, with the
    full label as a tooltip)."""
    strips = [r if isinstance(r, Strip) else Strip(label=r[0], values=r[1], color=r[2]) for r in rows]
    height = 60 + 22 * len(strips)
    vals = np.asarray([v for s in strips for v in s.values], dtype=np.float64)
    vals = vals[np.isfinite(vals)]
    lo, hi = (float(vals.min()), float(vals.max())) if vals.size else (0.0, 1.0)
    pad = 0.08 * (hi - lo or abs(hi) or 1.0)
    left = min(max((text_width(s.label) for s in strips), default=0.0) + 14, float(max_label))
    width = left + plot_width + 20
    f = _Frame((left, 28, left + plot_width, height - 40), (lo - pad, hi + pad), (0.0, float(len(strips))))
    out = _svg_open(width, height, title)
    out += [_text(width / 2, 18, title, width - 8, anchor="middle", bold=True),
            f'<rect class="plot-area" x="{f.l:.1f}" y="{f.t}" width="{f.r - f.l:.1f}" height="{f.b - f.t}" '
            f'fill="#fff" stroke="#999"/>',
            _text((f.l + f.r) / 2, height - 6, x_label, f.r - f.l, anchor="middle")]
    for v in nice_ticks(f.x0, f.x1, 4):
        x = float(f.px(v))
        out.append(f'<line x1="{x:.1f}" y1="{f.t}" x2="{x:.1f}" y2="{f.b}" stroke="#eee"/>'
                   f'<text x="{x:.1f}" y="{f.b + 16}" text-anchor="middle">{esc(_fmt(v))}</text>')
    for i, s in enumerate(strips):
        y = float(f.py(len(strips) - i - 0.5))
        out.append(_text(f.l - 6, y + 4, s.label, f.l - 8, anchor="end"))
        if s.mark is not None and math.isfinite(s.mark):
            x = float(f.px(s.mark))
            out.append(f'<line x1="{x:.1f}" y1="{y - 8:.1f}" x2="{x:.1f}" y2="{y + 8:.1f}" stroke="#000" '
                       f'stroke-width="1.5"><title>{esc(s.label)}: mean {esc(_fmt(s.mark))}</title></line>')
        for k, v in enumerate(s.values):
            who = s.names[k] if k < len(s.names) else s.label
            if math.isfinite(v):
                out.append(f'<circle cx="{float(f.px(v)):.1f}" cy="{y:.1f}" r="4" fill="{esc(s.color)}" '
                           f'opacity="0.8"><title>{esc(who)}: {esc(_fmt(v))}</title></circle>')
            else:
                out.append(f'<text x="{f.r - 4:.1f}" y="{y + 4:.1f}" text-anchor="end" fill="#c00">{esc(v)}'
                           f"<title>{esc(who)}: {esc(v)}</title></text>")
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
        raise UsageError(f"heatmap values have shape {vals.shape}, expected {(len(rows), len(cols))}")
    left, top, cell_h, legend_h = 230, 30, 16, 34
    n_cols = max(len(cols), 1)
    cell_w = max(2.0, (width - left - 10) / n_cols)
    height = top + cell_h * len(rows) + legend_h + 20
    lo, hi = value_range
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11" role="img">',
           f'<title>{esc(title)}</title>',
           _text(width / 2, 18, title, width - 8, anchor="middle", bold=True)]
    for i, label in enumerate(rows):
        y = top + i * cell_h
        out.append(_text(left - 6, y + cell_h - 4, label, left - 10, anchor="end"))
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

"""Reports of the experiments: one document model rendered three ways.

`Report` collects blocks (headings, paragraphs, bullet lists, tables, figures, verdicts) and writes
report.md (figures linked as files beside it) and report.html (one self-contained page: the PNGs
embedded as base64, no scripts, no external files). `text_table` formats the summary printed to
stdout. Studies build their Report from the run directory's logs only (see runner.read_arms), so every
number shown is one that a metrics.jsonl holds.

Inline markup in text: `code` and **bold**, nothing else.
"""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tformer.json_files import read_json

CSS = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
code { background: #f3f3f3; padding: 0 0.2em; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.9em; color: #555; }
.reproduced { color: #1a7f37; font-weight: bold; } .not-reproduced { color: #b42318; font-weight: bold; }
.inconclusive { color: #8a6d00; font-weight: bold; } .quick { color: #777; }
"""

QUICK_NOTE = (
    "**Quick setting**: a smoke test of the pipeline (tiny models, a handful of steps, a small slice of the "
    "data). Its "
    "verdicts say nothing about the claims; run the full setting for those."
)


def verdict_lines(checks, quick: bool) -> str:
    """The verdicts as console lines, `[status] claim`; in the quick setting with the caveat above them."""
    lines = [f"[{v.status}] {v.claim}" for v in checks]
    if quick:
        lines.insert(
            0, "quick setting (a smoke test of the pipeline): these verdicts say nothing about the claims"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- numbers
def fmt(x: float | int | None, digits: int = 4) -> str:
    """A number as the report prints it: fixed decimals, "nan" / "inf" spelled out, ints as they are."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}f}"


def fmt_count(n: float) -> str:
    """Parameter and FLOP counts: 1.23M, 45.6k."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


# ----------------------------------------------------------------------------- verdicts
@dataclass
class Verdict:
    """One claim tested: `holds` True (reproduced), False (not reproduced) or None (could not be decided,
    e.g. an arm missing); `rule` is the stated test, `evidence` the numbers it was decided on."""

    claim: str
    rule: str
    holds: bool | None
    evidence: str
    reference: str = ""

    @property
    def status(self) -> str:
        return {True: "reproduced", False: "not reproduced", None: "inconclusive"}[self.holds]


def lower(a: float | None, b: float | None) -> bool | None:
    """a < b for losses and perplexities, a diverged value (NaN or inf) worse than every finite one; None
    (undecided) when one is missing or neither is finite: NaN compares False to everything, so a rule
    written as `a < b` would decide on it."""
    if a is None or b is None:
        return None
    fa, fb = math.isfinite(a), math.isfinite(b)
    if fa and fb:
        return a < b
    return None if not (fa or fb) else fa


def less(a: float | None, b: float | None) -> bool | None:
    """a < b for measures with no "diverged" end (ratios, variations, load shares): None unless both
    are numbers (NaN: the measure had no data, e.g. no step after the warm-up window)."""
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return None
    return a < b


def training_units(run_dir: Path, asked: int | None, unit: str) -> str:
    """How many training documents (works, pairs) the study trained on, from its data.json: "all 38
    works", or "2 of 38" (asking for more than the split holds trains on all of them, and says so)."""
    try:
        have = read_json(Path(run_dir) / "data.json")["counts"]["train"]  # tasks.corpus.MANIFEST
    except (ValueError, KeyError, TypeError):  # a run without its manifest: what was asked
        return f"{'all' if asked is None else asked} training {unit}"
    if asked is None or asked >= have:
        more = f" ({asked:,} asked)" if asked is not None and asked > have else ""
        return f"all {have:,} training {unit}{more}"
    return f"{asked:,} of the {have:,} training {unit}"


def stopped_note(arms) -> str | None:
    """A sentence naming the arms that stopped before the budget (the non-finite rule), with the step and
    the reason, or None: their numbers (NaN, or from fewer steps) read otherwise like any arm's."""
    stopped = [(a.name, a.kind("stopped")[-1]) for a in arms if a.stopped]
    if not stopped:
        return None
    each = "; ".join(f"{name} at step {r['step']} ({r.get('reason', 'stopped')})" for name, r in stopped)
    return (
        f"**{len(stopped)} of {len(arms)} arms stopped before the budget**: {each}. Their numbers come "
        "from the steps they ran (a non-finite loss reads NaN); a rule that meets a diverged loss counts it "
        "worse than any finite one, and one with nothing to compare is inconclusive."
    )


def all_hold(flags: Sequence[bool | None]) -> bool | None:
    """True if every flag is True, False if any is False, None if there are none or some are None."""
    if not flags:
        return None
    if any(f is False for f in flags):
        return False
    return None if any(f is None for f in flags) else True


# ----------------------------------------------------------------------------- document
def _inline_html(text: str) -> str:
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)


def _md_cell(x: str) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


class Report:
    """A report as a list of blocks; `write(run_dir)` renders report.md and report.html."""

    def __init__(self, title: str, quick: bool = False) -> None:
        """quick: a smoke-test run, whose verdicts are shown muted and marked as no evidence."""
        self.title, self.quick = title, quick
        self.blocks: list[tuple[str, tuple]] = []

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(("heading", (text, level)))

    def text(self, text: str) -> None:
        self.blocks.append(("text", (text,)))

    def bullets(self, items: Sequence[str]) -> None:
        self.blocks.append(("bullets", (list(items),)))

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        self.blocks.append(("table", (list(headers), [list(map(str, r)) for r in rows])))

    def figure(self, path: Path, caption: str) -> None:
        self.blocks.append(("figure", (Path(path), caption)))

    def verdicts(self, verdicts: Sequence[Verdict]) -> None:
        self.blocks.append(("verdicts", (list(verdicts),)))

    def _status(self, v: Verdict, template: str) -> str:
        return template.format(v.status) + (" (quick run: not evidence)" if self.quick else "")

    # ------------------------------------------------------------------ markdown
    def to_markdown(self) -> str:
        out = [f"# {self.title}", ""]
        for kind, args in self.blocks:
            out += getattr(self, f"_md_{kind}")(*args) + [""]
        return "\n".join(out)

    def _md_heading(self, text: str, level: int) -> list[str]:
        return [f"{'#' * level} {text}"]

    def _md_text(self, text: str) -> list[str]:
        return [text]

    def _md_bullets(self, items: list[str]) -> list[str]:
        return [f"- {i}" for i in items]

    def _md_table(self, headers: list[str], rows: list[list[str]]) -> list[str]:
        lines = ["| " + " | ".join(map(_md_cell, headers)) + " |", "|" + "---|" * len(headers)]
        return lines + ["| " + " | ".join(map(_md_cell, r)) + " |" for r in rows]

    def _md_figure(self, path: Path, caption: str) -> list[str]:
        return [f"![{caption}]({path.name})", "", f"*{caption}*"]

    def _md_verdicts(self, verdicts: list[Verdict]) -> list[str]:
        rows = [[v.claim, v.rule, self._status(v, "**{}**"), v.evidence, v.reference] for v in verdicts]
        return self._md_table(["claim", "rule", "result", "evidence (this run)", "published"], rows)

    # ------------------------------------------------------------------ html
    def to_html(self) -> str:
        body = [f"<h1>{html.escape(self.title)}</h1>"]
        for kind, args in self.blocks:
            body.append(getattr(self, f"_html_{kind}")(*args))
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(self.title)}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(body)
            + "\n</body></html>\n"
        )

    def _html_heading(self, text: str, level: int) -> str:
        return f"<h{level}>{html.escape(text)}</h{level}>"

    def _html_text(self, text: str) -> str:
        return f"<p>{_inline_html(text)}</p>"

    def _html_bullets(self, items: list[str]) -> str:
        return "<ul>" + "".join(f"<li>{_inline_html(i)}</li>" for i in items) + "</ul>"

    def _html_table(self, headers: list[str], rows: list[list[str]], raw: bool = False) -> str:
        cell = (lambda x: x) if raw else _inline_html
        head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
        body = "".join("<tr>" + "".join(f"<td>{cell(c)}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def _html_figure(self, path: Path, caption: str) -> str:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return (
            f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_inline_html(caption)}</figcaption></figure>"
        )

    def _html_verdicts(self, verdicts: list[Verdict]) -> str:
        rows = [
            [
                _inline_html(v.claim),
                _inline_html(v.rule),
                self._status(
                    v, f'<span class="{"quick" if self.quick else v.status.replace(" ", "-")}">{{}}</span>'
                ),
                _inline_html(v.evidence),
                _inline_html(v.reference),
            ]
            for v in verdicts
        ]
        return self._html_table(
            ["claim", "rule", "result", "evidence (this run)", "published"], rows, raw=True
        )

    # ------------------------------------------------------------------ files
    def write(self, run_dir: Path) -> tuple[Path, Path]:
        run_dir = Path(run_dir)
        md, page = run_dir / "report.md", run_dir / "report.html"
        md.write_text(self.to_markdown(), encoding="utf-8")
        page.write_text(self.to_html(), encoding="utf-8")
        return md, page


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A fixed-width table for the terminal: first column left-aligned, the others right-aligned."""
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


# ----------------------------------------------------------------------------- plots
def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# series that may coincide (a variant that changes nothing at a length, two arms with equal losses): each
# drawn thinner and in another dash or marker than the one before, so one never hides another
LINE_STYLES = [
    ("-", 2.6, "o"),
    ("--", 2.0, "s"),
    ("-.", 1.6, "^"),
    (":", 1.4, "D"),
    ("-", 1.0, "v"),
    ("--", 0.8, "x"),
]


def series_style(i: int, markers: bool = False) -> dict:
    ls, lw, marker = LINE_STYLES[i % len(LINE_STYLES)]
    return {"ls": ls, "lw": lw, **({"marker": marker, "ms": 4, "mfc": "none"} if markers else {})}


def _readable_axes(fig) -> None:
    """Whole-number ticks on step / block / layer axes; plain numbers on a log axis that spans under two
    decades (matplotlib writes 3x10^-1, or labels one tick only)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax in fig.axes:
        label = ax.get_xlabel().lower()
        if ax.get_xscale() == "linear" and any(w in label for w in ("step", "block", "layer", "depth")):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_yscale() == "log":
            lo, hi = ax.get_ylim()
            if lo > 0 and hi / lo < 100:
                ax.yaxis.set_major_formatter(plain)
                ax.yaxis.set_minor_formatter(plain)


def save_figure(fig, path: Path) -> Path:
    _readable_axes(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path


def panels(n: int, width: float = 4.2, height: float = 3.3, sharey: bool = False, layout: str | None = None):
    """(figure, list of n axes) side by side."""
    plt = pyplot()
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False, sharey=sharey, layout=layout)
    return fig, list(axes[0])

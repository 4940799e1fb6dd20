"""The HTML report: one self-contained file (no network resources, no scripts) holding, per finding,
the console report's sections and an inline SVG plot of the pools' occupancy.
Design notes: docs/internals/reports.md.
"""

from __future__ import annotations

import datetime
import io
import re
from typing import Mapping

import jinja2
from rich.console import Console
from rich.terminal_theme import MONOKAI

from kvaudit.config import TargetConfig
from kvaudit import __version__
from kvaudit.audit.findings import Finding, report_order
from kvaudit.program import format_op
from kvaudit.reports.report import finding_renderable, summary_rows, suppressions_table
from kvaudit.reports.sarif import current_summary, engine_of

# one colour per identity term, in SERIES order; leaked is the one that should catch the eye
COLOURS = {"available": "#cfd8dc", "evictable": "#81c784", "protected": "#4fc3f7", "session_held": "#ba68c8",
           "uncached": "#ffb74d", "leaked": "#e53935"}

_env = jinja2.Environment(loader=jinja2.PackageLoader("kvaudit", "templates"),
                          autoescape=jinja2.select_autoescape(["html"]), trim_blocks=True, lstrip_blocks=True)


def _rich_html(renderable, width: int = 110) -> str:
    console = Console(record=True, width=width, file=io.StringIO(), color_system="truecolor")
    console.print(renderable)
    return console.export_html(theme=MONOKAI, inline_styles=True, code_format='<pre class="rich">{code}</pre>')


def _inline_svg(fig) -> str:
    """``fig`` as an ``<svg>`` element with no prolog, metadata or namespace URLs: the page names no
    outside resource."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    return re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)


IN_USE = ("leaked", "uncached", "session_held", "protected", "evictable")  # stacked bottom-up


def occupancy_svg(timeline: dict, finding: Finding | None = None) -> str:
    """An SVG plot of ``timeline`` (:func:`kvaudit.reports.timeline.record`), one panel per pool (the
    finding's first): the in-use terms stacked, the engine's own in-use count dashed, ``available`` on
    the right axis, the step ``finding`` was detected at a red line, steps after the program shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    plt.rcParams["svg.fonttype"] = "none"  # text stays text: searchable, and no glyph paths
    steps = timeline["steps"]
    pools = list(timeline["pools"])
    if finding is not None and finding.pool in pools:
        pools.remove(finding.pool)
        pools.insert(0, finding.pool)
    fig, axes = plt.subplots(len(pools), 1, figsize=(9.5, 1.6 * len(pools) + 0.7), sharex=True, squeeze=False)
    end = timeline.get("program_end_step")
    drained = end is not None and bool(steps) and end < steps[-1]
    for ax, pool in zip(axes[:, 0], pools):
        p = timeline["pools"][pool]
        series, total = p["series"], p["total"]
        ax.stackplot(steps, *[series[t] for t in IN_USE], labels=IN_USE, colors=[COLOURS[t] for t in IN_USE],
                     step="post", linewidth=0)
        engine_in_use = [total - a for a in series["available"]]
        ax.step(steps, engine_in_use, where="post", color="#263238", linestyle="--", linewidth=0.9,
                label="in use (engine: total - available)")
        top = max([1, *engine_in_use, *(sum(v) for v in zip(*(series[t] for t in IN_USE)))])
        # NOTE: below 0: a double free, or a term a bug drove negative (session_held released twice)
        bottom = min(0, *engine_in_use, *(min(series[t]) for t in IN_USE))
        ax.set_ylim(bottom - (top - bottom) * 0.05 if bottom < 0 else 0, top * 1.15)
        if bottom < 0:
            ax.axhline(0, color="#b71c1c", linewidth=0.6)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=8)
        right = ax.twinx()
        right.step(steps, series["available"], where="post", color="#90a4ae", linewidth=1.2, label="available")
        right.set_ylim(0, total * 1.05 or 1)
        right.tick_params(labelsize=7, colors="#78909c")
        leaked = max(series["leaked"])
        mark = finding is not None and pool == finding.pool
        title = f"{pool}: {total} {p['unit']}" + (f", {leaked} leaked at peak" if leaked else "")
        ax.set_title(title.replace("$", r"\$"), loc="left", fontsize=9,
                     color="#b71c1c" if mark or leaked else "#263238", fontweight="bold" if mark else "normal")
        if drained:
            ax.axvspan(end, steps[-1], color="#eceff1", alpha=0.7, zorder=0)
        if finding is not None and finding.step >= 0:
            ax.axvline(finding.step, color="#d50000", linewidth=1.4)
    axes[-1, 0].set_xlabel("scheduler step" + (" (shaded: steps after the program)" if drained else ""), fontsize=8)
    if finding is not None and finding.step >= 0:  # in the title row: never over the data
        axes[0, 0].set_title(f"red line: {finding.kind} detected (op #{finding.op_index}, step {finding.step})",
                             loc="right", fontsize=8, color="#d50000")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    handles.append(plt.Line2D([], [], color="#90a4ae", linewidth=1.2))
    labels.append("available (right axis)")
    fig.legend(handles, labels, loc="upper center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    svg = _inline_svg(fig)
    plt.close(fig)
    return svg


def ran_label(config: TargetConfig, cases: list, ran: tuple = ()) -> tuple[str, str, str]:
    """``(title, presets, bugs)`` of a report's header: the presets that ran (``ran``, a job's configs;
    else those of the cases with findings; else ``config``), the title naming them (``"13 presets"`` past
    three) and each preset's bugs (``"none"``; several presets: ``"mine-leaky: abort-leak"`` per preset with any)."""
    configs = list({c.preset: c for c in (ran or [c.config for c in cases if c.findings and c.config]
                                          or [config])}.values())
    names = [c.preset for c in configs]
    if len(configs) == 1:
        return names[0], names[0], ", ".join(sorted(configs[0].bugs)) or "none"
    bugs = "; ".join(f"{c.preset}: {', '.join(sorted(c.bugs))}" for c in configs if c.bugs) or "none"
    return (", ".join(names) if len(names) <= 3 else f"{len(names)} presets"), ", ".join(names), bugs


def render_html(config: TargetConfig, cases: list, suppressed: dict[str, int] | None = None, suppressions=None,
                extra: dict | None = None, recorded: Mapping[str, str] | None = None, ran: tuple = ()) -> str:
    """The report page for ``cases`` (:class:`kvaudit.reports.outputs.Case`; one without a timeline gets
    no plot); ``suppressions``: a SuppressionSet or None; ``recorded``: a signature -> the engine release its
    finding was recorded on (:func:`~kvaudit.reports.sarif.engine_of`); ``ran``: the configs a job ran, which
    the header names (:func:`ran_label`)."""
    on = engine_of(config, recorded)
    findings = [f for c in cases for f in c.findings]
    by_sig: dict[str, dict] = {}
    for case in cases:
        for f in report_order(case.findings):
            if f.signature in by_sig:  # one section per signature, as in the summary and JUnit
                by_sig[f.signature]["duplicates"] += 1
                continue
            i = len(by_sig)
            by_sig[f.signature] = {
                "title": f"finding {i + 1}: {f.kind}",
                "summary": current_summary(f, on(f)),
                "signature": f.signature,
                "duplicates": 0,
                "preset": (case.config or config).preset,
                "console": _rich_html(finding_renderable(f, case.program, i, case.program_title,
                                                                engine=on(f))),
                "plot": occupancy_svg(case.timeline, f) if case.timeline else None,
            }
    clean = [c for c in cases if not c.findings]
    title, presets, bugs = ran_label(config, cases, ran)
    # NOTE: counted as the SUMMARY: line counts them (every report), the signatures named where they are fewer
    counted = f"{len(findings)} finding(s)" + (f" in {len(by_sig)} signature(s)" if len(by_sig) < len(findings) else "")
    return _env.get_template("report.html").render(
        version=__version__,
        generated=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        config=config, title=title, counted=counted, presets=presets, several="," in presets, bugs=bugs,
        program=[format_op(op) for op in clean[0].program] if clean else [],
        summary=summary_rows(findings, suppressed or {}),
        sections=list(by_sig.values()),
        clean_plot=occupancy_svg(clean[0].timeline) if clean and clean[0].timeline else None,
        suppressions=_rich_html(suppressions_table(suppressions)) if suppressions else None,  # (None or empty)
        extra=extra or {},
    )

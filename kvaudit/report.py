"""Console reports with rich, in LeakSanitizer's manner but for KV slots.

Findings are plain data (:class:`kvaudit.findings.Finding`); this module only renders them.
"""

from __future__ import annotations

import linecache
import os
from collections import Counter

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from engine_under_test import EngineConfig
from kvaudit.findings import Finding, Site, source_path
from kvaudit.program import Op, format_op
from kvaudit.suppress import SuppressionSet


def _stack(title: str, sites: list[Site]) -> Group:
    parts: list = [Text(title, style="bold")]
    for i, s in enumerate(sites):
        parts.append(Text(f"    #{i} {s.function}  {_rel(s.file)}:{s.line}", style="cyan" if i == 0 else ""))
        src = linecache.getline(source_path(s.file), s.line).strip()
        if src:
            parts.append(Syntax("        " + src, "python", theme="ansi_dark", background_color="default"))
    if not sites:
        parts.append(Text("    (no stack recorded)", style="dim"))
    return Group(*parts)


def _rel(path: str) -> str:
    """``engine_under_test/...`` or ``kvaudit/...`` when the path is inside a package we know."""
    for pkg in ("engine_under_test", "kvaudit"):
        marker = f"{os.sep}{pkg}{os.sep}"
        if marker in path:
            return pkg + os.sep + path.rsplit(marker, 1)[1]
    return path


def finding_renderable(f: Finding, program: list[Op] | None, index: int = 0,
                       program_title: str = "minimized program") -> Panel:
    parts: list = [
        Text(f"==ERROR: kvaudit: {f.summary()}", style="bold red"),
        Text(f"signature: {f.signature}", style="yellow"),
        Text(f"detected after op #{f.op_index} at scheduler step {f.step}: {f.message}"),
    ]
    if f.slots:
        shown = ", ".join(map(str, f.slots[:16])) + (" ..." if len(f.slots) > 16 else "")
        parts.append(Text(f"{'rows' if f.unit == 'row' else 'slots'}: [{shown}]"))
    if f.kind == "double-free":
        parts.append(_stack("freed again at:", f.free_sites))
        parts.append(_stack("previously freed at:", f.prev_free_sites))
    if f.read_sites:
        parts.append(_stack("read at:", f.read_sites))
    if f.kind == "crash":
        parts.append(_stack("raised at:", f.alloc_sites))
    elif f.kind == "lock-imbalance":
        if f.alloc_sites:
            parts.append(_stack("last unmatched lock taken at:", f.alloc_sites))
        if f.free_sites:
            parts.append(_stack("last unmatched lock released at:", f.free_sites))
    elif f.alloc_sites:
        parts.append(_stack("allocated at:", f.alloc_sites))
    if f.owner_history:
        t = Table(title="lifecycle of the first unit", title_justify="left", show_edge=False, pad_edge=False)
        t.add_column("op", justify="right")
        t.add_column("step", justify="right")
        t.add_column("event")
        for o in f.owner_history:
            t.add_row(str(o.op_index), str(o.step), o.event if o.event != "owner" else f"owned by {o.owner}")
        if f.kind == "leak":
            owner = next((o.owner for o in reversed(f.owner_history) if o.owner != "-"), None)
            t.add_row("", "", f"[bold red]never freed[/]; last owner: {owner or 'none seen'}")
        parts.append(t)
    if program:
        t = Table(title=program_title, title_justify="left",
                  show_edge=False, pad_edge=False, show_header=False)
        t.add_column(justify="right")
        t.add_column()
        for i, op in enumerate(program):
            mark = "  <- detected here" if i == f.op_index else ""
            t.add_row(str(i), format_op(op) + mark)
        parts.append(t)
    if f.engine_check:
        ok = f.engine_check[0].endswith("ok")
        parts.append(Text("engine check_memory(): ", style="bold").append(
            "ok" if ok else "; ".join(f.engine_check), style="" if ok else "magenta"))
    if f.traceback:
        parts.append(Text(f.traceback.rstrip(), style="dim"))
    return Panel(Group(*parts), title=f"finding {index + 1}: {f.kind}", title_align="left", border_style="red")


def summary_table(findings: list[Finding], deduplicated: int = 0) -> Table:
    t = Table(title="summary", title_justify="left")
    t.add_column("kind")
    t.add_column("count", justify="right")
    for kind, n in sorted(Counter(f.kind for f in findings).items()):
        t.add_row(kind, str(n))
    if not findings:
        t.add_row("none", "0")
    if deduplicated:
        t.add_row("deduplicated", str(deduplicated), style="dim")
    return t


def suppressions_table(suppressions: SuppressionSet) -> Table:
    """Each rule with its hit count (findings it suppressed); a rule that matched nothing is flagged."""
    t = Table(title="suppressions used", title_justify="left",
              caption=suppressions.path, caption_justify="left")
    t.add_column("#", justify="right")
    t.add_column("kind", no_wrap=True)
    for col in ("pool", "site", "reason"):
        t.add_column(col, overflow="fold")
    t.add_column("hits", justify="right", no_wrap=True)
    for s in suppressions:
        any_ = Text("*", style="dim")
        cells = [s.kind or any_, s.pool or any_, s.site or any_, s.reason or Text("-", style="dim")]
        if s.hits:
            t.add_row(str(s.index), *cells, str(s.hits))
        else:
            t.add_row(str(s.index), *cells, "0 (matched nothing)", style="yellow")
    return t


def print_suppressions(console: Console, suppressions: SuppressionSet) -> None:
    """The "suppressions used" table and a line counting the rules that matched nothing."""
    if not len(suppressions):
        console.print(Text(f"suppressions used: none ({suppressions.path or 'no rules'} has no [[suppress]] entries)",
                           style="dim"), soft_wrap=True)
        return
    console.print(suppressions_table(suppressions))
    unused = suppressions.unused()
    if unused:
        console.print(Text(f"{len(unused)} suppression(s) matched nothing: "
                           + ", ".join(f"#{s.index} ({s.describe()})" for s in unused), style="yellow"),
                      soft_wrap=True)


def print_report(console: Console, config: EngineConfig, program: list[Op], findings: list[Finding],
                 deduplicated: int = 0, program_title: str = "minimized program",
                 suppressions: SuppressionSet | None = None) -> None:
    """The report: a header, one panel per finding, the summary and, with ``suppressions``, the
    suppressions used (``findings`` are the unsuppressed ones)."""
    bugs = ", ".join(sorted(config.bugs)) or "none"
    console.print(Text(f"kvaudit report: preset {config.preset}, bugs: {bugs}, model {config.model}, "
                       f"page_size {config.page_size}", style="bold"))
    for i, f in enumerate(findings):
        console.print(finding_renderable(f, program, i, program_title))
    console.print(summary_table(findings, deduplicated))
    if suppressions is not None:
        print_suppressions(console, suppressions)

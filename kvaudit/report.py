"""Console reports with rich, in LeakSanitizer's manner but for KV slots.

Findings are plain data (:class:`kvaudit.findings.Finding`); this module only renders them.
"""

from __future__ import annotations

import linecache
import os

from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from engine_under_test import EngineConfig
from kvaudit.findings import KINDS, Finding, Site, source_path
from kvaudit.program import Op, format_op
from kvaudit.suppress import SuppressionSet


def _stack(title: str, sites: list[Site]) -> Group:
    parts: list = [Text(title, style="bold")]
    for i, s in enumerate(sites):
        parts.append(Text(f"    #{i} {s.function}  {_rel(s.file)}:{s.line}", style="cyan" if i == 0 else ""))
        src = s.source or linecache.getline(source_path(s.file), s.line).strip()
        if src:
            parts.append(Padding(Syntax(src, "python", theme="ansi_dark", background_color="default",
                                        word_wrap=True), (0, 0, 0, 8)))  # long lines wrap, indented
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
    elif f.kind == "accounting-drift" and f.alloc_sites:  # the tree insert that cached past kv_committed_len
        parts.append(_stack("cached into the tree at:", f.alloc_sites))
    elif f.alloc_sites:
        parts.append(_stack("allocated at:", f.alloc_sites))
    if f.owner_history:
        parts.append(lifecycle_table(f))
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


def lifecycle_table(f: Finding) -> Table:
    """The first unit's timeline: its alloc (op, step, site, for whom), owner changes, the end of its
    last owner, its frees, and for a leak the verdict "never freed"."""
    first = f.slots[0] if f.slots else "?"
    if f.unit == "page" and f.slots and f.num_units:
        first = f.slots[0] // (len(f.slots) // f.num_units)  # slots list whole pages
    t = Table(title=f"lifecycle of {f.unit} {first}", title_justify="left", show_edge=False, pad_edge=False)
    t.add_column("op", justify="right")
    t.add_column("step", justify="right")
    t.add_column("event")
    owner = None
    for o in f.owner_history:
        if o.event != "owner":
            text = o.event
        elif o.owner == "-":
            text = f"[yellow]{owner} no longer holds it[/]; no owner since" if owner else "no owner"
        else:
            text = f"owned by {o.owner}"
        if o.event == "owner" and o.owner != "-":
            owner = o.owner
        elif o.event == "owner":
            owner = None
        t.add_row(str(o.op_index), str(o.step), text)
    if f.kind == "leak":
        last = next((o.owner for o in reversed(f.owner_history) if o.owner != "-"), None)
        t.add_row("", "", f"[bold red]never freed[/]; last owner: {last or 'none seen'}")
    return t


def summary_rows(findings: list[Finding], suppressed: dict[str, int] | None = None,
                 deduplicated: dict[str, int] | None = None) -> list[dict]:
    """Per kind: distinct findings (by signature), suppressed findings and deduplicated reports
    (further reports of a signature already counted), in :data:`KINDS` order."""
    suppressed, deduplicated = dict(suppressed or {}), dict(deduplicated or {})
    distinct: dict[str, set[str]] = {}
    for f in findings:
        sigs = distinct.setdefault(f.kind, set())
        if f.signature in sigs:
            deduplicated[f.kind] = deduplicated.get(f.kind, 0) + 1
        sigs.add(f.signature)
    kinds = [k for k in KINDS if k in distinct or suppressed.get(k) or deduplicated.get(k)]
    kinds += sorted((set(distinct) | set(suppressed) | set(deduplicated)) - set(KINDS))
    return [{"kind": k, "findings": len(distinct.get(k, ())), "suppressed": suppressed.get(k, 0),
             "deduplicated": deduplicated.get(k, 0)} for k in kinds]


def suppressed_by_kind(suppressions: SuppressionSet | None) -> dict[str, int]:
    """Distinct signatures the rules suppressed, per finding kind."""
    out: dict[str, int] = {}
    for sig in (suppressions.suppressed_signatures() if suppressions is not None else ()):
        kind = sig.split("/", 1)[0]
        out[kind] = out.get(kind, 0) + 1
    return out


def summary_table(findings: list[Finding], suppressed: dict[str, int] | None = None,
                  deduplicated: dict[str, int] | None = None) -> Table:
    """Findings by kind, with suppressed and deduplicated counts, and a total row."""
    rows = summary_rows(findings, suppressed, deduplicated)
    t = Table(title="summary", title_justify="left", show_footer=bool(rows))
    totals = [sum(r[c] for r in rows) for c in ("findings", "suppressed", "deduplicated")]
    t.add_column("kind", footer="total")
    for col, total in zip(("findings", "suppressed", "deduplicated"), totals):
        t.add_column(col, justify="right", footer=str(total))
    for r in rows:
        t.add_row(r["kind"], str(r["findings"]), str(r["suppressed"]), str(r["deduplicated"]),
                  style="" if r["findings"] else "dim")
    if not rows:
        t.add_row("none", "0", "0", "0")
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


def header(config) -> str:
    """The report's first line. For a real-SGLang config: the tree core, and the fields that differ
    from its preset (a corpus file may use a smaller pool than the preset it names)."""
    bugs = ", ".join(sorted(config.bugs)) or "none"
    if getattr(config, "target", "eut") != "sglang":
        return f"kvaudit report: preset {config.preset}, bugs: {bugs}, model {config.model}, page_size {config.page_size}"
    from kvaudit.targets.sglang_config import SGLANG_PRESETS
    preset = config.preset
    if preset in SGLANG_PRESETS:
        base = SGLANG_PRESETS[preset].config().to_dict()
        mine = config.to_dict()
        changed = [f"{k}={mine[k]}" for k in mine
                   if k not in ("tree_core", "bugs", "seed", "preset") and mine[k] != base.get(k)]
        if changed:
            preset += f" (modified: {', '.join(changed)})"
    return (f"kvaudit report: target sglang, preset {preset}, {config.tree_core} tree core, bugs: {bugs}, "
            f"page_size {config.page_size}")


def print_cases(console: Console, config: EngineConfig, cases: list[tuple[list[Op], list[Finding], str]],
                suppressed: dict[str, int] | None = None) -> None:
    """Like :func:`print_report` for several (program, findings, program title) cases of one config
    (a campaign's report): every finding with its own program, one summary."""
    console.print(Text(header(config), style="bold"))
    i = 0
    for program, findings, title in cases:
        for f in findings:
            console.print(finding_renderable(f, program, i, title))
            i += 1
    console.print(summary_table([f for _, fs, _ in cases for f in fs], suppressed))


def print_report(console: Console, config: EngineConfig, program: list[Op], findings: list[Finding],
                 deduplicated: dict[str, int] | None = None, program_title: str = "minimized program",
                 suppressions: SuppressionSet | None = None) -> None:
    """The report: a header, one panel per finding, the summary and, with ``suppressions``, the
    suppressions used (``findings`` are the unsuppressed ones)."""
    console.print(Text(header(config), style="bold"))
    for i, f in enumerate(findings):
        console.print(finding_renderable(f, program, i, program_title))
    console.print(summary_table(findings, suppressed_by_kind(suppressions), deduplicated))
    if suppressions is not None:
        print_suppressions(console, suppressions)

"""Console reports with rich, in LeakSanitizer's manner but for KV slots: findings are plain data, this
module only renders them. Design notes: docs/internals/reports.md."""

from __future__ import annotations

import io
from collections import Counter
from typing import Mapping, Sequence

import numpy as np

from rich import box
from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.measure import Measurement
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from kvaudit.config import TargetConfig, shown_path
from kvaudit.audit.findings import KINDS, Finding, Site, portable_path, report_order
from kvaudit.audit.frames import RecordedEngine, resolve
from kvaudit.audit.kinds import lookup
from kvaudit.program import Op, format_op
from kvaudit.audit.suppress import SuppressionSet
from kvaudit.reports.sarif import current_summary, engine_of, lifecycle_events, verdict_text
from kvaudit.targets.registry import kind_of


def _stack(title: str, sites: list[Site], plain: bool = False, engine: RecordedEngine | None = None) -> Group:
    """A titled stack, innermost frame first, each frame with its source line as it is now (a frame of
    another release of ``engine``: as recorded, its release named)."""
    parts: list = [Text(title, style="bold")]
    for i, s in enumerate(sites):
        fr = resolve(s, engine)
        parts.append(Text(f"    #{i} {s.function}  {portable_path(s.file)}:{fr.line}", style="cyan" if i == 0 else ""))
        if fr.source:
            parts.append(Text("        " + fr.source) if plain else
                         Padding(Syntax(fr.source, "python", theme="ansi_dark", background_color="default",
                                        word_wrap=True), (0, 0, 0, 8)))  # long lines wrap, indented
        if fr.note:
            parts.append(Text(f"        ({fr.note})", style="yellow") if plain else
                         Padding(Text(f"({fr.note})", style="yellow"), (0, 0, 0, 8)))
    if not sites:
        parts.append(Text("    (no stack recorded)", style="dim"))
    return Group(*parts)


def _print(console: Console, renderable, plain: bool, soft_wrap: bool = False) -> None:
    """Print ``renderable``; with ``plain``, with no control codes (``NO_COLOR`` keeps bold), no broken
    lines, no cut table cells (drawn as wide as its widest row needs, whatever the console's width) and no
    trailing blanks."""
    if not plain:
        console.print(renderable, soft_wrap=soft_wrap)
        return
    buf = Console(file=io.StringIO(), width=console.width, color_system=None, highlight=False)
    buf.width = max(console.width, Measurement.get(buf, buf.options.update_width(1 << 20), renderable).maximum)
    buf.print(renderable, soft_wrap=True)
    text = buf.file.getvalue().removesuffix("\n")
    console.out("\n".join(line.rstrip() for line in text.split("\n")), highlight=False)


def is_plain(console: Console) -> bool:
    """Whether ``console`` gets plain lines (CI logs: no frames, no control codes): not a terminal,
    ``TERM=dumb`` or ``NO_COLOR``."""
    return not console.is_terminal or console.is_dumb_terminal or console.no_color


def print_table(console: Console, table: Table, header: bool = False) -> None:
    """``table`` as rich draws it; on a plain console, its title, with ``header`` its column names, one
    unfolded line per row (cells joined by two spaces), then its caption: each row whole in a CI log."""
    if not is_plain(console):
        console.print(table)
        return
    lines = [f"{table.title}:"] * bool(table.title)
    lines += ["  " + "  ".join(str(c.header) for c in table.columns)] * header
    for row in zip(*(c.cells for c in table.columns)):
        lines.append("  " + "  ".join(c.plain if isinstance(c, Text) else str(c) for c in row))
    for line in lines + [str(table.caption)] * bool(table.caption):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def finding_renderable(f: Finding, program: list[Op] | None, index: int = 0,
                       program_title: str = "minimized program", plain: bool = False,
                       engine: RecordedEngine | None = None) -> Panel | Group:
    """One finding: a red panel, or with ``plain`` the same lines unframed from the ``==ERROR:
    kvaudit:`` line (print it with ``soft_wrap=True``). Its stacks are its kind's ``console`` sections, their
    frames resolved for ``engine`` (:func:`~kvaudit.audit.frames.resolve`)."""
    parts: list = [
        Text(f"==ERROR: kvaudit: {current_summary(f, engine)}", style="bold red"),
        Text(f"signature: {f.signature}", style="yellow"),
        Text(f"detected after op #{f.op_index} at scheduler step {f.step}: {f.message}"),
    ]
    if f.slots:
        word, ids = f.listed()
        shown = ", ".join(map(str, ids[:16])) + (" ..." if len(ids) > 16 else "")
        parts.append(Text(f"{word}: [{shown}]"))
    for part, title, more in lookup(f.kind).console(f):
        parts.append(_stack(title, more, plain, engine) if part == "stack" else Text(title, style=more))
    if f.owner_history:
        parts.append(lifecycle_table(f, plain))
    if program:
        t = Table(title=program_title, title_justify="left",
                  show_edge=False, pad_edge=False, show_header=False, box=None if plain else box.HEAVY_HEAD)
        t.add_column(justify="right")
        t.add_column()
        for i, op in enumerate(program):
            mark = "  <- detected here" if i == f.op_index else ""
            t.add_row(str(i), format_op(op) + mark)
        parts.append(t)
    for title, lines in (("engine check_memory(): ", f.engine_check),
                         ("engine check_memory() once drained to idle: ", f.engine_check_at_idle)):
        if lines:
            text = verdict_text(lines)
            parts.append(Text(title, style="bold").append(text, style="" if text == "ok" else "magenta"))
    if f.traceback:
        parts.append(Text(f.traceback.rstrip(), style="dim"))
    if plain:
        return Group(*parts, Text(""))
    return Panel(Group(*parts), title=f"finding {index + 1}: {f.kind}", title_align="left", border_style="red")


def lifecycle_table(f: Finding, plain: bool = False) -> Table:
    """The first unit's timeline (:func:`kvaudit.reports.sarif.lifecycle_events`) as a table."""
    first = f.slots[0] if f.slots else "?"
    if f.unit in ("page", "block") and f.slots and f.num_units:
        first = f.slots[0] // (len(f.slots) // f.num_units)  # slots list whole pages
    t = Table(title=f"lifecycle of {f.unit} {first}", title_justify="left", show_edge=False, pad_edge=False,
              box=None if plain else box.HEAVY_HEAD)
    t.add_column("op", justify="right")
    t.add_column("step", justify="right")
    t.add_column("event")
    for op, step, text, style in lifecycle_events(f):
        t.add_row(op, step, Text(text, style=style))
    return t


def summary_rows(findings: list[Finding], suppressed: dict[str, int] | None = None) -> list[dict]:
    """Per kind, in :data:`KINDS` order: distinct findings (by signature), suppressed findings and
    deduplicated reports (further reports of a signature already counted)."""
    suppressed, deduplicated = dict(suppressed or {}), {}
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


def units_involved(runs: list[list[Finding]]) -> Counter:
    """Distinct units the findings name, as ``{"slot": n, "row": n, "block": n}``: a unit counts once per
    pool per program run (``runs``: the findings of each run), however many findings name it (the same
    slots leaked under two signatures are counted once); units of different runs are different memory."""
    counts: Counter = Counter()
    for findings in runs:
        ids: dict[tuple[str, str], list] = {}
        for f in findings:
            if f.slots:
                unit = f.unit if f.unit in ("row", "block") else "slot"
                ids.setdefault((unit, f.pool), []).append(f.listed()[1] if unit == "block" else f.slots)
        for (unit, _), parts in ids.items():
            counts[unit] += int(np.unique(np.concatenate(parts)).size)
    return counts


# stdout's last line for a run that checked nothing (exit 5), for grep '^SUMMARY:' as every run's
NOTHING_SEARCHED_SUMMARY = "SUMMARY: kvaudit: nothing searched (the budget ended before the first program ran)."


def summary_line(findings: list[Finding], suppressed: dict[str, int] | None = None,
                 interrupted: bool = False, runs: list[list[Finding]] | None = None) -> str:
    """The closing line, always one, for ``grep '^SUMMARY:'``: ``SUMMARY: kvaudit: 3 finding(s) (2 leak,
    1 double-free) in 2 signature(s); 12 distinct slot(s), 1 distinct row(s) involved.`` (each unit, slot,
    row or block, only where the findings involve any, and no ``involved`` clause where none does;
    :func:`units_involved` over ``runs``, the findings split by program run, by default one run), or ``SUMMARY: kvaudit: no findings.`` (``(interrupted)`` for a run cut
    short), with ``; N suppressed signature(s)`` when rules suppressed findings (``suppressed``: distinct
    signatures per kind, as the "suppressions used" table's ``signatures`` column counts them)."""
    n_suppressed = sum((suppressed or {}).values())
    tail = f"; {n_suppressed} suppressed signature(s)" if n_suppressed else ""
    if not findings:
        return f"SUMMARY: kvaudit: no findings{' (interrupted)' if interrupted else ''}{tail}."
    counts = Counter(f.kind for f in findings)
    kinds = ", ".join(f"{counts[r['kind']]} {r['kind']}" for r in summary_rows(findings))
    units = units_involved([findings] if runs is None else runs)
    involved = ", ".join(f"{units[u]} distinct {u}(s)" for u in ("slot", "row", "block") if units[u])
    return (f"SUMMARY: kvaudit: {len(findings)} finding(s) ({kinds}) in {len({f.signature for f in findings})} "
            f"signature(s){f'; {involved} involved' if involved else ''}{tail}.")


def new_findings_line(runs: list[list[Finding]], suppressed: dict[str, int] | None = None, interrupted: bool = False,
                      unwritten: dict[str, str] | None = None, known: int = 0) -> str:
    """A campaign's or a ``kvaudit ci`` job's ``SUMMARY:`` line, over its new findings (``runs``: those of
    each replay file): :func:`summary_line` saying ``no new findings`` for none, ``; N known signature(s) not
    reported again`` for ``known`` > 0, and the signatures ``unwritten`` names (signature -> the file a full
    disk refused) said to be found but not written (then not "no new findings")."""
    line = summary_line([f for found in runs for f in found], suppressed, interrupted=interrupted, runs=runs)
    line = line.replace("kvaudit: no findings", "kvaudit: no new findings")
    if known:
        line = line[:-1] + f"; {known} known signature(s) not reported again."
    if not unwritten:
        return line
    lost = f"{len(unwritten)} new signature(s) found but not written (disk full): " + ", ".join(sorted(unwritten))
    return line.replace("no new findings", lost) if "no new findings" in line else line[:-1] + f"; {lost}."


def suppressed_by_kind(suppressions: SuppressionSet | None) -> dict[str, int]:
    """Distinct signatures the rules suppressed, per finding kind."""
    sigs = suppressions.suppressed_signatures() if suppressions is not None else ()
    return dict(Counter(sig.split("/", 1)[0] for sig in sigs))


def summary_table(findings: list[Finding], suppressed: dict[str, int] | None = None, plain: bool = False) -> Table:
    """Findings by kind, with suppressed and deduplicated counts, and a total row."""
    rows = summary_rows(findings, suppressed)
    t = Table(title="summary", title_justify="left", show_footer=bool(rows),
              box=box.ASCII2 if plain else box.HEAVY_HEAD)
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
    """Each rule with what it suppressed, counted two ways, each column saying which: ``signatures``
    (distinct findings, the unit of the ``SUMMARY:`` line) and ``hits (per run)`` (each suppressed finding
    once per program run it appeared in: a search counts it again in every program). A rule that matched
    nothing is flagged."""
    t = Table(title="suppressions used", title_justify="left",
              caption=f"rules from {shown_path(suppressions.path)}" if suppressions.path else None,
              caption_justify="left")
    by_signature = any(s.signature is not None for s in suppressions)  # (a column only when a rule has one)
    t.add_column("#", justify="right")
    t.add_column("kind", no_wrap=True)
    for col in ("pool", "site") + ("signature",) * by_signature + ("reason",):
        t.add_column(col, overflow="fold")
    t.add_column("signatures", justify="right", no_wrap=True)
    t.add_column("hits (per run)", justify="right", no_wrap=True)
    for s in suppressions:
        any_ = Text("(any)", style="dim")  # (a key the rule leaves out; a glob "*" is shown as given)
        cells = [s.kind or any_, s.pool or any_, s.site or any_] + [s.signature or any_] * by_signature
        cells.append(s.reason or Text("-", style="dim"))
        if s.hits:
            t.add_row(str(s.index), *cells, str(len(s.signatures)), str(s.hits))
        else:
            t.add_row(str(s.index), *cells, "0", "0 (matched nothing)", style="yellow")
    return t


def print_suppressions(console: Console, suppressions: SuppressionSet, not_run: str | None = None) -> None:
    """The "suppressions used" table, and the rules that matched nothing; with ``not_run`` (why no program
    ran) one line that says so instead: a rule tried on nothing did not "match nothing"."""
    plain = is_plain(console)
    if not len(suppressions):
        where = shown_path(suppressions.path) if suppressions.path else "no rules"
        _print(console, Text(f"suppressions used: none ({where} has no [[suppress]] entries)",
                           style="dim"), plain, soft_wrap=True)
        return
    if not_run is not None:
        where = f" in {shown_path(suppressions.path)}" if suppressions.path else ""
        _print(console, Text(f"suppressions used: none, no program ran ({not_run}): the {len(suppressions)} "
                             f"rule(s){where} were not tried", style="dim"), plain, soft_wrap=True)
        return
    table = suppressions_table(suppressions)
    if plain:  # the file in the title, not a caption line
        table.title = f"suppressions used ({shown_path(suppressions.path)})" if suppressions.path else table.title
        table.caption = None
    print_table(console, table, header=True)
    unused = suppressions.unused()
    if unused:
        _print(console, Text(f"{len(unused)} suppression(s) matched nothing: "
                             + ", ".join(f"#{s.index} ({s.describe()})" for s in unused), style="yellow"),
               plain, soft_wrap=True)


def header(config) -> str:
    """The report's first line, as the config's target kind writes it."""
    kind = kind_of(config)
    if kind.header is not None:
        return kind.header(config)
    bugs = ", ".join(sorted(config.bugs)) or "none"
    return f"kvaudit report: target {kind.name}, preset {config.preset}, bugs: {bugs}"


def print_cases(console: Console, config: TargetConfig, cases: list[tuple[list[Op], list[Finding], str]],
                suppressed: dict[str, int] | None = None, suppressions: SuppressionSet | None = None,
                closing: bool = True, recorded: Mapping[str, str] | None = None,
                interrupted: bool = False, notes: Sequence[str] = ()) -> None:
    """:func:`print_report` for several (program, findings, program title) cases of one config (a
    campaign's report): every finding with its own program (a case's findings in
    :func:`~kvaudit.audit.findings.report_order`), one summary, the closing line.
    ``recorded``: a signature -> the engine release its finding was recorded on (a replay file's
    ``engine_version``, :func:`~kvaudit.reports.sarif.engine_of`); ``interrupted``: the run that recorded
    them was cut short (a ``--json``'s ``"interrupted": true``), as the closing line says; ``notes``: plain
    lines after the summary, before the closing line (what a clean run's programs reached)."""
    plain = is_plain(console)
    on = engine_of(config, recorded)
    _print(console, Text(header(config), style="bold"), plain)
    everything = [(program, f, title) for program, findings, title in cases for f in report_order(findings)]
    for i, (program, f, title) in enumerate(everything):
        _print(console, finding_renderable(f, program, i, title, plain, on(f)), plain)
    findings = [f for _, f, _ in everything]
    _print(console, summary_table(findings, suppressed, plain=plain), plain)
    if suppressions is not None:
        print_suppressions(console, suppressions)
    for note in notes:
        console.print(note, soft_wrap=True, markup=False, highlight=False)  # (a path's name: any string)
    if closing:
        line = summary_line(findings, suppressed, interrupted, runs=[found for _, found, _ in cases])
        _print(console, Text(line, style="bold"), plain, soft_wrap=True)


def print_report(console: Console, config: TargetConfig, program: list[Op], findings: list[Finding],
                 program_title: str = "minimized program", suppressions: SuppressionSet | None = None,
                 closing: bool = True) -> None:
    """The report: a header, one panel per finding (plain lines off a terminal, see :func:`is_plain`),
    the summary, the ``suppressions`` used (``findings`` are the unsuppressed ones), and the closing
    ``SUMMARY:`` line unless ``closing`` is False (one section of a run that closes with one line over
    them all: a run prints one ``SUMMARY:`` line)."""
    print_cases(console, config, [(program, findings, program_title)], suppressed_by_kind(suppressions),
                suppressions=suppressions, closing=closing)

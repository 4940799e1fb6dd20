"""What a command shows while it runs: rich consoles, and the live status of a search or a replay
(a rich display on a terminal, plain lines in a CI log)."""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from rich.console import Console, RenderHook
from rich.measure import Measurement
from rich.segment import Segment
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from kvaudit.app.budget import duration
from kvaudit.app.interrupts import LIVE
from kvaudit.config import shown_controls

if TYPE_CHECKING:
    from kvaudit.search.fuzz import FuzzStats


def console(stderr: bool = False) -> Console:
    """A rich console; off a terminal it is wide, so that paths in reports are not broken up. Under ``NO_COLOR``
    it sends no styles at all (rich drops the colours only, keeping bold and dim): what it redraws live (fuzz's
    status, ``campaign status --watch``) has no colour, bold or dim, though it still moves the cursor to redraw
    (only off a terminal or under ``TERM=dumb`` is there no live display: plain lines instead)."""
    probe = Console(stderr=stderr)
    width = None if probe.is_terminal else _columns()
    out = Console(stderr=stderr, highlight=False, width=width, color_system=None if probe.no_color else "auto")
    out.push_render_hook(_ShowControls())
    return out


class _Escaped:
    """``inner`` rendered with the control characters of its text (a replay file's message, a frame's source
    line: anything read from a file) shown as ``\\x1b``, so that they cannot drive the terminal; rich's own
    control segments (styles, a live display's cursor moves) pass as they are."""

    def __init__(self, inner):
        self.inner = inner

    def __rich_console__(self, console, options):
        for seg in console.render(self.inner, options):
            if seg.control is None and shown_controls(seg.text) != seg.text:
                seg = Segment(shown_controls(seg.text), seg.style)
            yield seg

    def __rich_measure__(self, console, options):
        return Measurement.get(console, options, self.inner)


class _ShowControls(RenderHook):
    """Every renderable a console prints, :class:`_Escaped`."""

    def process_renderables(self, renderables):
        return [_Escaped(r) for r in renderables]


class LiveDisplay(Live):
    """rich's :class:`~rich.live.Live`, listed in :data:`interrupts.LIVE` while it shows: a Ctrl-C's echoed
    ``^C`` is on its last line, which its next redraw clears (a newline after the ``^C`` would put that redraw,
    and the removal of a transient one, a line low)."""

    def start(self, refresh: bool = False) -> None:
        super().start(refresh)
        LIVE.append(self)

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            if self in LIVE:
                LIVE.remove(self)


def _columns() -> int:
    # COLUMNS off a terminal: a positive whole number (of at most 6 digits), else 120 (a shell's `COLUMNS=abc`
    # is not an error)
    text = os.environ.get("COLUMNS", "").strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 6 and int(text) > 0 else 120


def live_terminal(console: Console) -> bool:
    """Whether ``console`` can redraw a live status: a terminal, not ``TERM=dumb`` (which cannot move the
    cursor: there the plain lines are printed, as in a CI log)."""
    return console.is_terminal and not console.is_dumb_terminal


PROGRESS_INTERVAL = 5.0  # seconds between plain status lines off a terminal (fuzz, replay)


def coverage_field(coverage: str) -> tuple[str, str]:
    """``"93 features, 6 programs (2 unreadable ...)"`` as one field of a plain status line,
    ``93features/6programs``, and the note in parentheses (``""``: none), which the line ends with as
    written."""
    head, _, note = coverage.partition(" (")
    return "/".join("".join(part.split()) for part in head.split(",")), note and f" ({note}"


class Progress:
    """A search's live status on a terminal; off one, a plain line every ``interval`` seconds and at
    each phase change, from the first program run. ``max_time``: the search budget (seconds)."""

    def __init__(self, console: Console, max_time: float, interval: float = PROGRESS_INTERVAL):
        self.console, self.max_time, self.interval = console, max_time, interval
        self.live = LiveDisplay(console=console, transient=True, auto_refresh=False) if live_terminal(console) else None
        self._last = 0.0
        self._phase = None

    @staticmethod
    def _fields(s: FuzzStats, max_time: float) -> list[tuple[str, str]]:
        rate = s.executions / s.elapsed if s.elapsed > 0 else 0.0
        return [("executions", f"{s.executions}"), ("exec/s", f"{rate:.1f}"), ("ops", f"{s.ops}"),
                ("findings", f"{s.findings}"), ("suppressed", f"{len(s.suppressed)}"),
                ("coverage", s.coverage or f"{len(s.sites)} alloc/free sites"),
                ("elapsed", duration(s.elapsed)), ("remaining", duration(max(0.0, max_time - s.elapsed)))]

    def line(self, s: FuzzStats) -> str:
        f = dict(self._fields(s, self.max_time))
        cov, note = coverage_field(s.coverage or "")
        return (f"[{s.elapsed:6.1f}s] {s.phase}: executions={f['executions']} exec/s={f['exec/s']} ops={f['ops']} "
                f"findings={f['findings']} suppressed={f['suppressed']} sites={len(s.sites)} "
                + (f"coverage={cov} " if cov else "") + f"remaining={f['remaining']}{note}")

    def renderable(self, s: FuzzStats):
        grid = Table.grid(padding=(0, 2))
        grid.add_row(Text(f"kvaudit fuzz: {s.phase}", style="bold blue"),
                     ProgressBar(total=self.max_time, completed=min(s.elapsed, self.max_time), width=40),
                     Text(f"{duration(min(s.elapsed, self.max_time))}/{duration(self.max_time)}"))
        stats = Table.grid(padding=(0, 3))
        fields = self._fields(s, self.max_time)
        for _ in fields:
            stats.add_column(justify="right")
        stats.add_row(*[Text(k, style="dim") for k, _ in fields])
        stats.add_row(*[Text(v, style="bold red" if k == "findings" and v != "0" else "bold") for k, v in fields])
        outer = Table.grid()
        outer.add_row(grid)
        outer.add_row(stats)
        return outer

    def __enter__(self):
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live:
            self.live.__exit__(*exc)

    def update(self, s: FuzzStats, force: bool = False) -> None:
        """Show ``s``: on a terminal at once; off one when ``force``d, at a phase change or after ``interval``
        seconds, but never before the first program ran, forced or not (``executions=0`` says nothing the
        start-up line did not, and a run's end with none is its ``nothing searched`` lines)."""
        if self.live:
            self.live.update(self.renderable(s), refresh=True)
        elif not s.executions:
            return
        elif force or s.phase != self._phase or time.monotonic() - self._last >= self.interval:
            self._last, self._phase = time.monotonic(), s.phase
            print(self.line(s), file=sys.stderr, flush=True)


class OpProgress:
    """Where a long run of one program is, called as ``progress(ops run, scheduler steps)`` after each
    op: off a terminal a plain line every ``interval`` seconds (then one at the end), on one a live line."""

    def __init__(self, console: Console, label: str, total: int, interval: float | None = None):
        self.console, self.label, self.total = console, label, total
        self.interval = PROGRESS_INTERVAL if interval is None else interval
        self.start = time.monotonic()
        self._next = self.start + (min(1.0, self.interval) if live_terminal(console) else self.interval)
        self.live = None
        self.printed = False
        self.ops = self.steps = 0

    def line(self, done: bool = False) -> str:
        el = time.monotonic() - self.start
        rate = self.ops / el if el > 0 else 0.0
        left = f"remaining={(self.total - self.ops) / rate:.0f}s" if rate > 0 and not done else ""
        return (f"[{el:6.1f}s] {self.label}: ops={self.ops}/{self.total} steps={self.steps} ops/s={rate:.0f} "
                + (left or "done")).rstrip()

    def __call__(self, ops: int, steps: int) -> None:
        self.ops, self.steps = ops, steps
        now = time.monotonic()
        if now < self._next:
            return
        if live_terminal(self.console):
            if self.live is None:
                self.live = LiveDisplay(console=self.console, transient=True, auto_refresh=False)
                self.live.__enter__()
            self.live.update(Text(self.line()), refresh=True)
            self._next = now + 0.25
        else:
            print(self.line(), file=sys.stderr, flush=True)
            self.printed = True
            self._next = now + self.interval

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)
        elif self.printed and exc[0] is None:
            print(self.line(done=True), file=sys.stderr, flush=True)


class MinimizeProgress(OpProgress):
    """Where a minimization is, called as ``progress(runs, ops of the smallest program so far)`` after each
    run; shown as :class:`OpProgress` shows a replay (``total``: the input's ops)."""

    def __call__(self, runs: int, smallest: int) -> None:
        super().__call__(smallest, runs)  # NOTE: kept as OpProgress's ops and steps

    def line(self, done: bool = False) -> str:
        el = time.monotonic() - self.start
        return f"[{el:6.1f}s] {self.label}: runs={self.steps} smallest={self.ops}/{self.total} ops" + (
            " done" if done else "")

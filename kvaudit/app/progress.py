"""What a command shows while it runs: rich consoles, and the live status of a search (a rich
display on a terminal, plain lines in a CI log)."""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from kvaudit.search.fuzz import FuzzStats
    from kvaudit.audit.suppress import SuppressionSet


def console(stderr: bool = False) -> Console:
    """A rich console; off a terminal it is wide, so that paths in reports are not broken up."""
    from rich.console import Console

    probe = Console(stderr=stderr)
    width = None if probe.is_terminal else int(os.environ.get("COLUMNS", 0) or 120)
    return Console(stderr=stderr, highlight=False, width=width)


class Progress:
    """Live status on a terminal (rich); off a terminal, a plain line every ``interval`` seconds (and
    at each phase change), with no control codes, for CI logs."""

    def __init__(self, console: Console, max_time: float, interval: float = 5.0,
                 suppressions: SuppressionSet | None = None):
        from rich.live import Live

        self.console, self.max_time, self.interval = console, max_time, interval
        self.suppressions = suppressions
        self.live = Live(console=console, transient=True, auto_refresh=False) if console.is_terminal else None
        self._last = 0.0
        self._phase = None

    @staticmethod
    def _fields(s: FuzzStats, max_time: float) -> list[tuple[str, str]]:
        rate = s.executions / s.elapsed if s.elapsed > 0 else 0.0
        return [("executions", f"{s.executions}"), ("exec/s", f"{rate:.1f}"), ("ops", f"{s.ops}"),
                ("findings", f"{s.findings}"), ("suppressed", f"{len(s.suppressed)}"),
                ("coverage", getattr(s, "coverage", None) or f"{len(s.sites)} alloc/free sites"),
                ("elapsed", f"{s.elapsed:.1f}s"), ("remaining", f"{max(0.0, max_time - s.elapsed):.0f}s")]

    def line(self, s: FuzzStats) -> str:
        f = dict(self._fields(s, self.max_time))
        cov = getattr(s, "coverage", None)
        return (f"[{s.elapsed:6.1f}s] {s.phase}: executions={f['executions']} exec/s={f['exec/s']} ops={f['ops']} "
                f"findings={f['findings']} suppressed={f['suppressed']} sites={len(s.sites)} "
                + (f"coverage={cov.replace(' ', '_')} " if cov else "") + f"remaining={f['remaining']}")

    def renderable(self, s: FuzzStats):
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        grid = Table.grid(padding=(0, 2))
        grid.add_row(Text(f"kvaudit fuzz: {s.phase}", style="bold blue"),
                     ProgressBar(total=self.max_time, completed=min(s.elapsed, self.max_time), width=40),
                     Text(f"{min(s.elapsed, self.max_time):.0f}/{self.max_time:g}s"))
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
        if self.live:
            self.live.update(self.renderable(s), refresh=True)
        elif force or s.phase != self._phase or time.monotonic() - self._last >= self.interval:
            self._last, self._phase = time.monotonic(), s.phase
            print(self.line(s), file=sys.stderr, flush=True)

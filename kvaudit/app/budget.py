"""What ``--max-time`` means: seconds of *search*. Start-up (importing torch, Hypothesis and a real
engine, then building the first engine) is paid before the clock starts, so a short budget on SGLang
or vLLM, whose import alone takes 5-25 s, still searches for the whole budget. The run's first lines
say what start-up took, so a slow one is seen rather than silently paid.

The CLI builds one :class:`Budget` per command, from the option and the process start time the
console script hands it (``kvaudit.entry``: click's ``obj``), and passes it down; nothing below
reads a process-wide start time. Imports nothing heavy (``kvaudit --help`` imports this module)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

MAX_SECONDS = 365 * 24 * 3600.0  # a year: past it a budget is a typo (1e308), not a plan; Ctrl-C ends a search early


@dataclass(frozen=True)
class Budget:
    """``seconds`` of search (``--max-time``), counted from :meth:`start` (once the first engine is
    built), not from the process start. ``process_start``: ``time.monotonic()`` when the process
    began (the console script's entry), None in-process (click's test runner, a notebook): then
    start-up counts from when the command began (``command_start``)."""

    seconds: float
    process_start: float | None = None
    command_start: float | None = None

    @classmethod
    def for_command(cls, seconds: float, obj) -> Budget:
        """The budget of a command whose click ``obj`` is what ``kvaudit.entry`` passes (a dict with
        ``process_start``), or None in-process."""
        started = obj.get("process_start") if isinstance(obj, dict) else None
        return cls(seconds, process_start=started, command_start=time.monotonic())

    def startup(self, now: float | None = None) -> float:
        """Seconds from the process start (or, in-process, the command's) to ``now`` (default: now)."""
        t0 = self.process_start if self.process_start is not None else self.command_start
        now = time.monotonic() if now is None else now
        return max(0.0, now - t0) if t0 is not None else 0.0

    def deadline(self) -> float:
        """``time.monotonic()`` at which a search that starts now ends."""
        return time.monotonic() + self.seconds


def check_seconds(value: float, allow_zero: bool = False) -> float:
    """``value`` if it is a usable number of seconds: finite, positive (or 0 with ``allow_zero``), at
    most :data:`MAX_SECONDS`. Raises ``ValueError`` with the one-line reason (nan, inf, negative,
    1e308), for the CLI to prefix with the option's name."""
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"must be a finite number of seconds, not {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"must be a number of seconds {'>= 0' if allow_zero else '> 0'}, not {value:g}")
    if value > MAX_SECONDS:
        raise ValueError(f"must be at most {MAX_SECONDS:.0f} seconds ({duration(MAX_SECONDS)}), not {value:g}; "
                         "Ctrl-C or SIGTERM ends a run early and keeps what it found")
    return value


def duration(seconds: float) -> str:
    """``seconds`` as a person reads it, with no space (a plain status line's token): ``0.001s``,
    ``0.4s``, ``42s``, ``12m05s``, ``3h20m``, ``2d03h``, ``365d``."""
    if not math.isfinite(seconds):
        return str(seconds)
    s = max(0.0, seconds)
    if 0 < s < 0.05:
        return f"{s:.2g}s"
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    s = int(round(s))
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    days, hours = divmod(s // 3600, 24)
    return f"{days}d" + (f"{hours:02d}h" if hours else "")

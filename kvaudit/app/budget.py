"""What ``--max-time`` means: seconds of *search*, counted once start-up (imports, the first engine)
is done. Imports nothing heavy. Design notes: docs/internals/app.md."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """``seconds`` of search. ``process_start``: ``time.monotonic()`` at the console script's entry,
    None in-process (then start-up counts from ``command_start``)."""

    seconds: float
    process_start: float | None = None
    command_start: float | None = None

    @classmethod
    def for_command(cls, seconds: float, obj) -> Budget:
        """``obj``: click's, what ``kvaudit.entry`` passes (``{"process_start": ...}``), None in-process."""
        started = obj.get("process_start") if isinstance(obj, dict) else None
        return cls(seconds, process_start=started, command_start=time.monotonic())

    def startup(self) -> float:
        t0 = self.process_start if self.process_start is not None else self.command_start
        return max(0.0, time.monotonic() - t0) if t0 is not None else 0.0

    def deadline(self) -> float:
        return time.monotonic() + self.seconds


def duration(seconds: float) -> str:
    """``seconds`` as one token: ``0.001s``, ``0.4s``, ``42s``, ``12m05s``, ``3h20m``, ``2d03h``, ``365d``."""
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

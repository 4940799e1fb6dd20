"""One trial of the history suite: :class:`kvaudit.search.bench.Trial` plus what the suite adds."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvaudit.search.bench import Trial


@dataclass
class HistoryTrial(Trial):
    """A search of one bug by one fuzzer with one seed on the release that ships it. Beside the zoo
    trial's fields: the finding's ``signature`` and ``confirmations`` (of 3), the minimized ``program``
    (op dicts), ``others`` (signatures of other findings suppressed on the way), and, filled by the parent
    from the fixing release, ``fixed_clean`` (None: no fixing release, or not replayed) and ``fixed_signatures``."""

    signature: str = ""
    confirmations: int = 0
    program: list | None = None
    others: list = field(default_factory=list)
    fixed_clean: bool | None = None
    fixed_signatures: list = field(default_factory=list)

    def line(self) -> str:
        """One progress line."""
        head = f"{self.bug:34} {self.fuzzer:10} seed {self.seed}: "
        if not self.success:
            return head + "not found" + (f" ({self.note})" if self.note else "")
        others = f" ({len(self.others)} other signature(s) suppressed on the way)" if self.others else ""
        return (head + f"found in {self.seconds:.1f}s, {self.executions} executions, {self.min_len} ops, "
                f"{self.signature}" + others)

"""The accounting identity oracle (``accounting-drift``): each pool's terms add up to its total, each
engine counter against the structure it describes, the engine's free list against the event log, the
engine's own check while every other oracle is clean."""

from __future__ import annotations

import numpy as np

from kvaudit.audit.findings import Finding
from kvaudit.audit.hooks import Auditor
from kvaudit.targets.base import DEFAULT_IDENTITY


def units_count(units: list[np.ndarray], n: int) -> int:
    if not units:
        return 0
    mark = np.zeros(n, dtype=bool)
    mark[np.concatenate(units)] = True
    return int(np.count_nonzero(mark))

def identity(auditor: Auditor, pool: str, led, a, req_units, session_units, recount=None,
              terms: tuple[str, ...] = DEFAULT_IDENTITY, referenced: np.ndarray | None = None,
              counts: tuple[int, int, int] | None = None) -> list[Finding]:
    """The accounting identity ``terms`` (:meth:`kvaudit.targets.base.Target.identity_terms`) of pool
    accounting ``a`` (tokens) with kvaudit's own ``uncached`` and ``session_held``, and each engine
    counter against the structure it describes (``recount``: ``{term: Recount}``). At most one finding,
    giving every check that fails, the recounted counters first. ``req_units``/``session_units``:
    ``[k] int64`` arrays a request or a session holds privately; ``referenced``: ``[n] bool``; ``counts``
    (instead of the three): the ``(uncached, session, referenced)`` units an incremental check keeps."""
    ps, n = led.spec.page_size, led.allocated.size
    uncached = (counts[0] if counts else units_count(req_units, n)) * ps
    held = (counts[1] if counts else units_count(session_units, n)) * ps
    lines, checks = [], []
    if recount:
        wrong = [t for t, r in recount.items() if getattr(a, t) != r.tokens]
        if wrong:
            have = {term: getattr(a, term) for term in recount}
            lines += [f"{recount[t].counter} counter {t}={have[t]} but {recount[t].source} hold "
                      f"{recount[t].tokens} tokens" for t in wrong]
            lines += [f"{t}={have[t]} matches {r.source}" for t, r in recount.items() if t not in wrong]
            checks.append("counter:" + ",".join(sorted(wrong)))
    free_units = (n - 1) - int(np.count_nonzero(led.allocated[1:])) if led.spec.kind == "kv" else 0
    if led.spec.kind == "kv" and a.available != free_units * ps:
        lines.append(f"the engine reports available={a.available} but the ledger holds {free_units * ps} slots free")
        checks.append("counter:available")
    if a.session_held != held:
        lines.append(f"the engine reports session_held={a.session_held} but session slots privately hold {held}")
        checks.append("counter:session_held")
    # (the default identity summed directly: this runs after every step of every program)
    lhs = (a.available + a.evictable + a.protected + held + uncached if terms is DEFAULT_IDENTITY
           else sum(_term(t, a, held, uncached, referenced, counts, ps) for t in terms))
    if lhs != a.total:
        values = [(t, _term(t, a, held, uncached, referenced, counts, ps)) for t in terms]
        lines.append(" + ".join(f"{t}={v}" for t, v in values) + f" = {lhs} != total={a.total}, "
                     "while every allocated unit is reachable")
        checks.append("identity")
    return [_drift(auditor, pool, "; ".join(lines), checks[0])] if lines else []


def _drift(auditor: Auditor, pool: str, message: str, check: str) -> Finding:
    """An ``accounting-drift`` of ``pool`` (counted in slots) failing ``check``, at the auditor's op and step."""
    return Finding(kind="accounting-drift", pool=pool, unit="slot", message=message, op_index=auditor.op_index,
                   step=auditor.step, check=check)


def _term(t: str, a, held: int, uncached: int, referenced: np.ndarray | None, counts, ps: int) -> int:
    # one identity term's tokens (identity's)
    if t == "referenced" and counts:
        return counts[2] * ps
    if t == "referenced":
        return int(np.count_nonzero(referenced[1:])) * ps if referenced is not None else 0
    return held if t == "session_held" else uncached if t == "uncached" else getattr(a, t)


def replay_free_list(auditor: Auditor, pool: str, led, free: np.ndarray) -> list[Finding]:
    """The engine's free list (``[n] int64`` units) against the replay of kvaudit's event log."""
    n = led.allocated.size
    # NOTE: runs for every pool after every step. The clean case in five calls: as many entries as free
    # units, none negative, and the allocated units with the listed ones cover the pool: then every entry
    # is a distinct free unit (an entry past the pool raises: the exact count below names it)
    if free.size == n - np.count_nonzero(led.allocated) and (not free.size or free.min() >= 0):
        cover = led.allocated.copy()
        try:
            cover[free] = True
        except IndexError:
            pass
        else:
            if np.count_nonzero(cover) == n:
                return []
    listed = np.bincount(free[(free >= 0) & (free < n)], minlength=n)
    missing = np.flatnonzero(~led.allocated & (listed == 0))
    extra = np.flatnonzero(led.allocated & (listed > 0))
    twice = np.flatnonzero(listed > 1)
    if not (missing.size or extra.size or twice.size):
        return []
    return [_drift(auditor, pool, f"the engine's free list disagrees with the replay of the event log: {extra.size} "
                   f"unit(s) free in the list but allocated in the log, {missing.size} the other way, {twice.size} "
                   "listed twice (a path that bypasses kvaudit's wrappers)", "free_list")]

def engine_disagrees(auditor: Auditor, target) -> list[Finding]:
    """The engine's own ``check_memory()`` (and its metrics) fail while every kvaudit oracle is clean."""
    for line in target.engine_check() + target.metrics_check():  # (the first line that fails)
        return [_drift(auditor, line[1:line.index("]")] if line.startswith("[") else "-",
                       f"the engine's own check fails while memory is intact: {line}", "engine_check")]
    return []

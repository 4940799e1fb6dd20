"""Pool occupancy over a program's scheduler steps, split into the terms of SGLang's accounting identity
plus leaked units: the data behind the HTML report's plot, kept as plain lists in the report JSON.
Design notes: docs/internals/reports.md.
"""

from __future__ import annotations

import re

import numpy as np

from kvaudit.config import TargetConfig
from kvaudit.program import Op, Step
from kvaudit.audit.runner import AuditedRun
from kvaudit.targets.base import Accounting

SERIES = ("available", "evictable", "protected", "session_held", "uncached", "leaked")
MAX_SAMPLED_STEPS = 20_000  # steps sampled at most (a program of step(n=10000) ops runs on unsampled)
MAX_POINTS = 1_000  # samples kept: more are thinned evenly (the first, last and detection step kept)


def occupancy(run: AuditedRun) -> dict[str, dict[str, int]]:
    """``{pool: {term: count, ..., "total": n}}`` for the run's current state, in tokens (rows for
    ``req_to_token_pool``); a pool with no engine counters takes them from the ledger and the roots."""
    auditor, target = run.auditor, run.target
    acc = target.accounting()
    roots: dict[str, list] = {name: [] for name in auditor.ledgers}
    for root in target.roots():
        roots[root.pool].append(root)
    out = {}
    for pool, led in auditor.ledgers.items():
        n, ps = led.allocated.size, led.spec.page_size
        referenced = np.zeros(n, dtype=bool)
        owned = np.zeros(n, dtype=bool)
        held = np.zeros(n, dtype=bool)  # by session slots
        for root in roots[pool]:
            referenced[root.units] = True
            if root.private and root.role == "req":
                owned[root.units] = True
            elif root.private and root.role == "session":
                held[root.units] = True
        referenced[0] = owned[0] = held[0] = False
        a = acc.get(pool)
        if a is None:  # no engine counters: the ledger's free units, the session slots' held ones
            a = Accounting((n - 1 - int(np.count_nonzero(led.allocated[1:]))) * ps, 0, 0,
                           int(np.count_nonzero(held)) * ps, (n - 1) * ps)
        out[pool] = {"available": a.available, "evictable": a.evictable, "protected": a.protected,
                     "session_held": a.session_held, "uncached": int(np.count_nonzero(owned)) * ps,
                     "leaked": int(np.count_nonzero(led.allocated[1:] & ~referenced[1:])) * ps, "total": a.total}
    return out


def record(config: TargetConfig, program: list[Op], suppressions=None, drain_steps: int = 8,
           findings: list | None = None, on_op=None) -> dict:
    """Run ``program`` from a fresh engine with every oracle on, sampling :func:`occupancy` before the
    first step and after every scheduler step: the whole program, then up to ``drain_steps`` more
    steps (at least one). Returns ``{"steps": [k] int, "ops": [k] int (-1 before any op), "pools":
    {pool: {"unit": "tokens"|"rows", "total": int, "series": {term: [k] int}}}, "detected": {"step",
    "op_index", "kind", "pool"} or None, "program_end_step": int}``. ``findings`` receives the run's
    findings (one replay serves the report and the plot); ``on_op(ops run, steps)`` runs after each op.
    """
    steps: list[int] = []
    ops: list[int] = []
    samples: list[dict] = []

    def sample(r: AuditedRun) -> None:
        if len(steps) <= MAX_SAMPLED_STEPS:
            steps.append(r.target.steps)
            ops.append(r.ops_run - 1)
            samples.append(occupancy(r))

    detected = None
    with AuditedRun(config, suppressions=suppressions) as run:
        sample(run)
        run.on_step = sample
        for op in program:
            found = run.apply(op)
            if on_op is not None:
                on_op(run.ops_run, run.target.steps)
            if found and detected is None:
                f = found[0]
                detected = {"step": f.step, "op_index": f.op_index, "kind": f.kind, "pool": f.pool}
        end = run.target.steps
        if findings is not None:
            findings.extend(run.findings)
        for _ in range(drain_steps):  # the aftermath: does the engine ever get the memory back?
            if run.crashed:  # (a crashed engine runs no more steps: the plot ends at the crash)
                break
            try:
                if run.target.is_idle() and run.target.steps > end:
                    break
            except Exception:  # the target's is_idle raising, met first here: the run's finding is the report's
                break
            run.apply(Step(1))
        units = {name: ("rows" if led.spec.kind == "rows" else "tokens") for name, led in run.auditor.ledgers.items()}
    truncated = len(steps) > MAX_SAMPLED_STEPS
    keep = list(range(len(steps)))
    if len(keep) > MAX_POINTS:
        must = {0, len(steps) - 1}
        if detected is not None and detected["step"] in steps:
            must.add(steps.index(detected["step"]))
        keep = sorted(set(np.linspace(0, len(steps) - 1, MAX_POINTS - len(must)).astype(int).tolist()) | must)
        steps, ops, samples = [steps[i] for i in keep], [ops[i] for i in keep], [samples[i] for i in keep]
    pools = {}
    for pool, unit in units.items():
        pools[pool] = {"unit": unit, "total": samples[-1][pool]["total"],
                       "series": {term: [s[pool][term] for s in samples] for term in SERIES}}
    out = {"steps": steps, "ops": ops, "pools": pools, "detected": detected, "program_end_step": end}
    if truncated:
        out["truncated_after_step"] = steps[-1]
    return out


def is_valid(t) -> bool:
    """Whether ``t`` (read from a file) is a timeline the HTML plot can draw: at most :data:`MAX_POINTS`
    samples, equal-length lists of integers below 2**53 in magnitude (steps non-negative), 1 to 32
    named pools with a unit and every term of :data:`SERIES`."""
    def counts(v, low: int = 0) -> bool:
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and low <= x < 2**53
                                           for x in v)

    try:
        n = len(t["steps"])
        pools = t["pools"]
        return (0 < n <= MAX_POINTS and counts(t["steps"]) and isinstance(t["ops"], list) and len(t["ops"]) == n
                and isinstance(pools, dict) and 0 < len(pools) <= 32 and all(
                    isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name)
                    and isinstance(p, dict) and p.get("unit") in ("tokens", "rows")
                    and isinstance(p.get("total"), int) and 0 <= p["total"] < 2**53
                    and isinstance(p.get("series"), dict) and set(SERIES) <= set(p["series"])
                    and all(counts(v, -2**53 + 1) and len(v) == n for v in p["series"].values())
                    for name, p in pools.items())
                and (t.get("program_end_step") is None or isinstance(t["program_end_step"], int))
                and (t.get("detected") is None or isinstance(t["detected"], dict)))
    except (TypeError, KeyError, AttributeError):
        return False

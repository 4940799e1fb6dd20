"""Minimization of a program that yields a finding's signature: ddmin over ops, then simplification of
op arguments, to a fixpoint. Design notes: docs/internals/fuzzers.md.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from kvaudit.config import TargetConfig
from kvaudit.program import Op, Step
from kvaudit.program.schema import OPS, optional_defaults
from kvaudit.audit.runner import execute, step_timeout

HANG_PROBE = 1.0
"""Seconds: the least step limit a candidate runs under while a watchdog hang is minimized (:func:`probe_limit`)."""


def reproduces(config: TargetConfig, program: list[Op], signature: str, suppressions=None,
               step_limit: float | None = None) -> bool:
    """Whether one fresh run of ``program`` (fast stacks, ``suppressions`` left out) yields ``signature``;
    ``step_limit``: the watchdog's seconds (default :func:`kvaudit.audit.runner.step_timeout`)."""
    return signature in execute(config, program, full_stacks=False, suppressions=suppressions,
                                step_limit=step_limit).signatures


def probe_limit(signature: str, seconds: float) -> float | None:
    """The step limit the candidates of a watchdog hang (``hang/-/stuck:SITE``, docs/reference/signatures.md)
    can run under, given the ``seconds`` the input's run took: what it took besides its stuck step, at least
    :data:`HANG_PROBE`; None (the user's limit) for another signature or where that is no shorter. A
    reproducing candidate waits its whole step limit; a stuck step is stuck under either limit, and a slow one
    this cuts short :func:`minimize` checks by running its result again under the user's limit."""
    kind, _, site = (signature.split("/", 2) + ["", ""])[:3]
    if kind != "hang" or not site.startswith("stuck:"):
        return None
    limit = max(HANG_PROBE, seconds - step_timeout())
    return limit if limit < step_timeout() else None


def ddmin(ops: list[Op], fails: Callable[[list[Op]], bool]) -> list[Op]:
    """The classic ddmin: a 1-minimal sublist of ``ops`` for which ``fails`` still holds."""
    n = 2
    while len(ops) >= 2:
        chunk = max(1, len(ops) // n)
        subsets = [ops[i : i + chunk] for i in range(0, len(ops), chunk)]
        reduced = False
        for i in range(len(subsets)):
            complement = [op for j, s in enumerate(subsets) if j != i for op in s]
            if fails(subsets[i]):
                ops, n, reduced = subsets[i], 2, True
                break
            if len(subsets) > 2 and fails(complement):
                ops, n, reduced = complement, max(n - 1, 2), True
                break
        if not reduced:
            if n >= len(ops):
                break
            n = min(len(ops), n * 2)
    if len(ops) == 1 or not ops:
        return ops
    i = 0  # the final 1-minimality pass: drop single ops
    while i < len(ops) and len(ops) > 1:
        cand = ops[:i] + ops[i + 1 :]
        if fails(cand):
            ops = cand
        else:
            i += 1
    return ops


def _below(v: int, lo: int) -> list[int]:
    """Values under ``v`` down to ``lo``, lowest first: ``lo``, half of ``v``, then halfway from there to ``v``
    again and again, ``v - 1`` last (76: 1, 38, 57, 66, 71, 73, 74, 75)."""
    out, c = {lo}, max(lo, v // 2)
    while c < v:
        out.add(c)
        c += max(1, (v - c) // 2)
    return sorted(c for c in out if c < v)


def _simpler(op: Op) -> list[Op]:
    """Simpler forms of one op, simplest first, from the schema: an argument always drawn to the low end of
    its range, to half its value and to one less, any other set argument to :attr:`Arg.toward` and then (a
    nullable one: a submit's ``session``, ``stop_at``, ``priority`` ..., an abort's ``handle``; a flush's
    ``timeout``) to the low end, half its value and one less; None stays None. With one less last, no argument
    of a program that none of its simpler forms reproduces could be lowered by one."""
    out: list[Op] = []
    for a in OPS[op.kind].args:
        v = getattr(op, a.name)
        if v is None:
            continue
        lower = _below(v, a.lo)
        if a.p < 1.0 or a.simplest != "default":  # (a nullable one then lower: session=3 names the one open too)
            ordinal = a.nullable or a.simplest == "default"  # (a pause's mode names a kind: no order to lower)
            cands = ([a.toward] if v != a.toward else []) + [c for c in lower if ordinal and c != a.toward]
        else:
            cands = lower
        out += [dataclasses.replace(op, **{a.name: c}) for c in cands]
    return out


def merge_steps(ops: list[Op], fails: Callable[[list[Op]], bool]) -> list[Op]:
    """Fold adjacent ``step`` ops into one ``step(n=sum)`` wherever ``fails`` still holds."""
    i = 0
    while i + 1 < len(ops):
        if isinstance(ops[i], Step) and isinstance(ops[i + 1], Step):
            trial = ops[:i] + [Step(ops[i].n + ops[i + 1].n)] + ops[i + 2 :]
            if fails(trial):
                ops = trial
                continue
        i += 1
    return ops


def reset_defaults(ops: list[Op], fails: Callable[[list[Op]], bool]) -> list[Op]:
    """Every optional argument (:func:`kvaudit.program.schema.optional_defaults`) back to its default wherever
    ``fails`` still holds: all at once first, then one argument at a time."""
    defaults = optional_defaults()

    def resets(op: Op) -> dict:
        return {f.name: defaults[f.name] for f in dataclasses.fields(op)
                if f.name in defaults and getattr(op, f.name) != defaults[f.name]}

    plain = [dataclasses.replace(op, **resets(op)) for op in ops]
    if plain != ops and fails(plain):
        return plain
    for i in range(len(ops)):
        for name, value in resets(ops[i]).items():
            trial = ops[:i] + [dataclasses.replace(ops[i], **{name: value})] + ops[i + 1:]
            if fails(trial):
                ops = trial
    return ops


def simplify_round(ops: list[Op], fails: Callable[[list[Op]], bool]) -> list[Op]:
    """Each op in turn takes its first simpler form (:func:`_simpler`) after which ``fails`` still holds: one
    argument one step a round."""
    for i in range(len(ops)):
        for cand in _simpler(ops[i]):
            trial = ops[:i] + [cand] + ops[i + 1 :]
            if fails(trial):
                ops = trial
                break
    return ops


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C (or SIGTERM) during :func:`minimize`. ``smallest``: the smallest program that reproduced the
    signature so far (fewest ops; the latest of equal length), or None if the input had not yet reproduced.
    ``checked``: the smallest that reproduced it under the user's step limit (at least the input; None before
    it reproduced): ``smallest`` itself except while a watchdog hang's candidates run under :func:`probe_limit`'s."""

    def __init__(self, smallest: list[Op] | None, checked: list[Op] | None = None):
        super().__init__()
        self.smallest = smallest
        self.checked = smallest if checked is None else checked


class OutOfTime(Exception):
    """:func:`minimize` reached its ``until``. ``smallest``: the smallest program that reproduced the signature
    under the user's step limit (it always has one: the input runs first whatever the time)."""

    def __init__(self, smallest: list[Op]):
        super().__init__()
        self.smallest = smallest


def _passes(ops: list[Op], fails: Callable[[list[Op]], bool]) -> list[Op]:
    """ddmin, then argument and step passes with ddmin again, to a fixpoint (docs/internals/fuzzers.md)."""
    ops = ddmin(ops, fails)
    while True:  # to a fixpoint: minimizing the result again changes nothing
        before = ops
        ops = merge_steps(ddmin(simplify_round(reset_defaults(ops, fails), fails), fails), fails)
        if ops == before:
            return ops


def minimize(config: TargetConfig, program: list[Op], signature: str, suppressions=None,
             until: float | None = None, on_run: Callable[[int, int], None] | None = None) -> list[Op]:
    """The smallest program found that still yields ``signature`` (minimizing it again returns it unchanged),
    every run leaving out what ``suppressions`` covers. ``until`` (``time.monotonic()`` seconds): no candidate
    starts past it. ``on_run(runs, ops of the smallest program that reproduced so far)`` is called after each run
    (the input's length until one reproduced). Raises ``ValueError`` if ``program`` does not reproduce it,
    :class:`OutOfTime` past ``until`` and :class:`Interrupted` when interrupted (both with the smallest program
    so far). A watchdog hang's candidates run under :func:`probe_limit`'s limit; its result is run again under
    the user's (a run: counted by ``on_run``, not started past ``until``), and where it does not reproduce
    there, minimization starts again under the user's limit. Until that run, :class:`OutOfTime` carries the
    smallest program checked under the user's limit (the input) and :class:`Interrupted` both."""
    cache: dict[tuple, bool] = {}
    runs = 0  # (not len(cache): the re-check under the user's limit is a run, and a restart clears the cache)
    smallest: list[Op] | None = None  # NOTE: every pass moves only to programs that fail: the latest is the best
    checked: list[Op] | None = None  # the smallest that reproduced under the user's limit (while probing: the input)
    limit: float | None = None  # a candidate's step limit (None: the user's)

    def in_time() -> None:
        if checked is not None and until is not None and time.monotonic() > until:
            raise OutOfTime(checked)

    def counted() -> None:
        nonlocal runs
        runs += 1
        if on_run is not None:
            on_run(runs, len(smallest if smallest is not None else program))

    def run(ops: list[Op]) -> bool:
        nonlocal limit
        if limit is not None:
            return reproduces(config, ops, signature, suppressions, step_limit=limit)
        started = time.monotonic()
        found = reproduces(config, ops, signature, suppressions)
        if smallest is None and found:  # the input, under the user's limit
            limit = probe_limit(signature, time.monotonic() - started)
        return found

    def fails(ops: list[Op]) -> bool:
        nonlocal smallest, checked
        key = tuple(ops)
        ran, users = key not in cache, limit is None  # (a cached result: the input's, or one under this limit)
        if ran:
            in_time()
            cache[key] = bool(ops) and run(ops)
        if cache[key] and (smallest is None or len(ops) <= len(smallest)):
            smallest = list(ops)
            if users:
                checked = smallest
        if ran:
            counted()
        return cache[key]

    def reproduces_under_the_users_limit(ops: list[Op]) -> bool:
        nonlocal checked
        in_time()
        found = reproduces(config, ops, signature, suppressions)
        if found:
            checked = list(ops)
        counted()
        return found

    try:
        if not fails(list(program)):
            raise ValueError(f"program does not reproduce {signature}")
        ops = _passes(list(program), fails)
        if limit is not None and ops != program and not reproduces_under_the_users_limit(ops):
            # NOTE: the probe's limit cut a slow step short somewhere: nothing it decided stands
            limit, smallest = None, list(program)
            cache.clear()
            cache[tuple(program)] = True
            ops = _passes(list(program), fails)
        return ops
    except (Interrupted, OutOfTime):
        raise
    except KeyboardInterrupt:
        raise Interrupted(smallest, checked) from None

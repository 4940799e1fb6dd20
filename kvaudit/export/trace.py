"""Resolve a program's handles the way the target did: run it once (no auditor) and note, before each
op, the live requests and open sessions, and after each submit the id it got. A client script names
requests and sessions, not handles modulo the live set.
"""

from __future__ import annotations

from typing import NamedTuple

from kvaudit.export.http_api import export_for
from kvaudit.program import ContinueGeneration, Idle, Op, Step, Submit
from kvaudit.targets import make_target
from kvaudit.targets.registry import kind_of

IDLE_STEP_CAP = 300  # scheduler steps an idle() may take in the trace (a hang program never idles)


class OpView(NamedTuple):
    """What the target held just before op ``index``: ``live`` request ids and open ``sessions`` (in
    order); ``rid``: the id a submit got (else None)."""

    index: int
    live: tuple[str, ...]
    sessions: tuple[str, ...]
    rid: str | None
    answered: tuple[str, ...] = ()  # of ``live``: finished, their blocks held (vLLM: a KV connector's send)


class Trace(NamedTuple):
    """Per op an :class:`OpView`, up to the op the engine raised at (none after it)."""

    views: tuple[OpView, ...]


def trace(config, program: list[Op]) -> Trace | None:
    """Run ``program`` on a fresh target of ``config``, reading what it holds before each op through its
    kind's ``export.trace_views``. None when the target cannot be built here or its kind does not expose
    those; an engine exception ends the trace at that op."""
    try:
        target = make_target(config)
    except Exception:  # noqa: BLE001 -- any reason the engine cannot be built: no trace, a static plan
        return None
    try:
        got = export_for(kind_of(config).name).trace_views(target)
    except KeyError:  # a kind with no server: nothing to resolve for a client
        got = None
    if got is None:
        target.close()
        return None
    live_of, answered_of, sessions_of = got
    views: list[OpView] = []
    stopped = None
    try:
        for i, op in enumerate(program):
            live, answered, sessions = live_of(), answered_of(), sessions_of()
            before = len(target.submitted)
            try:
                if isinstance(op, Step):
                    for _ in range(max(1, op.n)):
                        target.step()
                elif isinstance(op, Idle):
                    if getattr(target, "paused", False):
                        target.apply(ContinueGeneration())
                    for _ in range(IDLE_STEP_CAP):
                        if target.is_idle():
                            break
                        target.step()
                else:
                    target.apply(op)
            except Exception:  # noqa: BLE001 -- the finding itself (a crash): the trace ends here
                stopped = i
            rid = target.submitted[before] if isinstance(op, Submit) and len(target.submitted) > before else None
            views.append(OpView(i, live, sessions, rid, answered))
            if stopped is not None:
                break
    finally:
        target.close()
    return Trace(tuple(views))

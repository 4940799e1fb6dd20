"""Resolve a program's handles the way the target did: run it once on the target (no auditor) and
note, before each op, which requests are live and which sessions are open, and after each submit
the request id it got. A client script names requests and sessions, not handles modulo the live set.
"""

from __future__ import annotations

from typing import NamedTuple

from kvaudit.program import Idle, Op, Step, Submit

IDLE_STEP_CAP = 300  # scheduler steps an idle() may take in the trace (a hang program never idles)


class OpView(NamedTuple):
    """What the target held just before op ``index``: ``live`` request ids (unfinished, in submission
    order), ``sessions`` (open session ids, in opening order); ``rid``: the id a submit got (None for
    other ops, or a submit held by a pause)."""

    index: int
    live: tuple[str, ...]
    sessions: tuple[str, ...]
    rid: str | None
    answered: tuple[str, ...] = ()  # of ``live``: finished, their blocks held (vLLM: a KV connector's send)


class Trace(NamedTuple):
    """Per op an :class:`OpView` (ops after a crash are left out); ``stopped_at``: the op index the
    engine raised at, else None; ``finished``: request id -> the index of the first op before which it
    was no longer live (absent: live to the end)."""

    views: tuple[OpView, ...]
    stopped_at: int | None
    finished: dict[str, int]


def trace(config, program: list[Op]) -> Trace | None:
    """Run ``program`` on a fresh target of ``config`` (SGLang's: its intake's ``live_rids()``,
    ``sessions`` and ``submitted``; vLLM's: ``known()``, the Scheduler's ``requests`` in arrival order,
    which its aborts pick from, and ``submitted``). Returns None when the target cannot be built here
    (the engine is not installed) or does not expose those. An engine exception ends the trace at that
    op."""
    from kvaudit.targets import make_target

    try:
        target = make_target(config)
    except Exception:  # noqa: BLE001 -- any reason the engine cannot be built: no trace, a static plan
        return None
    if hasattr(target, "known") and hasattr(target, "submitted"):  # vLLM: no sessions
        def live_of():
            return tuple(target.known())

        def answered_of():
            return tuple(rid for rid, (_, status) in target.known().items() if status.startswith("finished"))

        def sessions_of():
            return ()
    elif all(hasattr(target, a) for a in ("live_rids", "sessions", "submitted")):
        def live_of():
            return tuple(target.live_rids())

        def answered_of():
            return ()

        def sessions_of():
            return tuple(target.sessions)
    else:
        target.close()
        return None
    views: list[OpView] = []
    finished: dict[str, int] = {}
    seen: set[str] = set()
    stopped = None
    try:
        for i, op in enumerate(program):
            live, answered = live_of(), answered_of()
            for rid in seen - set(live):
                finished.setdefault(rid, i)
            seen |= set(live)
            sessions = sessions_of()
            before = len(target.submitted)
            try:
                if isinstance(op, Step):
                    for _ in range(max(1, op.n)):
                        target.step()
                elif isinstance(op, Idle):
                    if getattr(target, "paused", False):
                        from kvaudit.program import ContinueGeneration
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
    return Trace(tuple(views), stopped, finished)

"""The runner's own checks, on the outcome of the engine calls: a flush that left memory held, a
request that makes no progress, an idle() that never drains, a call the watchdog interrupted, a
call that raised. Each takes the :class:`kvaudit.audit.runner.AuditedRun` it checks.
"""

from __future__ import annotations

import os
import sys
import traceback

from kvaudit.audit import memstate
from kvaudit.audit.findings import KVAUDIT_DIR, Finding, Site, portable_path
from kvaudit.audit.oracles.lock_balance import lock_balance
from kvaudit.targets.base import ABORT_IGNORED, LOST

MAX_IDLE_STEPS = 2000
LIVENESS_STEPS = 300  # no request needs this many steps without progress in any preset
AT_ONCE = (LOST, ABORT_IGNORED)  # the progress values reported at once, and once per request
WATCHDOG_HANG = "engine step did not return within"  # the message of a watchdog hang starts so


def attach_engine_verdict(target, findings: list[Finding]) -> list[Finding]:
    """Put the engine's own ``check_memory()`` verdict beside each finding; returns ``findings``."""
    if findings:
        verdict = target.engine_check() or ["engine check_memory(): ok"]
        for f in findings:
            f.engine_check = verdict
    return findings


def quiescence(run) -> list[Finding]:
    """``leak``: after a successful ``flush_cache`` some pool is not full again."""
    run.flushes_checked = run.target.flushed()
    found = [Finding(kind="leak", pool=pool, op_index=run.ops_run - 1, step=run.target.steps,
                     message=f"not quiescent: {problem}") for pool, problem in run.target.quiescence()]
    return attach_engine_verdict(run.target, found[:1])


def liveness(run) -> list[Finding]:
    """``liveness``: a request that holds KV, or was aborted, and makes no progress for
    LIVENESS_STEPS steps (a parked request nobody schedules, an abort that never ends it); at once, and once,
    one the target calls :data:`~kvaudit.targets.base.LOST` (never answered, held nowhere), named by what
    last handled it (``Target.dropped_by``)."""
    now, seen = run.target.steps, {}
    for rid, value in run.target.progress().items():
        last = run.last_progress.get(rid)
        seen[rid] = last if last is not None and last[0] == value else (value, now)
    run.last_progress = seen
    # (a lost request, or an ignored abort, is reported once: suppressed, it was built again at every check)
    told = run.told_once
    stuck = sorted(rid for rid, (value, since) in seen.items()
                   if (rid not in told if value in AT_ONCE else now - since >= LIVENESS_STEPS))
    if not stuck:
        return []
    run.last_progress = {}
    value = seen[stuck[0]][0]
    if value in AT_ONCE:
        told.add(stuck[0])
    state = ("lost" if value == LOST else "abort-ignored" if value == ABORT_IGNORED else "aborted" if value < 0
             else "holds-kv")
    what = {"lost": "lost: never answered, and the engine holds it nowhere", "aborted": "aborted, never finished",
            "abort-ignored": "its abort ignored: the engine took the abort while it was unanswered, then answered "
                             "it with another reason", "holds-kv": "holds KV"}[state]
    # its signature names where the request sits (Root.where) and what it is, never its id; a lost request,
    # what last handled it (Target.dropped_by: the path that dropped it)
    where = next((r.where for r in run.target.roots() if r.owner == f"req:{stuck[0]}" and r.where), "")
    by = run.target.dropped_by(stuck[0]) if state == "lost" else None
    f = Finding(kind="liveness", pool="-", op_index=run.ops_run - 1, step=now,
                check=f"{where or '-'}:{state}" + f"/{by}" * bool(by),
                message=f"req:{stuck[0]} ({what}{f', in {where}' if where else ''}"
                        + f"; last handled by {by}" * bool(by) + ")"
                        + ("" if value in AT_ONCE else f" made no progress for {LIVENESS_STEPS} steps")
                        + (f"; also {', '.join(stuck[1:4])}" if len(stuck) > 1 else ""))
    return attach_engine_verdict(run.target, [f])


def idle_hang(run) -> list[Finding]:
    """idle() never drained: a ``hang`` naming what the target says is stuck (``Target.stuck()``), its
    ``describe_busy()`` in the message; before it, the locks no live holder accounts for (one hang
    symptom, several causes)."""
    try:
        busy = run.target.describe_busy()  # "" (the base's default): the target does not say
        said = f": {busy}" if busy else " (the target's describe_busy() names nothing)"
    except Exception as e:  # only the hang's words: the hang stays the finding, not a crash of describe_busy
        said = f" (the target's describe_busy() raised {type(e).__name__}: {e})"
    stuck = run.target.stuck()
    f = Finding(kind="hang", pool="-", op_index=run.ops_run - 1, step=run.target.steps, check=stuck,
                message=f"engine not idle after {MAX_IDLE_STEPS} steps of idle()" + said
                + (f"; stuck: {stuck}" if stuck else ""))
    locks = lock_balance(run.auditor, run.target, idle=True) if run.run_oracles else []
    return attach_engine_verdict(run.target, locks + [f])


def watchdog_hang(run, stack) -> list[Finding]:
    """The watchdog's ``hang``: ``stack`` (``traceback`` frames, outermost first) is the interrupted
    thread's below the runner; the finding names its engine frames."""
    frames = _engine_frames(stack, run.target.engine_files())
    where = f"; stuck in {frames[0].short()}" if frames else ""
    f = Finding(kind="hang", pool="-", op_index=run.ops_run - 1, step=run.target.steps, alloc_sites=frames[:8],
                message=f"{WATCHDOG_HANG} {run.step_limit:g}s (watchdog){where}")
    try:  # the step was cut short: the engine's counters may be half-updated, or its check may fail
        return attach_engine_verdict(run.target, [f])
    except Exception as exc:
        f.engine_check = [f"engine check_memory() raised {type(exc).__name__}: {exc}"]
        return [f]


def crash(run, exc: BaseException) -> list[Finding]:
    """The ``crash``: its stack without kvaudit's frames, except the target's ``engine_files`` (a
    driver that plays the scheduler); an out-of-memory crash also carries who held the memory then."""
    engine_files = run.target.engine_files()
    frames = _engine_frames(traceback.extract_tb(exc.__traceback__), engine_files)
    f = Finding(kind="crash", pool="-", message=f"{type(exc).__name__}: {exc}", alloc_sites=frames[:8],
                op_index=run.ops_run - 1, step=run.target.steps, traceback=_engine_traceback(exc, engine_files),
                check=run.target.crash_by(exc))
    if memstate.is_out_of_memory(str(exc)):
        f.memory_state = memstate.memory_state(run.target, run.auditor)
    cause = run.target.crash_cause() if run.auditor is not None else None
    if cause is not None and cause.free_sites:  # where the state the crash met began (the signature keeps the raise)
        f.message += f" (the state then: {cause.message})"
        f.free_sites = run.auditor.site(int(cause.free_sites[-1]))
    return [f]


def _kept_frames(stack, engine_files) -> list:
    keep = {os.path.abspath(f) for f in engine_files}
    return [fr for fr in stack if not (path := os.path.abspath(fr.filename)).startswith(KVAUDIT_DIR + os.sep)
            or path in keep]


def _engine_frames(stack, engine_files) -> list[Site]:
    return [Site(portable_path(fr.filename), fr.lineno or 0, fr.name, (fr.line or "").strip())
            for fr in reversed(_kept_frames(stack, engine_files))]


def _display_path(path: str) -> str:
    # an installed module's path from its import root (sglang/srt/... in site-packages or an overlay)
    path = portable_path(path)
    if not os.path.isabs(path):
        return path
    roots = [os.path.abspath(r) for r in sys.path if r and os.path.isabs(r)]
    root = max((r for r in roots if path.startswith(r + os.sep)), key=len, default=None)
    return os.path.relpath(path, root) if root else path


def _engine_traceback(exc: BaseException, engine_files) -> str:
    # NOTE: without kvaudit's frames and with portable paths, so a replay file's text does not change
    # when only kvaudit or the machine does
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    seen, todo = set(), [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        frames = _kept_frames(t.stack, engine_files)
        for fr in frames:
            fr.filename = _display_path(fr.filename)
        t.stack = traceback.StackSummary.from_list(frames)
        todo += [c for c in (t.__cause__, t.__context__) if c is not None]
    return "".join(te.format())

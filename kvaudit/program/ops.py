"""The program model: an event program is a list of typed ops that any target can run.

Every program is valid by construction: request handles are taken modulo the live set, and
lengths are clamped by the target to what its context allows. Programs round-trip through JSON
(the ``program`` key of a replay file) and print as one readable line per op.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Union


class ProgramError(ValueError):
    """A program (or one op of it) read from JSON is malformed."""


@dataclass(frozen=True)
class Submit:
    """A generate request. The prompt is ``prompt_len`` tokens of prefix family ``family``: prompts
    of one family share their leading tokens, so the radix cache sees real prefix hits.

    ``session``: the next turn of open session ``session`` (modulo the open ones; a plain request
    when none is open). ``extends``: the prompt continues the text (prompt + output so far) of
    submitted request ``extends`` (modulo all submitted), as a chat client resending its history.
    ``priority``: the request's scheduling priority (SGLang's ``priority``; larger runs first unless
    the target schedules low values first). A target without priority scheduling ignores it, as
    SGLang does by default. ``ignore_eos``: 1 = sampling parameter ``ignore_eos`` (the EOS sampled at
    ``stop_at`` does not finish the request; it runs to ``max_new_tokens``). ``grammar``: the request
    is constrained by a grammar (SGLang's ``regex``/``json_schema``) that compiles ``grammar`` scheduler
    steps after it arrives; until then it waits in the grammar queue. A target without a grammar
    manager (the built-in engine, PD decode) runs it unconstrained.

    A session turn's ``SessionParams`` (SGLang's; a streaming session rejects all but a plain append,
    a non-streaming one rebuilds the prompt from a branch of its history): ``parent`` continues from
    the session's ``parent``-th turn (modulo its turns; None: the default branch point), ``replace``
    (0/1) replaces that turn (or, with no parent, clears the history), ``drop_previous_output`` (0/1)
    leaves the parent's output out, ``offset`` splices the new prompt in at that token of the history.
    The built-in engine's sessions ignore them.
    """

    family: int = 0
    prompt_len: int = 4
    max_new_tokens: int = 4
    stop_at: int | None = None  # output length at which EOS is sampled
    session: int | None = None
    extends: int | None = None
    priority: int | None = None
    ignore_eos: int = 0
    grammar: int | None = None
    parent: int | None = None
    replace: int = 0
    drop_previous_output: int = 0
    offset: int | None = None
    kind: ClassVar[str] = "submit"


@dataclass(frozen=True)
class HealthCheck:
    """SGLang's ``/health_generate``: runs as a 1-token request only when the engine is idle."""

    kind: ClassVar[str] = "health_check"


@dataclass(frozen=True)
class Abort:
    """Abort live request ``handle`` (modulo the live set), or every request if ``handle`` is None."""

    handle: int | None = 0
    kind: ClassVar[str] = "abort"


@dataclass(frozen=True)
class FlushCache:
    """SGLang's ``/flush_cache``: empties the cache and every pool, but only when the engine is idle.
    ``timeout``: a busy engine is waited for up to ``timeout`` scheduler steps (SGLang's ``timeout_s``
    with one second a step: ``SchedulerFlushWrapper``), then the flush fails. A target without the
    deferred flush tries once."""

    timeout: int = 0
    kind: ClassVar[str] = "flush_cache"


@dataclass(frozen=True)
class OpenSession:
    """Open a streaming session (a no-op on an engine without them)."""

    kind: ClassVar[str] = "open_session"


@dataclass(frozen=True)
class CloseSession:
    """Close open session ``handle`` (modulo the open ones); deferred while its turn is in flight."""

    handle: int = 0
    kind: ClassVar[str] = "close_session"


@dataclass(frozen=True)
class MemoryPressure:
    """Another tenant needs device memory: the tree's evictable KV is evicted and the next decode
    step retracts every running request but one."""

    kind: ClassVar[str] = "memory_pressure"


PAUSE_MODES = ("abort", "in_place", "retract")  # PauseGenerationReqInput.mode, in SGLang's order


@dataclass(frozen=True)
class PauseGeneration:
    """SGLang's ``/pause_generation`` (a weight update's first step), ``mode`` indexing
    :data:`PAUSE_MODES`: 0 ``abort`` -- the tokenizer aborts every request and holds new ones, the
    scheduler keeps running; 1 ``in_place`` -- the scheduler stops scheduling, its state frozen;
    2 ``retract`` -- as in_place, after retracting every in-flight request to the waiting queue
    (``retract_all``), so ``flush_cache`` can succeed. New requests (submits, health checks) are held
    at the tokenizer until :class:`ContinueGeneration`. Source: ``Scheduler.pause_generation``,
    ``TokenizerManager.pause_generation``."""

    mode: int = 0
    kind: ClassVar[str] = "pause_generation"


@dataclass(frozen=True)
class ContinueGeneration:
    """SGLang's ``/continue_generation``: the scheduler runs again and the held requests are sent.
    A no-op when not paused."""

    kind: ClassVar[str] = "continue_generation"


@dataclass(frozen=True)
class TransferFail:
    """PD decode: the KV transfer of request ``handle`` fails (the prefill server dies, the wire errs
    or times out: its receiver polls ``KVPoll.Failed``), or of every such request if ``handle`` is
    None. ``handle`` is taken modulo the live requests that have not joined the running batch yet
    (queued for pre-allocation, transferring, or transferred and waiting to join), in submission
    order; a no-op when there is none or the target is not a PD decode server. A target whose PD
    driver does not model failures ignores it."""

    handle: int | None = 0
    kind: ClassVar[str] = "transfer_fail"


@dataclass(frozen=True)
class Step:
    """``n`` scheduler iterations."""

    n: int = 1
    kind: ClassVar[str] = "step"


@dataclass(frozen=True)
class Idle:
    """Run the engine to quiescence, then the idle checks. A paused engine is resumed first
    (:class:`ContinueGeneration`): an operator ends a pause before draining."""

    kind: ClassVar[str] = "idle"


Op = Union[Submit, HealthCheck, Abort, FlushCache, OpenSession, CloseSession, MemoryPressure, PauseGeneration,
           ContinueGeneration, TransferFail, Step, Idle]
OP_TYPES: dict[str, type] = {t.kind: t for t in (Submit, HealthCheck, Abort, FlushCache, OpenSession, CloseSession,
                                                 MemoryPressure, PauseGeneration, ContinueGeneration, TransferFail,
                                                 Step, Idle)}
NULLABLE = ("stop_at", "handle", "session", "extends", "priority", "grammar", "parent", "offset")
# arguments added after format 1 was first written: left out of JSON and of printed ops when at
# their default, so every program written before reads, prints and serializes as it did
LATE_DEFAULTS = {"priority": None, "ignore_eos": 0, "grammar": None, "timeout": 0, "parent": None, "replace": 0,
                 "drop_previous_output": 0, "offset": None}
MAXIMA = {"ignore_eos": 1, "mode": len(PAUSE_MODES) - 1, "replace": 1, "drop_previous_output": 1}  # arguments narrower than [0, MAX_ARG]
FORMAT = "kvaudit.program/1"
MAX_ARG = 10_000  # no op argument needs more; step(n=10**12) would never return


def prompt_tokens(family: int, length: int, vocab_size: int = 128) -> list[int]:
    """The prompt of ``family`` truncated to ``length`` tokens (ids in ``[2, vocab_size)``)."""
    span = vocab_size - 2
    return [2 + ((family + 1) * 131 + i * 17 + (i * i) % 5) % span for i in range(length)]


def _args(op: Op) -> dict:
    return {k: v for k, v in dataclasses.asdict(op).items() if not (k in LATE_DEFAULTS and v == LATE_DEFAULTS[k])}


def op_to_dict(op: Op) -> dict:
    return {"op": op.kind, **_args(op)}


def op_from_dict(d: object) -> Op:
    """Parse one op. Raises :class:`ProgramError` with a one-line reason."""
    if not isinstance(d, dict) or "op" not in d:
        raise ProgramError(f"op must be an object with an 'op' key, got {d!r:.60}")
    cls = OP_TYPES.get(d["op"]) if isinstance(d["op"], str) else None
    if cls is None:
        raise ProgramError(f"unknown op {d['op']!r}; valid ops: {', '.join(OP_TYPES)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    args = {k: v for k, v in d.items() if k != "op"}
    for k, v in args.items():
        if k not in fields:
            raise ProgramError(f"op {d['op']!r} has no argument {k!r}")
        if not (v is None or (isinstance(v, int) and not isinstance(v, bool))):
            raise ProgramError(f"argument {k!r} of op {d['op']!r} must be an integer or null")
    op = cls(**args)
    for k, v in dataclasses.asdict(op).items():
        if v is not None and not 0 <= v <= MAXIMA.get(k, MAX_ARG):
            raise ProgramError(f"argument {k!r} of op {d['op']!r} must be in [0, {MAXIMA.get(k, MAX_ARG)}]")
        if v is None and k not in NULLABLE:
            raise ProgramError(f"argument {k!r} of op {d['op']!r} must not be null")
    return op


def program_to_json(ops: list[Op]) -> list[dict]:
    return [op_to_dict(op) for op in ops]


def program_from_json(data: object) -> list[Op]:
    if not isinstance(data, list):
        raise ProgramError("program must be a list of ops")
    return [op_from_dict(d) for d in data]


def format_op(op: Op) -> str:
    args = ", ".join(f"{k}={v}" for k, v in _args(op).items() if not (v is None and k in NULLABLE and k != "handle"))
    return f"{op.kind}({args})"


def format_program(ops: list[Op]) -> str:
    """One op per line, numbered from 0 (the op index used in findings)."""
    return "\n".join(f"{i:>3}  {format_op(op)}" for i, op in enumerate(ops))


FEATURES = ("priority", "grammar", "flush_timeout", "session_params", "transfer_fail")  # what only some targets model


def random_program(rng, length: int, max_prompt: int = 32, features: frozenset = frozenset()) -> list[Op]:
    """A random program of ``length`` ops from ``rng`` (a ``random.Random``), ending in ``idle``.

    The op mix is fixed (no coverage feedback): this is the plain random baseline. ``features`` (of
    :data:`FEATURES`, what the target models -- a config's ``program_features``): ``priority``, submits
    carry a priority (0..9, or none); ``grammar``, one submit in four has a grammar compiling in 0..6
    steps; ``flush_timeout``, a flush may wait up to 8 steps for idle; ``session_params``, one session
    turn in three is edited: it names a parent turn (three in four; else none, the default branch
    point) and may replace it, drop its output or splice at an offset;
    ``transfer_fail``, about one op in 25 is a :class:`TransferFail` (a PD decode server's transfers).
    """
    ops: list[Op] = []
    for _ in range(max(0, length - 1)):
        r = rng.random()
        if r < 0.33:
            family, plen, new = rng.randrange(4), rng.randint(1, max_prompt), rng.randint(1, 12)
            stop_at = rng.choice([None, None, rng.randint(1, 12)])
            session, extends = rng.choice([None, None, rng.randrange(4)]), rng.choice([None] * 5 + [rng.randrange(8)])
            ignore_eos = int(stop_at is not None and rng.random() < 0.25)
            priority = rng.choice([None, rng.randrange(10)]) if "priority" in features else None
            grammar = (rng.randint(0, 6) if rng.random() < 0.25 else None) if "grammar" in features else None
            edit: dict = {}
            if "session_params" in features and session is not None and rng.random() < 1 / 3:
                # one edit in four names no parent turn (replace: clear the history; SGLang 0.5.23
                # crashed on it, corpora/sglang #10): always naming one, the random baseline never made it
                parent = rng.randrange(4)
                edit = {"parent": None if rng.random() < 0.25 else parent,
                        rng.choice(["replace", "drop_previous_output", "offset", "-"]): 1}
                edit.pop("-", None)
                if "offset" in edit:
                    edit["offset"] = rng.randint(0, 24)
            ops.append(Submit(family, plen, new, stop_at, session, extends, priority, ignore_eos, grammar, **edit))
        elif r < 0.41:
            ops.append(HealthCheck())
        elif r < 0.5:
            ops.append(Abort(rng.choice([None, rng.randrange(8)])))
        elif r < 0.53:
            ops.append(FlushCache(rng.choice([0, 0, rng.randint(1, 8)]) if "flush_timeout" in features else 0))
        elif r < 0.57:
            ops.append(OpenSession())
        elif r < 0.6:
            ops.append(CloseSession(rng.randrange(4)))
        elif r < 0.62:
            ops.append(MemoryPressure())
        elif r < 0.64:
            ops.append(PauseGeneration(rng.randrange(len(PAUSE_MODES))))
        elif r < 0.66:
            ops.append(ContinueGeneration())
        elif r < 0.7 and "transfer_fail" in features:
            ops.append(TransferFail(rng.choice([None, rng.randrange(4), rng.randrange(4)])))
        elif r < 0.9:
            ops.append(Step(rng.randint(1, 4)))
        else:
            ops.append(Idle())
    ops.append(Idle())
    return ops

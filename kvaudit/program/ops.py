"""The program model: an event program is a list of typed ops that any target can run.

Every program is valid by construction: request handles are taken modulo the live set, and
lengths are clamped by the target to what its context allows. Programs round-trip through JSON
(the ``program`` key of a replay file) and print as one readable line per op.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Union

from kvaudit.program.schema import OPS, late_defaults


class ProgramError(ValueError):
    """A program (or one op of it) read from JSON is malformed."""


_SUBMIT = OPS["submit"].arg


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

    family: int = _SUBMIT['family'].default
    prompt_len: int = _SUBMIT['prompt_len'].default
    max_new_tokens: int = _SUBMIT['max_new_tokens'].default
    stop_at: int | None = _SUBMIT['stop_at'].default
    session: int | None = _SUBMIT['session'].default
    extends: int | None = _SUBMIT['extends'].default
    priority: int | None = _SUBMIT['priority'].default
    ignore_eos: int = _SUBMIT['ignore_eos'].default
    grammar: int | None = _SUBMIT['grammar'].default
    parent: int | None = _SUBMIT['parent'].default
    replace: int = _SUBMIT['replace'].default
    drop_previous_output: int = _SUBMIT['drop_previous_output'].default
    offset: int | None = _SUBMIT['offset'].default
    kind: ClassVar[str] = "submit"


@dataclass(frozen=True)
class HealthCheck:
    """SGLang's ``/health_generate``: runs as a 1-token request only when the engine is idle."""

    kind: ClassVar[str] = "health_check"


@dataclass(frozen=True)
class Abort:
    """Abort live request ``handle`` (modulo the live set), or every request if ``handle`` is None."""

    handle: int | None = OPS["abort"].arg["handle"].default
    kind: ClassVar[str] = "abort"


@dataclass(frozen=True)
class FlushCache:
    """SGLang's ``/flush_cache``: empties the cache and every pool, but only when the engine is idle.
    ``timeout``: a busy engine is waited for up to ``timeout`` scheduler steps (SGLang's ``timeout_s``
    with one second a step: ``SchedulerFlushWrapper``), then the flush fails. A target without the
    deferred flush tries once."""

    timeout: int = OPS["flush_cache"].arg["timeout"].default
    kind: ClassVar[str] = "flush_cache"


@dataclass(frozen=True)
class OpenSession:
    """Open a streaming session (a no-op on an engine without them)."""

    kind: ClassVar[str] = "open_session"


@dataclass(frozen=True)
class CloseSession:
    """Close open session ``handle`` (modulo the open ones); deferred while its turn is in flight."""

    handle: int = OPS["close_session"].arg["handle"].default
    kind: ClassVar[str] = "close_session"


@dataclass(frozen=True)
class MemoryPressure:
    """Another tenant needs device memory: the tree's evictable KV is evicted and the next decode
    step retracts every running request but one."""

    kind: ClassVar[str] = "memory_pressure"


@dataclass(frozen=True)
class PauseGeneration:
    """SGLang's ``/pause_generation`` (a weight update's first step), ``mode`` indexing
    :data:`kvaudit.program.schema.PAUSE_MODES`: 0 ``abort`` -- the tokenizer aborts every request and holds new ones, the
    scheduler keeps running; 1 ``in_place`` -- the scheduler stops scheduling, its state frozen;
    2 ``retract`` -- as in_place, after retracting every in-flight request to the waiting queue
    (``retract_all``), so ``flush_cache`` can succeed. New requests (submits, health checks) are held
    at the tokenizer until :class:`ContinueGeneration`. Source: ``Scheduler.pause_generation``,
    ``TokenizerManager.pause_generation``."""

    mode: int = OPS["pause_generation"].arg["mode"].default
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

    handle: int | None = OPS["transfer_fail"].arg["handle"].default
    kind: ClassVar[str] = "transfer_fail"


@dataclass(frozen=True)
class Step:
    """``n`` scheduler iterations."""

    n: int = OPS["step"].arg["n"].default
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
_GENERATED: dict[str, tuple] = {}  # kind -> (its OpSpec, the op type made from it)


def op_type(kind: str) -> type:
    """The op type of ``kind``: its class above, else a frozen dataclass made from its
    :data:`kvaudit.program.schema.OPS` row (its arguments as fields, in order, with their defaults;
    named after the kind: ``probe_op`` -> ``ProbeOp``), so that a row is a whole op. Raises
    ``KeyError`` for a kind that is not in :data:`OPS`."""
    if kind in OP_TYPES:
        return OP_TYPES[kind]
    spec = OPS[kind]
    made = _GENERATED.get(kind)
    if made is None or made[0] is not spec:
        name = "".join(w.title() for w in kind.split("_"))
        cls = dataclasses.make_dataclass(name, [(a.name, "int | None", dataclasses.field(default=a.default))
                                                for a in spec.args] + [("kind", ClassVar[str], kind)],
                                         frozen=True, namespace={"__doc__": f"The op {kind!r} (read from its schema row)."})
        made = _GENERATED[kind] = (spec, cls)
    return made[1]


# the schema's views: arguments that may be null, and those left out of JSON and printed ops at
# their default (added after format 1 was first written, so every older program reads as it did)
NULLABLE = frozenset(a.name for spec in OPS.values() for a in spec.args if a.nullable)
LATE_DEFAULTS = late_defaults()
FORMAT = "kvaudit.program/1"


def _args(op: Op) -> dict:
    # the fields are flat ints or None: a shallow read, not dataclasses.asdict's deep copy (the corpus
    # fuzzer writes hundreds of programs a minute)
    values = ((f.name, getattr(op, f.name)) for f in dataclasses.fields(op))
    return {k: v for k, v in values if not (k in LATE_DEFAULTS and v == LATE_DEFAULTS[k])}


def op_to_dict(op: Op) -> dict:
    return {"op": op.kind, **_args(op)}


def op_from_dict(d: object) -> Op:
    """Parse one op. Raises :class:`ProgramError` with a one-line reason."""
    if not isinstance(d, dict) or "op" not in d:
        raise ProgramError(f"op must be an object with an 'op' key, got {d!r:.60}")
    cls = op_type(d["op"]) if isinstance(d["op"], str) and d["op"] in OPS else None
    if cls is None:
        raise ProgramError(f"unknown op {d['op']!r}; valid ops: {', '.join(OPS)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    args = {k: v for k, v in d.items() if k != "op"}
    for k, v in args.items():
        if k not in fields:
            raise ProgramError(f"op {d['op']!r} has no argument {k!r}")
        if not (v is None or (isinstance(v, int) and not isinstance(v, bool))):
            raise ProgramError(f"argument {k!r} of op {d['op']!r} must be an integer or null")
    op = cls(**args)
    spec = OPS[cls.kind].arg
    for k, v in dataclasses.asdict(op).items():
        if v is not None and not 0 <= v <= spec[k].limit:
            raise ProgramError(f"argument {k!r} of op {d['op']!r} must be in [0, {spec[k].limit}]")
        if v is None and not spec[k].nullable:
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

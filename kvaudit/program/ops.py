"""The program model: an event program is a list of typed ops that any target can run. Each op type is
a frozen dataclass made from its row of :data:`kvaudit.program.schema.OPS`; programs round-trip through
JSON (the ``program`` key of a replay file) and print as one readable line per op.

Design notes: docs/internals/program.md.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Union

from kvaudit.config import json_value
from kvaudit.program.schema import OPS


class ProgramError(ValueError):
    """A program (or one op of it) read from JSON is malformed."""


_TYPES: dict[str, tuple] = {}  # kind -> (its OpSpec, the op type made from it)


def op_type(kind: str) -> type:
    """The op type of ``kind``: a frozen dataclass made from its :data:`OPS` row (its arguments as
    fields, in order, with their defaults; named after the kind: ``probe_op`` -> ``ProbeOp``), made
    again if the row changes. Raises ``KeyError`` for a kind that is not in :data:`OPS`."""
    spec = OPS[kind]
    made = _TYPES.get(kind)
    if made is None or made[0] is not spec:
        name = "".join(w.title() for w in kind.split("_"))
        fields = [(a.name, "int | None", dataclasses.field(default=a.default)) for a in spec.args]
        doc = spec.doc or f"The op {kind!r} (read from its schema row)."
        cls = dataclasses.make_dataclass(name, fields + [("kind", ClassVar[str], kind)], frozen=True,
                                         namespace={"__doc__": doc, "__module__": __name__})
        made = _TYPES[kind] = (spec, cls)
    return made[1]


Submit = op_type("submit")
HealthCheck = op_type("health_check")
Abort = op_type("abort")
FlushCache = op_type("flush_cache")
OpenSession = op_type("open_session")
CloseSession = op_type("close_session")
MemoryPressure = op_type("memory_pressure")
PauseGeneration = op_type("pause_generation")
ContinueGeneration = op_type("continue_generation")
TransferFail = op_type("transfer_fail")
Step = op_type("step")
Idle = op_type("idle")
Op = Union[Submit, HealthCheck, Abort, FlushCache, OpenSession, CloseSession, MemoryPressure, PauseGeneration,
           ContinueGeneration, TransferFail, Step, Idle]
OP_TYPES: dict[str, type] = {t.kind: t for t in Op.__args__}

# the schema's views: arguments that may be null, and those left out of JSON and printed ops at their
# default (added after format 1 was first written, so every older program reads as it did; the same
# default wherever the name occurs)
NULLABLE = frozenset(a.name for spec in OPS.values() for a in spec.args if a.nullable)
LATE_DEFAULTS = {a.name: a.default for spec in OPS.values() for a in spec.args if a.late}
FORMAT = "kvaudit.program/1"


def _args(op: Op) -> dict:
    # NOTE: a shallow read, not dataclasses.asdict's deep copy: the corpus fuzzer writes hundreds of programs a minute
    values = ((f.name, getattr(op, f.name)) for f in dataclasses.fields(op))
    return {k: v for k, v in values if not (k in LATE_DEFAULTS and v == LATE_DEFAULTS[k])}


def op_to_dict(op: Op) -> dict:
    return {"op": op.kind, **_args(op)}


def op_from_dict(d: object) -> Op:
    """Parse one op. Raises :class:`ProgramError` with a one-line reason."""
    if not isinstance(d, dict) or "op" not in d:
        raise ProgramError(f'op must be an object with an "op" key, got {json_value(d, 60)}')
    cls = op_type(d["op"]) if isinstance(d["op"], str) and d["op"] in OPS else None
    if cls is None:
        raise ProgramError(f"unknown op {json_value(d['op'], 60)}; valid ops: {', '.join(OPS)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    args = {k: v for k, v in d.items() if k != "op"}
    for k, v in args.items():
        if k not in fields:
            raise ProgramError(f"op {json_value(d['op'])} has no argument {json_value(k, 60)}")
        if not (v is None or (isinstance(v, int) and not isinstance(v, bool))):
            raise ProgramError(f"argument {json_value(k)} of op {json_value(d['op'])} must be an integer or null, "
                               f"got {json_value(v, 40)}")
    op = cls(**args)
    spec = OPS[cls.kind].arg
    for k, v in dataclasses.asdict(op).items():
        if v is not None and not 0 <= v <= spec[k].limit:
            raise ProgramError(f"argument {json_value(k)} of op {json_value(d['op'])} must be in [0, {spec[k].limit}], "
                               f"got {v}")
        if v is None and not spec[k].nullable:
            raise ProgramError(f"argument {json_value(k)} of op {json_value(d['op'])} must not be null")
    return op


def program_to_json(ops: list[Op]) -> list[dict]:
    return [op_to_dict(op) for op in ops]


def program_from_json(data: object) -> list[Op]:
    """A replay file's ``program`` (a list of op objects) as ops. Raises :class:`ProgramError` with one line,
    naming the op by its index (``op #3: ...``) where one is bad."""
    if not isinstance(data, list):
        raise ProgramError("program must be a list of ops")
    ops = []
    for i, d in enumerate(data):
        try:
            ops.append(op_from_dict(d))
        except ProgramError as e:  # (numbered as reports number ops: "detected after op #5")
            raise ProgramError(f"op #{i}: {e}") from None
    return ops


def format_op(op: Op) -> str:
    args = ", ".join(f"{k}={v}" for k, v in _args(op).items() if not (v is None and k in NULLABLE and k != "handle"))
    return f"{op.kind}({args})"


def format_program(ops: list[Op]) -> str:
    """One op per line, numbered from 0 (the op index used in findings)."""
    return "\n".join(f"{i:>3}  {format_op(op)}" for i, op in enumerate(ops))

"""A byte decoder for coverage-guided fuzzers: any byte string is a valid program.

libFuzzer (through atheris) mutates flat byte strings; :func:`program_from_bytes` maps each one to
a valid :mod:`kvaudit.program` program for a given target config, and :func:`program_to_bytes` is
its inverse, used to seed the corpus with known reproducers.

Versions
--------
A byte string says its layout by its first byte: :data:`V2_MAGIC` (``0xf2``) starts a **version 2**
input (the records follow it); any other first byte (and ``b""``) is a **version 1** input, read
from its first byte. Version 1 is frozen: every input written before version 2 (the seeds under
``corpora/seeds/``, libFuzzer corpora) decodes to the program it always did (``tests/data/
bytes_v1_programs.json`` pins it). A version 1 input starting with ``0xf2`` (one in 256 random
inputs; never a written seed, whose first byte is an opcode index below 12) reads as version 2 now.
New fuzzing uses version 2 (:data:`DEFAULT_VERSION`): the seeds are written in both versions and
:func:`kvaudit.search.atheris_fuzz.atheris_search` starts an empty corpus from ``V2_MAGIC``.

Both versions read consecutive fixed-size records, one op per record, so a byte flip changes one
op (or one argument of one op) and leaves the rest of the program as it was. A short last record
is read as if padded with zero bytes; at most ``max_ops`` records are read and the rest of the input
is ignored. The decoded ops are followed by one ``idle()`` unless the last one already is ``idle``,
so a program has at most ``max_ops + 1`` ops and ``b""`` is ``[idle()]``.

Version 2 (reads :data:`kvaudit.program.schema.OPS`)
----------------------------------------------------
Records of :data:`RECORD_V2` bytes: an opcode byte, then one byte per argument of the op in field
order (unused bytes ignored). The opcode indexes the op kinds of the config's reach
(:func:`kvaudit.program.schema.reach`: its ``program_features`` and capabilities), each kind
repeated :attr:`OpSpec.weight` times (:func:`kvaudit.program.generate.weighted_kinds`):
``kind = table[byte % len(table)]``. So every op and argument the schema defines for the target is
reached: pause and continue, priorities, grammars, flush timeouts, every ``SessionParams``
combination (``replace`` with or without a parent), transfer failures. An argument byte ``b`` of an
argument with range ``lo..hi`` (``n = hi - lo + 1``; a prompt's ``hi`` is ``max_prompt``) is
``lo + b % n`` for an argument always drawn (``Arg.p == 1``) and, for an optional one, unset (its
default, or None) for an even byte and ``lo + (b >> 1) % n`` for an odd one: a zero byte gives the
smallest value or unset. The schema's ``requires`` and ``caps`` then apply
(:func:`kvaudit.program.schema.resolve`).

Version 1 (frozen: its own constants, not the schema)
-----------------------------------------------------
Records of :data:`RECORD` **= 6 bytes**, one op per record::

    byte 0      opcode: OP_KINDS[config][byte % len(OP_KINDS[config])]
    bytes 1..5  arguments a1..a5 of that op, in the order listed below (unused ones ignored)

The op kinds of a config (:func:`op_kinds`), in opcode order, mirror the Hypothesis rules of
:func:`kvaudit.search.fuzz._machine` as they were when this layout was fixed (later ops and arguments --
``pause_generation``, ``continue_generation``, ``ignore_eos``, priorities, grammars, flush timeouts,
session parameters -- are not decoded, so every existing byte seed keeps its program)::

    submit, health_check, abort, flush_cache, step, idle          always
    submit_extending, memory_pressure                             unless config.disable_radix_cache
    open_session, submit_turn, close_session                      if config.enable_streaming_session
    transfer_fail                                                 on a PD decode server (added later: a
                                                                  PD seed's opcodes are below 6, so it
                                                                  decodes as before)

Argument bytes (``b`` is the byte; ``v = lo + b % (hi - lo + 1)`` for a range ``lo..hi``; a
nullable argument is ``None`` for an even byte and ``lo + (b >> 1) % (hi - lo + 1)`` for an odd
one, so a zero byte gives the smallest value or ``None``)::

    submit            a1 family 0..7, a2 prompt_len 1..max_prompt, a3 max_new_tokens 1..12,
                      a4 stop_at None|1..12
    submit_extending  a1 extends 0..7, a2 family 0..7, a3 prompt_len 1..16, a4 max_new_tokens 1..12,
                      a5 stop_at None|1..12
    submit_turn       a1 session 0..3, a2 family 0..7, a3 prompt_len 1..48, a4 max_new_tokens 1..12,
                      a5 stop_at None|1..12
    abort             a1 handle None|0..7
    transfer_fail     a1 handle None|0..3
    close_session     a1 handle 0..3
    step              a1 n 1..4
    health_check, flush_cache, idle, memory_pressure, open_session: no arguments

``max_prompt = max(2, min(96, config.context_len - 12))`` tokens (both versions; :func:`kvaudit.program.schema.max_prompt`).
Lengths are in tokens; ``step(n)`` is ``n`` scheduler iterations.

The seed corpora (``corpora/seeds/<preset>/``, both versions) are written from the regression
reproducers and :func:`hand_seeds` by ``python -m kvaudit.search.seeds --write-seeds [DIR]``.
"""

from __future__ import annotations

from kvaudit.config import TargetConfig
from kvaudit.program import bytes_v1
from kvaudit.program.bytes_v1 import RECORD, max_prompt
from kvaudit.program.generate import make_op, weighted_kinds
from kvaudit.program.ops import (Abort, CloseSession, ContinueGeneration, FlushCache, HealthCheck, Idle, MemoryPressure,
                                 Op, OpenSession, PauseGeneration, Step, Submit, TransferFail)
from kvaudit.program.schema import OPS, arg_range, reach, reachable
from kvaudit.targets import program_features

V2_MAGIC = 0xF2  # the first byte of a version 2 input
RECORD_V2 = 1 + max(len(s.args) for s in OPS.values())  # bytes per op: 1 opcode + one per argument (14)
DEFAULT_VERSION = 2  # what new seeds and new fuzzing use
VERSIONS = (1, 2)


def version_of(data: bytes) -> int:
    """The layout version of ``data``: 2 when it starts with :data:`V2_MAGIC`, else 1."""
    return 2 if data[:1] == bytes([V2_MAGIC]) else 1


def max_len(max_ops: int, version: int = DEFAULT_VERSION) -> int:
    """The longest input (bytes) that :func:`program_from_bytes` reads whole with ``max_ops``."""
    return RECORD * max_ops if version == 1 else 1 + RECORD_V2 * max_ops


def _arg_from_byte(a, b: int, mp: int):
    lo, hi = arg_range(a, mp)
    n = hi - lo + 1
    if a.p >= 1.0:
        return lo + b % n
    return a.unset if b % 2 == 0 else lo + (b >> 1) % n


def _decode_v2(data: bytes, config, max_ops: int) -> list[Op]:
    r = reach(config)
    table, mp = weighted_kinds(r), max_prompt(config)
    ops: list[Op] = []
    for start in range(0, min(len(data), max(0, max_ops) * RECORD_V2), RECORD_V2):
        rec = data[start:start + RECORD_V2].ljust(RECORD_V2, b"\x00")
        kind = table[rec[0] % len(table)]
        values = {a.name: _arg_from_byte(a, rec[1 + i], mp) for i, a in enumerate(OPS[kind].args)}
        ops.append(make_op(kind, values, r, mp))
    return ops


def _arg_to_byte(a, v, mp: int, kind: str) -> int:
    lo, hi = arg_range(a, mp)
    if a.p < 1.0 and v == a.unset:
        return 0
    if v is None or not lo <= v <= hi:
        raise ValueError(f"{a.name}={v!r} is outside {lo}..{hi}")
    return v - lo if a.p >= 1.0 else ((v - lo) << 1) | 1


def _encode_v2(op: Op, r: frozenset, table: tuple[str, ...], mp: int) -> bytes:
    spec = OPS[op.kind]
    if not reachable(spec.gate, r) or op.kind not in table:
        raise ValueError(f"op {op.kind} is not decoded for this config (its ops: {', '.join(dict.fromkeys(table))})")
    rec = bytes([table.index(op.kind)] + [_arg_to_byte(a, getattr(op, a.name), mp, op.kind) for a in spec.args])
    rec = rec.ljust(RECORD_V2, b"\x00")
    back = make_op(op.kind, {a.name: _arg_from_byte(a, rec[1 + i], mp) for i, a in enumerate(spec.args)}, r, mp)
    if back != op:  # an argument the target does not model, or one its requirement leaves unset
        diff = [a.name for a in spec.args if getattr(back, a.name) != getattr(op, a.name)]
        raise ValueError(f"{', '.join(diff)} cannot be decoded for this config")
    return rec


def program_from_bytes(data: bytes, config: TargetConfig, max_ops: int = 24) -> list[Op]:
    """Decode ``data`` into a valid program for ``config`` (see the module docstring for the layouts;
    the version is read from ``data``: :func:`version_of`).

    Total and deterministic: every byte string, ``b""`` included, gives a program of at most
    ``max_ops`` decoded ops plus a final ``idle()`` (added unless the last decoded op is ``idle``).
    """
    data = bytes(data)
    ops = _decode_v2(data[1:], config, max_ops) if version_of(data) == 2 else bytes_v1.decode(data, config, max_ops)
    if version_of(data) == 2 and (not ops or not isinstance(ops[-1], Idle)):
        ops.append(Idle())
    return ops


def program_to_bytes(program: list[Op], config: TargetConfig, version: int = DEFAULT_VERSION) -> bytes:
    """The bytes that :func:`program_from_bytes` decodes back into ``program`` (with a final ``idle()``
    appended when ``program`` does not end with one), in layout ``version`` (a version 2 input
    starts with :data:`V2_MAGIC`; unused argument bytes are zero). Raises ``ValueError`` for an op
    or argument the decoder cannot produce for ``config`` (a session op without sessions, a prompt
    longer than its range, in version 1 any argument added after it...). Programs longer than the
    decoder's ``max_ops`` are encoded whole; decode them with a larger ``max_ops``."""
    if version == 1:
        return bytes_v1.encode(program, config)
    if version != 2:
        raise ValueError(f"unknown byte layout version {version} (valid: {', '.join(map(str, VERSIONS))})")
    r = reach(config)
    table, mp = weighted_kinds(r), max_prompt(config)
    out = bytearray([V2_MAGIC])
    for i, op in enumerate(program):
        try:
            out += _encode_v2(op, r, table, mp)
        except ValueError as e:
            raise ValueError(f"op {i} ({op.kind}): {e}") from None
    return bytes(out)


# --- seed corpora ---------------------------------------------------------------------------------

def hand_seeds(config: TargetConfig, version: int = 1) -> list[list[Op]]:
    """A few short programs every corpus starts from (each decodable for ``config`` in layout
    ``version``; version 2's add the ops and arguments version 1 cannot write)."""
    seeds = [[Submit(0, 4, 2), Idle()], [HealthCheck(), Idle()], [Submit(0, 4, 4), Step(1), Abort(0), Idle()],
             [Submit(1, 8, 3), Submit(1, 12, 2, stop_at=1), Step(2), Abort(None), Idle(), FlushCache(), Idle()]]
    if not config.disable_radix_cache:
        seeds.append([Submit(2, 6, 2), Idle(), Submit(2, 4, 2, extends=0), MemoryPressure(), Idle()])
    if config.enable_streaming_session:
        seeds.append([OpenSession(), Submit(0, 4, 2, session=0), Step(1), CloseSession(0), Idle()])
    if "transfer_fail" in program_features(config):
        seeds.append([Submit(0, 8, 3), Submit(1, 6, 2), Step(1), TransferFail(1), Step(1), TransferFail(0), Idle()])
    if version >= 2:
        r = reach(config)
        seeds.append([Submit(0, 8, 4), Step(1), PauseGeneration(2), Submit(0, 4, 2), FlushCache(), ContinueGeneration(),
                      Idle()])
        seeds.append([Submit(1, 6, 6, stop_at=2, ignore_eos=1,
                             priority=3 if "priority" in r else None, grammar=2 if "grammar" in r else None), Idle()])
        if "sessions" in r:
            params = dict(replace=1, drop_previous_output=1) if "session_params" in r else {}
            seeds.append([OpenSession(), Submit(0, 4, 2, session=0), Idle(), Submit(0, 4, 2, session=0, **params),
                          Idle()])
    return seeds

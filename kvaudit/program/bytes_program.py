"""A byte decoder for coverage-guided fuzzers (libFuzzer through atheris): any byte string is a valid
program for a given target config (:func:`program_from_bytes`), and :func:`program_to_bytes` is its
inverse, used to seed the corpus with known reproducers. An input starting with :data:`V2_MAGIC` is in
layout version 2 (read from :data:`kvaudit.program.schema.OPS`), any other in version 1, frozen
(:mod:`kvaudit.program.bytes_v1`). The layouts, byte by byte: docs/reference/byte-layout.md.
"""

from __future__ import annotations

from kvaudit.config import TargetConfig
from kvaudit.program import bytes_v1
from kvaudit.program.bytes_v1 import RECORD, arg_from_byte, arg_to_byte, encode_each, max_prompt, records
from kvaudit.program.generate import make_op, weighted_kinds
from kvaudit.program.ops import (Abort, CloseSession, ContinueGeneration, FlushCache, HealthCheck, Idle, MemoryPressure,
                                 Op, OpenSession, PauseGeneration, Step, Submit, TransferFail)
from kvaudit.program.schema import OPS, arg_range, reach
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


def _decode_v2(rec: bytes, r: frozenset, table: tuple[str, ...], mp: int) -> Op:
    kind = table[rec[0] % len(table)]
    values = {a.name: arg_from_byte(b, *arg_range(a, mp), a.p < 1.0, a.unset) for b, a in zip(rec[1:], OPS[kind].args)}
    return make_op(kind, values, r, mp)


def _encode_v2(op: Op, r: frozenset, table: tuple[str, ...], mp: int) -> bytes:
    spec = OPS[op.kind]
    if op.kind not in table:
        raise ValueError(f"op {op.kind} is not decoded for this config (its ops: {', '.join(dict.fromkeys(table))})")
    args = [arg_to_byte(getattr(op, a.name), *arg_range(a, mp), a.p < 1.0, a.name, a.unset) for a in spec.args]
    rec = bytes([table.index(op.kind)] + args).ljust(RECORD_V2, b"\x00")
    back = _decode_v2(rec, r, table, mp)
    if back != op:  # an argument the target does not model, or one its requirement leaves unset
        diff = [a.name for a in spec.args if getattr(back, a.name) != getattr(op, a.name)]
        raise ValueError(f"{', '.join(diff)} cannot be decoded for this config")
    return rec


def program_from_bytes(data: bytes, config: TargetConfig, max_ops: int = 24) -> list[Op]:
    """Decode ``data`` into a valid program for ``config`` (the version is read from ``data``:
    :func:`version_of`). Total and deterministic: every byte string, ``b""`` included, gives a program
    of at most ``max_ops`` decoded ops plus a final ``idle()`` (added unless the last decoded op is one)."""
    data = bytes(data)
    if version_of(data) == 1:
        ops = bytes_v1.decode(data, config, max_ops)
    else:
        r = reach(config)
        table, mp = weighted_kinds(r), max_prompt(config)
        ops = [_decode_v2(rec, r, table, mp) for rec in records(data[1:], RECORD_V2, max_ops)]
    if not ops or not isinstance(ops[-1], Idle):
        ops.append(Idle())
    return ops


def program_to_bytes(program: list[Op], config: TargetConfig, version: int = DEFAULT_VERSION) -> bytes:
    """The bytes that :func:`program_from_bytes` decodes back into ``program`` (with a final ``idle()``
    appended when ``program`` does not end with one), in layout ``version`` (unused argument bytes are
    zero). Raises ``ValueError`` for an op or argument the decoder cannot produce for ``config`` (a
    session op without sessions, a prompt longer than its range...). Programs longer than the decoder's
    ``max_ops`` are encoded whole; decode them with a larger ``max_ops``."""
    if version == 1:
        return bytes_v1.encode(program, config)
    if version != 2:
        raise ValueError(f"unknown byte layout version {version} (valid: {', '.join(map(str, VERSIONS))})")
    r = reach(config)
    table, mp = weighted_kinds(r), max_prompt(config)
    return bytes([V2_MAGIC]) + encode_each(program, lambda op: _encode_v2(op, r, table, mp))


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

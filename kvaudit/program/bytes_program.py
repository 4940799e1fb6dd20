"""A byte decoder for coverage-guided fuzzers: any byte string is a valid program.

libFuzzer (through atheris) mutates flat byte strings; :func:`program_from_bytes` maps each one to
a valid :mod:`kvaudit.program` program for a given :class:`EngineConfig`, and
:func:`program_to_bytes` is its inverse, used to seed the corpus with known reproducers.

Byte layout
-----------
The input is read as consecutive **records of** :data:`RECORD` **= 6 bytes**, one op per record::

    byte 0      opcode: OP_KINDS[config][byte % len(OP_KINDS[config])]
    bytes 1..5  arguments a1..a5 of that op, in the order listed below (unused ones ignored)

Every record has the same size whatever its op, so a byte flip changes one op (or one argument of
one op) and leaves the rest of the program as it was. A short last record is read as if padded
with zero bytes (``b"\\x00"`` is a plain ``submit``); at most ``max_ops`` records are read and the
rest of the input is ignored. The decoded ops are followed by one ``idle()`` unless the last one
already is ``idle``, so a program has at most ``max_ops + 1`` ops and ``b""`` is ``[idle()]``.

The op kinds of a config (:func:`op_kinds`), in opcode order, mirror the Hypothesis rules of
:func:`kvaudit.fuzz._machine` as they were when this layout was fixed (later ops and arguments --
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

``max_prompt = max(2, min(96, config.context_len - 12))`` tokens, as in the Hypothesis search.
Lengths are in tokens; ``step(n)`` is ``n`` scheduler iterations.

``python -m kvaudit.bytes_program --write-seeds [DIR]`` writes the seed corpora
(``corpora/seeds/<preset>/``) from the regression reproducers and a few hand-chosen programs.
"""

from __future__ import annotations

import hashlib
import os
import sys

from engine_under_test import EngineConfig
from kvaudit.program import (Abort, CloseSession, FlushCache, HealthCheck, Idle, MemoryPressure, Op, OpenSession,
                             Step, Submit, TransferFail)
from kvaudit.targets import program_features

RECORD = 6  # bytes per op: 1 opcode + 5 argument bytes
ARG_BYTES = RECORD - 1
FAMILIES = 8
MAX_NEW_TOKENS = 12
STOP_AT = 12
ABORT_HANDLES = 8
SESSION_HANDLES = 4
EXTEND_HANDLES = 8
EXTEND_PROMPT = 16
TURN_PROMPT = 48
TRANSFER_HANDLES = 4
STEP_N = 4

_BASE = ("submit", "health_check", "abort", "flush_cache", "step", "idle")
_RADIX = ("submit_extending", "memory_pressure")
_SESSIONS = ("open_session", "submit_turn", "close_session")
_PD = ("transfer_fail",)


def max_prompt(config: EngineConfig) -> int:
    """The longest plain prompt (tokens) the decoder emits for ``config``: as in the Hypothesis search."""
    return max(2, min(96, config.context_len - 12))


def op_kinds(config: EngineConfig) -> tuple[str, ...]:
    """The op kinds meaningful for ``config``, in opcode order (``opcode % len(...)`` indexes it)."""
    kinds = _BASE
    if not config.disable_radix_cache:
        kinds += _RADIX
    if config.enable_streaming_session:
        kinds += _SESSIONS
    if "transfer_fail" in program_features(config):
        kinds += _PD
    return kinds


def _rng(b: int, lo: int, hi: int) -> int:
    return lo + b % (hi - lo + 1)


def _opt(b: int, lo: int, hi: int) -> int | None:
    return None if b % 2 == 0 else lo + (b >> 1) % (hi - lo + 1)


def _decode(kind: str, a: bytes, mp: int) -> Op:
    if kind == "submit":
        return Submit(_rng(a[0], 0, FAMILIES - 1), _rng(a[1], 1, mp), _rng(a[2], 1, MAX_NEW_TOKENS),
                      _opt(a[3], 1, STOP_AT))
    if kind == "submit_extending":
        return Submit(_rng(a[1], 0, FAMILIES - 1), _rng(a[2], 1, EXTEND_PROMPT), _rng(a[3], 1, MAX_NEW_TOKENS),
                      _opt(a[4], 1, STOP_AT), extends=_rng(a[0], 0, EXTEND_HANDLES - 1))
    if kind == "submit_turn":
        return Submit(_rng(a[1], 0, FAMILIES - 1), _rng(a[2], 1, TURN_PROMPT), _rng(a[3], 1, MAX_NEW_TOKENS),
                      _opt(a[4], 1, STOP_AT), session=_rng(a[0], 0, SESSION_HANDLES - 1))
    if kind == "abort":
        return Abort(_opt(a[0], 0, ABORT_HANDLES - 1))
    if kind == "close_session":
        return CloseSession(_rng(a[0], 0, SESSION_HANDLES - 1))
    if kind == "transfer_fail":
        return TransferFail(_opt(a[0], 0, TRANSFER_HANDLES - 1))
    if kind == "step":
        return Step(_rng(a[0], 1, STEP_N))
    return {"health_check": HealthCheck, "flush_cache": FlushCache, "idle": Idle, "memory_pressure": MemoryPressure,
            "open_session": OpenSession}[kind]()


def program_from_bytes(data: bytes, config: EngineConfig, max_ops: int = 24) -> list[Op]:
    """Decode ``data`` into a valid program for ``config`` (see the module docstring for the layout).

    Total and deterministic: every byte string, ``b""`` included, gives a program of at most
    ``max_ops`` decoded ops plus a final ``idle()`` (added unless the last decoded op is ``idle``).
    """
    kinds = op_kinds(config)
    mp = max_prompt(config)
    ops: list[Op] = []
    data = bytes(data)
    for start in range(0, min(len(data), max(0, max_ops) * RECORD), RECORD):
        rec = data[start:start + RECORD].ljust(RECORD, b"\x00")
        ops.append(_decode(kinds[rec[0] % len(kinds)], rec[1:], mp))
    if not ops or not isinstance(ops[-1], Idle):
        ops.append(Idle())
    return ops


def _in(v, lo: int, hi: int, what: str) -> int:
    if v is None or not lo <= v <= hi:
        raise ValueError(f"{what}={v!r} is outside {lo}..{hi}")
    return v - lo


def _nin(v, lo: int, hi: int, what: str) -> int:
    return 0 if v is None else (_in(v, lo, hi, what) << 1) | 1


def _encode(op: Op, kinds: tuple[str, ...], mp: int) -> bytes:
    if isinstance(op, Submit):
        if op.session is not None and op.extends is not None:
            raise ValueError("a submit with both session and extends has no byte encoding")
        tail = [_in(op.max_new_tokens, 1, MAX_NEW_TOKENS, "max_new_tokens"), _nin(op.stop_at, 1, STOP_AT, "stop_at")]
        family = _in(op.family, 0, FAMILIES - 1, "family")
        if op.session is not None:
            kind = "submit_turn"
            args = [_in(op.session, 0, SESSION_HANDLES - 1, "session"), family,
                    _in(op.prompt_len, 1, TURN_PROMPT, "prompt_len")] + tail
        elif op.extends is not None:
            kind = "submit_extending"
            args = [_in(op.extends, 0, EXTEND_HANDLES - 1, "extends"), family,
                    _in(op.prompt_len, 1, EXTEND_PROMPT, "prompt_len")] + tail
        else:
            kind, args = "submit", [family, _in(op.prompt_len, 1, mp, "prompt_len")] + tail
    elif isinstance(op, Abort):
        kind, args = "abort", [_nin(op.handle, 0, ABORT_HANDLES - 1, "handle")]
    elif isinstance(op, CloseSession):
        kind, args = "close_session", [_in(op.handle, 0, SESSION_HANDLES - 1, "handle")]
    elif isinstance(op, TransferFail):
        kind, args = "transfer_fail", [_nin(op.handle, 0, TRANSFER_HANDLES - 1, "handle")]
    elif isinstance(op, Step):
        kind, args = "step", [_in(op.n, 1, STEP_N, "n")]
    else:
        kind, args = op.kind, []
    if kind not in kinds:
        raise ValueError(f"op {kind} is not decoded for this config (its ops: {', '.join(kinds)})")
    return bytes([kinds.index(kind)] + args + [0] * (ARG_BYTES - len(args)))


def program_to_bytes(program: list[Op], config: EngineConfig) -> bytes:
    """The bytes that :func:`program_from_bytes` decodes back into ``program`` (with a final ``idle()``
    appended when ``program`` does not end with one): one :data:`RECORD`-byte record per op, unused
    argument bytes zero. Raises ``ValueError`` for an op or argument the decoder cannot produce for
    ``config`` (a session op without sessions, a prompt longer than its range, ...). Programs longer
    than the decoder's ``max_ops`` are encoded whole; decode them with a larger ``max_ops``."""
    kinds = op_kinds(config)
    mp = max_prompt(config)
    out = bytearray()
    for i, op in enumerate(program):
        try:
            out += _encode(op, kinds, mp)
        except ValueError as e:
            raise ValueError(f"op {i} ({op.kind}): {e}") from None
    return bytes(out)


# --- seed corpora ---------------------------------------------------------------------------------

def hand_seeds(config: EngineConfig) -> list[list[Op]]:
    """A few short programs every corpus starts from (each decodable for ``config``)."""
    seeds = [[Submit(0, 4, 2), Idle()], [HealthCheck(), Idle()], [Submit(0, 4, 4), Step(1), Abort(0), Idle()],
             [Submit(1, 8, 3), Submit(1, 12, 2, stop_at=1), Step(2), Abort(None), Idle(), FlushCache(), Idle()]]
    if not config.disable_radix_cache:
        seeds.append([Submit(2, 6, 2), Idle(), Submit(2, 4, 2, extends=0), MemoryPressure(), Idle()])
    if config.enable_streaming_session:
        seeds.append([OpenSession(), Submit(0, 4, 2, session=0), Step(1), CloseSession(0), Idle()])
    if "transfer_fail" in program_features(config):
        seeds.append([Submit(0, 8, 3), Submit(1, 6, 2), Step(1), TransferFail(1), Step(1), TransferFail(0), Idle()])
    return seeds


def seed_programs(preset: str, regressions_dir: str) -> list[tuple[str, list[Op], EngineConfig]]:
    """``(name, program, config)`` of every seed for ``preset``: the programs of the regression
    reproducers in ``regressions_dir`` whose ``config.preset`` is ``preset``, then :func:`hand_seeds`."""
    from engine_under_test import get_preset
    from kvaudit.replay import load

    out = []
    if os.path.isdir(regressions_dir):
        for name in sorted(os.listdir(regressions_dir)):
            if not name.endswith(".json"):
                continue
            config, program, _, _ = load(os.path.join(regressions_dir, name))
            if config.preset == preset:
                out.append((f"regression-{name[:-5]}", program, config))
    config = get_preset(preset).config()
    out += [(f"hand-{i}", p, config) for i, p in enumerate(hand_seeds(config))]
    return out


def write_seeds(out_dir: str, regressions_dir: str) -> list[str]:
    """Write ``out_dir/<preset>/<name>-<sha1[:8]>`` for every preset (stale files of those directories
    are removed first; an input already written for the preset under another name is skipped);
    returns the paths written."""
    from engine_under_test import PRESETS

    written = []
    for preset in PRESETS:
        d = os.path.join(out_dir, preset)
        os.makedirs(d, exist_ok=True)
        for old in os.listdir(d):
            os.unlink(os.path.join(d, old))
        seen = set()
        for name, program, config in seed_programs(preset, regressions_dir):
            data = program_to_bytes(program, config)
            if data in seen:
                continue
            seen.add(data)
            path = os.path.join(d, f"{name}-{hashlib.sha1(data).hexdigest()[:8]}")
            with open(path, "wb") as fh:
                fh.write(data)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not argv or argv[0] != "--write-seeds" or len(argv) > 2:
        print("usage: python -m kvaudit.bytes_program --write-seeds [DIR]  (default DIR: corpora/seeds of this "
              "checkout)", file=sys.stderr)
        return 2
    out = argv[1] if len(argv) == 2 else os.path.join(root, "corpora", "seeds")
    paths = write_seeds(out, os.path.join(root, "corpora", "regressions"))
    print(f"wrote {len(paths)} seed inputs under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

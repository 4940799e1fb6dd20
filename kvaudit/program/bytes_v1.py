"""Version 1 of the byte decoder, frozen: the layout docs/reference/byte-layout.md documents.

Its constants and op kinds are its own, not the schema's, so every version 1 input (the shipped
seeds, libFuzzer corpora written before version 2) keeps its program: ``tests/data/
bytes_v1_programs.json`` pins the programs of the seeds and of fixed random inputs. Do not change.
"""

from __future__ import annotations

from kvaudit.program.ops import (Abort, CloseSession, FlushCache, HealthCheck, Idle, MemoryPressure, Op, OpenSession,
                                 Step, Submit, TransferFail)
from kvaudit.program.schema import max_prompt as _max_prompt

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


def max_prompt(config) -> int:
    """The longest plain prompt (tokens) the decoder emits for ``config``: as in the Hypothesis search."""
    return _max_prompt(config.context_len)


def op_kinds(config) -> tuple[str, ...]:
    """The op kinds meaningful for ``config``, in opcode order (``opcode % len(...)`` indexes it)."""
    kinds = _BASE
    if not config.disable_radix_cache:
        kinds += _RADIX
    if config.enable_streaming_session:
        kinds += _SESSIONS
    from kvaudit.targets import program_features

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


def decode(data: bytes, config, max_ops: int = 24) -> list[Op]:
    """Decode ``data`` into a valid program for ``config`` (docs/reference/byte-layout.md, version 1).

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


def encode(program: list[Op], config) -> bytes:
    """The bytes that :func:`decode` decodes back into ``program`` (with a final ``idle()``
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


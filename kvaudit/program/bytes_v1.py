"""Version 1 of the byte decoder, frozen: the layout docs/reference/byte-layout.md documents. Its
constants and op kinds are its own, not the schema's, so every version 1 input keeps its program
(``tests/data/bytes_v1_programs.json`` pins them). Do not change.
"""

from __future__ import annotations

from kvaudit.program.ops import OP_TYPES, Op, Submit
from kvaudit.program.schema import max_prompt as _max_prompt
from kvaudit.targets import program_features

RECORD = 6  # bytes per op: 1 opcode + 5 argument bytes
ARG_BYTES = RECORD - 1

_BASE = ("submit", "health_check", "abort", "flush_cache", "step", "idle")
_RADIX = ("submit_extending", "memory_pressure")
_SESSIONS = ("open_session", "submit_turn", "close_session")
_PD = ("transfer_fail",)

# the argument bytes of each record kind: (argument, lo, hi, optional) in byte order; hi None: max_prompt.
# A kind not here has no arguments; the submit kinds make a Submit.
_TAIL = (("max_new_tokens", 1, 12, False), ("stop_at", 1, 12, True))
_LAYOUT = {
    "submit": (("family", 0, 7, False), ("prompt_len", 1, None, False)) + _TAIL,
    "submit_extending": (("extends", 0, 7, False), ("family", 0, 7, False), ("prompt_len", 1, 16, False)) + _TAIL,
    "submit_turn": (("session", 0, 3, False), ("family", 0, 7, False), ("prompt_len", 1, 48, False)) + _TAIL,
    "abort": (("handle", 0, 7, True),),
    "close_session": (("handle", 0, 3, False),),
    "transfer_fail": (("handle", 0, 3, True),),
    "step": (("n", 1, 4, False),),
}


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
    if "transfer_fail" in program_features(config):
        kinds += _PD
    return kinds


def arg_from_byte(b: int, lo: int, hi: int, optional: bool, unset=None):
    """Argument byte ``b`` as a value of ``lo..hi``; an optional argument is ``unset`` for an even byte."""
    if not optional:
        return lo + b % (hi - lo + 1)
    return unset if b % 2 == 0 else lo + (b >> 1) % (hi - lo + 1)


def arg_to_byte(v, lo: int, hi: int, optional: bool, name: str, unset=None) -> int:
    """The byte :func:`arg_from_byte` reads back as ``v``; ``ValueError`` when ``v`` is outside ``lo..hi``."""
    if optional and v == unset:
        return 0
    if v is None or not lo <= v <= hi:
        raise ValueError(f"{name}={v!r} is outside {lo}..{hi}")
    return ((v - lo) << 1) | 1 if optional else v - lo


def records(data: bytes, size: int, max_ops: int):
    """The first ``max_ops`` records of ``size`` bytes of ``data``, a short last one padded with zeros."""
    for start in range(0, min(len(data), max(0, max_ops) * size), size):
        yield data[start:start + size].ljust(size, b"\x00")


def encode_each(program: list[Op], encode_op) -> bytes:
    """``encode_op(op)`` of every op, joined; its ``ValueError`` says which op."""
    out = bytearray()
    for i, op in enumerate(program):
        try:
            out += encode_op(op)
        except ValueError as e:
            raise ValueError(f"op {i} ({op.kind}): {e}") from None
    return bytes(out)


def decode(data: bytes, config, max_ops: int = 24) -> list[Op]:
    """The ops of ``data`` for ``config`` (version 1; at most ``max_ops``, no final ``idle()`` added)."""
    kinds, mp = op_kinds(config), max_prompt(config)
    ops: list[Op] = []
    for rec in records(bytes(data), RECORD, max_ops):
        kind = kinds[rec[0] % len(kinds)]
        layout = _LAYOUT.get(kind, ())
        args = {name: arg_from_byte(b, lo, hi or mp, opt) for b, (name, lo, hi, opt) in zip(rec[1:], layout)}
        ops.append(Submit(**args) if kind.startswith("submit") else OP_TYPES[kind](**args))
    return ops


def _encode(op: Op, kinds: tuple[str, ...], mp: int) -> bytes:
    kind = op.kind
    if isinstance(op, Submit):
        if op.session is not None and op.extends is not None:
            raise ValueError("a submit with both session and extends has no byte encoding")
        kind = "submit_turn" if op.session is not None else "submit_extending" if op.extends is not None else "submit"
    args = [arg_to_byte(getattr(op, name), lo, hi or mp, opt, name) for name, lo, hi, opt in _LAYOUT.get(kind, ())]
    if kind not in kinds:
        raise ValueError(f"op {kind} is not decoded for this config (its ops: {', '.join(kinds)})")
    return bytes([kinds.index(kind)] + args + [0] * (ARG_BYTES - len(args)))


def encode(program: list[Op], config) -> bytes:
    """The version 1 bytes of ``program`` (see :func:`kvaudit.program.bytes_program.program_to_bytes`)."""
    kinds, mp = op_kinds(config), max_prompt(config)
    return encode_each(program, lambda op: _encode(op, kinds, mp))

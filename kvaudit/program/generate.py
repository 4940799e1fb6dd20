"""The generators' shared part: an op from the schema's arguments, whatever draws them (the random
baseline here, the Hypothesis rules, the version 2 byte decoder), and the random baseline itself.

Design notes: docs/internals/program.md#generation.
"""

from __future__ import annotations

from kvaudit.program.ops import Idle, Op, op_type
from kvaudit.program.schema import CAPABILITIES, OPS, arg_range, kinds, reachable, resolve


def make_op(kind: str, values: dict, reach: frozenset, max_prompt: int) -> Op:
    """The op ``kind`` with ``values`` (every argument, each a set value in its range or unset)
    resolved by :func:`kvaudit.program.schema.resolve` for ``reach`` and ``max_prompt`` (tokens)."""
    return op_type(kind)(**resolve(kind, values, reach, max_prompt))


def _draw_value(rng, arg, max_prompt: int):
    if arg.p < 1.0 and rng.random() >= arg.p:
        return arg.unset
    lo, hi = arg_range(arg, max_prompt)
    return rng.randint(lo, hi)


def random_op(rng, reach: frozenset, max_prompt: int, table: tuple[str, ...] | None = None) -> Op:
    """One op drawn by ``rng`` (a ``random.Random``): its kind from ``table`` (a weighted list of kinds;
    default :func:`weighted_kinds`), each argument set with probability :attr:`Arg.p`, else unset."""
    table = table or weighted_kinds(reach)
    kind = table[rng.randrange(len(table))]
    values = {a.name: _draw_value(rng, a, max_prompt) if reachable(a.gate, reach) else a.unset
              for a in OPS[kind].args}
    return make_op(kind, values, reach, max_prompt)


def weighted_kinds(reach: frozenset) -> tuple[str, ...]:
    """The op kinds of ``reach``, each repeated :attr:`OpSpec.weight` times (the random mix)."""
    return tuple(k for k in kinds(reach) for _ in range(OPS[k].weight))


def random_program(rng, length: int, max_prompt: int = 32, features: frozenset = frozenset()) -> list[Op]:
    """A random program of ``length`` ops from ``rng`` (a ``random.Random``), ending in ``idle``: the
    plain random baseline (a fixed op mix). It draws every op and argument whose gate is in ``features``
    (a config's ``program_features``) or is a capability (a target without them ignores them)."""
    reach = frozenset(features) | frozenset(CAPABILITIES)
    table = weighted_kinds(reach)
    ops: list[Op] = [random_op(rng, reach, max_prompt, table) for _ in range(max(0, length - 1))]
    ops.append(Idle())
    return ops

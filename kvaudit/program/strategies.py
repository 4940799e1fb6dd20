"""Hypothesis strategies of op arguments, read from the schema (imports hypothesis: the search only).

:func:`arg_strategies` gives one strategy per argument of an op kind; the rules of
:func:`kvaudit.search.fuzz._machine` draw them and build the op with
:func:`kvaudit.program.generate.make_op`, as the other generators do. An optional argument shrinks
to unset (its default, or None) first, an always-drawn one to the low end of its range.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvaudit.program.schema import OPS, arg_range, reachable


def arg_strategy(a, reach: frozenset, max_prompt: int, pinned: bool = False) -> st.SearchStrategy:
    """The strategy of argument ``a`` (a :class:`kvaudit.program.schema.Arg`): ``just(unset)`` when its
    gate is out of ``reach``; a set value (``lo..hi``) when it is drawn always or ``pinned``; else
    either."""
    if not reachable(a.gate, reach):
        return st.just(a.unset)
    lo, hi = arg_range(a, max_prompt)
    values = st.integers(lo, hi)
    return values if a.p >= 1.0 or pinned else st.just(a.unset) | values


def arg_strategies(kind: str, reach: frozenset, max_prompt: int, pinned: tuple[str, ...] = ()) -> dict:
    """``{name: strategy}`` of every argument of op ``kind``; those named in ``pinned`` are always set
    (a rule for extending submits pins ``extends``)."""
    return {a.name: arg_strategy(a, reach, max_prompt, a.name in pinned) for a in OPS[kind].args}

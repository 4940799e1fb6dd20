"""Hypothesis strategies of op arguments, read from the schema (imports hypothesis: the search only).
An optional argument shrinks to unset first, an always-drawn one to the low end of its range."""

from __future__ import annotations

from hypothesis import strategies as st

from kvaudit.program.schema import OPS, arg_range, reachable


def arg_strategy(a, reach: frozenset, max_prompt: int, pinned: bool = False) -> st.SearchStrategy:
    """The strategy of argument ``a`` (a :class:`kvaudit.program.schema.Arg`): ``just(unset)`` when its
    gate is out of ``reach``; a set value (``lo..hi``) when it is drawn always or ``pinned``; else either."""
    if not reachable(a.gate, reach):
        return st.just(a.unset)
    lo, hi = arg_range(a, max_prompt)
    values = st.integers(lo, hi)
    return values if a.p >= 1.0 or pinned else st.just(a.unset) | values


def arg_strategies(kind: str, reach: frozenset, max_prompt: int, pinned: tuple[str, ...] = ()) -> dict:
    """``{name: strategy}`` of every argument of op ``kind``; those in ``pinned`` are always set."""
    return {a.name: arg_strategy(a, reach, max_prompt, a.name in pinned) for a in OPS[kind].args}

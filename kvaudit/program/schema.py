"""The op schema: one table (:data:`OPS`) of every op's arguments, read by the ops, the generators, the
byte decoder and the minimizer; and the request a client builds from a ``submit`` op.

Design notes (what each field of a row means, what derives from a row): docs/internals/program.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

from kvaudit.targets import program_features
from kvaudit.targets.registry import kind_of

FEATURES = ("priority", "grammar", "flush_timeout", "session_params", "transfer_fail")  # what only some targets model
CAPABILITIES = ("sessions", "prefix_cache")  # read from any config: streaming sessions, a radix cache
MAX_ARG = 10_000  # no op argument needs more; step(n=10**12) would never return
PROMPT = -1  # ``Arg.hi`` placeholder: the generator's max_prompt (tokens)
PAUSE_MODES = ("abort", "in_place", "retract")  # PauseGenerationReqInput.mode, in SGLang's order


@dataclass(frozen=True)
class Arg:
    """One argument of an op; the fields: docs/internals/program.md#arguments."""

    name: str
    default: int | None
    lo: int = 0
    hi: int = 0
    nullable: bool = False
    p: float = 1.0
    gate: str | None = None
    requires: str | None = None
    caps: tuple[tuple[str, int], ...] = ()
    limit: int = MAX_ARG
    late: bool = False
    simplest: int | None | str = "default"  # what the minimizer pulls a set value toward

    @property
    def toward(self) -> int | None:
        return self.default if self.simplest == "default" else self.simplest

    @property
    def unset(self) -> int | None:
        return None if self.nullable else self.default


@dataclass(frozen=True)
class OpSpec:
    """One op kind: its arguments in field order, its gate, its weight in the random mix, its swarm group
    ("": its own kind; None: in every case), whether it can end a state the oracles see (``ends``: it
    releases, evicts or flushes at the next intake, so a search's sparse schedule checks what the steps
    before it left, :class:`kvaudit.audit.runner.AuditedRun`) and its docstring
    (docs/internals/program.md#op-kinds)."""

    kind: str
    args: tuple[Arg, ...] = ()
    gate: str | None = None
    weight: int = 1
    swarm: str | None = ""
    ends: bool = False
    doc: str = field(default="", repr=False)
    arg: dict = field(default=None, compare=False, repr=False)  # name -> Arg, filled in __post_init__

    def __post_init__(self):
        object.__setattr__(self, "arg", {a.name: a for a in self.args})
        if self.swarm == "":
            object.__setattr__(self, "swarm", self.kind)


_SESSION_PARAM = dict(gate="session_params", requires="session", late=True)

OPS: dict[str, OpSpec] = {s.kind: s for s in (
    OpSpec("submit", weight=33, args=(
        Arg("family", 0, 0, 7),  # prefix family: prompts of one family share their leading tokens
        Arg("prompt_len", 4, 1, PROMPT, caps=(("extends", 16), ("session", 48))),  # tokens
        Arg("max_new_tokens", 4, 1, 12),  # tokens
        Arg("stop_at", None, 1, 12, nullable=True, p=1 / 3),  # output length at which EOS is sampled
        Arg("session", None, 0, 3, nullable=True, p=1 / 3, gate="sessions"),  # open session handle
        Arg("extends", None, 0, 7, nullable=True, p=1 / 6, gate="prefix_cache"),  # submitted request handle
        Arg("priority", None, 0, 9, nullable=True, p=1 / 2, gate="priority", late=True),
        Arg("ignore_eos", 0, 1, 1, p=1 / 4, requires="stop_at", limit=1, late=True),
        Arg("grammar", None, 0, 6, nullable=True, p=1 / 4, gate="grammar", late=True),  # compile steps
        Arg("parent", None, 0, 3, nullable=True, p=1 / 4, **_SESSION_PARAM),  # the session's turn
        Arg("replace", 0, 1, 1, p=1 / 8, limit=1, **_SESSION_PARAM),
        Arg("drop_previous_output", 0, 1, 1, p=1 / 8, limit=1, **_SESSION_PARAM),
        Arg("offset", None, 0, 24, nullable=True, p=1 / 8, **_SESSION_PARAM),  # token of the history
    ), doc="A generate request (its arguments: docs/internals/program.md#submit)."),
    OpSpec("health_check", weight=8,
           doc="SGLang's ``/health_generate``: runs as a 1-token request only when the engine is idle."),
    OpSpec("abort", weight=9, ends=True, args=(Arg("handle", 0, 0, 7, nullable=True, p=1 / 2),),
           doc="Abort live request ``handle`` (modulo the live set), or every request if ``handle`` is None."),
    OpSpec("flush_cache", weight=3, ends=True, args=(Arg("timeout", 0, 1, 8, p=1 / 3, gate="flush_timeout", late=True),),
           doc="SGLang's ``/flush_cache`` when idle; ``timeout``: steps a busy engine is waited for."),
    OpSpec("open_session", weight=4, gate="sessions", swarm="sessions",
           doc="Open a streaming session (a no-op on an engine without them)."),
    OpSpec("close_session", weight=3, gate="sessions", swarm="sessions", ends=True, args=(Arg("handle", 0, 0, 3),),
           doc="Close open session ``handle`` (modulo the open ones); deferred while its turn is in flight."),
    OpSpec("memory_pressure", weight=2, gate="prefix_cache", ends=True,
           doc="Another tenant needs device memory: evictable KV evicted, all running requests but one retracted."),
    # NOTE: the minimizer pulls a pause toward in_place: a pause that moves no memory
    OpSpec("pause_generation", weight=2, swarm="pause", ends=True,
           args=(Arg("mode", 0, 0, len(PAUSE_MODES) - 1, limit=len(PAUSE_MODES) - 1, simplest=1),),
           doc="SGLang's ``/pause_generation`` (``Scheduler.pause_generation``), ``mode`` indexing ``PAUSE_MODES``."),
    OpSpec("continue_generation", weight=2, swarm="pause",
           doc="SGLang's ``/continue_generation``: the scheduler runs again and the held requests are sent."),
    # NOTE: a failed transfer ends requests as an abort does
    OpSpec("transfer_fail", weight=4, gate="transfer_fail", swarm="abort", ends=True,
           args=(Arg("handle", 0, 0, 3, nullable=True, p=2 / 3),),
           doc="PD (decode or prefill): the KV transfer of request ``handle`` (or of every one: None) fails "
               "(``KVPoll.Failed``)."),
    OpSpec("step", weight=20, swarm=None, args=(Arg("n", 1, 1, 4),), doc="``n`` scheduler iterations."),
    OpSpec("idle", weight=10, swarm=None,
           doc="Run the engine to quiescence (a paused one is resumed first), then the idle checks."),
)}

# NOTE: Hypothesis draws a case's swarm as a set sampled from swarm_groups(), so the groups' order is part
# of what a seed means: these keep the order they were drawn in before the groups were read from OPS, and
# a group not named here follows them, in OPS order
_SWARM_ORDER = ("submit", "health_check", "abort", "flush_cache", "memory_pressure", "sessions", "pause")


def swarm_groups() -> tuple[str, ...]:
    """The swarm groups of :data:`OPS` (every ``OpSpec.swarm`` but None), each once, read when a search
    starts (so a new row is drawn with no other table changed)."""
    groups = dict.fromkeys(s.swarm for s in OPS.values() if s.swarm is not None)
    return tuple(g for g in _SWARM_ORDER if g in groups) + tuple(g for g in groups if g not in _SWARM_ORDER)


def optional_defaults() -> dict[str, int | None]:
    """``{name: default}`` of the arguments a minimized program drops when they make no difference:
    the gated ones (a submit's ``session`` and ``extends``) and every late one."""
    return {a.name: a.default for s in OPS.values() for a in s.args if a.late or a.gate in CAPABILITIES}


def reachable(gate: str | None, reach: frozenset) -> bool:
    return gate is None or gate in reach


def capabilities(config) -> frozenset[str]:
    """Which of :data:`CAPABILITIES` the target of ``config`` has (its kind's ``capabilities``)."""
    return frozenset(kind_of(config).capabilities(config)) & frozenset(CAPABILITIES)


def reach(config) -> frozenset[str]:
    """What of :data:`FEATURES` (``program_features``) and :data:`CAPABILITIES` (:func:`capabilities`)
    the target of ``config`` models: what the Hypothesis search and the byte decoder draw (the random and
    corpus searches draw every capability)."""
    return frozenset(program_features(config)) | capabilities(config)


def kinds(reach: frozenset) -> tuple[str, ...]:
    """The op kinds drawn for ``reach``, in :data:`OPS` order."""
    return tuple(k for k, s in OPS.items() if reachable(s.gate, reach))


def max_prompt(context_len: int) -> int:
    """The longest plain prompt (tokens) the generators draw for a context of ``context_len`` tokens:
    long prompts from 8 families fill a 512-slot pool in a few submits, so eviction and admission
    under pressure are reached."""
    return max(2, min(96, context_len - 12))


def arg_range(a: Arg, max_prompt: int) -> tuple[int, int]:
    """``(lo, hi)`` of a set value of ``a``, :data:`PROMPT` resolved to ``max_prompt``."""
    return a.lo, (max_prompt if a.hi == PROMPT else a.hi)


def resolve(kind: str, values: dict, reach: frozenset, max_prompt: int) -> dict:
    """``values`` (each argument of ``kind`` drawn independently, a set value in its range) made a
    program's arguments: an argument whose gate is out of ``reach`` or whose ``requires`` is unset
    goes back to unset; a capped argument is folded into its cap while the capping argument is set.
    Returns a new dict; raises ``KeyError`` for a missing argument."""
    spec = OPS[kind]
    out = dict(values)
    for a in spec.args:
        if not reachable(a.gate, reach):
            out[a.name] = a.unset
    for a in spec.args:
        if a.requires is not None and out[a.requires] == spec.arg[a.requires].unset:
            out[a.name] = a.unset
        for other, cap in a.caps:
            if out[other] is not None and out[a.name] is not None:
                lo, hi = arg_range(a, max_prompt)
                cap = max(lo, min(cap, hi))
                out[a.name] = lo + (out[a.name] - lo) % (cap - lo + 1)
                break
    return out


# --- building a client's request from an op -------------------------------------------------------

def prompt_tokens(family: int, length: int, vocab_size: int = 128) -> list[int]:
    """The prompt of ``family`` truncated to ``length`` tokens (ids in ``[2, vocab_size)``: 0 is pad,
    1 is EOS). Prompts of one family share their leading tokens, so a radix cache sees prefix hits."""
    span = vocab_size - 2
    return [2 + ((family + 1) * 131 + i * 17 + (i * i) % 5) % span for i in range(length)]


def pick(handle: int | None, items: Sequence):
    """``items[handle % len(items)]``: how every op names a request or session (modulo the live
    ones), so any handle is valid; None when ``handle`` is None or ``items`` is empty."""
    return items[handle % len(items)] if handle is not None and items else None


class SubmitRequest(NamedTuple):
    """A ``submit`` op as a client sends it: ``input_ids`` (``[n]`` token ids, the resent history
    first for an extending submit), ``max_new_tokens`` (tokens), ``stop_at`` (output length at which
    EOS is sampled, or None), ``session`` (the picked open session, or None)."""

    input_ids: list[int]
    max_new_tokens: int
    stop_at: int | None
    session: object


def resolve_submit(op, vocab_size: int, max_new_cap: int, prompt_cap: int | Callable[[int], int],
                   submitted: Sequence = (), text_of: Callable | None = None, sessions: Sequence = ()) -> SubmitRequest:
    """The request of submit ``op``: ``max_new_tokens`` clamped to ``1..max_new_cap``, the prompt of
    ``op.family`` clamped to ``1..cap`` tokens where ``cap`` is ``prompt_cap`` (or
    ``prompt_cap(max_new)``), an extending submit's prompt preceded by ``text_of(picked request)``
    (prompt + output so far of ``pick(op.extends, submitted)``) and truncated to ``cap`` tokens, and
    the session ``pick(op.session, sessions)``. ``stop_at`` is passed as the op holds it.

    The targets' limits: the built-in engine (``kvaudit/targets/eut/target.py``) ``max_new_cap =
    context_len // 2``, ``prompt_cap = context_len - max_new``; the real-SGLang driver
    (``kvaudit/targets/sglang/intake.py``) ``context_len // 4`` and ``context_len // 2``."""
    max_new = max(1, min(op.max_new_tokens, max_new_cap))
    cap = prompt_cap(max_new) if callable(prompt_cap) else prompt_cap
    prompt = prompt_tokens(op.family, max(1, min(op.prompt_len, cap)), vocab_size)
    base = pick(op.extends, submitted)
    if base is not None:
        prompt = (list(text_of(base)) + prompt)[:cap]
    return SubmitRequest(prompt, max_new, op.stop_at, pick(op.session, sessions))

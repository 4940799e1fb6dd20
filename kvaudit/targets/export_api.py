"""What a target kind hands ``kvaudit export``: its engine's HTTP API, the engine's pieces of a client
script and of an issue text, its server launch and the rules a client follows there.

A kind whose engine has a server provides an :class:`EngineExport` from its own package
(``kvaudit/targets/<kind>/export.py``) through its :class:`kvaudit.targets.registry.TargetKind`'s
``export`` field; :mod:`kvaudit.export` reads nothing else about an engine, and never names one.
Plain data and callables over the kind's own config: nothing here imports :mod:`kvaudit.export`
(which sits above the target kinds, docs/architecture.md), so a hook that takes a plan or a call
reads only their attributes (``plan.calls``, ``call.kind``, ``call.args``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple


class ApiCall(NamedTuple):
    """How one op kind is sent: ``method`` and ``path`` (``None``: no HTTP call), ``body`` (the JSON
    fields set, in words), ``exact`` (a client reproduces the op as the program means it) and
    ``note`` (what a client cannot force, and the approximation the script makes)."""

    method: str | None
    path: str | None
    body: str
    exact: bool
    note: str = ""


class EngineApi(NamedTuple):
    """One engine's table: ``engine`` (its name as its project spells it: ``"SGLang"``), ``version``
    checked, ``sources`` read, ``calls`` per op kind, ``metrics`` (the gauges the client prints before
    and after, with the flag that enables them)."""

    engine: str
    version: str
    sources: tuple[str, ...]
    calls: dict[str, ApiCall]
    metrics: tuple[str, ...]
    metrics_flag: str


@dataclass(frozen=True)
class ClientParts:
    """The engine's part of a client script (Python source text, spliced verbatim): ``api`` (the
    ``Client`` methods for its routes), ``funcs`` (``engine_args``, ``server_line``, ``pool_findings``),
    ``url`` (the server's default URL), ``settle`` (seconds the gauges may take to settle), ``busy``
    (the gauges that say a request runs or waits), ``settle_gauge``/``settle_why``, ``metrics_hint``
    (how to get ``/metrics``), ``imports`` (extra import lines), ``consts`` (extra constant lines),
    ``init`` (lines added to ``Client.__init__``), ``server_keys`` (a ``SERVER_KEYS = [...]`` line, or
    "")."""

    api: str
    funcs: str
    url: str
    settle: float
    busy: tuple[str, ...]
    settle_gauge: str
    settle_why: str
    metrics_hint: str
    imports: str = ""
    consts: tuple[str, ...] = ()
    init: str = ""
    server_keys: str = ""


def _no_lines(*_a) -> list[str]:
    return []


def _none(*_a):
    return None


@dataclass(frozen=True)
class IssueParts:
    """The engine's words in an issue text. ``environment(config)``: the Environment bullet's tail
    after the preset (the pool's size). ``launch_notes(config, env)``: bullets about the launch's
    environment variables; ``server_notes(config)``: bullets about the server the launch needs (after
    the release's). ``program_note``: appended to the ops' legend. ``exact``: the paragraph for a
    client that maps every op one to one; ``approximates``: what else a client cannot do, after "pace
    the scheduler step by step". ``call_text(call)``: the line for a call the engine says its own way,
    None: the table's. ``driver``: whose order kvaudit's driver calls the engine in; ``seen_how``: what
    kvaudit drove, after "own memory manager and scheduler objects". ``model(config)``: the model the
    launch needs, after "Launch the server as above (" (default: any model)."""

    environment: Callable[[object], str]
    exact: str
    approximates: str
    driver: str
    seen_how: str
    launch_notes: Callable[[object, list[str]], list[str]] = _no_lines
    server_notes: Callable[[object], list[str]] = _no_lines
    program_note: str = ""
    call_text: Callable[[object], str | None] = _none
    model: Callable[[object], str] = lambda _config: "any model"


def planted_faults(faults: Mapping[str, tuple[str, str]]) -> Callable[[object], str | None]:
    """An :attr:`EngineExport.planted` for a kind whose ``bugs`` are faults it injects (every name a
    real engine's config takes): ``--bug NAME: what it does`` per name (``faults[name][1]``, as ``kvaudit
    bugs`` lists it), or None when the config names none (a finding in the engine as shipped)."""
    def planted(config) -> str | None:
        bugs = sorted(getattr(config, "bugs", ()) or ())
        return "; ".join(f"--bug {b}: {faults[b][1]}" if b in faults else f"--bug {b}" for b in bugs) or None
    return planted


def launch_line(command: str, flag_line: Callable) -> Callable:
    """An :attr:`EngineExport.launch`: ``(command flags..., env, unmapped)`` from ``flag_line(config)``'s
    ``(flags, env, unmapped)``."""
    def launch(config) -> tuple[str, list[str], list[str]]:
        flags, env, unmapped = flag_line(config)
        return " ".join([command] + flags), env, unmapped
    return launch


def _keep_env(_config, _program, _kind, env: list[str]) -> list[str]:
    return env


def _no_sizes(_config) -> tuple[int | None, int | None]:
    return None, None


def _no_consts(_config) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class EngineExport:
    """What ``kvaudit export`` needs of one engine.

    ``api``: its HTTP table. ``package``: the installed package (``pip install PACKAGE==VERSION``, the
    root engine frames are shown relative to, the corpus folder of its analyses). ``client`` and
    ``issue``: its parts of the client script and the issue text. ``launch(config)``: ``(command, env,
    unmapped)``, the server launch for a replay ``config``, its environment variables and the config
    fields no flag sets. ``expected_pool``: what a client sees when the pool does not come back.

    Optional: ``launch_env(config, program, finding_kind, env)`` the launch's environment for this
    program and finding (default: ``env``); ``planted(config)`` the injected faults ``config`` names,
    described as ``kvaudit bugs`` lists them, or None (a finding in the engine as shipped; the default,
    :func:`planted_faults` without descriptions: any name in ``bugs`` is planted);
    ``client_sizes(config)`` ``(pool_blocks, max_model_len)`` the script checks against (None: not
    used); ``client_consts(config)``: lines ``NAME = value`` of the script that its engine part reads for
    ``config`` (how a call is sent on this config: vLLM's ``RESET_RUNNING``; default none); ``batch_submits``: submits of one scheduler intake with the same session go in one request
    (else one streaming request per submit, ``same_step_note`` saying what a client cannot promise
    then); ``ignored_ops``: op kinds the target ignores (the script sends nothing); ``deferred_flush``:
    the engine takes a flush's timeout (else a deferred flush is sent at once, as the target does);
    ``remote_of(config, n)``: which side of a P/D pair the ``n``-th submit (from 0) is on
    (``"prefill"``, ``"decode"`` or None), with ``remote_notes[side]`` the line the report gives it;
    ``curl(plan, url)``: the plan as ``curl`` lines (None: the engine has none, the script is the
    reproducer); ``routes_also_checked``: release -> the engine files of that older release read for
    the routes the client uses; ``trace_views(target)``: ``(live, answered, sessions)``, three
    callables reading a built target's request ids and open sessions for
    :func:`kvaudit.export.trace.trace`, or None when the target does not expose them;
    ``unseen_pool(pool)``: for a finding pool (``Finding.pool``) whose units the script's ``/metrics``
    gauges do not count, one sentence naming the pool and what a maintainer can do instead (a memory
    finding there ends NOT CHECKED, exit 3); None for a pool the gauges count (default: every pool);
    ``unsent(config, program)``: one sentence naming what of ``program`` (a list of ops) no client can send
    on ``config``, though the finding may need it (a vLLM streaming-input session), or None (default): the
    script then never says NOT REPRODUCED, it ends NOT CHECKED (exit 3).
    """

    api: EngineApi
    package: str
    client: ClientParts
    issue: IssueParts
    launch: Callable[[object], tuple[str, list[str], list[str]]]
    expected_pool: str
    launch_env: Callable = _keep_env
    planted: Callable[[object], str | None] = planted_faults({})
    client_sizes: Callable[[object], tuple[int | None, int | None]] = _no_sizes
    client_consts: Callable[[object], tuple[str, ...]] = _no_consts
    batch_submits: bool = False
    same_step_note: str = ""
    ignored_ops: tuple[str, ...] = ()
    deferred_flush: bool = False
    remote_of: Callable[[object, int], str | None] = _none
    remote_notes: Mapping[str, str] = field(default_factory=dict)
    curl: Callable | None = None
    routes_also_checked: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    trace_views: Callable = _none
    unseen_pool: Callable[[str], str | None] = _none
    unsent: Callable[[object, list], str | None] = _none

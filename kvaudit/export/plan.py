"""A program as the HTTP calls a client makes, in the program's order (:func:`plan`), by the rules of
the engine's target kind (:class:`kvaudit.targets.export_api.EngineExport`).
Design notes: docs/internals/export.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvaudit.export.http_api import export_for
from kvaudit.export.trace import Trace
from kvaudit.program import (PAUSE_MODES, Abort, CloseSession, ContinueGeneration, FlushCache, HealthCheck, Idle,
                             MemoryPressure, Op, OpenSession, PauseGeneration, Step, Submit, TransferFail, format_op)
from kvaudit.program.schema import pick, resolve_submit
from kvaudit.targets.registry import kind_of


@dataclass
class GenItem:
    """One request of a ``/generate`` call: ``op`` index, ``rid`` (the program's id, e.g. ``r1``),
    ``input_ids`` (``[n]`` token ids), ``max_new_tokens`` (tokens, after the target's clamp or the
    program's EOS), ``hold`` (it must still run when a later message arrives)."""

    op: int
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    hold: bool = False
    notes: list[str] = field(default_factory=list)
    remote: str | None = None  # a P/D pair's other side: "prefill" (do_remote_prefill) | "decode" (do_remote_decode)


@dataclass
class Call:
    """One client action: ``kind`` (``open_session``, ``generate``, ``abort``, ``close_session``,
    ``flush_cache``, ``health``, ``pause``, ``continue``, ``wait``, ``idle``, ``no_api``, ``ignored``),
    the ``ops`` it stands for, its ``args``; ``exact`` is False where a client only approximates them."""

    kind: str
    ops: list[int]
    args: dict
    exact: bool = True
    note: str = ""


@dataclass
class Plan:
    """The calls in order, the ops' printed form, whether handles were resolved on the target
    (``traced``), and the session ids left open at the end."""

    calls: list[Call]
    op_lines: list[str]
    traced: bool
    open_at_end: list[str]
    engine: str  # the kind whose HTTP table the calls follow (a replay config's target)
    config: object = None  # the replay config the calls reproduce (what an engine's curl lines send beside them)

    @property
    def exact(self) -> bool:
        """Every call reproduces its op exactly, no request is held or needs a prefill server, and, untraced,
        no message follows a request (whether it must still run then is unknown)."""
        return all(c.exact for c in self.calls) and not self._unknown_holds and not any(
            i.hold or i.remote == "prefill" for c in self.calls for i in c.args.get("items", ()))

    @property
    def _unknown_holds(self) -> bool:
        # untraced: a generate followed by a message (not a wait) may need its request still running
        firsts = [k for k, c in enumerate(self.calls) if c.kind == "generate"]
        return not self.traced and bool(firsts) and any(
            c.kind not in ("wait", "idle", "no_api", "ignored") for c in self.calls[firsts[0] + 1:])

    @property
    def approximations(self) -> list[str]:
        out = ["handles not resolved on the target (--no-resolve, or the engine not installed): which request "
               "must still be decoding when a later message arrives is not known, so none is held "
               "(--hold-tokens)"] if self._unknown_holds else []
        for c in self.calls:
            if not c.exact:
                out.append(f"op {', '.join(map(str, c.ops))} ({c.kind}): {c.note}")
            for i in c.args.get("items", ()):
                out += [f"op {i.op} (submit {i.rid}): {n}" for n in i.notes]
        return out


def _session_params(op: Submit, sid: str, turns: list[str]) -> dict:
    """The ``session_params`` of a session turn: its id and the fields the op sets (unset ones left out)."""
    sp = {"id": sid, "rid": pick(op.parent, turns), "offset": op.offset, "replace": bool(op.replace) or None,
          "drop_previous_output": bool(op.drop_previous_output) or None}
    return {k: v for k, v in sp.items() if v is not None}


def _item(config, ex, op: Submit, i: int, rid: str, submitted: list[str], texts: dict) -> GenItem:
    """The request of submit op ``i``, with notes on what a client sends differently."""
    req = resolve_submit(op, config.vocab_size, config.context_len // 4, config.context_len // 2, submitted,
                         lambda base: texts.get(base, []))
    item = GenItem(i, rid, req.input_ids, req.max_new_tokens)
    base = pick(op.extends, submitted)
    if base is not None:
        item.notes.append(f"extends {base}: the prompt resends {base}'s prompt only; the program also "
                          "resends its output so far, which is the model's on a real server")
    item.remote = ex.remote_of(config, len(submitted))
    if item.remote is not None:
        item.notes.append(ex.remote_notes[item.remote])
    if op.stop_at is not None and op.stop_at < req.max_new_tokens and not op.ignore_eos:
        item.max_new_tokens = op.stop_at
        item.notes.append(f"the program samples EOS at output length {op.stop_at}: the script asks for "
                          f"max_new_tokens={op.stop_at} (a length finish, not an EOS one)")
    return item


def _op_calls(ex, engine: str, op: Op, i: int, v, live: list[str], sessions: list[str]) -> list[Call]:
    """The calls of op ``i`` (none for a close or an abort with nothing to name); ``v``: its trace view or
    None; a close removes its id from ``sessions``."""
    api = ex.api
    if isinstance(op, CloseSession):
        if not sessions:
            return []
        sid = sessions[op.handle % len(sessions)]
        sessions.remove(sid)
        return [Call("close_session", [i], {"session": sid})]
    if isinstance(op, Abort):
        if op.handle is None:
            done = [r for r in live if v is not None and r in v.answered]
            return [Call("abort", [i], {"rid": None}, exact=not done,
                         note=f"{', '.join(done)} already answered (a KV connector holds the blocks while "
                              "the KV is sent): no connection left to close" if done else "")]
        if not live:
            return []
        rid = pick(op.handle, live)
        done = v is not None and rid in v.answered
        return [Call("abort", [i], {"rid": rid}, exact=not done,
                     note=f"{rid} has already answered (a KV connector holds its blocks while its KV "
                          "is sent): it has no connection left to close" if done else "")]
    if isinstance(op, FlushCache):
        return [Call("flush_cache", [i], {"timeout": op.timeout}, exact=op.timeout == 0 or not ex.deferred_flush,
                     note=api.calls["flush_cache"].note)]
    if isinstance(op, PauseGeneration):
        return [Call("pause", [i], {"mode": PAUSE_MODES[op.mode]})]
    if isinstance(op, ContinueGeneration):
        return [Call("continue", [i], {})]
    if isinstance(op, (MemoryPressure, TransferFail)):
        return [Call("no_api", [i], {"op": format_op(op)}, exact=False, note=api.calls[op.kind].note)]
    if isinstance(op, Step):
        return [Call("wait", [i], {"steps": op.n}, exact=False, note=api.calls["step"].note)]
    if isinstance(op, Idle):
        return [Call("idle", [i], {})]
    # NOTE: a new op of the schema: how a client sends it is the engine's to say, not a silent gap
    raise ValueError(f"op {i} ({op.kind}): no client call is known for this op on {engine} "
                     "(add it to kvaudit/export/plan.py and to the engine's HTTP table, or to its ignored_ops)")


def plan(config, program: list[Op], tr: Trace | None = None) -> Plan:
    """The client calls for ``program`` on a server launched as ``config`` says. ``tr``: the program's
    trace on the target (None: handles resolved statically). Request lengths are clamped as the SGLang
    and vLLM targets clamp them (prompt ``context_len // 2`` tokens, output ``context_len // 4``).
    Raises ``KeyError`` for a target with no HTTP table, ``ValueError`` naming an op with no call."""
    engine = kind_of(config).name
    ex = export_for(engine)
    api, batch = ex.api, ex.batch_submits
    views = {v.index: v for v in tr.views} if tr is not None else {}
    calls: list[Call] = []
    sessions: list[str] = []  # static resolution (the same rule as the target's intake)
    turns: dict[str, list[str]] = {}
    submitted: list[str] = []
    texts: dict[str, list[int]] = {}
    n = 0  # the target's request counter (health checks use a number too)
    opened = 0
    last_generate: Call | None = None  # the open batch of this intake, if the previous op was a submit
    for i, op in enumerate(program):
        v = views.get(i)
        if tr is not None and v is None:
            break  # the engine raised before this op: nothing after it ran
        live = list(v.live) if v is not None else list(submitted)
        if v is not None:
            sessions = list(v.sessions)
        if isinstance(op, Submit):
            rid = (v.rid if v is not None and v.rid else f"r{n}")
            n += 1
            item = _item(config, ex, op, i, rid, submitted, texts)
            sid = pick(op.session, sessions)
            sp = _session_params(op, sid, turns.setdefault(sid, [])) if sid is not None else None
            if sid is not None:
                turns[sid].append(rid)
            submitted.append(rid)
            texts[rid] = list(item.input_ids)
            if last_generate is not None and last_generate.args["session_params"] == sp and batch:
                last_generate.args["items"].append(item)
                last_generate.ops.append(i)
            else:
                same_step = not batch and bool(calls) and calls[-1].kind == "generate" and last_generate is not None
                last_generate = Call("generate", [i], {"session_params": sp, "items": [item]}, exact=not same_step,
                                     note=ex.same_step_note if same_step else "")
                calls.append(last_generate)
            continue
        last_generate = None
        if op.kind in ex.ignored_ops:
            calls.append(Call("ignored", [i], {"op": format_op(op)}, note=api.calls[op.kind].note))
        elif isinstance(op, OpenSession):
            sid = f"s{opened}"
            opened += 1
            sessions.append(sid)  # (a trace's next view says the same)
            calls.append(Call("open_session", [i], {"session": sid, "streaming": config.session_streaming,
                                                    "timeout": config.session_timeout_steps}))
        elif isinstance(op, HealthCheck):
            n += 1
            calls.append(Call("health", [i], {}))
        else:
            calls += _op_calls(ex, engine, op, i, v, live, sessions)
    _mark_holds(calls, tr, same_intake_submits=batch)
    # NOTE: a wait matters only where a later message must find the engine at a given step
    for k, c in enumerate(calls):
        if c.kind == "wait" and not any(x.kind not in ("wait", "idle") for x in calls[k + 1:]):
            c.exact, c.note = True, "the program's last step: the script waits and then looks"
    return Plan(calls, [format_op(op) for op in program], tr is not None, list(sessions), engine, config)


def _mark_holds(calls: list[Call], tr: Trace | None, same_intake_submits: bool = True) -> None:
    """Mark each request the trace shows still live when a later message (not a wait) is sent: a client
    must keep it running until then. With ``same_intake_submits`` False, a later submit of the same
    intake does not count (a longer output would change which request finishes first)."""
    if tr is None:
        return
    views = {v.index: v for v in tr.views}
    for k, c in enumerate(calls):
        for item in c.args.get("items", ()):
            later, waited = [], False
            for x in calls[k + 1:]:
                waited = waited or x.kind in ("wait", "idle")
                if x.kind in ("wait", "idle", "no_api", "ignored"):
                    continue
                if x.kind == "generate" and not waited and not same_intake_submits:
                    continue
                later.append(x)
            if any(item.rid in views[x.ops[0]].live and item.rid not in views[x.ops[0]].answered
                   for x in later if x.ops[0] in views):
                item.hold = True
                item.notes.append(f"still running at a later message in the program (max_new_tokens="
                                  f"{item.max_new_tokens}): the script asks for --hold-tokens more so that it "
                                  "is still decoding when that message arrives")

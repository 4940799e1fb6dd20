"""``kvaudit export --client``: a standalone script (standard library only) that drives a real server
through its HTTP API in the program's order and says what a maintainer should see: a crash, a hang, or
the pool gauges of ``/metrics`` before and after.
Design notes: docs/internals/export.md.
"""

from __future__ import annotations

import importlib.resources
import re

from kvaudit.audit.kinds import lookup
from kvaudit.config import shown_controls
from kvaudit.export.http_api import export_for
from kvaudit.export.plan import Call, Plan

# the script's lines for a call of each kind that is one method call with the call's args and note
_ONE_CALL = {"open_session": "c.open_session({session!r}, streaming={streaming!r}, timeout={timeout!r}, "
                             "label={label!r})",
             "close_session": "c.close_session({session!r}, label={label!r})",
             "abort": "c.abort({rid!r}, label={label!r})",
             "flush_cache": "c.flush_cache({timeout}, label={label!r})", "health": "c.health(label={label!r})",
             "pause": "c.pause({mode!r}, label={label!r})", "continue": "c.resume(label={label!r})",
             "idle": "c.idle(label={label!r})",
             "ignored": "# nothing to send: {note}\n    c.ignored({op!r}, {note!r}, label={label!r})",
             "no_api": "# NOT FORCED BY A CLIENT: {note}\n    c.no_api({op!r}, {note!r}, label={label!r})"}


def _template_parts() -> dict[str, str]:
    """The parts of ``kvaudit/templates/client.py.in``, each the text after its ``#@ NAME`` line."""
    text = (importlib.resources.files("kvaudit") / "templates" / "client.py.in").read_text()
    bits = re.split(r"^#@ (\w+)$", text, flags=re.M)
    return dict(zip(bits[1::2], bits[2::2]))


_PARTS = _template_parts()
IMPORTS, CORE, CORE_TAIL, MAIN = (_PARTS[k] for k in ("IMPORTS", "CORE", "CORE_TAIL", "MAIN"))


def _call_line(c: Call, plan: Plan) -> list[str]:
    ops = c.ops
    comment = [f"    # op {i}: {plan.op_lines[i]}" for i in ops]
    label = f"op {ops[0]}" if len(ops) == 1 else f"ops {ops[0]}-{ops[-1]}"
    a = c.args
    if c.kind == "generate" and not export_for(plan.engine).batch_submits:  # one streaming request per submit
        (it,) = a["items"]
        comment += [f"    # {it.rid}: {n}" for n in it.notes]
        return comment + [f"    c.submit({it.rid!r}, {it.input_ids!r}, {it.max_new_tokens}, {it.hold!r}, "
                          f"remote={it.remote!r}, label={label!r})"]
    if c.kind == "generate":
        items = a["items"]
        if len(items) > 1:
            comment.append(f"    # -> ONE batched /generate: the program delivers these {len(items)} submits at one "
                           "intake, so they reach the scheduler in one message and are admitted together")
        for it in items:
            comment += [f"    # {it.rid}: {n}" for n in it.notes]
        body = ",\n".join(f"        ({it.rid!r}, {it.input_ids!r}, {it.max_new_tokens}, {it.hold!r})" for it in items)
        return comment + [f"    c.generate([\n{body},\n    ], session_params={a['session_params']!r}, "
                          f"label={label!r})"]
    if c.kind in _ONE_CALL:
        return comment + ["    " + _ONE_CALL[c.kind].format(**a, label=label, note=c.note)]
    if c.kind == "wait":
        note = [] if c.exact else ["    # (approximate: a client cannot run the scheduler step by step)"]
        return comment + note + [f"    c.wait({a['steps']}, label={label!r})"]
    raise ValueError(f"unknown call kind {c.kind!r}")


def expected_line(kind: str, server: str, engine: str, unseen: str | None = None) -> str:
    """What a maintainer should see, for the finding ``kind`` on ``engine`` (a kind's name), in one line:
    the kind's ``symptom`` (:mod:`kvaudit.audit.kinds`), else the engine's pool line; for a memory kind
    whose pool the gauges do not count (``unseen``: ``EngineExport.unseen_pool``'s sentence), that the
    script cannot see it. Raises ``KeyError`` for an engine with no HTTP table."""
    pool = export_for(engine).expected_pool
    row = lookup(kind)
    if unseen is not None and row.expect == "memory":
        return (f"{server or 'units lost from a pool'} -- which this script cannot see ({unseen}), so it ends "
                "RESULT: NOT CHECKED (exit 3)")
    return (row.symptom or pool) + (f" -- {server}" if server else "")


def unjudged(expect: str, unseen: str | None = None) -> bool:
    """Whether the client never judges its symptom: a wrong answer (``expect == "output"``), or a memory finding
    in a pool the gauges do not count (``unseen``: ``EngineExport.unseen_pool``'s sentence)."""
    return expect == "output" or (expect == "memory" and unseen is not None)


def results_lines(expect: str, unseen: str | None = None, unsent: str | None = None) -> list[str]:
    """The script's RESULT lines and exit codes, as its docstring (and ``--help``) lists them, for a finding
    whose client ``expect`` s (``crash``, ``hang``, ``memory``, ``output``) in a pool the gauges count
    (``unseen`` None) or not, of a program a client can send (``unsent`` None) or not."""
    blind = unjudged(expect, unseen) or unsent is not None
    why = ("a wrong answer, which this script does not judge" if expect == "output" else
           "the finding's pool is not in /metrics" if unjudged(expect, unseen) else
           "the program cannot be sent as written (see NOTE)" if blind else "")
    return ["RESULT lines and exit codes:",
            "  REPRODUCED      exit 1: the symptom was seen (or the server failed)",
            "  NOT REPRODUCED  exit 0: the program ran as written and nothing abnormal was seen" +
            (" (never printed here: see NOT CHECKED)" if blind else ""),
            "  NOT CHECKED     exit 3: the server refused a call or did not answer in time, or /metrics did not",
            "                  answer, so the program did not run as written or was not judged" +
            (f"; and always when nothing else is seen: {why}" if blind else ""),
            "  (no RESULT)     exit 2: no server answers, or bad arguments"]


def _docstring(text: str) -> str:
    """``text`` (a title quoting a finding's message, a file name) as a docstring that reads as ``text``: its
    backslashes and triple quotes escaped, so that none ends the string or makes an escape (``\\N``, ``\\x``), and
    its control characters shown (:func:`kvaudit.config.shown_controls`; a NUL is no Python source)."""
    return '"""' + shown_controls(text).replace("\\", "\\\\").replace('"""', '\\"\\"\\"') + '"""'


def render_client(plan: Plan, *, title: str, source: str, launch: str, kind: str, server: str,
                  env: list[str], hold_tokens: int = 256, planted: str | None = None,
                  pool_blocks: int | None = None, max_model_len: int | None = None,
                  release: str | None = None, unseen: str | None = None, unsent: str | None = None,
                  engine_consts: tuple[str, ...] = ()) -> str:
    """The script's text for ``plan``: ``source`` (the replay file), ``launch`` (the server command),
    ``kind`` (the first finding's), ``server`` (what a server shows), ``env`` (variables the launch
    needs), ``planted`` (kvaudit's planted fault, or None), ``pool_blocks`` (vLLM: the pool's usable
    blocks), ``max_model_len`` (tokens, prompt + output, a held request's cap: vLLM's max_model_len, SGLang's
    --context-length), ``release`` (the release, with why it
    is named, e.g. "0.16.0 (the release that ships the bug)", when not the one the routes were read on),
    ``unseen`` (``EngineExport.unseen_pool``'s sentence for the finding's pool, or None), ``unsent``
    (``EngineExport.unsent``'s sentence: what of the program no client can send, or None), ``engine_consts``
    (``EngineExport.client_consts``' lines for the finding's config). Raises
    ``KeyError`` for an engine with no HTTP table."""
    ex = export_for(plan.engine)
    api, part = ex.api, ex.client
    expect = lookup(kind).expect
    approx = plan.approximations
    how = "exactly" if plan.exact else "approximately (see the NOTE lines it prints)"
    expected = expected_line(kind, server, plan.engine, unseen)
    doc = [f'"""{title}', ""]
    if planted is not None:
        doc += ["PLANTED FAULT, NOT A BUG OF " + api.engine.upper() + ": kvaudit injected it into " + api.engine +
                "'s own objects", f"to test itself ({planted}).",
                f"An unmodified {api.engine} server does not have it: against one, this script should print",
                ("RESULT: NOT CHECKED (exit 3: a wrong answer is not judged here)" if expect == "output" else
                 "RESULT: NOT CHECKED (exit 3: the pool is not in /metrics)" if unjudged(expect, unseen) else
                 "RESULT: NOT CHECKED (exit 3: the program cannot be sent as written)" if unsent else
                 "RESULT: NOT REPRODUCED") + ". It shows what `kvaudit export` makes of a finding.", ""]
    version = api.version if release is None else release
    doc += [f"Reproduces kvaudit's finding in {source} against a real {api.engine} {version} server, "
            f"through its HTTP API only ({how}).", "",
            "1. Launch the server:", "", f"       {' '.join(env + [launch])}", "",
            f"2. Run:  python3 THIS_FILE --url {part.url}", "",
            f"Expected: {expected}.", "", *results_lines(expect, unseen, unsent), "",
            "Standard library only; generated by `kvaudit export` (do not edit: regenerate).", '"""']
    consts = [f"EXPECT = {expect!r}", f"EXPECTED = {expected!r}", f"EXACT = {plan.exact!r}",
              f"HOLD_TOKENS = {hold_tokens}", f"OPEN_AT_END = {plan.open_at_end!r}",
              f"METRICS = {list(api.metrics)!r}", f"BUSY = {list(part.busy)!r}",
              f"SETTLE_GAUGE = {part.settle_gauge!r}", f"SETTLE_WHY = {part.settle_why!r}",
              f"SETTLE_S = {part.settle!r}", f"METRICS_HINT = {part.metrics_hint!r}",
              f"DEFAULT_URL = {part.url!r}", f"UNSEEN = {unseen!r}", f"UNSENT = {unsent!r}"]
    if part.server_keys:
        consts.append(part.server_keys)
    consts += list(part.consts) + list(engine_consts)
    if pool_blocks is not None:
        consts.append(f"POOL_BLOCKS = {pool_blocks}")
    if max_model_len is not None:
        consts.append(f"MAX_MODEL_LEN = {max_model_len}")
    consts.append("APPROXIMATIONS = [" + "".join(f"\n    {a!r}," for a in approx) + ("\n]" if approx else "]"))
    body = ["", "", "def program(c):", '    """The program, one call per op (a batch for submits of one intake)."""']
    for call in plan.calls:
        body += _call_line(call, plan)
    if not plan.calls:
        body.append("    pass")
    core = CORE.replace("        self.lock = threading.Lock()\n",
                        "        self.lock = threading.Lock()\n" + part.init)
    return ("#!/usr/bin/env python3\n" + _docstring("\n".join(doc)[3:-3]) + "\n" + IMPORTS + part.imports + "\n\n" +
            "\n".join(consts) + "\n\n" + core + part.api + CORE_TAIL + "\n" + "\n".join(body) + "\n" +
            part.funcs + MAIN)


def curl_lines(plan: Plan, url: str | None = None) -> list[str]:
    """The plan as ``curl`` commands (against ``url``, default the engine's) when a client runs it exactly
    with one call at a time; [] otherwise, and for an engine whose kind gives no curl lines."""
    ex = export_for(plan.engine)
    if ex.curl is None or not plan.exact or any(c.kind in ("wait", "idle") for c in plan.calls[:-1]) or \
            any(c.kind in ("health", "no_api") for c in plan.calls):
        return []
    return ex.curl(plan, url or ex.client.url)

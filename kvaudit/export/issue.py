"""``kvaudit export --issue``: a Markdown bug report for an engine's tracker, from a replay file.
Design notes: docs/internals/export.md.
"""

from __future__ import annotations

import json
import os
import shlex

from kvaudit.audit.findings import Finding
from kvaudit.audit.kinds import lookup
from kvaudit.export.client import curl_lines
from kvaudit.export.http_api import export_for
from kvaudit.export.notes import Note
from kvaudit.export.plan import Plan
from kvaudit.reports.sarif import engine_path, finding_stacks
from kvaudit.targets.registry import kind_of

SECTIONS = ("## Environment", "## What happens", "## Minimized program", "## Reproduce with a client",
            "## kvaudit report", "## Why this is a defect", "## Suggested fix", "## How sure we are")


def _frame(site, package: str) -> str:
    rel = engine_path(site.file, package)
    mark = "" if rel is not None else "   [kvaudit's driver, in the scheduler's place]"
    src = f"\n          {site.source.strip()}" if site.source else ""
    return f"    {rel or site.file}:{site.line} in {site.function}{mark}{src}"


def _finding(f: Finding, package: str) -> list[str]:
    out = [f"### {f.kind}" + (f" in `{f.pool}`" if f.pool != "-" else ""), "", f"- signature: `{f.signature}`",
           f"- seen at op {f.op_index}, scheduler step {f.step}: {f.message}"]
    if f.num_units:
        ids = f.listed()[1]  # rows, blocks (a "blocks" pool's ids) or token slots
        shown = ", ".join(map(str, ids[:16])) + (" ..." if len(ids) > 16 else "")
        out.append(f"- {f.num_units} page(s), slots {shown}" if f.unit == "page" and len(f.slots) != f.num_units
                   else f"- {f.num_units} {f.unit}(s): {shown}")
    if f.used_by:
        out.append(f"- still used by: {', '.join(f.used_by)}")
    if f.engine_check:
        out.append("- the engine's own memory check said: " + "; ".join(f.engine_check[:3]))
    for label, frames in finding_stacks(f):
        out += ["", f"{label} (innermost first):", "", "```"] + [_frame(s, package) for s in frames] + ["```"]
    return out + [""]


def title_of(findings: list[Finding], note: Note | None) -> str:
    """The report's title: the note's, else the first finding's kind and innermost function, and its message on
    one line (a crash's exception message can span several)."""
    if note is not None:
        return note.title
    if not findings:
        return "kvaudit: a program with no recorded finding"
    f = findings[0]
    fn = next((s.function for _, frames in finding_stacks(f) for s in frames), "?")
    return f"{f.kind} in {f.pool} at {fn}: {_clipped(' '.join(f.message.split()), 80)}"  # (one line: a heading)


def _clipped(text: str, width: int) -> str:
    """``text`` cut at the last word boundary within ``width`` characters (inside a word when that boundary
    would keep less than half), with ``...`` when cut."""
    if len(text) <= width:
        return text
    cut = text[:width - 3]
    at_word = cut.rsplit(" ", 1)[0].rstrip(" ,;:(")
    return (at_word if len(at_word) >= width // 2 else cut) + "..."  # (a long unbroken token: cut inside it)


# a client call's kind -> the op whose HTTP call it makes
_CALL_OP = {"generate": "submit", "health": "health_check", "pause": "pause_generation",
            "continue": "continue_generation", "wait": "step", "ignored": "-"}


def _call_line(c, api, words) -> str:
    call = api.calls.get(_CALL_OP.get(c.kind, c.kind))
    what = f"{call.method} {call.path}" if call is not None and call.method else "(no HTTP call)"
    if c.kind == "generate":
        items = c.args["items"]
        sp = c.args["session_params"]
        what += (f" with {len(items)} inputs in one request" if len(items) > 1 else "") + \
            (f", session_params={json.dumps(sp)}" if sp else "") + ": " + ", ".join(
            f"{i.rid} ({len(i.input_ids)} prompt tokens, max_new_tokens={i.max_new_tokens}"
            f"{' + hold' if i.hold else ''})" for i in items)
    elif c.kind == "wait":
        what = f"wait (stands for {c.args['steps']} scheduler step(s))"
    elif c.kind == "ignored":
        what = f"nothing sent for `{c.args['op']}` ({c.note})"
    elif words.call_text(c) is not None:
        what = words.call_text(c)
    elif c.kind == "idle":
        what = "wait until every request has answered and none runs or queues (polls GET /metrics)"
    elif c.args:
        what += " " + ", ".join(f"{k}={v}" for k, v in c.args.items() if k != "op" and v is not None)
    return f"- op {', '.join(map(str, c.ops))}: {what}"


def _environment(ex, config, version: str, launch: str, env: list[str], unmapped: list[str],
                 release: tuple | None) -> list[str]:
    api, words = ex.api, ex.issue
    out = ["## Environment", "",
           f"- {api.engine} {version} (`pip install {ex.package}=={version}`), kvaudit preset "
           f"`{config.preset}`, " + words.environment(config),
           "- The server launch this preset corresponds to:", "", "```",
           " ".join(env + [launch]), "```", "",
           "- Not set by a flag (kvaudit's driver sets them; a server picks its own): " + "; ".join(unmapped) + "."]
    out += words.launch_notes(config, env)
    if release is not None:
        checked = ex.routes_also_checked.get(release[0])
        out.append(f"- The client's routes and request fields were read on {api.engine} {api.version}" +
                   (f" and found the same in {release[0]}'s own sources ({', '.join(f'`{f}`' for f in checked)})."
                    if checked else f"; {release[0]}'s were not checked."))
    return out + words.server_notes(config)


def _unjudged(findings: list[Finding]) -> bool:
    """Whether the client cannot judge the finding's symptom (a wrong answer: ``expect == "output"``)."""
    return bool(findings) and lookup(findings[0].kind).expect == "output"


def _reproduce(ex, config, plan: Plan, note: Note | None, client_name: str | None, version: str,
               expected: str, judged: bool = True, unseen: str | None = None,
               unsent: str | None = None) -> list[str]:
    api, words = ex.api, ex.issue
    out = ["## Reproduce with a client", ""]
    why = ("the finding's pool is not among the `/metrics` gauges (see Expected)." if unseen is not None else
           "a wrong answer is not something the script judges; compare its answers with the same prompts sent alone."
           if not judged else f"{unsent}.")
    judged = judged and unseen is None and unsent is None
    curls = curl_lines(plan)
    curl_hint = "; or the curl lines below" if curls else ""
    if client_name is not None:
        out += [f"1. Launch the server as above ({words.model(config)}; {api.engine} {version}).",
                f"2. `python3 {client_name} --url {ex.client.url}` (standard library only){curl_hint}.", "",
                f"Expected: {note.server if note is not None and unseen is None else expected}. The script prints "
                "every call and answer, the `/metrics` pool counters before and after, and `RESULT: REPRODUCED` "
                "(exit 1), " + ("`NOT REPRODUCED` (exit 0) or `NOT CHECKED` (exit 3: a call was refused or not "
                                "answered in time, or `/metrics` did not answer)." if judged else
                                f"or else `NOT CHECKED` (exit 3): {why}"), ""]
    else:
        out += ["(Export with `kvaudit export FILE --client OUT.py` for the script.)", ""]
    if curls:
        out += ["The same by hand (each call waits for its answer; the last one never gets a normal answer if the "
                "bug fires):", "", "```sh"] + curls + ["```", ""]
    if plan.exact:
        out += [words.exact + (" It cannot see this finding's pool, though (see Expected)." if unseen else ""), ""]
    else:
        out += ["The client only approximates the program (a client cannot pace the scheduler step by step" +
                words.approximates + "):", ""] + [f"- {a}" for a in plan.approximations] + [""]
    return out + ["The calls, in order:", ""] + [_call_line(c, api, words) for c in plan.calls]


def _how_sure(ex, doc: dict, plan: Plan, version: str, source: str, planted: str | None,
              release: tuple | None, triaged: bool = True, note: Note | None = None) -> list[str]:
    """The "How sure we are" lines; ``triaged``: a note of the signature is recorded (else a line says the
    finding is not yet shown to be the engine's rather than kvaudit's driver's, and to triage it first);
    ``note``: its analysis, whose own confidence and driver differences (``sure``, ``driver``) come first."""
    api, package = ex.api, ex.package
    return ["## How sure we are", "",
            *([f"- {note.sure[:1].upper()}{note.sure[1:]}."] if note is not None and note.sure else []),
            *([f"- Where kvaudit's driver could differ from a server on this path: {note.driver}."]
              if note is not None and note.driver else []),
            f"- Seen: kvaudit drove {api.engine} {version}'s own memory manager and scheduler objects "
            f"{ex.issue.seen_how}; the finding replays deterministically "
            f"({doc.get('confirmations', 'not recorded')}).",
            "- Not verified: on a full server with a model and a GPU, and with the client script above (no GPU "
            "server ran here; the script was checked against a stand-in HTTP server that records the requests).",
            "- The client " + ("maps every op one to one." if plan.exact else
                               "approximates step-level timing or memory pressure (listed above): a server "
                               "run may need a few tries or tuning (--step-delay, --hold-tokens)."),
            *(["- Planted: the fault exists only under kvaudit's `--bug` switch; a real server should not show it."]
              if planted is not None else []),
            *([f"- Not triaged: no analysis of this signature is recorded (`corpora/{package}/notes.toml`), so it "
               f"is not yet shown to be {api.engine}'s defect rather than one of kvaudit's driver or stand-ins; "
               "triage it before filing."] if not triaged and planted is None else []),
            f"- Replay: `kvaudit replay {shlex.quote(source)}`." if release is None else
            f"- Replay on {api.engine} {release[0]} (" + (
                "the release the file was recorded on" if doc.get("engine_version") == release[0] or release[1] is None
                else "the file does not name the release") +
            (f"; on {release[1]} it replays clean" if release[1] is not None else "") +
            f"): `python -m kvaudit.history.releases {package}=={release[0]}` installs it as an overlay, then "
            f"`PYTHONPATH=~/.cache/kvaudit/releases/{package}-{release[0]} kvaudit replay {shlex.quote(source)}`."]


def render_issue(*, config, title: str, program_lines: list[str], findings: list[Finding], doc: dict, plan: Plan,
                 note: Note | None, source: str, client_name: str | None, launch: str, env: list[str],
                 unmapped: list[str], expected: str, planted: str | None = None,
                 release: tuple | None = None, unseen: str | None = None, unsent: str | None = None) -> str:
    """The Markdown text (:data:`SECTIONS`). ``title``: :func:`title_of`, marked when planted; ``source``:
    the replay file's path; ``client_name``: the script's file name (None: not exported);
    ``launch``/``env``/``unmapped``: from ``EngineExport.launch``; ``expected``: the client's symptom line;
    ``planted``: kvaudit's planted fault, or None; ``release``: ``(buggy, fixed, sources)`` for a bug of an
    older release (the history suite's), ``(recorded, None, ())`` for a file recorded on another release than
    the one the HTTP table was read on (its ``engine_version``), else None; ``unseen``: the sentence for a
    finding pool the script's gauges do not count (``EngineExport.unseen_pool``), or None; ``unsent``: what of
    the program no client can send (``EngineExport.unsent``), or None."""
    ex = export_for(kind_of(config).name)
    api, package, words = ex.api, ex.package, ex.issue
    out = [f"# {title}", ""]
    if planted is not None:
        out += [f"> **This is a planted fault, not a bug of {api.engine}.** kvaudit injected it into {api.engine}'s "
                f"own objects through its wrappers to test itself ({planted}). An unmodified {api.engine} "
                f"{api.version} does not have it, and the client script below is expected to print "
                f"`RESULT: {'NOT CHECKED' if _unjudged(findings) or unseen or unsent else 'NOT REPRODUCED'}` against a real server. The report is a demonstration of `kvaudit export` on a "
                f"{api.engine} finding; do not file it.", ""]
    version = api.version if release is None else release[0]
    found_on = (f"in {api.engine} {api.version}" if release is None else
                f"in {api.engine} {release[0]}, the release the replay file was recorded on" if release[1] is None else
                f"in {api.engine} {release[0]}, the release that ships this bug (fixed in {release[1]}: "
                f"{', '.join(release[2])})")
    out += [f"Found by kvaudit (a memory auditor for KV-cache schedulers) {found_on}; replay "
            f"file `{os.path.basename(source)}` ({'minimized, ' if doc.get('minimized') else ''}confirmed "
            f"{doc.get('confirmations', '?')} by deterministic replay).", ""]
    out += _environment(ex, config, version, launch, env, unmapped, release)
    kinds = ", ".join(f"{f.kind}" + (f" in {f.pool}" if f.pool != "-" else "")
                      + f" ({_clipped(f.message.splitlines()[0], 160)})"
                      for f in findings) or "no finding recorded"
    out += ["", "## What happens", "", f"kvaudit reports: {kinds}.", ""]
    if note is not None:
        out += [f"On a server: {note.server}.", ""]
        if note.reach:
            out += [f"How a server gets there from client requests: {note.reach}.", ""]
    out += ["## Minimized program", "",
            "kvaudit's ops, numbered as the findings name them (`submit` is a generate request of `prompt_len` "
            "tokens and `max_new_tokens` output tokens; `session=k` is the next turn of the k-th open session; "
            "`step(n=1)` is one scheduler iteration; `idle()` runs the scheduler until it is idle; handles are "
            "taken modulo the live requests or open sessions" + words.program_note + "):", "", "```"]
    out += [f"{i:>3}  {line}" for i, line in enumerate(program_lines)] + ["```", ""]
    out += _reproduce(ex, config, plan, note, client_name, version, expected, not _unjudged(findings), unseen,
                      unsent)
    out += ["", "## kvaudit report", "",
            f"Frames are the engine's own, relative to the installed package (`{package}/...`), innermost first; "
            f"frames under `kvaudit/` are kvaudit's driver, which calls {api.engine}'s functions in the "
            f"{words.driver}'s order.",
            ""]
    for f in findings:
        out += _finding(f, package)
    out += ["## Why this is a defect", "",
            note.why if note is not None else "(no analysis recorded for this signature yet)", "",
            "## Suggested fix", "", (note.fix or "(none known)") if note is not None else "(none recorded)", ""]
    if note is not None:
        out += [f"(Full analysis: kvaudit's `corpora/{package}/README.md`, "
                f"{'section' if release is not None and release[1] is not None else 'finding'} {note.readme}.)", ""]
    out += _how_sure(ex, doc, plan, version, source, planted, release, triaged=note is not None,
                     note=note if planted is None else None)
    return "\n".join(out) + "\n"

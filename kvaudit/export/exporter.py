"""Export one replay file: the issue report and/or the client script, written atomically."""

from __future__ import annotations

import os
from typing import NamedTuple

from kvaudit.config import json_value, shown_controls
from kvaudit.export.client import expected_line, render_client
from kvaudit.export.http_api import apis, export_for
from kvaudit.export.issue import render_issue, title_of
from kvaudit.export.notes import history_note, note_for
from kvaudit.export.plan import plan as make_plan
from kvaudit.export.trace import trace
from kvaudit.history.catalogue import BUGS
from kvaudit.program import format_op
from kvaudit.replay import NothingRecordedError, ReplayFormatError, TargetNotLoadedError, load, write_text_atomic
from kvaudit.targets.registry import kind_of


class ExportError(ValueError):
    """The replay file cannot be exported (one-line message)."""


class Exported(NamedTuple):
    """What :func:`export` wrote (None: not asked for), whether the client is exact and handles traced, and
    what of the program no client can send (``EngineExport.unsent``'s sentence, or None)."""

    issue: str | None
    client: str | None
    exact: bool
    traced: bool
    unsent: str | None = None


def history_bug(path: str, config, findings=(), version: str | None = None):
    """The :class:`kvaudit.history.catalogue.HistoryBug` a replay file under a ``history/`` folder is
    named after (``corpora/vllm/history/vllm-33377.json``); else the one catalogued bug with a fixing
    release that the first of ``findings`` is, recorded on that bug's last buggy release (``version``) with
    its preset (a known bug, already fixed, found again: a maintainer must not get it as new); or None."""
    engine = getattr(config, "target", None)
    if os.path.basename(os.path.dirname(os.path.abspath(path))) == "history":
        bug = BUGS.get(os.path.basename(path)[:-5])
        return bug if bug is not None and bug.engine == engine else None
    known = [b for b in BUGS.values() if b.engine == engine and b.fixed and b.buggy == version
             and b.preset == getattr(config, "preset", None) and findings and b.matches(findings[0])]
    return known[0] if len(known) == 1 else None


def export(path: str, issue_out: str | None = None, client_out: str | None = None, resolve: bool = True) -> Exported:
    """Read replay file ``path`` and write the Markdown report to ``issue_out`` and the client script to
    ``client_out`` (either may be None). ``resolve``: trace the program on the target to name its handles.
    Raises :class:`ExportError` for a file that is not a replay file (:class:`TargetNotLoadedError` for one whose
    target is a plugin's not loaded here, :class:`NothingRecordedError` for a run's ``--json`` written at a
    start-up interrupt), whose engine has no HTTP API or
    whose program holds an op that API has no call for; OSError when an output cannot be written."""
    try:
        config, program, findings, doc = load(path)
    except (TargetNotLoadedError, NothingRecordedError):  # (not a broken file: the caller says which, as the
        raise                                             # other readers of replay files do)
    except ReplayFormatError as e:
        raise ExportError(str(e)) from None
    target = kind_of(config).name  # (a plugin's config need not have a ``target`` field)
    try:
        ex = export_for(target)
    except KeyError:
        raise ExportError(f"{path}: target {json_value(target)} has no server to export to (the issue and the client "
                          f"reproduce on a real server's HTTP API: {', '.join(apis())})") from None
    tr = trace(config, program) if resolve else None
    try:
        plan = make_plan(config, program, tr)
    except ValueError as e:  # an op the engine's export has no call for
        raise ExportError(f"{path}: {e}") from None
    launch, env, unmapped = ex.launch(config)
    planted = ex.planted(config)
    # (an analysis is of an engine's own bug: none for a planted fault, whose signature may be a real bug's)
    note = note_for(target, [f.signature for f in findings], config.preset) if planted is None else None
    kind = findings[0].kind if findings else "leak"
    unseen = unseen_pool(ex, findings)
    unsent = ex.unsent(config, program)
    env = ex.launch_env(config, program, kind, env)
    bug = history_bug(path, config, findings, doc.get("engine_version"))
    release = None
    if bug is not None:
        release = (bug.buggy, bug.fixed, bug.sources)
        note = history_note(bug, note)
    elif doc.get("engine_version") not in (None, ex.api.version):  # recorded on another release: that one's
        release = (doc["engine_version"], None, ())
    title = title_of(findings, note)
    if planted is not None:
        title = f"[planted fault, not a {ex.api.engine} bug] " + title
    server = note.server if note is not None else ""
    pool_blocks, max_model_len = ex.client_sizes(config)
    issue_path = client_path = None
    if client_out is not None:
        why = "that ships the bug" if release is not None and release[1] is not None else \
            "the replay file was recorded on"
        client_path = write_text_atomic(client_out, render_client(
            plan, title=title, source=os.path.basename(path), launch=launch, kind=kind, server=server, env=env,
            planted=planted, pool_blocks=pool_blocks,
            release=None if release is None else f"{release[0]} (the release {why})",
            max_model_len=max_model_len, unseen=unseen, unsent=unsent, engine_consts=ex.client_consts(config)))
        os.chmod(client_path, 0o755)
    if issue_out is not None:
        text = render_issue(config=config, title=title, program_lines=[format_op(op) for op in program],
                            findings=findings, doc=doc, plan=plan, note=note, source=_shown(path),
                            client_name=os.path.basename(client_out) if client_out else None, launch=launch,
                            env=env, unmapped=unmapped, expected=expected_line(kind, server, target, unseen),
                            planted=planted, release=release, unseen=unseen, unsent=unsent)
        issue_path = write_text_atomic(issue_out, shown_controls(text))  # (a message's escape codes: shown)
    return Exported(issue_path, client_path, plan.exact, plan.traced, unsent)


def unseen_pool(ex, findings) -> str | None:
    """``ex.unseen_pool``'s sentence for the first finding's pool when no finding is in a pool the script's
    gauges count (a use-after-free in the request rows that leaves a KV leak behind is seen by the KV
    gauges); None otherwise, and with no findings."""
    pools = [f.pool for f in findings if f.pool != "-"]
    if not pools or any(ex.unseen_pool(p) is None for p in pools):
        return None
    return ex.unseen_pool(pools[0])


def _shown(path: str) -> str:
    """``path`` as the issue text names it: relative to the current directory when below it (a corpus file
    of the checkout: ``corpora/sglang/x.json``), else its name alone (an issue goes to a public tracker: no
    local directories in it)."""
    rel = os.path.relpath(path)
    return os.path.basename(path) if rel.startswith("..") else rel

"""SARIF 2.1.0 output: findings as a static-analysis log that GitHub code scanning can ingest
(:func:`to_sarif`: one rule per finding kind, one result per finding, located at the engine's own
frame, the signature as its fingerprint).
Design notes: docs/internals/reports.md.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Callable, Mapping
from urllib.parse import quote

import kvaudit
from kvaudit.audit.findings import KINDS, Finding, Site, installed, portable_path, source_path
from kvaudit.audit.kinds import lookup
from kvaudit.audit.frames import (WINDOWS_ABS, Frame, RecordedEngine, engine_path, frame_release, norm_path as _norm,
                                  resolve)
from kvaudit.config import json_value
from kvaudit.reports.ci_outputs import sarif_log
from kvaudit.targets import EngineSource, engine_source
from kvaudit.targets.registry import UnknownTargetError, get, kind_of

SRCROOT = "%SRCROOT%"
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(kvaudit.__file__)))  # what installed() compares with
FINGERPRINT_KEY = "kvauditSignature/v1"
MAX_SLOTS = 64  # units (slots, rows or blocks) listed in a result's properties; the rest are counted
BASELINE_STATES = ("new", "unchanged")  # what ``kvaudit ci`` marks (the spec also has updated, absent)
# what a result's location is (_primary): a frame code scanning can show; the finding's own frame by a path it
# cannot (no frame under the current directory); the engine code the target kind names; the kind's config class
FRAME, FRAME_ELSEWHERE, ANCHOR, CONFIG_ANCHOR = "frame", "frame-elsewhere", "anchor", "config-anchor"


def _rule(kind: str) -> dict:
    row = lookup(kind)
    short, full = row.short, row.full
    markdown = (f"**{short}.**\n\n{full}\n\n"
                "The result's stacks show where the units were allocated, freed or read (innermost "
                "frame first); its properties list the pool, the units and the op and scheduler step "
                "after which the finding was detected. Reproduce it deterministically with "
                "`kvaudit replay <replay file>`, using the replay file that the run wrote.")
    return {
        "id": kind,
        "name": row.rule,
        "shortDescription": {"text": short},
        "fullDescription": {"text": full},
        "help": {"text": f"{short}. {full} Reproduce with: kvaudit replay <replay file>.",
                 "markdown": markdown},
        "defaultConfiguration": {"level": row.level},
        "properties": {"tags": ["kvaudit", "kv-cache", *row.tags], "precision": row.precision},
    }


def rules(extra_kinds: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """One rule per kind of :data:`KINDS`, in that order, then any ``extra_kinds`` not among them."""
    kinds = list(KINDS) + [k for k in dict.fromkeys(extra_kinds) if k not in KINDS]
    return [_rule(k) for k in kinds]


def _labelled_stacks(f: Finding) -> list[tuple[str, str, list[Site]]]:
    """``(field, label, frames)`` for each non-empty stack of ``f``, in its kind's reading order."""
    row = lookup(f.kind)
    return [(key, row.stack_label(key), list(getattr(f, key))) for key in row.stacks if getattr(f, key)]


def finding_stacks(f: Finding) -> list[tuple[str, list[Site]]]:
    """The finding's recorded stacks as ``(label, frames)``, innermost frame first, in reading order,
    empty stacks left out; a label says what the frames mean for this kind (a crash's: ``raised at``)."""
    return [(label, frames) for _, label, frames in _labelled_stacks(f)]


def primary_stack(f: Finding) -> str | None:
    """Which stack field holds the finding's primary location: the first non-empty one of its kind's
    ``primary`` (a double free's second free), else any stack; ``None`` for a finding with none."""
    order = lookup(f.kind).primary + ("free_sites", "prev_free_sites", "read_sites")
    return next((key for key in order if getattr(f, key)), None)


def cwd_relative(path: str) -> str | None:
    """An absolute ``path`` under the current directory (a plugin's engine), relative to it; None for a
    relative path, one elsewhere or in an installed package, or when the current directory is a root."""
    p = _norm(path)
    if not (p.startswith("/") or WINDOWS_ABS.match(p)) or "/site-packages/" in p or "/dist-packages/" in p:
        return None
    root = _norm(os.getcwd()).rstrip("/")
    if not root or WINDOWS_ABS.match(root) and len(root) <= 2:
        return None
    return p[len(root) + 1:] if p.startswith(root + "/") else None


def in_repo(site: Site) -> bool:
    """Whether code scanning can resolve ``site.file`` against the checkout: a repo-relative path (not a
    pseudo-file like ``<string>``, not ``../``) or one under the current directory."""
    p = _norm(site.file)
    if cwd_relative(p) is not None or _package_here(p) is not None:
        return True
    return bool(p) and not (p.startswith(("/", "<", "../")) or p == ".." or WINDOWS_ABS.match(p) or installed(p))


def _package_here(p: str) -> str | None:
    """A package-relative ``p`` (``toysched/engine.py``: how a module of a package on ``sys.path`` is
    recorded) whose file is under the current directory (a plugin's package in the user's repository, not
    an installed one), relative to it; else None."""
    if not p or p.startswith(("/", "<", "../")) or WINDOWS_ABS.match(p):
        return None
    src = _installed_file(p)
    return cwd_relative(src) if src is not None else None


def _installed_file(p: str) -> str | None:
    """For a relative ``p``: its file when it is an installed package's (:func:`installed`), else None;
    ``sys.path`` walked once (``installed`` and ``source_path`` walk it each)."""
    src = source_path(p)
    return src if src != os.path.join(_CHECKOUT, p) else None


def _local(path: str) -> str:
    """``path`` as a ``file://`` location names it (:func:`artifact_location`): a package-relative one (a plugin
    package on ``sys.path``) where it lies here; any other as it is."""
    p = _norm(path)
    if not p or p.startswith(("/", "<")) or WINDOWS_ABS.match(p):
        return p
    src = _installed_file(p)
    return _norm(src) if src is not None else p


def engine_base_id(package: str) -> str:
    return f"%{package.upper()}_ROOT%"


def artifact_location(path: str, engine: EngineSource | None = None) -> dict | None:
    """``artifactLocation`` for a recorded path: under ``%SRCROOT%`` or the engine's base id, a
    ``file://`` URI for another absolute path, ``None`` for a pseudo-file (``<string>``)."""
    rel = engine_path(path, engine.package) if engine is not None else None
    if rel is not None:
        return {"uri": quote(rel), "uriBaseId": engine_base_id(engine.package)}
    p = _norm(path)
    here = cwd_relative(p) or _package_here(p)
    if here is not None:
        return {"uri": quote(here), "uriBaseId": SRCROOT}
    if p.startswith("/"):
        return {"uri": "file://" + quote(p)}
    if WINDOWS_ABS.match(p):
        return {"uri": "file:///" + p[:2] + quote(p[2:])}
    if not p or p.startswith("<"):
        return None
    src = _installed_file(p)
    if src is not None:  # another installed package's (a library's), recorded from its package: where it is here
        return {"uri": "file://" + quote(_norm(src))}
    return {"uri": quote(p.removeprefix("./")), "uriBaseId": SRCROOT}


def _addressable(site: Site, engine: EngineSource | None) -> bool:
    return in_repo(site) or (engine is not None and engine_path(site.file, engine.package) is not None)


def _location(site: Site, message: str | None = None, loc_id: int | None = None,
              region_fallback: bool = False, engine: RecordedEngine | None = None) -> dict:
    """A ``location``: physical where the file is addressable (the line as :func:`resolve` finds it
    now), always logical; ``region_fallback`` puts an unknown line 0 on line 1."""
    loc: dict = {}
    if loc_id is not None:
        loc["id"] = loc_id
    art = artifact_location(site.file, engine)
    other = frame_release(site, engine)
    if art is not None:
        phys: dict = {"artifactLocation": art}
        if other is not None:  # NOTE: no region: the line is the recorded release's, not the installed file's
            loc["properties"] = {"recordedOn": f"{engine.package} {other}", "recordedLine": site.line}
        elif site.line >= 1 or region_fallback:
            fr = resolve(site) if site.line >= 1 else Frame(1, "")  # checked against the current source
            phys["region"] = {"startLine": fr.line}
            if fr.source:
                phys["region"]["snippet"] = {"text": fr.source}
            if fr.note:
                loc["properties"] = {"frameNote": fr.note}
        loc["physicalLocation"] = phys
    loc["logicalLocations"] = [{"name": site.function or "?", "kind": "function"}]
    if message:
        loc["message"] = {"text": message}
    return loc


def _anchor(kind: str, target: str = "eut") -> tuple[Site, bool]:
    """Where a finding without a usable frame is shown (code scanning rejects a result without one), and
    whether that is engine code: the code that owns the state, as the target kind's ``anchor`` names it,
    else the kind's config class (False)."""
    try:
        k = get(target)
    except UnknownTargetError:
        k = get("eut")
    try:
        if k.anchor is not None:
            fn, label = k.anchor(kind)
            line = inspect.getsourcelines(fn)[1]
            site = Site(_norm(portable_path(inspect.getsourcefile(fn) or "")), line, label)
            if in_repo(site):
                return site, True
    except (AttributeError, OSError, TypeError, ImportError):
        pass
    cls = k.config_class
    try:
        line = inspect.getsourcelines(cls)[1]  # the class statement (line 1 is outside it: a stale-frame note)
    except (OSError, TypeError):
        line = 1
    return Site(_norm(portable_path(inspect.getsourcefile(cls) or "")), line, cls.__name__), False


def _escape(text: str) -> str:
    """Square brackets escaped, which would read as embedded links; lone surrogates dropped."""
    return re.sub(r"([\[\]])", r"\\\1", re.sub("[\ud800-\udfff]", "", text))


def _current_lines(stacks: list, engine: RecordedEngine | None) -> Callable[[str], str]:
    """A text -> the text with each frame of ``stacks`` it names (``hisparse.py:183 in admit_request_direct``, as
    :meth:`Site.short` writes it) at the line its locations give, where the current source moved it."""
    moved = {}
    for _, _, frames in stacks:
        for s in frames:
            line = resolve(s, engine).line
            if line != s.line:
                moved[s.short()] = f"{os.path.basename(s.file)}:{line} in {s.function}"
    if not moved:
        return lambda text: text
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, sorted(moved, key=len, reverse=True))) + r")(?!\w)")
    return lambda text: pattern.sub(lambda m: moved[m[1]], text)


def current_summary(f: Finding, engine: RecordedEngine | None = None) -> str:
    """``f.summary()`` naming its frames at the lines the current source has them (:func:`_current_lines`), as
    the frame lines a report prints beside it do."""
    return _current_lines(_labelled_stacks(f), engine)(f.summary())


def verdict_text(lines: list[str]) -> str:
    """An engine check's recorded lines (``Finding.engine_check``) as the text after ``engine
    check_memory():``: ``ok``, or ``FAILED: `` and the failing lines."""
    if len(lines) == 1 and lines[0].endswith("ok"):
        return "ok"
    text = "; ".join(lines)
    return "FAILED: " + text.removeprefix("engine check_memory() ")


def engine_verdict(f: Finding) -> str:
    """The engine's own ``check_memory()`` verdict, one line (``engine check_memory(): FAILED: ...``)."""
    return f"engine check_memory(): {verdict_text(f.engine_check)}"


def lifecycle_events(f: Finding) -> list[tuple[str, str, str, str]]:
    """The first unit's timeline as every report words it: ``(op, step, event, rich style)`` per owner
    change or event, then its kind's ``lifecycle_end`` (a leak's verdict, op and step empty)."""
    rows, owner = [], None
    for o in f.owner_history:
        style = ""
        if o.event != "owner":
            text = o.event
        elif o.owner == "-":
            text, style = (f"{owner} no longer holds it; no owner since", "yellow") if owner else ("no owner", "")
        else:
            text = f"owned by {o.owner}"
        if o.event == "owner":
            owner = None if o.owner == "-" else o.owner
        rows.append((str(o.op_index), str(o.step), text, style))
    end = lookup(f.kind).lifecycle_end(f)  # (a leak's verdict)
    if end is not None:
        rows.append(("", "", *end))
    return rows


def lifecycle(f: Finding) -> list[str]:
    """:func:`lifecycle_events`, one ``op N step M: event`` line each."""
    return [f"op {op} step {step}: {text}" if op else text for op, step, text, _ in lifecycle_events(f)]


def _units_line(f: Finding) -> str:
    if not f.slots:
        return ""
    word, ids = f.listed()
    shown = ", ".join(map(str, ids[:16])) + (f", ... ({len(ids)} in all)" if len(ids) > 16 else "")
    return f"{word.capitalize()}: {shown}."


def _primary(stacks: list, key: str | None, target: str, kind: str,
             engine: RecordedEngine | None) -> tuple[Site, str | None, str]:
    """The result's location, the label of the stack it comes from (None for the anchor), and what it is
    (:data:`FRAME`, :data:`FRAME_ELSEWHERE`, :data:`ANCHOR` or :data:`CONFIG_ANCHOR`), in the order
    docs/internals/reports.md gives ("Where a result is located"). A frame the current source calls stale
    is skipped (its line would point at other code)."""
    def fresh(s: Site) -> bool:
        return not resolve(s).note.startswith("stale")

    def search(tests) -> tuple[Site, str] | None:
        for own in (True, False):
            for test in tests:
                hit = next(((s, label) for k, label, frames in stacks if (k == key) == own for s in frames
                            if test(s) and fresh(s)), None)
                if hit is not None:
                    return hit
        return None

    tests = ([lambda s: engine_path(s.file, engine.package) is not None and frame_release(s, engine) is None]
             if engine is not None else []) + [in_repo]
    hit = search(tests)
    if hit is not None:
        return hit[0], hit[1], FRAME
    anchor, engine_code = _anchor(kind, target)
    if not in_repo(anchor):
        hit = search([lambda s: _a_file(s) and not installed(s.file) and "/site-packages/" not in _norm(s.file),
                      _a_file])
        if hit is not None:
            return hit[0], hit[1], FRAME_ELSEWHERE
    return anchor, None, ANCHOR if engine_code else CONFIG_ANCHOR


def _a_file(site: Site) -> bool:
    """A frame of a source file (not ``<string>``), with a known line."""
    return site.line >= 1 and artifact_location(site.file) is not None


def _related(stacks: list, primary: Site, key: str | None, engine: RecordedEngine | None,
             now: Callable[[str], str] = str) -> tuple[list, list]:
    """``relatedLocations`` (every addressable frame but the primary) and the message's embedded links (their
    frames named by ``now``: :func:`_current_lines`)."""
    related: list[dict] = []
    links: list[str] = []
    for k, label, frames in stacks:
        # NOTE: a release's stack is linked at its path, the first frame past the release plumbing, as the
        # signature names it (the plumbing's own line is every release path's)
        lead = next((i for i, s in enumerate(frames) if not s.entry), 0)
        for depth, s in enumerate(frames):
            if s is primary or not _addressable(s, engine):
                continue
            loc_id = len(related) + 1  # ids are unique within the result, as embedded links need
            related.append(_location(s, f"{label} #{depth} {s.function}", loc_id, engine=engine))
            if depth == lead and k != key:
                other = frame_release(s, engine)
                on = f" in {engine.package} {other}" if other is not None else ""
                links.append(f"{label} [{_escape(s.function)}]({loc_id}) ({_escape(now(s.short()))}{on})")
    return related, links


def _message(f: Finding, links: list[str], primary: Site, where: str, recorded_on: str = "",
             package: str = "", any_frames: bool = False, outside: bool = False,
             now: Callable[[str], str] = str) -> str:
    summary = now(f.summary())
    lines = [_escape(summary)]
    detail = f": {now(f.message)}" if f.message and f.message not in f.summary() else ""
    if f.op_index >= 0 or f.step >= 0:
        lines.append(_escape(f"Detected after op #{f.op_index} at scheduler step {f.step}{detail}."))
    elif detail:
        lines.append(_escape(detail[2:]))
    if f.slots:
        lines.append(_units_line(f))
    if links:
        lines.append("See also: " + "; ".join(links) + ".")
    if recorded_on:
        lines.append(_escape(f"(Recorded on {recorded_on}, not the {package} installed here: its {package} frames "
                             "are named by path, their recorded lines kept as properties, not claimed as lines of "
                             "the installed files.)"))
    if where in (ANCHOR, CONFIG_ANCHOR) and not recorded_on:
        why = ("No recorded frame is a file of this checkout (run kvaudit from the repository root)" if any_frames
               else "No source frame recorded")
        what = ("where the engine keeps the state this finding is about" if where == ANCHOR
                else "the target kind's config class: the kind names no engine code for this state")
        lines.append(_escape(f"({why}: shown at {primary.function}, {what}.)"))
        if outside:  # (a plugin's config class, run from outside its folder)
            lines.append(_escape(f"(That is {_local(primary.file)}, not a file under the current directory, so "
                                 "code scanning cannot show this result in the repository. Run kvaudit from the "
                                 "root of the repository that holds the engine.)"))
    elif where == FRAME_ELSEWHERE:
        lines.append(_escape(f"(No recorded frame is a file under the current directory, so code scanning cannot "
                             f"show this result in the repository: it is located at its own frame, "
                             f"{_local(primary.file)}:{primary.line}, by that path. Run kvaudit from the root of "
                             "the repository that holds the engine.)"))
    if f.engine_check:
        lines.append(_escape(engine_verdict(f)))
    return "\n".join(lines)


def _properties(f: Finding, where: str, engine: EngineSource | None, outside: bool = False) -> dict:
    word, ids = f.listed()  # named in the pool's unit: token "slots", "rows", or (vLLM's) "blocks"
    # NOTE: a finding of no units (a hang, pool "-") names no unit: its recorded one is the default, not a pool's
    units = ({"unit": f.unit} if ids or f.num_units else {}) | (
        {word: list(ids[:MAX_SLOTS]), f"{word}Total": len(ids)} if ids else {})
    props: dict = {"signature": f.signature, "pool": f.pool, **units, "num_units": f.num_units, "op_index": f.op_index,
                   "step": f.step, "engine_check": list(f.engine_check)}
    props.update(lookup(f.kind).props(f))  # (a leak's indirect)
    if f.owner_history:
        props["lifecycle"] = lifecycle(f)
    if f.memory_state:
        props["memory_state"] = list(f.memory_state)
    if f.traceback:
        props["traceback"] = f.traceback if engine is None else re.sub(  # the engine's files as its frames are
            r'File "([^"]+)"', lambda m: f'File "{engine_path(m[1], engine.package) or m[1]}"', f.traceback)
    if where in (ANCHOR, CONFIG_ANCHOR):
        props["locationIsFallback"] = True
    if outside:
        props["locationOutsideCheckout"] = True
    return props | _engine_props(engine)


def _engine_props(engine: EngineSource | None) -> dict:
    if engine is None:
        return {}
    # NOTE: no version when the engine is not installed here (a report rendered from a file)
    return {"engine": engine.package} | ({"engineVersion": engine.version} if engine.version else {})


def _result(f: Finding, rule_index: int, level: str, target: str = "eut",
            engine: RecordedEngine | None = None) -> dict:
    stacks = _labelled_stacks(f)
    key = primary_stack(f)
    primary, primary_label, where = _primary(stacks, key, target, f.kind, engine)
    others = sorted({v for _, _, frames in stacks for s in frames if (v := frame_release(s, engine)) is not None})
    recorded_on = f"{engine.package} {', '.join(others)}" if others else ""
    now = _current_lines(stacks, engine)  # (the message names the lines its locations point at)
    related, links = _related(stacks, primary, key, engine, now)
    outside = where == FRAME_ELSEWHERE or (where in (ANCHOR, CONFIG_ANCHOR) and not in_repo(primary))
    result: dict = {
        "ruleId": f.kind,
        "ruleIndex": rule_index,
        "level": level,
        "message": {"text": _message(f, links, primary, where, recorded_on, engine.package if engine else "",
                                     any_frames=any(frames for _, _, frames in stacks), outside=outside,
                                     now=now)},
        "locations": [_location(primary, (primary_label or "anchored at") + f" {primary.function}",
                                region_fallback=True, engine=engine)],
        "partialFingerprints": {FINGERPRINT_KEY: f.signature},
    }
    if related:
        result["relatedLocations"] = related
    if stacks:
        result["stacks"] = [{"message": {"text": label},
                             "frames": [{"location": _location(s, engine=engine)} for s in frames]}
                            for _, label, frames in stacks]
    result["properties"] = _properties(f, where, engine, outside) | ({"recordedOn": recorded_on} if recorded_on else {})
    return result


def _kind_name(config) -> str:
    """The registered kind of ``config`` (a plugin's has no ``target`` field); ``eut`` for None."""
    if config is None:
        return "eut"
    try:
        return kind_of(config).name
    except UnknownTargetError:
        return getattr(config, "target", "eut")


def engine_of(config, recorded: Mapping[str, str] | None = None) -> Callable[[Finding], RecordedEngine | None]:
    """For ``config``'s target kind: a finding -> the engine its frames are of, for
    :func:`~kvaudit.audit.frames.resolve` (None for a kind whose source is this repository); ``recorded`` maps
    a signature to the release its finding was recorded on (a replay file's ``engine_version``)."""
    return _engine_of(engine_source(_kind_name(config)), recorded)


def _engine_of(engine, recorded: Mapping[str, str] | None) -> Callable[[Finding], RecordedEngine | None]:
    if engine is None:
        return lambda f: None
    return lambda f: RecordedEngine(*engine, (recorded or {}).get(f.signature))


def to_sarif(findings: list[Finding], config=None, baseline: Mapping[str, str] | None = None,
             recorded: Mapping[str, str] | None = None) -> dict:
    """A SARIF 2.1.0 log (a JSON-ready ``dict``), one result per finding in order. ``config`` (a target
    kind's config) goes into the run's ``properties`` and decides how engine frames are written;
    ``baseline`` maps a signature to its result's ``baselineState``; ``recorded`` a signature to the
    engine release its finding was recorded on (a replay file's ``engine_version``): where that is not the
    installed release, the finding's engine frames claim no line. Raises ValueError for a state outside
    :data:`BASELINE_STATES`."""
    rule_list = rules([f.kind for f in findings])
    index = {r["id"]: i for i, r in enumerate(rule_list)}
    target = _kind_name(config)
    engine = engine_source(target)  # (read once: the installed package's metadata)
    on = _engine_of(engine, recorded)
    results = []
    for f in findings:
        r = _result(f, index[f.kind], lookup(f.kind).level, target, on(f))
        state = (baseline or {}).get(f.signature)
        if state is not None:
            if state not in BASELINE_STATES:
                raise ValueError(f"baselineState {json_value(state)} (valid: {', '.join(BASELINE_STATES)})")
            r["baselineState"] = state
        results.append(r)
    run: dict = {}
    if engine is not None:
        where = (f"The directory the installed {engine.package} package lies in (its site-packages), "
                 f"so that {engine.package}/... is a file of {engine.package} "
                 f"{engine.version or '(version unknown)'}.")
        run["originalUriBaseIds"] = {engine_base_id(engine.package): {"description": {"text": where}}}
    if config is not None:
        d = config.to_dict()
        # (page_size: the config's, a field or (vLLM's block_size, a plugin's) a property to_dict() leaves out)
        run["properties"] = {"preset": getattr(config, "preset", d.get("preset")), "bugs": sorted(d.get("bugs", [])),
                             "model": d.get("model"), "page_size": getattr(config, "page_size", None),
                             "engineConfig": d,
                             **_engine_props(engine)}
    return sarif_log(rule_list, results, **run)

"""SARIF 2.1.0 output: findings as a static-analysis log that GitHub code scanning can ingest.

:func:`to_sarif` returns the log as a plain ``dict`` (``json.dump`` it). Its shape, in the
SARIF spec's own terms:

* ``sarifLog`` with one ``run``; the run's ``tool.driver`` (a ``toolComponent``) carries one
  ``reportingDescriptor`` (rule) per finding kind, in the order of :data:`kvaudit.audit.findings.KINDS`,
  so that a ``result.ruleIndex`` means the same rule in every log this version writes.
* One ``result`` per finding, deduplicated by nobody: the caller decides what to pass. Its
  primary ``location`` is where the finding happened in the engine's source (see
  :func:`primary_stack`), ``relatedLocations`` are the other frames, linked from the message
  text with SARIF's embedded links (``[text](id)``, spec "Messages with embedded links"),
  ``stacks`` hold every recorded stack in full (spec "stack object"/"stackFrame object"), and
  ``partialFingerprints["kvauditSignature/v1"]`` is :attr:`Finding.signature`, which is what
  code scanning then uses to track one alert across runs (spec "partialFingerprints property").
  With a ``baseline`` (``kvaudit ci``: every open finding, new or already in the corpus), each
  result says ``baselineState`` ``"new"`` or ``"unchanged"`` (spec "baselineState property").
* File locations are ``artifactLocation`` objects whose ``uri`` is repo-relative (forward
  slashes) with ``uriBaseId`` ``%SRCROOT%``, the convention GitHub resolves against the checkout.
  The log does not give ``%SRCROOT%`` an ``originalUriBaseIds`` entry: that would write one
  machine's checkout path into an otherwise portable, deterministic file (replay files avoid it
  for the same reason).
* A target that drives an installed engine (:func:`kvaudit.targets.engine_source`: real SGLang)
  records the engine's frames as absolute paths of the recording machine. Those frames are
  written relative to the directory the engine's package lies in (``sglang/srt/mem_cache/...``)
  with ``uriBaseId`` ``%SGLANG_ROOT%``, described (without a path) in ``originalUriBaseIds``,
  and a result is anchored at the engine's own frame, the innermost one in its package, before
  any frame of kvaudit's driver. Results and the run name the engine and its version in
  ``properties`` (``engine``, ``engineVersion``).

A user's own engine outside kvaudit's directory (a plugin target) is recorded with absolute paths: a
frame under the current directory, outside installed packages, is written relative to it with
``%SRCROOT%`` (:func:`cwd_relative`; run kvaudit from the repository's root).
Other frames outside the repository (an absolute path, as a crash in a library can have) appear in
``stacks`` as absolute ``file://`` URIs, and pseudo-files such as ``<string>`` by function name
only; neither is used as a result's location, since code scanning can show neither.
"""

from __future__ import annotations

import inspect
import os
import posixpath
import re
from typing import TYPE_CHECKING, Mapping
from urllib.parse import quote

import kvaudit
from kvaudit.audit.findings import KINDS, Finding, Site, portable_path
from kvaudit.audit.kinds import lookup
from kvaudit.audit.frames import Frame, resolve
from kvaudit.reports.ci_outputs import SARIF_SCHEMA, SARIF_VERSION

if TYPE_CHECKING:
    from kvaudit.targets import EngineSource

SRCROOT = "%SRCROOT%"
FINGERPRINT_KEY = "kvauditSignature/v1"
MAX_SLOTS = 64  # slots (or rows) listed in a result's properties; the rest are counted
BASELINE_STATES = ("new", "unchanged")  # what ``kvaudit ci`` marks (the spec also has updated, absent)

# ----------------------------------------------------------------------------- rules

def _rule(kind: str) -> dict:
    """The ``reportingDescriptor`` for ``kind``: its row of the finding kinds' table
    (:func:`kvaudit.audit.kinds.lookup`: a generic one for a kind no row describes)."""
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


# ----------------------------------------------------------------------------- stacks and locations

def _labelled_stacks(f: Finding) -> list[tuple[str, str, list[Site]]]:
    """``(field, label, frames)`` for each non-empty stack of ``f``, in reading order (its kind's
    ``stacks`` and ``labels``, :mod:`kvaudit.audit.kinds`)."""
    row = lookup(f.kind)
    return [(key, row.stack_label(key), list(getattr(f, key))) for key in row.stacks if getattr(f, key)]


def finding_stacks(f: Finding) -> list[tuple[str, list[Site]]]:
    """The finding's recorded stacks as ``(label, frames)``, innermost frame first, in reading
    order, empty stacks left out. Labels say what the frames mean for this kind (a crash's
    ``alloc_sites`` are where it was raised, a lock imbalance's where the lock was taken)."""
    return [(label, frames) for _, label, frames in _labelled_stacks(f)]


def primary_stack(f: Finding) -> str | None:
    """Which of the finding's stack fields holds its primary location: ``free_sites`` for a
    double free (the second free is the bug) and a use-after-free (the free that came too early),
    ``alloc_sites`` when there are any, else
    ``read_sites`` (stale KV with no allocation recorded), else whichever stack exists; ``None``
    for a finding with no stack (accounting drift, liveness, hang)."""
    order = lookup(f.kind).primary + ("free_sites", "prev_free_sites", "read_sites")
    return next((key for key in order if getattr(f, key)), None)


_WINDOWS_ABS = re.compile(r"^[A-Za-z]:[\\/]")


def _norm(path: str) -> str:
    """Forward slashes, with ``.`` and ``a/..`` folded (``a/../../x.py`` -> ``../x.py``)."""
    p = path.replace("\\", "/")
    return posixpath.normpath(p) if p and not p.startswith("<") else p


def cwd_relative(path: str) -> str | None:
    """An absolute ``path`` under the current directory, relative to it (forward slashes): a user's
    own engine outside kvaudit's directory (a plugin target), with kvaudit run from the repository's
    root as code scanning expects. None for a relative path, a path elsewhere, one inside an installed
    package (``site-packages``, ``dist-packages``), or when the current directory is a filesystem root."""
    p = _norm(path)
    if not (p.startswith("/") or _WINDOWS_ABS.match(p)) or "/site-packages/" in p or "/dist-packages/" in p:
        return None
    root = _norm(os.getcwd()).rstrip("/")
    if not root or _WINDOWS_ABS.match(root) and len(root) <= 2:
        return None
    return p[len(root) + 1:] if p.startswith(root + "/") else None


def in_repo(site: Site) -> bool:
    """Whether code scanning can resolve ``site.file`` against the checkout: a repo-relative path (see
    :func:`kvaudit.audit.findings.portable_path`), not a pseudo-file like ``<string>``, not ``../``; or
    an absolute path under the current directory (:func:`cwd_relative`)."""
    p = _norm(site.file)
    if cwd_relative(p) is not None:
        return True
    return bool(p) and not (p.startswith(("/", "<", "../")) or p == ".." or _WINDOWS_ABS.match(p))


def engine_base_id(package: str) -> str:
    """The ``uriBaseId`` of an installed engine's files: ``%SGLANG_ROOT%`` for ``sglang``."""
    return f"%{package.upper()}_ROOT%"


def engine_path(path: str, package: str) -> str | None:
    """``path`` relative to the directory holding ``package`` when it is an absolute path inside
    that package (``/x/site-packages/sglang/srt/a.py`` -> ``sglang/srt/a.py``; the last
    ``/<package>/`` in the path, so a source checkout's ``.../sglang/python/sglang/srt/a.py`` gives
    the same); else None (a repo-relative path, another package, a pseudo-file)."""
    p = _norm(path)
    if not (p.startswith("/") or _WINDOWS_ABS.match(p)):
        return None
    i = p.rfind(f"/{package}/")
    return p[i + 1:] if i >= 0 else None


def artifact_location(path: str, engine: EngineSource | None = None) -> dict | None:
    """``artifactLocation`` for a recorded path: repo-relative -> ``{"uri", "uriBaseId": "%SRCROOT%"}``;
    inside ``engine``'s package -> relative to the directory holding it, with the engine's base id
    (:func:`engine_path`); other absolute paths -> a ``file://`` URI; a pseudo-file (``<string>``)
    -> ``None``."""
    rel = engine_path(path, engine.package) if engine is not None else None
    if rel is not None:
        return {"uri": quote(rel), "uriBaseId": engine_base_id(engine.package)}
    p = _norm(path)
    here = cwd_relative(p)
    if here is not None:
        return {"uri": quote(here), "uriBaseId": SRCROOT}
    if p.startswith("/"):
        return {"uri": "file://" + quote(p)}
    if _WINDOWS_ABS.match(p):
        return {"uri": "file:///" + p[:2] + quote(p[2:])}
    if not p or p.startswith("<"):
        return None
    return {"uri": quote(p.removeprefix("./")), "uriBaseId": SRCROOT}


def _addressable(site: Site, engine: EngineSource | None) -> bool:
    """In the repository, or in the installed engine's package: a file a reader can open."""
    return in_repo(site) or (engine is not None and engine_path(site.file, engine.package) is not None)


def _location(site: Site, message: str | None = None, loc_id: int | None = None,
              region_fallback: bool = False, engine: EngineSource | None = None) -> dict:
    """A ``location`` object for a frame: physical (file, 1-based line and the line's text as the
    region's ``snippet``, both from :func:`kvaudit.audit.frames.resolve`: where the recorded text is now,
    with ``properties.frameNote`` when the frame no longer matches the current source) where the
    file is addressable, and
    always a logical location naming the function. ``region_fallback`` puts a
    line 0 (unknown, as a traceback can give) on line 1 instead of leaving the region out."""
    loc: dict = {}
    if loc_id is not None:
        loc["id"] = loc_id
    art = artifact_location(site.file, engine)
    if art is not None:
        phys: dict = {"artifactLocation": art}
        if site.line >= 1 or region_fallback:
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


def _anchor(kind: str, target: str = "eut") -> Site:
    """Where a finding without any usable frame is shown. Code scanning rejects a result without
    a location, and these findings (accounting drift, liveness, hang, a crash with no frame in
    the repository) are about the engine's state, not one line of it, so they are anchored on
    the engine code that owns that state, as the target kind registers it (its ``anchor``: for the
    built-in engine ``Scheduler.check_memory`` for accounting drift and lock imbalance, and
    ``Scheduler.step`` for everything else). The line is looked up in the current source, so the
    anchor follows edits; if that fails, or the kind registers none, line 1 of the file the kind's
    config class is defined in. The result says so in its message and in
    ``properties.locationIsFallback``."""
    from kvaudit.targets.registry import UnknownTargetError, get
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
                return site
    except (AttributeError, OSError, TypeError, ImportError):
        pass
    cls = k.config_class
    try:
        line = inspect.getsourcelines(cls)[1]  # the class statement (line 1 is outside it: a stale-frame note)
    except (OSError, TypeError):
        line = 1
    return Site(_norm(portable_path(inspect.getsourcefile(cls) or "")), line, cls.__name__)


# ----------------------------------------------------------------------------- results

def _escape(text: str) -> str:
    """Free text for a plain-text SARIF message: literal square brackets are backslash-escaped so
    that they are not read as embedded links (spec "Messages with embedded links"; SARIF
    viewers unescape ``\\[``/``\\]`` for display). Lone surrogates, which no UTF-8 reader
    accepts, are dropped."""
    return re.sub(r"([\[\]])", r"\\\1", re.sub("[\ud800-\udfff]", "", text))


def verdict_text(lines: list[str]) -> str:
    """An engine check's recorded lines (``Finding.engine_check``, ``engine_check_at_idle``) as the text
    after ``engine check_memory():``: ``ok``, or ``FAILED: `` and the failing lines (in words, off a
    terminal too: the console's colour is not all that says so)."""
    if len(lines) == 1 and lines[0].endswith("ok"):
        return "ok"
    text = "; ".join(lines)
    return "FAILED: " + text.removeprefix("engine check_memory() ")


def engine_verdict(f: Finding) -> str:
    """The engine's own ``check_memory()`` verdict recorded with the finding, as one line
    (``engine check_memory(): FAILED: [pool] available=... = 255 != total=256``)."""
    return f"engine check_memory(): {verdict_text(f.engine_check)}"


def lifecycle_events(f: Finding) -> list[tuple[str, str, str, str]]:
    """The first unit's timeline as every report words it: ``(op, step, event, style)`` per owner
    change or event (an owner that let go: ``X no longer holds it; no owner since``), then for a leak
    ``never freed; last owner: X`` (op and step empty). ``style``: a rich style for the console, ""."""
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
    """The first unit's timeline (:func:`lifecycle_events`), one ``op N step M: event`` line each."""
    return [f"op {op} step {step}: {text}" if op else text for op, step, text, _ in lifecycle_events(f)]


def _units_line(f: Finding) -> str:
    if not f.slots:
        return ""
    word, ids = f.listed()
    shown = ", ".join(map(str, ids[:16])) + (f", ... ({len(ids)} in all)" if len(ids) > 16 else "")
    return f"{word.capitalize()}: {shown}."


def _primary(f: Finding, stacks: list, key: str | None, target: str,
             engine: EngineSource | None) -> tuple[Site, bool]:
    """The result's location and whether it is the fallback anchor: the innermost frame of the primary
    stack in the installed engine's package, else of any stack; then the same for frames in the
    repository; else the kind's anchor (:func:`_anchor`)."""
    tests = ([lambda s: engine_path(s.file, engine.package) is not None] if engine is not None else []) + [in_repo]
    for test in tests:
        primary = next((s for s in (getattr(f, key) if key else []) if test(s)), None) or \
            next((s for _, _, frames in stacks for s in frames if test(s)), None)
        if primary is not None:
            return primary, False
    return _anchor(f.kind, target), True


def _related(stacks: list, primary: Site, key: str | None, engine: EngineSource | None) -> tuple[list, list]:
    """``relatedLocations`` (every addressable frame but the primary, ids from 1) and the message's
    embedded links to each other stack's innermost frame."""
    related: list[dict] = []
    links: list[str] = []
    for k, label, frames in stacks:
        for depth, s in enumerate(frames):
            if s is primary or not _addressable(s, engine):
                continue
            loc_id = len(related) + 1  # ids are unique within the result, as embedded links need
            related.append(_location(s, f"{label} #{depth} {s.function}", loc_id, engine=engine))
            if depth == 0 and k != key:
                links.append(f"{label} [{_escape(s.function)}]({loc_id}) ({_escape(s.short())})")
    return related, links


def _message(f: Finding, links: list[str], primary: Site, fallback: bool) -> str:
    """The result's message text: the summary, when it was detected, the units, the links."""
    summary = f.summary()
    lines = [_escape(summary)]
    detail = f": {f.message}" if f.message and f.message not in summary else ""
    if f.op_index >= 0 or f.step >= 0:
        lines.append(_escape(f"Detected after op #{f.op_index} at scheduler step {f.step}{detail}."))
    elif detail:
        lines.append(_escape(detail[2:]))
    if f.slots:
        lines.append(_units_line(f))
    if links:
        lines.append("See also: " + "; ".join(links) + ".")
    if fallback:
        lines.append(_escape(f"(No source frame recorded: shown at {primary.function}, "
                             "where the engine keeps the state this finding is about.)"))
    if f.engine_check:
        lines.append(_escape(engine_verdict(f)))
    return "\n".join(lines)


def _properties(f: Finding, fallback: bool, engine: EngineSource | None) -> dict:
    """The result's ``properties``: the finding's data (units capped at :data:`MAX_SLOTS`), its kind's
    extra properties, and the engine it was found in."""
    props: dict = {"signature": f.signature, "pool": f.pool, "unit": f.unit, "slots": list(f.slots[:MAX_SLOTS]),
                   "slotsTotal": len(f.slots), "num_units": f.num_units, "op_index": f.op_index, "step": f.step,
                   "engine_check": list(f.engine_check)}
    props.update(lookup(f.kind).props(f))  # (a leak's indirect)
    if f.owner_history:
        props["lifecycle"] = lifecycle(f)
    if f.memory_state:
        props["memory_state"] = list(f.memory_state)
    if f.traceback:
        props["traceback"] = f.traceback if engine is None else re.sub(  # the engine's files as its frames are
            r'File "([^"]+)"', lambda m: f'File "{engine_path(m[1], engine.package) or m[1]}"', f.traceback)
    if fallback:
        props["locationIsFallback"] = True
    if engine is not None:
        props["engine"] = engine.package
        if engine.version:  # not installed here (a report rendered from a file): no version to claim
            props["engineVersion"] = engine.version
    return props


def _result(f: Finding, rule_index: int, level: str, target: str = "eut",
            engine: EngineSource | None = None) -> dict:
    """One ``result`` (module docstring): located at :func:`_primary`, the other frames related."""
    stacks = _labelled_stacks(f)
    key = primary_stack(f)
    primary_label = next((label for k, label, _ in stacks if k == key), None)
    primary, fallback = _primary(f, stacks, key, target, engine)
    related, links = _related(stacks, primary, key, engine)
    result: dict = {
        "ruleId": f.kind,
        "ruleIndex": rule_index,
        "level": level,
        "message": {"text": _message(f, links, primary, fallback)},
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
    result["properties"] = _properties(f, fallback, engine)
    return result


def _kind_name(config) -> str:
    """The registered kind ``config`` belongs to (a plugin's config need not have a ``target`` field);
    ``eut`` for None or a config no kind takes."""
    from kvaudit.targets.registry import UnknownTargetError, kind_of
    if config is None:
        return "eut"
    try:
        return kind_of(config).name
    except UnknownTargetError:
        return getattr(config, "target", "eut")


def to_sarif(findings: list[Finding], config=None, baseline: Mapping[str, str] | None = None) -> dict:
    """A SARIF 2.1.0 log (a JSON-ready ``dict``) with one run holding one result per finding, in
    order. ``config`` (a target kind's config), when
    given, goes into the run's ``properties`` (``preset``, ``bugs``, ``model``, ``page_size`` and
    the full config as ``engineConfig``; ``engine`` and ``engineVersion`` for an installed engine),
    so that an uploaded log says what was audited; its ``target`` decides how engine frames are
    written (see the module doc). ``baseline`` maps a signature to the result's
    ``baselineState`` (one of :data:`BASELINE_STATES`); findings it does not name get none.
    Raises ValueError for a state outside :data:`BASELINE_STATES`."""
    rule_list = rules([f.kind for f in findings])
    index = {r["id"]: i for i, r in enumerate(rule_list)}
    from kvaudit.targets import engine_source

    target = _kind_name(config)
    engine = engine_source(target)
    results = []
    for f in findings:
        r = _result(f, index[f.kind], rule_list[index[f.kind]]["defaultConfiguration"]["level"], target, engine)
        state = (baseline or {}).get(f.signature)
        if state is not None:
            if state not in BASELINE_STATES:
                raise ValueError(f"baselineState {state!r} (valid: {', '.join(BASELINE_STATES)})")
            r["baselineState"] = state
        results.append(r)
    run: dict = {
        "tool": {"driver": {"name": "kvaudit", "version": kvaudit.__version__,
                            "semanticVersion": kvaudit.__version__, "rules": rule_list}},
        "results": results,
    }
    if engine is not None:
        where = (f"The directory the installed {engine.package} package lies in (its site-packages), "
                 f"so that {engine.package}/... is a file of {engine.package} "
                 f"{engine.version or '(version unknown)'}.")
        run["originalUriBaseIds"] = {engine_base_id(engine.package): {"description": {"text": where}}}
    if config is not None:
        d = config.to_dict()
        run["properties"] = {"preset": getattr(config, "preset", d.get("preset")), "bugs": sorted(d.get("bugs", [])),
                             "model": d.get("model"), "page_size": d.get("page_size"), "engineConfig": d}
        if engine is not None:
            run["properties"]["engine"] = engine.package
            if engine.version:
                run["properties"]["engineVersion"] = engine.version
    return {"$schema": SARIF_SCHEMA, "version": SARIF_VERSION, "runs": [run]}

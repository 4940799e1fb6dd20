"""Replay files: the versioned JSON that makes a finding a deterministic reproducer, written
atomically. Format: docs/internals/app.md."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Callable

from kvaudit import atomic
from kvaudit.config import TargetConfig, json_value
from kvaudit.targets import config_from_dict, config_to_dict
from kvaudit.targets.registry import TargetUnavailable, UnknownTargetError, kind_of
from kvaudit.audit.findings import Finding, source_path
from kvaudit.program import Op, ProgramError, program_from_json, program_to_json
from kvaudit.program.ops import FORMAT as PROGRAM_FORMAT

FORMAT = "kvaudit.replay/1"
REPORT_FORMAT = "kvaudit.report/1"  # several replay files in one report (a campaign)


write_bytes_atomic, write_text_atomic = atomic.write_bytes_atomic, atomic.write_text_atomic


class ReplayFormatError(ValueError):
    """A file that is not a valid kvaudit replay file (message is one line)."""


class NothingRecordedError(ReplayFormatError):
    """The ``fuzz --json`` of a run interrupted during start-up (``"interrupted": true``, ``"executions": 0``,
    no ``config``: it was not built yet): a valid file that records no program to replay or report."""


class TargetNotLoadedError(ReplayFormatError):
    """A replay file whose ``config.target`` names a kind not registered in this process: a plugin's target
    whose plugin is not loaded (``KVAUDIT_PLUGINS``, an entry point). The message names the kind and how to
    load it."""


def _config(d, path: str) -> TargetConfig:
    try:
        return config_from_dict(d)
    except UnknownTargetError as e:
        raise TargetNotLoadedError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ReplayFormatError(f"{path}: bad config: {e}") from None


def engine_version(config: TargetConfig) -> str | None:
    """The release of the engine whose frames a run of ``config`` records, as its target kind's
    ``engine_source()`` says (a release overlay's when one is in front of ``sys.path``); None for an engine
    in this repository or an unknown release."""
    engine = kind_of(config).engine_source()
    return engine.version if engine is not None else None


def other_release(path: str, config: TargetConfig, doc: dict) -> str | None:
    """One line for a replay file ``doc`` recorded on another release of its engine than the installed one
    (its ``engine_version`` against :func:`engine_version`), saying whose lines its engine frames are and how
    to replay it on its own release; None when it names none or the installed one."""
    engine = kind_of(config).engine_source()  # (what engine_version reads: read once here)
    recorded, installed = doc.get("engine_version"), engine.version if engine is not None else None
    if recorded is None or recorded == installed or engine is None:
        return None
    pkg = engine.package
    # NOTE: the cache kvaudit.history.releases installs into (read here: history is above this layer)
    cache = os.environ.get("KVAUDIT_RELEASE_CACHE") or "~/.cache/kvaudit/releases"
    return (f"{path} was recorded on {pkg} {recorded}, not the installed {installed or 'none'}: its engine "
            f"frames' lines are {recorded}'s, and a run here can differ (on {recorded}: python -m "
            f"kvaudit.history.releases {pkg}=={recorded}, then PYTHONPATH={os.path.join(cache, f'{pkg}-{recorded}')})")


def to_doc(config: TargetConfig, program: list[Op], findings: list[Finding], **extra) -> dict:
    """A replay document: config (with its kind's ``target``), the engine's release (``engine_version``:
    :func:`engine_version`, unless ``extra`` names one; left out when None), program, findings, then the
    other ``extra`` keys."""
    version = extra.pop("engine_version") if "engine_version" in extra else engine_version(config)
    return {"format": FORMAT, "config": config_to_dict(config),
            **({"engine_version": version} if version is not None else {}), "program": program_to_json(program),
            "findings": [f.to_dict() for f in findings], **extra}


def doc_text(doc: dict) -> str:
    """``doc`` as a replay file's text, as :func:`write_atomic` writes it."""
    return json.dumps(doc, indent=2) + "\n"


def write_atomic(path: str, doc: dict) -> str:
    return write_text_atomic(path, doc_text(doc))


def rerecord(path: str, findings: list[Finding], timeline: Callable | None = None) -> str:
    """Write ``findings`` (a fresh replay of the file's program) back into the replay file at ``path``,
    keeping every other key; a timeline is recorded again by ``timeline(config, program)`` (passed down:
    reports are a layer above). Returns one line: ``updated``, ``unchanged`` or ``not updated: ...``
    (a lost finding, or another bug). Raises :class:`ReplayFormatError`, OSError."""
    config, program, recorded, doc = load(path)
    if recorded and not findings:
        return "not updated: its recorded finding(s) no longer reproduce"
    order = [f.signature for f in recorded]
    if recorded and not any(f.kind == recorded[0].kind for f in findings):  # another bug, not a re-record
        return (f"not updated: it recorded a {recorded[0].kind} and now yields "
                f"{', '.join(dict.fromkeys(f.kind for f in findings))} (another bug? re-record it by hand)")
    findings = sorted(findings, key=lambda f: order.index(f.signature) if f.signature in order else len(order))
    root = source_path("")  # the checkout: tracebacks name its files relative to it, as sites do
    new = {**doc, "findings": [{**d, "traceback": d["traceback"].replace(f'File "{root}', 'File "')}
                               if d.get("traceback") else d for d in (f.to_dict() for f in findings)]}
    if "timeline" in doc and timeline is not None:
        new["timeline"] = timeline(config, program)
    version = engine_version(config)  # NOTE: a file whose findings stay as they were keeps its lack of one
    if version is not None and (new != doc or "engine_version" in doc):  # after config, where to_doc puts it
        items = [(k, v) for k, v in new.items() if k != "engine_version"]
        at = next((i + 1 for i, (k, _) in enumerate(items) if k == "config"), 0)
        new = dict(items[:at] + [("engine_version", version)] + items[at:])
    # NOTE: the signature as the file writes it (what a CI, a suppression or a file name go by), else as made
    old_sigs = [d.get("signature") or f.signature for d, f in zip(doc.get("findings", []), recorded)]
    new_sigs = [f.signature for f in findings]
    changed = f" (signatures were {', '.join(old_sigs) or 'none'}; now {', '.join(new_sigs)})" \
        if old_sigs != new_sigs else ""
    if new == doc:
        return "unchanged"
    write_atomic(path, new)
    return f"updated: {len(findings)} finding(s) re-recorded{changed}"


MAX_STEM = 160  # a replay file name's stem: room left for ci's ".<preset>", home's ".<n>", ".json" (255 bytes)


def file_name(signature: str) -> str:
    """The replay file name of ``signature``: its characters outside ``[A-Za-z0-9_.-]`` made ``_``; past
    :data:`MAX_STEM` characters cut, with 10 hex digits of the signature's SHA-1 (a plugin's long signature made
    a name the file system refuses: the finding was not written)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", signature).strip("_")
    if len(stem) > MAX_STEM:
        import hashlib

        stem = stem[:MAX_STEM - 11] + "_" + hashlib.sha1(signature.encode()).hexdigest()[:10]
    return stem + ".json"


def target_name(config) -> str:
    """The name of ``config``'s target kind as its replay files record it (``config.target``)."""
    return config_to_dict(config)["target"]


def target_of(doc: dict) -> str:
    """The name of the target kind a valid replay document was recorded on (its config's ``target``, ``eut``
    when it names none). Raises :class:`ReplayFormatError` for a config this process cannot read."""
    return target_name(_config(doc["config"], "the replay document"))


def home(directory: str, signature: str, target: str, name: str | None = None) -> tuple[str, bool]:
    """Where a replay file of kind ``target`` named for ``signature`` goes in ``directory``: ``(path, has_it)``.
    ``<name>.json`` (``name``: that file name, ``file_name(signature)`` by default; a copy passes its own)
    unless that file is something else (another kind's replay file, which may record the same signature; a
    note; one that does not load): never written over, the next ``<name>.<n>.json`` (n = 2, 3, ...) that is
    free or is such a file is taken. ``has_it``: ``path`` already holds a replay file of kind ``target`` that
    records ``signature`` (to replace, or to leave as it is)."""
    stem = os.path.splitext(name or file_name(signature))[0]
    n = 1
    while True:
        path = os.path.join(directory, (f"{stem}.{n}" if n > 1 else stem) + ".json")
        if not os.path.lexists(path):
            return path, False
        if not os.path.isfile(path):  # a folder, a FIFO (reading one waits for a writer for ever), a dangling link
            n += 1
            continue
        try:
            config, _, findings, _ = load(path)
            if target_name(config) == target and any(f.signature == signature for f in findings):
                return path, True
        except ReplayFormatError:
            pass
        n += 1


class _Twice(Exception):
    """A key met twice in one JSON object (its name)."""


def _one_of_each(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set = set()
        raise _Twice(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


_LIBFUZZER_ARTIFACT = re.compile(r"(?:crash|leak|timeout|oom|slow-unit|minimized-from)-[0-9a-f]{40}")


def _sha1(path: str) -> str:
    import hashlib

    with open(path, "rb") as fh:
        return hashlib.sha1(fh.read()).hexdigest()


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8-sig") as fh:  # NOTE: UTF-8 whatever the locale; a BOM (an editor's) skipped
            doc = json.load(fh, object_pairs_hook=_one_of_each)
    except _Twice as e:
        raise ReplayFormatError(f"{path}: key {json_value(e.args[0], 60)} appears twice in one object (a JSON reader "
                                "would keep the last: delete the one not meant)") from None
    except OSError as e:
        raise ReplayFormatError(f"cannot read {path}: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and ints past Python's digit limit
        why = str(e).splitlines()[0]
        if "integer string conversion" in why:  # (Python's own hint names sys.set_int_max_str_digits)
            raise ReplayFormatError(f"{path} is not a kvaudit replay file (a number of more than "
                                    f"{sys.get_int_max_str_digits()} digits)") from None
        if _LIBFUZZER_ARTIFACT.fullmatch(os.path.basename(path)):  # (what a user has in hand after a crash)
            raise ReplayFormatError(
                f"{path} is a libFuzzer input (bytes), not a replay file: the atheris harness wrote its replay file "
                f"to KVAUDIT_FINDINGS_DIR (kvaudit fuzz: --out), the one whose input_sha1 is {_sha1(path)}; "
                "harnesses/fuzz_engine.py FILE reruns the input") from None
        if isinstance(e, json.JSONDecodeError) and not e.doc.strip():
            why = "the file is empty"
        elif isinstance(e, json.JSONDecodeError) and (e.pos >= len(e.doc.rstrip()) or e.msg.startswith("Unterminated")):
            why += " (the file ends there: cut short?)"
        raise ReplayFormatError(f"{path} is not JSON: {why}") from None
    except RecursionError:
        raise ReplayFormatError(f"{path} is not a kvaudit replay file (nested too deeply)") from None
    return _no_lone_surrogate(doc, path)


def _no_lone_surrogate(x, where: str):
    # NOTE: JSON's "\\ud800" escapes load as strings UTF-8 cannot encode
    stack = [x]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ReplayFormatError(f"{where}: a string holds an unpaired UTF-16 surrogate ({json_value(v, 40)})") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return x


def load(path: str) -> tuple[TargetConfig, list[Op], list[Finding], dict]:
    """Read and validate a replay file. Raises :class:`ReplayFormatError` with a one-line reason."""
    return _parse_replay(_read(path), path)


def parse_doc(doc, where: str) -> tuple[TargetConfig, list[Op], list[Finding], dict]:
    """:func:`load` of a document already parsed (from Redis, say); ``where`` names its origin."""
    return _parse_replay(_no_lone_surrogate(doc, where), where)


def _parse_replay(doc, path: str) -> tuple[TargetConfig, list[Op], list[Finding], dict]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else None
        if isinstance(got, str) and got.startswith("kvaudit.replay/"):  # a newer kvaudit's file, say
            raise ReplayFormatError(f"{path}: replay format {json_value(got)} is not supported by this kvaudit "
                                    f"(it reads {json_value(FORMAT)})")
        if got in _OTHER_FILES:  # (another kvaudit file: said what it is, in place of what it is not)
            what, use = _OTHER_FILES[got]
            up = [".."] if got == PROGRAM_FORMAT else []  # (C/programs/x.json: C/findings)
            findings = os.path.normpath(os.path.join(os.path.dirname(path), *up, "findings"))
            raise ReplayFormatError(f"{path} is {what}, not a replay file: {use.format(findings=findings)}")
        hint = " (a report of several cases: use 'kvaudit report')" if got == REPORT_FORMAT else ""
        raise ReplayFormatError(f"{path} is not a kvaudit replay file (want \"format\": \"{FORMAT}\"){hint}")
    return _parse(doc, path)


# the other files kvaudit writes, by "format": (what one is, what to use instead; {findings}: the campaign's
# folder of replay files beside it); written by kvaudit.search.bench, history.suite, search.campaign, corpus_fuzz
_OTHER_FILES = {
    "kvaudit.bench/1": ("a kvaudit bench report", "it holds trial statistics, no program or finding; its Markdown "
                                                  "(bench --out, benchmarks.md by default) is the one to read"),
    "kvaudit.bench-history/1": ("a kvaudit bench --suite history report",
                                "it holds trial statistics, no replay file; its Markdown (bench --out, "
                                "benchmarks-history.md by default) is the one to read"),
    "kvaudit.campaign/1": ("a campaign's run record",
                           "the campaign's findings are the replay files in {findings}"),
    PROGRAM_FORMAT: ("a campaign's corpus program (ops only: no config, no finding)",
                     "the campaign's findings are the replay files in {findings}"),
}


def load_cases(path: str) -> tuple[TargetConfig, list[tuple[TargetConfig, list[Op], list[Finding], dict]], dict]:
    """A replay file (one case) or a ``kvaudit.report/1`` document: its config (else the first case's),
    the cases as :func:`load` returns them and the document. Raises :class:`ReplayFormatError`."""
    doc = _read(path)
    if isinstance(doc, dict) and doc.get("format") == REPORT_FORMAT:
        cases = doc.get("cases")
        if not isinstance(cases, list) or not cases:
            raise ReplayFormatError(f"{path}: bad cases: want a non-empty list of replay documents")
        out = []
        for i, case in enumerate(cases):
            if not isinstance(case, dict) or case.get("format") != FORMAT:
                raise ReplayFormatError(f"{path}: case {i} is not a replay document")
            out.append(_parse(case, f"{path} case {i}"))
        top = _config(doc["config"], path) if isinstance(doc.get("config"), dict) else out[0][0]
        return top, out, doc
    case = _parse_replay(doc, path)  # the file is read once
    return case[0], [case], doc


# the keys of a replay document kvaudit reads; another one is kept as it is (a newer kvaudit's, a note)
_KEYS = {"format", "config", "engine_version", "program", "findings", "fuzzer", "seed", "confirmations", "minimized",
         "minimized_from"}


def _parse(doc: dict, path: str) -> tuple[TargetConfig, list[Op], list[Finding], dict]:
    if "config" not in doc and doc.get("interrupted") is True and doc.get("executions") == 0:
        raise NothingRecordedError(f"{path}: nothing recorded: the run was interrupted (Ctrl-C or SIGTERM) during "
                                   "start-up, before it checked anything (no config, no program)")
    for key in doc:
        if isinstance(key, str) and key not in _KEYS and key.lower() in _KEYS:  # (a hand edit's "Findings")
            raise ReplayFormatError(f"{path}: key {json_value(key, 60)} is not one kvaudit reads: keys are lower case "
                                    f"({json_value(key.lower())})")
    for key in ("config", "program"):
        if key not in doc:
            raise ReplayFormatError(f"{path}: missing key {json_value(key)}")
    if not isinstance(doc["config"], dict):
        raise ReplayFormatError(f"{path}: bad config: config must be an object")
    config = _config(doc["config"], path)
    try:
        program = program_from_json(doc["program"])
    except ProgramError as e:
        raise ReplayFormatError(f"{path}: bad program: {e}") from None
    recorded = doc.get("findings", [])
    if not isinstance(recorded, list) or not all(
            isinstance(f, dict) and {"kind", "pool", "message"} <= set(f) for f in recorded):
        raise ReplayFormatError(f"{path}: bad findings: want a list of objects with kind, pool and message")
    findings = []
    for i, f in enumerate(recorded):
        try:
            findings.append(Finding.from_dict(f))
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            raise ReplayFormatError(f"{path}: bad findings: {e} (finding #{i})") from None
    version = doc.get("engine_version")
    if version is not None and not (isinstance(version, str) and version):
        raise ReplayFormatError(f"{path}: bad engine_version: want the engine's release as a string, "
                                f"got {json_value(version, 60)}")
    for key, ok, want in (("fuzzer", lambda v: isinstance(v, str) and v, "the fuzzer's name as a string"),
                          ("seed", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                           "an integer >= 0 (--seed)")):
        if key in doc and not ok(doc[key]):  # (what reports name as the search that found it: tester 59b)
            raise ReplayFormatError(f"{path}: bad {key}: want {want}, got {json_value(doc[key], 60)}")
    kind = kind_of(config)
    try:
        presets = kind.any_release_presets()  # NOTE: a preset of any release: the probe judges the config
    except TargetUnavailable as e:  # the kind is loaded, its engine not installed here: what this host lacks
        raise TargetNotLoadedError(f"{path}: {e}") from None
    if config.preset not in presets and config.preset != "custom":
        raise ReplayFormatError(f"{path}: bad config: " + (kind.refusal(config.preset) or (
            f"unknown preset {json_value(config.preset)} (valid: {', '.join(presets)}, or custom)")))
    return config, program, findings, doc

"""The atheris (libFuzzer) harness for the built-in engine, audited by kvaudit: the logic behind
``harnesses/fuzz_engine.py``, which is only the ten-line shape atheris documents (instrument the engine,
then ``Setup`` and ``Fuzz``). Its flags and environment: harnesses/README.md; design notes:
docs/internals/fuzzers.md. This module imports neither the engine nor kvaudit's audit at import time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import pkgutil
import sys
import time
from collections import Counter


def instrument():
    """Import atheris and, under ``atheris.instrument_imports``, every module of the built-in engine (before
    kvaudit's audit imports it: libFuzzer's coverage is the engine's branches). Returns the atheris module;
    exits 69 (one line on stderr) without it."""
    try:
        import atheris
    except ImportError:
        from kvaudit.constants import EXIT_UNAVAILABLE, MISSING_ATHERIS  # neither imports the engine

        sys.stderr.write(f"fuzz_engine.py: {MISSING_ATHERIS}\n")
        sys.exit(EXIT_UNAVAILABLE)
    with atheris.instrument_imports(include=["engine_under_test"]):
        import engine_under_test

        for m in pkgutil.iter_modules(engine_under_test.__path__):
            importlib.import_module(f"engine_under_test.{m.name}")
    return atheris


class KvauditFinding(Exception):
    """A new finding; the message is its signature (raised so that libFuzzer records a crash)."""


def _die(msg: str) -> None:
    sys.stderr.write(f"fuzz_engine.py: {msg}\n")
    sys.exit(2)


def _config():
    from engine_under_test import UnknownBugError
    from kvaudit.config import UnknownPresetError, device_unavailable
    from kvaudit.targets import registry

    eut = registry.get("eut")  # NOTE: through the registry: no target kind is imported here
    EutConfig, get_preset = eut.config_class, eut.preset

    raw = os.environ.get("KVAUDIT_CONFIG", "").strip() or "default"
    bugs = frozenset(b.strip() for b in os.environ.get("KVAUDIT_BUGS", "").split(",") if b.strip())
    try:
        config = EutConfig.from_dict(json.loads(raw)) if raw.startswith("{") else get_preset(raw).config()
        config = config.replace(bugs=config.bugs | bugs) if bugs else config
    except (ValueError, TypeError, UnknownBugError, UnknownPresetError) as e:  # JSONDecodeError is a ValueError
        _die(f"bad KVAUDIT_CONFIG or KVAUDIT_BUGS: {e}")
    why = device_unavailable(config.device)  # (else every input is a crash: torch's AssertionError)
    if why is not None:
        _die(f"KVAUDIT_CONFIG: {why}")
    return config


CONFIG = KNOWN = SUPPRESSIONS = FINDINGS_DIR = STATS_DIR = MAX_OPS = None  # set by :func:`main`


def _setup() -> None:
    global CONFIG, KNOWN, SUPPRESSIONS, FINDINGS_DIR, STATS_DIR, MAX_OPS
    from kvaudit.audit.suppress import SuppressionError, SuppressionSet
    from kvaudit.config import json_value

    CONFIG = _config()
    known, suppress = os.environ.get("KVAUDIT_KNOWN"), os.environ.get("KVAUDIT_SUPPRESS")
    try:
        with open(known, encoding="utf-8") if known else contextlib.nullcontext(()) as fh:
            KNOWN = frozenset(line.strip() for line in fh if line.strip() and not line.startswith("#"))
    except OSError as e:
        _die(f"cannot read KVAUDIT_KNOWN file {known}: {e.strerror or e}")
    try:
        SUPPRESSIONS = SuppressionSet.load(suppress) if suppress else None
    except SuppressionError as e:
        _die(str(e))
    FINDINGS_DIR = os.path.abspath(os.environ.get("KVAUDIT_FINDINGS_DIR") or "kvaudit-findings")
    STATS_DIR = os.environ.get("KVAUDIT_STATS_DIR") or None
    try:
        MAX_OPS = int(os.environ.get("KVAUDIT_MAX_OPS") or 24)
    except ValueError:
        _die(f"KVAUDIT_MAX_OPS must be an integer, got {json_value(os.environ['KVAUDIT_MAX_OPS'], 40)}")
    if MAX_OPS < 1:  # (every input decoded to the final idle() alone: a session that fuzzed nothing, exit 0)
        _die(f"KVAUDIT_MAX_OPS must be at least 1, got {MAX_OPS}")


_counts = {"executions": 0, "ops": 0}
_suppressed: set = set()
_reached: Counter = Counter()  # Target.reach() summed: the driver's ``reached:`` line
_last_write = [0.0]


def _write_stats(force: bool = False) -> None:
    from kvaudit import replay

    now = time.monotonic()
    if STATS_DIR is None or not (force or now - _last_write[0] >= 1.0):
        return
    _last_write[0] = now
    doc = {"pid": os.getpid(), **_counts, "suppressed": sorted(_suppressed), "reached": dict(_reached)}
    try:
        replay.write_text_atomic(os.path.join(STATS_DIR, f"{os.getpid()}.json"), json.dumps(doc) + "\n")
    except OSError:
        pass  # statistics are best effort


def _keep_existing(path: str, ops: int, size: int) -> bool:
    """Whether ``path`` holds a reproducer at least as small (ops, then input bytes: ``-minimize_crash``
    leaves the smallest one)."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
        return (len(doc["program"]), int(doc.get("input_size", 1 << 30))) <= (ops, size)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def TestOneInput(data: bytes) -> None:
    """One libFuzzer input: decode, run audited, write and raise (:class:`KvauditFinding`) a new finding."""
    from kvaudit import replay
    from kvaudit.program.bytes_program import program_from_bytes
    from kvaudit.search.schedule import search_run

    program = program_from_bytes(data, CONFIG, MAX_OPS)
    ran, found = [], []
    with search_run(CONFIG, SUPPRESSIONS) as run:
        for op in program:
            ran.append(op)
            found = run.apply(op)
            if found:
                break
        else:
            found = run.finish()
        _suppressed.update(f.signature for f in run.suppressed)
        _reached.update(run.target.reach())
    _counts["executions"] += 1
    _counts["ops"] += len(ran)
    new = [f for f in found if f.signature not in KNOWN]
    if not new:
        _write_stats()
        return
    primary = new[0]
    findings = [primary] + [f for f in found if f is not primary]
    # NOTE: another file of its name (a note, another kind's replay file) is left as it is (replay.home)
    path, has_it = replay.home(FINDINGS_DIR, primary.signature, replay.target_name(CONFIG))
    if not (has_it and _keep_existing(path, len(ran), len(data))):
        replay.write_atomic(path, replay.to_doc(CONFIG, ran, findings, fuzzer="atheris",
                                                input_sha1=hashlib.sha1(data).hexdigest(), input_size=len(data)))
    _write_stats(force=True)
    raise KvauditFinding(primary.signature)


def main(atheris) -> None:
    """Read the environment (exit 2 on a bad value), then hand the inputs to libFuzzer."""
    _setup()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()

"""Coverage-guided search with atheris (libFuzzer), the driver behind ``kvaudit fuzz --fuzzer atheris``: it runs
``harnesses/fuzz_engine.py`` in a process group of its own, follows libFuzzer's status lines and reads back
the replay files the harness wrote for its findings.

Design notes (the work directory's layout, the stopping rules): docs/internals/fuzzers.md.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Callable

from kvaudit.config import TargetConfig
from kvaudit import replay
from kvaudit.atomic import scratch_dir
from kvaudit.program.bytes_program import V2_MAGIC, max_len
from kvaudit.data import data_path
from kvaudit.audit.findings import Finding
from kvaudit.search.fuzz import FuzzStats
from kvaudit.program import Op
from kvaudit.audit.runner import INTERRUPTED

HARNESS = data_path("harnesses", "fuzz_engine.py")
SEEDS_DIR = data_path("corpora", "seeds")
GRACE_S = 20.0  # past max_time: harness start-up (torch import, ~2-3 s) plus libFuzzer's wrap-up
KILL_WAIT_S = 3.0  # between SIGINT to the process group and SIGKILL
FOUND_WAIT_S = 30.0  # the longest wait for a finding's crash-* input, after its replay file

# "#1234\tNEW    cov: 345 ft: 678 corp: 12/96b lim: 8 exec/s: 567 rss: 300Mb ..." (plain mode) and
# "#1234: cov: 345 ft: 678 corp: 12 exec/s 567 oom/timeout/crash: 0/0/0 time: 9s job: 2 ..." (-fork)
_STATUS = re.compile(r"^#(\d+):?\s+(?:(\w+)\s+)?cov: (\d+) ft: (\d+) corp: (\d+)\S*\s+"
                     r"(?:lim: \d+ )?exec/s:? (\d+)")
_EXECUTED = re.compile(r"^(?:stat::number_of_executed_units: |Done (?=\d+ runs in))(\d+)")


class AtherisError(RuntimeError):
    """The harness could not run (bad environment, a harness error, a crash that is not a finding);
    the message ends with the tail of libFuzzer's log."""


class _Monitor:
    """libFuzzer's output, read on a thread into the log and the figures it reports."""

    def __init__(self, stream, log_path: str):
        self.executions = 0
        self.coverage = 0  # edges
        self.tail: list[str] = []
        self._stream, self._log_path = stream, log_path
        self.thread = threading.Thread(target=self._read, name="libfuzzer-output", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with open(self._log_path, "a", encoding="utf-8", errors="replace") as log:
            for raw in iter(self._stream.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                log.write(line + "\n")
                self.tail = (self.tail + [line])[-40:]
                self.parse(line)
            log.flush()

    def parse(self, line: str) -> None:
        m = _STATUS.match(line)
        if m:
            self.executions = max(self.executions, int(m.group(1)))
            cov = int(m.group(3))
            if cov or not self.coverage:  # -fork reports cov: 0 before its first merge
                self.coverage = cov
            return
        m = _EXECUTED.match(line)
        if m:
            self.executions = max(self.executions, int(m.group(1)))


def libfuzzer_seed(seed: int) -> int:
    """libFuzzer's ``-seed`` for ``seed``: 1..2**31-1 as is, others folded into that range (0 is "random")."""
    return seed if 0 < seed < 2 ** 31 else seed % (2 ** 31 - 2) + 1


def harness_command(corpus_dir: str, seed_dir: str | None, max_time: float, seed: int, work_dir: str,
                    workers: int = 1, max_ops: int = 24) -> list[str]:
    """The harness command line (``argv[0]`` is the harness itself: ``-fork`` re-executes it); inputs may be
    ``max_ops`` records long from the start (``-len_control=0``)."""
    cmd = [HARNESS, corpus_dir] + ([seed_dir] if seed_dir else []) + [
        f"-max_total_time={max(1, math.ceil(max_time))}", f"-seed={libfuzzer_seed(seed)}", "-print_final_stats=1",
        f"-artifact_prefix={os.path.join(work_dir, 'crashes')}{os.sep}", f"-max_len={max_len(max_ops)}",
        "-len_control=0"]
    if workers > 1:
        cmd += [f"-fork={workers}", "-ignore_crashes=0"]
    return cmd


def harness_env(config: TargetConfig, findings_dir: str, stats_dir: str | None = None,
                suppressions_path: str | None = None, known_path: str | None = None, max_ops: int = 24) -> dict:
    """The environment of a harness run (``os.environ`` with kvaudit's variables), with this interpreter's
    directory first on ``PATH``: the harness's ``#!/usr/bin/env python3`` runs the Python that runs kvaudit."""
    env = dict(os.environ)
    env.update(KVAUDIT_CONFIG=json.dumps(config.to_dict()), KVAUDIT_FINDINGS_DIR=os.path.abspath(findings_dir),
               KVAUDIT_MAX_OPS=str(max_ops), PYTHONUNBUFFERED="1")
    env.pop("KVAUDIT_BUGS", None)  # the config is complete
    for key, value in (("KVAUDIT_STATS_DIR", stats_dir), ("KVAUDIT_SUPPRESS", suppressions_path),
                       ("KVAUDIT_KNOWN", known_path)):
        if value:
            env[key] = os.path.abspath(value)
        else:
            env.pop(key, None)
    bindir = os.path.dirname(os.path.abspath(sys.executable))
    if os.path.exists(os.path.join(bindir, "python3")):
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def _new_crash(crashes_dir: str, before: set[str]) -> bool:
    return any(c.startswith("crash-") and c not in before for c in os.listdir(crashes_dir))


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to the harness's process group (libFuzzer prints its final stats and exits), then SIGKILL to
    the group: the leader if it is still there after KILL_WAIT_S, and any -fork child that outlives it."""
    with contextlib.suppress(ProcessLookupError):
        for sig in (signal.SIGINT, signal.SIGKILL):
            os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_WAIT_S)


def _read_stats(stats_dir: str) -> tuple[int, int, set, Counter]:
    """The harness's figures summed over its stats files (one per process: -fork's jobs): executions, ops,
    suppressed signatures, and what the programs reached (``Target.reach()``)."""
    executions = ops = 0
    suppressed: set = set()
    reached: Counter = Counter()
    for path in glob.glob(os.path.join(stats_dir, "*.json")):
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
            executions += int(doc.get("executions", 0))
            ops += int(doc.get("ops", 0))
            suppressed.update(doc.get("suppressed", ()))
            reached.update({str(k): int(v) for k, v in doc.get("reached", {}).items()})
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # a file being replaced: next time
    return executions, ops, suppressed, reached


def load_findings(findings_dir: str, known=frozenset()) -> list[tuple[str, list[Op], list[Finding]]]:
    """``(path, program, findings)`` of every readable replay file in ``findings_dir`` with a signature not
    in ``known``, oldest first."""
    out = []
    paths = sorted(glob.glob(os.path.join(findings_dir, "*.json")), key=lambda p: (os.path.getmtime(p), p))
    for path in paths:
        try:
            _, program, findings, _ = replay.load(path)
        except replay.ReplayFormatError:
            continue
        if findings and not all(f.signature in known for f in findings):
            out.append((path, program, findings))
    return out


def _clear(directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        if name.endswith(".json"):
            os.unlink(os.path.join(directory, name))


def atheris_search(config: TargetConfig, max_time: float, seed: int, stats: FuzzStats,
                   on_progress: Callable[[FuzzStats], None] | None = None, corpus_dir: str | None = None,
                   workers: int = 1, suppressions_path: str | None = None, known=frozenset(),
                   work_dir: str | None = None, use_seeds: bool = True,
                   max_ops: int = 24) -> tuple[list[Op], list[Finding]] | None:
    """Fuzz ``config`` with atheris for ``max_time`` seconds of libFuzzer time; return the first finding's
    ``(program, findings)`` (the program ends with the op that found it) neither ``known`` nor suppressed
    (``suppressions_path``), or None. ``work_dir`` None: a :func:`kvaudit.atomic.scratch_dir`; the work
    directory, the options and when the harness is stopped: docs/internals/fuzzers.md, "The atheris driver".
    Updates ``stats`` (``coverage``: ``"345 edges"``); ``on_progress(stats)`` at most every 0.25 s and at the end.
    Re-raises KeyboardInterrupt (or ``INTERRUPTED``) once the harness is stopped. Raises :class:`AtherisError`
    when the harness fails without writing a finding (it cannot start, libFuzzer reports a timeout or an
    out-of-memory input)."""
    with contextlib.nullcontext(work_dir) if work_dir is not None else scratch_dir("kvaudit-atheris-") as work:
        return _search(config, max_time, seed, stats, on_progress, corpus_dir, workers, suppressions_path,
                       frozenset(known), os.path.abspath(work), use_seeds, max_ops)


def _prepare(work_dir: str, corpus_dir: str | None, known: frozenset) -> tuple[str, str]:
    """Lay out ``work_dir`` for a run (docs/internals/fuzzers.md). Returns (corpus_dir, known.txt)."""
    corpus_dir = os.path.abspath(corpus_dir or os.path.join(work_dir, "corpus"))
    for d in ("findings", "stats"):
        _clear(os.path.join(work_dir, d))
    shutil.rmtree(os.path.join(work_dir, "tmp"), ignore_errors=True)
    for d in (corpus_dir, os.path.join(work_dir, "crashes"), os.path.join(work_dir, "tmp")):
        os.makedirs(d, exist_ok=True)
    if not os.listdir(corpus_dir):
        with open(os.path.join(corpus_dir, "v2-start"), "wb") as fh:
            fh.write(bytes([V2_MAGIC]))
    known_path = os.path.join(work_dir, "known.txt")
    with open(known_path, "w", encoding="utf-8") as fh:
        fh.writelines(f"{s}\n" for s in sorted(known))
    return corpus_dir, known_path


def _watch(proc: subprocess.Popen, deadline: float, findings_dir: str, crashes_dir: str, crashes_before: set,
           refresh: Callable[[], None]) -> None:
    """Wait for the harness to exit, or stop it at ``deadline`` or once a finding's crash input is in
    ``crashes_dir`` (at most FOUND_WAIT_S after its replay file). Raises KeyboardInterrupt on INTERRUPTED."""
    found_at = None
    while True:
        if INTERRUPTED.is_set():
            raise KeyboardInterrupt
        try:
            proc.wait(timeout=0.1)
            return
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            return _stop(proc)
        if found_at is None and any(n.endswith(".json") for n in os.listdir(findings_dir)):
            found_at = time.monotonic()  # the harness writes only unknown signatures
        if found_at is not None and (_new_crash(crashes_dir, crashes_before)
                                     or time.monotonic() - found_at > FOUND_WAIT_S):
            return _stop(proc)  # NOTE: -fork would wait for its other jobs
        refresh()


def _search(config, max_time, seed, stats, on_progress, corpus_dir, workers, suppressions_path, known, work_dir,
            use_seeds, max_ops):
    findings_dir, stats_dir = os.path.join(work_dir, "findings"), os.path.join(work_dir, "stats")
    crashes_dir = os.path.join(work_dir, "crashes")
    corpus_dir, known_path = _prepare(work_dir, corpus_dir, known)
    seed_dir = os.path.join(SEEDS_DIR, config.preset)
    seed_dir = seed_dir if use_seeds and os.path.isdir(seed_dir) and os.listdir(seed_dir) else None
    log_path = os.path.join(work_dir, "libfuzzer.log")
    open(log_path, "w").close()
    cmd = harness_command(corpus_dir, seed_dir, max_time, seed, work_dir, workers, max_ops)
    env = harness_env(config, findings_dir, stats_dir, suppressions_path, known_path, max_ops)
    env["TMPDIR"] = os.path.join(work_dir, "tmp")
    base_execs, base_ops, base_reached = stats.executions, stats.ops, Counter(stats.reached)
    crashes_before = set(os.listdir(crashes_dir))
    proc = subprocess.Popen(cmd, cwd=work_dir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    mon = _Monitor(proc.stdout, log_path)
    last_progress = last_stats = 0.0

    def refresh(force: bool = False, report: bool = True) -> None:
        nonlocal last_progress, last_stats
        now = time.monotonic()
        if force or now - last_stats >= 0.5:
            last_stats = now
            execs, ops, suppressed, reached = _read_stats(stats_dir)
            stats.executions = base_execs + max(mon.executions, execs)
            stats.ops = base_ops + ops
            stats.reached = Counter(base_reached)
            stats.reached.update(reached)  # (not ``+``: a counter at 0, a path not taken, is kept)
            stats.suppressed.update(suppressed)
        stats.coverage = f"{mon.coverage} edges"
        if report and on_progress is not None and (force or now - last_progress >= 0.25):
            last_progress = now
            on_progress(stats)

    stats.coverage = "0 edges"
    try:
        _watch(proc, time.monotonic() + max_time + GRACE_S, findings_dir, crashes_dir, crashes_before, refresh)
    except BaseException:
        _stop(proc)
        mon.thread.join(timeout=5)
        refresh(force=True, report=False)  # the figures of an interrupted run, for its message
        raise
    finally:
        if proc.poll() is None:
            _stop(proc)
        mon.thread.join(timeout=5)
        proc.stdout.close()
    refresh(force=True)
    found = load_findings(findings_dir, known)
    if found:
        _, program, findings = found[0]
        return program, findings
    # -fork goes on past timeouts and out-of-memory inputs (timeout-*, oom-* artifacts); a crash-*
    # without a replay file is the harness's own failure
    if proc.returncode not in (0, -signal.SIGINT, -signal.SIGKILL, 72) or _new_crash(crashes_dir, crashes_before):
        tail = "\n".join(mon.tail[-15:])
        raise AtherisError(f"atheris harness exited with code {proc.returncode} without a kvaudit finding "
                           f"(log: {log_path}); last lines:\n{tail}")
    return None

"""``kvaudit bench --suite history``: known SGLang and vLLM bugs searched for in the releases that shipped
them (each release an overlay, each search a child process: :mod:`kvaudit.history.worker`), then the
minimized programs replayed on the releases that fixed them; and the markdown report.

Design notes (the method, the statistics, the report): docs/internals/history.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import Callable

from kvaudit.atomic import scratch_dir
from kvaudit.history import releases
from kvaudit.history.catalogue import UNREACHED, all_bugs
from kvaudit.history.trial import HistoryTrial
from kvaudit.program import format_program, program_from_json
from kvaudit.search.bench import geomean_cells, summarize, table, trial_cells, vs_random_cells


class SuiteError(RuntimeError):
    """A release could not be installed or its child process failed; one line."""


class WorkerFailed(SuiteError):
    """A worker exited with an error; ``results``: the trials it had written before."""

    def __init__(self, message: str, results: list[dict]):
        super().__init__(message)
        self.results = results


@dataclass
class ReleaseUse:
    engine: str
    version: str
    overlay: str  # "" for the base environment
    bytes: int
    install_seconds: float


@dataclass
class HistoryResult:
    trials: list[HistoryTrial] = field(default_factory=list)
    releases: list[ReleaseUse] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    wall: float = 0.0
    interrupted: bool = False
    failures: list[str] = field(default_factory=list)  # "bug: what the worker said" per worker that failed

    def to_json(self) -> dict:
        return {"format": "kvaudit.bench-history/1", "settings": self.settings, "wall_seconds": round(self.wall, 1),
                "interrupted": self.interrupted, "failures": self.failures,
                "releases": [asdict(r) for r in self.releases], "trials": [asdict(t) for t in self.trials]}

    def found(self, bug_id: str) -> list[HistoryTrial]:
        return [t for t in self.trials if t.bug == bug_id and t.success]

    def ran(self, bug_ids: list[str]) -> list[str]:
        """The bugs of ``bug_ids`` with a trial (an interrupted suite leaves the rest not run)."""
        tried = {t.bug for t in self.trials}
        return [b for b in bug_ids if b in tried]


def _kill_group(proc) -> None:
    """SIGKILL ``proc``'s process group (each child runs in its own session): what it started dies with it and
    lets go of the pipe the parent reads (pip's build steps, a shell's ``sleep``)."""
    if proc.returncode is not None:  # reaped: its pid may be another's now
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # gone already (or not a group leader: the process alone)
        with contextlib.suppress(OSError):
            proc.kill()


class _Runner:
    """Child processes of one suite run; ``stop()`` (Ctrl-C) kills them, and each then returns the
    results its worker wrote so far."""

    def __init__(self, on_event: Callable[[str], None]):
        self.on_event = on_event
        self.stopped = threading.Event()
        self.procs: set = set()
        self.lock = threading.Lock()

    def stop(self) -> None:
        self.stopped.set()
        with self.lock:
            for p in self.procs:
                _kill_group(p)

    def tool(self, cmd: list[str]) -> tuple[int, str]:
        """``cmd`` (a release's pip install) as one of the children: ``stop()`` kills it too, so a second
        Ctrl-C does not leave the process waiting for pip (stop 61). Returns (exit code, stderr); (-1,
        "stopped") once stopped, without starting it."""
        with self.lock:
            if self.stopped.is_set():
                return -1, "stopped"
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            self.procs.add(proc)
        try:
            _, stderr = proc.communicate()
        finally:
            if proc.returncode is None:
                _kill_group(proc)
                proc.wait()
            with self.lock:
                self.procs.discard(proc)
        return proc.returncode, stderr

    def child(self, job: dict, engine: str, version: str, overlay) -> list[dict]:
        """Run one worker job under the release's environment and return its results. Raises
        :class:`SuiteError` when the worker fails (not when stopped: then the results so far)."""
        with scratch_dir("kvaudit-history-job-") as d:
            job_path, out_path = os.path.join(d, "job.json"), os.path.join(d, "out.json")
            with open(job_path, "w") as f:
                json.dump(job, f)
            env = releases.env(engine, version, overlay)
            env["PYTHONUNBUFFERED"] = "1"
            # the worker's temp files (its trials' dirs, torch's caches) inside the job's dir: removed with it
            # here, also when a Ctrl-C stops the worker with SIGKILL mid-trial (its own cleanup never runs)
            env["TMPDIR"] = d
            tail: list[str] = []
            with self.lock:
                if self.stopped.is_set():
                    return []
                # its own session: a Ctrl-C reaches the parent alone, which stops the children itself
                proc = subprocess.Popen([sys.executable, "-m", "kvaudit.history.worker", job_path, out_path],
                                        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                        start_new_session=True)
                self.procs.add(proc)
            rc = None
            try:
                for line in proc.stderr:
                    line = line.rstrip("\n")
                    if line.startswith("kvaudit history: "):
                        self.on_event(line[len("kvaudit history: "):])
                    tail = (tail + [line])[-5:]
                rc = proc.wait()
            finally:
                if rc is None:  # left early (on_event raised: our stderr a closed pipe, `2>&1 | head`): the
                    _kill_group(proc)  # worker must not outlive its dir, which it made again for its next out.json
                    proc.wait()
                with self.lock:
                    self.procs.discard(proc)
            results = []
            if os.path.exists(out_path):
                with open(out_path) as f:
                    results = json.load(f)["results"]
            if rc != 0 and not self.stopped.is_set():
                last = next((t for t in reversed(tail) if t.strip()), f"exit {rc}")
                if rc == 2:  # the worker's own refusal: the release is not the one asked for, or no target
                    raise SuiteError(f"{engine} {version}: {last.strip()}")
                raise WorkerFailed(f"{engine} {version}: the worker failed: {last.strip()}", results)
            return results


_INSTALL_LOCK = threading.Lock()


def _release(res: HistoryResult, engine: str, version: str, runner: _Runner) -> object:
    with _INSTALL_LOCK:  # one pip at a time; a release asked twice is installed once
        if runner.stopped.is_set():  # (Ctrl-C while it waited for another job's pip: no "installing" line, no pip)
            raise SuiteError(f"{engine} {version}: not installed, the suite was stopped")
        t0 = time.monotonic()
        try:
            overlay = releases.ensure(engine, version, runner.on_event, run=runner.tool)
        except releases.ReleaseError as e:
            raise SuiteError(str(e)) from None
        if not any(r.engine == engine and r.version == version for r in res.releases):
            res.releases.append(ReleaseUse(engine, version, str(overlay or ""), releases.size_bytes(overlay),
                                           round(time.monotonic() - t0, 1)))
    return overlay


def _job(runner: _Runner, res: HistoryResult, job: dict, engine: str, failure: str, goes_on: str) -> list[dict]:
    """``job``'s results on ``engine`` at ``job["version"]``. A worker that fails costs this job's remaining
    results only: listed in ``res.failures`` as ``failure: error``, its results so far returned."""
    overlay = _release(res, engine, job["version"], runner)
    try:
        return runner.child(job, engine, job["version"], overlay)
    except WorkerFailed as e:
        res.failures.append(f"{failure}: {e}")
        runner.on_event(f"{job['bug']}: {e} ({goes_on})")
        return e.results


def _one_bug(runner: _Runner, res: HistoryResult, bid: str, fuzzers: list[str], trials: int,
             budget: float) -> list[HistoryTrial]:
    bug = all_bugs()[bid]
    job = {"mode": "search", "bug": bid, "version": bug.buggy, "fuzzers": fuzzers,
           "seeds": list(range(1, trials + 1)), "budget": budget}
    found = [HistoryTrial(**d) for d in _job(runner, res, job, bug.engine, bid,
                                             "its trials so far are kept; the suite goes on")]
    ok = [t for t in found if t.success]
    if bug.fixed is None or bug.replay_blocked or not ok or runner.stopped.is_set():
        return found
    job = {"mode": "replay", "bug": bid, "version": bug.fixed, "programs": [t.program for t in ok]}
    try:
        replays = _job(runner, res, job, bug.engine, f"{bid} (replay)", "the suite goes on")
    except SuiteError:
        if runner.stopped.is_set():  # Ctrl-C killed the fixed release's pip: the trials found stand, not replayed
            return found
        raise
    for t, r in zip(ok, replays):
        t.fixed_clean, t.fixed_signatures = r["clean"], r["signatures"]
    if not runner.stopped.is_set():
        clean = sum(bool(t.fixed_clean) for t in ok)
        runner.on_event(f"{bid}: {clean}/{len(ok)} minimized program(s) clean on {bug.engine} {bug.fixed}")
    return found


def _collect(futures: dict, done: dict[str, list[HistoryTrial]]) -> bool:
    """After a Ctrl-C (the children being stopped): each bug's trials into ``done``, waiting for the
    workers still running. A second Ctrl-C (or SIGTERM) stops the wait: the bugs not finished by then count
    as not run. Returns whether the wait was stopped so."""
    try:
        for fut, bid in futures.items():
            if not fut.cancel():
                try:
                    done[bid] = fut.result()
                except SuiteError:
                    pass
        return False
    except KeyboardInterrupt:
        for fut, bid in futures.items():
            if bid not in done and fut.done() and not fut.cancelled() and fut.exception() is None:
                done[bid] = fut.result()
        return True


def run(bug_ids: list[str], fuzzers: list[str], trials: int, budget: float,
        on_event: Callable[[str], None] = print, jobs: int = 1) -> HistoryResult:
    """The suite, ``jobs`` bugs at a time (a child process each). On Ctrl-C the children are stopped and
    the result holds every trial they finished, with ``interrupted`` set (a second Ctrl-C while waiting
    for them: the bugs still running count as not run). A worker that fails (an error,
    not a finding) costs its bug's remaining trials only: it is listed in ``failures`` and the suite goes
    on. Raises :class:`SuiteError` when a release cannot be installed or a worker cannot start on it."""
    res = HistoryResult(settings={"suite": "history", "bugs": bug_ids, "fuzzers": fuzzers, "trials": trials,
                                  "budget": budget, "jobs": jobs, "cpu_count": os.cpu_count(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    t0 = time.monotonic()
    runner = _Runner(on_event)
    done: dict[str, list[HistoryTrial]] = {}
    abandoned = False
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    futures = {pool.submit(_one_bug, runner, res, bid, fuzzers, trials, budget): bid for bid in bug_ids}
    try:
        for fut in as_completed(futures):
            done[futures[fut]] = fut.result()
    except KeyboardInterrupt:
        res.interrupted = True
        runner.stop()
        abandoned = _collect(futures, done)
    except Exception:  # a SuiteError, or an on_event that failed (a closed pipe): the other workers stop too
        runner.stop()
        raise
    finally:
        pool.shutdown(wait=not abandoned, cancel_futures=True)
    for bid in bug_ids:  # in the order asked, whatever order they finished in
        res.trials += done.get(bid, [])
    res.wall = time.monotonic() - t0
    return res


def rediscovered(res: HistoryResult, bug_id: str) -> bool:
    """Found (3/3, minimized) on the buggy release by some trial whose program is clean on the fixing one
    (for a bug with no fixing release: found)."""
    bug = all_bugs()[bug_id]
    if bug.replay_blocked:
        return False  # found at most: the fixing release was not run
    return any(t.fixed_clean for t in res.found(bug_id)) if bug.fixed else bool(res.found(bug_id))


# -- the markdown report ---------------------------------------------------------------------------

def _bugs(res: HistoryResult, ids: list[str], bugs: dict, best: dict) -> list[str]:
    rows = []
    for bid in ids:
        b, ok, top = bugs[bid], res.found(bid), best[bid]
        replayed = [t for t in ok if t.fixed_clean is not None] if b.fixed and not b.replay_blocked else []
        fixed = f"{b.fixed} ({b.clean_because})" if b.fixed else "- (a rediscovery)"
        verdict = ("not run (interrupted)" if not any(t.bug == bid for t in res.trials) else
                   "yes" if rediscovered(res, bid) else
                   f"found; not replayed on the fixed release ({b.replay_blocked})" if ok and b.replay_blocked else
                   "found; NOT clean on the fixed release" if replayed else
                   f"found; not replayed on the fixed release{' (interrupted)' if res.interrupted else ''}"
                   if ok and b.fixed else "no")
        if replayed:  # (a trial whose replay on the fixed release did not run, interrupted, is not counted)
            verdict += f" ({sum(bool(t.fixed_clean) for t in replayed)}/{len(replayed)} programs clean" + (
                f"; {len(ok) - len(replayed)} not replayed)" if len(replayed) < len(ok) else ")")
        rows.append((bid, b.engine, b.buggy, fixed, verdict, f"{top.min_len if top else '-'} ops",
                     f"`{top.signature if top else b.signature or b.finding}`"))
    return ["", "## Bugs", ""] + table(("bug", "engine", "shipped in", "fixed in (why clean)", "rediscovered",
                                        "minimized program", "signature"), rows)


def _per_fuzzer(ids: list[str], fuzzers: list[str], by: dict) -> list[str]:
    return ["", "## Per bug and fuzzer", ""] + table(
        ("bug", "fuzzer", "found", "time to bug (s)", "executions to bug", "min ops", "p vs random", "A12 vs random"),
        ((c.bug, c.fuzzer, *trial_cells(c), *vs_random_cells(c))
         for c in filter(None, (by.get((bid, f)) for bid in ids for f in fuzzers))))


def _programs(best: dict, bugs: dict, raw: str) -> list[str]:
    shown = [(bid, t) for bid, t in best.items() if t is not None]
    if not shown:
        return []
    lines = ["", "## Minimized programs", "",
             "The shortest per bug, confirmed 3/3 on the release that shipped it; `kvaudit replay` runs it "
             f"once saved with its config (`{raw}` has every trial's)."]
    for bid, t in shown:
        fixed = (f"; on {bugs[bid].fixed}: " + ("clean" if t.fixed_clean else
                                                ", ".join(t.fixed_signatures) or "not replayed")
                 if bugs[bid].fixed else "")
        lines += ["", f"{bid} ({t.fuzzer}, seed {t.seed}; {t.confirmations}/3 confirmations{fixed}):", "", "```",
                  format_program(program_from_json(t.program)).rstrip("\n"), "```"]
    return lines


def _reached(b) -> str:
    if b.replay_file:  # a rediscovery: its triage is the corpus's, in the README beside the file
        return (f"- **{b.id}**: {b.title}, searched with that file's config (preset `{b.preset}`). "
                f"Reached: {b.reach or f'see {posixpath.dirname(b.replay_file)}/README.md'}")
    return (f"- **{b.id}** ({', '.join(b.sources)}): {b.title}. Preset `{b.preset}`"
            + (f" with {', '.join(f'{k}={v}' for k, v in b.config.items())}" if b.config else "")
            + f". Reached: {b.reach}")


def _not_run(by: dict, fuzzer: str, bug_ids: list[str]) -> str:
    """A headline cell's note on the bugs of ``bug_ids`` ``fuzzer`` had no trial of (an interrupted suite):
    counted apart, not as missed."""
    n = sum((b, fuzzer) not in by for b in bug_ids)
    return f" ({n} bug(s) not run: interrupted)" if n else ""


def markdown(res: HistoryResult, raw: str = "benchmarks-history.json") -> str:
    """The history-suite report; ``raw``: the name of the raw-data file written beside it."""
    s, bugs = res.settings, all_bugs()
    fuzzers, ids = s["fuzzers"], s["bugs"]
    cells = summarize(res.trials)
    by = {(c.bug, c.fuzzer): c for c in cells}
    best = {bid: min(res.found(bid), key=lambda t: t.min_len, default=None) for bid in ids}

    def hit(bid: str, fuzzer: str) -> bool:
        return bool(by.get((bid, fuzzer)) and by[(bid, fuzzer)].successes)

    tried = {f: [b for b in ids if (b, f) in by] for f in fuzzers}  # (an interrupted suite's others: not run)

    lines = [
        "# kvaudit on the history suite: known bugs in the releases that shipped them",
        "",
        f"Generated by `kvaudit bench --suite history --trials {s['trials']} --budget {s['budget']:g} --fuzzers "
        f"{','.join(fuzzers)} --jobs {s.get('jobs', 1)}"
        + (f" --bugs {','.join(ids)}" if set(ids) != set(bugs) else "")
        + f"` on {s['started']} ({s['cpu_count']} CPUs; wall time {res.wall / 60:.1f} min"
        + (", INTERRUPTED: partial" if res.interrupted else "") + f"). Raw data: `{raw}`."
        + (f" Added afterwards, with the same settings in a run of their own ({s['added']['started']}, "
           f"{s['added']['wall_seconds'] / 60:.1f} min) merged into this report: "
           f"{', '.join(s['added']['bugs'])}." if s.get("added") else ""),
        "",
        "Each bug x fuzzer: trials with seeds 1..N, at most the budget each, one core, in a child process "
        "whose `PYTHONPATH` starts with the release's overlay. A trial succeeds when a finding that is the "
        "bug (its kind, and its check or signature where the catalogue names one) is confirmed 3/3 and "
        "minimized on the release that shipped it; every other finding is suppressed (the program goes on "
        "past it, as with a campaign's suppression file). The bug is "
        "*rediscovered* when a minimized program, replayed and drained to idle on the first release with "
        "the fix, finds nothing. Times and executions are to the first detection (before triage): median "
        "[IQR] over successful trials, '-' when half the trials or more failed. p and A12 compare "
        "time-to-bug with `random` (Mann-Whitney U; A12 < 0.5: faster), failed trials counted as the budget; "
        "p is '-' with fewer than 2 trials.",
        "",
        "## Headline",
        "",
        "| | " + " | ".join(fuzzers) + " |",
        "|---|" + "---|" * len(fuzzers),
        "| bugs found (at least once) | " + " | ".join(f"{sum(hit(b, f) for b in ids)}/{len(tried[f])}"
                                                     + _not_run(by, f, ids) for f in fuzzers) + " |",
        "| geometric mean of median executions-to-bug vs random (target >= 3x fewer) | "
        + " | ".join(geomean_cells(cells, fuzzers)) + " |",
    ]
    if "random" in fuzzers:  # the other target: every bug random finds
        lines.append("| bugs random finds and this fuzzer misses (target: none) | " + " | ".join(
            "-" if f == "random" else (", ".join(b for b in tried[f] if hit(b, "random") and not hit(b, f)) or "none")
            + _not_run(by, f, [b for b in ids if hit(b, "random")]) for f in fuzzers) + " |")
    if res.failures:  # a worker's error cost its bug's remaining trials: the table is short of them
        lines += ["", "**Workers that failed** (an error in kvaudit or the engine, not a finding; the bug's "
                  "trials after it are missing from the tables):", ""]
        lines += [f"- {f}" for f in res.failures]
    lines += _bugs(res, ids, bugs, best) + _per_fuzzer(ids, fuzzers, by) + _programs(best, bugs, raw)
    lines += ["", "## What each bug is, and how a real server reaches it", ""] + [_reached(bugs[bid]) for bid in ids]
    lines += ["", "## Known bugs not in the suite", ""] + table(
        ("bug", "sources", "releases", "why not"),
        ((u.id, ", ".join(u.sources), u.releases, u.reason) for u in UNREACHED))
    if res.releases:
        lines += ["", "## Releases used", ""] + table(
            ("engine", "version", "overlay", "size on disk", "install or cache check (s)"),
            ((r.engine, r.version, "base environment" if not r.overlay else "cached overlay",
              f"{r.bytes / 2**20:.0f} MiB", f"{r.install_seconds:g}")
             for r in sorted(res.releases, key=lambda r: (r.engine, r.version))))
        total = sum(r.bytes for r in {(r.engine, r.version): r for r in res.releases}.values())
        lines.append(f"\nOverlays in all: {total / 2**30:.2f} GiB.")
    notes = [t for t in res.trials if t.note or t.others]
    if notes:
        lines += ["", "## Trial notes", ""]
        for t in notes:
            extra = f"suppressed on the way: {', '.join(f'`{o}`' for o in t.others)}" if t.others else ""
            lines.append(f"- {t.bug}, {t.fuzzer}, seed {t.seed}: " + "; ".join(x for x in (t.note, extra) if x))
    return "\n".join(lines) + "\n"

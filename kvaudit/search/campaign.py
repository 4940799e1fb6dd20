"""Campaigns: a time-boxed search that goes on past its findings, in N worker processes, over a corpus
directory that makes it resumable (``kvaudit fuzz --corpus DIR``); with ``--db``, across hosts
(:mod:`kvaudit.search.hub`). Design notes (the directory, the workers' messages, interrupts):
docs/internals/search.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

from kvaudit.config import TargetConfig, json_value
from kvaudit.constants import MINIMIZE_GRACE
from kvaudit.targets import config_from_dict, config_to_dict
from kvaudit.targets.registry import TargetDefinitionError
from kvaudit import replay
from kvaudit.reports.outputs import disk_full
from kvaudit.search import fuzzers
from kvaudit.search.fuzz import FuzzStats, SearchInterrupted, triage

PROGRESS_EVERY = 0.5  # seconds between a worker's progress messages


def findings_dir(corpus: str) -> str:
    return os.path.join(corpus, "findings")


def known_signatures(corpus: str, unreadable: list[str] | None = None, target: str | None = None,
                     others: list[tuple[str, str]] | None = None) -> dict[str, str]:
    """Signature -> replay file, for every signature a file in ``corpus`` records (its secondary ones
    too); an entry that is not a replay file (unreadable, a file not named ``*.json``, a directory) is
    skipped, its path appended to ``unreadable``; dot files (kvaudit's temporaries) are skipped unnamed.
    ``target``: the campaign's kind (:func:`kvaudit.replay.target_name`); a replay file recorded on another
    kind is skipped too, appended to ``others`` as ``(path, its kind)``: its signatures name another engine's
    parts."""
    files, rest = findings_files(corpus)
    if unreadable is not None:
        unreadable.extend(rest)
    out: dict[str, str] = {}
    for path, kind, signatures in _loaded(files, unreadable):
        if target is not None and kind != target:
            if others is not None:
                others.append((path, kind))
            continue
        for sig in signatures:
            out.setdefault(sig, path)
    return out


def recorded_kinds(corpus: str) -> dict[str, set[str]]:
    """Target kind -> the signatures the replay files in ``corpus``'s findings folder record on it (a file that
    does not load is skipped)."""
    out: dict[str, set[str]] = {}
    for _, kind, signatures in _loaded(findings_files(corpus)[0]):
        out.setdefault(kind, set()).update(signatures)
    return out


def findings_files(corpus: str) -> tuple[list[str], list[str]]:
    """The entries of ``corpus``'s findings folder, sorted: ``(the regular files named *.json, the others)``
    (paths); dot files (kvaudit's temporaries) are neither. Only the first are ever opened: a FIFO waits for a
    writer for ever."""
    d = findings_dir(corpus)
    names = sorted(n for n in os.listdir(d) if not n.startswith(".")) if os.path.isdir(d) else []
    paths = [os.path.join(d, n) for n in names]
    files = [p for p in paths if p.endswith(".json") and os.path.isfile(p)]
    regular = set(files)
    return files, [p for p in paths if p not in regular]


def skipped_lines(corpus: str, target: str) -> tuple[dict[str, str], list[str]]:
    """:func:`known_signatures` of a campaign of kind ``target`` over ``corpus``, and one warning line
    each for what it skips: the entries that are not replay files, the replay files of another kind."""
    unreadable: list[str] = []
    others: list[tuple[str, str]] = []
    known = known_signatures(corpus, unreadable, target, others)
    lines = []
    if unreadable:  # (left as they are, and never written over: a finding of that name gets the next free one)
        lines.append(f"{len(unreadable)} file(s) in {findings_dir(corpus)} are not replay files, skipped: "
                     + ", ".join(os.path.basename(p) for p in unreadable))
    if others:  # (left as they are, and never written over: a finding of this kind gets a name of its own)
        lines.append(f"{len(others)} replay file(s) in {findings_dir(corpus)} are another target kind's, not "
                     f"this campaign's ({target}): their signatures are not known here, skipped: "
                     + ", ".join(f"{os.path.basename(p)} ({kind})" for p, kind in others))
    return known, lines


def _loaded(paths: list[str], unreadable: list[str] | None = None) -> Iterator[tuple[str, str, list[str]]]:
    """``(file, its target kind, the signatures of its findings in order)`` for each of the replay files ``paths``
    that loads; the path of one that does not is appended to ``unreadable``."""
    for path in paths:
        try:
            config, _, findings, _ = replay.load(path)
        except replay.ReplayFormatError:
            if unreadable is not None:
                unreadable.append(path)
            continue
        yield path, replay.target_name(config), [f.signature for f in findings]


@dataclass
class CampaignResult:
    new: dict[str, str] = field(default_factory=dict)  # signature -> replay file, found by this run
    known: dict[str, str] = field(default_factory=dict)  # signature -> replay file, found before
    flaky: set[str] = field(default_factory=set)  # found, but not reproduced K of K
    stats: FuzzStats = field(default_factory=FuzzStats)
    interrupted: bool = False
    workers: int = 1
    fleet: dict[str, str] = field(default_factory=dict)  # signature -> replay file, found by another host meanwhile
    duplicates: dict[str, int] = field(default_factory=dict)  # signature -> times found while another worker held it
    warnings: list[str] = field(default_factory=list)  # the workers' (a malformed entry in Redis)
    # worker -> its suppression rules' usage so far (SuppressionSet.usage; the parent's set adds them up)
    suppression_usage: dict[int, list] = field(default_factory=dict)
    # a file not written on a full disk (a worker's replay file: the campaign stopped there, keeping what it had
    # found; or the run record, corpus/campaign.json): filename names it
    not_written: OSError | None = None
    also_not_written: list[str] = field(default_factory=list)  # files a full disk refused after not_written's
    unwritten: dict[str, str] = field(default_factory=dict)  # signature -> its replay file, found but not written


@dataclass
class _Spec:
    """What a worker needs (picklable: it crosses into a spawned process)."""

    index: int
    config: dict
    fuzzer: str
    seed: int
    budget: float  # seconds of search, from when this worker has built its first engine (not its start-up)
    corpus: str
    suppress_path: str | None
    workers: int  # atheris: libFuzzer -fork=N (one driver); others: this worker's share
    parent: int  # pid of the parent (a worker exits when it dies)
    use_seeds: bool = True  # atheris: read corpora/seeds/<preset> too
    step_timeout: float = 0.0  # the watchdog's limit on one engine step (kvaudit.audit.runner); 0: the default
    db: str | None = None  # a Redis URL: the campaign spans hosts (kvaudit.search.hub)
    campaign: str = "default"  # its name in Redis
    ttl: float = 30.0  # seconds a claim or heartbeat lives unrenewed

    @property
    def target(self) -> str:
        """The campaign's kind (:func:`kvaudit.replay.target_name`): the replay files of another are not its own."""
        return self.config["target"]


def _search_loop(spec: _Spec, emit: Callable[[tuple], None]) -> None:
    """Build the first engine, then search for ``spec.budget`` seconds, triaging and writing every new
    finding; ``emit`` tells the parent, ``("ready", i)`` once the engine is built and ``("done", i)`` last."""
    from kvaudit.audit.runner import set_step_timeout, warm_up
    from kvaudit.audit.suppress import SuppressionSet

    if spec.step_timeout > 0:
        set_step_timeout(spec.step_timeout)  # a spawned worker starts with the default
    config = config_from_dict(spec.config)
    warm_up(config)  # a spawned worker imports the engine again: its start-up is not search time
    fuzzers.get(spec.fuzzer).warm_up()  # (Hypothesis's first-run set-up)
    fuzzers.settle_heap()  # (a spawned worker's start-up objects: frozen, so full collections stay frequent)
    deadline = time.time() + spec.budget
    emit(("ready", spec.index))
    sset = SuppressionSet.load(spec.suppress_path) if spec.suppress_path else None
    os.makedirs(findings_dir(spec.corpus), exist_ok=True)
    hub = None
    if spec.db:
        from kvaudit.search import hub as hubs

        hub = hubs.Hub(hubs.connect(spec.db, check=False), spec.campaign, hubs.worker_id(spec.index), ttl=spec.ttl,
                       who=f"worker {spec.index}")
        # (before the first heartbeat, which start() sends: `campaign status` showed fuzzer=- until the next one)
        hub.beat(host=hubs.socket.gethostname(), pid=os.getpid(), fuzzer=spec.fuzzer, started=time.time())
        hub.start()
    worker = _Worker(spec, emit, config, sset, hub, known_signatures(spec.corpus, target=spec.target),
                     ends=time.monotonic() + deadline - time.time())
    try:
        while (left := deadline - time.time()) > 0:
            if hub is not None:
                worker.sync()
                left = min(deadline - time.time(), max(10.0, 2 * spec.ttl))  # rounds end to re-claim orphans
                if left <= 0:
                    break
            if not worker.round(left) and hub is None:  # the budget is spent (a fleet's rounds are shorter: go on)
                break
    finally:
        if hub is not None:
            hub.beat(**worker.counts)
            hub.stop()
            for w in hub.warnings:
                emit(("warning", spec.index, w))
    emit(("done", spec.index))


class _Worker:
    """One worker's rounds of search and what they share: the signatures it knows, those found flaky, its
    counts (for the fleet's heartbeat) and what the fuzzer keeps across rounds."""

    def __init__(self, spec: _Spec, emit: Callable[[tuple], None], config, sset=None, hub=None, known=(),
                 ends: float | None = None):
        self.spec, self.emit, self.config, self.sset, self.hub = spec, emit, config, sset, hub
        self.ends = ends  # time.monotonic() at the end of the search budget: minimization stops there (or later)
        self.fdir = findings_dir(spec.corpus)
        self.known, self.flaky = set(known), set()
        self.counts = {"new": 0, "duplicates": 0, "flaky": 0}
        self.stats = FuzzStats()
        self.kept: dict = {}  # :attr:`kvaudit.search.fuzzers.Search.kept`
        self.rounds = 0
        self._last_progress = 0.0

    def progress(self, s: FuzzStats, force: bool = False) -> None:
        if self.spec.parent and os.getppid() != self.spec.parent:
            os._exit(0)  # the parent is gone (kill -9): nobody reads our results
        if self.hub is not None:
            self.hub.beat(executions=s.executions, ops=s.ops,
                          coverage=s.coverage or f"{len(s.sites)} sites", **self.counts)
        if force or time.monotonic() - self._last_progress >= PROGRESS_EVERY:
            self._last_progress = time.monotonic()
            self.emit(("progress", self.spec.index, s.executions, s.ops, sorted(s.sites), sorted(s.suppressed),
                       s.coverage, dict(s.reached),
                       self.sset.usage() if self.sset is not None else None))

    def sync(self) -> None:
        """Between rounds of a fleet campaign: pull the fleet's files and known signatures; triage orphans."""
        spec, hub = self.spec, self.hub
        # (the rest stays in Redis on a full disk, known below)
        for sig, path in pull_files(hub, spec.corpus, spec.target):
            # announced even when known here (a duplicate): the parent must not count the file as this host's
            self.known.add(sig)  # own when it sweeps DIR/findings/ at the end
            self.emit(("pulled", spec.index, sig, path))
        self.known |= hub.known()
        orphans = hub.orphans()
        for sig, doc in orphans:
            # (one this worker met while another held it is in known, but it has no file: triage it now)
            if sig in self.flaky or sig in known_signatures(spec.corpus, target=spec.target):
                continue
            found_in, program, findings, _ = replay.parse_doc(doc, f"pending {sig}")  # the config it was found in
            # with the program's other orphaned signatures: one bug is one worker's
            mine = hub.claim([sig] + [f.signature for f in findings if f.signature in {s for s, _ in orphans}], doc)
            if sig not in mine:  # another worker took it first (its other signatures go back: theirs to triage)
                hub.release(mine)
                continue
            primary = next((f for f in findings if f.signature == sig), findings[0])
            self.triage_and_write(found_in, program, findings, primary, doc.get("seed", 0), mine)

    def round(self, left: float) -> bool:
        """One search of at most ``left`` seconds and the triage of what it found. Returns False when the
        search found nothing (its budget is spent)."""
        spec, hub = self.spec, self.hub
        self.known |= set(known_signatures(spec.corpus, target=spec.target))  # other workers' findings
        skip = frozenset(self.known | self.flaky)
        seed = spec.seed * 1_000_003 + spec.index * 7919 + self.rounds
        self.rounds += 1
        cut: KeyboardInterrupt | None = None  # an interrupt that came with a finding: it ends the round once written
        try:
            found = fuzzers.get(spec.fuzzer).search(self.config, left, seed, self.stats, fuzzers.Search(
                on_progress=self.progress, suppressions=self.sset, suppressions_path=spec.suppress_path, known=skip,
                corpus_dir=spec.corpus, workers=spec.workers, use_seeds=spec.use_seeds, hub=hub, kept=self.kept))
        except SearchInterrupted as e:  # stopping while Hypothesis shrank a failure: write it unminimized
            found, cut = e.found, e
        except KeyboardInterrupt:  # (the programs run since the last progress message are counted)
            self.progress(self.stats, force=True)
            raise
        self.progress(self.stats, force=True)
        if found is None:
            return False
        program, findings = found
        # the findings the campaign does not know yet (a known one may come first in the same op)
        on_disk = known_signatures(spec.corpus, target=spec.target)
        sigs = [s for s in _signatures(findings) if s not in skip]
        self.known.update(s for s in sigs if s in on_disk)
        sigs = mine = [s for s in sigs if s not in on_disk]
        if hub is not None and sigs:  # every signature of the program at once: one bug is one worker's
            first = next(f for f in findings if f.signature == sigs[0])
            pending = [first] + [f for f in findings if f is not first]
            mine = hub.claim(sigs, replay.to_doc(self.config, program, pending, fuzzer=spec.fuzzer, seed=seed,
                                                 minimized=False))
            for s in sigs:
                if s not in mine:  # another worker holds it, or the fleet has its file: a duplicate
                    self.known.add(s)
                    self.counts["duplicates"] += 1
                    self.emit(("duplicate", spec.index, s))
        if mine:
            primary = next(f for f in findings if f.signature == mine[0])
            self.triage_and_write(self.config, program, findings, primary, seed, mine, cut=cut)
        elif cut is not None:
            raise cut
        return True

    def triage_and_write(self, config, program, findings, primary, seed, claimed=(),
                         cut: KeyboardInterrupt | None = None) -> None:
        """Confirm and minimize ``primary``, then write and announce its replay file. ``claimed``: this
        worker's claims for ``program`` in the fleet. ``cut``: the interrupt that came with this finding: it is
        written unminimized, then ``cut`` is raised."""
        spec, hub, sset = self.spec, self.hub, self.sset
        sig = primary.signature
        try:
            if cut is not None:
                raise cut
            # NOTE: a replay can cost seconds (an idle() that never drains runs 2,000 steps): minimization ends
            # with the budget, or MINIMIZE_GRACE s after it starts; the file says so ("minimized": false)
            until = None if self.ends is None else max(self.ends, time.monotonic() + MINIMIZE_GRACE)
            crash = triage(config, program, primary, suppressions=sset.fresh() if sset is not None else None,
                           minimize_until=until, on_phase=lambda name: self.emit(("phase", spec.index, name, sig)))
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM while confirming or minimizing: keep it, unminimized
            doc = replay.to_doc(config, program, [primary] + [f for f in findings if f is not primary],
                                fuzzer=spec.fuzzer, seed=seed, minimized=False,
                                confirmations="interrupted before confirmation")
            new, path = self._write(None, doc)  # this host's files: it is stopping
            for s in new:
                self.emit(("finding", spec.index, s, path))
            raise
        if crash is None:
            self.flaky.add(sig)
            self.counts["flaky"] += 1
            if hub is not None:
                hub.flaky(sig)
                hub.release(claimed)
            self.emit(("flaky", spec.index, sig))
            return
        doc = replay.to_doc(config, crash.program, crash.findings, fuzzer=spec.fuzzer, seed=seed,
                            minimized=crash.minimized, confirmations=f"{crash.confirmations}/{crash.runs}",
                            original_length=crash.original_length, timeline=crash.timeline)
        before = set(self.known)
        with _held_interrupts():  # registered in the fleet, then written and announced here: whole, or not at all
            new, path = self._write(hub, doc)
            sigs = _signatures(crash.findings)
            if hub is not None:  # those the minimized program no longer raises: for any worker to triage on their own
                hub.release(claimed)
            self.known.update(sigs)
            for s in sigs:
                if s not in new:  # recorded by another worker's file: the parent does not count it as this host's
                    self.counts["duplicates"] += s not in before
                    self.emit(("duplicate", spec.index, s))
            self.counts["new"] += len(new)
            for s in new:
                self.emit(("finding", spec.index, s, path))
        if hub is not None:
            hub.beat(**self.counts)  # (the next heartbeat carries it, not the next round's first progress)

    def _write(self, hub, doc: dict) -> tuple[list[str], str]:
        """:func:`_register_and_write`; on an OSError (a full disk) the parent is told first which signatures
        were found but not written (``("unwritten", i, signatures, file)``): the error alone names a file."""
        try:
            return _register_and_write(self.spec.corpus, self.fdir, hub, doc)
        except OSError as e:
            sigs = [s for s in dict.fromkeys(f["signature"] for f in doc["findings"]) if s not in self.known]
            self.emit(("unwritten", self.spec.index, sigs, e.filename or self.fdir))
            raise


def _signatures(findings) -> list[str]:
    return list(dict.fromkeys(f.signature for f in findings))


def _register_and_write(corpus: str, fdir: str, hub, doc: dict) -> tuple[list[str], str]:
    """Write ``doc`` for the signatures no file of this host (nor, with ``hub``, of the fleet) records yet.
    Returns (those signatures, the file written), or ([], "") when there are none. Another target kind's
    replay file, or a file that is not a replay file, is never written over: the file takes the next free
    ``<name>.<n>.json`` (:func:`kvaudit.replay.home`)."""
    sigs = list(dict.fromkeys(f["signature"] for f in doc["findings"]))
    with open(os.path.join(corpus, ".findings.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker of this host at a time; released when the file closes
        target = doc["config"]["target"]
        on_disk = known_signatures(corpus, target=target)
        new = [s for s in sigs if s not in on_disk]
        if new and hub is not None:
            got = hub.register(new, replay.doc_text(doc))
            new = new if got is None else got
        if not new:
            return [], ""
        path, _ = replay.home(fdir, sigs[0] if sigs[0] in new else new[0], target)
        replay.write_atomic(path, doc)
    return new, path


@contextlib.contextmanager
def _held_interrupts():
    """Ctrl-C and SIGTERM wait for the end of the block, then raise KeyboardInterrupt (and set
    :data:`kvaudit.audit.runner.INTERRUPTED`). Signals a process ignores stay ignored; off the main
    thread nothing is held (Python runs handlers there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    held = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)
            if signal.getsignal(s) not in (signal.SIG_IGN, None)}
    for s in held:
        signal.signal(s, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
    if came:
        from kvaudit.audit.runner import INTERRUPTED

        INTERRUPTED.set()
        raise KeyboardInterrupt


def _worker_main(spec: _Spec, q) -> None:
    """A worker process: Ctrl-C is the parent's business, and it dies with the parent. The first SIGTERM
    stops it as Ctrl-C stops a search: a finding in triage is written unminimized first."""
    from kvaudit.audit.runner import INTERRUPTED, quiet_unraisable

    quiet_unraisable()  # a KeyboardInterrupt a gc callback swallows is not a traceback in the log

    def on_sigterm(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: the next would cut the write short
        INTERRUPTED.set()  # stops the next op even if a library swallows the KeyboardInterrupt
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the getppid() check in progress() does it
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    try:
        import torch

        torch.set_num_threads(1)
        _search_loop(spec, q.put)
    except KeyboardInterrupt:  # SIGTERM: what was found is written
        q.put(("done", spec.index))
    except Exception as e:  # report, do not hang the parent
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (see below)
        q.put(error_message(spec.index, e))
        q.put(("done", spec.index))
    finally:
        # NOTE: its end is said: the parent's SIGTERM (it stops the others when one failed) would only interrupt
        # the queue's flush at exit, a traceback in the log ("Process SpawnProcess-1: ... KeyboardInterrupt")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


_MISTAKES = {c.__name__: c for c in (TargetDefinitionError, fuzzers.FuzzerDefinitionError)}  # a plugin's own


def error_message(index: int, e: Exception) -> tuple:
    """What worker ``index`` tells its parent of the error that ended it: ``("error", index, text, errno,
    filename, strerror, mistake)``, errno, filename and strerror None but for an OSError (the parent stops the
    campaign on a full disk, keeping what it found, :class:`_Tally`); ``mistake``: ``(class name, message)`` of a
    plugin target's or fuzzer's own mistake (the parent raises it again, a usage error as in one process), else
    None."""
    oserror = (e.errno, e.filename, e.strerror) if isinstance(e, OSError) else (None, None, None)
    mistake = next(((name, str(e)) for name, cls in _MISTAKES.items() if isinstance(e, cls)), None)
    return ("error", index, f"{type(e).__name__}: {e}", *oserror, mistake)


CAMPAIGN_FORMAT = "kvaudit.campaign/1"  # corpus/campaign.json: {"format", "runs": [run record, ...], ...}


def _append_run_record(corpus: str, record: dict, warnings: list[str]) -> OSError | None:
    """Add ``record`` to ``corpus/campaign.json``, keeping the file's other top-level keys; the error (its filename
    that path) when it cannot be written: the run's result is the caller's to report all the same. Nothing the
    user had is lost: a file there that is not a JSON object is moved aside to ``campaign.json.unreadable``
    (``-1``, ``-2`` ... when taken) and a new one started; a ``runs`` that is not a list, and entries of ``runs``
    that are not run records (an object with a ``"started"`` time), are left out of the new file, the file as it
    was copied aside first. ``warnings`` says which."""
    path = os.path.join(corpus, "campaign.json")
    doc: dict = {"format": CAMPAIGN_FORMAT, "runs": []}
    try:
        with open(path, encoding="utf-8-sig") as fh:  # (UTF-8 whatever the locale; a BOM, an editor's, skipped)
            text = fh.read()
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError(f"a JSON {type(doc).__name__}, not an object")
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError) as e:
        doc, aside = {"format": CAMPAIGN_FORMAT, "runs": []}, _aside(path)
        with contextlib.suppress(OSError):
            os.replace(path, aside)
            warnings.append(f"{path} was not a run record ({type(e).__name__}: {e}): moved to {aside}, and a new "
                            "one started")
    entries = doc.get("runs", [])
    runs = [r for r in entries if _is_run_record(r)] if isinstance(entries, list) else []
    if not isinstance(entries, list):  # (its other keys kept, as below)
        left_out = f"its runs is a JSON {type(entries).__name__}, not a list of run records"
    elif len(runs) < len(entries):
        junk = [r for r in entries if not _is_run_record(r)]
        left_out = (f"{len(junk)} of its {len(entries)} runs are not run records (the first: "
                    f"{json_value(junk[0], 40)})")
    else:
        left_out = None
    if left_out is not None:
        aside = _aside(path)
        try:
            replay.write_text_atomic(aside, text)
        except OSError as e:  # (the file is left as it was, and this run's record not added: say that one)
            return OSError(e.errno, e.strerror, path)
        warnings.append(f"{path}: {left_out}: left out, the file as it was copied to {aside}")
    try:
        replay.write_atomic(path, {**doc, "format": CAMPAIGN_FORMAT, "runs": runs + [record]})
    except OSError as e:
        return e
    return None


def _is_run_record(entry) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("started"), str)


def _aside(path: str) -> str:
    """``path.unreadable``, else the first of ``path.unreadable-1``, ``-2`` ... that is not taken."""
    aside = path + ".unreadable"
    for n in itertools.count(1):
        if not os.path.lexists(aside):
            return aside
        aside = f"{path}.unreadable-{n}"


class _DiskFull(Exception):
    """A worker met a full disk (:attr:`CampaignResult.not_written` holds its error): the campaign stops."""


class _Tally:
    """The parent's side of the workers' messages: each is folded into the campaign's result."""

    def __init__(self, result: CampaignResult, on_progress, on_finding):
        self.result, self.on_progress, self.on_finding = result, on_progress, on_finding
        self.ready: set[int] = set()
        self.per_worker: dict[int, tuple] = {}
        self.reached: dict[int, dict] = {}  # worker -> its Target.reach() sums so far
        self.triaging: dict[int, str] = {}  # worker -> what it is doing to a finding (seconds with no progress)

    def _triaged(self, index: int | None) -> None:
        """Worker ``index`` is done with its finding (None: none is); the phase names those still at theirs."""
        self.triaging.pop(index, None)
        self.result.stats.phase = "; ".join(["fuzzing", *self.triaging.values()])

    def __call__(self, msg: tuple) -> None:
        kind, index = msg[0], msg[1]
        result, stats = self.result, self.result.stats
        if kind == "ready":  # a worker built its first engine: the search's clock starts with the first
            if not self.ready:
                stats.started = time.monotonic()
            self.ready.add(index)
        elif kind == "phase":  # a worker confirming or minimizing a finding: the progress line says which
            self.triaging[index] = f"worker {index} {msg[2]} {msg[3]}"
            self._triaged(None)
        elif kind == "progress":
            self._triaged(index)
            self.per_worker[index] = msg[2:4]
            stats.sites.update(map(tuple, msg[4]))
            stats.suppressed.update(msg[5])
            stats.executions = sum(v[0] for v in self.per_worker.values())
            stats.ops = sum(v[1] for v in self.per_worker.values())
            if msg[6] is not None:
                stats.coverage = msg[6]
            self.reached[index] = msg[7]
            if msg[8] is not None:
                result.suppression_usage[index] = msg[8]
            stats.reached = Counter()
            for counts in self.reached.values():
                stats.reached.update(counts)  # (update keeps a 0: a path no program reached)
        elif kind == "finding":
            sig, path = msg[2], msg[3]
            self._triaged(index)
            if sig not in result.new and sig not in result.known:
                result.new[sig] = path
                stats.findings = len(result.new)
                if self.on_finding:
                    self.on_finding(sig, path)
        elif kind == "unwritten":
            for sig in msg[2]:
                if sig not in result.new and sig not in result.known:
                    result.unwritten.setdefault(sig, msg[3])
        elif kind == "flaky":
            result.flaky.add(msg[2])
            self._triaged(index)
        elif kind == "pulled":
            if msg[2] not in result.new and msg[2] not in result.known:
                result.fleet.setdefault(msg[2], msg[3])
        elif kind == "duplicate":
            result.duplicates[msg[2]] = result.duplicates.get(msg[2], 0) + 1
        elif kind == "warning":  # (one line for a text several workers sent: a malformed entry in Redis)
            if msg[2] not in result.warnings:
                result.warnings.append(msg[2])
        elif kind == "error":
            if msg[3] is not None:
                error = OSError(msg[3], f"{msg[5] or msg[2]}, in worker {index}", msg[4])
                if disk_full(error):  # the campaign stops with what it found; the CLI says so in one line (exit 74)
                    result.not_written = result.not_written or error
                    raise _DiskFull
                raise OSError(msg[3], f"worker {index}: {msg[2]}", msg[4])
            if msg[6] is not None:  # (the same mistake in every worker: said once, as one process says it)
                name, text = msg[6]
                raise _MISTAKES[name](text)
            raise RuntimeError(f"worker {index}: {msg[2]}")
        if self.on_progress:
            self.on_progress(stats)


@contextlib.contextmanager
def sigint_ignored_at_birth():
    """Processes started inside the block begin with SIGINT ignored: a disposition ``exec`` keeps and Python's
    start-up leaves alone, so a terminal's Ctrl-C (sent to the whole process group) cannot interrupt a spawned
    worker's imports before :func:`_worker_main` ignores SIGINT itself; it printed multiprocessing's traceback
    from the worker's ``import torch`` (tester, stop 55). The parent ignores a Ctrl-C during the starts
    (milliseconds); its handler is back after them."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _run_workers(specs: list[_Spec], handle: Callable[[tuple], None]) -> None:
    """One spawned process per spec, its messages handed to ``handle`` until each says done or all are gone;
    then they are stopped (SIGTERM: a worker in triage writes its finding first; SIGKILL after 5 s). A worker gone
    without saying done (killed: the OOM killer) is named in a ``warning`` message."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(s, q), daemon=True) for s in specs]
    with sigint_ignored_at_birth():
        for p in procs:
            p.start()
    try:
        running, done = len(procs), set()
        while running:
            try:
                msg = q.get(timeout=0.5)
            except queue_mod.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if msg[0] == "done":
                running -= 1
                done.add(msg[1])
            handle(msg)
        gone = [(s.index, p.exitcode) for s, p in zip(specs, procs) if s.index not in done]
        for index, code in gone:
            handle(("warning", index, f"worker {index} ended {_ended(code)} mid-run: the campaign searched on with "
                                      f"{len(procs) - len(gone)} of {len(procs)} workers"))
    finally:
        if not running:  # every worker said done: let them exit on their own first
            for p in procs:
                p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        _drain(q, handle)


def _ended(exitcode: int | None) -> str:
    """How a process ended, from its ``exitcode`` (negative: the signal's number)."""
    if exitcode is None or exitcode >= 0:
        return f"with exit code {exitcode}"
    try:
        return f"by {signal.Signals(-exitcode).name}"
    except ValueError:  # (a number Python has no name for)
        return f"by signal {-exitcode}"


# what a worker says of its findings, and its last progress (its programs since the one before), read after the
# workers stopped (what else they said then is moot)
_FINDING_NEWS = ("finding", "unwritten", "duplicate", "flaky", "pulled", "progress")


def _drain(q, handle: Callable[[tuple], None]) -> None:
    """The findings news the stopped workers left in ``q``: a worker stopped in triage writes its finding and
    then says so, after the parent stopped reading (Ctrl-C, a worker's error). Handled, so that every file this
    run's workers wrote is announced, and the end's sweep counts any other file as another process's; and
    their last progress, so that the run's counts take in the programs run since the one before. The pipe
    is read without waiting: a worker killed mid-write (a message over the pipe's atomic size, into a pipe full
    since the parent stopped reading) left part of one, whose rest never comes; that ends the drain."""
    with contextlib.suppress(AttributeError, OSError, ValueError):  # (NOTE: the queue's private end)
        os.set_blocking(q._reader.fileno(), False)
    while True:
        try:
            msg = q.get_nowait()
        except (queue_mod.Empty, OSError, ValueError, EOFError):  # (BlockingIOError: the cut message)
            return
        if msg[0] in _FINDING_NEWS:
            handle(msg)


def pull_files(hub, corpus: str, target: str | None = None) -> list[tuple[str, str]]:
    """The fleet's replay files that ``corpus`` lacks (a campaign of kind ``target``: its own kind's files), written
    into its findings: ``(signature, path)`` for each finding they record. A full disk ends the pull (what was
    written is returned; the rest stays in Redis)."""
    pulled: list[str] = []
    try:
        hub.pull_findings(findings_dir(corpus), have=set(known_signatures(corpus, target=target)), written=pulled)
    except OSError:
        pass
    return [(sig, path) for path, _, signatures in _loaded(pulled) for sig in signatures]


def run_campaign(config: TargetConfig, fuzzer: str, max_time: float, seed: int, workers: int, corpus: str,
                 suppress_path: str | None = None, on_progress: Callable[[FuzzStats], None] | None = None,
                 on_finding: Callable[[str, str], None] | None = None, use_seeds: bool = True,
                 db: str | None = None, campaign: str = "default") -> CampaignResult:
    """Search for ``max_time`` seconds per worker, counted from when it has built its first engine
    (``stats.started``: when the first was ready). ``on_finding(signature, path)``: once per new signature,
    as it lands. Ctrl-C stops the workers and returns what was found (``interrupted`` set). ``db``: a Redis
    URL that makes the workers part of campaign ``campaign`` across hosts (a claim or heartbeat lives
    $KVAUDIT_FLEET_TTL seconds unrenewed, default 30); ``fleet``: the findings pulled from it during this run.
    Raises OSError if ``corpus`` cannot be written."""
    os.makedirs(findings_dir(corpus), exist_ok=True)
    fleet, target, ttl = None, replay.target_name(config), _Spec.ttl
    if db is not None:  # the fleet's findings are known before the first program runs (those its kind lacks)
        from kvaudit.search import hub as hubs

        ttl = hubs.fleet_ttl()  # (read only for a fleet: a local campaign holds no claims, a bad value is no error)
        fleet = hubs.Hub(hubs.connect(db), campaign, hubs.worker_id(-1), ttl=ttl)
        fleet.pull_findings(findings_dir(corpus), have=set(known_signatures(corpus, target=target)))
    result = CampaignResult(known=known_signatures(corpus, target=target), workers=workers)
    stats = result.stats
    handle = _Tally(result, on_progress, on_finding)
    # a fuzzer that parallelizes inside itself (atheris: libFuzzer -fork=N re-executes the harness) has one driver
    drivers = 1 if fuzzers.get(fuzzer).one_driver else workers
    from kvaudit.audit.runner import step_timeout

    specs = [_Spec(i, config_to_dict(config), fuzzer, seed, max_time, corpus, suppress_path, workers,
                   os.getpid() if drivers > 1 else 0, use_seeds, step_timeout(), db, campaign, ttl)
             for i in range(drivers)]
    started = time.time()
    try:
        if drivers == 1:
            _search_loop(specs[0], handle)
        else:
            _run_workers(specs, handle)
    except KeyboardInterrupt:
        result.interrupted = True
    except _DiskFull:  # (a worker's: its error is the result's)
        pass
    except OSError as e:  # the one driver's own, in this process
        if not disk_full(e):
            raise
        result.not_written = e
    if fleet is not None and result.duplicates and result.not_written is None:
        # what this host met while another held it: the workers pull the fleet's files between rounds only, so
        # one met in the last round ended without its file here (tester, stop 55). The start's hub: an outage
        # since then pulls nothing (connect() would raise); a full disk leaves the rest in Redis
        for sig, path in pull_files(fleet, corpus, target):
            handle(("pulled", -1, sig, path))
    for sig, path in known_signatures(corpus, target=target).items():
        if any(sig in d for d in (result.new, result.known, result.fleet)):
            continue
        # every file this run's workers wrote was announced (those written as they stopped: _drain); this one another
        # process sharing DIR wrote while this run searched: known here, as it would be had it been there at the start
        result.known[sig] = path
    stats.phase = "interrupted" if result.interrupted else "done"
    not_recorded = _append_run_record(corpus, {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        "fuzzer": fuzzer, "workers": workers, "seed": seed, "preset": config.preset, "bugs": sorted(config.bugs),
        "executions": stats.executions, "ops": stats.ops, "new": sorted(result.new), "known": sorted(result.known),
        "interrupted": result.interrupted}, result.warnings)
    if result.not_written is not None and not_recorded is not None:
        result.also_not_written.append(not_recorded.filename)
    result.not_written = result.not_written or not_recorded
    return result

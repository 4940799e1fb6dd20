"""Campaigns: a time-boxed search that goes on past its findings, in N worker processes, over a
corpus directory that makes it resumable.

Corpus directory layout (``kvaudit fuzz --corpus DIR``)::

    DIR/findings/<signature>.json   one confirmed, minimized replay file per signature
    DIR/hypothesis/                 Hypothesis's example database (saved examples replay first; one
                                    whose finding is known by then replays clean and Hypothesis drops
                                    it, so it keeps only failures not yet triaged)
    DIR/atheris/                    libFuzzer's corpus of interesting inputs
    DIR/campaign.json               one record per run of the campaign (time, executions, findings)

Every file is written atomically (temporary file + rename), so a campaign killed at any moment
(``kill -9`` included) leaves only whole files, and a rerun with the same ``DIR`` resumes: the
findings already on disk are *known* -- the search treats their signatures as it treats
suppressed findings (the program stops, the search goes on) and never reports them as new.

Workers share nothing but ``DIR``: each one searches with its own seed, triages (confirms,
minimizes) what it finds and writes the replay file for the signatures no file in ``DIR/findings/``
records yet, checked and written under ``DIR/.findings.lock`` (so two workers that found one bug,
even from two of its signatures, write one file; the other writes nothing); the parent process
counts each signature once. A worker exits when its parent dies. With ``--db`` the fleet's files
count too (:mod:`kvaudit.search.hub`: a program's signatures are claimed together, a file's
registered together).

Ctrl-C or SIGTERM (the parent sends its workers SIGTERM when it is interrupted) while a finding
is being confirmed or minimized writes it unminimized (``"minimized": false``) before stopping;
the parent counts every file that landed while its workers stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvaudit.config import TargetConfig
from kvaudit.targets import config_from_dict, config_to_dict
from kvaudit import replay
from kvaudit.search import fuzzers
from kvaudit.search.fuzz import FuzzStats, SearchInterrupted, triage

PROGRESS_EVERY = 0.5  # seconds between a worker's progress messages


def findings_dir(corpus: str) -> str:
    return os.path.join(corpus, "findings")


def known_signatures(corpus: str) -> dict[str, str]:
    """Signature -> replay file of every finding already in ``corpus``: every signature a file
    records, not only its primary one, so that a program producing a known finding together with
    the secondary finding saved beside it is not a new crash (unreadable files skipped)."""
    out: dict[str, str] = {}
    d = findings_dir(corpus)
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            _, _, findings, _ = replay.load(os.path.join(d, name))
        except replay.ReplayFormatError:
            continue
        for f in findings:
            out.setdefault(f.signature, os.path.join(d, name))
    return out


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


def _search_loop(spec: _Spec, emit: Callable[[tuple], None]) -> None:
    """Build the first engine, then search for ``spec.budget`` seconds, triaging and writing every new
    finding; ``emit`` tells the parent ("ready", i) once the engine is built (the search's clock
    starts), ("progress", i, executions, ops, sites, suppressed), ("finding", i, signature, path),
    ("flaky", i, signature) and finally ("done", i)."""
    from kvaudit.audit.runner import set_step_timeout, warm_up
    from kvaudit.audit.suppress import SuppressionSet

    if spec.step_timeout > 0:
        set_step_timeout(spec.step_timeout)  # a spawned worker starts with the default
    config = config_from_dict(spec.config)
    warm_up(config)  # a spawned worker imports the engine again: its start-up is not search time
    fuzzers.get(spec.fuzzer).warm_up()  # (Hypothesis's first-run set-up)
    deadline = time.time() + spec.budget
    emit(("ready", spec.index))
    sset = SuppressionSet.load(spec.suppress_path) if spec.suppress_path else None
    stats = FuzzStats()
    fdir = findings_dir(spec.corpus)
    os.makedirs(fdir, exist_ok=True)
    last = [0.0]

    def progress(s: FuzzStats, force: bool = False) -> None:
        if spec.parent and os.getppid() != spec.parent:
            os._exit(0)  # the parent is gone (kill -9): nobody reads our results
        if force or time.monotonic() - last[0] >= PROGRESS_EVERY:
            last[0] = time.monotonic()
            emit(("progress", spec.index, s.executions, s.ops, sorted(s.sites), sorted(s.suppressed),
                  getattr(s, "coverage", None)))

    counts = {"new": 0, "duplicates": 0, "flaky": 0}  # this worker's, for the fleet's heartbeat
    hub = None
    if spec.db:
        from kvaudit.search import hub as hubs

        hub = hubs.Hub(hubs.connect(spec.db, check=False), spec.campaign, hubs.worker_id(spec.index),
                       ttl=spec.ttl).start()
        hub.beat(host=hubs.socket.gethostname(), pid=os.getpid(), fuzzer=spec.fuzzer, started=time.time())
        inner_progress = progress

        def progress(s: FuzzStats, force: bool = False) -> None:  # noqa: F811 (the heartbeat's figures too)
            hub.beat(executions=s.executions, ops=s.ops, coverage=getattr(s, "coverage", None) or f"{len(s.sites)} sites",
                     **counts)
            inner_progress(s, force)

    known = set(known_signatures(spec.corpus))
    flaky: set[str] = set()
    round_ = 0
    kept: dict = {}  # what the fuzzer keeps across rounds (the corpus fuzzer's Corpus and CorpusStore, DIR/programs/)
    try:
        while True:
            left = deadline - time.time()
            if left <= 0:
                break
            if hub is not None:
                _sync(hub, config, spec, fdir, known, flaky, sset, emit, counts)
                left = min(deadline - time.time(), max(10.0, 2 * spec.ttl))  # rounds end to re-claim orphans
                if left <= 0:
                    break
            found = _round(spec, config, sset, stats, progress, emit, fdir, known, flaky, round_, hub, counts, left,
                           kept)
            round_ += 1
            if not found and hub is None:  # the budget is spent (a fleet's rounds are shorter: go on)
                break
    finally:
        if hub is not None:
            hub.beat(**counts)
            hub.stop()
            for w in hub.warnings:
                emit(("warning", spec.index, w))
    emit(("done", spec.index))


def _sync(hub, config, spec: _Spec, fdir: str, known: set, flaky: set, sset, emit, counts: dict) -> None:
    """Between rounds of a fleet campaign: pull the fleet's replay files (announced as ``pulled``),
    learn its known signatures, and re-claim and triage any finding whose claimant died."""
    for path in hub.pull_findings(fdir, have=set(known_signatures(spec.corpus))):
        try:
            _, _, findings, _ = replay.load(path)
        except replay.ReplayFormatError:
            continue
        for f in findings:  # announced even when known here (a duplicate): the parent must not count the file
            known.add(f.signature)   # as this host's own when it sweeps DIR/findings/ at the end
            emit(("pulled", spec.index, f.signature, path))
    known |= hub.known()
    orphans = hub.orphans()
    for sig, doc in orphans:
        # (one this worker met while another held it is in known, but it has no file: triage it now)
        if sig in flaky or sig in known_signatures(spec.corpus):
            continue
        found_in, program, findings, _ = replay.parse_doc(doc, f"pending {sig}")  # the config it was found in
        # with the program's other orphaned signatures: one bug is one worker's
        mine = hub.claim([sig] + [f.signature for f in findings if f.signature in {s for s, _ in orphans}], doc)
        if sig not in mine:  # another worker took it first (its other signatures go back: theirs to triage)
            hub.release(mine)
            continue
        primary = next((f for f in findings if f.signature == sig), findings[0])
        _triage_and_write(spec, found_in, sset, emit, fdir, program, findings, primary, doc.get("seed", 0), known,
                          flaky, hub, counts, mine)


def _signatures(findings) -> list[str]:
    """The distinct signatures of ``findings``, in order (a replay file's primary first)."""
    return list(dict.fromkeys(f.signature for f in findings))


@contextlib.contextmanager
def _findings_lock(corpus: str):
    """Hold ``DIR/.findings.lock`` (``flock``): one worker of this host at a time checks which
    signatures the files in ``DIR/findings/`` record and writes a file there."""
    with open(os.path.join(corpus, ".findings.lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _register_and_write(corpus: str, fdir: str, hub, doc: dict) -> tuple[list[str], str]:
    """Write the replay document ``doc`` into ``fdir`` for the signatures it records that no file
    records yet: this host's files, checked and written under :func:`_findings_lock`, and the fleet's,
    registered in one atomic step (:meth:`kvaudit.search.hub.Hub.register`; offline, this host's
    files only). Returns (those new signatures, the file written), or ([], "") when other files
    record them all (nothing is written: another worker reported this bug first). The file is
    named after its primary signature, else after the first new one."""
    sigs = list(dict.fromkeys(f["signature"] for f in doc["findings"]))
    with _findings_lock(corpus):
        on_disk = known_signatures(corpus)
        new = [s for s in sigs if s not in on_disk]
        if new and hub is not None:
            got = hub.register(new, replay.doc_text(doc))
            new = new if got is None else got
        if not new:
            return [], ""
        path = os.path.join(fdir, replay.file_name(sigs[0] if sigs[0] in new else new[0]))
        replay.write_atomic(path, doc)
    return new, path


def _triage_and_write(spec: _Spec, config, sset, emit, fdir: str, program, findings, primary, seed, known: set,
                      flaky: set, hub, counts: dict, claimed=(), cut: KeyboardInterrupt | None = None) -> None:
    """Confirm and minimize ``primary`` (found by ``program``), then write its replay file for the
    signatures no other file records (:func:`_register_and_write`) and tell the parent: a finding
    per signature it reports, a duplicate per signature of it another file reported first.
    ``claimed``: the signatures this worker claimed for ``program`` in the fleet; those the
    minimized program no longer raises are released for any worker to triage. ``cut``: the interrupt
    that stopped the search with this finding (:class:`kvaudit.search.fuzz.SearchInterrupted`): it is
    written unminimized, then ``cut`` is raised."""
    sig = primary.signature
    try:
        if cut is not None:
            raise cut
        crash = triage(config, program, primary, suppressions=sset.fresh() if sset is not None else None)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while confirming or minimizing: keep it, unminimized
        doc = replay.to_doc(config, program, [primary] + [f for f in findings if f is not primary],
                            fuzzer=spec.fuzzer, seed=seed, minimized=False,
                            confirmations="interrupted before confirmation")
        new, path = _register_and_write(spec.corpus, fdir, None, doc)  # this host's files: it is stopping
        for s in new:
            emit(("finding", spec.index, s, path))
        raise
    if crash is None:
        flaky.add(sig)
        counts["flaky"] += 1
        if hub is not None:
            hub.flaky(sig)
            hub.release(claimed)
        emit(("flaky", spec.index, sig))
        return
    doc = replay.to_doc(config, crash.program, crash.findings, fuzzer=spec.fuzzer, seed=seed, minimized=True,
                        confirmations=f"{crash.confirmations}/{crash.runs}", original_length=crash.original_length,
                        timeline=crash.timeline)
    before = set(known)
    with _held_interrupts():  # registered in the fleet, then written and announced here: whole, or not at all
        new, path = _register_and_write(spec.corpus, fdir, hub, doc)
        sigs = _signatures(crash.findings)
        if hub is not None:  # those the minimized program no longer raises: for any worker to triage on their own
            hub.release(claimed)
        known.update(sigs)
        for s in sigs:
            if s not in new:  # recorded by another worker's file: the parent does not count it as this host's
                counts["duplicates"] += s not in before
                emit(("duplicate", spec.index, s))
        counts["new"] += len(new)
        for s in new:
            emit(("finding", spec.index, s, path))


@contextlib.contextmanager
def _held_interrupts():
    """Ctrl-C and SIGTERM wait for the end of the block, then raise KeyboardInterrupt (and set
    :data:`kvaudit.audit.runner.INTERRUPTED`) as they would have. Around a finding's registration in the
    fleet and its write here: a SIGTERM that landed between the two left the bug known in Redis and
    this host's file unwritten, the run exiting 130 as if it had found nothing (seen in
    tests/test_fleet.py under load). Signals a process ignores stay ignored; off the main thread, nothing
    is held (Python runs handlers there only)."""
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


def _round(spec: _Spec, config, sset, stats, progress, emit, fdir: str, known: set, flaky: set, round_: int, hub,
           counts: dict, left: float, kept: dict) -> bool:
    """One search of at most ``left`` seconds and the triage of what it found. ``kept``: what the
    fuzzer keeps across rounds (:attr:`kvaudit.search.fuzzers.Search.kept`, filled in place). Returns False when the
    search found nothing (its budget is spent)."""
    known |= set(known_signatures(spec.corpus))  # other workers' findings
    skip = frozenset(known | flaky)
    seed = spec.seed * 1_000_003 + spec.index * 7919 + round_
    cut: KeyboardInterrupt | None = None  # an interrupt that came with a finding: it ends the round once written

    def done() -> bool:
        if cut is not None:
            raise cut
        return True
    try:
        found = fuzzers.get(spec.fuzzer).search(config, left, seed, stats, fuzzers.Search(
            on_progress=progress, suppressions=sset, suppressions_path=spec.suppress_path, known=skip,
            corpus_dir=spec.corpus, workers=spec.workers, use_seeds=spec.use_seeds, hub=hub, kept=kept))
    except SearchInterrupted as e:  # stopping while Hypothesis shrank a failure: write it unminimized
        found, cut = e.found, e
    progress(stats, force=True)
    if found is None:
        return False
    program, findings = found
    # the findings the campaign does not know yet (a known one may come first in the same op)
    on_disk = known_signatures(spec.corpus)
    sigs = [s for s in _signatures(findings) if s not in skip]
    known.update(s for s in sigs if s in on_disk)
    sigs = [s for s in sigs if s not in on_disk]
    if not sigs:
        return done()
    first = next(f for f in findings if f.signature == sigs[0])
    mine = sigs
    if hub is not None:  # every signature of the program at once: one bug is one worker's
        mine = hub.claim(sigs, replay.to_doc(config, program, [first] + [f for f in findings if f is not first],
                                             fuzzer=spec.fuzzer, seed=seed, minimized=False))
        for s in sigs:
            if s not in mine:  # another worker holds it, or the fleet has its file: a duplicate
                known.add(s)
                counts["duplicates"] += 1
                emit(("duplicate", spec.index, s))
        if not mine:
            return done()
    primary = next(f for f in findings if f.signature == mine[0])
    _triage_and_write(spec, config, sset, emit, fdir, program, findings, primary, seed, known, flaky, hub, counts,
                      mine, cut=cut)
    return True


def _worker_main(spec: _Spec, q) -> None:
    """Entry point of a worker process: Ctrl-C is the parent's business; die with the parent. The
    first SIGTERM (the parent's, when it is interrupted, or ``timeout``'s to the process group)
    stops the worker as Ctrl-C stops a search: a finding in triage is written unminimized first."""
    from kvaudit.audit.runner import INTERRUPTED, quiet_unraisable

    quiet_unraisable()  # a KeyboardInterrupt a gc callback swallows is not a traceback in the log

    def on_sigterm(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: the next would cut the write short
        INTERRUPTED.set()  # stops the next op even if a library swallows the KeyboardInterrupt
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the getppid() check in the progress callback does the same, later
    try:
        import torch

        torch.set_num_threads(1)
        _search_loop(spec, q.put)
    except KeyboardInterrupt:  # SIGTERM: what was found is written
        q.put(("done", spec.index))
    except Exception as e:  # report, do not hang the parent
        oserror = (e.errno, e.filename) if isinstance(e, OSError) else (None, None)
        q.put(("error", spec.index, f"{type(e).__name__}: {e}", *oserror))
        q.put(("done", spec.index))


def _append_run_record(corpus: str, record: dict) -> None:
    path = os.path.join(corpus, "campaign.json")
    runs = []
    try:
        with open(path) as fh:
            runs = json.load(fh).get("runs", [])
    except (OSError, ValueError, AttributeError):
        pass
    replay.write_atomic(path, {"format": "kvaudit.campaign/1", "runs": runs + [record]})


class _Tally:
    """The parent's side of the workers' messages (:func:`_search_loop`): it folds each into the
    campaign's result and figures, and calls ``on_progress`` and ``on_finding``."""

    def __init__(self, result: CampaignResult, on_progress, on_finding):
        self.result, self.on_progress, self.on_finding = result, on_progress, on_finding
        self.ready: set[int] = set()
        self.per_worker: dict[int, tuple] = {}

    def __call__(self, msg: tuple) -> None:
        kind, index = msg[0], msg[1]
        result, stats = self.result, self.result.stats
        if kind == "ready":  # a worker built its first engine: the search's clock starts with the first
            if not self.ready:
                stats.started = time.monotonic()
            self.ready.add(index)
        elif kind == "progress":
            self.per_worker[index] = msg[2:4]
            stats.sites.update(map(tuple, msg[4]))
            stats.suppressed.update(msg[5])
            stats.executions = sum(v[0] for v in self.per_worker.values())
            stats.ops = sum(v[1] for v in self.per_worker.values())
            if msg[6] is not None:
                stats.coverage = msg[6]
        elif kind == "finding":
            sig, path = msg[2], msg[3]
            if sig not in result.new and sig not in result.known:
                result.new[sig] = path
                stats.findings = len(result.new)
                if self.on_finding:
                    self.on_finding(sig, path)
        elif kind == "flaky":
            result.flaky.add(msg[2])
        elif kind == "pulled":
            if msg[2] not in result.new and msg[2] not in result.known:
                result.fleet.setdefault(msg[2], msg[3])
        elif kind == "duplicate":
            result.duplicates[msg[2]] = result.duplicates.get(msg[2], 0) + 1
        elif kind == "warning":
            if msg[2] not in result.warnings:
                result.warnings.append(msg[2])
        elif kind == "error":
            if msg[3] is not None:  # an OSError (a full disk): the CLI says so in one line
                raise OSError(msg[3], f"worker {index}: {msg[2]}", msg[4])
            raise RuntimeError(f"worker {index}: {msg[2]}")
        if self.on_progress:
            self.on_progress(stats)


def _run_workers(specs: list[_Spec], handle: Callable[[tuple], None]) -> None:
    """One spawned process per spec (no fork of a process that has torch's thread pools), their
    messages handed to ``handle`` until each says done or all are gone; then they are stopped
    (SIGTERM: a worker in triage writes its finding first; SIGKILL after 5 s)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(s, q), daemon=True) for s in specs]
    for p in procs:
        p.start()
    try:
        running = len(procs)
        while running:
            try:
                msg = q.get(timeout=0.5)
            except queue_mod.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if msg[0] == "done":
                running -= 1
            handle(msg)
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


def run_campaign(config: TargetConfig, fuzzer: str, max_time: float, seed: int, workers: int, corpus: str,
                 suppress_path: str | None = None, on_progress: Callable[[FuzzStats], None] | None = None,
                 on_finding: Callable[[str, str], None] | None = None, use_seeds: bool = True,
                 db: str | None = None, campaign: str = "default", ttl: float = 30.0) -> CampaignResult:
    """Run a campaign for ``max_time`` seconds of search per worker, each worker's counted from when it
    has built its first engine (a spawned worker's start-up, seconds for a real engine, comes first;
    ``stats.started`` is when the first worker was ready) (see module doc). ``on_finding(signature, path)`` is
    called once per new signature as it lands. Ctrl-C stops the workers and returns what was
    found so far (``interrupted`` set). ``db``: a Redis URL that makes this host's workers part of
    campaign ``campaign`` across hosts (:mod:`kvaudit.search.hub`; ``ttl``: seconds a claim or
    heartbeat lives unrenewed); the fleet's findings are pulled into ``corpus`` (``fleet``: those
    that landed during this run). Raises OSError if ``corpus`` cannot be written."""
    os.makedirs(findings_dir(corpus), exist_ok=True)
    if db is not None:  # the fleet's findings are known before the first program runs
        from kvaudit.search import hub as hubs

        hubs.Hub(hubs.connect(db), campaign, hubs.worker_id(-1), ttl=ttl).pull_findings(findings_dir(corpus))
    result = CampaignResult(known=known_signatures(corpus), workers=workers)
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
    for sig, path in known_signatures(corpus).items():  # landed while the workers stopped (not announced)
        if sig not in result.new and sig not in result.known and sig not in result.fleet \
                and sig not in result.duplicates:  # (another host's, saved here as a secondary finding)
            handle(("finding", -1, sig, path))
    stats.phase = "interrupted" if result.interrupted else "done"
    _append_run_record(corpus, {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "seconds": round(time.time() - started, 1),
        "fuzzer": fuzzer, "workers": workers, "seed": seed, "preset": config.preset, "bugs": sorted(config.bugs),
        "executions": stats.executions, "ops": stats.ops, "new": sorted(result.new), "known": sorted(result.known),
        "interrupted": result.interrupted})
    return result

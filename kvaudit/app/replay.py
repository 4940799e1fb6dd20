"""``kvaudit replay``: rerun a replay file and report it, check that its runs are deterministic,
or re-record files in place (``--update``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvaudit import atomic, replay
from kvaudit.app.configs import check_device, require_target, with_tree_core
from kvaudit.app.errors import (EXIT_CLEAN, EXIT_FINDINGS, EXIT_NONDETERMINISTIC, EXIT_NOT_REPRODUCED, DiskFull,
                                InputError, NothingChecked, unreadable, write_error)
from kvaudit.app.files import check_outputs, load_suppressions, write_reports
from kvaudit.app.progress import OpProgress, console as make_console
from kvaudit.audit.runner import execute, set_step_timeout, step_timeout
from kvaudit.audit.suppress import Suppression, SuppressionSet
from kvaudit.config import shown_path
from kvaudit.reports import timeline
from kvaudit.reports.outputs import Outputs, ReportData, search_facts
from kvaudit.reports.report import print_report, print_table, suppressed_by_kind


def load_replay(file: str, suppress_file: str | None, tree_core: str | None = None, probe: bool = True):
    """(config, program, recorded findings, suppressions, found by) of a replay file; found by: the search
    that found it, as the file records it (``fuzzer``, ``seed``; ``{}`` for a file that records none).
    ``probe`` False: the caller calls :func:`require_target` (seconds) after its own checks. Raises
    :class:`InputError`, or what :func:`~kvaudit.app.errors.unreadable` says for a file that cannot be read here."""
    try:
        config, program, recorded, doc = replay.load(file)
    except replay.ReplayFormatError as e:
        raise unreadable(e) from None
    other = replay.other_release(file, config, doc)
    if other is not None:
        click.echo(f"warning: {other}", err=True)
    config = with_tree_core(config, tree_core)
    sset = load_suppressions(suppress_file)
    check_device(config.device)
    if probe:
        require_target(config, recorded_in=file)
    return config, program, recorded, sset, search_facts(doc)


def load_replayable(file: str, suppress_file: str | None, tree_core: str | None = None):
    """:func:`load_replay` of a file with something to replay. Raises :class:`NothingChecked` (exit 5, as the
    ``--json`` of a run interrupted at start-up) for a file that records no program and no finding: a clean run's
    ``--json`` (its replay ran 0 ops and said clean, exit 0), before the target is probed."""
    config, program, recorded, sset, found_by = load_replay(file, suppress_file, tree_core, probe=False)
    if not program and not recorded:
        raise NothingChecked(f"{file}: nothing recorded: no program and no finding to replay (the --json of a run "
                             "that found nothing new; a finding's replay file is what replays)")
    require_target(config, recorded_in=file)
    return config, program, recorded, sset, found_by


def run(files: tuple[str, ...], *, suppress_file: str | None, check_determinism: bool, runs: int,
        tree_core: str | None, update: bool, outputs: Outputs) -> int:
    """``kvaudit replay FILE...``; returns the exit code."""
    if update:
        if suppress_file or check_determinism or tree_core or outputs.wanted():
            raise InputError("--update re-records files as they are: it takes no --suppress, "
                             "--check-determinism, --tree-core or report flags")
        return update_replays(files)
    if len(files) > 1:
        raise InputError(f"one FILE at a time ({len(files)} given); several only with --update")
    file = files[0]
    check_outputs((file, suppress_file), **vars(outputs))
    config, program, recorded, sset, found_by = load_replayable(file, suppress_file, tree_core)
    err = make_console(stderr=True)
    with OpProgress(err, f"replaying {shown_path(file)}", len(program)) as progress:
        ex = execute(config, program, suppressions=sset, drain=True, on_op=progress)
    console = make_console()
    print_report(console, config, program, ex.findings, program_title="program", suppressions=sset)
    want = {f.signature for f in recorded}
    hidden = sorted(want & sset.suppressed_signatures()) if sset is not None else []
    if want:
        same = "yes" if want <= set(ex.signatures) | set(hidden) else "no"
        console.print(f"recorded signature(s) reproduced: {same}"
                      + (f" (suppressed: {', '.join(hidden)})" if hidden else ""), soft_wrap=True)
    occupancy = record_timeline(config, program, sset, err) if outputs.html or outputs.json else None
    # (the runs before the reports: an interrupt among them writes none, as exit-codes.md says)
    differ = check_determinism and _check_determinism(console, config, program, sset, ex, runs)
    write_reports(outputs, ReportData.single(config, program, ex.findings, suppressed_by_kind(sset),
                                             {**found_by, "replayed": file}, timeline=occupancy,
                                             program_title="program", suppressions=sset), err)
    if differ:
        return EXIT_NONDETERMINISTIC
    return EXIT_FINDINGS if ex.findings else EXIT_CLEAN


def record_timeline(config, program, sset, err: Console) -> dict | None:
    """The pool occupancy of ``program`` for the reports' plot (one more run, said on ``err``); None for
    an empty program. Report writers never run the engine: a job calls this before them."""
    if not program:
        return None
    err.print(f"recording pool occupancy: replaying the {len(program)}-op program", soft_wrap=True)
    with OpProgress(err, "recording pool occupancy", len(program)) as progress:
        return timeline.record(config, program, suppressions=sset.fresh() if sset is not None else None,
                               on_op=progress)


def update_replays(files: tuple[str, ...]) -> int:
    """``replay --update`` (:func:`kvaudit.replay.rerecord`), one line per file; exit 4 if a finding was lost. A file
    that cannot be read, run or written here is one error line on stderr, and the rest are still re-recorded; the
    exit code is then the first such file's. A full disk stops it, naming the files it re-recorded before."""
    for file in files:  # (each before any is replayed: a pipe reads once, and a descriptor is no file to rewrite)
        if (link := atomic.fd_link(file)) is not None:
            raise InputError(f"{file}: {link} is a file descriptor's link, not a file: --update rewrites files in place")
    console = make_console()
    lost, refused, written = 0, None, []
    for file in files:
        try:
            config, program, recorded, *_ = load_replayable(file, None)
        except click.ClickException as e:  # (2 malformed, 5 nothing recorded, 69 a plugin's kind not loaded)
            click.echo(f"kvaudit: error: {e.format_message()}", err=True)
            refused = refused or e
            continue
        try:
            drain = any(f.engine_check_at_idle for f in recorded)
            with OpProgress(make_console(stderr=True), f"replaying {shown_path(file)}", len(program)) as progress:
                findings = execute(config, program, drain=drain, on_op=progress).findings
            outcome = replay.rerecord(file, findings, timeline=timeline.record)
        except OSError as e:  # a full disk stops here; a file it may not write (permissions) is left as it was
            error = write_error(e, file, kept=written)
            if isinstance(error, DiskFull):
                raise error from None
            click.echo(f"kvaudit: error: {error.format_message()}", err=True)
            refused = refused or error
            continue
        if outcome.startswith("updated"):
            written.append(file)
        lost += outcome.startswith("not updated")
        console.print(f"{shown_path(file)}: {outcome}", soft_wrap=True)
    if refused is not None:
        return refused.exit_code
    return EXIT_NOT_REPRODUCED if lost else EXIT_CLEAN


def _check_determinism(console: Console, config, program, sset, first, runs: int) -> bool:
    """Run ``program`` ``runs - 1`` more times beside ``first``, a row each; True if any run differs. The second
    run is in this process (an order that changes from run to run); the third and later each in a fresh process
    under its own ``PYTHONHASHSEED`` (an order that follows the hash of a str: :func:`_hash_seeds`)."""
    rows = [_outcome(first)]
    seeds = _hash_seeds(runs - 2)
    for i in range(2, runs + 1):
        with OpProgress(make_console(stderr=True), f"determinism run {i}/{runs}", len(program)) as progress:
            if i == 2:
                rows.append(_outcome(execute(config, program, suppressions=sset.fresh() if sset is not None else None,
                                             on_op=progress)))
            else:
                rows.append(_run_under_hash_seed(config, program, sset, seeds[i - 3]))
    t = Table(title=f"determinism: {runs} runs", title_justify="left")
    for col in ("run", "ledger digest", "scheduler steps", "signatures"):
        t.add_column(col, overflow="fold")
    for i, row in enumerate(rows):
        where = f" (PYTHONHASHSEED={seeds[i - 2]})" if i >= 2 else ""
        t.add_row(f"{i + 1}{where}", row["digest"][:16], str(row["steps"]), ", ".join(row["signatures"]) or "none",
                  style="" if _key(row) == _key(rows[0]) else "bold red")
    print_table(console, t, header=True)
    differ = any(_key(row) != _key(rows[0]) for row in rows)
    console.print(Text("NOT deterministic: the runs differ" if differ else f"deterministic: {runs} identical runs",
                       style="bold red" if differ else "green"), soft_wrap=True)  # (never folded: grep reads it)
    return differ


def _outcome(ex) -> dict:
    """What a determinism run compares (the ledger digest, each finding's signature, slots and step, the
    scheduler steps) and shows, as plain data: a fresh process's run hands it back as JSON."""
    findings = [[f.signature, [int(u) for u in f.slots], int(f.step)] for f in ex.findings]
    return {"digest": ex.digest, "findings": findings, "steps": ex.steps, "signatures": list(ex.signatures)}


def _key(row: dict) -> tuple:
    return row["digest"], row["findings"], row["steps"]


def _hash_seeds(n: int) -> list[int]:
    """``n`` hash seeds for fresh processes: 1, 2, ..., leaving out this process's own (``PYTHONHASHSEED``)."""
    own = os.environ.get("PYTHONHASHSEED")
    return [s for s in range(1, n + 2) if str(s) != own][:n]


_RULE_FIELDS = ("kind", "pool", "site", "signature", "reason", "index")  # a Suppression's rule, not its hits


def _run_under_hash_seed(config, program, sset, seed: int) -> dict:
    """One run of ``program`` in a fresh Python process under ``PYTHONHASHSEED=seed`` (its own session, so a
    terminal's Ctrl-C reaches this process alone, which kills it), the same step limit, environment
    (``KVAUDIT_PARANOID``, ``KVAUDIT_PLUGINS``) and suppression rules (``sset``, passed as data: a ``--suppress``
    pipe reads once); its :func:`_outcome`. Raises RuntimeError naming its last line of stderr if it fails."""
    with atomic.scratch_dir("kvaudit-determinism-") as d:
        job, out = os.path.join(d, "job.json"), os.path.join(d, "out.json")
        rules = None if sset is None else [{k: getattr(s, k) for k in _RULE_FIELDS} for s in sset]
        replay.write_atomic(job, replay.to_doc(config, program, [], suppress=rules, step_timeout=step_timeout()))
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (kvaudit's parent)
        env = {**os.environ, "PYTHONHASHSEED": str(seed),  # (kvaudit last on the path: an overlay stays first)
               "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), root) if p)}
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from kvaudit.app.replay import run_one; "
                                 "run_one(sys.argv[1], sys.argv[2])", job, out], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = proc.communicate()
        finally:
            if proc.returncode is None:  # (interrupted: the run is stopped with this process)
                proc.kill()
                proc.wait()
        if proc.returncode != 0 or not os.path.exists(out):
            last = next((line for line in reversed(err.splitlines()) if line.strip()), "no output")
            raise RuntimeError(f"the determinism run under PYTHONHASHSEED={seed} failed (exit {proc.returncode}): "
                               f"{last}")
        with open(out) as fh:
            return json.load(fh)


def run_one(job: str, out: str) -> None:
    """A fresh process's determinism run (:func:`_run_under_hash_seed`): the program of the replay document
    ``job`` under its suppressions and step limit; :func:`_outcome` written to ``out``."""
    config, program, _, doc = replay.load(job)
    set_step_timeout(doc["step_timeout"])
    sset = None if doc["suppress"] is None else SuppressionSet([Suppression(**r) for r in doc["suppress"]])
    atomic.write_text_atomic(out, json.dumps(_outcome(execute(config, program, suppressions=sset))))

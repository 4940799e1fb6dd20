"""``kvaudit campaign status`` and ``pull``: a campaign shared through Redis (:mod:`kvaudit.search.hub`),
seen from any machine that reaches it."""

from __future__ import annotations

import json
import os
import time

from kvaudit.app.errors import EXIT_CLEAN, EXIT_INTERRUPTED, InputError, UnavailableError, write_error
from kvaudit.app.configs import check_db
from kvaudit.config import json_value
from kvaudit.app.progress import LiveDisplay, console as make_console, live_terminal

COLUMNS = ("worker", "state", "fuzzer", "executions", "exec/s", "coverage", "new", "dup", "flaky", "heartbeat")


def _rows(status: dict) -> list[dict]:
    now, out = time.time(), []
    for w, beat in status["workers"].items():
        if beat is None:
            out.append({"worker": w, "state": "gone"})
            continue
        execs = int(beat.get("executions", 0))
        t = beat.get("time", now)
        out.append({"worker": w, "state": beat.get("state", "alive"), "fuzzer": beat.get("fuzzer", "-"),
                    "executions": execs,
                    "exec/s": execs / max(1e-9, t - beat.get("started", t)), "coverage": beat.get("coverage", "-"),
                    "new": beat.get("new", 0), "dup": beat.get("duplicates", 0), "flaky": beat.get("flaky", 0),
                    "heartbeat": max(0.0, now - t)})
    return out


def status_table(status: dict, campaign: str):
    """``status`` (:func:`kvaudit.search.hub.campaign_status`): a row per worker, the totals as caption."""
    from rich.table import Table
    from rich.text import Text

    totals = (f"{len(status['findings'])} signature(s) with a replay file ({len(status['known'])} known), "
              f"{len(status['pending'])} being triaged, {len(status['flaky'])} flaky, "
              f"{sum(status['duplicates'].values())} duplicate hit(s), {status['programs']} corpus program(s)")
    t = Table(title=Text(f"campaign {campaign}"), title_justify="left", caption=totals)
    for col in COLUMNS:
        t.add_column(col, no_wrap=col != "coverage", overflow="fold")
    for row in _rows(status):
        if row["state"] == "gone":
            t.add_row(row["worker"], "gone", *["-"] * 7, "expired")
            continue
        t.add_row(row["worker"], row["state"], str(row["fuzzer"]), f"{row['executions']:,}", f"{row['exec/s']:.1f}",
                  str(row["coverage"]), str(row["new"]), str(row["dup"]), str(row["flaky"]),
                  f"{row['heartbeat']:.0f}s ago")
    return t


def status_lines(status: dict, campaign: str) -> list[str]:
    """:func:`status_table` as plain ``key=value`` lines (for CI logs); the campaign's name as typed (one word:
    ``check_campaign_name``), the coverage spelled as JSON."""
    out = []
    for row in _rows(status):
        if row["state"] == "gone":
            out.append(f"campaign {campaign}: worker={row['worker']} state=gone")
            continue
        out.append(f"campaign {campaign}: worker={row['worker']} state={row['state']} fuzzer={row['fuzzer']} "
                   f"executions={row['executions']} exec/s={row['exec/s']:.1f} new={row['new']} dup={row['dup']} "
                   f"flaky={row['flaky']} heartbeat={row['heartbeat']:.0f}s coverage={json_value(row['coverage'])}")
    out.append(f"campaign {campaign}: findings={len(status['findings'])} known={len(status['known'])} "
               f"triaging={len(status['pending'])} flaky={len(status['flaky'])} "
               f"duplicates={sum(status['duplicates'].values())} programs={status['programs']}")
    return out


def _unknown(client, db: str, campaign: str, refuse: bool) -> str | None:
    """None when a worker ever joined ``campaign`` (a typo read as an empty campaign: exit 0 with nothing);
    else the campaigns there in words, or with ``refuse`` :class:`InputError` naming them."""
    from kvaudit.search.hub import campaign_names, safe_url

    names = campaign_names(client)
    if campaign in names:
        return None
    there = f"campaigns there: {', '.join(map(json_value, names))}" if names else "no campaign there yet"
    if refuse:
        raise InputError(f"--campaign {json_value(campaign)}: no worker ever joined it in "
                         f"{json_value(safe_url(db))} ({there})")
    return there


def status(db: str, campaign: str, watch: float | None, as_json: bool) -> int:
    """``kvaudit campaign status``; returns the exit code."""
    from kvaudit.search.hub import campaign_status

    client = check_db(db)
    out = make_console()
    there = _unknown(client, db, campaign, refuse=watch is None)  # --watch may wait for one to start
    if there is not None:
        make_console(stderr=True).print(f"warning: --campaign {json_value(campaign)}: no worker has joined it yet "
                                        f"({there})",
                                        soft_wrap=True, markup=False)
    if as_json:
        out.print_json(json.dumps({"campaign": campaign, **campaign_status(client, campaign)}))
        return EXIT_CLEAN
    def show():
        st = campaign_status(client, campaign)
        if live_terminal(out):
            out.print(status_table(st, campaign))
        else:
            for line in status_lines(st, campaign):
                out.print(line, soft_wrap=True, markup=False)

    if watch is None:
        show()
        return EXIT_CLEAN

    try:
        if live_terminal(out):
            with LiveDisplay(console=out, auto_refresh=False) as live:
                while True:
                    live.update(status_table(campaign_status(client, campaign), campaign), refresh=True)
                    time.sleep(watch)
        while True:
            show()
            time.sleep(watch)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def pull(db: str, campaign: str, directory: str) -> int:
    """``kvaudit campaign pull``; returns the exit code (a malformed entry is skipped with a warning)."""
    from kvaudit.search.campaign import recorded_kinds
    from kvaudit.search.corpus_fuzz import CorpusStore
    from kvaudit.search.hub import Hub, safe_url, worker_id

    if directory == "":  # (an unset variable in a script: os.path.join("", ...) is the current directory)
        raise InputError('DIRECTORY: want a directory name, not ""')
    client = check_db(db)
    _unknown(client, db, campaign, refuse=True)  # (a typo pulled nothing, exit 0)
    err = make_console(stderr=True)
    try:
        os.makedirs(os.path.join(directory, "findings"), exist_ok=True)
    except OSError as e:
        raise InputError(f"{directory}: {e.strerror or e}") from None
    hub, paths, kinds = Hub(client, campaign, worker_id(-1)), [], set()
    try:
        hub.pull_findings(os.path.join(directory, "findings"), written=paths, kinds=kinds,
                          recorded=recorded_kinds(directory))
    except OSError as e:  # (a full disk: not Redis going away)
        raise write_error(e, e.filename, paths) from None
    store = CorpusStore(os.path.join(directory, "programs"), mirror=hub)
    store.seen.update(os.listdir(store.path) if os.path.isdir(store.path) else ())
    programs = store.load_new()
    gone = None if hub.online else hub.outage  # (a worker's words: the error line below says it for the pull)
    for w in hub.warnings + [f"skipped a malformed corpus program in Redis ({n})" for n in store.skipped]:
        if w != gone:
            err.print(f"warning: {w}", soft_wrap=True)
    if store.write_errors:  # (the store goes on past a file it cannot write; a pull must not say it has it)
        path, e = store.write_errors[0]
        kept = f"{len(programs) - len(store.write_errors)} of {len(programs)} corpus program(s) in {store.path}"
        raise write_error(e, path, [*paths, kept])
    if not hub.online:
        raise UnavailableError(f"--db {safe_url(db)}: Redis went away during the pull")
    have, other = _findings_here(directory, kinds)
    make_console().print(f"pulled campaign {campaign}: {len(paths)} new replay file(s) ({have} in "
                         f"{os.path.join(directory, 'findings')}"
                         + (f"; {other} other file(s) there, not counted: another target kind's or not replay files"
                            if other else "") + f"), {len(programs)} new corpus program(s) in {store.path}",
                         soft_wrap=True, markup=False)
    return EXIT_CLEAN


def _findings_here(corpus: str, kinds: set[str]) -> tuple[int, int]:
    """``(replay files, other entries)`` in ``corpus``'s findings folder (listed as a campaign lists them,
    :func:`kvaudit.search.campaign.findings_files`): the replay files recorded on one of ``kinds`` (the fleet's;
    every kind when it holds none), which a campaign of that kind reads; the other entries (another kind's
    replay files, notes, folders) it skips."""
    from kvaudit import replay
    from kvaudit.search.campaign import findings_files

    files, rest = findings_files(corpus)
    used = 0
    for path in files:
        try:
            config = replay.load(path)[0]
        except replay.ReplayFormatError:
            continue
        used += not kinds or replay.target_name(config) in kinds
    return used, len(files) + len(rest) - used

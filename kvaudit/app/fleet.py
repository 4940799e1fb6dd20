"""``kvaudit campaign status`` and ``kvaudit campaign pull``: a campaign that spans hosts through
Redis (:mod:`kvaudit.search.hub`), seen from any machine that can reach its Redis."""

from __future__ import annotations

import json
import os
import time

from kvaudit import replay
from kvaudit.app.errors import EXIT_CLEAN, EXIT_INTERRUPTED, InputError, UnavailableError
from kvaudit.app.fuzz import check_db, hub_safe
from kvaudit.app.progress import console as make_console


def _client(db: str):
    from kvaudit.search.hub import HubError, connect

    check_db(db)
    try:
        return connect(db)
    except HubError as e:
        raise UnavailableError(str(e)) from None


def status_table(status: dict, campaign: str, now: float | None = None):
    """A rich table of ``status`` (:func:`kvaudit.search.hub.campaign_status`): one row per worker
    (host, pid, fuzzer, executions, exec/s, coverage, new/duplicate/flaky counts, seconds since its
    last heartbeat, or ``gone`` once it expired), the campaign's totals in the caption."""
    from rich.table import Table

    now = time.time() if now is None else now
    t = Table(title=f"campaign {campaign}", title_justify="left")
    for col in ("worker", "state", "fuzzer", "executions", "exec/s", "coverage", "new", "dup", "flaky", "heartbeat"):
        t.add_column(col, no_wrap=col != "coverage", overflow="fold")
    for w, beat in status["workers"].items():
        if beat is None:
            t.add_row(w, "gone", "-", "-", "-", "-", "-", "-", "-", "expired")
            continue
        execs = int(beat.get("executions", 0))
        rate = execs / max(1e-9, beat.get("time", now) - beat.get("started", beat.get("time", now)))
        t.add_row(w, "alive", str(beat.get("fuzzer", "-")), f"{execs:,}", f"{rate:.1f}", str(beat.get("coverage", "-")),
                  str(beat.get("new", 0)), str(beat.get("duplicates", 0)), str(beat.get("flaky", 0)),
                  f"{max(0.0, now - beat.get('time', now)):.0f}s ago")
    dups = sum(status["duplicates"].values())
    t.caption = (f"{len(status['findings'])} signature(s) with a replay file ({len(status['known'])} known), "
                 f"{len(status['pending'])} being triaged, {len(status['flaky'])} flaky, {dups} duplicate hit(s), "
                 f"{status['programs']} corpus program(s)")
    return t


def status_lines(status: dict, campaign: str, now: float | None = None) -> list[str]:
    """The table of :func:`status_table` as plain ``key=value`` lines (for CI logs): one per worker,
    then the totals."""
    now = time.time() if now is None else now
    out = []
    for w, beat in status["workers"].items():
        if beat is None:
            out.append(f"campaign {campaign}: worker={w} state=gone")
            continue
        execs = int(beat.get("executions", 0))
        rate = execs / max(1e-9, beat.get("time", now) - beat.get("started", beat.get("time", now)))
        out.append(f"campaign {campaign}: worker={w} state=alive fuzzer={beat.get('fuzzer', '-')} executions={execs} "
                   f"exec/s={rate:.1f} new={beat.get('new', 0)} dup={beat.get('duplicates', 0)} "
                   f"flaky={beat.get('flaky', 0)} heartbeat={max(0.0, now - beat.get('time', now)):.0f}s "
                   f"coverage={beat.get('coverage', '-')!r}")
    out.append(f"campaign {campaign}: findings={len(status['findings'])} known={len(status['known'])} "
               f"triaging={len(status['pending'])} flaky={len(status['flaky'])} "
               f"duplicates={sum(status['duplicates'].values())} programs={status['programs']}")
    return out


def status(db: str, campaign: str, watch: float | None, as_json: bool) -> int:
    """``kvaudit campaign status``: print the table once (or as JSON), or refresh it every ``watch``
    seconds until Ctrl-C (a live table on a terminal; off one, plain lines: :func:`status_lines`)."""
    from kvaudit.search.hub import campaign_status

    client = _client(db)
    out = make_console()
    if as_json:
        out.print_json(json.dumps({"campaign": campaign, **campaign_status(client, campaign)}))
        return EXIT_CLEAN
    def show():
        st = campaign_status(client, campaign)
        if out.is_terminal:
            out.print(status_table(st, campaign))
        else:
            for line in status_lines(st, campaign):
                out.print(line, soft_wrap=True)

    if watch is None:
        show()
        return EXIT_CLEAN
    from rich.live import Live

    try:
        if out.is_terminal:
            with Live(console=out, auto_refresh=False) as live:
                while True:
                    live.update(status_table(campaign_status(client, campaign), campaign), refresh=True)
                    time.sleep(watch)
        while True:
            show()
            time.sleep(watch)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def pull(db: str, campaign: str, directory: str) -> int:
    """``kvaudit campaign pull``: the campaign's replay files into ``DIR/findings/`` and its corpus
    programs into ``DIR/programs/`` (each validated; a malformed entry is skipped with a warning)."""
    from kvaudit.search.corpus_fuzz import CorpusStore
    from kvaudit.search.hub import Hub, worker_id

    client = _client(db)
    err = make_console(stderr=True)
    try:
        os.makedirs(os.path.join(directory, "findings"), exist_ok=True)
    except OSError as e:
        raise InputError(f"{directory}: {e.strerror or e}") from None
    hub = Hub(client, campaign, worker_id(-1))
    paths = hub.pull_findings(os.path.join(directory, "findings"))
    store = CorpusStore(os.path.join(directory, "programs"), mirror=hub)
    store.seen.update(os.listdir(store.path) if os.path.isdir(store.path) else ())
    programs = store.load_new()
    for w in hub.warnings + [f"skipped a malformed corpus program in Redis ({n})" for n in store.skipped]:
        err.print(f"warning: {w}", soft_wrap=True)
    if not hub.online:
        raise UnavailableError(f"--db {hub_safe(db)}: Redis went away during the pull")
    have = sorted(n for n in os.listdir(os.path.join(directory, "findings")) if n.endswith(".json"))
    make_console().print(f"pulled campaign {campaign!r}: {len(paths)} new replay file(s) ({len(have)} in "
                         f"{os.path.join(directory, 'findings')}), {len(programs)} new corpus program(s) in "
                         f"{store.path}", soft_wrap=True)
    for p in paths:
        try:
            replay.load(p)
        except replay.ReplayFormatError as e:  # validated before writing: cannot happen, but say so if it does
            err.print(f"warning: {e}", soft_wrap=True)
    return EXIT_CLEAN

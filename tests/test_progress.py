"""What a command shows while it runs off a terminal (kvaudit.app.progress): the fuzz status line's
coverage field, and the progress of a long replay and of a minimization."""

import os
import re

from cli_helpers import ROOT, invoke

from kvaudit import replay
from kvaudit.app import progress
from kvaudit.app.progress import Progress, coverage_field
from kvaudit.program import Idle, Step, Submit
from kvaudit.search.fuzz import FuzzStats
from kvaudit.targets.eut.presets import get_preset


def test_the_plain_status_line_shows_coverage_as_one_readable_field(capsys):
    """It printed coverage=93_features,_6_programs."""
    assert coverage_field("93 features, 6 programs") == ("93features/6programs", "")
    assert coverage_field("412 edges") == ("412edges", "")
    stats = FuzzStats()
    stats.coverage = "93 features, 6 programs"

    class Plain:
        is_terminal = False

    line = Progress(Plain(), 60.0).line(stats)
    assert " coverage=93features/6programs remaining=60s" in line
    fields = line.split("] ", 1)[1].split(" ", 1)[1].split(" ")
    assert all(re.fullmatch(r"[a-z/]+=\S+", f) for f in fields), fields  # key=value, split on spaces


def test_the_corpus_stores_note_ends_the_status_line_as_written():
    """A corpus on a full disk: the note in the coverage text came out squashed into the field,
    `coverage=1414features/265programs(0unreadableand231unwritablefilesin/tmp/C/programs)` (the tester)."""
    stats = FuzzStats()
    stats.coverage = "1414 features, 265 programs (0 unreadable and 231 unwritable files in /tmp/C/programs)"

    class Plain:
        is_terminal = False

    line = Progress(Plain(), 60.0).line(stats)
    assert line.endswith(" coverage=1414features/265programs remaining=60s (0 unreadable and 231 unwritable files "
                         "in /tmp/C/programs)"), line


def test_no_plain_status_line_before_the_first_program_ran_even_forced(capsys):
    """Every search began with `[   0.0s] fuzzing: executions=0 exec/s=0.0 ops=0 ...` (twice in a campaign):
    a line that said nothing the start-up line had not. A run that searched nothing then ended with a forced
    all-zero `done:` line, though fuzzing.md says a line of zeros is not printed: its `nothing searched` lines
    say it."""
    class Plain:
        is_terminal = False

    p, stats = Progress(Plain(), 60.0), FuzzStats()
    p.update(stats)
    p.update(stats)
    assert capsys.readouterr().err == ""
    stats.executions = 1
    p.update(stats)  # the first program ran: a line at once
    assert "fuzzing: executions=1 " in capsys.readouterr().err
    stats.phase = "confirming"
    p.update(stats, force=True)  # a forced line (a phase, the end) once a program ran
    assert "confirming: executions=1 " in capsys.readouterr().err
    stats.executions, stats.phase = 0, "done"
    p.update(stats, force=True)  # the end of a search that ran nothing: no line of zeros
    assert capsys.readouterr().err == ""


def long_program(n: int) -> list:
    return [Submit(prompt_len=4 + i % 7, max_new_tokens=2) if i % 2 == 0 else Step(n=1) for i in range(n)] + [Idle()]


def test_a_long_replay_shows_its_progress_off_a_terminal(tmp_path, monkeypatch):
    """A 100k-op replay printed nothing for 150 s. (A small program with a short interval here.)"""
    path = tmp_path / "long.json"
    program = long_program(400)
    replay.write_atomic(str(path), replay.to_doc(get_preset("default").config(), program, []))
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL", 0.0)
    r = invoke("replay", str(path))
    assert r.exit_code == 0, r.output + r.stderr
    lines = re.findall(rf"^\[\s*[\d.]+s\] replaying {re.escape(str(path))}: ops=(\d+)/401 steps=(\d+) ops/s=\d+ "
                       r"(remaining=\d+s|done)$", r.stderr, flags=re.M)
    assert len(lines) > 10, r.stderr
    ops = [int(o) for o, _, _ in lines]
    assert ops == sorted(ops) and lines[-1][2] == "done" and ops[-1] == 401
    assert "\x1b" not in r.stderr
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL", 5.0)  # the default: a short replay says nothing
    r = invoke("replay", str(path))
    assert r.exit_code == 0 and "ops=" not in r.stderr, r.stderr


def test_a_dumb_terminal_gets_the_plain_status_lines(capsys, monkeypatch):
    """Tester 61a: `TERM=dumb` on a terminal showed no status at all (rich's live display cannot move a dumb
    terminal's cursor, and the plain lines were only printed off a terminal)."""
    import io

    from rich.console import Console

    monkeypatch.setenv("TERM", "dumb")
    console = Console(file=io.StringIO(), force_terminal=True)
    assert console.is_terminal and not progress.live_terminal(console)
    p, stats = Progress(console, 60.0), FuzzStats()
    assert p.live is None
    stats.executions = 1
    p.update(stats)
    assert "fuzzing: executions=1 " in capsys.readouterr().err
    monkeypatch.setenv("TERM", "xterm")
    assert progress.live_terminal(console) and Progress(console, 60.0).live is not None


def test_no_color_on_a_terminal_keeps_the_live_status_and_drops_its_styles_too(monkeypatch):
    """Stop 61's note: with NO_COLOR the live status still sent bold and dim (rich drops colours only; no-color.org
    asks no more). kvaudit's reports print no control codes under NO_COLOR (reports.md), so neither does the live
    status's text now: the same redraws, no SGR codes (``ESC [ ... m``)."""
    import io

    from rich.table import Table

    from kvaudit.app.progress import console as make_console

    monkeypatch.setenv("FORCE_COLOR", "1")  # (rich: a terminal, as on one)

    def shown(no_color: bool) -> str:
        if no_color:
            monkeypatch.setenv("NO_COLOR", "1")
        else:
            monkeypatch.delenv("NO_COLOR", raising=False)
        console = make_console()  # (the console every command prints with: campaign status --watch's too)
        assert console.is_terminal
        console.file, console.width = io.StringIO(), 160
        stats = FuzzStats()
        stats.executions, stats.findings = 7, 1
        with Progress(console, 60.0) as p:
            assert p.live is not None  # (still a live display: NO_COLOR is no dumb terminal)
            p.update(stats)
        return console.file.getvalue()

    sgr = re.compile("\x1b\\[[0-9;]*m")
    assert sgr.search(shown(False))  # (the test can see them)
    out = shown(True)
    assert "executions" in out and not sgr.search(out), repr(out)
    # campaign status --watch's live table: rich's header is bold by default
    console = make_console()
    console.file = io.StringIO()
    table = Table("worker", "state")
    table.add_row("0", "running")
    console.print(table)
    assert "worker" in console.file.getvalue() and not sgr.search(console.file.getvalue())


def test_campaign_status_watch_on_a_dumb_terminal_prints_plain_lines_as_it_watches(monkeypatch):
    """Tester 61c: `TERM=dumb ... campaign status --watch 1` printed nothing while it watched (rich's live
    table cannot redraw there), then one table when stopped."""
    import io

    from rich.console import Console

    from kvaudit.app import fleet
    from kvaudit.search import hub

    monkeypatch.setenv("TERM", "dumb")
    buf = io.StringIO()
    monkeypatch.setattr(fleet, "make_console", lambda stderr=False: Console(file=buf, force_terminal=True))
    monkeypatch.setattr(fleet, "check_db", lambda db: object())
    monkeypatch.setattr(hub, "campaign_names", lambda client: ["c1"])
    monkeypatch.setattr(hub, "campaign_status", lambda client, campaign: {
        "workers": [], "findings": {}, "known": {}, "pending": {}, "flaky": {}, "duplicates": {}, "programs": 3})
    monkeypatch.setattr(fleet, "status_lines", lambda st, campaign: [f"campaign {campaign}: programs={st['programs']}"])
    seen = []

    def sleep(_seconds):  # what the watcher has shown before each wait; stopped at the second
        seen.append(buf.getvalue())
        if len(seen) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(fleet.time, "sleep", sleep)
    assert fleet.status("redis://localhost:6379/0", "c1", 1.0, False) == fleet.EXIT_INTERRUPTED
    assert seen[0] == "campaign c1: programs=3\n" and seen[1].count("programs=3") == 2, seen


def test_a_columns_too_long_to_be_a_width_is_read_as_unset(monkeypatch):
    """th64: off a terminal a COLUMNS of 5,000 digits raised from int() (internal error 70, in-process)."""
    from kvaudit.app import progress

    for junk in ("9" * 5000, "9" * 7):
        monkeypatch.setenv("COLUMNS", junk)
        assert progress._columns() == 120
    monkeypatch.setenv("COLUMNS", "999999")
    assert progress._columns() == 999999


def test_a_long_minimization_shows_its_progress_off_a_terminal(tmp_path, monkeypatch):
    """Tester tm65: `kvaudit minimize` of a 3,004-op program printed nothing for 49 s between its first line and
    its result. (The hisparse leak's 2 ops behind 40 idle steps here, with a short interval.)"""
    name = os.path.join(ROOT, "corpora", "regressions", "hisparse-prebuilt-skip-finish.json")
    config, program, recorded, _ = replay.load(name)
    path, out = tmp_path / "padded.json", tmp_path / "padded.min.json"
    replay.write_atomic(str(path), replay.to_doc(config, [Step(n=1)] * 40 + program, recorded))
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL", 0.0)
    r = invoke("minimize", str(path), "-o", str(out))
    assert r.exit_code == 0, r.output + r.stderr
    lines = re.findall(r"^\[\s*[\d.]+s\] minimizing: runs=(\d+) smallest=(\d+)/42 ops( done)?$", r.stderr, flags=re.M)
    assert len(lines) > 5, r.stderr
    runs, smallest = [int(n) for n, _, _ in lines], [int(s) for _, s, _ in lines]
    assert runs == sorted(runs) and smallest == sorted(smallest, reverse=True), lines
    assert smallest[-1] == len(program) and lines[-1][2] == " done" and "\x1b" not in r.stderr

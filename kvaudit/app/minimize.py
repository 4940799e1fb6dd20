"""``kvaudit minimize``: shrink a replay file's program keeping one finding's signature
(:mod:`kvaudit.search.minimize`), confirm it and write it."""

from __future__ import annotations

import os

import click

from kvaudit.app.configs import require_target
from kvaudit.app.errors import EXIT_CLEAN, EXIT_INTERRUPTED, EXIT_NOT_REPRODUCED, InputError
from kvaudit.app.files import check_paths, write_replay
from kvaudit.app.interrupts import catch_sigint, ignore_interrupts
from kvaudit.app.progress import MinimizeProgress, OpProgress, console as make_console
from kvaudit.app.replay import load_replay
from kvaudit.config import shown_path
from kvaudit.audit.runner import execute
from kvaudit.constants import CONFIRM_RUNS
from kvaudit.reports.report import print_report, summary_line
from kvaudit.search.fuzz import confirm
from kvaudit.search.minimize import Interrupted, minimize
from kvaudit.targets.registry import TargetDefinitionError


def run(file: str, *, out_file: str | None, signature: str | None, suppress_file: str | None) -> int:
    """``kvaudit minimize FILE``; returns the exit code."""
    config, program, recorded, sset, found_by = load_replay(file, suppress_file, probe=False)
    if not program:  # (a kvaudit ci job's --json: its programs are in its replay files)
        raise InputError(f"{file} records no program: nothing to minimize")
    if signature is None:
        if not recorded:
            raise InputError(f"{file} records no finding: name one with --signature")
        signature = recorded[0].signature
    elif recorded and signature not in {f.signature for f in recorded}:
        raise InputError(f"--signature {signature}: {file} records no finding of it; its signature(s): "
                         + ", ".join(dict.fromkeys(f.signature for f in recorded)))
    rule = next((r for f in recorded if f.signature == signature for r in (sset or ()) if r.matches(f)), None)
    if rule is not None:  # (minimizing would only say that it does not reproduce)
        raise InputError(f"{signature} is suppressed by rule #{rule.index} ({rule.describe()}) of {suppress_file}: "
                         "minimize it without that rule")
    if out_file is None and not os.path.isfile(file):  # (<(cat F): /dev/fd/63.min.json, 'cannot write in /proc/N/fd')
        raise InputError(f"{file}: not a regular file's path (a pipe or a device): the default output is named "
                         "after FILE; pass -o OUT")
    if out_file is None:  # (not `or`: -o "" is refused as every empty output path is, not the default)
        out_file = (file[:-5] if file.endswith(".json") else file) + ".min.json"
    check_paths((file,), output=out_file)  # the same checks as the report flags, named as the flag
    require_target(config, recorded_in=file)  # last: a real engine's probe imports it (seconds)
    console, err = make_console(), make_console(stderr=True)
    fresh = (lambda: sset.fresh()) if sset is not None else (lambda: None)
    err.print(f"minimizing {len(program)} ops of {shown_path(file)}, keeping {signature}", soft_wrap=True)
    catch_sigint()
    small = None
    try:
        with MinimizeProgress(err, "minimizing", len(program)) as progress:
            small = minimize(config, program, signature, fresh(), on_run=progress)
        confirmations = confirm(config, small, signature, suppressions=fresh())
    except TargetDefinitionError:  # (a ValueError: the target's mistake a smaller program met, exit 2)
        raise
    except ValueError:
        err.print(f"{shown_path(file)}: {signature} does not reproduce", soft_wrap=True)
        return _nothing(console, EXIT_NOT_REPRODUCED)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM
        smallest, checked = (small, small) if small is not None else \
            (e.smallest, e.checked) if isinstance(e, Interrupted) else (None, None)
        return _write_interrupted(config, program, smallest, signature, file, out_file, fresh(), console, err,
                                  found_by, checked=checked)
    if confirmations < CONFIRM_RUNS:
        err.print(f"the minimized program reproduces {signature} only {confirmations}/{CONFIRM_RUNS} times; "
                  "nothing written", soft_wrap=True)
        return _nothing(console, EXIT_NOT_REPRODUCED)
    final = execute(config, small, suppressions=fresh(), drain=True)
    findings = sorted(final.findings, key=lambda f: f.signature != signature)  # the file keeps its first
    try:
        path = write_replay(out_file, config, small, findings, **found_by, minimized=True, minimized_from=file,
                            confirmations=f"{confirmations}/{CONFIRM_RUNS}")
    except click.ClickException:  # a full disk (write_error): the minimized program still reaches the log
        print_report(console, config, small, findings)
        raise
    console.print(f"minimized {len(program)} -> {len(small)} ops; reproduced {confirmations}/{CONFIRM_RUNS}; "
                  f"written to {shown_path(path)}", soft_wrap=True)
    print_report(console, config, small, findings)  # last: its SUMMARY: line closes stdout
    return EXIT_CLEAN


def _write_interrupted(config, program, smallest, signature, file, out_file, suppressions, console, err,
                       found_by: dict, checked=None) -> int:
    """``checked``: the smallest program that reproduced under the user's step limit, replayed where
    ``smallest`` (a watchdog hang's, found under the probe's limit) does not reproduce under it."""
    ignore_interrupts(clear=True)  # the replay below runs ops
    if smallest is None:
        err.print("interrupted before the program reproduced: nothing written")
        return _nothing(console, EXIT_INTERRUPTED)

    def replayed(ops):
        with OpProgress(err, "replaying the smallest program so far", len(ops)) as progress:
            return execute(config, ops, suppressions=suppressions, drain=True, on_op=progress)

    final = replayed(smallest)
    if signature not in final.signatures and checked is not None and checked != smallest:
        err.print(f"the smallest program so far ({len(smallest)} ops) did not reproduce {signature} under the "
                  f"step limit; replaying the smallest that did ({len(checked)} ops)", soft_wrap=True)
        smallest = checked
        final = replayed(smallest)
    findings = sorted(final.findings, key=lambda f: f.signature != signature)
    if signature not in final.signatures:
        err.print(f"interrupted; the smallest program so far ({len(smallest)} ops) did not reproduce {signature} "
                  "when replayed: nothing written", soft_wrap=True)
        return _nothing(console, EXIT_INTERRUPTED)
    print_report(console, config, smallest, findings)
    path = write_replay(out_file, config, smallest, findings, **found_by, minimized=False, minimized_from=file,
                        confirmations="interrupted before confirmation")
    err.print(f"interrupted: the smallest program so far ({len(program)} -> {len(smallest)} ops, not confirmed) "
              f"written to {shown_path(path)}", soft_wrap=True)
    return EXIT_INTERRUPTED


def _nothing(console, code: int) -> int:
    """A run that writes nothing still ends stdout with its ``SUMMARY:`` line (docs/guides/reports.md):
    no findings, ``(interrupted)`` when it was. Returns ``code``."""
    console.print(summary_line([], interrupted=code == EXIT_INTERRUPTED), soft_wrap=True)
    return code

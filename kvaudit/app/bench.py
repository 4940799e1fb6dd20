"""``kvaudit bench``: check the lists, run the benchmark (:mod:`kvaudit.search.bench`,
:mod:`kvaudit.history.suite`), write its markdown and JSON."""

from __future__ import annotations

import os

import click
from hypothesis.configuration import set_hypothesis_home_dir

from kvaudit import replay
from kvaudit.atomic import scratch_dir
from kvaudit.app.errors import EXIT_CLEAN, EXIT_INTERNAL, EXIT_INTERRUPTED, InputError, UnavailableError, write_error
from kvaudit.app.configs import names_arg, presets_arg
from kvaudit.app.files import check_paths
from kvaudit.app.interrupts import ignore_interrupts
from kvaudit.app.progress import console as make_console
from kvaudit.history import suite
from kvaudit.history.catalogue import all_bugs
from kvaudit.search import bench
from kvaudit.search import fuzzers as fuzzer_kinds
from kvaudit.targets import registry


def default_fuzzers(history: bool = False) -> tuple[list[str], list[str]]:
    """``--fuzzers``' default: the ``bench`` fuzzers (history: those that can search every engine) that can run
    here, and those left out because they cannot (atheris where it is not installed)."""
    engines = {b.engine for b in all_bugs().values()} if history else ()
    names = [n for n, k in fuzzer_kinds.kinds().items() if k.bench and all(k.takes(e) for e in engines)]
    missing = [n for n in names if fuzzer_kinds.unavailable(n) is not None]
    return [n for n in names if n not in missing], missing


def check_fuzzers(names: list[str]) -> None:
    """Raises :class:`UnavailableError` (exit 69) naming ``--fuzzers`` when one of ``names`` cannot run here."""
    for name in names:
        why = fuzzer_kinds.unavailable(name)
        if why is not None:
            raise UnavailableError(f"--fuzzers: {name}: {why.reason}; leave it out of --fuzzers")


def _say_left_out(err, left_out: tuple[str, ...]) -> None:
    if left_out:  # (a fuzzer named in --fuzzers that cannot run here is refused: exit 69)
        err.print(f"kvaudit bench: {', '.join(left_out)} cannot run here (see 'kvaudit fuzz --fuzzer {left_out[0]}'): "
                  "left out of the default --fuzzers", soft_wrap=True, highlight=False, markup=False)


def _fuzzers_arg(value: str) -> list[str]:
    valid = fuzzer_kinds.kinds()
    return names_arg(value, valid, "--fuzzers: unknown fuzzer", f"valid: {', '.join(valid)}", every=None)


def _write_both(out_json: str, doc: dict, out_md: str, markdown) -> None:
    kept: list[str] = []
    for path, write in ((out_json, lambda: replay.write_atomic(out_json, doc)),
                        (out_md, lambda: replay.write_text_atomic(out_md, markdown(os.path.basename(out_json))))):
        try:
            kept.append(write())
        except OSError as e:
            raise write_error(e, path, kept) from None


def run(*, trials: int, budget: float, fuzzers_value: str, bugs_value: str, fp_seconds: float | None,
        overhead_presets: str, out_md: str, out_json: str, left_out: tuple[str, ...] = ()) -> int:
    """``kvaudit bench``; returns the exit code. Raises :class:`InputError` for a bad option. ``left_out``: the
    default ``--fuzzers`` that cannot run here (said once the options are checked)."""
    fuzzers = _fuzzers_arg(fuzzers_value)
    bugs = names_arg(bugs_value, registry.get("eut").bugs(), "--bugs: unknown bug", "see 'kvaudit bugs'")
    ov = [] if overhead_presets == "none" else presets_arg("--overhead-presets", overhead_presets)
    check_fuzzers(fuzzers)
    check_paths(out=out_md, json=out_json)  # writable, distinct
    err = make_console(stderr=True)
    _say_left_out(err, left_out)
    err.print(f"kvaudit bench: {len(bugs)} bug(s) x {len(fuzzers)} fuzzer(s) x {trials} trial(s), "
              f"budget {budget:g}s each", soft_wrap=True)
    with scratch_dir("kvaudit-bench-") as scratch:  # Hypothesis's files: not the user's current directory
        set_hypothesis_home_dir(os.path.join(scratch, ".hypothesis"))
        res = bench.run(bugs, fuzzers, trials, budget, budget if fp_seconds is None else fp_seconds, ov,
                        on_event=lambda line: err.print(line, soft_wrap=True, highlight=False))
    ignore_interrupts(clear=True)  # the report of what ran is written whole
    _write_both(out_json, res.to_json(), out_md, lambda name: bench.markdown(res, name))
    make_console().print(f"bench {'INTERRUPTED ' if res.interrupted else ''}done in {res.wall / 60:.1f} min: "
                         f"{out_md}, {out_json}")
    return EXIT_INTERRUPTED if res.interrupted else EXIT_CLEAN


def list_zoo(bugs_value: str = "all") -> int:
    """``kvaudit bench --list``: the zoo's bugs that ``--bugs`` names, one a line. Raises :class:`InputError`
    for a name the zoo lacks, as a run does."""
    for name in names_arg(bugs_value, registry.get("eut").bugs(), "--bugs: unknown bug", "see 'kvaudit bugs'"):
        click.echo(name)
    return EXIT_CLEAN


def run_history(*, trials: int, budget: float, fuzzers_value: str, bugs_value: str, list_bugs: bool,
                out_md: str, out_json: str, jobs: int = 1, left_out: tuple[str, ...] = ()) -> int:
    """``kvaudit bench --suite history``; returns the exit code. Raises :class:`InputError` for a bad
    option, :class:`UnavailableError` when a release cannot be installed."""
    bugs_all = all_bugs()
    bugs = names_arg(bugs_value, bugs_all, "--bugs: unknown history bug", "see 'kvaudit bench --suite history --list'")
    if list_bugs:  # the bugs --bugs names (all by default)
        width = max(len(b) for b in bugs)  # the longest id too keeps its column
        for b in map(bugs_all.get, bugs):
            fixed = f" -> {b.fixed}" if b.fixed else ""
            click.echo(f"{b.id:{width}}  {b.engine} {b.buggy}{fixed}  {b.finding}")
        return EXIT_CLEAN
    fuzzers = _fuzzers_arg(fuzzers_value)
    engines = sorted({bugs_all[b].engine for b in bugs})
    for f in fuzzers:
        kind = fuzzer_kinds.get(f)
        if not all(kind.takes(e) for e in engines):
            ok = sorted(n for n, k in fuzzer_kinds.kinds().items() if all(k.takes(e) for e in engines))
            raise InputError(f"--fuzzers: {f} {kind.targets_why or 'cannot search these engines'}; the history suite "
                             f"drives SGLang and vLLM (use {fuzzer_kinds.words(ok, 'and')})")
    check_fuzzers(fuzzers)
    check_paths(out=out_md, json=out_json)
    err = make_console(stderr=True)
    _say_left_out(err, left_out)
    err.print(f"kvaudit bench --suite history: {len(bugs)} bug(s) x {len(fuzzers)} fuzzer(s) x {trials} trial(s), "
              f"budget {budget:g}s each, {jobs} at a time", soft_wrap=True)
    try:
        res = suite.run(bugs, fuzzers, trials, budget, jobs=jobs,
                        on_event=lambda line: err.print(line, soft_wrap=True, highlight=False, markup=False))
    except suite.SuiteError as e:
        raise UnavailableError(str(e)) from None
    ignore_interrupts(clear=True)
    _write_both(out_json, res.to_json(), out_md, lambda name: suite.markdown(res, name))
    found, ran = sum(suite.rediscovered(res, b) for b in bugs), res.ran(bugs)
    make_console().print(f"bench --suite history {'INTERRUPTED ' if res.interrupted else ''}done in "
                         f"{res.wall / 60:.1f} min: {found}/{len(ran)} bug(s) rediscovered"
                         + (f" ({len(bugs) - len(ran)} not run)" if len(ran) < len(bugs) else "")
                         + f"; {out_md}, {out_json}",
                         soft_wrap=True)
    if res.interrupted:
        return EXIT_INTERRUPTED
    if res.failures:
        err.print(f"kvaudit: {len(res.failures)} worker(s) failed (listed in {out_md}): {res.failures[0]}",
                  soft_wrap=True, highlight=False, markup=False)
        return EXIT_INTERNAL
    return EXIT_CLEAN

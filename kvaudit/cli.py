"""The ``kvaudit`` command line (click): options parsed into plain values for the jobs in
:mod:`kvaudit.app`. Exit codes and design notes: docs/internals/app.md."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
import warnings

import click

# NOTE: only modules that import neither torch, Hypothesis nor rich belong up here: `kvaudit --help`
# must start in a fraction of a second (tests/test_entry.py checks it with -X importtime). The
# commands import the jobs (kvaudit.app.*) they run inside their functions.
from kvaudit import __version__
from kvaudit.app.budget import Budget
from kvaudit.app.configs import (FuzzerChoice, TargetChoice, bugs_renderables, check_plugins, common_options,
                                 presets_table, replay_tree_core_option, select_config)
from kvaudit.app.errors import EXIT_CLEAN, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USAGE
from kvaudit.app.files import check_outputs, folder_problem, out_folder_problem
from kvaudit.app.interrupts import BENCH_OUT, end_startup_interrupt, restoring_sigint
from kvaudit.config import json_value
from kvaudit.constants import (CAMPAIGN_FUZZER, CONFIRM_RUNS, DEFAULT_FUZZER, DEFAULT_STEP_TIMEOUT, WATCHDOG_IDLE_POLL,
                               check_seconds, check_step_timeout)
from kvaudit.search import fuzzers
from kvaudit.reports.outputs import FORMATS
from kvaudit.targets.registry import TargetDefinitionError


class _NamesItsCommand:
    """A usage error met parsing this command's options knows its command: click's parser raises an option
    with no value (``Option '--max-time' requires an argument.``) or a flag given one with no context, so its
    message lacked the ``(see 'kvaudit fuzz --help')`` the other usage errors end with."""

    def parse_args(self, ctx, args):
        try:
            rest = super().parse_args(ctx, args)
        except click.UsageError as e:
            if e.ctx is None:
                e.ctx = ctx
            raise
        if not (ctx.find_root().obj or {}).get(CHECK_ONLY):  # (the entry point's check first: said once)
            _warn_given_twice(ctx, getattr(ctx, "_kvaudit_order", ()))
        return rest

    def make_parser(self, ctx):
        """The parser, keeping the order it met the options in (each once per time given) for
        :func:`_warn_given_twice`."""
        parser = super().make_parser(ctx)
        parse = parser.parse_args

        def parse_args(args):
            opts, rest, order = parse(args=args)
            ctx._kvaudit_order = list(order)
            return opts, rest, order

        parser.parse_args = parse_args
        return parser


def _warn_given_twice(ctx, order) -> None:
    """A one-value option given more than once: click keeps the last value and drops the others without a
    word (``--json a.json --json b.json`` wrote b.json only), so one line of warning each says so. (The value
    is not shown: a ``--db`` URL may hold a password.)"""
    for param in dict.fromkeys(order):
        n = order.count(param)
        if n > 1 and isinstance(param, click.Option) and not param.multiple and not param.count:
            flags = "/".join(param.opts + param.secondary_opts)
            click.echo(f"warning: {flags} given {n} times; only the last one counts", err=True)


class KvauditCommand(_NamesItsCommand, click.Command):
    """Every ``kvaudit`` command (:class:`_NamesItsCommand`)."""


class _Interrupted(Exception):
    """A Ctrl-C or SIGTERM met inside a command, carried past click's ``main``, which answers a
    ``KeyboardInterrupt`` with an empty line on stderr before its ``Abort`` (a blank line above ``kvaudit:
    interrupted`` in a log)."""


class KvauditGroup(_NamesItsCommand, click.Group):
    """Every error is one line on stderr with a distinct exit code, never a traceback."""

    command_class = KvauditCommand
    group_class = type  # (a subgroup, ``campaign``: this class again)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Interrupted from None

    def main(self, args=None, prog_name=None, **extra):
        try:
            with _keeping_hypothesis_home():
                rv = super().main(args=args, prog_name=prog_name, standalone_mode=False, **extra)
        except click.exceptions.Exit as e:
            return sys.exit(e.exit_code)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help())
            return sys.exit(EXIT_CLEAN)
        except click.ClickException as e:  # a UsageError's exit code is 2
            click.echo(f"kvaudit: error: {_click_message(e)}", err=True)
            return sys.exit(e.exit_code)
        except (TargetDefinitionError, fuzzers.FuzzerDefinitionError) as e:  # a plugin's own mistake, met running
            if os.environ.get("KVAUDIT_DEBUG") and e.__cause__ is not None:  # (its own exception: a constructor's)
                traceback.print_exception(e.__cause__, file=sys.stderr)
            click.echo(f"kvaudit: error: {e}", err=True)
            return sys.exit(EXIT_USAGE)
        except (click.Abort, KeyboardInterrupt, _Interrupted):
            # only before a job began does an interrupt get here (a job writes its own reports, then
            # returns): `ci` and `fuzz` still write the reports asked for and their SUMMARY: line
            end_startup_interrupt(sys.argv[1:] if args is None else list(args))
            return sys.exit(EXIT_INTERRUPTED)
        except Exception as e:  # a kvaudit bug: say so in one line, keep the traceback opt-in
            if os.environ.get("KVAUDIT_DEBUG"):
                raise
            click.echo(f"kvaudit: internal error: {type(e).__name__}: {e} (set KVAUDIT_DEBUG=1 for a traceback)",
                       err=True)
            return sys.exit(EXIT_INTERNAL)
        return sys.exit(rv or 0)


# Other fuzzers' options (libFuzzer's -jobs and -max_total_time, spelled as long options) that kvaudit
# names otherwise: an unknown option among them suggests kvaudit's own, where the command has it.
_OTHER_SPELLINGS = {"--jobs": "--workers", "--max-total-time": "--max-time", "--max_total_time": "--max-time"}


def _click_message(e: click.ClickException) -> str:
    """click's own message, an other fuzzer's spelling of an option pointed at kvaudit's, and for a usage
    error where to read the command's options. (click quotes values the Python way, ``'nope'``: rewriting
    its quotes in the finished text also rewrote apostrophes in paths and in kvaudit's own messages.)"""
    if isinstance(e, click.NoSuchOption) and e.ctx and e.option_name in _OTHER_SPELLINGS:
        ours = _OTHER_SPELLINGS[e.option_name]
        if any(ours in p.opts for p in e.ctx.command.params):
            e.possibilities = [ours]
    text = e.format_message()
    if isinstance(e, click.UsageError) and e.ctx:
        text += f" (see '{e.ctx.command_path} --help')"
    return text


@contextlib.contextmanager
def _keeping_hypothesis_home():
    """``fuzz`` and ``ci`` point Hypothesis's files at their output directory: put an in-process caller's back."""
    conf = sys.modules.get("hypothesis.configuration")
    # (hypothesis < 6.155: storage_directory() is the home itself, a Path with no home_directory)
    home = conf.storage_directory(intent_to_write=False) if conf is not None else None
    before = getattr(home, "home_directory", home)
    try:
        yield
    finally:
        if "hypothesis.configuration" in sys.modules:
            sys.modules["hypothesis.configuration"].set_hypothesis_home_dir(before)


def needs_targets(f):
    """A command that reads the registry of target kinds: :func:`kvaudit.app.configs.check_plugins` first."""
    @functools.wraps(f)
    def wrapper(*a, **k):
        check_plugins()
        return f(*a, **k)

    return wrapper


def _checked(check):
    """A click callback: ``check(value)`` (None passes), its ``ValueError`` a usage error (exit 2)."""
    def callback(ctx, param, value):
        try:
            return None if value is None else check(value)
        except ValueError as e:
            raise click.BadParameter(str(e), param=param) from None
    return callback


def _ignored(option: str, applies_to: str, ignored: bool) -> None:
    """Warn (one line) when ``option``, given on the command line, is ``ignored`` here: it applies to
    ``applies_to`` only."""
    ctx = click.get_current_context()
    name = next((p.name for p in ctx.command.params if option in p.opts), None)
    if ignored and ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
        click.echo(f"warning: {option} applies to {applies_to}; here it is ignored", err=True)


def _seconds(allow_zero: bool = False):
    return _checked(lambda value: check_seconds(value, allow_zero))


def _path_problem(problem):
    """A click callback: ``problem(path)`` (app.files' ``folder_problem``, ``out_folder_problem``) other than None is
    one usage error in kvaudit's words (click's own check said ``Directory 'X' is a file.`` of a file named without
    a trailing slash only)."""
    def check(ctx, param, value):
        what = None if value is None else problem(value)
        if what is not None:
            raise click.BadParameter(f"{value or json_value(value)}: {what}", param=param)
        return value
    return check


_folder = _path_problem(folder_problem)  # a folder to read: ci --regressions
_out_folder = _path_problem(out_folder_problem)  # an output directory: fuzz/ci --out, --corpus


def _campaign_name(ctx, param, value):
    from kvaudit.search.hub import check_campaign_name

    return _checked(check_campaign_name)(ctx, param, value)


_suppress_option = click.option(
    "--suppress", "suppress_file", type=click.Path(exists=False), default=None, metavar="FILE",
    help="TOML suppression file: findings its [[suppress]] rules match are not findings (see docs/guides/reports.md).")


def _set_step_timeout(ctx, param, value):
    value = _checked(lambda v: check_step_timeout(check_seconds(v)))(ctx, param, value)  # (as kvaudit.testing.fuzz)
    if isinstance(ctx.obj, dict) and ctx.obj.get(CHECK_ONLY):
        return value  # parses(), or a command line it refused: the value checked, the runner (torch) not imported
    from kvaudit.audit.runner import set_step_timeout, step_timeout

    # process-wide: reset every command, and the caller's put back when it returns (an in-process caller, a test,
    # kept the last command's, fuzz's and ci's own for their budget included); by the root context, which closes
    # also when an option read after this one is refused (the command's own is then never closed)
    ctx.find_root().call_on_close(functools.partial(set_step_timeout, step_timeout()))
    set_step_timeout(DEFAULT_STEP_TIMEOUT if value is None else value)
    return value


_step_timeout_option = click.option(
    "--step-timeout", type=float, default=None, callback=_set_step_timeout,
    metavar="SECONDS",
    help=f"Watchdog: one engine step that runs longer is a hang finding naming the frames it is stuck in (the "
         f"step is interrupted; a step blocked inside one C call cannot be); at least {WATCHDOG_IDLE_POLL:g}. "
         f"[default: {DEFAULT_STEP_TIMEOUT:g}; "
         f"fuzz: min({DEFAULT_STEP_TIMEOUT:g}, --max-time / 6), ci's search: min({DEFAULT_STEP_TIMEOUT:g}, a preset's "
         f"share / 6), at least 1]")


_OUTPUT_HELP = {
    "html": "Write a self-contained HTML report (with a plot of pool occupancy) to OUT.",
    "sarif": "Write a SARIF 2.1.0 log (for GitHub code scanning) to OUT.",
    "junit": "Write JUnit XML, one test case per finding signature, to OUT.",
    "json": "Write the report as JSON (a replay file plus the occupancy timeline) to OUT.",
}


def output_options(f):
    """--html/--sarif/--junit/--json OUT, gathered into an ``outputs`` argument."""
    @functools.wraps(f)
    def wrapper(*a, **k):
        k["outputs"] = check_outputs(**{fmt: k.pop(f"{fmt}_out") for fmt in FORMATS})
        return f(*a, **k)

    for fmt in reversed(FORMATS):
        wrapper = click.option(f"--{fmt}", f"{fmt}_out", type=click.Path(), default=None, metavar="OUT",
                               help=_OUTPUT_HELP[fmt] + " A missing directory in OUT is created.")(wrapper)
    return wrapper


@click.group(cls=KvauditGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvaudit")
def main():
    """kvaudit: find KV-cache memory leaks, double frees and use-after-free in LLM serving schedulers."""


def _set_paranoid(ctx, param, value):
    if value:  # the environment, so that a campaign's worker processes inherit it; the caller's put back when the
        # command returns or is refused (the root context: as --step-timeout's limit)
        ctx.find_root().call_on_close(functools.partial(_put_env, "KVAUDIT_PARANOID",
                                                        os.environ.get("KVAUDIT_PARANOID")))
        os.environ["KVAUDIT_PARANOID"] = "1"
    return value


def _put_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


_paranoid_option = click.option(
    "--paranoid", is_flag=True, expose_value=False, callback=_set_paranoid,
    help="Run the full mark and sweep beside the incremental per-step check at every step and stop with an "
         "error on any disagreement between them (exit 2, as for a target's own mistake: a disagreement is "
         "never reported as a finding). Slower; for checking a target's ownership deltas.")


CHECK_ONLY = "check_only"  # ctx.obj key: the options' callbacks check their values and set nothing process-wide


def parses(args: list[str]) -> bool:
    """Whether :data:`main` accepts the command line ``args`` (``sys.argv[1:]``): parsed and checked as the
    command will be (an unknown option, a missing or wrong value: ``False``), nothing run. The entry point
    asks before it imports the engine and the search for a command that runs them, so that a mistyped flag
    is refused in a fraction of a second (docs/internals/app.md). Only click's own refusals (and its
    --help/--version exits) are ``False``: anything else the check meets (a click that deprecated what it
    reads, under ``-W error``) is ``True``, so that the command runs with its set-up and says what is wrong
    itself. Raises only what an interrupt raises."""
    try:
        with main.make_context("kvaudit", list(args), obj={CHECK_ONLY: True}) as ctx:
            with warnings.catch_warnings():  # click 8.2+ deprecates protected_args (9.0: gone, args has all)
                warnings.simplefilter("ignore", DeprecationWarning)
                lead = list(getattr(ctx, "protected_args", ()))
            name, command, rest = main.resolve_command(ctx, [*lead, *ctx.args])
            command.make_context(name, rest, parent=ctx).close()
    except (click.ClickException, click.exceptions.Exit, click.Abort):  # the command says which, the same
        return False                                                     # way, when it runs
    except Exception:
        return True
    return True


@main.command()
@common_options
@click.option("--fuzzer", type=FuzzerChoice(), default=None,
              help=fuzzers.help_text(default=DEFAULT_FUZZER) + f"  [default: {DEFAULT_FUZZER}; a campaign (--corpus, "
                   f"--workers > 1, --db): {CAMPAIGN_FUZZER}]")
@click.option("--max-time", type=float, default=60.0, show_default=True, callback=_seconds(), metavar="SECONDS",
              help="Search budget, in seconds. Start-up is not counted: the clock starts after the imports and "
                   "the first engine build (SGLang or vLLM: 5-25 s; the run's second line says how long), each "
                   "campaign worker's after its own; triage of a finding comes after.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed (0 or more); the same seed gives the same search.")
@click.option("--out", "out_dir", type=click.Path(), default="kvaudit-out", show_default=True, metavar="DIRECTORY",
              callback=_out_folder,
              help="Directory for replay files of findings (made when one is written; a replay file of the "
                   "same target kind and signature already there is replaced by the new one, any other file "
                   "of its name is left as it is and the new one takes the next free <name>.<n>.json; "
                   "--fuzzer atheris also keeps "
                   "libFuzzer's work directory and corpus in DIR/.atheris).")
@click.option("--workers", type=click.IntRange(min=1, max=256), default=1, show_default=True,
              help="Worker processes (atheris: libFuzzer -fork=N). More than 1 runs a campaign.")
@click.option("--corpus", "corpus_dir", type=click.Path(), default=None, metavar="DIR", callback=_out_folder,
              help="Run a resumable campaign over DIR (corpus, example database, findings): search the whole "
                   "budget, report each new signature once, skip those DIR already holds.")
@click.option("--db", "db_url", default=None, metavar="URL",
              help="Share the campaign with other hosts through Redis (redis://[:PASSWORD@]HOST:PORT/N or "
                   "rediss:// for TLS): one corpus, one example database, each signature triaged and reported "
                   "once across the fleet. Implies a campaign (DIR: --corpus, else --out).")
@click.option("--campaign", "campaign_name", default="default", show_default=True, metavar="NAME",
              callback=_campaign_name,
              help="With --db: the campaign's name in Redis (hosts with the same URL and name share it).")
@click.option("--seeds/--no-seeds", "use_seeds", default=True, show_default=True,
              help="atheris: start from the seed corpus in corpora/seeds/<preset> (it holds the regression "
                   "reproducers; --no-seeds to measure how the search finds them).")
@_suppress_option
@_step_timeout_option
@_paranoid_option
@output_options
@restoring_sigint
@needs_targets
def fuzz(preset, bugs, model, device, page_size, target, tree_core, fuzzer, max_time, seed, out_dir, workers,
         corpus_dir, db_url, campaign_name, use_seeds, suppress_file, step_timeout, outputs):
    """Fuzz a target (the built-in engine, or another registered kind: --target); confirm,
    minimize and report what it finds.

    Without --corpus (and one worker) the search stops at the first finding and exits 1 with a
    replay file in --out, or 0 when the budget ends clean. With --corpus DIR, or --workers N > 1
    (DIR defaults to --out), it is a campaign: it searches the whole budget, writes one replay file
    per new signature to DIR/findings/ as soon as it is confirmed, and exits 1 if any is new.
    Findings that --suppress rules match do not count: the search goes on past them.

    With --db URL the campaign spans hosts: every host's workers share one Redis; findings other
    hosts made are pulled into DIR/findings/ and are not new here.

    Exit codes: 0 clean, 1 a finding (campaign: a new one), 2 bad input (refused before any engine
    is imported), 5 nothing searched (the budget ended before one program ran), 69 what this host lacks: the
    target's engine (or the release it needs), atheris or redis-py not installed, or Redis unreachable at
    start, 130 interrupted with nothing found. Ctrl-C keeps what was found
    (unminimized if minimizing) and writes the reports asked for.
    """
    from kvaudit.app import fuzz as job

    budget = Budget.for_command(max_time, click.get_current_context().find_root().obj)
    checked = job.check_options(target=target, fuzzer=fuzzer, out_dir=out_dir, corpus_dir=corpus_dir, workers=workers,
                                db=db_url, suppress_file=suppress_file)
    config = select_config(preset, bugs, model, device, page_size, target, tree_core)  # imports the engine
    return job.run(config, checked, fuzzer=checked.fuzzer, budget=budget, seed=seed, out_dir=out_dir,
                   workers=workers, corpus_dir=corpus_dir, use_seeds=use_seeds, suppress_file=suppress_file,
                   step_timeout=step_timeout, outputs=outputs, db=db_url, campaign_name=campaign_name,
                   seeds_given=click.get_current_context().get_parameter_source("use_seeds")
                   is click.core.ParameterSource.COMMANDLINE)


@main.command("replay")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False), metavar="FILE...")
@_suppress_option
@click.option("--check-determinism", is_flag=True,
              help="Run the replay --runs times and compare the ledger digests (each pool's allocs and frees "
                   "in order, and the lock events) and findings: the second run in this process, the third and "
                   "later each in a fresh process under its own PYTHONHASHSEED (1, 2, ...); exit 3 if any run "
                   "differs.")
@click.option("--runs", type=click.IntRange(min=2, max=1000), default=CONFIRM_RUNS, show_default=True,
              help="Runs for --check-determinism.")
@replay_tree_core_option
@click.option("--update", is_flag=True,
              help="Re-record each FILE in place (atomically) instead of reporting: replay it and write back "
                   "its findings with today's stacks, source lines and signatures, keeping the config, program "
                   "and every other field (a timeline is recorded again). For keeping a corpus fresh after the "
                   "engine's code moved: kvaudit replay --update corpora/regressions/*.json. Exits 4 if a file "
                   "that recorded findings yields none (it is left as it was).")
@_step_timeout_option
@_paranoid_option
@output_options
@needs_targets
def replay_cmd(files, suppress_file, check_determinism, runs, tree_core, update, step_timeout,
               outputs):
    """Rerun a replay file and print its report. Exits 1 if it still yields findings, 0 if clean
    (or if --suppress rules match every finding); with --check-determinism, 3 if the runs differ.
    With --html or --json the program runs once more, to record the pool occupancy. With --update,
    re-record one or more files in place (see --update)."""
    from kvaudit.app import replay as job

    _ignored("--runs", "--check-determinism", not check_determinism)
    return job.run(files, suppress_file=suppress_file, check_determinism=check_determinism, runs=runs,
                   tree_core=tree_core, update=update, outputs=outputs)


@main.command("minimize")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out_file", type=click.Path(dir_okay=False), default=None, metavar="OUT",
              help="Where to write the minimized replay file (default: FILE with .min.json).")
@click.option("--signature", default=None, metavar="SIG",
              help="The finding to keep (default: the first finding recorded in FILE); one of the signatures FILE "
                   "records (any, for a file that records none).")
@_suppress_option
@_step_timeout_option
@restoring_sigint
@needs_targets
def minimize_cmd(file, out_file, signature, suppress_file, step_timeout):
    """Minimize a replay file: delta debugging over its ops, then simpler op arguments, keeping the
    finding's signature; the result is confirmed 3 of 3 times and written atomically. Exits 0 when
    written, 4 if the finding does not reproduce (or not 3 of 3 after minimizing). Ctrl-C or
    SIGTERM writes the smallest program that reproduced so far (unconfirmed) and exits 130."""
    from kvaudit.app import minimize as job

    return job.run(file, out_file=out_file, signature=signature, suppress_file=suppress_file)


@main.command("ci")
@click.option("--max-time", type=float, default=60.0, show_default=True, metavar="SECONDS",
              callback=_seconds(allow_zero=True),
              help="Search time in all, split evenly over the presets (0: replay the regressions only); each "
                   "preset's share starts once its first engine is built. Not counted: start-up, the regression "
                   "replays, building each preset's engine, triage of new findings; the job's wall time is "
                   "those plus this, and its bound is the CI job's timeout (SIGTERM: the reports are written, "
                   "exit 130).")
@click.option("--presets", "presets_value", default="all", show_default=True, metavar="LIST",
              help="Presets to fuzz: 'all' or a comma-separated list (of --target's presets).")
@click.option("--target", type=TargetChoice(), default="eut", show_default=True,
              help="The target kind whose presets are fuzzed (see 'kvaudit presets').")
@click.option("--fuzzer", type=FuzzerChoice(), default=CAMPAIGN_FUZZER, show_default=True,
              help="The fuzzer of each preset's campaign (the default keeps its programs in --corpus DIR/<preset>).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--regressions", "regressions_dir", type=click.Path(), default=None, metavar="DIR", callback=_folder,
              help="Replay files that must still reproduce (and be clean when their switches are off) "
                   "[default: the regression corpus the --target kind ships, ./corpora/regressions for the "
                   "built-in engine (docs/guides/ci.md lists each kind's); a kind that ships none needs this option].")
@click.option("--corpus", "corpus_dir", type=click.Path(), default=None, metavar="DIR", callback=_out_folder,
              help="Keep a campaign corpus per preset in DIR/<preset> between runs (nightly): known findings "
                   "are not new.")
@click.option("--db", "db_url", default=None, metavar="URL",
              help="Share each preset's campaign with the other CI shards through Redis (as fuzz --db): "
                   "campaign NAME/<preset>; what another shard found is known here, not new.")
@click.option("--campaign", "campaign_name", default="default", show_default=True, metavar="NAME",
              callback=_campaign_name,
              help="With --db: the campaigns' name prefix in Redis.")
@click.option("--out", "out_dir", type=click.Path(), default="kvaudit-ci-out", show_default=True,
              metavar="DIRECTORY", callback=_out_folder,
              help="Directory for the replay files of new findings (made when one is written).")
@_suppress_option
@_step_timeout_option
@output_options
@restoring_sigint
@needs_targets
def ci_cmd(max_time, presets_value, target, fuzzer, seed, regressions_dir, corpus_dir, db_url, campaign_name, out_dir,
           suppress_file, step_timeout, outputs):
    """The nightly / per-PR job: replay every regression file (it must reproduce 3 times
    identically with its switches on and be clean with them off), fuzz the clean engine over the
    presets for --max-time seconds of search in all, write JUnit/SARIF/HTML/JSON as asked. Exits 0 when
    clean, 1 on a failed regression (a malformed file among them: a JUnit error, and the job goes on)
    or a new finding, 2 on bad input (refused before any engine is imported), 5 when a preset's share
    ended before one program ran (nothing searched there), 69 when --target's engine (or the release it
    needs), redis-py or --fuzzer atheris's atheris is not installed, or --db's Redis cannot be reached at the
    start, 130 when interrupted (Ctrl-C or SIGTERM; the reports are written)."""
    from kvaudit.app import ci as job

    ctx = click.get_current_context()
    budget = Budget.for_command(max_time, ctx.find_root().obj)
    return job.run(budget=budget, presets_value=presets_value, fuzzer=fuzzer, seed=seed,
                   regressions_dir=regressions_dir, corpus_dir=corpus_dir, out_dir=out_dir,
                   suppress_file=suppress_file, outputs=outputs, target=target, db=db_url,
                   campaign_name=campaign_name, step_timeout=step_timeout,
                   out_given=ctx.get_parameter_source("out_dir") is not click.core.ParameterSource.DEFAULT)


@main.command("bench")
@click.option("--suite", type=click.Choice(["zoo", "history"]), default="zoo", show_default=True,
              help="zoo: the built-in engine's planted bugs; history: known SGLang and vLLM bugs in the "
                   "releases that shipped them (installs each release as a cached overlay).")
@click.option("--trials", type=click.IntRange(min=1, max=100), default=5, show_default=True,
              help="Trials per bug and fuzzer (seeds 1..N).")
@click.option("--budget", type=float, default=60.0, show_default=True, callback=_seconds(),
              metavar="SECONDS", help="Time budget of one trial.")
@click.option("--fuzzers", "fuzzers_value", default=None, metavar="LIST",
              help=f"Fuzzers to compare  [default: zoo: {','.join(fuzzers.BUILTIN_FUZZERS)}; history: the same but atheris, "
                   "which instruments the built-in engine only; either: less any that cannot run here, as atheris "
                   "where it is not installed]")
@click.option("--bugs", "bugs_value", default="all", show_default=True, metavar="LIST",
              help="The suite's bugs: 'all' or a comma-separated list ('kvaudit bugs'; history: "
                   "'kvaudit bench --suite history --list').")
@click.option("--list", "list_bugs", is_flag=True, help="List the suite's bugs (those --bugs names) and exit.")
@click.option("--jobs", type=click.IntRange(min=1, max=64), default=1, show_default=True,
              help="History: bugs searched at a time, a child process each (the trials' time budgets are "
                   "wall-clock: more jobs than cores slows each).")
@click.option("--fp-seconds", type=float, default=None, callback=_seconds(allow_zero=True), metavar="SECONDS",
              help="Zoo: clean-engine time per fuzzer for the false-positive run (default: the budget).")
@click.option("--overhead-presets", default="all", show_default=True, metavar="LIST",
              help="Zoo: presets for the overhead/throughput table ('all', a list, or 'none').")
@click.option("--out", "out_md", type=click.Path(dir_okay=False), default=None,
              help=f"Markdown report  [default: {BENCH_OUT['zoo'][0]}; history: {BENCH_OUT['history'][0]}; in the "
                   "current directory: the repository's docs/benchmarks*.md are regenerated only by naming them]")
@click.option("--json", "out_json", type=click.Path(dir_okay=False), default=None,
              help=f"Raw data  [default: {BENCH_OUT['zoo'][1]}; history: {BENCH_OUT['history'][1]}; in the current "
                   "directory]")
@restoring_sigint
def bench_cmd(suite, trials, budget, fuzzers_value, bugs_value, list_bugs, jobs, fp_seconds, overhead_presets,
              out_md, out_json):
    """Benchmark the fuzzers. --suite zoo: each bug-zoo bug x fuzzer for --trials trials of --budget
    seconds, a false-positive run on the clean engine and the overhead per preset. --suite history:
    each known SGLang/vLLM bug searched for in the release that shipped it, the minimized program
    replayed on the release that fixed it. Writes a markdown report and the raw JSON (method:
    kvaudit/search/bench.py, kvaudit/history/suite.py), by default into the current directory. Exit 0, 2 on bad input, 69 when a release cannot
    be installed, 70 when a history worker failed (the suite goes on; the report lists it), 130 when
    interrupted (the report so far is written)."""
    from kvaudit.app import bench as job

    # (not `or`: --out "" is refused as every empty output path is, not taken for the default)
    out_md = BENCH_OUT[suite][0] if out_md is None else out_md
    out_json = BENCH_OUT[suite][1] if out_json is None else out_json
    suite_only = (("--fp-seconds", "zoo"), ("--overhead-presets", "zoo"), ("--jobs", "history"))
    for option, applies in suite_only:
        _ignored(option, f"--suite {applies}", suite != applies)
    runs_only = ["--fuzzers", "--trials", "--budget", "--out", "--json"]  # (--bugs: --list lists the ones it names)
    runs_only += [option for option, applies in suite_only if suite == applies]  # (else warned above)
    for option in runs_only:
        _ignored(option, "a benchmark run, not --list", list_bugs)
    missing: tuple[str, ...] = ()
    if fuzzers_value is None and not list_bugs:  # ("" is a list of no fuzzer: refused, not the default)
        names, missing = job.default_fuzzers(history=suite == "history")
        fuzzers_value = ",".join(names)
    if suite == "history":
        return job.run_history(trials=trials, budget=budget, fuzzers_value=fuzzers_value, bugs_value=bugs_value,
                               list_bugs=list_bugs, jobs=jobs, out_md=out_md, out_json=out_json, left_out=tuple(missing))
    if list_bugs:
        return job.list_zoo(bugs_value)
    return job.run(trials=trials, budget=budget, fuzzers_value=fuzzers_value, bugs_value=bugs_value,
                   fp_seconds=fp_seconds, overhead_presets=overhead_presets, out_md=out_md, out_json=out_json,
                   left_out=tuple(missing))


@main.group("campaign")
def campaign_group():
    """A campaign that spans hosts through Redis (kvaudit fuzz --db URL --campaign NAME)."""


def _db_options(f):
    f = click.option("--campaign", "campaign_name", default="default", show_default=True, metavar="NAME",
                     callback=_campaign_name, help="The campaign's name in Redis.")(f)
    return click.option("--db", "db_url", required=True, metavar="URL",
                        help="The campaign's Redis (redis://[:PASSWORD@]HOST:PORT/N, rediss:// for TLS).")(f)


@campaign_group.command("status")
@_db_options
@click.option("--watch", type=click.FloatRange(min=0.5), default=None, metavar="SECONDS", callback=_seconds(),
              help="Refresh every SECONDS until Ctrl-C (a live table on a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of a table.")
def campaign_status_cmd(db_url, campaign_name, watch, as_json):
    """The campaign's workers across hosts (executions, exec/s, coverage, new/duplicate/flaky
    signatures, last heartbeat; 'exited' once a worker stopped, 'gone' once a heartbeat expired: a
    killed worker) and its totals. Exit 0, 2 on a bad URL or a campaign no worker ever joined (--watch
    waits for one, with a warning), 69 when Redis cannot be reached or redis-py is not installed."""
    from kvaudit.app import fleet

    return fleet.status(db_url, campaign_name, watch, as_json)


@campaign_group.command("pull")
@_db_options
@click.argument("directory", type=click.Path(file_okay=False))
def campaign_pull_cmd(db_url, campaign_name, directory):
    """Write the campaign's replay files into DIRECTORY/findings/ and its corpus programs into
    DIRECTORY/programs/, for 'kvaudit replay' and the reports. Exit 0, 2 on bad input (a campaign no
    worker ever joined included), 69 when Redis cannot be reached (or goes away during the pull) or redis-py
    is not installed."""
    from kvaudit.app import fleet

    return fleet.pull(db_url, campaign_name, directory)


@main.command("report")
@click.argument("file", type=click.Path(dir_okay=False))
@output_options
@needs_targets
def report_cmd(file, outputs):
    """Render the findings recorded in a replay or report JSON FILE: the console report, and the
    files that --html/--sarif/--junit/--json ask for. Runs no search and no engine: the occupancy
    plot (--html, --json) is the timeline FILE records (a file without one gets no plot). Exits 0
    once the report is rendered, findings or not; 2 for a bad FILE; 5 for the --json of a run
    interrupted during start-up (nothing recorded: no report is written); 69 when FILE's target is a
    plugin's kind not loaded here (KVAUDIT_PLUGINS)."""
    from kvaudit.app import report as job

    return job.run(file, outputs)


@main.command("export")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--issue", "issue_out", type=click.Path(dir_okay=False), default=None, metavar="OUT.md",
              help="Write a Markdown bug report for the engine's tracker (title, server launch, what happens and how a "
                   "server gets there, program, client reproduction, the finding's engine frames, why, fix, how "
                   "sure we are: the driver's differences and what was not verified).")
@click.option("--client", "client_out", type=click.Path(dir_okay=False), default=None, metavar="OUT.py",
              help="Write a standalone client script (standard library only) that drives a real server's HTTP "
                   "API in the program's order and prints what a maintainer should see.")
@click.option("--resolve/--no-resolve", default=True, show_default=True,
              help="Run the program on the target once to name the requests and sessions its handles picked "
                   "(without it, or without the engine installed, handles are resolved statically).")
@needs_targets
def export_cmd(file, issue_out, client_out, resolve):
    """Export a replay FILE (an SGLang or vLLM finding) as an issue report and/or a client-level reproducer.
    Exit 0 once written, 2 on a bad file or flag, 5 when FILE is the --json of a run interrupted at start-up
    (nothing recorded), 69 when FILE's target is a plugin's kind not loaded here."""
    from kvaudit.app import export as job

    return job.run(file, issue_out, client_out, resolve)


@main.command()
@click.option("--target", type=TargetChoice(), default=None, help="Only this target kind's presets (default: every kind's).")
@needs_targets
def presets(target):
    """List the engine presets (off a terminal: one plain line each)."""
    from kvaudit.app.progress import console
    from kvaudit.reports.report import print_table

    print_table(console(), presets_table(target))


@main.command()
@click.option("--target", type=TargetChoice(), default=None,
              help="Only what this target kind's --bug takes (default: every kind's).")
@needs_targets
def bugs(target):
    """List the bug-zoo switches with their preset and public source, and each target's injected faults
    (off a terminal: plain lines)."""
    from rich.table import Table

    from kvaudit.app.progress import console
    from kvaudit.reports.report import print_table

    out = console()
    for renderable in bugs_renderables(target):
        if isinstance(renderable, Table):
            print_table(out, renderable)
        else:
            out.print(renderable, soft_wrap=True)


if __name__ == "__main__":
    main()

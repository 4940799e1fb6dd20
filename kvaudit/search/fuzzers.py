"""The registry of fuzzers: every search ``--fuzzer`` names, and what each needs. Adding a fuzzer is one
module that calls :func:`register` (a plugin: named in ``KVAUDIT_PLUGINS``); the built-ins are registered
at the bottom. Design notes: docs/internals/search.md.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from kvaudit.config import json_value
from kvaudit.targets import registry as targets


class UnknownFuzzerError(ValueError):
    """A fuzzer name no registered :class:`FuzzerKind` has; the message lists the valid ones."""


class FuzzerUnavailable(RuntimeError):
    """A fuzzer cannot run here (a package or program it needs is missing): one line with the fix (the
    CLI: exit 69). ``reason``: what is missing and how to get it, without the message's option words
    (``bench`` names its own ``--fuzzers``); the message when not given."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = message if reason is None else reason


class FuzzerDefinitionError(ValueError):
    """A :class:`FuzzerKind` that does not keep the interface (a bad name, a missing callable)."""


@dataclass
class Search:
    """What one search gets besides its config, budget (seconds), seed and
    :class:`kvaudit.search.fuzz.FuzzStats`. A fuzzer ignores what it has no use for."""

    on_progress: Callable | None = None  # on_progress(stats), now and then
    suppressions: Any = None  # a kvaudit.audit.suppress.SuppressionSet, in process
    suppressions_path: str | None = None  # its file, for a fuzzer that runs in processes of its own
    known: Any = frozenset()  # signatures that are not findings (a container, or fuzz.OnlySignature)
    max_executions: int | None = None  # a second budget, in programs (kvaudit bench)
    out_dir: str | None = None  # a single run's output directory (work files in a dot-directory there)
    corpus_dir: str | None = None  # a campaign's directory (a subdirectory per fuzzer); None: not a campaign
    workers: int = 1  # a one-driver fuzzer's own parallelism
    use_seeds: bool = True  # read the shipped seed corpus (--seeds/--no-seeds)
    hub: Any = None  # a fleet's kvaudit.search.hub.Hub; None: one host
    kept: dict = field(default_factory=dict)  # filled by the fuzzer, kept across the rounds of one run


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class FuzzerKind:
    """One fuzzer. ``search(config, seconds, seed, stats, run)`` (``run``: a :class:`Search`) returns the
    first finding not in ``run.known`` nor suppressed, as ``(program, findings)``, or None when the budget
    ends; it updates ``stats`` (``executions``, ``ops``, ``stats.hit()``) and may raise
    :class:`kvaudit.search.fuzz.SearchInterrupted` carrying a finding when interrupted."""

    name: str  # what --fuzzer takes (and a replay file's "fuzzer")
    summary: str  # one line, for --fuzzer's help
    search: Callable
    check: Callable[[], None] = _nothing  # raises FuzzerUnavailable (one line) when what it needs is missing
    warm_up: Callable[[], None] = _nothing  # its one-time set-up, paid before the search's clock starts
    targets: tuple[str, ...] | None = None  # the target kinds it can search; None: every kind
    targets_why: str = ""  # why only those, in words after the fuzzer's name
    campaign: bool = True  # it can run a campaign
    bench: bool = True  # kvaudit bench runs it by default
    one_driver: bool = False  # it parallelizes inside itself: a campaign runs one driver, handed ``workers``
    uses_seeds: bool = False  # --seeds/--no-seeds applies
    in_process: bool = True  # it runs in the calling process (kvaudit.testing.fuzz takes only those)
    # a campaign's rerun resumes from what this fuzzer kept (programs, an example database), not only from the
    # findings; False: it keeps nothing, and the same --seed draws the same programs again; None: not said
    resumes: bool | None = None

    def takes(self, target: str) -> bool:
        """Whether it can search target kind ``target``."""
        return self.targets is None or target in self.targets


_FUZZERS: dict[str, FuzzerKind] = {}
BUILTIN_FUZZERS = ("hypothesis", "atheris", "random", "random-96", "corpus")  # the order ``--fuzzer`` lists them


def register(kind: FuzzerKind) -> FuzzerKind:
    """Add ``kind`` (or replace the fuzzer of the same name: a reloaded plugin) and return it. Raises
    :class:`FuzzerDefinitionError` for a bad name, a summary that is not one line or a field not callable."""
    name = kind.name
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_" for c in name):
        raise FuzzerDefinitionError(f"a fuzzer's name must be letters, digits, '-' or '_' (it is what --fuzzer "
                                    f"takes), got {json_value(name)}")
    if not isinstance(kind.summary, str) or not kind.summary.strip() or "\n" in kind.summary:
        raise FuzzerDefinitionError(f"fuzzer {name}: summary must be one line of text, got {json_value(kind.summary, 80)}")
    bad = next((f for f in ("search", "check", "warm_up") if not callable(getattr(kind, f))), None)
    if bad:
        raise FuzzerDefinitionError(f"fuzzer {name}: {bad} must be callable, got {json_value(getattr(kind, bad), 80)}")
    _FUZZERS[name] = kind if name in BUILTIN_FUZZERS else replace(kind, search=_checked_search(name, kind.search))
    targets.note_plugin_registration()  # a plugin module that registers only fuzzers registered something
    return kind


def _checked_search(name: str, search: Callable) -> Callable:
    """A plugin fuzzer's ``search`` held to its contract, so its mistakes are named as its own (one line,
    exit 2) rather than as kvaudit's internal error or an empty budget: an exception it raises (but an
    interrupt, a target's own mistake, a missing package, a full disk; ``KVAUDIT_DEBUG=1`` lets it through
    as it is), a result that is not None or ``(program, findings)`` with a program and a finding, and
    None returned before the budget ended without a program counted in ``stats.executions``."""
    def checked(config, seconds, seed, stats, run):
        t0 = time.monotonic()
        try:
            got = search(config, seconds, seed, stats, run)
        except (FuzzerUnavailable, FuzzerDefinitionError, targets.TargetDefinitionError):
            raise
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- named as the plugin's, one line
            if os.environ.get("KVAUDIT_DEBUG") or getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
                raise  # (a full disk is exit 74, whoever wrote)
            raise FuzzerDefinitionError(f"fuzzer {name}: its search raised {type(e).__name__}: {e}") from e
        from kvaudit.audit.findings import Finding  # (here: the CLI imports this module before any engine)
        from kvaudit.program import Op

        if got is None:
            spent = time.monotonic() - t0
            if stats.executions == 0 and spent < seconds:
                raise FuzzerDefinitionError(f"fuzzer {name}: its search returned None after {spent:.1f} s of its "
                                            f"{seconds:.1f} s budget with no program counted in stats.executions")
            return None
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[0], list) and got[0]
                and isinstance(got[1], list) and got[1] and all(isinstance(op, Op) for op in got[0])
                and all(isinstance(f, Finding) for f in got[1])):
            raise FuzzerDefinitionError(f"fuzzer {name}: its search must return None or (program, findings): a "
                                        f"non-empty list of kvaudit.program ops and a non-empty list of Finding, got "
                                        f"{_shape(got)}")
        return got

    return checked


def _shape(value) -> str:
    """What a value is, for an error: its type, and a pair's or list's element types (``a tuple of (list of
    int, list of Finding)``)."""
    def inner(v):
        if isinstance(v, (list, tuple)):
            kinds = sorted({type(x).__name__ for x in v})
            return f"{type(v).__name__} of {' and '.join(kinds)}" if kinds else f"empty {type(v).__name__}"
        return type(v).__name__
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return f"a {type(value).__name__} of ({inner(value[0])}, {inner(value[1])})"
    return f"a {inner(value)}"


def kinds() -> dict[str, FuzzerKind]:
    """Every registered fuzzer, by name: the built-ins first, then the plugins' in registration order.
    Loads ``KVAUDIT_PLUGINS`` first (once)."""
    targets.load_plugins()
    order = [n for n in BUILTIN_FUZZERS if n in _FUZZERS] + [n for n in _FUZZERS if n not in BUILTIN_FUZZERS]
    return {n: _FUZZERS[n] for n in order}


def get(name: str) -> FuzzerKind:
    """The fuzzer called ``name``. Raises :class:`UnknownFuzzerError` listing the valid ones."""
    all_ = kinds()
    if name not in all_:
        raise UnknownFuzzerError(f"unknown fuzzer {json_value(name, 60)} (valid: {', '.join(all_)})")
    return all_[name]


def unavailable(name: str) -> FuzzerUnavailable | None:
    """Why fuzzer ``name`` cannot run here (its ``check()``'s :class:`FuzzerUnavailable`), else None."""
    try:
        get(name).check()
    except FuzzerUnavailable as e:
        return e
    return None


def help_text(names=BUILTIN_FUZZERS, default: str | None = None) -> str:
    """``--fuzzer``'s help: ``name: summary`` per fuzzer in ``names``, ``default`` first (the built-ins
    only by default: the CLI builds it at import, before any plugin loads)."""
    order = ([default] if default in names else []) + [n for n in names if n != default]
    return "; ".join(f"{n}: {_FUZZERS[n].summary}" for n in order) + "."


def alternatives(target: str, but: str) -> list[str]:
    """The other fuzzers that can search target kind ``target``, sorted (for an error's hint)."""
    return sorted(n for n, k in kinds().items() if n != but and k.takes(target))


def words(names: list[str], last: str = "or") -> str:
    """``a, b or c``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" {last} " + names[-1]


# -- the built-ins -----------------------------------------------------------------------------------

def _hypothesis(config, seconds, seed, stats, run: Search):
    from kvaudit.search.fuzz import hypothesis_search

    database = None
    if run.corpus_dir is not None:  # a campaign keeps Hypothesis's example database in DIR/hypothesis
        database = os.path.join(run.corpus_dir, "hypothesis")
        if run.hub is not None:
            database = run.hub.example_database(database)
    return hypothesis_search(config, seconds, seed, stats, on_progress=run.on_progress,
                             suppressions=run.suppressions, known=run.known, database=database,
                             max_executions=run.max_executions)


def settle_heap() -> int:
    """After start-up (the engine imported, the first engine built): collect, then move every object left
    to the collector's permanent generation (``gc.freeze``). Returns the objects frozen.

    NOTE: so that the full collections that free each program's target cycles come every few hundred
    programs, not after the ~650,000 objects vLLM and torch bring (docs/internals/fuzzers.md, "Memory")."""
    import gc

    gc.collect()
    gc.freeze()
    gc.collect()  # (the threshold counts the oldest generation as the last full collection left it: now ~0)
    return gc.get_freeze_count()


def _warm_up_hypothesis() -> None:
    from kvaudit.search.fuzz import warm_up_hypothesis

    warm_up_hypothesis()


def _random(config, seconds, seed, stats, run: Search, lengths: dict | None = None):
    from kvaudit.search.fuzz import random_search

    return random_search(config, seconds, seed, stats, on_progress=run.on_progress, suppressions=run.suppressions,
                         known=run.known, max_executions=run.max_executions, **(lengths or {}))


def _random_96(config, seconds, seed, stats, run: Search):
    """``random`` at the corpus fuzzer's fresh lengths: for a seed, the programs of its first 1,024
    executions (:data:`kvaudit.search.corpus_fuzz.WARMUP`), and of every execution after."""
    from kvaudit.search.corpus_fuzz import MAX_OPS, MIN_OPS

    return _random(config, seconds, seed, stats, run, dict(min_ops=MIN_OPS, max_ops=MAX_OPS))


def _corpus(config, seconds, seed, stats, run: Search):
    from kvaudit.search.corpus_fuzz import Corpus, CorpusStore, corpus_search

    corpus = run.kept.setdefault("corpus", Corpus())  # past a flaky finding, the search goes on from it
    store = None
    if run.corpus_dir is not None:  # a campaign keeps the programs in DIR/programs
        store = run.kept.setdefault("store", CorpusStore(os.path.join(run.corpus_dir, "programs"), mirror=run.hub))
    return corpus_search(config, seconds, seed, stats, on_progress=run.on_progress, suppressions=run.suppressions,
                         known=run.known, corpus=corpus, max_executions=run.max_executions, store=store)


def _atheris(config, seconds, seed, stats, run: Search):
    from kvaudit.search.atheris_fuzz import atheris_search

    corpus_dir = work_dir = None
    if run.corpus_dir is not None:  # a campaign keeps libFuzzer's corpus in DIR/atheris
        corpus_dir, work_dir = os.path.join(run.corpus_dir, "atheris"), os.path.join(run.corpus_dir, ".atheris-work")
    elif run.out_dir is not None:
        work_dir = os.path.join(run.out_dir, ".atheris")
    if run.hub is not None:
        run.hub.sync_dir("atheris", corpus_dir)  # the fleet's inputs in, this host's out (and again below)
    found = atheris_search(config, seconds, seed, stats, on_progress=run.on_progress, corpus_dir=corpus_dir,
                           workers=run.workers, suppressions_path=run.suppressions_path, known=run.known,
                           work_dir=work_dir, use_seeds=run.use_seeds)
    if run.hub is not None:
        run.hub.sync_dir("atheris", corpus_dir)
    return found


def _check_atheris() -> None:
    from kvaudit.constants import MISSING_ATHERIS
    from kvaudit.search.atheris_fuzz import HARNESS

    try:
        import atheris
    except ImportError:
        raise FuzzerUnavailable(f"--fuzzer atheris: {MISSING_ATHERIS}; or use --fuzzer random-96, corpus, "
                                "hypothesis or random", MISSING_ATHERIS) from None
    del atheris
    if not os.access(HARNESS, os.X_OK):
        why = f"the harness {HARNESS} is missing or not executable (reinstall kvaudit: the wheel ships it)"
        raise FuzzerUnavailable(f"--fuzzer atheris: {why}", why)


register(FuzzerKind(
    "hypothesis", "stateful generation with shrinking and swarm testing", _hypothesis, warm_up=_warm_up_hypothesis))
register(FuzzerKind(
    "atheris", "coverage-guided libFuzzer over a byte encoding of programs (the built-in engine only)", _atheris,
    check=_check_atheris, targets=("eut",), targets_why="instruments the built-in engine only", one_driver=True,
    uses_seeds=True, in_process=False, resumes=True))
register(FuzzerKind("random", "the plain random baseline (4-24-op programs)", _random, resumes=False))
register(FuzzerKind(
    "random-96", "fresh random 16-96-op programs, no feedback (corpus's first 1,024 programs for a seed, then more "
                 "fresh ones)", _random_96, resumes=False))
register(FuzzerKind(
    "corpus", "fresh 16-96-op random programs, then a mutated program corpus guided by the scheduler states "
              "reached (a campaign keeps it in DIR/programs)", _corpus, resumes=True))

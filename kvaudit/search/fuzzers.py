"""The registry of fuzzers: every search ``--fuzzer`` names, and what each needs.

A fuzzer registers, once, a :class:`FuzzerKind`: its name and one line of help, how it runs one
search within a budget, what it needs installed, which target kinds it can search and what it keeps
across the rounds of a run. ``kvaudit fuzz``, campaigns (``fuzz --corpus``, ``ci``), ``kvaudit bench``
(both suites), the history worker and :func:`kvaudit.testing.fuzz` all read it, so adding a fuzzer
is one module that calls :func:`register`.

The built-ins (``hypothesis``, ``atheris``, ``random``, ``corpus``) are registered at the bottom of
this module; their searches import what they need when called (``kvaudit --help`` imports neither
Hypothesis nor torch). A plugin fuzzer comes from a module named in ``KVAUDIT_PLUGINS``, the variable
target plugins use, loaded once by :func:`kvaudit.targets.registry.load_plugins` (a module may
register target kinds, fuzzers or both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from kvaudit.targets import registry as targets


class UnknownFuzzerError(ValueError):
    """A fuzzer name no registered :class:`FuzzerKind` has; the message lists the valid ones."""


class FuzzerUnavailable(RuntimeError):
    """A fuzzer cannot run here (a package or program it needs is missing): one line with the fix (the
    CLI: exit 69)."""


class FuzzerDefinitionError(ValueError):
    """A :class:`FuzzerKind` that does not keep the interface (a bad name, a missing callable)."""


@dataclass
class Search:
    """What one search gets besides its config, budget (seconds), seed and
    :class:`kvaudit.search.fuzz.FuzzStats`.

    ``on_progress(stats)``: called now and then. ``suppressions``: a
    :class:`kvaudit.audit.suppress.SuppressionSet` (in process) and ``suppressions_path`` its file (for
    a fuzzer that runs in processes of its own). ``known``: signatures that are not findings (a
    container, or :class:`kvaudit.search.fuzz.OnlySignature`). ``max_executions``: a second budget, in
    programs (``kvaudit bench``; a fuzzer that counts no programs ignores it). ``out_dir``: a single
    run's output directory (a fuzzer may keep work files in a dot-directory there); ``corpus_dir``: a
    campaign's directory (each fuzzer keeps its own subdirectory there across runs; None: not a
    campaign). ``workers``: a one-driver fuzzer's own parallelism. ``use_seeds``: read the shipped seed
    corpus (``--seeds/--no-seeds``). ``hub``: a fleet's :class:`kvaudit.search.hub.Hub` (None: one host).
    ``kept``: filled by the fuzzer, kept across the rounds of one run (a round after a flaky finding
    goes on from what the last one learnt)."""

    on_progress: Callable | None = None
    suppressions: Any = None
    suppressions_path: str | None = None
    known: Any = frozenset()
    max_executions: int | None = None
    out_dir: str | None = None
    corpus_dir: str | None = None
    workers: int = 1
    use_seeds: bool = True
    hub: Any = None
    kept: dict = field(default_factory=dict)


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class FuzzerKind:
    """One fuzzer.

    ``name``: what ``--fuzzer`` takes (and a replay file's ``fuzzer``). ``summary``: one line for
    ``--fuzzer``'s help. ``search(config, seconds, seed, stats, run)`` (``run``: a :class:`Search`):
    the first finding not in ``run.known`` nor suppressed, as ``(program, findings)``, or None when the
    budget ends; updates ``stats`` (``executions``, ``ops``, ``first_hit`` through ``stats.hit()``); may
    raise :class:`kvaudit.search.fuzz.SearchInterrupted` carrying a finding when interrupted.

    Optional: ``check()`` raises :class:`FuzzerUnavailable` (one line) when what it needs is not
    installed; ``warm_up()`` pays its one-time set-up before the search's clock starts; ``targets``: the
    target kinds it can search (None: every kind) and ``targets_why`` the reason, in words, after the
    fuzzer's name; ``campaign``: it can run a campaign; ``bench``: ``kvaudit bench`` runs it by default;
    ``one_driver``: it parallelizes inside itself (a campaign runs one driver and hands it ``workers``);
    ``uses_seeds``: ``--seeds/--no-seeds`` applies; ``in_process``: it runs in the calling process
    (:func:`kvaudit.testing.fuzz` takes only those)."""

    name: str
    summary: str
    search: Callable
    check: Callable[[], None] = _nothing
    warm_up: Callable[[], None] = _nothing
    targets: tuple[str, ...] | None = None
    targets_why: str = ""
    campaign: bool = True
    bench: bool = True
    one_driver: bool = False
    uses_seeds: bool = False
    in_process: bool = True

    def takes(self, target: str) -> bool:
        """Whether it can search target kind ``target``."""
        return self.targets is None or target in self.targets


_FUZZERS: dict[str, FuzzerKind] = {}
BUILTIN_FUZZERS = ("hypothesis", "atheris", "random", "corpus")  # the order ``--fuzzer`` lists them


def register(kind: FuzzerKind) -> FuzzerKind:
    """Add ``kind`` (or replace the fuzzer of the same name: a reloaded plugin). Returns it. Raises
    :class:`FuzzerDefinitionError` for a name ``--fuzzer`` cannot take, a summary that is not one line
    or a field that should be callable and is not."""
    name = kind.name
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_" for c in name):
        raise FuzzerDefinitionError(f"a fuzzer's name must be letters, digits, '-' or '_' (it is what --fuzzer "
                                    f"takes), got {name!r}")
    if not isinstance(kind.summary, str) or not kind.summary.strip() or "\n" in kind.summary:
        raise FuzzerDefinitionError(f"fuzzer {name}: summary must be one line of text, got {kind.summary!r}")
    bad = next((f for f in ("search", "check", "warm_up") if not callable(getattr(kind, f))), None)
    if bad:
        raise FuzzerDefinitionError(f"fuzzer {name}: {bad} must be callable, got {getattr(kind, bad)!r}")
    _FUZZERS[name] = kind
    targets.note_plugin_registration()  # a plugin module that registers only fuzzers registered something
    return kind


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
        raise UnknownFuzzerError(f"unknown fuzzer {name!r} (valid: {', '.join(all_)})")
    return all_[name]


def help_text(names=BUILTIN_FUZZERS, default: str | None = None) -> str:
    """``--fuzzer``'s help: ``name: summary`` per fuzzer in ``names``, ``default`` first (the built-ins
    only unless told: the CLI builds it at import, before any plugin loads)."""
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


def _warm_up_hypothesis() -> None:
    from kvaudit.search.fuzz import warm_up_hypothesis

    warm_up_hypothesis()


def _random(config, seconds, seed, stats, run: Search):
    from kvaudit.search.fuzz import random_search

    return random_search(config, seconds, seed, stats, on_progress=run.on_progress, suppressions=run.suppressions,
                         known=run.known, max_executions=run.max_executions)


def _corpus(config, seconds, seed, stats, run: Search):
    from kvaudit.search.corpus_fuzz import Corpus, CorpusStore, corpus_search

    corpus = run.kept.setdefault("corpus", Corpus())  # past a flaky finding, the search goes on from it
    store = None
    if run.corpus_dir is not None:  # a campaign keeps the programs in DIR/programs
        store = run.kept.get("store") or run.kept.setdefault(
            "store", CorpusStore(os.path.join(run.corpus_dir, "programs"), mirror=run.hub))
    return corpus_search(config, seconds, seed, stats, on_progress=run.on_progress, suppressions=run.suppressions,
                         known=run.known, corpus=corpus, max_executions=run.max_executions,
                         **({"store": store} if store is not None else {}))


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
    """atheris importable and the executable harness shipped: else :class:`FuzzerUnavailable`."""
    from kvaudit.constants import MISSING_ATHERIS
    from kvaudit.search.atheris_fuzz import HARNESS

    try:
        import atheris
    except ImportError:
        raise FuzzerUnavailable(f"--fuzzer atheris: {MISSING_ATHERIS}; or use --fuzzer corpus, hypothesis or "
                                "random") from None
    del atheris
    if not os.access(HARNESS, os.X_OK):
        raise FuzzerUnavailable(f"--fuzzer atheris: the harness {HARNESS} is missing or not executable (reinstall "
                                "kvaudit: the wheel ships it)")


register(FuzzerKind(
    "hypothesis", "stateful generation with shrinking and swarm testing", _hypothesis, warm_up=_warm_up_hypothesis))
register(FuzzerKind(
    "atheris", "coverage-guided libFuzzer over a byte encoding of programs (the built-in engine only)", _atheris,
    check=_check_atheris, targets=("eut",), targets_why="instruments the built-in engine only", one_driver=True,
    uses_seeds=True, in_process=False))
register(FuzzerKind("random", "the plain random baseline (4-24-op programs)", _random))
register(FuzzerKind(
    "corpus", "fresh 16-96-op random programs, then a mutated program corpus guided by the scheduler states "
              "reached (a campaign keeps it in DIR/programs)", _corpus))

"""The bug zoo as a fuzzer benchmark (``kvaudit bench``), after Magma and FuzzBench practice: N trials per
zoo bug and fuzzer, success rates, time- and executions-to-bug against ``random`` (Mann-Whitney U,
Vargha-Delaney A12), a false-positive run and the instrumentation overhead, as a markdown report.

Design notes (what counts as found, the statistics): docs/internals/fuzzers.md.
"""

from __future__ import annotations

import math
import os
import random as _random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from kvaudit.atomic import scratch_dir
from kvaudit.config import TargetConfig
from kvaudit.targets import registry
from kvaudit.search import fuzzers, schedule
from kvaudit.search.fuzz import FuzzStats, triage
from kvaudit.audit.runner import AuditedRun, execute


def _eut():
    return registry.get("eut")


@dataclass
class Trial:
    bug: str
    fuzzer: str
    seed: int
    budget: float
    success: bool = False
    seconds: float | None = None  # to the first detection of the bug
    executions: int | None = None  # programs run up to and including the detecting one
    min_len: int | None = None  # ops in the minimized program
    first_oracle: str | None = None  # kind of the first finding (the oracle that caught it)
    expected_kind: str = ""
    engine_idle_check: bool | None = None  # SGLang's idle check alone fails on the same program
    note: str = ""  # why a trial failed, or another finding it made
    wall: float = 0.0  # the whole trial, triage included

    def succeeded(self, crash, executions: int, seconds: float) -> None:
        """The trial found its bug: ``crash`` (:class:`kvaudit.search.fuzz.Crash`), first detected after
        ``executions`` programs and ``seconds``."""
        self.success, self.executions, self.seconds = True, executions, seconds
        self.min_len, self.first_oracle = len(crash.program), crash.finding.kind


def search(fuzzer: str, config: TargetConfig, budget: float, seed: int, stats: FuzzStats, work_dir: str,
           known=frozenset(), max_executions: int | None = None):
    """One search of ``budget`` seconds by ``fuzzer`` without the seed corpus (``known``, ``max_executions``:
    :class:`kvaudit.search.fuzzers.Search`); ``work_dir``: where a fuzzer may keep work files."""
    return fuzzers.get(fuzzer).search(config, budget, seed, stats, fuzzers.Search(
        known=known, max_executions=max_executions, out_dir=work_dir, use_seeds=False))


OVERRUN_GRACE = 0.1
"""Seconds past the budget a trial's first hit may land and count: the program running when the clock ran
out. A hit later than that (an atheris child's start-up is counted, and libFuzzer takes whole seconds) is a
miss, so every fuzzer's success rate is over the same budget."""


def run_trial(bug: str, fuzzer: str, seed: int, budget: float) -> Trial:
    info = _eut().bugs()[bug]
    config = _eut().preset(info.preset).config(bugs=frozenset([bug]))
    trial = Trial(bug, fuzzer, seed, budget, expected_kind=info.finding)
    stats = FuzzStats()
    t0 = time.monotonic()
    with scratch_dir("kvaudit-bench-") as work:
        found = search(fuzzer, config, budget, seed, stats, work)
        # the first detection, before Hypothesis's shrinking (atheris and random do not shrink)
        executions, seconds = stats.first_hit or (stats.executions, time.monotonic() - t0)
        if found is None:
            trial.note = "not found within the budget"
        elif seconds > budget + OVERRUN_GRACE:  # a child's start-up (atheris's) counted: censored, as a miss
            trial.note = f"found after {seconds:.1f} s, past the {budget:g} s budget: counted as not found"
        else:
            program, findings = found
            crash = triage(config, program, findings[0])
            clean = _eut().preset(info.preset).config()
            if crash is None:
                trial.note = f"{findings[0].signature} did not reproduce 3/3"
            elif execute(clean, crash.program, full_stacks=False).findings:
                trial.note = f"{crash.finding.signature} also fires without the switch: not the bug"
            else:
                trial.succeeded(crash, executions, seconds)
                trial.engine_idle_check = _eut().engine_check(config, program)[0] is not None
                if crash.finding.kind != info.finding:
                    trial.note = f"found as {crash.finding.kind} (the table says {info.finding})"
    trial.wall = time.monotonic() - t0
    return trial


# -- statistics ------------------------------------------------------------------------------------

def a12(x: list[float], y: list[float]) -> float:
    """Vargha-Delaney A12: the probability that a value of ``x`` is larger than one of ``y`` (ties count
    half); nan for an empty sample."""
    if not x or not y:
        return math.nan
    gt = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in x for b in y)
    return gt / (len(x) * len(y))


def mann_whitney_p(x: list[float], y: list[float]) -> float:
    """Two-sided Mann-Whitney U p-value (scipy); nan when a sample has fewer than 2 values or all values tie."""
    from scipy.stats import mannwhitneyu

    if len(x) < 2 or len(y) < 2 or len(set(x) | set(y)) == 1:
        return math.nan
    return float(mannwhitneyu(x, y, alternative="two-sided").pvalue)


def _quantiles(v: list[float]) -> tuple[float, float, float] | None:
    if not v:
        return None
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return float(q1), float(med), float(q3)


@dataclass
class Cell:
    """One bug x fuzzer: the trials' summary."""

    bug: str
    fuzzer: str
    trials: int
    successes: int
    time_q: tuple | None  # (q1, median, q3) seconds over successful trials
    execs_q: tuple | None
    min_len_median: float | None
    first_oracles: list[str]
    engine_idle_check: str  # "yes" / "no" / "some" over the successful trials
    p_vs_random: float = math.nan
    a12_vs_random: float = math.nan

    def _median(self, q: tuple | None) -> float | None:
        # NOTE: with half the trials or more failed the median is not reached (a censored value)
        return q[1] if q and self.successes * 2 > self.trials else None

    @property
    def median_time(self) -> float | None:
        return self._median(self.time_q)

    @property
    def median_execs(self) -> float | None:
        return self._median(self.execs_q)


def summarize(trials: list[Trial]) -> list[Cell]:
    cells = []
    groups: dict[tuple[str, str], list[Trial]] = {}
    for t in trials:
        groups.setdefault((t.bug, t.fuzzer), []).append(t)

    def censored_times(ts: list[Trial]) -> list[float]:
        return [t.seconds if t.success else t.budget for t in ts]

    for (bug, fuzzer), ts in groups.items():
        ok = [t for t in ts if t.success]
        checks = {t.engine_idle_check for t in ok}
        cell = Cell(bug, fuzzer, len(ts), len(ok), _quantiles([t.seconds for t in ok]),
                    _quantiles([float(t.executions) for t in ok]),
                    statistics.median([t.min_len for t in ok]) if ok else None,
                    sorted({t.first_oracle for t in ok}),
                    "yes" if checks == {True} else "no" if checks == {False} else "some" if checks else "-")
        rand = groups.get((bug, "random"))
        if rand is not None and fuzzer != "random":
            x, y = censored_times(ts), censored_times(rand)
            cell.p_vs_random, cell.a12_vs_random = mann_whitney_p(x, y), a12(x, y)
        cells.append(cell)
    return cells


def geomean_exec_ratio(cells: list[Cell], fuzzer: str) -> tuple[float | None, int]:
    """(Geometric mean of median executions(random) / median executions(``fuzzer``), the number of bugs)
    over the bugs whose both medians are reached; > 1: fewer executions than random."""
    by = {(c.bug, c.fuzzer): c for c in cells}
    pairs = [(by.get((bug, "random")), c) for (bug, f), c in by.items() if f == fuzzer]
    ratios = [r.median_execs / c.median_execs for r, c in pairs if r is not None and c.median_execs and r.median_execs]
    if not ratios:
        return None, 0
    return math.exp(sum(math.log(x) for x in ratios) / len(ratios)), len(ratios)


def geomean_cells(cells: list[Cell], fuzzers: list[str]) -> list[str]:
    """Per fuzzer, :func:`geomean_exec_ratio` as a table cell ("2.50x fewer (4 bugs)")."""
    out = []
    for f in fuzzers:
        g, n = geomean_exec_ratio(cells, f)
        bugs = f"{n} bug" + ("s" if n != 1 else "")
        out.append("1 (baseline)" if f == "random" else "-" if g is None
                   else f"{g:.2f}x fewer ({bugs})" if g >= 1 else f"{1 / g:.2f}x more ({bugs})")
    return out


# -- false positives, overhead, throughput ---------------------------------------------------------

def false_positive_run(fuzzer: str, seconds: float, seed: int = 1) -> dict:
    """``fuzzer`` over the clean engine of every preset, ``seconds`` in all: findings must be none."""
    per = seconds / len(_eut().presets())
    found, executions = [], 0
    with scratch_dir("kvaudit-bench-fp-") as work:
        for preset in _eut().presets():
            config = _eut().preset(preset).config()
            deadline = time.monotonic() + per
            stats = FuzzStats()
            while time.monotonic() < deadline:
                hit = search(fuzzer, config, deadline - time.monotonic(), seed + len(found), stats, work)
                if hit is None:
                    break
                found.append({"preset": preset, "signature": hit[1][0].signature})
                if not fuzzers.get(fuzzer).in_process:
                    break  # a driver in a process of its own (atheris) would hit the same input again
            executions += stats.executions
    return {"fuzzer": fuzzer, "seconds": seconds, "executions": executions, "findings": found}


OVERHEAD_MODES = (  # name, hooks (ledger), oracles after every step, shadow KV tags
    ("hooks off", False, False, False),
    ("hooks on", True, False, True),
    ("full oracles", True, True, True),
)


def run_programs(config: TargetConfig, programs: list, audit: bool, oracles: bool, full_stacks: bool,
                 shadow: bool, check_every: int = 1, lean: bool | None = None) -> tuple[float, int, int]:
    """Run every program from a fresh engine in one mode (``check_every``: the oracles' schedule; ``lean``:
    the hooks' lean mode, None: as a search runs them, lean on a sparse schedule;
    :class:`kvaudit.audit.runner.AuditedRun`; a lean run collects the site keys in the programs a search
    would, :func:`kvaudit.search.schedule.site_keys_due`); (process CPU seconds, ops, steps)."""
    ops = steps = 0
    lean = check_every > 1 if lean is None else lean
    t0 = time.process_time()
    for i, prog in enumerate(programs):
        with AuditedRun(config, audit=audit, run_oracles=oracles, full_stacks=full_stacks, shadow=shadow,
                        check_every=check_every, lean=lean, site_keys=schedule.site_keys_due(i + 1)) as r:
            for op in prog:
                r.apply(op)
            r.finish()
        ops += len(prog)
        steps += r.target.steps
    return time.process_time() - t0, ops, steps


def best_times(config: TargetConfig, programs: list, modes, rounds: int) -> tuple[dict[str, float], int]:
    """Process CPU seconds per mode (``(name, audit, oracles, shadow[, check_every])`` rows, fast stacks) over
    ``programs``, best of ``rounds`` with the modes taking turns, and the ops one round runs."""
    best: dict[str, float] = {}
    ops = 0
    for _ in range(rounds):
        for name, audit, oracles, shadow, *every in modes:
            secs, ops, _ = run_programs(config, programs, audit, oracles, False, shadow, *every)
            best[name] = min(best.get(name, math.inf), secs)
    return best, ops


def build_ms(config: TargetConfig, builds: int = 10) -> float:
    """Milliseconds one target of ``config`` takes to build, after a first build (what a process loads once)."""
    from kvaudit.targets import make_target

    make_target(config)
    t = time.perf_counter()
    for _ in range(builds):
        make_target(config)
    return (time.perf_counter() - t) * 1000 / builds


def overhead(preset: str, model: str, programs: int = 100, length: int = 20, rounds: int = 3,
             seed: int = 1) -> dict[str, float]:
    """Programs/s per :data:`OVERHEAD_MODES` mode (best of ``rounds``, process CPU time, one core)."""
    import torch

    from kvaudit.program import random_program

    torch.set_num_threads(1)
    rng = _random.Random(seed)
    progs = [random_program(rng, length) for _ in range(programs)]
    config = _eut().preset(preset).config(model=model)
    best, _ = best_times(config, progs, OVERHEAD_MODES, rounds)
    return {name: programs / secs for name, secs in best.items()}


@dataclass
class BenchResult:
    trials: list[Trial] = field(default_factory=list)
    false_positives: list[dict] = field(default_factory=list)
    overhead: list[dict] = field(default_factory=list)  # {"preset", "model", mode: programs/s}
    wall: float = 0.0
    settings: dict = field(default_factory=dict)
    interrupted: bool = False  # Ctrl-C or SIGTERM ended it: the parts that finished

    def to_json(self) -> dict:
        return {"format": "kvaudit.bench/1", "settings": self.settings, "wall_seconds": round(self.wall, 1),
                "interrupted": self.interrupted,
                "trials": [asdict(t) for t in self.trials], "false_positives": self.false_positives,
                "overhead": self.overhead}


def run(bugs: list[str], fuzzers: list[str], trials: int, budget: float, fp_seconds: float,
        overhead_presets: list[str], on_event: Callable[[str], None] = print) -> BenchResult:
    """The whole benchmark; ``on_event`` gets one line per finished step. Ctrl-C (or SIGTERM, under the
    CLI) ends it early: the result holds the trials and rows that finished, ``interrupted`` set."""
    res = BenchResult(settings={"bugs": bugs, "fuzzers": fuzzers, "trials": trials, "budget": budget,
                                "fp_seconds": fp_seconds, "overhead_presets": overhead_presets,
                                "cpu_count": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    t0 = time.monotonic()
    try:
        _run_parts(res, bugs, fuzzers, trials, budget, fp_seconds, overhead_presets, on_event)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the result holds the parts that finished
        res.interrupted = True
    res.wall = time.monotonic() - t0
    return res


def _run_parts(res: BenchResult, bugs, fuzzers, trials, budget, fp_seconds, overhead_presets, on_event) -> None:
    for bug in bugs:
        for fuzzer in fuzzers:
            for seed in range(1, trials + 1):
                t = run_trial(bug, fuzzer, seed, budget)
                res.trials.append(t)
                on_event(f"{bug:32} {fuzzer:10} seed {seed}: "
                         + (f"found in {t.seconds:.1f}s, {t.executions} executions, {t.min_len} ops, {t.first_oracle}"
                            if t.success else "not found") + (f" ({t.note})" if t.note else ""))
    for fuzzer in fuzzers:
        fp = false_positive_run(fuzzer, fp_seconds)
        res.false_positives.append(fp)
        on_event(f"false positives, {fuzzer}: {len(fp['findings'])} in {fp['executions']} executions")
    for preset in overhead_presets:
        for model in ("none", "tiny"):
            row = {"preset": preset, "model": model, **overhead(preset, model)}
            res.overhead.append(row)
            on_event(f"throughput {preset} {model}: " + ", ".join(f"{k} {v:.1f}/s" for k, v in row.items()
                                                                 if isinstance(v, float)))


# -- the markdown report ---------------------------------------------------------------------------

def _fmt_q(q: tuple | None, unit: str = "", digits: int = 1) -> str:
    if q is None:
        return "-"
    return f"{q[1]:.{digits}f}{unit} [{q[0]:.{digits}f}-{q[2]:.{digits}f}]"


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(header, rows) -> list[str]:
    """A markdown table's lines: ``header``'s row, its rule, a row per item of ``rows``."""
    return [_row(*header), "|" + "---|" * len(header), *(_row(*r) for r in rows)]


def trial_cells(c: Cell) -> tuple:
    """found, time to bug, executions to bug, min ops: as both suites' tables show a bug x fuzzer."""
    return (f"{c.successes}/{c.trials}", _fmt_q(c.time_q), _fmt_q(c.execs_q, digits=0),
            "-" if c.min_len_median is None else c.min_len_median)


def vs_random_cells(c: Cell) -> tuple[str, str]:
    return ("-" if math.isnan(c.p_vs_random) else f"{c.p_vs_random:.3f}",
            "-" if math.isnan(c.a12_vs_random) else f"{c.a12_vs_random:.2f}")


def markdown(res: BenchResult, raw: str = "benchmarks.json") -> str:
    """The zoo report; ``raw``: the name of the raw-data file written beside it."""
    cells = summarize(res.trials)
    s = res.settings
    fuzzers = s["fuzzers"]
    lines = [
        "# kvaudit on the bug zoo",
        "",
        f"Generated by `kvaudit bench --trials {s['trials']} --budget {s['budget']:g} --fuzzers {','.join(fuzzers)} "
        + (f"--bugs {','.join(s['bugs'])} " if set(s['bugs']) != set(_eut().bugs()) else "")
        + f"--fp-seconds {s.get('fp_seconds', s['budget']):g} "
        f"--overhead-presets {','.join(s.get('overhead_presets', [])) or 'none'}` "
        f"on {s['started']} ({s['cpu_count']} CPUs; wall time {res.wall / 60:.1f} min"
        + ("; INTERRUPTED: partial" if res.interrupted else "") + f"). Raw data: `{raw}`.",
        f"Each zoo bug x fuzzer: {s['trials']} trials (seeds 1..{s['trials']}), at most {s['budget']:g} s each, one "
        "core; a trial succeeds when a finding is confirmed 3/3 and its minimized program is clean with the "
        "switch off. Times and executions are to the first detection (before triage): median [IQR] over "
        "the successful trials; a median is '-' when half the trials or more failed. p and A12 compare "
        "time-to-bug with `random` (Mann-Whitney U, two-sided; Vargha-Delaney A12 < 0.5: faster than "
        "random), failed trials counted as the budget (p is '-' with fewer than 2 trials). 'SGLang idle check' "
        "says whether the engine's own `check_memory()` at idle fails on the same programs.",
        "",
        "## Headline",
        "",
    ]
    by = {(c.bug, c.fuzzer): c for c in cells}
    lines += _headline(res, cells, by)
    lines += ["", "## Per bug", ""] + table(
        ("bug", "expected", "fuzzer", "found", "time to bug (s)", "executions to bug", "min ops", "oracle",
         "SGLang idle check", "p vs random", "A12 vs random"),
        ((c.bug, _eut().bugs()[c.bug].finding, c.fuzzer, *trial_cells(c), ", ".join(c.first_oracles) or "-",
          c.engine_idle_check, *vs_random_cells(c)) for c in (by[(b, f)] for b in s["bugs"] for f in fuzzers
                                                               if (b, f) in by)))
    lines += _trials_and_runs(res)
    return "\n".join(lines) + "\n"


def _headline(res: BenchResult, cells: list[Cell], by: dict) -> list[str]:
    fuzzers, bugs = res.settings["fuzzers"], res.settings["bugs"]
    mine = {f: [by[(b, f)] for b in bugs if (b, f) in by] for f in fuzzers}
    worst = []
    for f in fuzzers:
        meds = [c.median_time for c in mine[f]]
        worst.append("-" if any(m is None for m in meds) or not meds else f"{max(meds):.1f} s")
    fp = {d["fuzzer"]: d for d in res.false_positives}
    lines = table(("target", *fuzzers), [
        ("bugs found (at least once)", *(f"{sum(1 for c in mine[f] if c.successes)}/{len(mine[f])}"
                                         + (f" ({len(bugs) - len(mine[f])} not run: interrupted)"
                                            if len(mine[f]) < len(bugs) else "") for f in fuzzers)),
        ("success rate over all trials",
         *(f"{sum(c.successes for c in mine[f])}/{sum(c.trials for c in mine[f])}" for f in fuzzers)),
        ("slowest median time-to-bug (target <= 60 s for every bug)", *worst),
        ("geometric mean of median executions-to-bug vs random (target >= 5x fewer)", *geomean_cells(cells, fuzzers)),
        ("false positives on the clean engine (target 0)",
         *(f"{len(fp[f]['findings'])} in {fp[f]['executions']} programs" if f in fp else "-" for f in fuzzers)),
    ])
    if res.overhead:
        ov = [r for r in res.overhead if r["model"] == "none"]
        worst_ov = max(r["hooks off"] / r["full oracles"] for r in ov) if ov else math.nan
        lines += ["", f"Full oracles cost up to {worst_ov:.2f}x over hooks off with `model=none` (target <= 1.5x); "
                      "see the throughput table."]
    return lines


def _trials_and_runs(res: BenchResult) -> list[str]:
    lines: list[str] = []
    notes = [t for t in res.trials if t.note and t.success]
    fails = [t for t in res.trials if not t.success]
    if notes or fails:
        lines += ["", "## Trial notes", ""]
        lines += [f"- {t.bug}, {t.fuzzer}, seed {t.seed}: {t.note}" for t in fails + notes]
    lines += ["", "## False-positive run", ""] + table(
        ("fuzzer", "seconds", "programs", "findings"),
        ((d["fuzzer"], f"{d['seconds']:g}", d["executions"],
          ", ".join(x["preset"] + ": " + x["signature"] for x in d["findings"]) or "none")
         for d in res.false_positives))
    if res.overhead:
        lines += ["", "## Instrumentation overhead and throughput", "",
                  "Programs/s on one core (100 random programs of 20 ops, best of 3 rounds, the modes taking "
                  "turns, process CPU time). 'hooks on' is the fuzzers' search mode (ledger + shadow KV tags); "
                  "'full oracles' adds reachability, the identities and liveness after every step.", ""] + table(
            ("preset", "model", "hooks off", "hooks on", "full oracles", "hooks on cost", "full oracles cost"),
            ((r["preset"], r["model"], f"{off:.1f}", f"{on:.1f}", f"{full:.1f}", f"{off / on:.2f}x",
              f"{off / full:.2f}x")
             for r in res.overhead for off, on, full in [(r["hooks off"], r["hooks on"], r["full oracles"])]))
    return lines

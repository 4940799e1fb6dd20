#!/usr/bin/env python3
"""Time to bug on two checkouts side by side (issue 38: "before this issue" against now).

    python benchmarks/bench_before_after.py --before PATH [--after PATH] [--suite history|zoo]
        [--fuzzer corpus] [--after-fuzzer F] [--seeds 3] [--budget 20] [--repeat 1] [--bugs LIST] [--pycache DIR] [--json OUT]

The same bugs, fuzzer, seeds and budgets run on both checkouts (``--after-fuzzer F``: the after runs F, as
when the default fuzzer changed between them), interleaved bug by bug (the side that
goes first alternates per bug), so that a slow phase of a shared machine falls on both. Each (bug,
side) is one child process whose ``PYTHONPATH`` is the release's overlay (history) and that checkout's
root, nothing else: the child runs that checkout's own trial code, unchanged (history: its
``kvaudit.history.worker.main``, the trials of ``kvaudit bench --suite history``; zoo: its
``kvaudit.search.bench.run_trial``). The child adds the process CPU time to the first hit and of the whole
trial (search and triage) by wrapping ``FuzzStats.hit``; wall seconds and executions to the first hit are
the trial's own. One thread per child (``OMP_NUM_THREADS=1``).

A child's first trial pays the modules imported inside it (a target's own, at its first build); where
``PYTHONDONTWRITEBYTECODE`` is set, also their compilation from source, which an installed kvaudit does not
pay and which grows with the source's length (stop 56: 4-5 ms of vllm-49684's first trial).
``--pycache DIR`` gives the children a bytecode cache in ``DIR`` instead.

Per bug: hits, and the medians over the seeds of executions, wall seconds and CPU seconds to the first
hit (a failed trial counts as never: '-' when half or more failed) for before and after, and the ratio
after/before; then the geometric means of the per-bug median times, after/before, over the bugs both
sides' medians reach. Bugs only one checkout's catalogue has are listed, not run. Prints a markdown table;
``--json`` writes every trial and the load average beside each child (rewritten after every bug);
``python benchmarks/bench_before_after.py --table FILE`` prints the table of such a file.

``--repeat N`` runs each bug's children N times per side, the two sides taking turns (before, after;
after, before; ...), and keeps per (bug, seed) the **minimum** over the N repeats of the CPU and wall
seconds: executions to the first hit are deterministic, the seconds are what a shared machine's load
moves, and the minimum is the run the load disturbed least. The repeats of one trial must agree on
executions and signature (a run that differs stops the benchmark: that is a detection change, not
noise); a repeat that did not hit within the budget counts as never and the others' minimum stands.
The JSON keeps every repeat beside the trial's minimum.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
FORMAT = "kvaudit.bench-before-after/1"


# -- the child: one checkout's own code --------------------------------------------------------------

def _cpu_box() -> dict:
    """Wrap ``FuzzStats.hit`` so that the process CPU time at a search's first hit lands in the box."""
    from kvaudit.search.fuzz import FuzzStats

    box: dict = {}
    orig = FuzzStats.hit

    def hit(self):
        if self.first_hit is None:
            box["hit"] = time.process_time()
        orig(self)

    FuzzStats.hit = hit
    return box


def _timed(box: dict, fn, *args) -> tuple:
    box.clear()
    c0 = time.process_time()
    out = fn(*args)
    hit = box.get("hit")
    return out, (None if hit is None else hit - c0), time.process_time() - c0


def child_list(suite: str) -> list[dict]:
    if suite == "history":
        from kvaudit.history.catalogue import all_bugs
        return [{"id": b.id, "engine": b.engine, "version": b.buggy} for b in all_bugs().values()]
    from kvaudit.search import bench
    return [{"id": name} for name in bench._eut().bugs()]


def child_run(job: dict) -> list[dict]:
    """``job``'s trials on this checkout, each a trial dict plus ``cpu_to_hit`` and ``cpu``."""
    from dataclasses import asdict

    box = _cpu_box()
    cpu: list[tuple] = []
    if job.get("check_every"):  # a diagnostic: the sparse schedule's K (a checkout that has one)
        from kvaudit.search import schedule
        schedule.CHECK_EVERY = job["check_every"]
    if job["suite"] == "zoo":
        from kvaudit.search import bench
        out = []
        for seed in job["seeds"]:
            t, to_hit, total = _timed(box, bench.run_trial, job["bug"], job["fuzzer"], seed, job["budget"])
            out.append(asdict(t))
            cpu.append((to_hit, total))
    else:
        from kvaudit.history import worker
        contained = worker._contained

        def timed(*args):
            t, to_hit, total = _timed(box, contained, *args)
            cpu.append((to_hit, total))
            return t

        worker._contained = timed
        with tempfile.TemporaryDirectory(prefix="kvaudit-ba-") as d:
            job_path, out_path = os.path.join(d, "job.json"), os.path.join(d, "out.json")
            with open(job_path, "w") as f:
                json.dump({"mode": "search", "bug": job["bug"], "version": job["version"],
                           "fuzzers": [job["fuzzer"]], "seeds": job["seeds"], "budget": job["budget"]}, f)
            rc = worker.main([job_path, out_path])
            if rc != 0:
                raise SystemExit(rc)
            with open(out_path) as f:
                out = json.load(f)["results"]
    for d, (to_hit, total) in zip(out, cpu):
        d["cpu_to_hit"] = to_hit if d.get("success") else None
        d["cpu"] = total
    return out


def child_fuzzers() -> list[str] | None:
    """The fuzzer names this checkout's searches take: its registry's, or (a checkout from before the registry)
    ``kvaudit.constants.FUZZERS``; None when neither is there."""
    try:
        from kvaudit.search import fuzzers
        return sorted(fuzzers.kinds())
    except (ImportError, AttributeError):
        pass
    try:
        from kvaudit.constants import FUZZERS
        return sorted(FUZZERS)
    except ImportError:
        return None


def child_main(argv: list[str]) -> int:
    mode, arg, out_path = argv
    import kvaudit

    result = {"kvaudit": os.path.dirname(os.path.dirname(os.path.abspath(kvaudit.__file__)))}
    if mode == "list":
        result["bugs"] = child_list(arg)
        result["fuzzers"] = child_fuzzers()
    else:
        with open(arg) as f:
            result["results"] = child_run(json.load(f))
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


# -- repeats: the minimum of N runs of one trial --------------------------------------------------------

REPEATS = "min over repeats: cpu_to_hit, seconds and cpu are each trial's minimum over its repeats"


class RepeatMismatch(RuntimeError):
    """Two repeats of one (bug, side, seed) hit at different executions or with different signatures."""


def _repeats_note(n: int) -> str:
    return f", CPU and wall seconds the minimum of {n} runs per trial" if n > 1 else ""


def side_order(index: int, repeat: int) -> tuple[str, str]:
    """Which side runs first for bug ``index``'s ``repeat`` (0-based): alternating over both, so that
    N repeats go before, after; after, before; before, after; ..."""
    return ("before", "after") if (index + repeat) % 2 == 0 else ("after", "before")


def combine_repeats(runs: list[dict]) -> dict:
    """One trial from its repeats (the same bug, side and seed; ``runs`` in the order they ran): the
    first hitting run with ``seconds``, ``cpu_to_hit`` and ``cpu`` each the minimum over the runs that
    hit (over all runs for ``cpu``), and the runs under ``repeats``. A run that did not hit counts as
    never. Raises :class:`RepeatMismatch` when the hitting runs disagree on executions or signature."""
    hits = [r for r in runs if r.get("success")]
    keys = {(r.get("executions"), r.get("signature")) for r in hits}
    if len(keys) > 1:
        r0 = runs[0]
        raise RepeatMismatch(f"{r0.get('bug')} {r0.get('side')} seed {r0.get('seed')}: the repeats disagree on "
                             f"(executions, signature): {sorted(keys, key=str)}")
    out = dict(hits[0] if hits else runs[0])
    if hits:
        for k in ("seconds", "cpu_to_hit"):
            out[k] = min(r[k] for r in hits)
    out["cpu"] = min(r["cpu"] for r in runs)
    out["repeats"] = [{k: r.get(k) for k in ("success", "executions", "seconds", "cpu_to_hit", "cpu")}
                      for r in runs]
    return out


def run_bug(bug: str, index: int, repeat: int, run_side) -> list[dict]:
    """Bug ``index``'s trials: ``run_side(side, r)`` (one child: that side's trials of every seed, each a
    dict with ``seed``) ``repeat`` times per side, the sides in :func:`side_order`; with one repeat the
    trials as they came, with more each (side, seed)'s :func:`combine_repeats`."""
    runs: dict = {}
    for r in range(repeat):
        for side in side_order(index, r):
            for t in run_side(side, r):
                runs.setdefault((side, t["seed"]), []).append({"bug": bug, "side": side, **t})
    if repeat == 1:
        return [rs[0] for rs in runs.values()]
    return [combine_repeats(rs) for rs in runs.values()]


# -- the parent ----------------------------------------------------------------------------------------

def child_env(root: str, overlay: str | None = None, pycache: str | None = None) -> dict:
    """A child's environment: this one's, with ``PYTHONPATH`` the overlay and ``root``, one thread, and with
    ``pycache`` (``--pycache``) a bytecode cache there (``PYTHONPYCACHEPREFIX``; ``PYTHONDONTWRITEBYTECODE``
    dropped), so that a module imported inside a trial is not compiled from source in it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [overlay, root])), OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if pycache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.abspath(pycache)
    return env


def _child(root: str, args: list[str], overlay: str | None = None, pycache: str | None = None) -> dict:
    """Run this script's child mode under ``root`` (and ``overlay``, and ``pycache``: :func:`child_env`) and
    return what it wrote."""
    env = child_env(root, overlay, pycache)
    with tempfile.TemporaryDirectory(prefix="kvaudit-ba-") as d:
        out = os.path.join(d, "out.json")
        r = subprocess.run([sys.executable, HERE, "--child", *args, out], env=env, cwd=root,
                           stderr=subprocess.PIPE, text=True)
        if r.returncode != 0 or not os.path.exists(out):
            tail = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            raise RuntimeError(f"child under {root} failed: {tail}")
        with open(out) as f:
            doc = json.load(f)
    if os.path.realpath(doc["kvaudit"]) != os.path.realpath(root):
        raise RuntimeError(f"the child imported kvaudit from {doc['kvaudit']}, not {root}")
    return doc


def _rev(root: str) -> str:
    r = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def catalogues(before: list[dict], after: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """(ids both have, in the after's order; only before's; only after's). A history bug whose buggy
    release differs between the two counts as only in each."""
    b = {d["id"]: d.get("version") for d in before}
    a = {d["id"]: d.get("version") for d in after}
    both = [i for i in a if i in b and a[i] == b[i]]
    return both, [i for i in b if i not in both], [i for i in a if i not in both]


def _median(values: list) -> float | None:
    """Median with a failed trial (None) counted as never; None when half or more failed."""
    v = sorted(math.inf if x is None else x for x in values)
    if not v:
        return None
    m = statistics.median(v)
    return None if math.isinf(m) or sum(x is None for x in values) * 2 >= len(values) else m


def compare(trials: list[dict], bugs: list[str]) -> list[dict]:
    """One row per bug: per side (``before``/``after``) hits, trials and the medians of ``executions``,
    ``seconds`` and ``cpu_to_hit`` over its trials (failed trials count as never)."""
    rows = []
    for bug in bugs:
        row: dict = {"bug": bug}
        for side in ("before", "after"):
            ts = [t for t in trials if t["bug"] == bug and t["side"] == side]
            ok = [t.get("success") for t in ts]
            row[side] = {"hits": sum(ok), "trials": len(ts),
                         **{k: _median([t.get(k) if t.get("success") else None for t in ts])
                            for k in ("executions", "seconds", "cpu_to_hit")}}
        rows.append(row)
    return rows


def geomean_ratio(rows: list[dict], key: str) -> tuple[float | None, int]:
    """(Geometric mean over bugs of median ``key`` after / before, bugs counted): over the bugs whose two
    medians are reached and positive."""
    r = [row["after"][key] / row["before"][key] for row in rows
         if row["before"][key] and row["after"][key]]
    return (math.exp(sum(map(math.log, r)) / len(r)) if r else None), len(r)


def _f(x, digits: int | None = 2) -> str:
    """A cell: '-' for None, ``digits`` decimals (None: as short as exact, for executions)."""
    return "-" if x is None else f"{x:g}" if digits is None else f"{x:.{digits}f}"


def table(rows: list[dict]) -> list[str]:
    """The markdown table of :func:`compare`'s rows and the geometric means under it."""
    lines = ["| bug | hits before | after | median execs before | after | median s before | after | after/before "
             "| median CPU s before | after | after/before |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        b, a = row["before"], row["after"]
        cells = [row["bug"], f"{b['hits']}/{b['trials']}", f"{a['hits']}/{a['trials']}",
                 _f(b["executions"], None), _f(a["executions"], None)]
        for k in ("seconds", "cpu_to_hit"):
            ratio = a[k] / b[k] if a[k] and b[k] else None
            cells += [_f(b[k]), _f(a[k]), "-" if ratio is None else f"{ratio:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for key, what in (("seconds", "wall seconds"), ("cpu_to_hit", "CPU seconds"), ("executions", "executions")):
        g, n = geomean_ratio(rows, key)
        lines.append(f"- geometric mean of the per-bug median {what} to the first hit, after/before: "
                     + ("-" if g is None else f"**{g:.3f}x** over {n} bugs"))
    slower = [r["bug"] for r in rows if r["before"]["seconds"] is not None
              and (r["after"]["seconds"] is None or r["after"]["seconds"] > r["before"]["seconds"])]
    lost = [r["bug"] for r in rows if r["before"]["seconds"] is not None and r["after"]["seconds"] is None]
    lines.append(f"- bugs whose median wall time after is above before: {', '.join(slower) or 'none'}"
                 + (f" (of them not reached after: {', '.join(lost)})" if lost else ""))
    return lines


def _fuzzers(before: str, after: str | None) -> str:
    return before if after in (None, before) else f"{before} (before) / {after} (after)"


def print_table(path: str) -> int:
    """``--table FILE``: the table of a run's ``--json`` file (a partial one too: the bugs it holds)."""
    with open(path) as f:
        doc = json.load(f)
    done = [b for b in doc["bugs"] if any(t["bug"] == b for t in doc["trials"])]
    print(f"{doc['suite']}, fuzzer {_fuzzers(doc['fuzzer'], doc.get('after_fuzzer'))}, seeds {doc['seeds']}, {doc['budget']:g} s per trial"
          f"{_repeats_note(doc.get('repeat', 1))}; before "
          f"{doc['before']['rev']}, after {doc['after']['rev']}; {len(done)} of {len(doc['bugs'])} bugs run\n")
    print("\n".join(table(compare(doc["trials"], done))))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the baseline checkout's root (a git worktree)")
    ap.add_argument("--after", default=os.path.dirname(os.path.dirname(HERE)),
                    help="the checkout measured against it  [default: this script's]")
    ap.add_argument("--suite", choices=("history", "zoo"), default="history")
    ap.add_argument("--fuzzer", default="corpus")
    ap.add_argument("--after-fuzzer", default=None, metavar="F",
                    help="the after's fuzzer, where it differs (the default fuzzer of each checkout, when it changed "
                         "between them)  [default: --fuzzer]")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 1..N per bug and side")
    ap.add_argument("--budget", type=float, default=20.0, help="seconds per trial")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run each (bug, seed) N times per side, the sides taking turns, and keep the minimum "
                         "CPU and wall seconds (executions must agree)")
    ap.add_argument("--bugs", default="all", help="comma separated, or 'all' (the ones both catalogues have)")
    ap.add_argument("--after-check-every", type=int, default=None, metavar="K",
                    help="a diagnostic: the after's searches check every K steps (kvaudit.search.schedule."
                         "CHECK_EVERY; 1: every step, as before the sparse schedule)")
    ap.add_argument("--pycache", default=None, metavar="DIR",
                    help="the children keep compiled bytecode in DIR (PYTHONPYCACHEPREFIX), as an installed "
                         "kvaudit and engine do, even where PYTHONDONTWRITEBYTECODE is set: a module imported "
                         "inside a trial (a target's, at its first build) is then not compiled in its time; "
                         "the first child of each side fills DIR, so use --repeat 2 or more, or a DIR kept")
    ap.add_argument("--json", dest="out_json", default=None, help="write every trial here")
    args = ap.parse_args(argv)
    if (args.seeds < 1 or args.budget <= 0 or args.repeat < 1
            or (args.after_check_every is not None and args.after_check_every < 1)):
        ap.error("--seeds, --budget, --repeat and --after-check-every must be positive")
    args.before, args.after = os.path.abspath(args.before), os.path.abspath(args.after)
    args.after_fuzzer = args.after_fuzzer or args.fuzzer
    if args.before == args.after:
        ap.error("--before and --after name the same checkout")
    return args


def _refuse(message: str) -> None:
    """A bad option met once the checkouts are read: one line, exit 2 (argparse's), before any trial."""
    print(f"bench_before_after: {message}", file=sys.stderr)
    sys.exit(2)


def _overlay(entry: dict) -> str | None:
    if "engine" not in entry:
        return None
    from kvaudit.history import releases  # the after's: the cache both sides share
    path = releases.ensure(entry["engine"], entry["version"])
    return str(path) if path else None


def _write(path: str | None, doc: dict, t0: float) -> None:
    if path:
        doc["wall_seconds"] = round(time.monotonic() - t0, 1)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    roots = {"before": args.before, "after": args.after}
    listed = {side: _child(root, ["list", args.suite], None, args.pycache) for side, root in roots.items()}
    for side, fuzzer in (("before", args.fuzzer), ("after", args.after_fuzzer)):
        takes = listed[side].get("fuzzers")
        if takes is not None and fuzzer not in takes:  # (before any trial: a run of hours would end at its first)
            flag = "--after-fuzzer" if side == "after" and args.after_fuzzer != args.fuzzer else "--fuzzer"
            _refuse(f"{flag} {fuzzer}: the {side} ({roots[side]}) has no such fuzzer (it has: {', '.join(takes)})")
    cats = {side: {d["id"]: d for d in listed[side]["bugs"]} for side in roots}
    both, only_before, only_after = catalogues(list(cats["before"].values()), list(cats["after"].values()))
    bugs = both if args.bugs == "all" else [b.strip() for b in args.bugs.split(",")]
    bad = [b for b in bugs if b not in both]
    if bad:
        _refuse(f"--bugs: not in both catalogues: {', '.join(bad)}")
    seeds = list(range(1, args.seeds + 1))
    doc = {"format": FORMAT, "suite": args.suite, "fuzzer": args.fuzzer, "after_fuzzer": args.after_fuzzer, "seeds": seeds, "budget": args.budget,
           "after_check_every": args.after_check_every,
           "before": {"root": args.before, "rev": _rev(args.before)}, "after": {"root": args.after, "rev": _rev(args.after)},
           "repeat": args.repeat, "combine": REPEATS if args.repeat > 1 else None,
           "only_before": only_before, "only_after": only_after, "bugs": bugs, "children": [], "trials": [],
           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    t0 = time.monotonic()
    for i, bug in enumerate(bugs):
        def run_side(side: str, repeat: int, bug=bug) -> list[dict]:
            entry = cats[side][bug]
            job = {"suite": args.suite, "bug": bug, "version": entry.get("version"),
                   "fuzzer": args.after_fuzzer if side == "after" else args.fuzzer,
                   "seeds": seeds, "budget": args.budget,
                   "check_every": args.after_check_every if side == "after" else None}
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(job, f)
            load, c0 = os.getloadavg(), time.monotonic()
            try:
                results = _child(roots[side], ["run", f.name], _overlay(entry), args.pycache)["results"]
            finally:
                os.unlink(f.name)
            doc["children"].append({"bug": bug, "side": side, "repeat": repeat, "load": [round(x, 2) for x in load],
                                    "wall": round(time.monotonic() - c0, 1)})
            for r in results:
                run = f" run {repeat + 1}" if args.repeat > 1 else ""
                print(f"{bug:60} {side:6} seed {r['seed']}{run}: " + (
                    f"{r['executions']} execs, {r['seconds']:.2f}s, CPU {r['cpu_to_hit']:.2f}s"
                    if r.get("success") else f"not found ({r.get('note', '')})") + f"  load {load[0]:.2f}",
                    file=sys.stderr, flush=True)
            return results

        try:
            doc["trials"] += run_bug(bug, i, args.repeat, run_side)
        except RepeatMismatch as e:
            doc["mismatch"] = str(e)
            _write(args.out_json, doc, t0)
            sys.exit(f"bench_before_after: {e} (a detection change, not noise: the benchmark stops)")
        _write(args.out_json, doc, t0)  # after every bug: an interrupted run keeps what it measured
    print(f"`{' '.join(['python', 'benchmarks/bench_before_after.py', *(argv or sys.argv[1:])])}`: "
          f"{args.suite}, fuzzer {_fuzzers(args.fuzzer, args.after_fuzzer)}, seeds 1..{args.seeds}, {args.budget:g} s per trial"
          f"{_repeats_note(args.repeat)}; "
          f"before {doc['before']['rev']}, after {doc['after']['rev']}; {(time.monotonic() - t0) / 60:.1f} min\n")
    print("\n".join(table(compare(doc["trials"], bugs))))
    for side, ids in (("before", only_before), ("after", only_after)):
        if ids:
            print(f"- only in the {side}'s catalogue (not compared): {', '.join(ids)}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child_main(sys.argv[2:]))
    if sys.argv[1:2] == ["--table"]:
        sys.exit(print_table(sys.argv[2]))
    sys.exit(main())

"""A corpus-and-mutation search guided by the abstract scheduler states a program reaches (AFLNet's state
feedback over the target's own view): fresh random programs first, then fresh or mutated corpus
programs; a program that reaches a feature never seen before joins the corpus.

Design notes: docs/internals/fuzzers.md.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from kvaudit.audit.findings import Finding
from kvaudit.config import TargetConfig
from kvaudit.program import Idle, Op, ProgramError, make_op, program_from_json, program_to_json
from kvaudit.program.schema import CAPABILITIES, OPS, arg_range, reachable
from kvaudit.program.generate import random_op, weighted_kinds
from kvaudit.program.schema import max_prompt as context_max_prompt
from kvaudit.search.fuzz import FuzzStats, programs_until, run_program
from kvaudit.targets import program_features


ENGINE_PACKAGES = ("sglang", "vllm", "engine_under_test")  # whose lines ``line_coverage`` records
MIN_OPS, MAX_OPS = 16, 96  # the fresh programs' lengths (ops, with the final idle): four times random's
WARMUP = 1024  # fresh programs before the corpus is mutated


@functools.cache
def _is_engine(code) -> bool:
    name = code.co_filename.replace(os.sep, "/")
    return "/kvaudit/" not in name and any(f"/{p}/" in name for p in ENGINE_PACKAGES)


class LineTracer:
    """Engine line coverage by ``sys.settrace``: the (code, line) pairs run in :data:`ENGINE_PACKAGES`
    (kvaudit's own left out) while it is on; about 2.2x the CPU time of an untraced program."""

    def __init__(self):
        self.lines: set = set()

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines.add((frame.f_code, frame.f_lineno))
        return self._local

    def _global(self, frame, event, arg):
        return self._local if _is_engine(frame.f_code) else None

    def __enter__(self) -> "LineTracer":
        self.lines = set()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)


def _bucket(n: int) -> int:
    """0, 1, 2, 3 (3-4), 4 (5-8), 5 (9-16), ...: AFL's hit-count buckets."""
    return n if n < 3 else (n - 1).bit_length() + 1


def _closed(program: list[Op]) -> list[Op]:
    return program if program and isinstance(program[-1], Idle) else program + [Idle()]


def abstract_state(target) -> tuple:
    """The target's state as a hashable tuple: the owners (bucketed) per (pool, role, where) of its roots,
    each pool's available and evictable tokens in eighths of its total (and whether any are protected or
    session-held), paused, idle. Reads only."""
    places = Counter((r.pool, r.role, r.where) for r in target.roots())
    levels = []
    for pool, a in sorted(target.accounting().items()):
        total = max(1, a.total)
        levels.append((pool, 8 * a.available // total, 8 * a.evictable // total, a.protected > 0, a.session_held > 0))
    return (tuple(sorted((k, _bucket(v)) for k, v in places.items())), tuple(levels), bool(target.paused),
            bool(target.is_idle()))


def op_shape(op: Op) -> str:
    """An op's kind and the optional arguments it sets (``submit+session``); values left out."""
    set_ = [a.name for a in OPS[op.kind].args if a.p < 1.0 and getattr(op, a.name) != a.unset]
    return "+".join([op.kind] + set_)


@dataclass
class Entry:
    program: list[Op]
    new_features: int  # features this program reached first
    picked: int = 0
    features: frozenset = frozenset()  # every feature it reached (for the rare-feature schedule)
    frontier: int | None = None  # index of the last op after which it reached a new feature


@dataclass
class Corpus:
    """The programs that reached new features, every feature seen (hashes), and how many executions
    reached each feature (``hits``: the rare-feature schedule's counts)."""

    entries: list[Entry] = field(default_factory=list)
    features: set = field(default_factory=set)
    hits: Counter = field(default_factory=Counter)

    def count(self, features: set) -> None:
        self.hits.update(features)

    def add(self, program: list[Op], features: set, frontier: int | None = None) -> bool:
        new = features - self.features
        if not new:
            return False
        self.features |= new
        self.entries.append(Entry(list(program), len(new), features=frozenset(features), frontier=frontier))
        return True

    def pick(self, rng: random.Random, schedule: str = "classic") -> Entry:
        """An entry, favouring short, rarely picked ones that found many features (``classic``) or reached
        features few executions reach (``rare``: the sum of 1/hits, AFLFast's and Entropic's idea)."""
        def score(e: Entry) -> float:
            return sum(1.0 / self.hits.get(f, 1) for f in e.features) if schedule == "rare" else 1 + e.new_features

        weights = [score(e) / ((1 + e.picked) * (4 + len(e.program))) for e in self.entries]
        e = rng.choices(self.entries, weights)[0]
        e.picked += 1
        return e


class CorpusStore:
    """A campaign's program corpus on disk (``DIR/programs/<16 hex>.json``, named by the digest of its
    contents), shared by its workers as AFL's parallel instances sync their queues. Files that do not
    parse are counted in ``skipped``, failed writes in ``write_errors``; nothing is ever deleted."""

    def __init__(self, path: str, mirror=None):
        self.path = path
        self.mirror = mirror  # a kvaudit.search.hub.Hub: programs shared across hosts (``--db``)
        self.seen: set[str] = set()  # file names loaded or written by this store
        self.skipped: list[str] = []
        self.write_errors: list[tuple[str, OSError]] = []  # (path, error) of each file not written

    @staticmethod
    def name(program: list[Op], ops: list | None = None) -> str:
        """``<16 hex>.json``: the SHA-1 of the program's JSON ops (``ops``, when the caller has them)."""
        text = json.dumps(program_to_json(program) if ops is None else ops, sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:16] + ".json"

    def save(self, program: list[Op], shared: bool = False) -> None:
        """Write ``program`` unless a file of the same contents is there; a new one goes to the mirror
        too, unless ``shared`` (it came from there)."""
        from kvaudit.replay import write_text_atomic

        ops = program_to_json(program)
        name = self.name(program, ops)
        self.seen.add(name)
        path = os.path.join(self.path, name)
        if not os.path.exists(path):
            try:
                write_text_atomic(path, json.dumps({"format": "kvaudit.program/1", "program": ops}) + "\n",
                                  durable=False)
            except OSError as e:
                self.write_errors.append((path, e))
            if self.mirror is not None and not shared:
                self.mirror.share_program(name, ops)

    def _parse(self, label: str, read: Callable[[], list]) -> list[Op] | None:
        try:
            program = program_from_json(read())
        except (OSError, ValueError, ProgramError):
            self.skipped.append(label)
            return None
        return _closed(program) if program else None

    def _read(self, name: str) -> list | None:
        with open(os.path.join(self.path, name), encoding="utf-8") as fh:
            doc = json.load(fh)
        return doc.get("program") if isinstance(doc, dict) else None

    def load_new(self) -> list[list[Op]]:
        """The programs the mirror's other workers shared since the last call (written here too), then
        those of the files not loaded or written by this store yet, in name order."""
        out = []
        for name, ops in self.mirror.new_programs() if self.mirror is not None else ():
            if name not in self.seen:
                self.seen.add(name)
                program = self._parse(f"redis:{name}", lambda: ops)
                if program:
                    self.save(program, shared=True)
                    out.append(program)
        try:
            names = sorted(n for n in os.listdir(self.path) if n.endswith(".json") and n not in self.seen)
        except FileNotFoundError:
            return out
        for name in names:
            self.seen.add(name)
            program = self._parse(name, lambda: self._read(name))
            if program:
                out.append(program)
        return out


class Mutator:
    """Program mutations over the op schema's reach: every op and argument stays valid."""

    def __init__(self, rng: random.Random, reach: frozenset, max_prompt: int, max_ops: int):
        self.rng, self.reach, self.max_prompt, self.max_ops = rng, reach, max_prompt, max_ops
        self.table = weighted_kinds(reach)

    def op(self, table=None, probs: dict | None = None) -> Op:
        """:func:`kvaudit.program.generate.random_op` of ``table`` (default: the random mix), each optional
        argument set with ``probs[(kind, name)]`` (default its ``Arg.p``)."""
        return random_op(self.rng, self.reach, self.max_prompt, table or self.table, probs)

    def swarm_table(self) -> tuple[str, ...]:
        """A random subset of the op kinds (step and idle, swarm None, always in), weighted as the mix."""
        kinds = sorted(set(self.table))
        keep = {k for k in kinds if OPS[k].swarm is None or self.rng.random() < 0.5}
        return tuple(k for k in self.table if k in keep)

    def swarm_probs(self) -> dict[str, float]:
        """For each optional argument of the reach, its probability in one program: never, its ``p``, always."""
        out = {}
        for kind in set(self.table):
            for a in OPS[kind].args:
                if a.p < 1.0 and reachable(a.gate, self.reach):
                    out[(kind, a.name)] = self.rng.choice((0.0, a.p, 1.0))
        return out

    def fresh(self, min_ops: int, max_ops: int, swarm: bool, arg_swarm: bool = False) -> list[Op]:
        """A fresh program; not ``swarm``: the random baseline's (:func:`kvaudit.program.random_program`)."""
        table = self.swarm_table() if swarm else self.table
        probs = self.swarm_probs() if swarm and arg_swarm else None
        return [self.op(table, probs) for _ in range(self.rng.randint(min_ops, max_ops) - 1)] + [Idle()]

    def redraw_arg(self, op: Op) -> Op:
        spec = OPS[op.kind]
        args = [a for a in spec.args if reachable(a.gate, self.reach)]
        if not args:
            return self.op()
        a = self.rng.choice(args)
        values = dataclasses.asdict(op)
        if a.nullable and values[a.name] is not None and self.rng.random() < 0.25:
            values[a.name] = a.unset
        else:
            lo, hi = arg_range(a, self.max_prompt)
            values[a.name] = self.rng.randint(lo, hi)
        return make_op(op.kind, values, self.reach, self.max_prompt)

    def extend(self, program: list[Op], frontier: int | None) -> list[Op]:
        """``program`` cut after op ``frontier`` (None: its whole body) and continued with one to four
        fresh ops, then ``idle``."""
        body = [op for op in program if not isinstance(op, Idle)] if frontier is None else \
            [op for op in program[:frontier + 1]]
        if body and isinstance(body[-1], Idle) and self.rng.random() < 0.5:
            body.pop()
        body += [self.op() for _ in range(self.rng.randint(1, 4))]
        return body[: self.max_ops - 1] + [Idle()]

    def mutate(self, program: list[Op], other: list[Op]) -> list[Op]:
        """One to four stacked mutations of ``program`` (splicing from ``other``); the result ends in
        ``idle`` and has at most ``max_ops`` ops."""
        rng = self.rng
        body = [op for op in program]
        if body and isinstance(body[-1], Idle):
            body.pop()
        for _ in range(1 << rng.randrange(3)):
            m = rng.randrange(7)
            i = rng.randint(0, len(body))
            if m == 0 or not body:  # insert
                body.insert(i, self.op())
            elif m == 1:  # delete
                del body[min(i, len(body) - 1)]
            elif m == 2:  # replace
                body[min(i, len(body) - 1)] = self.op()
            elif m in (3, 4):  # redraw an argument
                j = min(i, len(body) - 1)
                body[j] = self.redraw_arg(body[j])
            elif m == 5:  # splice: a prefix of this one, a suffix of the other
                o = [op for op in other if not isinstance(op, Idle)] or [self.op()]
                body = body[:i] + o[rng.randrange(len(o)):]
            else:  # duplicate a run of ops
                j = rng.randint(i, min(len(body), i + 4))
                k = rng.randint(0, len(body))
                body[k:k] = body[i:j] or [self.op()]
        return body[: self.max_ops - 1] + [Idle()]


def corpus_search(config: TargetConfig, max_time: float, seed_value: int, stats: FuzzStats,
                  on_progress: Callable[[FuzzStats], None] | None = None, suppressions=None,
                  known=frozenset(), min_ops: int = MIN_OPS, max_ops: int = MAX_OPS, warmup: int = WARMUP, fresh_share: float = 0.3,
                  corpus: Corpus | None = None, max_executions: int | None = None,
                  keep_findings: bool = False, line_coverage: bool = False,
                  store: CorpusStore | None = None, sync_every: int = 256,
                  schedule: str = "classic", extend_share: float = 0.0, arg_swarm: bool = False,
                  op_context: bool = False, transitions: bool = False,
                  ) -> tuple[list[Op], list[Finding]] | None:
    """Search ``config`` for ``max_time`` seconds (or ``max_executions`` programs) from ``seed_value``.
    Returns the first program that yields a finding neither suppressed nor ``known`` (a container of
    signatures) with its findings, or None. ``corpus`` (optional) is filled in place; ``stats.coverage``
    reports the features and corpus size. Fresh programs have ``min_ops..max_ops`` ops; the warm-up
    (``warmup``), ``fresh_share``, ``keep_findings``, ``line_coverage``, the ``store`` and its ``sync_every``
    and the variants: docs/internals/fuzzers.md, "The corpus search"."""
    rng = random.Random(seed_value)  # drawn in random_search's order during the warmup (at these lengths)
    deadline = time.monotonic() + max_time
    reach = frozenset(program_features(config)) | frozenset(CAPABILITIES)
    mut = Mutator(rng, reach, context_max_prompt(config.context_len), max_ops)
    corpus = corpus if corpus is not None else Corpus()
    tracer = LineTracer() if line_coverage else None
    pending: list[list[Op]] = store.load_new() if store is not None else []  # stored programs run first
    programs = _programs(rng, mut, corpus, pending, min_ops, max_ops, warmup, fresh_share, schedule, extend_share,
                         arg_swarm)
    for n, _ in enumerate(programs_until(deadline, max_executions, stats, on_progress), 1):
        if store is not None and n % sync_every == 0:
            pending += store.load_new()
        program = next(programs)
        steps = _StepFeatures(corpus.features, transitions, op_context)
        hit, kept = _run(config, program, steps, stats, known, keep_findings, suppressions, deadline, tracer)
        if hit is not None:
            return hit
        if kept is not None:
            if schedule == "rare":
                corpus.count(steps.features)
            frontier = steps.frontier if steps.frontier is not None and steps.frontier < len(kept) else None
            kept = _closed(kept)
            if corpus.add(kept, steps.features, frontier) and store is not None:
                store.save(kept)
        stats.coverage = f"{len(corpus.features)} features, {len(corpus.entries)} programs"
        if store is not None and (store.skipped or store.write_errors):
            stats.coverage += (f" ({len(store.skipped)} unreadable and {len(store.write_errors)} unwritable "
                               f"files in {store.path})")
    return None


def _run(config: TargetConfig, program: list[Op], steps: "_StepFeatures", stats: FuzzStats, known,
         keep_findings: bool, suppressions, deadline: float, tracer: LineTracer | None):
    """``(hit, kept)``: the program up to a new finding and its findings, else None; the ops that may join
    the corpus, None when the deadline cut the program."""
    ran, found, out_of_time, sites = run_program(config, program, stats, suppressions, deadline, on_step=steps,
                                                 before=steps.before, tracer=tracer)
    if out_of_time:
        return None, None
    if found and not all(f.signature in known for f in found):
        stats.hit()
        return (program[:ran], found), None
    if found and keep_findings:
        steps.features |= {hash(("finding", f.signature)) for f in found}
    elif found:  # a known finding: the op that raised it stays out of the corpus
        ran -= 1
    steps.features |= {hash(("site", s)) for s in sites} | (tracer.lines if tracer else set())
    return None, program[:ran]


def _programs(rng: random.Random, mut: Mutator, corpus: Corpus, pending: list, min_ops: int, max_ops: int,
              warmup: int, fresh_share: float, schedule: str, extend_share: float, arg_swarm: bool):
    warm = 0  # warmup programs drawn
    while True:
        if pending:  # filled in place by the caller
            yield pending.pop(0)
        elif warm < warmup:
            warm += 1
            yield mut.fresh(min_ops, max_ops, swarm=False)
        elif not corpus.entries or rng.random() < fresh_share:
            yield mut.fresh(min_ops, max_ops, swarm=rng.random() < 0.5, arg_swarm=arg_swarm)
        else:
            entry = corpus.pick(rng, schedule)
            if rng.random() < extend_share:
                yield mut.extend(entry.program, entry.frontier)
            else:
                yield mut.mutate(entry.program, rng.choice(corpus.entries).program)


class _StepFeatures:
    """A run's ``on_step``: the features of one program's scheduler steps, and ``frontier``: the last op
    after which a feature not in ``seen`` was reached."""

    def __init__(self, seen: set, transitions: bool, op_context: bool):
        self.seen, self.transitions, self.op_context = seen, transitions, op_context
        self.features: set = set()
        self.prev, self.kind, self.op, self.frontier = None, "-", 0, None
        self.since: list = []  # op shapes applied since the last scheduler step (op_context)

    def before(self, i: int, op: Op) -> None:
        self.kind, self.op = op.kind, i
        if self.op_context:
            self.since.append(op_shape(op))

    def __call__(self, r) -> None:
        s = hash(abstract_state(r.target))
        step = (s, hash((self.prev, s)), hash((self.kind, s))) if self.transitions else (s,)
        if self.op_context:
            step += (hash(("ops", tuple(self.since[-3:]), s)),)
            self.since.clear()
        self.features.update(step)
        if self.frontier != self.op and any(f not in self.seen for f in step):
            self.frontier = self.op
        self.prev = s

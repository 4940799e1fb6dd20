"""A corpus-and-mutation search guided by the abstract scheduler states a program reaches (AFLNet's state
feedback over the target's own view): fresh random programs first, then fresh or mutated corpus
programs; a program that reaches a feature never seen before joins the corpus.

Design notes: docs/internals/fuzzers.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
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


MIN_OPS, MAX_OPS = 16, 96  # the fresh programs' lengths (ops, with the final idle): four times random's
WARMUP = 1024  # fresh programs before the corpus is mutated


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


@dataclass
class Entry:
    program: list[Op]
    new_features: int  # features this program reached first
    picked: int = 0


@dataclass
class Corpus:
    """The programs that reached new features, and every feature seen (hashes)."""

    entries: list[Entry] = field(default_factory=list)
    features: set = field(default_factory=set)

    def add(self, program: list[Op], features: set) -> bool:
        new = features - self.features
        if not new:
            return False
        self.features |= new
        self.entries.append(Entry(list(program), len(new)))
        return True

    def pick(self, rng: random.Random) -> Entry:
        """An entry, favouring short, rarely picked ones that found many features."""
        weights = [(1 + e.new_features) / ((1 + e.picked) * (4 + len(e.program))) for e in self.entries]
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
        except (OSError, ValueError, ProgramError, RecursionError):  # (RecursionError: JSON nested too deeply)
            self.skipped.append(label)
            return None
        return _closed(program) if program else None

    def _read(self, name: str) -> list | None:
        path = os.path.join(self.path, name)
        if not os.path.isfile(path):  # a FIFO: opening one to read waits for a writer for ever
            raise OSError(f"{path} is not a regular file")
        with open(path, encoding="utf-8-sig") as fh:  # (a BOM, an editor's, skipped)
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

    def op(self, table=None) -> Op:
        """:func:`kvaudit.program.generate.random_op` of ``table`` (default: the random mix)."""
        return random_op(self.rng, self.reach, self.max_prompt, table or self.table)

    def swarm_table(self) -> tuple[str, ...]:
        """A random subset of the op kinds (step and idle, swarm None, always in), weighted as the mix."""
        kinds = sorted(set(self.table))
        keep = {k for k in kinds if OPS[k].swarm is None or self.rng.random() < 0.5}
        return tuple(k for k in self.table if k in keep)

    def fresh(self, min_ops: int, max_ops: int, swarm: bool) -> list[Op]:
        """A fresh program; not ``swarm``: the random baseline's (:func:`kvaudit.program.random_program`)."""
        table = self.swarm_table() if swarm else self.table
        return [self.op(table) for _ in range(self.rng.randint(min_ops, max_ops) - 1)] + [Idle()]

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
                  store: CorpusStore | None = None, sync_every: int = 256) -> tuple[list[Op], list[Finding]] | None:
    """Search ``config`` for ``max_time`` seconds (or ``max_executions`` programs) from ``seed_value``.
    Returns the first program that yields a finding neither suppressed nor ``known`` (a container of
    signatures) with its findings, or None. ``corpus`` (optional) is filled in place; ``stats.coverage``
    reports the features and corpus size. Fresh programs have ``min_ops..max_ops`` ops; the warm-up
    (``warmup``), ``fresh_share``, the ``store`` and its ``sync_every``: docs/internals/fuzzers.md, "The
    corpus search"."""
    rng = random.Random(seed_value)  # drawn in random_search's order during the warmup (at these lengths)
    deadline = time.monotonic() + max_time
    # every capability: a target without sessions refuses their ops (not gated on capabilities(config): the
    # gate changed the programs, and the executions to the first hit, of most presets; not measured enough)
    reach = frozenset(program_features(config)) | frozenset(CAPABILITIES)
    mut = Mutator(rng, reach, context_max_prompt(config.context_len), max_ops)
    corpus = corpus if corpus is not None else Corpus()
    pending: list[list[Op]] = store.load_new() if store is not None else []  # stored programs run first
    programs = _programs(rng, mut, corpus, pending, min_ops, max_ops, warmup, fresh_share)
    for n, _ in enumerate(programs_until(deadline, max_executions, stats, on_progress), 1):
        if store is not None and n % sync_every == 0:
            pending += store.load_new()
        stored = bool(pending)  # (a stored program, another search's corpus entry: it collects its site keys)
        program = next(programs)
        hit, kept, features = _run(config, program, stats, known, suppressions, deadline, stored or None)
        if hit is not None:
            return hit
        if kept is not None:
            kept = _closed(kept)
            if corpus.add(kept, features) and store is not None:
                store.save(kept)
        stats.coverage = f"{len(corpus.features)} features, {len(corpus.entries)} programs"
        if store is not None and (store.skipped or store.write_errors):
            stats.coverage += (f" ({len(store.skipped)} unreadable and {len(store.write_errors)} unwritable "
                               f"files in {store.path})")
    return None


def _run(config: TargetConfig, program: list[Op], stats: FuzzStats, known, suppressions, deadline: float,
         site_keys: bool | None = None):
    """``(hit, kept, features)``: the program up to a new finding and its findings, else None; the ops that
    may join the corpus, None when the deadline cut the program; the features reached (the abstract state
    after each scheduler step, the alloc/free/lock sites where it collects them: ``site_keys``, None: by
    :func:`kvaudit.search.schedule.site_keys_due`)."""
    features: set = set()
    ran, found, out_of_time, sites = run_program(config, program, stats, suppressions, deadline,
                                                 on_step=lambda r: features.add(hash(abstract_state(r.target))),
                                                 site_keys=site_keys)
    if out_of_time:
        return None, None, features
    if found and not all(f.signature in known for f in found):
        stats.hit()
        return (program[:ran], found), None, features
    if found:  # a known finding: the op that raised it stays out of the corpus
        ran -= 1
    features |= {hash(("site", s)) for s in sites}
    return None, program[:ran], features


def _programs(rng: random.Random, mut: Mutator, corpus: Corpus, pending: list, min_ops: int, max_ops: int,
              warmup: int, fresh_share: float):
    warm = 0  # warmup programs drawn
    while True:
        if pending:  # filled in place by the caller
            yield pending.pop(0)
        elif warm < warmup:
            warm += 1
            yield mut.fresh(min_ops, max_ops, swarm=False)
        elif not corpus.entries or rng.random() < fresh_share:
            yield mut.fresh(min_ops, max_ops, swarm=rng.random() < 0.5)
        else:
            entry = corpus.pick(rng)
            # NOTE: the draw that chose the measured-and-dropped frontier extension (docs/search/README.md,
            # "Search variants"): kept, so that every seed still runs the programs it ran
            rng.random()
            yield mut.mutate(entry.program, rng.choice(corpus.entries).program)

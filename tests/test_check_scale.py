"""What keeps a busy check at 1M slots cheap (docs/internals/performance.md, "A busy check under 5 ms"):
the live requests read once per check, the tree recount walked again only after a tree edit, and the
req_to_token compare. Each test plants what the saving could hide and checks it is still found."""

from __future__ import annotations

from kvaudit.audit import oracles
from kvaudit.audit.oracles import incremental
from kvaudit.audit.runner import AuditedRun
from kvaudit.program import Idle, Step, Submit
from kvaudit.targets.eut import observer
from kvaudit.targets.eut.presets import get_preset

from engine_under_test.scheduler import Scheduler


def _busy_run(max_new: int = 8) -> AuditedRun:
    run = AuditedRun(get_preset("default").config(), paranoid=False)
    run.__enter__()
    run.apply(Submit(family=0, prompt_len=12, max_new_tokens=max_new))
    run.apply(Submit(family=1, prompt_len=9, max_new_tokens=max_new))
    assert run.apply(Step(n=2)) == []
    return run


def test_one_check_reads_the_live_requests_once(monkeypatch):
    monkeypatch.setattr(observer, "OWNERS_ONCE_FROM", 0)  # (from 64 requests: two here)
    calls = []
    real = Scheduler.requests_owning_rows
    monkeypatch.setattr(Scheduler, "requests_owning_rows", lambda self: (calls.append(1), real(self))[1])
    run = _busy_run()
    try:
        eng = run.target.engine
        assert eng.requests_owning_rows()  # a request is live: the check has something to read
        calls.clear()
        assert oracles.check(run.auditor, run.target) == []
        assert len(calls) == 1
        assert "requests_owning_rows" not in eng.__dict__  # the engine's own method again after the check
        eng.requests_owning_rows()
        assert len(calls) == 2
    finally:
        run.__exit__(None, None, None)


def test_a_checks_own_readers_share_one_read_of_the_live_requests_at_any_size(monkeypatch):
    """Below OWNERS_ONCE_FROM (no shadow of the engine's method) the observer's readers in a check (the roots,
    the metrics, the lock holders) read the live requests once: a busy check reads them twice (that read and
    the engine's own check_memory), a check at idle not at all (check_memory reads none there, and the idle
    roots, finding every structure empty, tell the others there is none); a read after the check is fresh."""
    calls = []
    real = Scheduler.requests_owning_rows
    monkeypatch.setattr(Scheduler, "requests_owning_rows", lambda self: (calls.append(1), real(self))[1])
    run = _busy_run(max_new=2)
    try:
        target = run.target
        calls.clear()
        assert oracles.check(run.auditor, target) == []
        assert len(calls) == 2 and "requests_owning_rows" not in target.engine.__dict__
        assert run.apply(Idle()) == []
        assert target.is_idle()
        calls.clear()
        assert oracles.check(run.auditor, target, idle=True) == []
        assert len(calls) == 0
        assert target._owners() == [] and len(calls) == 1  # outside a check: read again
    finally:
        run.__exit__(None, None, None)


def test_the_tree_recount_walks_again_after_every_tree_edit(monkeypatch):
    monkeypatch.setattr(observer, "RECOUNT_EDITS_FROM", 0)  # (from 256 nodes: a few here)
    run = _busy_run()
    try:
        target, tree = run.target, run.target.engine.tree_cache
        first = target.recount()
        walks = []
        real = tree.nodes
        tree.nodes = lambda *a: (walks.append(1), real(*a))[1]
        assert target.recount() is first and not walks  # nothing changed: the last walk's counts
        node = next(n for n in real() if n.value is not None and n.lock_ref == 1 and not n.children)
        tree.dec_lock_ref(node)  # an edit through the tree's method: walked again, the unlock counted
        got = target.recount()["token_to_kv_pool"]
        assert walks and got["evictable"].tokens == first["token_to_kv_pool"]["evictable"].tokens + len(node.key)
        tree.inc_lock_ref(node)
        assert target.recount()["token_to_kv_pool"] == first["token_to_kv_pool"] and len(walks) == 2
    finally:
        run.__exit__(None, None, None)


def test_the_recount_walks_when_its_wrappers_are_not_outermost(monkeypatch):
    """An auditor's wrapper put on top of the counting one (or the counting ones taken away on close):
    the recount cannot tell, walks, and puts its wrappers back on top."""
    monkeypatch.setattr(observer, "RECOUNT_EDITS_FROM", 0)
    run = _busy_run()
    try:
        target, tree = run.target, run.target.engine.tree_cache
        target.recount()
        edits = target._tree_edits
        key = edits.key()
        assert key is not None and edits.key() == key
        inner = tree.inc_lock_ref
        tree.inc_lock_ref = lambda node: inner(node)  # someone else's wrapper, outermost
        assert edits.key() is None  # (and ours are back on top)
        assert edits.key() is not None
        del tree.__dict__["evict"]  # taken away, as Auditor.close does
        assert edits.key() is None and edits.key() is not None
    finally:
        run.__exit__(None, None, None)


def test_small_engines_keep_the_plain_walks():
    """A small tree walks at every check and a few requests are read per call: no wrapper on the tree's
    methods, no shadow of the engine's requests_owning_rows (each costs more there than it saves)."""
    run = _busy_run()
    try:
        run.target.recount()
        assert run.target.__dict__.get("_tree_edits") is None
        assert "match_prefix" not in run.target.engine.tree_cache.__dict__
        with run.target.checking():
            assert "requests_owning_rows" not in run.target.engine.__dict__
    finally:
        run.__exit__(None, None, None)


def _stray_write(run) -> tuple[int, int]:
    """Plant a stray write: a running request's last own slot overwritten (by no engine call) with
    another request's; returns (the slot that leaks, the slot now owned twice)."""
    eng = run.target.engine
    a, b = eng.requests_owning_rows()[:2]
    table = eng.req_to_token_pool.req_to_token
    assert a.kv.cache_protected_len < a.kv.kv_allocated_len and b.kv.cache_protected_len < b.kv.kv_allocated_len
    pos = a.kv.kv_allocated_len - 1
    leaked, twice = int(table[a.kv.req_pool_idx, pos]), int(table[b.kv.req_pool_idx, b.kv.kv_allocated_len - 1])
    table[a.kv.req_pool_idx, pos] = twice
    return leaked, twice


def _kinds(found) -> set[str]:
    return {f.kind for f in found}


def test_a_stray_write_is_found_by_the_next_full_sweep(monkeypatch):
    """A busy incremental check compares req_to_token only on the rows a step rewrites (EutDeltas._written):
    a stray write elsewhere is not seen there, and the next full sweep (here the idle check's) finds it,
    after which the kept state agrees with the roots again."""
    monkeypatch.setattr(incremental, "MIN_UNITS", 0)  # the incremental check on this small engine
    run = _busy_run()
    try:
        auditor, target = run.auditor, run.target
        assert auditor.bookkeeping.valid  # the last step's check ran from the deltas
        leaked, twice = _stray_write(run)
        assert oracles.check(auditor, target) == []  # the restricted look: not seen
        found = oracles.check(auditor, target, idle=True)  # a full sweep (exact deltas)
        assert {"leak", "aliasing"} <= _kinds(found), [f.summary() for f in found]
        leak = next(f for f in found if f.kind == "leak")
        assert leaked in leak.slots
        by_pool = {p: [] for p in auditor.ledgers}
        for r in target.roots():
            by_pool[r.pool].append(r)
        assert auditor.bookkeeping.disagreement(auditor, by_pool, False) == ""  # in step with the roots again
    finally:
        run.__exit__(None, None, None)


def test_a_stray_write_is_found_at_its_step_in_paranoid_mode(monkeypatch):
    """Paranoid mode asks for exact deltas at every check: the stray write is in them, the full sweep
    finds it at the same check, and the two agree (no DeltaDisagreement)."""
    monkeypatch.setattr(incremental, "MIN_UNITS", 0)
    run = _busy_run()
    try:
        run.auditor.paranoid = True
        assert oracles.check(run.auditor, run.target) == []
        _stray_write(run)
        found = oracles.check(run.auditor, run.target)
        assert {"leak", "aliasing"} <= _kinds(found), [f.summary() for f in found]
    finally:
        run.__exit__(None, None, None)


def test_one_check_walks_the_tree_once_and_the_next_walks_it_again():
    """roots(), recount() and lock_balance() share one walk within a check (EutObserver._tree_nodes); after
    the check a change of the tree is seen: a node locked after the check is found unbalanced."""
    run = _busy_run()
    try:
        target, tree = run.target, run.target.engine.tree_cache
        walks = []
        real = tree.nodes
        tree.nodes = lambda *a: (walks.append(a), real(*a))[1]
        assert oracles.check(run.auditor, run.target) == []
        assert walks == [()]  # one whole-tree walk for the check
        node = next(n for n in real() if n.value is not None)
        node.lock_ref += 1  # no receipt holds it: an imbalance only a fresh walk sees
        walks.clear()
        with target.checking():
            bad = target.lock_balance()
        assert walks == [(), (node,)] and [b.lock_ref for b in bad] == [node.lock_ref]
        node.lock_ref -= 1
    finally:
        run.__exit__(None, None, None)


def _recount_by_definition(target) -> dict:
    # the recount's terms node by node (observer.recount's docstring), to hold its C-level walk to
    out = {"token_to_kv_pool": [0, 0], "hicache_host": [0, 0]}  # (evictable, protected)
    for n in target.engine.tree_cache.nodes():
        if n.value is not None:
            out["token_to_kv_pool"][bool(n.lock_ref)] += len(n.key)
        if n.host_value is not None:
            out["hicache_host"][n.value is not None or bool(n.host_ref)] += len(n.key)
    return out


def test_the_tree_recount_and_the_idle_roots_lock_read_each_node_by_their_definition():
    """The recount's walk (map and compress in C, observer._walk_recount) counts each node's tokens as the
    per-node definition does, with any lock_ref or host_ref (2 and -1 too: a count, not a flag), and with
    HiCache's host copies; the idle roots say locked when any node's lock_ref is not 0."""
    run = AuditedRun(get_preset("hicache").config(), paranoid=False)
    try:
        for family in range(4):
            run.apply(Submit(family=family, prompt_len=20 + 7 * family, max_new_tokens=3))
        run.apply(Idle())
        target = run.target
        nodes = [n for n in target.engine.tree_cache.nodes()]
        assert len(nodes) >= 3 and any(n.host_value is not None for n in nodes)
        for i, (lock, host) in enumerate([(0, 0), (1, 0), (2, 1), (-1, 3), (0, 2), (3, 0)] * 2):
            n = nodes[i % len(nodes)]
            n.lock_ref, n.host_ref = lock, host
            want = _recount_by_definition(target)
            got, walked = target._walk_recount(nodes)
            assert walked == len(nodes)
            assert [got["token_to_kv_pool"][t].tokens for t in ("evictable", "protected")] == want["token_to_kv_pool"]
            assert [got["hicache_host"][t].tokens for t in ("evictable", "protected")] == want["hicache_host"]
            n.lock_ref = n.host_ref = 0
    finally:
        run.close()
    run = _busy_run(max_new=2)  # (no HiCache: the idle roots' lock read)
    try:
        assert run.apply(Idle()) == [] and run.target.is_idle()
        nodes = list(run.target.engine.tree_cache.nodes())
        assert nodes and run.target.idle_roots().locked is False
        for lock in (1, 2, -1):
            nodes[-1].lock_ref = lock
            assert run.target.idle_roots().locked is True
        nodes[-1].lock_ref = 0
        assert run.target.idle_roots().locked is False
    finally:
        run.__exit__(None, None, None)


def test_idle_roots_that_find_a_live_request_leave_the_checks_read_of_the_live_requests_to_the_engine():
    """The idle roots tell the check's other readers that no request is live only when they found every
    structure empty: with a request queued they give way to the full check, and the metrics still read it."""
    run = _busy_run()
    try:
        target = run.target
        with target.checking():
            assert target.idle_roots() is None
            live = target._owners()
        assert [r.rid for r in live] == [r.rid for r in target.engine.requests_owning_rows()] and live
    finally:
        run.__exit__(None, None, None)

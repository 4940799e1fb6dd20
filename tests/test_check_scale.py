"""What keeps a busy check at 1M slots cheap (docs/internals/performance.md, "A busy check under 5 ms"):
the live requests read once per check, the tree recount walked again only after a tree edit, and the
req_to_token compare. Each test plants what the saving could hide and checks it is still found."""

from __future__ import annotations

from kvaudit.audit import oracles
from kvaudit.audit.runner import AuditedRun
from kvaudit.program import Step, Submit
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


def test_the_tree_recount_walks_again_after_every_tree_edit():
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


def test_the_recount_walks_when_its_wrappers_are_not_outermost():
    """An auditor's wrapper put on top of the counting one (or the counting ones taken away on close):
    the recount cannot tell, walks, and puts its wrappers back on top."""
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

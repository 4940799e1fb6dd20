"""When the built-in engine's radix tree may have changed: a count of the calls of every ``RadixCache``
method that changes a node (its set, a key, a value or a ``lock_ref``), so that the tree recount
(:meth:`kvaudit.targets.eut.observer.EutObserver.recount`) walks the nodes again only after one.

The methods: ``insert`` and ``match_prefix`` (they split nodes, ``_split_node``, and add leaves),
``inc_lock_ref`` and ``dec_lock_ref``, ``evict`` (``_evict_lru`` and its ``release`` delete nodes) and
``reset`` (``engine_under_test/radix_cache.py``; the scheduler reaches the tree only through them). A
subclass (``HiRadixCache``: host copies, load-backs, demotions) has more: :meth:`TreeEdits.key` is then
None, and so is it while a counting wrapper is not the outermost one on the tree (an auditor's wrappers
were put on top of it, or taken away on close): the wrappers are put back on top and that call walks.
A change made to a node outside these methods is seen at the next call of one of them.
"""

from __future__ import annotations

from engine_under_test.radix_cache import RadixCache

#: RadixCache's methods that change a node (the ones the scheduler calls, and the two internal ones the
#: others reach a change through)
EDITS = ("insert", "match_prefix", "_split_node", "inc_lock_ref", "dec_lock_ref", "evict", "_evict_lru", "reset")


class TreeEdits:
    """Counts the calls of :data:`EDITS` on ``tree`` (a ``RadixCache``), through instance attributes."""

    def __init__(self, tree):
        self.tree, self.count, self.mine = tree, 0, {}

    def key(self) -> tuple | None:
        """``(root node id, calls so far)``: equal between two calls only if no node can have changed
        between them; None when this cannot be told (a subclass, or the wrappers not outermost)."""
        tree = self.tree
        if type(tree) is not RadixCache:
            return None
        d = tree.__dict__
        if not self.mine or any(d.get(name) is not w for name, w in self.mine.items()):
            self._install()
            return None
        return id(tree.root_node), self.count

    def _install(self) -> None:
        # a counting wrapper over each name's instance attribute (a wrapper put there before, ours
        # included), else over the class's method as it is at each call (a test may patch the class)
        self.count += 1
        d = self.tree.__dict__
        self.mine = {name: self._counting(name, d.get(name)) for name in EDITS}
        for name, w in self.mine.items():
            setattr(self.tree, name, w)

    def _counting(self, name: str, fn):
        tree, cls = self.tree, type(self.tree)

        def counted(*a, **k):
            self.count += 1
            return fn(*a, **k) if fn is not None else getattr(cls, name)(tree, *a, **k)

        return counted

"""The idle check in a few numpy calls per pool, where the target's roots are the cache's alone
(:meth:`kvaudit.targets.base.Target.idle_roots`): the mark and sweep reduced to facts read from the
ledger's arrays. It only certifies a clean state: when any fact fails, the full check runs and reports.
Paranoid mode runs both and raises :class:`~kvaudit.audit.oracles.incremental.DeltaDisagreement` on any
difference. Design notes: docs/internals/audit.md, "The idle check"; measured: docs/internals/performance.md.
"""

from __future__ import annotations

import numpy as np

from kvaudit.audit.hooks import Auditor
from kvaudit.audit.oracles.identity import engine_disagrees, identity, replay_free_list
from kvaudit.audit.oracles.target import target_findings
from kvaudit.targets.base import DEFAULT_IDENTITY, IdleRoots, Root


def idle_check(auditor: Auditor, target) -> tuple[bool, IdleRoots] | None:
    """At idle: None when the target gives no :class:`~kvaudit.targets.base.IdleRoots` (the full check
    runs), else ``(clean, roots)``: whether the full check would find nothing, and the target's idle roots.
    Reads only (:func:`commit` applies a clean verdict)."""
    got = target.idle_roots()
    if got is None:
        return None
    acc, free, recount = target.accounting(), target.free_lists(), target.recount()
    clean = not got.locked
    for pool, led in auditor.ledgers.items():
        if not clean:
            break
        units, held = got.units.get(pool), None
        if units is not None and units.size:
            held = np.zeros(led.allocated.size, dtype=bool)
            held[units] = True
            # a unit held twice or the reserved unit 0 (aliasing), or other units than the ledger's allocated
            # ones (a leak, a use-after-free)
            clean = not held[0] and np.count_nonzero(held) == units.size
            held[0] = True  # (the reserved unit reads as allocated in the ledger)
            clean = clean and not np.count_nonzero(held != led.allocated)
        else:  # nothing held: the ledger has the reserved unit alone allocated
            clean = bool(led.allocated[0]) and np.count_nonzero(led.allocated) == 1
        terms = target.identity_terms(pool)
        if clean and acc.get(pool) is not None:
            if held is None and terms is not DEFAULT_IDENTITY:  # (only a "referenced" term reads it)
                held = np.zeros(led.allocated.size, dtype=bool)
                held[0] = True
            clean = not identity(auditor, pool, led, acc[pool], [], [], recount.get(pool, {}), terms=terms,
                                 referenced=held)
        if clean and pool in free:
            clean = not replay_free_list(auditor, pool, led, free[pool])
    clean = clean and not target_findings(auditor, target) and not engine_disagrees(auditor, target)
    return clean, got


def _owner_ids(auditor: Auditor, led, got: IdleRoots, units: np.ndarray) -> np.ndarray:
    # ``[n] int64``: the idle roots' owner id on ``units``, 0 elsewhere (as the full check's sweep numbers owners)
    owner = np.zeros(led.allocated.size, dtype=np.int64)
    owner[units] = auditor.owner_id(got.owner)
    return owner


def owners(auditor: Auditor, got: IdleRoots) -> dict:
    """Each pool's owner ids (``[n] int64``) as the full check's sweep leaves them at these idle roots."""
    return {pool: _owner_ids(auditor, led, got, got.units.get(pool, np.zeros(0, dtype=np.int64)))
            for pool, led in auditor.ledgers.items()}


def commit(auditor: Auditor, got: IdleRoots) -> None:
    """What a clean full check at idle leaves in the auditor (:func:`idle_check`'s roots): the ledger's
    owners and their change record, ``checked_upto``, ``owner_where`` and ``roots_at_check``."""
    at_check: dict[str, list] = {}
    for pool, led in auditor.ledgers.items():
        units = got.units.get(pool)
        if units is not None and units.size:
            owner = _owner_ids(auditor, led, got, units)
            changed = (owner != led.owner).nonzero()[0]
            at_check[pool] = [Root(pool, got.owner, units, role="tree")]
        else:  # (most often no owner before either: nothing to record, no array to make)
            changed = led.owner.nonzero()[0] if np.count_nonzero(led.owner) else None
            owner = None if changed is None else np.zeros(led.allocated.size, dtype=np.int64)
            at_check[pool] = []
        if changed is not None and changed.size:
            auditor.owner_changes.append((auditor.op_index, auditor.step, pool, changed, owner[changed]))
            led.owner = owner
    auditor.checked_upto, auditor.owner_where, auditor.roots_at_check = len(auditor.events), {}, at_check

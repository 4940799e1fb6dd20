"""Shadow KV content tags: which token prefix each KV slot was written for.

The KV at position ``p`` of a sequence is a function of tokens ``0..p``. kvaudit keeps, per slot of
every KV pool, a 64-bit tag of the prefix the slot's content was computed for (0: never written),
updated on every KV write and copy the target reports. On every KV read it compares the tags of
the slots read with the reader's own prefix tags: a mismatch is *stale KV* -- the reader attends
to content that belongs to another sequence (a slot reused after a free, a stale tree node) or to
nothing at all (positions whose forward never ran, inserted into the tree anyway).

The engine is not changed: the target wraps the engine's forward, transfer and copy functions and
calls :meth:`ShadowKV.write`, :meth:`copy` and :meth:`read` (see ``EutTarget.install_shadow``).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

_MOD = (1 << 61) - 1
_BASE = 1_000_003


class ShadowKV:
    """Per-pool tag arrays, ``[num_slots] int64`` each, indexed by token slot."""

    def __init__(self, sizes: dict[str, int]):
        self.tags = {name: np.zeros(n, dtype=np.int64) for name, n in sizes.items()}
        self._prefix: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def prefix_tags(self, owner, tokens: list[int]) -> np.ndarray:
        """``[len(tokens)] int64``: tag ``p`` identifies ``tokens[:p + 1]`` (never 0). Cached per
        ``owner`` (a request object), extended as its token list grows."""
        have = self._prefix.get(owner)
        if have is None or len(have[0]) > len(tokens) or have[0] != tokens[: len(have[0])]:
            have = ([], [])
        toks, tags = have
        h = tags[-1] - 1 if tags else 0
        for t in tokens[len(toks):]:
            h = (h * _BASE + t + 1) % _MOD
            tags.append(h + 1)
        toks.extend(tokens[len(toks):])
        self._prefix[owner] = (toks, tags)
        return np.asarray(tags[: len(tokens)], dtype=np.int64)

    @staticmethod
    def _idx(slots) -> np.ndarray:
        if isinstance(slots, torch.Tensor):
            return slots.detach().cpu().numpy()
        return np.asarray(slots, dtype=np.int64)

    def write(self, pool: str, slots, tags: np.ndarray) -> None:
        """The KV of ``slots`` (``[n]``) was computed for the prefixes ``tags`` (``[n] int64``)."""
        self.tags[pool][self._idx(slots)] = tags

    def copy(self, dst_pool: str, dst, src_pool: str, src) -> None:
        """KV copied slot for slot from ``src`` (``[n]``) in ``src_pool`` to ``dst`` in ``dst_pool``."""
        self.tags[dst_pool][self._idx(dst)] = self.tags[src_pool][self._idx(src)]

    def read(self, pool: str, slots, expected: np.ndarray) -> np.ndarray:
        """Indices ``i`` (into ``slots``, ``[n]``) whose tag differs from ``expected[i]``."""
        return np.flatnonzero(self.tags[pool][self._idx(slots)] != expected)

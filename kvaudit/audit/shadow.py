"""Shadow KV content tags: which token prefix each KV slot was written for (a 64-bit hash per
slot, 0: never written), checked on every KV read the target reports (``stale-kv``).

Design notes (the hash, its caches): docs/internals/audit.md.
"""

from __future__ import annotations

import numpy as np
import torch

_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd, so invertible modulo 2**64
_BASE_INV = np.uint64(pow(int(_BASE), -1, 1 << 64))
_B, _M64 = int(_BASE), (1 << 64) - 1
_SIGN = 1 << 63
_SIGN_1 = _SIGN + 1  # ((h + _SIGN_1) & _M64) - _SIGN: the tag h + 1 (modulo 2**64) as an int64


def _powers(base: np.uint64, n: int) -> np.ndarray:
    out = np.full(n, base, dtype=np.uint64)
    out[0] = 1
    return np.cumprod(out, dtype=np.uint64)  # (integer array products wrap modulo 2**64, silently)


_MAX_LEN = 1 << 15  # longest token list hashed (EngineConfig caps context_len at 32768)
_POW = _powers(_BASE, _MAX_LEN)
_POW_INV = _powers(_BASE_INV, _MAX_LEN)


_PROMPT_TAGS: dict[tuple, tuple[np.ndarray, int]] = {}  # prompt tokens -> (their tags, h of the last)
_PROMPT_TAGS_MAX = 4096


class ShadowKV:
    """Per-pool tag arrays, ``[num_slots] int64`` each, indexed by token slot."""

    def __init__(self, sizes: dict[str, int]):
        self.tags = {name: np.zeros(n, dtype=np.int64) for name, n in sizes.items()}
        # id(owner) -> [owner, tags, length, last token, h of the last token]
        self._prefix: dict[int, tuple] = {}

    def request_tags(self, owner, origin: list[int], output=(), future=()) -> np.ndarray:
        """``[n] int64`` for the ``n`` tokens of ``origin + output + future`` (built without joining
        the lists): tag ``p`` identifies the prefix ``tokens[:p + 1]`` (0 means "never written").
        Cached per ``owner`` (a request object); rebuilt if its last cached token no longer matches."""
        n0 = len(origin)
        n01 = n0 + len(output)
        n = n01 + len(future)
        have = self._prefix.get(id(owner))
        if have is not None:
            length = have[2]
            if n == length + 1 and length and n <= have[1].size:  # the common call: one decoded token
                p = length - 1
                if (origin[p] if p < n0 else output[p - n0] if p < n01 else future[p - n01]) == have[3]:
                    # NOTE: runs for every row of every batch: the new token is the last of the lists, the tag
                    # (h + 1 modulo 2**64) stored as its int64 in one expression
                    t = have[3] = future[-1] if n01 < n else output[-1] if n0 < n01 else origin[-1]
                    h = have[4] = (have[4] * _B + t + 1) & _M64
                    have[2], tags = n, have[1]
                    tags[length] = ((h + _SIGN_1) & _M64) - _SIGN
                    return tags[:n]
            tags, last, h = have[1], have[3], have[4]
            p = length - 1
            if length > n or (length and (origin[p] if p < n0 else output[p - n0] if p < n01
                                          else future[p - n01]) != last):
                have = None  # not an extension of what was cached: start over
            elif length == n:
                return tags[:n]
        if have is None:
            # NOTE: prompts repeat (shared families, resent histories): cached process-wide
            key = tuple(origin) if not output and not future else None
            hit = _PROMPT_TAGS.get(key) if key is not None else None
            if hit is not None:
                tags = np.zeros(max(16, 2 * n), dtype=np.int64)
                tags[:n] = hit[0]
                self._prefix[id(owner)] = [owner, tags, n, origin[-1] if n else None, hit[1]]
                return tags[:n]
            tags, length, h = np.zeros(max(16, n), dtype=np.int64), 0, 0
            have = self._prefix[id(owner)] = [owner, tags, 0, None, 0]  # owner kept: ids stay unique
        if n > tags.size:
            tags = have[1] = np.concatenate((tags, np.zeros(max(n, 2 * tags.size) - tags.size, dtype=np.int64)))
        if n - length <= 16:  # a few new tokens (a decode step): plain integers beat numpy calls
            for p in range(length, n):
                t = origin[p] if p < n0 else output[p - n0] if p < n01 else future[p - n01]
                h = (h * _B + t + 1) & _M64
                v = (h + 1) & _M64
                tags[p] = v - (1 << 64) if v >= 1 << 63 else v
        else:
            tokens = (list(origin) + list(output) + list(future))[length:n]
            with np.errstate(over="ignore"):
                t = np.asarray(tokens, dtype=np.uint64) + np.uint64(1)
                seg = np.cumsum(t * _POW_INV[length:n], dtype=np.uint64)
                if length:
                    seg += np.uint64(h) * _POW_INV[length - 1]
                tags[length:n] = (seg * _POW[length:n] + np.uint64(1)).view(np.int64)
            h = (int(tags[n - 1]) - 1) & _M64
        p = n - 1
        have[2], have[4] = n, h
        have[3] = (origin[p] if p < n0 else output[p - n0] if p < n01 else future[p - n01]) if n else None
        if length == 0 and n and not output and not future:
            if len(_PROMPT_TAGS) >= _PROMPT_TAGS_MAX:
                _PROMPT_TAGS.clear()
            _PROMPT_TAGS[tuple(origin)] = (tags[:n].copy(), h)
        return tags[:n]

    @staticmethod
    def _idx(slots) -> np.ndarray:
        if isinstance(slots, torch.Tensor):
            return slots.numpy() if slots.device.type == "cpu" else slots.cpu().numpy()
        return np.asarray(slots, dtype=np.int64)

    def write(self, pool: str, slots, tags: np.ndarray) -> None:
        """The KV of ``slots`` (``[n]``) was computed for the prefixes ``tags`` (``[n] int64``)."""
        self.tags[pool][self._idx(slots)] = tags

    def copy(self, dst_pool: str, dst, src_pool: str, src) -> None:
        """KV copied slot for slot from ``src`` (``[n]``) in ``src_pool`` to ``dst`` in ``dst_pool``."""
        self.tags[dst_pool][self._idx(dst)] = self.tags[src_pool][self._idx(src)]

    def read(self, pool: str, idx: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, str] | None:
        """Check a read of slots ``idx`` (``[n] int64``) that should hold the prefixes ``expected``
        (``[n] int64``). None when every tag matches; else the indices into ``idx`` that do not, and
        whether those slots were never written or written for another token prefix."""
        tags = self.tags[pool]
        if tags.take(idx).tobytes() == expected.tobytes():
            return None
        bad = np.flatnonzero(tags[idx] != expected)
        return bad, "never written" if (tags[idx[bad]] == 0).all() else "written for another token prefix"

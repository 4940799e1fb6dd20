"""engine_under_test: a small, readable SGLang-style decode engine with a switchable bug zoo.

It never imports kvaudit. Start with :class:`Scheduler` and :class:`EngineConfig` (kvaudit keeps
named configurations of it: ``kvaudit/targets/eut/presets.py``).

The configuration (and the bug zoo) imports without torch; the memory pools, the radix cache
and the scheduler are imported on first use (PEP 562), so that a command line that only lists
presets or prints its help starts in a fraction of a second.
"""

from engine_under_test.bugs import BUGS, BugInfo, UnknownBugError
from engine_under_test.config import EngineConfig

# name -> the submodule that defines it (these import torch)
_LAZY = {
    "HostKVPool": "memory", "MHATokenToKVPool": "memory", "PoolIntegrityError": "memory",
    "ReqToTokenPool": "memory", "TokenToKVPoolAllocator": "memory",
    "MatchResult": "radix_cache", "RadixCache": "radix_cache", "TreeNode": "radix_cache",
    "FinishReason": "req", "Req": "req", "ReqKvInfo": "req",
    "PoolCheck": "scheduler_invariant_checker_mixin", "Scheduler": "scheduler",
}

__all__ = ["BUGS", "BugInfo", "UnknownBugError", "EngineConfig", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"engine_under_test.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'engine_under_test' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

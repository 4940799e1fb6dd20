"""engine_under_test: a small, readable SGLang-style decode engine with a switchable bug zoo.

It never imports kvaudit. Start with :class:`Scheduler` and :func:`get_preset`.
"""

from engine_under_test.bugs import BUGS, BugInfo, UnknownBugError
from engine_under_test.config import PRESETS, EngineConfig, Preset, UnknownPresetError, get_preset
from engine_under_test.memory import (HostKVPool, MHATokenToKVPool, PoolIntegrityError, ReqToTokenPool,
                                      TokenToKVPoolAllocator)
from engine_under_test.radix_cache import MatchResult, RadixCache, TreeNode
from engine_under_test.req import FinishReason, Req, ReqKvInfo
from engine_under_test.scheduler import PoolCheck, Scheduler

__all__ = [
    "BUGS", "BugInfo", "UnknownBugError", "PRESETS", "EngineConfig", "Preset", "UnknownPresetError",
    "get_preset", "HostKVPool", "MHATokenToKVPool", "PoolIntegrityError", "ReqToTokenPool",
    "TokenToKVPoolAllocator", "MatchResult", "RadixCache", "TreeNode", "FinishReason", "Req", "ReqKvInfo",
    "PoolCheck", "Scheduler",
]

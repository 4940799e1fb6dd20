"""minivllm: a small vLLM-style engine used as a third kvaudit target ("a user's own scheduler").

It never imports kvaudit; see :mod:`examples.minivllm.engine`.
"""

from examples.minivllm.engine import (
    BUGS, BlockPool, KVCacheBlock, KVCacheManager, MiniVllmConfig, Request, RequestStatus, Scheduler,
    SchedulerOutput, hash_block_tokens, sample_token,
)

__all__ = [
    "BUGS", "BlockPool", "KVCacheBlock", "KVCacheManager", "MiniVllmConfig", "Request", "RequestStatus",
    "Scheduler", "SchedulerOutput", "hash_block_tokens", "sample_token",
]

"""The real-vLLM target (``--target vllm``): vLLM's (0.15.1 to 0.33.0) v1 Scheduler, AsyncScheduler and
KVCacheManager on CPU. See ``docs/guides/vllm.md`` ("Auditing vLLM itself") and :mod:`.target`."""

"""The real-vLLM target (``--target vllm``): vLLM 0.33.0's v1 Scheduler, AsyncScheduler and
KVCacheManager on CPU. See ``README.md`` ("Auditing vLLM itself") and :mod:`.target`."""

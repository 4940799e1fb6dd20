"""kvaudit: memory-leak auditing and fuzzing for the KV-cache schedulers of LLM serving engines."""

__version__ = "0.1.0"

"""The real-SGLang target: kvaudit's programs drive SGLang 0.5.23's own memory manager on CPU.

Imports nothing itself, so that ``kvaudit.targets.sglang.config`` (the flags' validation) loads
without SGLang or torch; import the target classes from their modules.
"""

"""The real-SGLang target: kvaudit's programs drive SGLang 0.5.23's own memory manager on CPU (and, with the
legacy driver family of ``legacy.py``, that of 0.5.10.post1 and 0.5.11: ``compat.py``).

Imports nothing itself, so that ``kvaudit.targets.sglang.config`` (the flags' validation) loads
without SGLang or torch; import the target classes from their modules.
"""

#!/usr/bin/env python3
"""atheris (libFuzzer) harness for the built-in engine, audited by kvaudit: flags, environment and
behaviour are documented in kvaudit/search/atheris_harness.py. Executable with a shebang:
libFuzzer's -fork, -jobs and -minimize_crash re-execute argv[0]."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # audit the tree the harness sits in
if os.path.isfile(os.path.join(ROOT, "kvaudit", "__init__.py")) and ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # (installed from a wheel, it sits in kvaudit/_data/harnesses/)
from kvaudit.search import atheris_harness  # noqa: E402  (imports no engine module)

atheris_harness.main(atheris_harness.instrument())

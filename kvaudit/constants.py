"""Values ``kvaudit --help`` needs, kept apart from the modules that use them (those import torch and
Hypothesis). Imports nothing: the atheris harness reads it before instrumenting the engine."""

DEFAULT_FUZZER = "corpus"  # NOTE: fewest executions to each bug, misses none random finds (docs/benchmarks-history.md)
MINIMIZE_GRACE = 5.0  # kvaudit.search.campaign: seconds a finding's minimization may always take (past the budget)
CONFIRM_RUNS = 3  # kvaudit.search.fuzz: replays that must all reproduce a finding before it is reported
DEFAULT_STEP_TIMEOUT = 10.0  # kvaudit.audit.runner: seconds an engine step may take before the watchdog calls a hang
EXIT_UNAVAILABLE = 69  # sysexits' EX_UNAVAILABLE: a program kvaudit needs (atheris) is not installed here
MISSING_ATHERIS = ("atheris is not installed here ('pip install atheris': it has wheels for Linux x86-64 only; "
                   "elsewhere it builds from source and needs clang with libFuzzer, "
                   "https://github.com/google/atheris#installation)")

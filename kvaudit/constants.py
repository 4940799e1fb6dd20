"""Names, numbers and messages the command line needs to build its options and --help, kept apart
from the modules that use them (those import torch and Hypothesis), so that ``kvaudit --help``
imports neither; the modules import them from here under the same names. Nothing here imports
the built-in engine (the atheris harness reads it before instrumenting the engine)."""

# The fuzzer `fuzz` and `ci` use unless told: the one that finds the history suite's and the zoo's bugs in
# the fewest executions and misses none that random finds (docs/benchmarks-history.md, docs/search/).
DEFAULT_FUZZER = "corpus"
CONFIRM_RUNS = 3  # kvaudit.search.fuzz: replays that must all reproduce a finding before it is reported
DEFAULT_STEP_TIMEOUT = 10.0  # kvaudit.audit.runner: seconds one engine step may take before the watchdog calls it a hang
EXIT_UNAVAILABLE = 69  # sysexits' EX_UNAVAILABLE: a program kvaudit needs (atheris) is not installed here
# What `--fuzzer atheris` and harnesses/fuzz_engine.py say where atheris cannot be imported: it has
# wheels for Linux x86-64 only, and kvaudit depends on it only there (pyproject.toml).
MISSING_ATHERIS = ("atheris is not installed here: it has wheels for Linux x86-64 only; elsewhere 'pip install "
                   "atheris' builds it from source and needs clang with libFuzzer "
                   "(https://github.com/google/atheris#installation)")

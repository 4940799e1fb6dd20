"""Names and numbers the command line needs to build its options and --help, kept apart from the
modules that use them (those import torch and Hypothesis), so that ``kvaudit --help`` imports
neither; the modules import them from here under the same names."""

FUZZERS = ("hypothesis", "atheris", "random")  # kvaudit.campaign, kvaudit.bench
CONFIRM_RUNS = 3  # kvaudit.fuzz: replays that must all reproduce a finding before it is reported
DEFAULT_STEP_TIMEOUT = 10.0  # kvaudit.runner: seconds one engine step may take before the watchdog calls it a hang

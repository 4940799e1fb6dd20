"""Values ``kvaudit --help`` needs, kept apart from the modules that use them (those import torch and
Hypothesis). Imports nothing: the atheris harness reads it before instrumenting the engine."""

# --fuzzer's defaults (docs/search/README.md, "The guided phase past 1,024 executions"): a search that stops at
# its first finding runs random 16-96-op programs (on the bugs needing more than 1,024 executions corpus's guided
# phase found them no sooner, 9 hits of 15 against 8, at more CPU per seed); a campaign keeps corpus, the one
# fuzzer that keeps its programs in DIR/programs and resumes from them
DEFAULT_FUZZER = "random-96"
CAMPAIGN_FUZZER = "corpus"  # --corpus, --workers > 1, --db; kvaudit ci (a campaign per preset)
MINIMIZE_GRACE = 5.0  # kvaudit.search.campaign: seconds a finding's minimization may always take (past the budget)
CONFIRM_RUNS = 3  # kvaudit.search.fuzz: replays that must all reproduce a finding before it is reported
DEFAULT_STEP_TIMEOUT = 10.0  # kvaudit.audit.runner: seconds an engine step may take before the watchdog calls a hang
# kvaudit.audit.runner: how often the watchdog looks for an armed step while none is (a step it has not seen yet
# can run this long): the least --step-timeout it honours
WATCHDOG_IDLE_POLL = 0.2
MAX_SECONDS = 365 * 24 * 3600.0  # a year: past it a budget is a typo (1e308), not a plan; Ctrl-C ends a search early


def check_at_most_a_year(value) -> float:
    """``value`` (a number, not NaN) as a float when at most :data:`MAX_SECONDS`; an int past a float's range
    (``10**400``) is too long, not an ``OverflowError``. Raises ``ValueError`` with the reason (``--max-time``,
    ``--step-timeout`` and :func:`kvaudit.testing.fuzz`'s ``step_timeout`` say the same)."""
    try:
        seconds, shown = float(value), f"{value:.15g}"
    except OverflowError:
        seconds, shown = (float("inf") if value > 0 else float("-inf")), "an integer past a float's range"
    if seconds > MAX_SECONDS:
        raise ValueError(f"must be at most {MAX_SECONDS:.0f} seconds (365d), got {shown}; "
                         "Ctrl-C or SIGTERM ends a run early and keeps what it found")
    return seconds


def check_seconds(value, allow_zero: bool = False) -> float:
    """``value`` as a float when it is a finite number of seconds > 0 (or 0 with ``allow_zero``) and at most
    :data:`MAX_SECONDS`: ``--max-time`` (and the CLI's other durations) and :func:`kvaudit.testing.fuzz`'s
    ``max_time``, one check whichever door the value came in by. Raises ``ValueError`` with the reason, for the
    caller to prefix with the option's or the argument's name."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a finite number of seconds, got a {type(value).__name__}")
    if not value - value == 0:  # inf or nan (math.isfinite, without an import)
        raise ValueError(f"must be a finite number of seconds, got {value:.15g}")
    if value < 0 or (value == 0 and not allow_zero):
        try:
            shown = f"{value:.15g}"
        except OverflowError:  # (-10**400)
            shown = "an integer past a float's range"
        raise ValueError(f"must be a number of seconds {'>= 0' if allow_zero else '> 0'}, got {shown}")
    return check_at_most_a_year(value)


def check_step_timeout(value) -> float:
    """The watchdog's limit on one engine step (``--step-timeout``; :func:`kvaudit.testing.fuzz`'s ``step_timeout``):
    ``value`` as a float when it is a finite number of seconds of at least :data:`WATCHDOG_IDLE_POLL`. Raises
    ``ValueError`` with the reason, for the caller to prefix with the option's or the argument's name."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a finite number of seconds, got a {type(value).__name__}")
    if not value - value == 0:  # inf or nan (math.isfinite, without an import)
        raise ValueError(f"must be a finite number of seconds, got {value:.15g}")
    if value < WATCHDOG_IDLE_POLL:  # (1e-300 was taken: every step a hang, or none)
        raise ValueError(f"must be at least {WATCHDOG_IDLE_POLL:g} seconds (how often the watchdog looks for a step "
                         f"that started: a shorter limit cannot be kept), got {value:.15g}")
    return check_at_most_a_year(value)  # (as --step-timeout's: 1e300 was taken, 10**400 raised OverflowError)
EXIT_UNAVAILABLE = 69  # sysexits' EX_UNAVAILABLE: a program kvaudit needs (atheris) is not installed here
MISSING_ATHERIS = ("atheris is not installed here ('pip install atheris': it has wheels for Linux x86-64 only; "
                   "elsewhere it builds from source and needs clang with libFuzzer, "
                   "https://github.com/google/atheris#installation)")


def default_fuzzer(campaign: bool) -> str:
    """``--fuzzer``'s default: :data:`CAMPAIGN_FUZZER` for a campaign, else :data:`DEFAULT_FUZZER`."""
    return CAMPAIGN_FUZZER if campaign else DEFAULT_FUZZER

"""A plugin fuzzer written the way a newcomer writes one (tests/test_fuzzers.py): fresh random
programs of twelve ops, each run from a fresh engine, no feedback. Importing it (``KVAUDIT_PLUGINS=
toyfuzzer_plugin``) registers the fuzzer ``toy``; it touches no file of kvaudit."""

from __future__ import annotations

import random
import time

from kvaudit.audit.runner import execute
from kvaudit.program import random_program
from kvaudit.search.fuzzers import FuzzerKind, register
from kvaudit.targets import program_features


def toy_search(config, seconds, seed, stats, run):
    """The first program with a finding not in ``run.known`` (nor suppressed), or None after ``seconds``."""
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        program = random_program(rng, 12, features=program_features(config))
        stats.executions += 1
        stats.ops += len(program)
        ex = execute(config, program, full_stacks=False, suppressions=run.suppressions)
        found = [f for f in ex.findings if f.signature not in run.known]
        if found:
            stats.hit()
            return program, ex.findings
        if run.on_progress:
            run.on_progress(stats)
    return None


register(FuzzerKind("toy", "twelve random ops per program, no feedback (a test's plugin)", toy_search,
                    campaign=False, bench=False))

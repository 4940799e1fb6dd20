"""The history row sglang-swa-evict-page-round (kvaudit/targets/sglang/catalogue.py) beyond its known
program (tests/test_sglang_releases.py): SGLang 0.5.22's out-of-window SWA eviction keeps
``max(window, page)`` tokens, so where ``(window + 1) % page >= 2`` the key a checkpoint inserts ends with
less than a window of live SWA; the re-match after the insert stops short and the request keeps (after a
prefill: aliasing) or frees (at finish: use-after-free) the KV the tree took. 0.5.23 rounds to whole
pages. Each release runs in a child process with its overlay first on ``PYTHONPATH`` (skipped, with the
install command, when the overlay is missing)."""

import os

import pytest
from release_helpers import run_programs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the child: run each (config overrides, program) on the row's preset; print the version and each run's
# finding signatures (every finding, the run going on past each)
CHILD = """
import json, sys
from kvaudit.audit.runner import AuditedRun
from kvaudit.history.catalogue import BUGS, target_config
from kvaudit.program import program_from_json
from kvaudit.targets.sglang.boot import installed_version
out = {"version": installed_version(), "runs": []}
for overrides, ops in json.loads(sys.argv[1]):
    config = type(target_config(BUGS["sglang-swa-evict-page-round"])).from_dict(
        {**target_config(BUGS["sglang-swa-evict-page-round"]).to_dict(), **overrides})
    with AuditedRun(config) as run:
        for op in program_from_json(ops):
            run.apply(op)
        out["runs"].append(sorted({f.signature.split("/")[0] + "/" + f.pool for f in run.findings}))
print(json.dumps(out))
"""

PREFILL = [{"op": "submit", "prompt_len": 11, "max_new_tokens": 3}, {"op": "idle"}]
DECODE = [{"op": "submit", "prompt_len": 4, "max_new_tokens": 12}, {"op": "idle"}]
PROGRAMS = [({}, PREFILL), ({}, DECODE), ({"sliding_window_size": 7}, PREFILL), ({"sliding_window_size": 7}, DECODE)]


def run(version: str) -> list:
    return run_programs(CHILD, PROGRAMS, "sglang", version, ROOT)["runs"]


@pytest.mark.releases
def test_0_5_22_gives_the_tree_a_short_window_after_a_prefill_and_at_finish_but_not_at_window_7():
    prefill, decode, prefill7, decode7 = run("0.5.22")
    check = "unmatchable-prefix/swa_token_to_kv_pool"
    # after the prefill's checkpoint the request still counts the prompt pages the tree took
    assert check in prefill and "aliasing/token_to_kv_pool" in prefill, prefill
    # at finish release_kv_cache frees the output pages the tree took
    assert check in decode and "use-after-free/token_to_kv_pool" in decode, decode
    # window 7 over 4-token pages: (7 + 1) % 4 == 0, so max(window, page) is enough
    assert prefill7 == decode7 == []


@pytest.mark.releases
def test_0_5_23_rounds_the_kept_window_to_whole_pages():
    assert run("0.5.23") == [[], [], [], []]

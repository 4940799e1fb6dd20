"""The legacy family's PD decode with HiSparse (kvaudit/targets/sglang/legacy_pd.py) on SGLang 0.5.10.post1,
which ships #22882 (``process_batch_result_prebuilt`` releases without ``request_finished``), and on 0.5.11,
which fixes it. The history row's own program (health check, idle) is tested in test_sglang_releases.py;
here: the other ways in (a 1-token client request), the decode path that was always right, the path
counters, and the refusals. The releases run in child processes with their overlay first on ``PYTHONPATH``.
"""

import os
import subprocess
import sys

import pytest
import torch
from release_helpers import child_env, run_programs

from kvaudit.targets.sglang.boot import _alloc_decode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the child: run each program (a JSON list of op dicts) on the history row's config with the installed
# SGLang; print the version, each program's finding signatures and the target's path counters
CHILD = """
import json, sys
from kvaudit.audit.runner import AuditedRun
from kvaudit.history.catalogue import BUGS, target_config
from kvaudit.program import program_from_json
from kvaudit.targets.sglang.boot import installed_version
config = target_config(BUGS["sglang-22882"])
out = {"version": installed_version(), "runs": []}
for ops in json.loads(sys.argv[1]):
    with AuditedRun(config) as run:
        for op in program_from_json(ops):
            if run.apply(op):
                break
        out["runs"].append({"signatures": sorted({f.signature for f in run.findings}),
                            "reach": run.target.reach()})
print(json.dumps(out))
"""

HEALTH = [{"op": "health_check"}, {"op": "idle"}]
ONE_TOKEN = [{"op": "submit", "prompt_len": 40, "max_new_tokens": 1}, {"op": "idle"}]
DECODES = [{"op": "submit", "prompt_len": 40, "max_new_tokens": 6}, {"op": "submit", "prompt_len": 70,
                                                                      "max_new_tokens": 3}, {"op": "idle"}]
ABORTED = [{"op": "submit", "prompt_len": 40, "max_new_tokens": 12}, {"op": "step", "n": 3},
           {"op": "abort", "handle": 0}, {"op": "idle"}]


def run(version: str, programs: list) -> dict:
    return run_programs(CHILD, programs, "sglang", version, ROOT)


@pytest.mark.releases
def test_0_5_10_leaks_the_device_buffer_and_host_slots_of_every_request_finished_in_the_prebuilt_batch():
    health, one, decodes, aborted = run("0.5.10.post1", [HEALTH, ONE_TOKEN, DECODES, ABORTED])["runs"]
    site = "request-kv/process_batch_result_prebuilt@scheduler_output_processor_mixin.py"
    want = [f"leak/hisparse_device_pool/{site}", f"leak/hisparse_host_pool/{site}"]
    assert health["signatures"] == want and one["signatures"] == want
    assert health["reach"]["health_checks"] == 1 and health["reach"]["prebuilt_finished"] == 1
    # requests that finish in a decode batch, or are aborted while decoding, go through request_finished
    assert decodes["signatures"] == [] and decodes["reach"]["decode_finished"] == 2
    assert aborted["signatures"] == [] and aborted["reach"]["direct_admits"] == 1


@pytest.mark.releases
def test_0_5_11_releases_the_prebuilt_finish_with_request_finished():
    runs = run("0.5.11", [HEALTH, ONE_TOKEN, DECODES])["runs"]
    assert [r["signatures"] for r in runs] == [[], [], []]
    assert runs[0]["reach"]["prebuilt_finished"] == runs[1]["reach"]["prebuilt_finished"] == 1


@pytest.mark.releases
def test_a_pd_hisparse_config_the_legacy_family_does_not_drive_is_refused_in_one_line():
    code = ("from kvaudit.history.catalogue import BUGS, target_config; from kvaudit.targets import registry\n"
            "c = target_config(BUGS['sglang-22882'])\n"
            "try:\n registry.get('sglang').probe(type(c).from_dict({**c.to_dict(), 'page_size': 16,"
            " 'hisparse_device_buffer_size': 32}))\n"
            "except registry.TargetUnavailable as e: print('REFUSED', e)")
    env = child_env("sglang", "0.5.10.post1", ROOT)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("REFUSED")]
    assert len(line) == 1 and "page_size != 64" in line[0] and "HiSparse" in line[0], r.stdout + r.stderr[-1000:]


@pytest.mark.sglang
def test_sglang_0_5_23_refuses_pd_decode_with_hisparse_in_one_line():
    from kvaudit.history.catalogue import BUGS, target_config
    from kvaudit.targets import registry
    from kvaudit.targets.sglang.boot import installed_version

    if installed_version() != "0.5.23":
        pytest.skip("needs the base SGLang 0.5.23")
    with pytest.raises(registry.TargetUnavailable) as e:
        registry.get("sglang").probe(target_config(BUGS["sglang-22882"]))
    assert "\n" not in str(e.value) and "0.5.10.post1" in str(e.value) and "HiSparse" in str(e.value)


def test_the_decode_allocation_stand_in_takes_a_new_page_only_where_a_request_starts_one():
    # page 64: 65 and 129 tokens start a page (its first slot), 10 continues after its last slot
    seq_lens = torch.tensor([65, 10, 129])
    last_loc = torch.tensor([3 * 64 + 63, 5 * 64 + 8, 4 * 64 + 63])
    out = torch.empty(3, dtype=torch.int64)
    _alloc_decode(seq_lens, last_loc, torch.tensor([7, 9, 11]), out, 4, 64)
    assert out.tolist() == [7 * 64, 5 * 64 + 9, 9 * 64]

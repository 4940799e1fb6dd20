"""The history row sglang-36855 (kvaudit/targets/sglang/catalogue.py) beyond its known program
(tests/test_sglang_releases.py): a client request whose bootstrap_host is FAKE_BOOTSTRAP_HOST (config
``fake_bootstrap_every``) gets ``Req.skip_radix_cache_insert``; on SGLang 0.5.19 to 0.5.21
``maybe_cache_unfinished_req`` then returns before the tree's ``cache_unfinished_req``, so a chunked prompt's
prefix never advances and every chunk re-extends it from the start, leaking the chunk before. 0.5.22's
``checkpoint_kv_cache`` advances ``prefix_len`` whether or not the tree is told. The releases run in child
processes with their overlay first on ``PYTHONPATH`` (skipped, with the install command, when missing); the
option itself is checked on the installed SGLang."""

import os

import pytest
from release_helpers import run_programs

from kvaudit.audit.runner import AuditedRun
from kvaudit.history.catalogue import BUGS, target_config
from kvaudit.program import program_from_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the child: each (config overrides, program) on the row's preset; prints the version and each run's findings
CHILD = """
import json, sys
from kvaudit.audit.runner import AuditedRun
from kvaudit.history.catalogue import BUGS, target_config
from kvaudit.program import program_from_json
from kvaudit.targets.sglang.boot import installed_version
base = target_config(BUGS["sglang-36855"])
out = {"version": installed_version(), "runs": []}
for overrides, ops in json.loads(sys.argv[1]):
    config = type(base).from_dict({**base.to_dict(), **overrides})
    with AuditedRun(config) as run:
        for op in program_from_json(ops):
            run.apply(op)
        out["runs"].append(sorted({f.signature for f in run.findings}))
print(json.dumps(out))
"""

# r0 a 1-token request, r1 (fake_bootstrap_every 2: the fake one) 21 tokens over 16-token chunks
CHUNKED = [{"op": "submit", "prompt_len": 1, "max_new_tokens": 1},
           {"op": "submit", "prompt_len": 21, "max_new_tokens": 1}, {"op": "idle"}]
AGGREGATED = {"disaggregation_mode": "null", "bootstrap_lost_every": None}
PROGRAMS = [({}, CHUNKED), ({"fake_bootstrap_every": None}, CHUNKED), (AGGREGATED, CHUNKED)]
LEAK = "leak/token_to_kv_pool/request-kv/from:chunked"


def run(version: str) -> list:
    return run_programs(CHILD, PROGRAMS, "sglang", version, ROOT)["runs"]


@pytest.mark.releases
def test_0_5_21_leaks_the_chunks_of_a_fake_bootstrap_request_on_prefill_and_aggregated_servers():
    prefill, control, aggregated = run("0.5.21")
    assert prefill == [LEAK] and aggregated == [LEAK], (prefill, aggregated)
    assert control == []  # the same prompt from a decode host is inserted chunk by chunk: clean


@pytest.mark.releases
def test_0_5_22_advances_the_prefix_without_the_tree():
    assert run("0.5.22") == [[], [], []]


@pytest.mark.sglang
@pytest.mark.parametrize("every, skipped", [(2, True), (None, False)])
def test_the_fake_bootstrap_request_skips_the_tree_on_the_installed_sglang(every, skipped):
    """The option reaches SGLang's own flag: the chunked request (r1) carries FAKE_BOOTSTRAP_HOST, SGLang's
    ``Req`` sets ``skip_radix_cache_insert`` and, once idle, the tree holds none of its prompt."""
    base = target_config(BUGS["sglang-36855"])
    config = type(base).from_dict({**base.to_dict(), "fake_bootstrap_every": every})
    seen = {}
    with AuditedRun(config) as run:
        for op in program_from_json(CHUNKED[:2] + [{"op": "step"}] * 4 + CHUNKED[2:]):  # r1 chunked after bootstrap
            run.apply(op)
            req = run.target.chunked_req
            if req is not None:
                seen[req.rid] = req.skip_radix_cache_insert
        assert run.findings == []
        cached = run.target.tree_cache.evictable_size()
    assert seen == {"r1": skipped}
    assert (cached == 0) == skipped, cached

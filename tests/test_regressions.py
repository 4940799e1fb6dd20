"""Every file in corpora/regressions/ must still reproduce with its bug switched on and replay
clean with it switched off (the bug-zoo contract: the switch is what makes the finding)."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest

from kvaudit import replay
from kvaudit.audit.runner import execute

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "corpora", "regressions", "*.json")))


def test_there_are_regressions():
    assert FILES, "corpora/regressions/ is empty"


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_regression_reproduces_with_switch_and_is_clean_without(path):
    config, program, recorded, _ = replay.load(path)
    name = os.path.basename(path)[: -len(".json")]
    assert name in config.bugs, f"{name}.json must switch its own bug on"
    want = {f.signature for f in recorded}
    assert want
    for _ in range(3):  # deterministic: K of K
        assert want <= set(execute(config, program).signatures)
    clean = execute(dataclasses.replace(config, bugs=frozenset()), program)
    assert clean.findings == []


def test_every_zoo_bug_has_a_minimized_regression_of_its_finding_kind():
    """The bug-zoo contract: each switch has a reproducer found by kvaudit, whose first finding has
    the kind the zoo table gives, no longer than the table's shortest known program plus one op."""
    from engine_under_test import BUGS

    have = {os.path.basename(f)[: -len(".json")]: f for f in FILES}
    assert sorted(have) == sorted(BUGS)
    for name, bug in BUGS.items():
        config, program, recorded, _ = replay.load(have[name])
        assert recorded[0].kind == bug.finding, name
        assert len(program) <= bug.min_ops + 1, f"{name}: {len(program)} ops, zoo min {bug.min_ops}"


def test_no_two_zoo_bugs_share_a_signature():
    """A signature is a promise that two findings are one bug. Before the leak's second site, the
    row leaks of chunked-abort-ignored (an abort drops a parked chunked request) and
    prefill-finish-leaks-row (a release that forgets the row) were one signature,
    leak/req_to_token_pool/alloc_for_extend@scheduler.py, and so were their KV leaks: a campaign
    that knew one took the other as known."""
    owner: dict[str, str] = {}
    for path in FILES:
        config, program, _, _ = replay.load(path)
        for sig in set(execute(config, program).signatures):
            name = os.path.basename(path)[: -len(".json")]
            assert owner.setdefault(sig, name) == name, f"{sig}: {owner[sig]} and {name}"
    chunked, finish = (next(s for s, n in owner.items() if n == b and s.startswith("leak/req_to_token_pool/"))
                       for b in ("chunked-abort-ignored", "prefill-finish-leaks-row"))
    assert chunked.endswith("/from:chunked")  # dropped from the chunked slot without a release
    assert finish.endswith("/process_batch_result@scheduler.py")  # the release that left the row out

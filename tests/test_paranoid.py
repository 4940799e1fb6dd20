"""The paranoid mode (``KVAUDIT_PARANOID=1``, :data:`kvaudit.audit.oracles.PARANOID`): every check also runs
the reference sweep and raises ``Disagreement`` where the fast sweep differs. Over the zoo's reproducers and
every shipped corpus file it must find no disagreement, and the findings must be the same as without it."""

import glob
import os

import numpy as np
import pytest

from kvaudit import replay
from kvaudit.audit import oracles
from kvaudit.audit.runner import AuditedRun, execute

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(os.path.relpath(p, ROOT) for pattern in ("corpora/regressions/*.json", "corpora/sglang/*.json",
                                                       "corpora/vllm/*.json")
               for p in glob.glob(os.path.join(ROOT, pattern)))
ENGINE_MARKS = {"/sglang/": pytest.mark.sglang, "/vllm/": pytest.mark.vllm}


def _firsts(ex) -> list:
    return [(f.signature, f.op_index, f.step) for f in ex.findings]


@pytest.mark.parametrize("name", [pytest.param(n, marks=[m for d, m in ENGINE_MARKS.items() if d in n])
                                  for n in FILES])
def test_paranoid_replay_of_a_corpus_file_finds_no_disagreement_and_the_same_findings(name, monkeypatch):
    config, program, _, _ = replay.load(os.path.join(ROOT, name))
    plain = _firsts(execute(config, program))
    monkeypatch.setattr(oracles, "PARANOID", True)
    monkeypatch.setattr(oracles, "VECTORIZE_ROOTS", -1)  # the vectorized sweep on every check, held to the reference
    assert _firsts(execute(config, program)) == plain  # (a Disagreement would raise out of execute)


def test_paranoid_mode_raises_when_the_fast_sweep_and_its_reference_differ(monkeypatch):
    from kvaudit.targets.eut.presets import get_preset
    from kvaudit.program import Submit, Step

    monkeypatch.setattr(oracles, "PARANOID", True)
    monkeypatch.setattr(oracles, "VECTORIZE_ROOTS", -1)
    real = oracles._mark_vectorized

    def off_by_one(auditor, roots, private, n):  # a fast sweep wrong about the last unit of every pool
        referenced, owner, cat = real(auditor, roots, private, n)
        referenced[-1] = ~referenced[-1]
        return referenced, owner, cat

    monkeypatch.setattr(oracles, "_mark_vectorized", off_by_one)
    with AuditedRun(get_preset("default").config(model="none")) as run:
        with pytest.raises(oracles.Disagreement, match=r"pool \w+: the sweep and its reference disagree on 1 unit\(s\)"):
            run.apply(Submit(family=0, prompt_len=16, max_new_tokens=4))
            run.apply(Step(n=2))

"""Every shipped replay file replays to the ledger digest and signatures recorded in
tests/data/corpus_digests.json: the guard for refactors that must not change behaviour (issue 19).
After a deliberate change of the engine or of a signature, refresh the record and say why in the
commit: ``python tests/test_corpus_digests.py`` (from the repository root)."""

import glob
import json
import os
import sys

import pytest

from kvaudit import replay
from kvaudit.audit.runner import execute

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "tests", "data", "corpus_digests.json")
FILES = sorted(os.path.relpath(p, ROOT) for pattern in ("corpora/regressions/*.json", "corpora/sglang/*.json",
                                                       "corpora/vllm/*.json")
               for p in glob.glob(os.path.join(ROOT, pattern)))
ENGINE_MARKS = {"/sglang/": pytest.mark.sglang, "/vllm/": pytest.mark.vllm}  # files of a real engine need it


def replayed(name: str) -> list:
    """[ledger digest, sorted signatures] of one replay of ``name`` (a path relative to the root)."""
    config, program, _, _ = replay.load(os.path.join(ROOT, name))
    ex = execute(config, program)
    return [ex.digest, sorted(ex.signatures)]


def test_the_record_lists_every_shipped_replay_file():
    assert sorted(json.load(open(RECORD))) == FILES


@pytest.mark.parametrize("name", [pytest.param(n, marks=[m for d, m in ENGINE_MARKS.items() if d in n])
                                  for n in FILES])
def test_a_replay_file_replays_to_its_recorded_digest_and_signatures(name):
    recorded = json.load(open(RECORD)).get(name)
    assert replayed(name) == recorded, (
        f"{name} no longer replays to its recorded ledger digest and signatures; if the change was "
        "deliberate, refresh with 'python tests/test_corpus_digests.py' and say why in the commit")


def test_every_engine_function_a_recorded_signature_names_is_still_defined_in_its_file():
    """A signature names its sites ``function@basename``: moving such a function to another module
    changes a shipped signature (a promise to users), so it stays where the record says."""
    import ast
    import re

    sites = {s for name, (_, sigs) in json.load(open(RECORD)).items() for sig in sigs
             if name.startswith("corpora/regressions/")  # the built-in engine's (a real engine's are its own)
             for s in re.findall(r"(\w+)@(\w+\.py)", sig)}
    missing = []
    for fn, base in sorted(sites):
        path = os.path.join(ROOT, "engine_under_test", base)
        if os.path.exists(path) and fn not in {n.name for n in ast.walk(ast.parse(open(path).read()))
                                               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}:
            missing.append(f"{fn}@{base}")
    assert sites and not missing, f"no longer defined in their engine file: {missing}"


if __name__ == "__main__":  # refresh the record
    with open(RECORD, "w") as fh:
        json.dump({n: replayed(n) for n in FILES}, fh, indent=1, sort_keys=True)
        fh.write("\n")
    print(f"recorded {len(FILES)} file(s) in {os.path.relpath(RECORD, os.getcwd())}", file=sys.stderr)

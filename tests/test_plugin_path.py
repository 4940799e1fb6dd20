"""The "audit your own engine" path as a newcomer walks it (docs/writing-a-target.md): a plugin kind
(``tests/rowtoy_plugin.py``: a config with no ``target`` field, a rows pool returning numpy arrays,
bugs as plain strings, no ``describe_busy``) fuzzed, replayed and reported from the command line."""

import numpy as np
import pytest
import torch

from kvaudit.audit.hooks import Auditor
from kvaudit.audit.runner import execute
from kvaudit.program import Abort, Idle, Step, Submit
from kvaudit.targets import registry

registry.kinds()  # the built-ins register first, as in a command's run
import rowtoy_plugin  # noqa: E402  (registers the kind "rowtoy" in this process)

PLUGIN = "rowtoy_plugin"


@pytest.fixture(autouse=True)
def plugin(monkeypatch):
    monkeypatch.setenv("KVAUDIT_PLUGINS", PLUGIN)  # what a user sets


# -- 4. the rows-pool wrapper takes any sequence or array of ints ----------------------------------

class TorchRows:
    """A rows pool on torch: ``alloc`` returns an int32 tensor, ``free`` takes a tensor or a 0-d one."""

    def __init__(self, size):
        self.free_rows = list(range(1, size))

    def alloc(self, n):
        out, self.free_rows = self.free_rows[:n], self.free_rows[n:]
        return torch.tensor(out, dtype=torch.int32)

    def free(self, rows):
        self.free_rows += torch.as_tensor(rows).reshape(-1).tolist()


@pytest.mark.parametrize("engine_pool", ["numpy", "torch"])
def test_the_rows_wrapper_records_arrays_and_integer_scalars(engine_pool):
    target = rowtoy_plugin.RowToyTarget(rowtoy_plugin.RowToyConfig(size=16))
    if engine_pool == "torch":
        target.engine.pool = TorchRows(16)
    pool = target.engine.pool
    auditor = Auditor(target)
    try:
        held = auditor.ledgers["rows"].allocated  # (the reserved row 0 reads as held)
        rows = pool.alloc(5)
        got = np.asarray(rows.tolist(), dtype=np.int64)
        assert held[got].all() and held[1:].sum() == 5
        pool.free(rows[0])  # one row: an np.int64 / 0-d tensor scalar
        assert not held[got[0]] and held[1:].sum() == 4
        pool.free(rows[1:3])
        pool.free(int(r) for r in got[3:])  # a generator: the engine and the ledger both see every row
        assert held[1:].sum() == 0
        assert sorted(pool.free_rows.tolist() if engine_pool == "numpy" else pool.free_rows) == list(range(1, 16))
        with pytest.raises(TypeError, match=r"rows.free\(\) was given ndarray of float64, not row ids"):
            pool.free(np.array([1.0]))
    finally:
        auditor.uninstall()


def test_an_engine_returning_numpy_rows_runs_clean_and_its_leak_is_a_leak():
    """The wrapper crashed on ``if out:`` of an array (reported as the engine's crash)."""
    program = [Submit(prompt_len=4, max_new_tokens=3), Step(n=2), Idle()]
    clean = execute(rowtoy_plugin.PRESETS["rowtoy"].config(), program)
    assert clean.findings == []
    leaky = execute(rowtoy_plugin.PRESETS["rowtoy"].config(bugs={"abort-leak"}),
                    [Submit(prompt_len=4, max_new_tokens=3), Step(n=1), Abort(handle=0), Idle()])
    assert [f.kind for f in leaky.findings] == ["leak"], [f.message for f in leaky.findings]
    assert leaky.findings[0].pool == "rows"

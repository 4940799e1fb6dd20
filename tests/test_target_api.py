"""The public target API (issue 19): the Target base class's defaults, 'blocks' pools with reference
counts, per-target identities, typed findings from targets, and the registry of target kinds."""

from dataclasses import dataclass, field

import numpy as np
import pytest

from kvaudit.audit import oracles
from kvaudit.config import ConfigBase, Preset
from kvaudit.audit.hooks import Auditor
from kvaudit.targets import config_from_dict, make_target, registry
from kvaudit.targets.base import Accounting, PoolSpec, Root, Target, TargetFinding


class Blocks:
    """A toy reference-counted pool: ``new(n)`` hands out blocks, ``ref``/``unref`` change counts."""

    def __init__(self, n):
        self.refs, self.free = [0] * n, list(range(1, n))

    def new(self, n):
        out = [self.free.pop(0) for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        return out

    def ref(self, blocks):
        for b in blocks:
            if self.refs[b] == 0:
                self.free.remove(b)
            self.refs[b] += 1

    def unref(self, blocks):
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)


class ToyTarget(Target):
    """Owners are named lists of blocks; everything else is the base class's default."""

    def __init__(self, n=8, terms=("available", "referenced"), own=()):
        self.pool, self.held, self.terms, self.own, self.steps = Blocks(n), {}, terms, list(own), 0

    def pools(self):
        return [PoolSpec("blocks", self.pool, "blocks", 1, len(self.pool.refs) - 1)]

    def install_pool(self, spec, auditor, wrap):
        auditor.wrap_blocks(spec, list, alloc="new", ref="ref", unref="unref")

    def roots(self, aborting=True):
        return [Root("blocks", o, np.array(b, dtype=np.int64), private=False) for o, b in self.held.items()]

    def accounting(self):
        return {"blocks": Accounting(len(self.pool.free), 0, 0, 0, len(self.pool.refs) - 1)}

    def identity_terms(self, pool):
        return self.terms

    def invariant_findings(self):
        return self.own

    def engine_check(self):
        return []


@pytest.fixture
def toy():
    made = []

    def make(**kw):
        t = ToyTarget(**kw)
        made.append(Auditor(t))
        return t, made[-1]

    yield make
    for a in made:
        a.uninstall()


def kinds(findings):
    return [f.kind for f in findings]


def test_a_shared_block_is_freed_when_its_last_reference_goes(toy):
    t, a = toy()
    t.held["a"] = t.pool.new(2)
    t.pool.ref(t.held["a"][:1])
    t.held["b"] = t.held["a"][:1]
    assert oracles.check(a, t) == []
    t.pool.unref(t.held.pop("a"))
    assert oracles.check(a, t) == []  # block 1 is still b's
    assert a.ledgers["blocks"].refs[1:3].tolist() == [1, 0]
    t.pool.unref(t.held.pop("b"))
    assert oracles.check(a, t) == [] and not a.ledgers["blocks"].allocated[1:].any()
    assert [e.kind for e in a.events] == ["alloc", "free", "free"]


def test_a_count_taken_below_zero_is_a_double_free(toy):
    t, a = toy()
    blocks = t.pool.new(1)
    t.pool.unref(blocks)
    t.pool.unref(blocks)
    assert kinds(a.pending) == ["double-free"]


def test_a_block_revived_from_count_zero_is_allocated_again_and_its_holder_keeps_it(toy):
    t, a = toy()
    blocks = t.pool.new(1)
    t.pool.unref(blocks)  # cached but free
    t.pool.ref(blocks)  # a prefix hit revives it
    t.held["c"] = blocks
    assert oracles.check(a, t) == []
    t.held.clear()
    assert kinds(oracles.check(a, t)) == ["leak"]


def test_the_identity_is_the_targets_own(toy):
    t, a = toy()
    t.held["a"] = t.pool.new(3)
    assert oracles.check(a, t) == []  # available 4 + referenced 3 == 7
    t, a = toy(terms=("available", "evictable", "protected", "session_held", "uncached"))
    t.held["a"] = t.pool.new(3)  # shared roots: SGLang's uncached is 0, so its identity fails here
    drift = oracles.check(a, t)
    assert kinds(drift) == ["accounting-drift"] and "uncached=0 = 4 != total=7" in drift[0].message


def test_a_target_reports_a_finding_of_any_kind_with_its_check(toy):
    t, a = toy()
    t.held["a"] = t.pool.new(2)
    t.own.append(TargetFinding("accounting-drift", "blocks", np.array([2]), "ref_cnt off", check="ref_cnt"))
    (f,) = oracles.check(a, t)
    assert f.signature == "accounting-drift/blocks/ref_cnt" and f.slots == [2]


@dataclass(frozen=True)
class ToyConfig(ConfigBase):
    n: int = 8
    bugs: frozenset = field(default_factory=frozenset)
    preset: str = "custom"
    target: str = "toy"


def test_a_registered_kind_builds_targets_and_configs_from_replay_files():
    kind = registry.register(registry.TargetKind(
        "toy", "a toy", ToyConfig, presets=lambda: {"toy": Preset("toy", "one", {}, ToyConfig)},
        make=lambda c: ToyTarget(n=c.n), default_preset="toy"))
    try:
        config = kind.preset("default").config(n=5)
        assert isinstance(make_target(config), ToyTarget) and len(make_target(config).pool.refs) == 5
        assert config_from_dict(config.to_dict()) == config
        with pytest.raises(ValueError, match="unknown target 'nope'"):
            config_from_dict({"target": "nope"})
        with pytest.raises(ValueError, match="valid presets: toy"):
            kind.preset("other")
    finally:
        registry._KINDS.pop("toy")
    assert list(registry.kinds())[:2] == ["eut", "sglang"]


def test_the_built_ins_list_first_even_when_a_plugin_registered_before_them(monkeypatch):
    """A plugin module imported before the registry first loaded went ahead of eut in every listing."""
    now = registry.kinds()
    toy = registry.TargetKind("early", "a plugin imported early", ToyConfig, presets=dict, make=lambda c: None)
    monkeypatch.setattr(registry, "_KINDS", {"early": toy, **now})
    assert list(registry.kinds()) == ["eut", "sglang", "vllm", "early"] + [n for n in now if n not in
                                                                          ("eut", "sglang", "vllm")]


@pytest.mark.parametrize("command", [["presets"], ["bugs"], ["fuzz", "--max-time", "0.1"]])
def test_a_plugin_that_fails_to_load_is_a_warning_not_silence(command, tmp_path):
    """A typo in KVAUDIT_PLUGINS used to be silent unless its target was asked for."""
    import subprocess

    from cli_helpers import kvaudit_script, plain_env

    env = {**plain_env(), "KVAUDIT_PLUGINS": "examples.minivllm.targt"}
    r = subprocess.run([kvaudit_script(), *command], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "warning: cannot import 'examples.minivllm.targt' named in KVAUDIT_PLUGINS" in r.stderr
    assert "Traceback" not in r.stderr

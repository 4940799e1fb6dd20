"""The public target API (issue 19): the Target base class's defaults, 'blocks' pools with reference
counts, per-target identities, typed findings from targets, and the registry of target kinds."""

import os
import re
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest
from cli_helpers import invoke, one_error_line

from kvaudit import replay
from kvaudit.audit import oracles
from kvaudit.config import ConfigBase, Preset, json_value
from kvaudit.audit.hooks import Auditor
from kvaudit.targets import config_from_dict, make_target, registry
from kvaudit.targets.base import Accounting, PoolSpec, Root, Target, TargetFinding
from kvaudit.targets.eut.presets import EutConfig

registry.kinds()  # the built-ins register first, as in a command's run
import rowtoy_plugin  # noqa: E402  (registers the kind "rowtoy" in this process)
import pagetoy_plugin  # noqa: E402  (registers "pagetoy": docs/writing-a-target.md's stale-KV shadow)

HERE = os.path.dirname(os.path.abspath(__file__))


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

    def apply(self, op):
        pass

    def step(self):
        self.steps += 1

    def is_idle(self):
        return True


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
    f = a.pending[0]
    assert f.unit == "block" and f.listed() == ("blocks", blocks)  # the unit the pool declares
    assert f.summary().startswith("Double free of 1 block in pool blocks")


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


def test_a_targets_leak_that_names_what_lost_it_reads_as_the_leak_oracles(toy):
    """A target's leak with ``lost_by`` (vLLM: a reference count above the holders, kept by a block table dropped
    whole: ``from:running``) ends as the leak oracle's of the same loss (``Target.lost_by``'s words), with its
    check after it when it names one."""
    t, a = toy()
    t.held["a"] = t.pool.new(2)
    t.own.append(TargetFinding("leak", "blocks", np.array([2]), "ref_cnt off", lost_by="from:running"))
    (f,) = oracles.check(a, t)
    kind, pool, site, *rest = f.signature.split("/")
    assert (kind, pool, rest) == ("leak", "blocks", ["from:running"]) and "@" in site, f.signature
    t.own[0] = t.own[0]._replace(check="ref_cnt")
    (f,) = oracles.check(a, t)
    assert f.signature == f"leak/blocks/{site}/from:running/check:ref_cnt"


@dataclass(frozen=True)
class ToyConfig(ConfigBase):
    n: int = 8
    bugs: frozenset = field(default_factory=frozenset)
    preset: str = "custom"
    target: str = "toy"
    page_size = 1
    context_len = 8

    @property
    def num_slots(self) -> int:
        return self.n


def test_a_registered_kind_builds_targets_and_configs_from_replay_files():
    kind = registry.register(registry.TargetKind(
        "toy", "a toy", ToyConfig, presets=lambda: {"toy": Preset("toy", "one", {}, ToyConfig)},
        make=lambda c: ToyTarget(n=c.n), default_preset="toy"))
    try:
        config = kind.preset("default").config(n=5)
        assert isinstance(make_target(config), ToyTarget) and len(make_target(config).pool.refs) == 5
        assert config_from_dict(config.to_dict()) == config
        with pytest.raises(ValueError, match='unknown target "nope"'):
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


# -- a KVAUDIT_PLUGINS module that does not import is an error --------------------------------------

@pytest.mark.parametrize("command", [["presets"], ["bugs"], ["fuzz", "--max-time", "0.1"], ["replay", "x.json"],
                                     ["report", "x.json"], ["ci", "--max-time", "0"]])
def test_a_plugin_that_fails_to_import_is_one_line_exit_2(command, tmp_path, monkeypatch, fresh_registry):
    """A typo in KVAUDIT_PLUGINS was a warning, and the command ran on, exit 0, without the target meant."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVAUDIT_PLUGINS", "examples.minivllm.targt")
    r = invoke(*command)
    assert r.exit_code == 2, r.output
    line = one_error_line(r)
    assert 'cannot import "examples.minivllm.targt" named in KVAUDIT_PLUGINS: ModuleNotFoundError' in line
    assert f"looked on sys.path and in the current directory {tmp_path}" in line
    assert str(tmp_path) not in sys.path  # not found there either: the path is left as it was


@pytest.mark.parametrize("plugins, tail", [("a" * 100_000, "..."), (",".join(f"x{i}" for i in range(5000)), "; and 4997 more")],
                         ids=["huge-name", "5000-modules"])
def test_a_kvaudit_plugins_of_huge_names_or_thousands_of_modules_is_a_short_line(plugins, tail, monkeypatch,
                                                                                 fresh_registry):
    """th64: a module name of 100,000 characters made a 200 KB error line (the name twice, whole), and 5,000
    modules that did not import a 470 KB one (each named)."""
    monkeypatch.setenv("KVAUDIT_PLUGINS", plugins)
    r = invoke("presets")
    assert r.exit_code == 2, r.output[-500:]
    line = one_error_line(r)
    assert line.startswith('kvaudit: error: cannot import "') and line.endswith(tail) and len(line) < 2000, len(line)
    # tb64: an unknown --target named every module that did not import (a 186 KB line for 2,000)
    r = invoke("fuzz", "--target", "foo", "--max-time", "0.1")
    assert r.exit_code == 2, r.output[-500:]
    line = one_error_line(r)
    assert 'unknown target "foo"' in line and f"{tail})" in line and len(line) < 2000, len(line)


@pytest.mark.parametrize("command", [["presets"], ["bugs", "--target", "eut"]])
def test_a_plugin_module_that_registers_no_kind_is_one_warning_line_and_the_command_goes_on(
        command, monkeypatch, fresh_registry):
    """KVAUDIT_PLUGINS=os (a module that imports and registers nothing) was accepted without a word."""
    monkeypatch.setenv("KVAUDIT_PLUGINS", "os")
    r = invoke(*command)
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == ['warning: module "os" named in KVAUDIT_PLUGINS registered no target kind']
    assert r.stdout.strip()


def test_a_plugin_kind_s_replay_command_names_kvaudit_plugins(monkeypatch, fresh_registry):
    monkeypatch.setenv("KVAUDIT_PLUGINS", "os, examples.minivllm.target")
    assert registry.plugins_env("minivllm") == "KVAUDIT_PLUGINS='os, examples.minivllm.target'"
    assert registry.plugins_env("eut") is None and registry.plugins_env("vllm") is None
    monkeypatch.setenv("KVAUDIT_PLUGINS", "os")  # registered, but not by a module this run names
    assert registry.plugins_env("minivllm") is None


def test_a_plugin_module_is_found_in_the_current_directory_after_the_installed_packages(
        tmp_path, monkeypatch, fresh_registry):
    """The console script does not put the current directory on sys.path (python -m does, first)."""
    (tmp_path / "cwd_toy_plugin.py").write_text(open(os.path.join(HERE, "rowtoy_plugin.py")).read()
                                                .replace('name="rowtoy"', 'name="cwdtoy"'))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVAUDIT_PLUGINS", "cwd_toy_plugin")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    try:
        assert "cwdtoy" in registry.kinds() and registry.plugin_errors() == []
        assert sys.path[-1] == str(tmp_path)  # appended: an installed module of the same name wins
        r = invoke("presets", "--target", "cwdtoy")
        assert r.exit_code == 0 and "rowtoy-leaky" in r.output, r.output + r.stderr
    finally:
        sys.modules.pop("cwd_toy_plugin", None)


def test_a_module_the_plugin_imports_is_not_looked_for_in_the_current_directory(tmp_path, monkeypatch,
                                                                                 fresh_registry):
    (tmp_path / "needs_missing.py").write_text("import no_such_dependency_kva\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVAUDIT_PLUGINS", "needs_missing")
    try:
        (line,) = registry.plugin_errors()
    finally:
        sys.modules.pop("needs_missing", None)
    assert "No module named 'no_such_dependency_kva'" in line and "current directory" not in line


# -- a target's own mistakes are configuration errors, not engine crashes --------------------------------

@dataclass(frozen=True)
class BadToyConfig(ConfigBase):
    """rowtoy's engine (tests/rowtoy_plugin.py) under a target with one mistake, named by ``preset``."""

    size: int = 48
    bugs: frozenset = field(default_factory=frozenset)
    preset: str = "kv-kind-on-rows"
    page_size = 1
    num_slots = 47
    context_len = 16


class KvKindOnRows(rowtoy_plugin.RowToyTarget):
    """Declares its row pool as a token-slot allocator: the kv wrapper called available_size() at the
    first alloc, an AttributeError reported as the engine's crash at the engine's alloc line."""

    def pools(self):
        return [PoolSpec("rows", self.engine.pool, "kv", 1, self.config.size - 1)]


class MisspeltKind(rowtoy_plugin.RowToyTarget):
    def pools(self):
        return [PoolSpec("rows", self.engine.pool, "row", 1, self.config.size - 1)]


class BlocksWithoutInstall(rowtoy_plugin.RowToyTarget):
    def pools(self):
        return [PoolSpec("rows", self.engine.pool, "blocks", 1, self.config.size - 1)]


class TwoRows(rowtoy_plugin.RowToyTarget):
    def pools(self):
        return [PoolSpec("rows", self.engine.pool, "rows", 1, self.config.size - 1)] * 2


class NoEngineCheck(rowtoy_plugin.RowToyTarget):
    engine_check = Target.engine_check  # as if the author never wrote it


class ListRoots(rowtoy_plugin.RowToyTarget):
    """Roots whose units are a list of Python ints, of a pool it never declared."""

    def roots(self, aborting=True):
        return [Root("rowz", f"req:{r.rid}", r.rows) for r in self.engine.running]


class KvTensorsShadow(rowtoy_plugin.RowToyTarget):
    """Follows base.py's old kv_pools docstring ("the KV tensors, {pool: (k, v)}") and tags its running
    requests' rows each step: the shadow's tags came out [48, 48], and the first write was 'Engine crash:
    ValueError: shape mismatch', blamed on the target's own step, exit 1."""

    def kv_pools(self):
        return {"rows": (self.config.size, self.config.size)}

    def install_shadow(self, shadow, wrap, report):
        step = self.engine.step

        def tagged_step():
            step()
            for r in self.engine.running:
                tags = shadow.request_tags(r, list(range(r.rows.size)))
                shadow.write("rows", r.rows, tags)
                if shadow.read("rows", r.rows, tags) is not None:
                    report("rows", r.rows, f"req:{r.rid} reads another's KV")

        wrap(self.engine, "step", tagged_step)


class KvOfAnUndeclaredPool(KvTensorsShadow):
    def kv_pools(self):
        return {"kv": self.config.size}


class ReadsUnwritten(rowtoy_plugin.RowToyTarget):
    """A shadow that checks each running request's rows after each step and writes none of them, so every
    read is stale ('never written'); it reports the slots as a list of ints (``REPORT_POOL``'s)."""

    REPORT_POOL = "rows"

    def kv_pools(self):
        return {"rows": self.config.size}

    def reported(self, slots):
        return slots.tolist()

    def install_shadow(self, shadow, wrap, report):
        step = self.engine.step

        def checked_step():
            step()
            for r in self.engine.running:
                bad = shadow.read("rows", r.rows, shadow.request_tags(r, list(range(r.rows.size))))
                if bad is not None:
                    report(self.REPORT_POOL, self.reported(r.rows[bad[0]]), f"req:{r.rid} reads KV {bad[1]}")

        wrap(self.engine, "step", checked_step)


class ReportsAnUndeclaredPool(ReadsUnwritten):
    REPORT_POOL = "kv"


class ReportsPastThePool(ReadsUnwritten):
    """Reports token slots past its kv_pools() size: was 'Engine crash: IndexError', exit 1."""

    def reported(self, slots):
        return slots + self.config.size


class ReportsNoTags(ReadsUnwritten):
    """Reports the tags its reader wanted (report's optional 4th argument, tb66), none for its slots: without the
    count check, an IndexError in the auditor."""

    def install_shadow(self, shadow, wrap, report):
        super().install_shadow(shadow, wrap, lambda pool, slots, message: report(pool, slots, message, []))


BAD = {"kv-kind-on-rows": (KvKindOnRows, 'pool "rows" declares kind "kv", but its RowPool has no available_size()'),
       "misspelt-kind": (MisspeltKind, 'pool "rows" declares kind "row"; the pool kinds are kv, rows, blocks'),
       "blocks-without-install": (BlocksWithoutInstall, 'pool "rows" is a "blocks" pool, which has no standard '
                                                        "wrapping: BlocksWithoutInstall.install_pool must call "
                                                        "auditor.wrap_blocks"),
       # (the names spelled as JSON: it said got ['rows', 'rows'])
       "pool-named-twice": (TwoRows, 'TwoRows.pools() must name each pool once with a non-empty string, got ["rows", '
                                     '"rows"]'),
       "no-engine-check": (NoEngineCheck, "NoEngineCheck does not define engine_check(), required of every target"),
       "undeclared-root-pool": (ListRoots, 'a root of req:r1 names pool "rowz", which its pools() does not declare'),
       "kv-tensors-shadow": (KvTensorsShadow, "KvTensorsShadow.kv_pools() must return {declared pool: its size in "
                                              'token slots, an int >= (num_units + 1) * page_size}, got {"rows": '
                                              "[48, 48]}"),
       "kv-of-an-undeclared-pool": (KvOfAnUndeclaredPool, "KvOfAnUndeclaredPool.kv_pools() must return {declared "
                                                          "pool: its size in token slots"),
       "reads-unwritten": (ReadsUnwritten, "(none: a stale read reported with its slots as a list)"),
       "report-of-an-undeclared-pool": (ReportsAnUndeclaredPool, "ReportsAnUndeclaredPool.install_shadow's report(pool, "
                                                                  "slots, message) takes a pool of kv_pools() (rows) "
                                                                  'and the token slots read wrong, integers in [0, its '
                                                                  'size), got "kv" and [1'),
       "report-past-the-pool": (ReportsPastThePool, "ReportsPastThePool.install_shadow's report(pool, slots, message) "
                                                    "takes a pool of kv_pools() (rows) and the token slots read wrong, "
                                                    "integers in [0, its size), got \"rows\" and [49"),
       "report-no-tags": (ReportsNoTags, "ReportsNoTags.install_shadow's report(pool, slots, message, expected) takes "
                                         "one tag per slot in expected, got 0 for "),
       }


@pytest.fixture
def badtoy():
    kind = registry.register(registry.TargetKind(
        "badtoy", "rowtoy's engine behind a target with one mistake", BadToyConfig,
        presets=lambda: {n: Preset(n, n, {}, BadToyConfig) for n in BAD},
        make=lambda c: BAD[c.preset][0](c), default_preset="kv-kind-on-rows"))
    yield kind
    registry._KINDS.pop("badtoy")


@pytest.mark.parametrize("preset", [p for p in BAD if p not in ("undeclared-root-pool", "reads-unwritten",
                                                                 "report-of-an-undeclared-pool", "report-past-the-pool",
                                                                 "report-no-tags")])
def test_a_targets_declaration_mistake_is_one_line_exit_2_naming_the_kind(preset, badtoy, tmp_path):
    """KvKindOnRows was 'Engine crash: AttributeError: 'RowPool' object has no attribute
    'available_size'', blamed on the engine's own alloc line, exit 1."""
    r = invoke("fuzz", "--target", "badtoy", "--preset", preset, "--fuzzer", "random", "--max-time", "5",
               "--out", str(tmp_path))
    assert r.exit_code == 2, r.output + r.stderr
    line = one_error_line(r)
    assert line.startswith(f"kvaudit: error: target badtoy: {BAD[preset][1]}"), line
    assert os.listdir(tmp_path) == [] or not any(n.endswith(".json") for n in os.listdir(tmp_path))


def test_a_shadow_reports_a_stale_read_with_its_slots_as_any_integer_sequence(badtoy, tmp_path):
    """report(pool, slots, message) with slots as a list of ints was 'Engine crash: TypeError: unsupported
    operand type(s) for //: 'list' and 'int'' (the auditor divided the slots by the page size), exit 1."""
    r = invoke("fuzz", "--target", "badtoy", "--preset", "reads-unwritten", "--fuzzer", "random", "--max-time", "5",
               "--out", str(tmp_path))
    assert r.exit_code == 1, r.output + r.stderr
    assert "signature: stale-kv/rows/" in r.output and "/unwritten" in r.output, r.output
    assert "Engine crash" not in r.output, r.output
    # a report naming a pool the shadow does not cover was 'Engine crash: KeyError: 'kv'', one of slots past the
    # pool 'Engine crash: IndexError', exit 1 both
    for preset in ("report-of-an-undeclared-pool", "report-past-the-pool", "report-no-tags"):
        r = invoke("fuzz", "--target", "badtoy", "--preset", preset, "--fuzzer", "random", "--max-time", "5",
                   "--out", str(tmp_path / preset))
        assert r.exit_code == 2, r.output + r.stderr
        last = r.stderr.strip().splitlines()[-1]  # met running, after the run's first lines
        assert last.startswith(f"kvaudit: error: target badtoy: {BAD[preset][1]}"), last
        assert "Traceback" not in r.output + r.stderr and "crash" not in r.output


def test_fuzz_s_replay_command_carries_its_suppressions(badtoy, tmp_path):
    """A toy plugin's stale read found past suppressed use-after-frees printed 'kvaudit replay FILE' without
    the run's --suppress: that replay stopped at the first use-after-free, 'recorded signature(s) reproduced:
    no'. The hint now carries the rules, and running it reproduces the file's finding."""
    rules = tmp_path / "known.toml"
    rules.write_text('[[suppress]]\nkind = "leak"\nreason = "known"\n')
    r = invoke("fuzz", "--target", "badtoy", "--preset", "reads-unwritten", "--fuzzer", "random", "--max-time", "5",
               "--suppress", str(rules), "--out", str(tmp_path / "out"))
    assert r.exit_code == 1, r.output + r.stderr
    (hint,) = re.findall(r"^replay file: .*\((.*)\)$", r.output, re.M)
    assert hint.startswith("kvaudit replay ") and hint.endswith(f" --suppress {rules}"), hint
    again = invoke(*hint.split()[1:])
    assert again.exit_code == 1 and "recorded signature(s) reproduced: yes" in again.output, again.output


def test_a_plugins_shadow_finds_the_early_free_a_later_prefill_overwrites(tmp_path):
    """docs/writing-a-target.md's 'Reads: stale KV', run: an early free whose page the next prefill takes is
    stale-kv at the read (its signature names the free), with the shadow; without it, ownership alone sees
    the use-after-free only at a step a check runs, and a search's sparse schedule passes it unseen."""
    from kvaudit.audit.runner import AuditedRun
    from kvaudit.program import Step, Submit

    program = [Submit(family=0, prompt_len=3, max_new_tokens=3), Step(n=2),
               Submit(family=1, prompt_len=25, max_new_tokens=2), Step(n=6)]

    def search(preset):  # a search's schedule: a full check every 16 steps and at the end
        with AuditedRun(pagetoy_plugin.PRESETS[preset].config(bugs={"early-free"}), check_every=16) as run:
            return next((found for found in map(run.apply, program) if found), None) or run.finish()

    assert search("pagetoy-roots") == []
    assert search("pagetoy-tight")
    path = tmp_path / "early-free.json"
    replay.write_atomic(str(path), replay.to_doc(pagetoy_plugin.PRESETS["pagetoy-tight"].config(bugs={"early-free"}),
                                                 program, []))
    rules = tmp_path / "rules.toml"
    rules.write_text('[[suppress]]\nkind = "use-after-free"\nreason = "the read, not the roots"\n')
    r = invoke("replay", str(path), "--suppress", str(rules))
    assert r.exit_code == 1, r.output + r.stderr
    assert "signature: stale-kv/pages/freed:step@pagetoy_plugin.py" in r.output, r.output
    assert "req:r1 reads KV written for another token prefix" in r.output, r.output


class KvOfTheDefaultSize(ReadsUnwritten):
    def kv_pools(self):
        return {"rows": 48}  # (the default config's size, whatever this config's)


def test_kv_pools_is_checked_for_each_plugin_config_not_only_the_first(badtoy):
    """kv_pools() was checked once per target class: a second config whose pool outgrew it passed, and its
    first read past slot 47 raised IndexError in the shadow, reported as the engine's crash."""
    config = BadToyConfig(preset="reads-unwritten")
    make_target(config).close()  # (the class's reads checked, once)
    BAD["kv-of-the-default-size"] = (KvOfTheDefaultSize, "")
    try:
        make_target(BadToyConfig(preset="kv-of-the-default-size")).close()  # 48 slots for 48: right
        with pytest.raises(registry.TargetDefinitionError, match=re.escape(
                "target badtoy: KvOfTheDefaultSize.kv_pools() must return {declared pool: its size in token slots, "
                'an int >= (num_units + 1) * page_size}, got {"rows": 48}')):
            make_target(BadToyConfig(preset="kv-of-the-default-size", size=96))
    finally:
        del BAD["kv-of-the-default-size"]


def test_a_root_of_an_undeclared_pool_met_mid_run_is_not_an_engine_crash(badtoy, tmp_path):
    """The check at build sees no roots (a fresh engine holds none): the oracle meets it at the first
    step with a live request, and it is the target's error, not a crash finding."""
    from kvaudit.audit.runner import execute
    from kvaudit.program import Idle, Submit

    config = badtoy.preset("undeclared-root-pool").config()
    with pytest.raises(registry.TargetDefinitionError, match=re.escape(BAD["undeclared-root-pool"][1])):
        execute(config, [Submit(prompt_len=4, max_new_tokens=3), Idle()])
    r = invoke("fuzz", "--target", "badtoy", "--preset", "undeclared-root-pool", "--fuzzer", "random",
               "--max-time", "5", "--out", str(tmp_path))
    assert r.exit_code == 2, r.output + r.stderr
    last = r.stderr.strip().splitlines()[-1]  # after the run's first lines: it was met running
    assert last == f"kvaudit: error: target badtoy: {BAD['undeclared-root-pool'][1]} (rows)"
    assert "Traceback" not in r.output + r.stderr and "crash" not in r.output


class FloatRoots(rowtoy_plugin.RowToyTarget):
    def roots(self, aborting=True):
        return [Root("rows", f"req:{r.rid}", r.rows.astype(float)) for r in self.engine.running]


class ListUnitRoots(rowtoy_plugin.RowToyTarget):
    def roots(self, aborting=True):
        return [Root("rows", f"req:{r.rid}", [int(x) for x in r.rows]) for r in self.engine.running]


class PastThePoolRoots(rowtoy_plugin.RowToyTarget):
    def roots(self, aborting=True):
        return [Root("rows", f"req:{r.rid}", r.rows + 1000) for r in self.engine.running]


class StillSteps(rowtoy_plugin.RowToyTarget):
    def step(self):
        self.engine.step()  # as if the author never counted its steps


class PyListFreeLists(rowtoy_plugin.RowToyTarget):
    def free_lists(self):
        return {"rows": [int(x) for x in self.engine.pool.free_rows]}  # a list, not a numpy array


class MisspeltIdentity(rowtoy_plugin.RowToyTarget):
    def identity_terms(self, pool):
        return ("available", "refrenced")


class TupleFindings(rowtoy_plugin.RowToyTarget):
    def invariant_findings(self):
        return [("leak", "rows", r.rows, "x") for r in self.engine.running]


class UnknownKindFindings(rowtoy_plugin.RowToyTarget):
    def invariant_findings(self):
        return [TargetFinding("ref-mismatch", "rows", r.rows, "x") for r in self.engine.running]


class NoneLostBy(rowtoy_plugin.RowToyTarget):
    def invariant_findings(self):
        return [TargetFinding("leak", "rows", r.rows, "x", lost_by=None) for r in self.engine.running]


class ListProgress(rowtoy_plugin.RowToyTarget):
    def progress(self):
        return [r.out for r in self.engine.running]


class TextReach(rowtoy_plugin.RowToyTarget):
    def reach(self):
        return {"admitted": "some"}


class NoneIdle(rowtoy_plugin.RowToyTarget):
    def is_idle(self):
        super().is_idle()  # the author forgot the return


class LateAccounting(rowtoy_plugin.RowToyTarget):
    def accounting(self):
        got = super().accounting()
        return {p: (a.available, a.total) for p, a in got.items()} if self.steps else got


class LateEngineCheck(rowtoy_plugin.RowToyTarget):
    def engine_check(self):
        return None if self.steps else []


#: a plugin's read that goes wrong only once a request runs (the build's check reads the fresh engine) was an
#: "Engine crash: AttributeError ... crash/-/AttributeError@?" (exit 1, a replay file), or no error at all (a
#: hang of an idle engine; reach's text summed into "admitted=somesome...")
READS = {"free-lists-pylist": (PyListFreeLists, 'PyListFreeLists.free_lists() must return {declared pool: [n] '
                                                'integer numpy array}, got {"rows": ['),
         "identity-misspelt": (MisspeltIdentity, 'MisspeltIdentity.identity_terms("rows") must return a tuple of '
                                                 "available, evictable, protected, session_held, uncached, "
                                                 'referenced, got ["available", "refrenced"]'),
         "findings-tuples": (TupleFindings, "TupleFindings.invariant_findings() must return a list of TargetFinding "
                                            "of declared pools with integer units and a string lost_by, got [["),
         # (a lost_by of None went into the finding, and its replay file was refused on load)
         "findings-lost-by-none": (NoneLostBy, "NoneLostBy.invariant_findings() must return a list of TargetFinding "
                                               "of declared pools with integer units and a string lost_by, got [["),
         "findings-unknown-kind": (UnknownKindFindings, 'UnknownKindFindings.invariant_findings(): finding kind '
                                                        '"ref-mismatch" is not one of leak, '),
         "progress-list": (ListProgress, "ListProgress.progress() must return {request: int}, got ["),
         "reach-text": (TextReach, 'TextReach.reach() must return {name: int}, got {"admitted": "some"}'),
         "idle-none": (NoneIdle, "NoneIdle.is_idle() must return a bool, got null"),
         "accounting-late": (LateAccounting, 'LateAccounting.accounting() must return {declared pool: Accounting}, '
                                             'got {"rows": ['),
         "engine-check-late": (LateEngineCheck, "LateEngineCheck.engine_check() must return a list of strings, got "
                                                "null")}


MID_RUN = {**READS, "float-units": (FloatRoots, "FloatRoots.roots(): req:r1's units must be a [n] integer numpy array, got "
                                       "ndarray of float64"),
           "list-units": (ListUnitRoots, "ListUnitRoots.roots(): req:r1's units must be a [n] integer numpy array, "
                                         "got list"),
           "past-the-pool": (PastThePoolRoots, 'PastThePoolRoots.roots(): req:r1\'s units of pool "rows" must be in '
                                               "[1, 47] (unit 0 is reserved; 47 its num_units), got 1001 to"),
           # (it was silently 'detected after op #3 at scheduler step 0', owned/dropped at step 0 before 'alloc
           # ... step 1')
           "steps-not-counted": (StillSteps, "StillSteps.step() left self.steps at 0: a target's step() must add 1 "
                                             "to self.steps")}


@pytest.mark.parametrize("preset", list(MID_RUN))
def test_a_plugin_roots_mistake_met_mid_run_is_the_targets_error_not_an_engine_crash(preset, tmp_path):
    """The check at build reads the fresh engine's roots, an empty list: float, list and out-of-pool
    units met with the first live request were 'Engine crash: IndexError ...', exit 1, a replay file."""
    from kvaudit.audit.runner import execute
    from kvaudit.program import Idle, Submit

    kind = registry.register(registry.TargetKind(
        "midtoy", "rowtoy's engine behind roots that go wrong with a request", BadToyConfig,
        presets=lambda: {n: Preset(n, n, {}, BadToyConfig) for n in MID_RUN},
        make=lambda c: MID_RUN[c.preset][0](c), default_preset="float-units"))
    try:
        if preset != "reach-text":  # (a search reads reach(), a single run does not)
            with pytest.raises(registry.TargetDefinitionError, match=re.escape(MID_RUN[preset][1])):
                execute(kind.preset(preset).config(), [Submit(prompt_len=4, max_new_tokens=3), Idle()])
        r = invoke("fuzz", "--target", "midtoy", "--preset", preset, "--fuzzer", "random", "--max-time", "5",
                   "--out", str(tmp_path))
    finally:
        registry._KINDS.pop("midtoy")
    assert r.exit_code == 2, r.output + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"kvaudit: error: target midtoy: {MID_RUN[preset][1]}")
    assert "Engine crash" not in r.output and "crash/-/" not in r.output  # (an error may list the kind "crash")
    assert not any(n.endswith(".json") for n in os.listdir(tmp_path))


@dataclass(frozen=True)
class SubToyConfig(ToyConfig):
    target: str = "subtoy"


def test_a_kind_whose_config_subclasses_another_kinds_runs_itself():
    """kind_of took the first kind whose class the config is an instance of: --target subtoy ran toy's
    target (registered first) and the replay file still said subtoy."""
    toy = registry.register(registry.TargetKind("toy", "a toy", ToyConfig, presets=dict,
                                                make=lambda c: ToyTarget(n=c.n)))
    sub = registry.register(registry.TargetKind("subtoy", "a toy's subclass", SubToyConfig, presets=dict,
                                                make=lambda c: ToyTarget(n=c.n)))
    try:
        assert registry.kind_of(SubToyConfig()) is sub and registry.kind_of(ToyConfig()) is toy
        # the same class for two kinds: --target loud silently ran toy's target
        with pytest.raises(registry.TargetDefinitionError, match="^target loud: config_class ToyConfig is target "
                                                                 "toy's; a kind needs a config class of its own"):
            registry.register(registry.TargetKind("loud", "toy's config again", ToyConfig, presets=dict,
                                                  make=lambda c: ToyTarget(n=c.n)))
        assert "loud" not in registry._KINDS
    finally:
        registry._KINDS.pop("toy"), registry._KINDS.pop("subtoy")


def test_kind_of_sees_a_kind_registered_or_removed_after_its_map_was_built():
    """kind_of builds its map of config classes once (it was built on every call): a kind registered
    after a call, a nearer subclass's included, or removed, is seen at the next call."""
    toy = registry.register(registry.TargetKind("toy", "a toy", ToyConfig, presets=dict,
                                                make=lambda c: ToyTarget(n=c.n)))
    try:
        assert registry.kind_of(SubToyConfig()) is toy  # (no subtoy yet: the nearest registered class)
        sub = registry.register(registry.TargetKind("subtoy", "a toy's subclass", SubToyConfig, presets=dict,
                                                    make=lambda c: ToyTarget(n=c.n)))
        assert registry.kind_of(SubToyConfig()) is sub and registry.kind_of(ToyConfig()) is toy
        registry._KINDS.pop("subtoy")
        assert registry.kind_of(SubToyConfig()) is toy
        again = registry.register(registry.TargetKind("toy", "a reloaded toy", SubToyConfig, presets=dict,
                                                      make=lambda c: ToyTarget(n=c.n)))  # (as many kinds as before)
        assert registry.kind_of(SubToyConfig()) is again
        with pytest.raises(registry.UnknownTargetError, match="no registered target takes a ToyConfig"):
            registry.kind_of(ToyConfig())
    finally:
        registry._KINDS.pop("toy"), registry._KINDS.pop("subtoy", None)
    with pytest.raises(registry.UnknownTargetError, match="no registered target takes a SubToyConfig"):
        registry.kind_of(SubToyConfig())


def test_make_target_checks_every_kind_and_the_built_ins_pass():
    for name in ("eut", "vllm"):
        kind = registry.get(name)
        try:
            kind.probe(kind.preset("default").config())
        except registry.TargetUnavailable:
            continue
        make_target(kind.preset("default").config()).close()  # raises TargetDefinitionError if not
    with pytest.raises(registry.TargetDefinitionError, match="target rowtoy: make.config. returned a "
                                                              "SimpleNamespace, not a kvaudit.targets.base.Target"):
        from types import SimpleNamespace

        from kvaudit.targets.base import check_target
        check_target(SimpleNamespace(), "rowtoy")


@dataclass(frozen=True)
class NoPresetConfig(ConfigBase):
    n: int = 8
    bugs: frozenset = field(default_factory=frozenset)


class PlainConfig(ConfigBase):
    preset = "custom"
    bugs = frozenset()


@pytest.mark.parametrize("change, message", [
    # (a config class without a preset field registered, and 'kvaudit fuzz --target' exited 70: "internal error:
    # TypeError: NoPresetConfig.__init__() got an unexpected keyword argument 'preset'")
    ({"config_class": NoPresetConfig}, "target toy2: config_class NoPresetConfig must be a dataclass with the fields "
                                       "preset and bugs (docs/writing-a-target.md); it has no preset"),
    ({"config_class": PlainConfig}, "target toy2: config_class PlainConfig must be a dataclass with the fields "
                                    "preset and bugs (docs/writing-a-target.md); it is not a dataclass"),
    ({"name": "my target"}, "a target kind's name must be letters, digits, '-' or '_' (it is what --target takes), "
                            'got "my target"'),
    ({"summary": ""}, 'target toy2: summary must be one line of text, got ""'),
    ({"config_class": ToyConfig()}, "target toy2: config_class must be a class"),
    ({"make": "ToyTarget"}, 'target toy2: make must be callable, got "ToyTarget"'),
    ({"header": "kvaudit"}, 'target toy2: header must be None or callable, got "kvaudit"'),
])
def test_register_refuses_a_malformed_kind(change, message):
    kind = registry.TargetKind("toy2", "a toy", ToyConfig, presets=dict, make=ToyTarget)
    import dataclasses

    try:
        with pytest.raises(registry.TargetDefinitionError, match=re.escape(message)):
            registry.register(dataclasses.replace(kind, **change))
        assert "toy2" not in registry._KINDS
    finally:  # (a kind registered by mistake would fail every case after it)
        registry._KINDS.pop("toy2", None)


def test_a_built_in_kinds_pools_are_checked_once_per_shape_and_a_plugins_at_every_build(monkeypatch):
    """check_target read every pool's kind and API for every target built, in a bare run too: a
    built-in kind's pools are checked once per target class and pools' shape; a plugin's, whose pool
    objects may differ build by build, at every build."""
    from kvaudit.targets import base

    calls = []
    monkeypatch.setattr(base, "_checked", set())
    monkeypatch.setattr(base, "POOL_KINDS", _Counting(base.POOL_KINDS, calls))
    eut = registry.get("eut")
    for _ in range(3):
        make_target(eut.preset("default").config()).close()
    first = len(calls)
    assert first, "the first target's pools were not checked"
    make_target(eut.preset("default").config()).close()
    assert len(calls) == first, calls  # the same shape again: not checked again
    make_target(eut.preset("default").config(page_size=4)).close()  # another shape: checked
    assert len(calls) > first, calls
    calls.clear()
    rowtoy = registry.get("rowtoy")
    for _ in range(2):
        make_target(rowtoy.preset(rowtoy.default_preset).config()).close()
    assert len(calls) == 2 * (len(calls) // 2) > 0 and calls[:len(calls) // 2] == calls[len(calls) // 2:], calls


class _Counting(dict):
    """A dict that notes each key looked up (check_target's reads of POOL_KINDS)."""

    def __init__(self, d, calls):
        super().__init__(d)
        self.calls = calls

    def get(self, key, default=None):
        self.calls.append(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.calls.append(key)
        return super().__contains__(key)


# -- plugin modules written by a test: the imports every one uses, a config class, and KVAUDIT_PLUGINS -------

_PLUGIN_HEADER = ("from dataclasses import dataclass, field\n"
                  "import numpy as np\n"
                  "import rowtoy_plugin\n"
                  "from kvaudit.config import ConfigBase, Preset\n"
                  "from kvaudit.targets.registry import TargetKind, TargetUnavailable, register\n")


def _config_source(name: str, base: str = "ConfigBase", extra: str = "") -> str:
    """A plugin's frozen config class ``name`` with ``bugs`` and ``preset``, then ``extra`` (indented lines)."""
    return (f"@dataclass(frozen=True)\nclass {name}({base}):\n"
            "    bugs: frozenset = field(default_factory=frozenset)\n    preset: str = 'custom'\n" + extra)


def _use_plugin(tmp_path, monkeypatch, module: str, body: str) -> None:
    """``module`` (the header, then ``body``) written in ``tmp_path``, run from there, in KVAUDIT_PLUGINS."""
    (tmp_path / f"{module}.py").write_text(_PLUGIN_HEADER + body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVAUDIT_PLUGINS", module)


@pytest.mark.parametrize("taken", ["eut", "rowtoy"])
def test_a_plugin_cannot_take_another_modules_kind_name(taken, tmp_path, monkeypatch, fresh_registry):
    """A plugin registering the name "eut" silently replaced the built-in engine (its presets gone, the
    regression files no longer replaying); a second plugin's "toy" replaced the first's (tester t54)."""
    _use_plugin(tmp_path, monkeypatch, "name_thief", _config_source("ThiefConfig")
                + f"register(TargetKind({taken!r}, 'a thief', ThiefConfig, presets=dict, make=object))\n")
    r = invoke("presets", "--target", taken)
    assert r.exit_code == 2, r.output
    why = "a kind kvaudit has built in" if taken == "eut" else "module "
    assert (f'cannot load the target kind of "name_thief" named in KVAUDIT_PLUGINS: TargetDefinitionError: '
            f"target {taken}: the name is taken ({why}") in one_error_line(r)
    assert registry.get(taken).config_class.__name__ != "ThiefConfig"


def test_a_module_registering_its_kind_again_replaces_it(fresh_registry):
    """A reloaded plugin registers its kind again from the same module: allowed (the newer wins)."""
    first = registry.register(registry.TargetKind("toy3", "a toy", ToyConfig, presets=dict, make=ToyTarget))
    again = registry.register(registry.TargetKind("toy3", "a toy, again", ToyConfig, presets=dict, make=ToyTarget))
    assert registry.get("toy3") is again is not first


_TABLE_MISTAKES = {
    "presets-raise": ("presets=lambda: 1 / 0, default_preset='t1'",
                      "presets() raised ZeroDivisionError: division by zero"),
    "bugs-raise": ("presets=lambda: P, bugs=lambda: 1 / 0, default_preset='t1'", "bugs() raised ZeroDivisionError"),
    "bugs-list": ("presets=lambda: P, bugs=lambda: ['a'], default_preset='t1'",
                  'bugs() must return a mapping of name -> one-line description, got ["a"]'),
    "default-missing": ("presets=lambda: P, default_preset='nope'",
                        'default_preset "nope" is not one of its presets (t1)'),
    "other-class": ("presets=lambda: {'t1': Preset('t1', 'x', {}, config_class=Other)}, default_preset='t1'",
                    'preset "t1" must be a Preset of config_class TabConfig (or a subclass), got Other'),
}


@pytest.mark.parametrize("mistake", list(_TABLE_MISTAKES))
def test_a_plugin_kinds_tables_are_checked_when_it_registers(mistake, tmp_path, monkeypatch, fresh_registry):
    """presets() or bugs() raising was `internal error`, exit 70, in every command that lists kinds
    (`kvaudit presets` too); a default_preset not among the presets passed until --preset default (with
    a hint naming --target eut); a preset of another kind's config class wrote replay files that did not
    replay (tester t54, defect 4)."""
    fields, message = _TABLE_MISTAKES[mistake]
    module = f"tab_plugin_{mistake.replace('-', '_')}"  # (one per case: an imported module is not imported again)
    _use_plugin(tmp_path, monkeypatch, module, _config_source("TabConfig") + _config_source("Other")
                + "P = {'t1': Preset('t1', 'x', {}, config_class=TabConfig)}\n"
                + f"register(TargetKind('tab', 'a toy', TabConfig, make=object, {fields}))\n")
    r = invoke("presets")
    assert r.exit_code == 2, r.output
    line = one_error_line(r)
    assert line.startswith(f'kvaudit: error: cannot load the target kind of "{module}" named in KVAUDIT_PLUGINS: '
                           f"TargetDefinitionError: target tab: {message}"), line


@pytest.mark.parametrize("sizes, message", [
    ("page_size = 1\n    num_slots = 47\n",
     "must give context_len as a positive integer (a Python int, tokens; a field or a property), got nothing"),
    ("page_size = 1\n    num_slots = 47\n    context_len = 0\n", "must give context_len as a positive integer"),
    ("page_size = 1.0\n    num_slots = 47\n    context_len = 16\n",
     "must give page_size as a positive integer (a Python int, tokens; a field or a property), got 1.0"),
    # (a numpy int passed, then the finding's replay file could not be written: JSON cannot hold it; exit 70)
    ("page_size = 1\n    num_slots = 47\n    context_len = np.int64(16)\n", "must give context_len as a positive "
                                                                            "integer (a Python int"),
])
def test_a_plugin_config_without_the_sizes_the_generators_read_is_one_line(sizes, message, tmp_path, monkeypatch,
                                                                           fresh_registry):
    """A config without context_len ran the start-up, then `internal error: AttributeError: 'NoCL' object has
    no attribute 'context_len'`, exit 70 (tester t54, defect 4)."""
    module = f"size_plugin_{abs(hash(sizes))}"  # (one per case: an imported module is not imported again)
    _use_plugin(tmp_path, monkeypatch, module, _config_source("SizeConfig", extra=f"    size: int = 48\n    {sizes}")
                + "register(TargetKind('sizes', 'a toy', SizeConfig, make=rowtoy_plugin.RowToyTarget,\n"
                "                    default_preset='s',\n"
                "                    presets=lambda: {'s': Preset('s', 'x', {}, config_class=SizeConfig)}))\n")
    r = invoke("fuzz", "--target", "sizes", "--fuzzer", "random", "--max-time", "2", "--out", str(tmp_path / "o"))
    assert r.exit_code == 2, r.output
    assert f"kvaudit: error: target sizes: its config (SizeConfig) {message}" in one_error_line(r)


def test_a_hang_stays_a_hang_when_the_targets_describe_busy_raises(monkeypatch):
    """describe_busy() raising turned the hang into `Engine crash: RuntimeError` at describe_busy, its
    signature the target's code's (tester t54): the hang is the finding, the error is in its words."""
    from kvaudit.audit.runner import execute
    from kvaudit.program import Idle, Submit

    def boom(self):
        raise RuntimeError("busy boom")

    monkeypatch.setattr(rowtoy_plugin.RowToyTarget, "describe_busy", boom, raising=False)
    config = registry.get("rowtoy").preset("rowtoy").config(bugs={"stuck"})
    found = execute(config, [Submit(prompt_len=4, max_new_tokens=3), Idle()]).findings
    hang = next(f for f in found if f.kind == "hang")
    assert "(the target's describe_busy() raised RuntimeError: busy boom)" in hang.message, hang.message
    assert not [f for f in found if f.kind == "crash"], found


def test_a_built_in_kinds_name_is_refused_before_the_registry_has_loaded(fresh_registry):
    """A module registering "eut" before anything read the registry got in first: the built-in's own
    registration was then the one refused, escaping the registry's load, and the fake eut stayed (tester)."""
    fresh_registry._KINDS.pop("eut")
    with pytest.raises(registry.TargetDefinitionError, match="target eut: the name is taken .a kind kvaudit has "
                                                             "built in."):
        registry.register(registry.TargetKind("eut", "a fake", ToyConfig, presets=dict, make=ToyTarget))
    assert "eut" not in fresh_registry._KINDS


def test_a_plugins_tables_are_read_once_its_module_has_imported(tmp_path, monkeypatch, fresh_registry):
    """register() read presets() at once: a module registering before the table its presets() returns
    (defined further down) was refused with NameError; a presets() raising TargetUnavailable (its engine
    not installed) stopped every command, `kvaudit bugs --target eut` too; a kind with no presets was told
    that "default" is a preset of --target eut (tester)."""
    _use_plugin(tmp_path, monkeypatch, "lazy_tables", _config_source("LazyConfig")
                + _config_source("GoneConfig", base="LazyConfig") + _config_source("NoneConfig", base="LazyConfig") +
        "register(TargetKind('lazy', 'a toy', LazyConfig, make=object, presets=lambda: PRESETS, default_preset='l'))\n"
        "def gone():\n"
        "    raise TargetUnavailable('engine foo is not installed: pip install foo')\n"
        "register(TargetKind('gone', 'a toy', GoneConfig, make=object, presets=gone))\n"
        "register(TargetKind('none', 'a toy', NoneConfig, make=object, presets=dict))\n"
        "PRESETS = {'l': Preset('l', 'lazy', {}, config_class=LazyConfig)}\n")
    r = invoke("presets")
    assert r.exit_code == 0, r.output
    assert "lazy (--target lazy)" in r.stdout and "unavailable here: engine foo is not installed" in r.stdout, r.stdout
    assert invoke("bugs", "--target", "eut").exit_code == 0
    r = invoke("fuzz", "--target", "none", "--max-time", "1", "--out", str(tmp_path / "o"))
    assert r.exit_code == 2, r.output
    line = one_error_line(r)
    assert 'unknown preset "default" for --target none; --target none has no presets' in line and "--target eut" \
        not in line, line
    r = invoke("ci", "--target", "none", "--presets", "default", "--max-time", "1")  # (ci's --presets: the same)
    assert r.exit_code == 2, r.output
    line = one_error_line(r)
    assert '--presets: unknown preset "default"' in line and "--target eut" not in line, line
    # its engine not installed: fuzz and ci say so in one line (exit 69, what this host lacks, as its replay
    # files below), not an internal error (tester 60a); another kind's unknown preset still gets its one line
    # (exit 2: the hint skips the kind it cannot list)
    for args in (("fuzz", "--target", "gone", "--max-time", "1", "--out", str(tmp_path / "g")),
                 ("ci", "--target", "gone", "--max-time", "1"),
                 ("fuzz", "--preset", "nope", "--max-time", "1", "--out", str(tmp_path / "g"))):
        r = invoke(*args)
        assert r.exit_code == (69 if "gone" in args else 2), (args, r.output)
        line = one_error_line(r)
        assert ("engine foo is not installed: pip install foo" in line) == ("gone" in args), (args, line)
    # a replay file of its kind: one line, exit 69 (this host lacks the engine), and ci's JUnit error (tester 60c)
    gone = registry.get("gone")
    src = tmp_path / "regs" / "gone.json"
    src.parent.mkdir()
    replay.write_atomic(str(src), replay.to_doc(gone.config_class(), [], []))
    for args in (("replay", str(src)), ("report", str(src)), ("minimize", str(src), "-o", str(tmp_path / "m.json"))):
        r = invoke(*args)
        assert r.exit_code == 69 and "engine foo is not installed" in one_error_line(r), (args, r.output)
    r = invoke("ci", "--regressions", str(src.parent), "--max-time", "0", "--junit", str(tmp_path / "ci.xml"))
    assert r.exit_code == 1 and "engine foo is not installed" in (tmp_path / "ci.xml").read_text(), r.output


def test_an_entry_points_kind_has_its_tables_checked_too(monkeypatch, fresh_registry):
    """A kind from an installed ``kvaudit.targets`` entry point is registered from the registry's own
    module, which register() took for a built-in's: its presets() and bugs() went unchecked."""
    import importlib.metadata
    from types import SimpleNamespace

    kind = registry.TargetKind("epk", "a toy", ToyConfig, presets=lambda: 1 / 0, make=ToyTarget)
    ep = SimpleNamespace(name="epk", value="epk_pkg:kind", load=lambda: (lambda: kind))
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [ep] if group == registry.ENTRY_POINT_GROUP
                        else [])
    r = invoke("presets")
    assert r.exit_code == 0, r.output  # (an entry point that fails to load is a warning: the others still run)
    assert ('warning: cannot load entry point "epk" (epk_pkg:kind): TargetDefinitionError: target epk: presets() '
            "raised ZeroDivisionError") in r.stderr, r.stderr
    assert "epk" not in registry.kinds()


def test_a_plugin_module_another_plugin_imports_is_credited_with_its_kind(tmp_path, monkeypatch, fresh_registry):
    """KVAUDIT_PLUGINS=first,second where first imports second: second's kind was credited to first, so
    second was warned as a module that "registered no target kind" (tester)."""
    _use_plugin(tmp_path, monkeypatch, "second_plug", _config_source("SecondConfig")
                + "register(TargetKind('second', 'a toy', SecondConfig, make=object, default_preset='s',\n"
                "                    presets=lambda: {'s': Preset('s', 'x', {}, config_class=SecondConfig)}))\n")
    (tmp_path / "first_plug.py").write_text("import second_plug  # noqa: F401\n")
    monkeypatch.setenv("KVAUDIT_PLUGINS", "first_plug,second_plug")
    r = invoke("presets", "--target", "second")
    assert r.exit_code == 0, r.output
    assert 'module "second_plug" named in KVAUDIT_PLUGINS registered no target kind' not in r.stderr, r.stderr
    assert 'module "first_plug" named in KVAUDIT_PLUGINS registered no target kind' in r.stderr, r.stderr


def test_a_plugins_checked_reads_pass_what_the_oracles_take():
    """check_reads_always refuses wrong shapes only: a finding with no units or with a list of ints, numpy
    integers in progress() and reach(), a numpy bool from is_idle() all pass through unchanged."""
    from kvaudit.targets.base import check_reads_always

    class Lenient(rowtoy_plugin.RowToyTarget):
        def invariant_findings(self):
            return [TargetFinding("leak", "rows", [], "none"), TargetFinding("leak", "rows", [1, 2], "two")]

        def progress(self):
            return {"r1": np.int64(3)}

        def reach(self):
            return {"admitted": np.int64(2)}

        def is_idle(self):
            return np.bool_(True)

    target = Lenient(rowtoy_plugin.PRESETS["rowtoy"].config())
    check_reads_always(target, "lenient")
    assert [f.message for f in target.invariant_findings()] == ["none", "two"]
    assert target.progress() == {"r1": 3} and target.reach() == {"admitted": 2} and target.is_idle()


@pytest.mark.parametrize("said", [None, 3, "req:retried"])
def test_a_plugins_crash_by_must_return_a_string_or_its_crash_file_could_not_be_replayed(said):
    """A plugin's ``crash_by`` returning None (or any non-string) was recorded as the crash finding's ``check``
    (``"check": null``), and the file fuzz wrote was refused by replay (``bad findings: check: want a string,
    got null``, exit 2): check_reads_always checks it as it checks the other reads, naming the method."""
    from types import SimpleNamespace

    from kvaudit.audit.findings import Finding
    from kvaudit.audit.oracles.outcome import crash
    from kvaudit.targets.base import check_reads_always

    class Says(rowtoy_plugin.RowToyTarget):
        def crash_by(self, exc):
            return said

    target = Says(rowtoy_plugin.PRESETS["rowtoy"].config())
    check_reads_always(target, "says")
    try:
        raise KeyError("r9")
    except KeyError as e:
        exc = e
    run = SimpleNamespace(target=target, auditor=None, ops_run=1)
    if not isinstance(said, str):
        with pytest.raises(registry.TargetDefinitionError, match=re.escape(
                f"target says: Says.crash_by(KeyError('r9')) must return a string, got {json_value(said)}")):
            crash(run, exc)
        return
    [f] = crash(run, exc)
    assert f.signature.endswith("/req:retried") and Finding.from_dict(f.to_dict()).signature == f.signature


@dataclass(frozen=True)
class RowMapToyConfig(EutConfig):
    target: str = "rowmaptoy"


def _row_map_toy(mistake: str | None):
    """The built-in engine's target as a plugin's, one of its row maps gone wrong (``mistake``)."""
    from kvaudit.targets.eut.target import EutTarget

    class UnitsNotByPool(EutTarget):
        def units_of_rows(self, rows, lengths=None):
            return super().units_of_rows(rows, lengths)["token_to_kv_pool"]  # the units, not {pool: units}

    class TenantsPastThePool(EutTarget):
        def units_of_tenants(self, rows):
            got = super().units_of_tenants(rows)
            return None if got is None else {p: u + 10_000 for p, u in got.items()}

    return {"units_of_rows": UnitsNotByPool, "units_of_tenants": TenantsPastThePool, None: EutTarget}[mistake]


@pytest.mark.parametrize("method", ["units_of_rows", "units_of_tenants"])
def test_a_plugins_units_of_rows_or_tenants_of_the_wrong_shape_is_the_targets_one_line_not_an_engine_crash(method):
    """A plugin's ``units_of_rows`` returning the units (not ``{pool: units}``) was 'Engine crash: ValueError: The
    truth value of an array ... crash/-/ValueError@?' (exit 1, a replay file), from inside the leak oracle; units
    past the pool's would index its ledger out of range. check_reads_always checks both reads, naming the method."""
    from kvaudit.audit.runner import execute
    from kvaudit.targets.base import check_reads_always

    path = os.path.join(HERE, "..", "corpora", "regressions", "prefill-finish-leaks-row.json")
    config, program, recorded, _ = replay.load(path)
    cls = _row_map_toy(method)
    registry.register(registry.TargetKind(
        "rowmaptoy", "the built-in engine behind a plugin whose row map goes wrong", RowMapToyConfig,
        presets=lambda: {"leaky": Preset("leaky", "the row leak", {}, RowMapToyConfig)}, make=cls,
        default_preset="leaky"))
    try:
        toy = RowMapToyConfig(**{k: v for k, v in config.to_dict().items() if k != "target"})
        with pytest.raises(registry.TargetDefinitionError, match=re.escape(f"target rowmaptoy: {cls.__name__}.{method}(")
                           + ".*" + re.escape("must return None or {declared pool: [n] integer numpy array of units in "
                                              "[0, num_units]}, got ")) as e:
            execute(toy, program, full_stacks=False)
        assert "\n" not in str(e.value), str(e.value)  # (one line: a numpy array's repr wraps)
    finally:
        registry._KINDS.pop("rowmaptoy")
    assert recorded[0].kind == "leak"  # (the program leaks a row: the leak oracle reads the row map)
    target = _row_map_toy(None)(config)  # what the built-in target returns passes: 0 (a row's empty entry) included
    try:
        check_reads_always(target, "eut-as-plugin")
        assert target.units_of_rows(np.zeros(0, dtype=np.int64))["token_to_kv_pool"].size == 0
        assert 0 in target.units_of_rows(np.array([1]))["token_to_kv_pool"]
    finally:
        target.close()


def test_a_long_signature_s_replay_file_has_a_name_the_file_system_takes(tmp_path):
    """A plugin's crash_by of 300 characters made a signature whose file name the file system refused: fuzz
    found the crash and ended 'cannot write .../crash_-_..._yyyy...json: File name too long' (exit 2), the
    finding lost. A name past replay.MAX_STEM is cut, with a hash of the signature; short names are as before."""
    config = rowtoy_plugin.PRESETS["rowtoy"].config()
    short = "crash/-/KeyError@free@engine.py"
    assert replay.file_name(short) == "crash_-_KeyError_free_engine.py.json"
    names = set()
    for tail in ("y" * 300, "y" * 299 + "z"):
        sig = f"{short}/{tail}"
        path, has_it = replay.home(str(tmp_path), sig, "rowtoy")
        replay.write_atomic(path, replay.to_doc(config, [], []))  # (OSError: File name too long, before)
        assert not has_it and len(os.path.basename(path)) <= 200
        names.add(os.path.basename(path))
    assert len(names) == 2  # (two signatures that differ past the cut: two names)


class _Unbuildable(rowtoy_plugin.RowToyTarget):
    built = 0

    def __init__(self, config):
        type(self).built += 1
        if config.preset == "always" or type(self).built > 3:
            raise RuntimeError("no device left")  # (the target's own code, as a constructor that opens one)
        super().__init__(config)


@pytest.mark.parametrize("preset", ["always", "later"])
def test_a_plugin_target_whose_constructor_raises_is_one_line_exit_2_its_traceback_behind_kvaudit_debug(
        preset, tmp_path):
    """A constructor that raised at the first build was one line (require_target); one that raised at a later
    build, as the search builds a target per program, was 'kvaudit: internal error: RuntimeError: no device
    left', exit 70, blaming kvaudit. Both are the target's line, exit 2, and KVAUDIT_DEBUG=1 (which showed
    nothing more) prints the constructor's traceback above it."""
    _Unbuildable.built = 0
    kind = registry.register(registry.TargetKind(
        "unbuildable", "rowtoy's engine behind a constructor that fails", BadToyConfig,
        presets=lambda: {n: Preset(n, n, {}, BadToyConfig) for n in ("always", "later")},
        make=_Unbuildable, default_preset="always"))
    try:
        runs = []
        for env in ({}, {"KVAUDIT_DEBUG": "1"}):
            _Unbuildable.built = 0
            runs.append(invoke("fuzz", "--target", "unbuildable", "--preset", preset, "--fuzzer", "random",
                               "--max-time", "3", "--out", str(tmp_path), env=env))
    finally:
        registry._KINDS.pop("unbuildable")
    line = ("kvaudit: error: target unbuildable: building its target failed: RuntimeError: no device left "
            "(KVAUDIT_DEBUG=1 shows its traceback)")
    for r in runs:
        assert r.exit_code == 2, r.output + r.stderr
        assert r.stderr.strip().splitlines()[-1] == line
    assert "Traceback" not in runs[0].stderr
    assert "Traceback" in runs[1].stderr and "in __init__" in runs[1].stderr and "no device left" in runs[1].stderr


@dataclass(frozen=True)
class LabelToyConfig(BadToyConfig):
    """rowtoy's engine under a target whose ``preset`` (crash_by, lost_by or freed_by) raises."""

    preset: str = "crash_by"


class _LabelRaises(rowtoy_plugin.RowToyTarget):
    """crash_by: its engine raises at step 2; lost_by: a row allocated at step 2 no owner ever holds;
    freed_by: a root still names a finished request's rows (a use-after-free)."""

    def __init__(self, config):
        super().__init__(config)
        self.done = []
        release = self.engine.release

        def kept(r):
            self.done.append(r.rows.copy())
            release(r)
        self.engine.release = kept

    def step(self):
        super().step()
        if self.steps == 2 and self.config.preset == "crash_by":
            raise KeyError("r9")
        if self.steps == 2 and self.config.preset == "lost_by":
            self.engine.pool.alloc(1)

    def roots(self, aborting=True):
        ghost = self.done[:1] if self.config.preset == "freed_by" else []
        return super().roots() + [Root("rows", "req:ghost", rows) for rows in ghost]

    def _bug(self, method: str):
        if self.config.preset == method:
            raise RuntimeError(f"{method}'s own bug")
        return getattr(super(), method)

    def crash_by(self, exc):
        return self._bug("crash_by")(exc)

    def lost_by(self, pool, units):
        return self._bug("lost_by")(pool, units)

    def freed_by(self, pool, units, frees):
        return self._bug("freed_by")(pool, units, frees)


@pytest.mark.parametrize("method", ["crash_by", "lost_by", "freed_by"])
def test_a_plugins_crash_by_lost_by_or_freed_by_that_raises_is_the_targets_one_line_exit_2(method, tmp_path):
    """A plugin's crash_by or freed_by that raised ended the run as 'kvaudit: internal error: RuntimeError: ...',
    exit 70, blaming kvaudit; a lost_by that raised was reported as the engine's crash at the target's own line
    (crash/-/RuntimeError@lost_by@...), exit 1. Each is the target's own mistake: one line naming the kind and
    the method, exit 2 (docs/writing-a-target.md), its traceback behind KVAUDIT_DEBUG=1."""
    from kvaudit.audit.runner import execute
    from kvaudit.program import Idle, Step, Submit

    kind = registry.register(registry.TargetKind(
        "labelraises", "rowtoy's engine behind a target whose crash_by, lost_by or freed_by raises", LabelToyConfig,
        presets=lambda: {n: Preset(n, n, {}, LabelToyConfig) for n in ("crash_by", "lost_by", "freed_by")},
        make=_LabelRaises, default_preset="crash_by"))
    try:
        program = [Submit(prompt_len=4, max_new_tokens=2), Step(n=3), Idle()]
        message = (f"target labelraises: _LabelRaises.{method} raised RuntimeError: {method}'s own bug "
                   "(KVAUDIT_DEBUG=1 shows its traceback)")
        with pytest.raises(registry.TargetDefinitionError, match=re.escape(message)):
            execute(kind.preset(method).config(), program)
        runs = [invoke("fuzz", "--target", "labelraises", "--preset", method, "--fuzzer", "random", "--max-time", "3",
                       "--seed", "1", "--out", str(tmp_path), env=env) for env in ({}, {"KVAUDIT_DEBUG": "1"})]
    finally:
        registry._KINDS.pop("labelraises")
    for r in runs:
        assert r.exit_code == 2, r.output + r.stderr
        assert r.stderr.strip().splitlines()[-1] == f"kvaudit: error: {message}"
    assert "Traceback" not in runs[0].stderr and f"in {method}" in runs[1].stderr


class _LabelNotText(_LabelRaises):
    """lost_by and freed_by that return a number per unit, not a string."""

    def _bug(self, method: str):
        if self.config.preset == method:
            return lambda pool, units, *rest: [5] * len(units)
        return getattr(super(rowtoy_plugin.RowToyTarget, self), method)


@pytest.mark.parametrize("method", ["lost_by", "freed_by"])
def test_a_plugins_lost_by_or_freed_by_that_returns_no_strings_is_the_targets_one_line_exit_2(method, tmp_path):
    """lost_by and freed_by name a part of the signature, one string per unit: a plugin's that returned [5]
    ended the run as 'kvaudit: internal error: TypeError: sequence item 1: expected str instance, int found'
    (exit 70, blaming kvaudit). Their value is checked at every call, as crash_by's: the target's one line, exit 2."""
    from kvaudit.audit.runner import execute
    from kvaudit.program import Idle, Step, Submit

    kind = registry.register(registry.TargetKind(
        "labelnottext", "rowtoy's engine behind a target whose lost_by or freed_by returns numbers", LabelToyConfig,
        presets=lambda: {n: Preset(n, n, {}, LabelToyConfig) for n in ("lost_by", "freed_by")},
        make=_LabelNotText, default_preset="lost_by"))
    try:
        program = [Submit(prompt_len=4, max_new_tokens=2), Step(n=3), Idle()]
        with pytest.raises(registry.TargetDefinitionError, match=re.escape(f"_LabelNotText.{method}(") + ".*"
                           + re.escape("must return None or a list of strings (one per unit), got [5")):
            execute(kind.preset(method).config(), program)
        r = invoke("fuzz", "--target", "labelnottext", "--preset", method, "--fuzzer", "random", "--max-time", "3",
                   "--seed", "1", "--out", str(tmp_path))
    finally:
        registry._KINDS.pop("labelnottext")
    assert r.exit_code == 2, r.output + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"kvaudit: error: target labelnottext: _LabelNotText.{method}(")


class _LaterLabelsRaise(_LabelRaises):
    def freed_under_reader(self, pool, units, frees):
        return self._bug("freed_under_reader")(pool, units, frees)

    def dropped_by(self, rid):
        return self._bug("dropped_by")(rid)


@pytest.mark.parametrize("method, args", [("freed_under_reader", ("rows", np.array([1]), np.array([2]))),
                                          ("dropped_by", ("r1",))])
def test_every_method_that_only_labels_a_finding_is_the_targets_one_line_when_it_raises(method, args):
    """freed_under_reader and dropped_by came after LABELS (crash_by, lost_by, freed_by): a plugin's that raised
    was reported as the engine's crash or kvaudit's internal error. Each is wrapped as the others are."""
    from kvaudit.targets.base import check_reads_always

    target = _LaterLabelsRaise(LabelToyConfig(preset=method))
    check_reads_always(target, "labelraises")
    with pytest.raises(registry.TargetDefinitionError,
                       match=re.escape(f"target labelraises: _LaterLabelsRaise.{method} raised RuntimeError")):
        getattr(target, method)(*args)


class _WrongWhenShort(rowtoy_plugin.RowToyTarget):
    def is_idle(self):  # a mistake only a program with one submit meets: one a minimization tries
        idle = super().is_idle()
        return None if self.n < 2 and self.steps else idle


def test_a_target_mistake_met_while_minimizing_is_the_targets_error_not_a_program_that_does_not_reproduce(tmp_path):
    """minimize and fuzz's triage took every ValueError from the minimizer as "does not reproduce"
    (minimize exited 4; fuzz passed the finding over as flaky), a TargetDefinitionError (a ValueError)
    included: the mistake a smaller program met is the target's one line, exit 2."""
    from kvaudit.audit.runner import execute
    from kvaudit.program import Abort, Idle, Step, Submit
    from kvaudit.search.fuzz import triage

    kind = registry.register(registry.TargetKind(
        "shortwrong", "rowtoy's engine whose is_idle() goes wrong on a program with one submit", BadToyConfig,
        presets=lambda: {"leaky": Preset("leaky", "abort leaks", {"bugs": {"abort-leak"}}, BadToyConfig)},
        make=_WrongWhenShort, bugs=lambda: {"abort-leak": "abort leaks"}, default_preset="leaky"))
    try:
        config = kind.preset("leaky").config()
        program = [Submit(prompt_len=4, max_new_tokens=8), Submit(prompt_len=4, max_new_tokens=8), Step(n=1),
                   Abort(handle=0), Idle()]
        found = execute(config, program).findings
        assert [f.kind for f in found][:1] == ["leak"]
        with pytest.raises(registry.TargetDefinitionError, match=r"_WrongWhenShort\.is_idle\(\) must return a bool"):
            triage(config, program, found[0])
        path = tmp_path / "leak.json"
        path.write_text(replay.doc_text(replay.to_doc(config, program, found)))
        r = invoke("minimize", str(path), "-o", str(tmp_path / "small.json"))
    finally:
        registry._KINDS.pop("shortwrong")
    assert r.exit_code == 2, r.output + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "kvaudit: error: target shortwrong: _WrongWhenShort.is_idle() must return a bool, got null")

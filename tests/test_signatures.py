"""Signatures that separate root causes (issue 34, :mod:`kvaudit.audit.findings`).

A signature is a promise that two findings are one bug. Faults planted here, outside the bug zoo, in
the built-in engine's retraction, PD transfer-failure, finish and HiCache load-back paths took a zoo
bug's signature (every leak's lost release read ``release_kv_cache@scheduler.py``, a lock leak was
named by its inc alone) and every hang was ``hang/-/idle``: a campaign that knew the zoo would have
taken them as known. Each must now have a signature no zoo bug has and no other planted fault has,
and the zoo's own signatures must not split across the programs that trigger them.

A fault is planted by editing one method's source text and compiling it under the method's own file
name (:func:`plant`), so that its frames name the engine's functions as a fault in the engine would.
"""

from __future__ import annotations

import __future__
import copy
import dataclasses
import glob
import inspect
import json
import os
import random
import sys
import textwrap

import types

import numpy as np
import pytest
import torch

from engine_under_test.hicache import HiRadixCache
from engine_under_test.memory import TokenToKVPoolAllocator
from engine_under_test.radix_cache import RadixCache
from engine_under_test.scheduler import Scheduler
from kvaudit import replay
from kvaudit.audit.findings import Finding, Site
from kvaudit.audit.ledger import Event
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import (Abort, CloseSession, FlushCache, HealthCheck, Idle, MemoryPressure, OpenSession,
                             PauseGeneration, Step, Submit, TransferFail, random_program)
from kvaudit.targets import program_features
from kvaudit.targets.eut.evictions import Evictions
from kvaudit.targets.eut.observer import EutObserver
from kvaudit.targets.eut.presets import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO_FILES = sorted(glob.glob(os.path.join(ROOT, "corpora", "regressions", "*.json")))
LOAD_BACK = [Submit(0, 40, 2), Idle(), MemoryPressure(), Step(1), Submit(0, 44, 2), Idle()]  # the prefix comes back
# a zoo bug's symptom no regression file holds: the load-back's leaked lock keeps a later request out for good
ZOO_HANG = ("hicache-abort-loadback-leak",
            [Submit(0, 40, 2), Idle(), MemoryPressure(), Step(1), Submit(0, 44, 2), Abort(None), Submit(1, 100, 2), Idle()])


def plant(monkeypatch, cls, method: str, old: str, new: str) -> None:
    """For this test, ``cls.method`` with ``old`` (its exact text, once) replaced by ``new``: compiled
    under the method's own file name, at its own first line."""
    fn = getattr(cls, method)
    lines, first = inspect.getsourcelines(fn)
    src = "".join(lines)
    assert src.count(old) == 1, f"{method}: the text to replace is not there exactly once"
    code = compile("\n" * (first - 1) + textwrap.dedent(src.replace(old, new)), fn.__code__.co_filename, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    scope = dict(sys.modules[fn.__module__].__dict__)
    exec(code, scope)
    monkeypatch.setattr(cls, method, scope[method])


# name -> (preset, (class, method, old text, new text), program, the zoo bug whose signature it took before)
FAULTS = {
    # the retraction path forgets HiSparse's retract_req: device buffer and host slots leak, lost in
    # release_kv_cache like hisparse-prebuilt-skip-finish's (which forgets request_finished in the prebuilt step)
    "retract-skips-hisparse": (
        "pd-decode-hisparse",
        (Scheduler, "release_req", "            self.hisparse_coordinator.retract_req(req)\n", "            pass\n"),
        [Submit(0, 1, 3, stop_at=6), Step(2), PauseGeneration(mode=2), Step(1)], "hisparse-prebuilt-skip-finish"),
    # a failed transfer is released without request_finished: its host slots leak
    "transfer-fail-skips-hisparse": (
        "pd-decode-hisparse",
        (Scheduler, "poll_transfer_failures", "            self._release_finished(req, checkpoint=False)\n",
         "            self.release_kv_cache(req, checkpoint=False)\n            self._emit(req)\n"),
        [Submit(0, 8, 4), Step(1), TransferFail(None), Idle()], "hisparse-prebuilt-skip-finish"),
    # the finish path floors the free range to a page, as retract-unaligned-page's retraction does
    "finish-floors-last-page": (
        "retract",
        (Scheduler, "process_batch_result",
         "                    self._release_finished(req, checkpoint=self._caches_on_release(req))\n",
         "                    req.kv.kv_allocated_len = req.kv.kv_allocated_len // self.page_size * self.page_size\n"
         "                    self._release_finished(req, checkpoint=False)\n"),
        [Submit(0, 6, 2), Idle()], "retract-unaligned-page"),
    # a load-back acked on completion drops its device lock but keeps its host pin; the zoo's abort
    # drops the whole record
    "load-back-done-keeps-host-pin": (
        "hicache",
        (Scheduler, "get_new_batch_prefill", "                tree.release_load_back(req.load_back)\n",
         "                req.load_back.released = True\n                tree.dec_lock_ref(req.load_back.node)\n"
         "                del tree.ongoing_load_back[req.load_back.node.id]\n"),
        LOAD_BACK, "hicache-abort-loadback-leak"),
    # hangs: a load-back that never completes, a PD pre-allocation that never fits (its reserve counted
    # in pool sizes); and a transfer that never lands, which the liveness oracle reports first
    "load-back-never-ready": (
        "hicache", (HiRadixCache, "load_back_ready", "        return self.now >= rec.ready_step\n",
                    "        return False\n"),
        LOAD_BACK, "hicache-abort-loadback-leak"),
    "prealloc-never-fits": (
        "pd-decode",
        (Scheduler, "process_decode_queue", "+ 2 * self.page_size\n", "+ 2 * alloc.size\n"),
        [Submit(0, 8, 4), Idle()], "hicache-abort-loadback-leak"),
    "transfer-never-done": (
        "pd-decode",
        (Scheduler, "process_decode_queue",
         "(0 if fake else self.config.transfer_latency_steps)", "(0 if fake else 10**9)"),
        [Submit(0, 8, 4), Idle()], None),
}


def legacy(f: Finding) -> str:
    """``f``'s signature as kvaudit named it before issue 34: a lost release by its innermost frame
    (``release_kv_cache``), a lock leak by its inc alone, a hang ``hang/-/idle``, a liveness finding
    ``liveness/-/progress``."""
    g = copy.deepcopy(f)
    for key in ("alloc_sites", "free_sites", "prev_free_sites", "read_sites", "lost_sites"):
        setattr(g, key, [dataclasses.replace(s, entry=False, request_kv=False) for s in getattr(g, key)])
    g.holder = ""
    if g.kind == "lock-imbalance":
        g.lost_sites = []
    if g.kind in ("hang", "liveness"):
        g.check = ""
    return g.signature


def run_fault(name: str, full_stacks: bool = True) -> list[Finding]:
    preset, edit, program, _ = FAULTS[name]
    with pytest.MonkeyPatch.context() as mp:
        plant(mp, *edit)
        return execute(get_preset(preset).config(), program, full_stacks=full_stacks).findings


@pytest.fixture(scope="module")
def zoo() -> dict[str, list[Finding]]:
    """Each zoo bug's findings: its regression file replayed, and the hang one of them leads to."""
    out = {}
    for path in ZOO_FILES:
        config, program, _, _ = replay.load(path)
        out[os.path.basename(path)[: -len(".json")]] = execute(config, program).findings
    out[ZOO_HANG[0]] = out[ZOO_HANG[0]] + zoo_hang()
    return out


def zoo_hang() -> list[Finding]:
    """ZOO_HANG's findings as a target that finds a leaked lock only at idle sees them: the eut names every
    lock holder, so it reports the load-back's lock at the abort's step and the run stops before the hang."""
    name, program = ZOO_HANG
    config, _, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", f"{name}.json"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EutObserver, "lock_holders_exact", False)
        return execute(config, program).findings


@pytest.fixture(scope="module")
def planted() -> dict[str, list[Finding]]:
    return {name: run_fault(name) for name in FAULTS}


def test_each_planted_fault_is_found(planted):
    assert all(planted.values()), [n for n, fs in planted.items() if not fs]


@pytest.mark.parametrize("name", [n for n, f in FAULTS.items() if f[3]])
def test_a_planted_fault_took_a_zoo_bugs_signature_before(name, planted, zoo):
    """The reason for the scheme: without the release path, the holder's release and what is stuck,
    the planted fault reads as the zoo bug."""
    bug = FAULTS[name][3]
    assert {legacy(f) for f in planted[name]} & {legacy(f) for f in zoo[bug]}, (name, bug)


@pytest.mark.parametrize("name", FAULTS)
def test_a_planted_fault_has_a_signature_no_zoo_bug_has(name, planted, zoo):
    mine = {f.signature for f in planted[name]}
    taken = {f.signature: bug for bug, fs in zoo.items() for f in fs}
    assert not mine & set(taken), {s: taken[s] for s in mine & set(taken)}


def test_no_two_planted_faults_share_a_signature(planted):
    owner: dict[str, str] = {}
    for name, fs in planted.items():
        for sig in {f.signature for f in fs}:
            assert owner.setdefault(sig, name) == name, f"{sig}: {owner[sig]} and {name}"


def test_the_planted_faults_read_as_their_causes(planted):
    """What each signature now names: the release path that forgot the units, the release that let a
    load-back go with its host pin, and what each hang or stalled request waits for."""
    sigs = {name: sorted({f.signature for f in fs}) for name, fs in planted.items()}
    assert all(s.endswith("/release_req@scheduler_decode_mixin.py") for s in sigs["retract-skips-hisparse"])
    assert sigs["transfer-fail-skips-hisparse"] == [
        "leak/hisparse_host/alloc_host@hisparse.py/poll_transfer_failures@scheduler_disagg_decode_mixin.py"]
    assert sigs["finish-floors-last-page"] == ["leak/token_to_kv_pool/request-kv/process_batch_result@scheduler.py"]
    assert sigs["load-back-done-keeps-host-pin"] == [
        "lock-imbalance/hicache_host/inc:load_back@hicache.py/get_new_batch_prefill@scheduler_prefill_mixin.py"]
    assert sigs["load-back-never-ready"] == ["hang/-/idle/hicache:load-back"]
    assert sigs["prealloc-never-fits"] == ["hang/-/idle/prealloc:memory"]
    assert sigs["transfer-never-done"] == ["liveness/-/progress/transfer:holds-kv"]


def test_a_load_back_that_never_completes_is_one_hang_whether_its_request_waits_or_was_aborted(monkeypatch):
    """What is stuck is the load-back, not the queue its request happens to be in (its request still
    waiting for it, or aborted and the load-back orphaned until an ack that never comes)."""
    plant(monkeypatch, *FAULTS["load-back-never-ready"][1])
    orphaned = [Submit(7, 1, 1), Idle(), MemoryPressure(), Submit(7, 3, 1), Abort(0), Idle()]
    assert {s for p in (LOAD_BACK, orphaned) for s in execute(get_preset("hicache").config(), p).signatures} == \
        {"hang/-/idle/hicache:load-back"}


def test_the_zoo_hang_names_the_memory_its_leaked_lock_holds(zoo):
    assert "hang/-/idle/waiting:memory-locked" in {f.signature for f in zoo["hicache-abort-loadback-leak"]}


def test_a_hang_on_locked_memory_comes_with_the_lock_that_holds_it(monkeypatch):
    """Two leaked locks, one symptom: a request waits for memory tree locks hold. Before, both were
    ``hang/-/idle``; the hang now comes with the lock-imbalance that names its cause, the zoo's load-back
    or an admission rollback that released the matched node's parent (the radix-lock path)."""
    plant(monkeypatch, Scheduler, "get_new_batch_prefill", "                    tree.dec_lock_ref(match.last_node)\n",
          "                    tree.dec_lock_ref(match.last_node.parent or match.last_node)\n")
    program = [Submit(1, 46, 1), Submit(0, 39, 1), Submit(0, 7, 6, extends=7), Submit(0, 9, 12, extends=6),
               Submit(0, 85, 1), Idle()]
    found = execute(get_preset("retract").config(), program).findings
    assert [f.signature for f in found] == [
        "lock-imbalance/token_to_kv_pool/inc:get_new_batch_prefill@scheduler_prefill_mixin.py",
        "hang/-/idle/waiting:memory-locked"]
    assert [f.signature for f in zoo_hang()] == [
        "lock-imbalance/token_to_kv_pool/inc:load_back@hicache.py", "lock-imbalance/hicache_host/inc:load_back@hicache.py",
        "hang/-/idle/waiting:memory-locked"]
    name, program = ZOO_HANG  # with every holder named, the lock at its step, before the hang it leads to
    config, _, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", f"{name}.json"))
    assert sorted(execute(config, program).signatures) == [
        "lock-imbalance/hicache_host/inc:load_back@hicache.py", "lock-imbalance/token_to_kv_pool/inc:load_back@hicache.py"]


@pytest.mark.parametrize("name", ["retract-skips-hisparse", "load-back-done-keeps-host-pin"])
def test_the_fuzzers_fast_stacks_name_the_same_release_path(name):
    """The fuzzers record only a site's innermost frame, and the path's frame when that is a release
    entry: the signatures agree with a full-stack run (minimization compares them)."""
    assert sorted(f.signature for f in run_fault(name, full_stacks=False)) == \
        sorted(f.signature for f in run_fault(name))


def _no_new_split(zoo_findings: list[Finding], found: list[Finding]) -> list[str]:
    """The findings of ``found`` that the old scheme took for the zoo bug but the new one names
    otherwise (one cause split in two): ``[]`` when none."""
    known = {legacy(f): f.signature for f in zoo_findings}
    return [f"{f.signature} (was {legacy(f)}, the zoo's {known[legacy(f)]})" for f in found
            if legacy(f) in known and f.signature != known[legacy(f)]]


@pytest.mark.parametrize("path", ZOO_FILES, ids=[os.path.basename(p)[:-5] for p in ZOO_FILES])
def test_a_zoo_bug_keeps_its_signatures_in_other_programs_that_trigger_it(path, zoo):
    """Its regression program with a step slipped in before each op, and after an unrelated request:
    wherever the old scheme saw the zoo bug, the new one names it as the regression file does."""
    config, program, _, _ = replay.load(path)
    mine = zoo[os.path.basename(path)[: -len(".json")]]
    variants = [program[:i] + [Step(1)] + program[i:] for i in range(1, len(program))]
    variants.append([Submit(3, 5, 1), Step(1)] + list(program))
    split = [s for v in variants for s in _no_new_split(mine, execute(config, v).findings)]
    assert not split, split


# programs `kvaudit fuzz --bug BUG` found for zoo bugs where a leak's lost release was first blamed on
# another request's release in the same step (a freed row's stale entry, a unit handed on and freed again)
FOUND = {
    "hisparse-prebuilt-skip-finish": [
        [Submit(0, 9, 1, stop_at=10), Step(1), PauseGeneration(mode=0), Submit(0, 1, 1), Submit(0, 1, 2),
         FlushCache(timeout=0), Idle()]],
    "pd-abort-after-transfer-leak": [
        [Submit(0, 1, 1, stop_at=2), Submit(0, 1, 1), Submit(0, 1, 1, extends=2), Step(5), FlushCache(timeout=0),
         HealthCheck(), Submit(0, 1, 6), Submit(0, 1, 1), Step(3), Abort(None), Step(1)],
        [Submit(0, 1, 5), Idle(), FlushCache(timeout=0), Submit(0, 1, 4), Submit(0, 6, 3), Step(2),
         PauseGeneration(mode=0), Step(1)]],
}


# and (`kvaudit fuzz --bug radix-lock-skips-matched-node --seed 1`) where a node evicted under its reader was
# handed to another request and freed again by its release in the same step: the use-after-free of those
# slots was named by that release, release_kv_cache, beside the eviction's release@radix_cache.py
FOUND["radix-lock-skips-matched-node"] = [[Submit(1, 71, 2), Submit(0, 87, 1), Idle()]]
# ts65's splits, fixed (ta66). pd-abort: a stale entry of the leaked PD row (an earlier tenant's slots, handed
# to a decoding request since) freed by that request's finish: the lost release read process_batch_result, not
# from:waiting; a unit another row freed by the same release maps is that row's (leaks._by_row).
FOUND["pd-abort-after-transfer-leak"].append(
    [Submit(0, 1, 1), Submit(0, 4, 1), Idle(), FlushCache(timeout=0), Submit(0, 1, 3), Submit(0, 1, 1), Step(2),
     Abort(None), Step(1)])
# radix-lock: the reader was admitted after the previous check, in the step whose allocation evicted its node
# and whose finish freed the page again: the use-after-free named that release beside release@radix_cache.py;
# the eviction of a node a lock receipt covered is a free under its reader (Target.freed_under_reader).
FOUND["radix-lock-skips-matched-node"].append([Submit(0, 45, 1), Submit(1, 87, 1), Submit(0, 53, 1), Idle()])
# ts65's last split, fixed (tp67): the leaked row (a health check's, one position) still maps units 2 and 3 at
# positions 1-2, its former tenant's; unit 3, handed out with the row's own unit 1 and rows 1-3 in one
# alloc_extend, went to row 3, whose checkpoint freed it as a duplicate prefix: the lost release read
# checkpoint_kv_cache_into_tree, not process_batch_result. The engine fills req_to_token by tensor indexing;
# the target now records how far each row's tenant wrote it (Target.units_of_tenants), and the leak oracle
# reads a row's units there (leaks._by_row).
FOUND["prefill-finish-leaks-row"] = [[Submit(0, 1, 4), Idle(), PauseGeneration(mode=1), HealthCheck(), Submit(1, 1, 2),
                                      Submit(1, 1, 2), FlushCache(timeout=0), Idle()]]


@pytest.mark.parametrize("bug", FOUND)
def test_a_zoo_bug_found_by_another_program_has_the_regression_files_signatures(bug, zoo):
    config, _, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", f"{bug}.json"))
    want = {f.signature for f in zoo[bug]}
    for program in FOUND[bug]:
        assert set(execute(config, program).signatures) == want


def test_a_rows_tenant_maps_the_positions_it_wrote_prefill_and_decode():
    """Tenants (the built-in target's Target.units_of_tenants): one row, two tenants; the second (3 prompt positions
    and 2 decoded) leaves the first's entries past position 5 in the row. Only its own 5 are its units: a decode's
    write (tensor indexing in update_running_batch) counts as a prefill's does. A search's lean run records none."""
    from kvaudit.search.schedule import search_run

    config = get_preset("default").config(max_req_rows=1)
    with AuditedRun(config) as run:
        for op in [Submit(0, 12, 2), Idle(), Submit(1, 3, 4), Step(3)]:
            assert not run.apply(op)
        (req,) = run.target.engine.running_batch
        row, table = req.kv.req_pool_idx, run.target.engine.req_to_token_pool.req_to_token
        assert req.kv.kv_allocated_len == 5
        own = set(table[row, :5].tolist())
        assert set(run.target.units_of_rows([row])["token_to_kv_pool"].tolist()) > own | {0}  # the first's, stale
        assert set(run.target.units_of_tenants([row])["token_to_kv_pool"].tolist()) == own
    lean = search_run(config)
    assert lean.auditor.lean and lean.target.units_of_tenants([1]) is None
    lean.close()


@pytest.mark.parametrize("preset", ["chunked", "mixed-chunk", "retract", "overlap", "paged", "pd-decode",
                                    "pd-decode-hisparse", "hisparse", "streaming-session", "hicache"])
def test_a_rows_recorded_tenant_length_covers_every_position_its_live_record_allocated(preset):
    """Tenants' length is a floor on what leak attribution reads as a row's own: one shorter than a live record's
    ``kv_allocated_len`` would drop its own entries (a chunk continuation, a retraction's re-admission, a session turn
    on a borrowed record, a PD pre-allocation, a HiSparse or overlap decode). After every step of random programs,
    every live request's and session's record: the recorded length reaches its allocated length."""
    config = get_preset(preset).config(model="none")
    short, seen = [], 0
    for seed in range(6):
        rng = random.Random(seed)
        with AuditedRun(config, full_stacks=False) as run:
            def check(run):
                nonlocal seen
                eng = run.target.engine
                kvs = [r.kv for r in eng.requests_owning_rows()]
                kvs += [s.kv for _, s in eng.session_controller.slots()] if eng.session_controller is not None else []
                for kv in kvs:
                    seen += 1
                    length = int(run.target.tenants.lengths(np.array([kv.req_pool_idx]))[0])
                    if length < kv.kv_allocated_len:
                        short.append((seed, run.target.steps, kv.req_pool_idx, length, kv.kv_allocated_len))
            run.on_step = check
            for op in random_program(rng, rng.randint(16, 64), features=program_features(config)):
                if run.apply(op):
                    break
    assert seen and short == []


# programs `kvaudit fuzz --bug BUG --seed 1..5` (corpus and random) minimized to, where the lost or freed
# slots were allocated in decode (update_running_batch) where the regression file's were in prefill
# (alloc_for_extend): one bug, two signatures, a campaign re-reporting it as new (3 to 7 of 8 runs each)
DECODE = {
    "session-abort-borrows-slot": [
        [OpenSession(), Submit(0, 10, 11, session=3), Idle(), Submit(0, 40, 1, session=1), Step(1)],
        [OpenSession(), Submit(0, 26, 1), Submit(0, 1, 4, session=1, extends=5), Idle(), Submit(0, 27, 1, session=0),
         Idle()]],
    "session-close-while-running": [
        [OpenSession(), Submit(0, 1, 4, session=1), Step(3), CloseSession(0), Step(1)],
        [OpenSession(), Submit(0, 1, 3, stop_at=4, session=1), Step(3), CloseSession(0), Step(1)]],
    # (retract-unaligned-page was here while its switch skipped the request's last page, which decode may
    # have allocated; sglang PR #4977's retraction skips the page holding the prompt's end, always prefill's)
}


def by_function(f: Finding) -> str:
    """``f``'s signature with its allocation site named by its function, as before ``request-kv``."""
    return dataclasses.replace(f, alloc_sites=[dataclasses.replace(s, request_kv=False) for s in f.alloc_sites]).signature


@pytest.mark.parametrize("bug", DECODE)
def test_a_zoo_bug_whose_units_decode_allocated_has_the_regression_files_signatures(bug, zoo):
    """The request's own KV is one role, ``request-kv``, whether prefill or decode allocated the units the
    bug lost: named by their function, the programs split the bug in two."""
    config, _, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", f"{bug}.json"))
    want = {f.signature for f in zoo[bug]}
    named = {by_function(f) for f in zoo[bug]}
    for program in DECODE[bug]:
        found = execute(config, program).findings
        assert {f.signature for f in found} == want
        named |= {by_function(f) for f in found}
    assert any("/update_running_batch@scheduler.py" in s for s in named) and len(named) > len(want), named



def test_request_kv_names_allocation_sites_only():
    """``Site.request_kv`` names an allocation site by its role; a free, a crash's frame and a lock's
    site in such a function keep the function. The flag is written only where set and read back."""
    grow = Site("engine_under_test/scheduler.py", 320, "update_running_batch", request_kv=True)
    other = Site("engine_under_test/scheduler.py", 404, "_pre_alloc")
    leak = Finding("leak", "token_to_kv_pool", "m", alloc_sites=[grow], lost_from="session")
    assert leak.signature == "leak/token_to_kv_pool/request-kv/from:session"
    assert dataclasses.replace(leak, alloc_sites=[other]).signature == \
        "leak/token_to_kv_pool/_pre_alloc@scheduler.py/from:session"
    assert Finding("double-free", "p", "m", prev_free_sites=[grow], free_sites=[other]).signature == \
        "double-free/p/update_running_batch@scheduler.py/_pre_alloc@scheduler.py"
    assert Finding("crash", "-", "RuntimeError: Decode out of memory", alloc_sites=[grow]).signature == \
        "crash/-/RuntimeError@update_running_batch@scheduler.py"
    d = leak.to_dict()
    assert d["alloc_sites"][0]["request_kv"] is True
    assert "request_kv" not in Finding("leak", "p", "m", alloc_sites=[other]).to_dict()["alloc_sites"][0]
    assert Finding.from_dict(d).signature == leak.signature
    d["alloc_sites"][0]["request_kv"] = "yes"
    with pytest.raises(ValueError, match="request_kv"):
        Finding.from_dict(d)


def test_a_leak_no_owner_had_is_named_by_what_the_target_says_lost_it():
    """A leak with no release path and no ``from:`` place takes the target's ``lost_by`` as its second part
    (SGLang: where its row write put the unit), written to the file only where set and read back; a release
    path or a ``from:`` place comes first."""
    grow = Site("sglang/srt/mem_cache/allocation.py", 159, "alloc_token_slots", request_kv=True)
    leak = Finding("leak", "token_to_kv_pool", "m", alloc_sites=[grow], lost_by="past-table")
    assert leak.signature == "leak/token_to_kv_pool/request-kv/past-table"
    assert Finding.from_dict(leak.to_dict()).signature == leak.signature
    assert "lost_by" not in dataclasses.replace(leak, lost_by="").to_dict()
    assert dataclasses.replace(leak, lost_from="waiting").signature == "leak/token_to_kv_pool/request-kv/from:waiting"
    with pytest.raises(ValueError, match="lost_by"):
        Finding.from_dict({**leak.to_dict(), "lost_by": 3})


def test_a_crash_signature_ends_with_what_the_target_says_of_the_request_it_raised_on():
    """The crash oracle records ``Target.crash_by(exc)`` as the finding's ``check``, the signature's last part,
    so that one raise reached by two root causes (SGLang's ``try_match_prefix`` assertion: a turn sharing a
    running turn's record, or a retry optimistic prefill requeued) is two bugs; the base's ``""`` adds none."""
    from types import SimpleNamespace

    from kvaudit.audit.oracles.outcome import crash
    from kvaudit.targets.base import Target

    def raised():
        try:
            raise AssertionError("streaming session prefix shrank")
        except AssertionError as exc:
            return exc

    class Said(Target):
        def crash_by(self, exc):
            return "req:requeued" if "shrank" in str(exc) else ""

    for target, last in ((Said(), "/req:requeued"), (Target(), "")):
        target.steps = 0
        run = SimpleNamespace(target=target, auditor=None, ops_run=1)
        [f] = crash(run, raised())
        assert f.signature == f"crash/-/AssertionError@raised@test_signatures.py{last}"
        assert Finding.from_dict(f.to_dict()).signature == f.signature


def test_a_premature_free_is_named_by_its_release_path_not_the_release_plumbing():
    """A use-after-free's free site, as a leak's lost release, is the first frame above a target's release
    entries (``Site.entry``): the caller that chose to free. (Tester 62: SGLang frees a row's KV through
    ``free_kv_row_segments``, an entry, so a deferred session close and a PD prefill's failed transfer, two
    root causes, both read ``.../free_kv_row_segments@common.py``: one JUnit case, one SARIF alert.)"""
    grow = Site("sglang/srt/mem_cache/allocation.py", 159, "alloc_token_slots", request_kv=True)
    plumbing = [Site("sglang/srt/mem_cache/common.py", 190, "free_kv_row_segments", entry=True),
                Site("sglang/srt/mem_cache/base_prefix_cache.py", 80, "free_kv_row", entry=True)]
    close = Site("sglang/srt/session/streaming_session.py", 300, "release_session")
    failed = Site("sglang/srt/disaggregation/prefill.py", 700, "handle_inflight_transfer_failure")
    uaf = Finding("use-after-free", "token_to_kv_pool", "m", alloc_sites=[grow], free_sites=plumbing + [close])
    assert uaf.signature == "use-after-free/token_to_kv_pool/request-kv/release_session@streaming_session.py"
    assert dataclasses.replace(uaf, free_sites=plumbing + [failed]).signature == \
        "use-after-free/token_to_kv_pool/request-kv/handle_inflight_transfer_failure@prefill.py"
    handle_abort = Site("engine_under_test/scheduler.py", 265, "handle_abort")  # no entry: its own frame
    assert dataclasses.replace(uaf, free_sites=[handle_abort]).signature.endswith("/handle_abort@scheduler.py")


def test_a_double_free_and_a_stale_reads_free_are_named_by_their_release_paths():
    """The same for the frees a double free and a stale read name: SGLang's double frees all read
    ``double-free/token_to_kv_pool/free_kv_row_segments@common.py/free_kv_row_segments@common.py`` (the history
    suite's campaigns met it beside ``double-free/token_to_kv_pool/?/free_kv_row_segments@common.py``)."""
    plumbing = [Site("sglang/srt/mem_cache/common.py", 190, "free_kv_row_segments", entry=True),
                Site("sglang/srt/mem_cache/common.py", 120, "release_kv_cache", entry=True)]
    close = Site("sglang/srt/session/streaming_session.py", 300, "release_session")
    finish = Site("sglang/srt/managers/scheduler_output_processor_mixin.py", 90, "process_batch_result_decode")
    df = Finding("double-free", "token_to_kv_pool", "m", prev_free_sites=plumbing + [close],
                 free_sites=plumbing + [finish])
    assert df.signature == ("double-free/token_to_kv_pool/release_session@streaming_session.py/"
                            "process_batch_result_decode@scheduler_output_processor_mixin.py")
    stale = Finding("stale-kv", "token_to_kv_pool", "m", check="freed", free_sites=plumbing + [close])
    assert stale.signature == "stale-kv/token_to_kv_pool/freed:release_session@streaming_session.py"


def test_the_two_sglang_premature_frees_of_kv_are_two_signatures():
    """The corpus's findings 4 and 11 (corpora/sglang/README.md), read back: two root causes, two
    signatures, each the one its file records."""
    sigs = []
    for name in ("uaf-deferred-close-after-rejected-turn", "uaf-pd-prefill-failed-transfer-frees-source-page"):
        doc = json.load(open(os.path.join(ROOT, "corpora", "sglang", f"{name}.json")))
        (uaf,) = [d for d in doc["findings"] if d["kind"] == "use-after-free" and d["pool"] == "token_to_kv_pool"]
        assert Finding.from_dict(uaf).signature == uaf["signature"], name
        sigs.append(uaf["signature"])
    assert sigs[0] != sigs[1], sigs


@pytest.mark.slow
@pytest.mark.parametrize("path", ZOO_FILES, ids=[os.path.basename(p)[:-5] for p in ZOO_FILES])
def test_a_zoo_bug_keeps_its_signatures_in_random_programs(path, zoo):
    """The same over 150 random programs per zoo bug (its preset and switch, three seeds of 50)."""
    config, _, _, _ = replay.load(path)
    mine = zoo[os.path.basename(path)[: -len(".json")]]
    split = []
    for seed in range(3):
        rng = random.Random(f"signatures-{seed}")
        for _ in range(50):
            program = random_program(rng, 24, max_prompt=48, features=program_features(config))
            split += _no_new_split(mine, execute(config, program).findings)
    assert not split, sorted(set(split))


# programs that trigger each fault in different ways: freed, reallocated and lost in one step (a flush,
# a health check), or retracted in the step another request finishes
VARIANTS = {
    "finish-floors-last-page": [
        [Submit(0, 6, 2), Step(1), PauseGeneration(mode=2), HealthCheck(), FlushCache(timeout=0), Abort(None), Idle()],
        [Submit(0, 11, 8, stop_at=2), Idle(), PauseGeneration(mode=1), HealthCheck(), FlushCache(timeout=0), Idle()],
        [Submit(0, 65, 5), Step(3), Abort(None), Idle(), FlushCache(timeout=0), HealthCheck(), Submit(0, 1, 2), Step(1)],
        [Submit(0, 1, 4), Submit(0, 1, 9), Submit(1, 44, 4), Submit(3, 51, 4), Submit(0, 14, 4), Idle()]],
    "retract-forgets-tail": [
        [Submit(0, 6, 2), Step(1), PauseGeneration(mode=2), Step(1), Idle()],
        [Submit(0, 1, 4), Submit(0, 1, 9), Submit(1, 44, 4), Submit(3, 51, 4), Submit(0, 14, 4), Idle()]],
}
# the retraction forgets a request's last slot (not separated from retract-unaligned-page, whose
# retraction forgets its last page: one function, one pool, one path)
RETRACT_TAIL = (Scheduler, "release_req", "        self.release_kv_cache(req, checkpoint=False)\n",
                "        req.kv.kv_allocated_len -= 1\n        self.release_kv_cache(req, checkpoint=False)\n")


@pytest.mark.parametrize("name", VARIANTS)
def test_a_planted_leak_is_named_by_its_own_release_in_every_program(name, monkeypatch):
    """The release blamed is the leaked unit's owner's, not another request's that freed units a freed
    row still names (a stale entry) or units the owner held before they were freed and handed on in
    the same step."""
    plant(monkeypatch, *(FAULTS[name][1] if name in FAULTS else RETRACT_TAIL))
    config = get_preset("retract").config()
    paths = {f.signature.rsplit("/", 1)[1] for p in VARIANTS[name] for f in execute(config, p).findings}
    assert paths == {"process_batch_result@scheduler.py" if name in FAULTS else "release_req@scheduler_decode_mixin.py"}


def test_a_finding_of_an_unknown_kind_is_refused_by_from_dict_as_any_bad_field_is():
    """Finding.from_dict checked every field but the kind: replay._parse checked that after it, so any other
    loader of findings took "bogus" and failed later, at a renderer's kind table."""
    d = Finding("leak", "p", "m").to_dict()
    d["kind"] = "bogus"
    with pytest.raises(ValueError, match=r'^unknown kind "bogus" \(valid: leak, use-after-free, '):
        Finding.from_dict(d)
    d["kind"] = 5
    with pytest.raises(ValueError, match="^kind: want a string, got 5$"):
        Finding.from_dict(d)


# Found in session 65 (ts65): `kvaudit fuzz --preset P --bug BUG --fuzzer random-96 --seed 1..5 --corpus DIR`
# for every zoo bug, programs minimized with `kvaudit minimize --signature`. Each was a strict xfail until fixed,
# then moved to FOUND (a split) or made a plain test (a collision); a new one is added the same way.
# Fixed (tf65): a tree eviction (release@radix_cache.py) is the premature free of two root causes: radix-lock-
# skips-matched-node (a live receipt covered the node, the tree's lock did not) and session-close-while-running
# (the close released the session's lock on the turn's published prompt while the turn still reads it: no
# receipt covered the node). The eviction is shared plumbing; the target's record of it (Target.freed_by:
# "unlocked") tells them apart.
SESSION_CLOSE_EVICTED = [OpenSession(), Submit(0, 1, 2, session=0), Step(2), CloseSession(0), MemoryPressure(), Step(1)]
# aborted-kv-inserted: the aborted request's unwritten decode slot, cached into the tree, still holds a former
# tenant's KV; the stale read was classed "freed:" by that slot's last free (the tree's eviction), not
# "unwritten": radix-lock-skips-matched-node's fuzzed stale read (seeds 1, 3, 4, 5) reads the same (fixed: ta66)
ABORTED_KV_EVICTED = [
    Submit(1, 34, 1), Submit(0, 2, 5), Submit(0, 80, 6), Submit(0, 1, 6), Submit(4, 38, 11), Idle(), Submit(3, 47, 3),
    Submit(2, 72, 1), Step(1), Submit(2, 69, 1), Step(1), MemoryPressure(), Submit(0, 7, 4, extends=5),
    Submit(0, 64, 1), Abort(0), Submit(0, 7, 1, extends=7), Idle()]


def test_a_session_closed_under_its_turn_is_not_the_radix_lock_bug(zoo):
    config, _, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", "session-close-while-running.json"))
    found = set(execute(config, SESSION_CLOSE_EVICTED).signatures)
    assert found and not found & {f.signature for f in zoo["radix-lock-skips-matched-node"]}, found


def test_a_search_reports_the_unlocked_eviction_its_lean_run_does_not_record():
    """A search's lean run records no evictions (the eut skips the wrappers there: +0.027x bytecodes on
    eut ``default``); its hit is localized by the per-step replay, which does: the search reports
    ``/unlocked`` as a per-step run does, and the lean run itself installs nothing."""
    from kvaudit.search.schedule import search_run

    config, _, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", "session-close-while-running.json"))
    run = search_run(config)
    assert run.auditor.lean and run.target.evictions is None
    found = []
    for op in SESSION_CLOSE_EVICTED:  # (as a search applies a program: until its first finding)
        found = run.apply(op)
        if found:
            break
    found = {f.signature for f in found or run.finish()}
    assert any(s.endswith("/release@radix_cache.py/unlocked") for s in found), found


class _AuditorStandIn:  # (the events and ledgers Evictions reads; weakly referenced, as the auditor is)
    pass


def _recorded_tree(bug: str = ""):
    """A 16-slot RadixCache with ``bug`` on, whose frees an auditor stand-in logs, its evictions recorded."""
    alloc = TokenToKVPoolAllocator(16, 1)
    tree = RadixCache(alloc, 1, bugs=frozenset({bug} - {""}))
    auditor = _AuditorStandIn()
    auditor.events, auditor.ledgers = [], {"token_to_kv_pool": types.SimpleNamespace(
        last_free=np.full(17, -1, dtype=np.int64))}
    free = alloc.free

    def free_wrapper(slots):
        units = slots.tolist()
        auditor.events.append(Event(len(auditor.events), "free", "token_to_kv_pool", units, 0, 0, -1))
        auditor.ledgers["token_to_kv_pool"].last_free[units] = auditor.events[-1].id
        return free(slots)

    alloc.free = free_wrapper
    rec = Evictions(auditor, "token_to_kv_pool", 1)
    rec.install(tree, lambda obj, name, fn: setattr(obj, name, fn))
    return tree, alloc, auditor, rec


@pytest.mark.parametrize("bug", ["", "radix-lock-skips-matched-node"])
def test_an_eviction_is_unlocked_only_when_no_lock_call_covered_its_node(bug):
    """Evictions (the built-in target's Target.freed_by): a node a receipt covered when the tree evicted it (the
    lock call's node or its descendant, though the buggy tree counted no lock on it) is not `unlocked`; a node
    whose receipt was released is; and the record names that eviction's free only, not the unit's later free."""
    tree, alloc, auditor, rec = _recorded_tree(bug)
    tree.insert((1, 2), alloc.alloc(2))
    value = alloc.alloc(4)
    alloc.free(value[:tree.insert((1, 2, 3, 4), value)])  # (the duplicate head, as the scheduler frees it)
    leaf = tree.match_prefix((1, 2, 3, 4)).last_node
    units = torch.cat([leaf.parent.value, leaf.value]).numpy()  # the head's, then the leaf's
    tree.inc_lock_ref(leaf)
    tree.evict(4)  # the bug: the leaf (tokens 3, 4) is evicted under its lock call
    tree.dec_lock_ref(leaf)
    tree.inc_lock_ref(leaf.parent)
    tree.dec_lock_ref(leaf.parent)
    tree.evict(4)  # its parent (tokens 1, 2): its lock was released
    frees = auditor.ledgers["token_to_kv_pool"].last_free[units]
    by = rec.freed_by(units, frees)
    assert by == ["unlocked"] * 2 + ([""] * 2 if bug else ["unlocked"] * 2), by
    assert rec.freed_by(units[:2], frees[:2] + 1) == ["", ""]  # another free of the units is not the eviction
    # Target.freed_under_reader: the covered eviction (the bug's) is a free under its reader, no other is
    assert rec.under_lock(units, frees) == [False] * 2 + ([True] * 2 if bug else [False] * 2)
    assert rec.under_lock(units[2:], frees[2:] + 1) == [False, False]


def test_an_unlocked_eviction_of_units_a_locked_node_also_holds_is_the_trees_aliasing():
    """A unit two nodes hold (the aftermath of an earlier premature free: a freed slot handed on and cached
    again), evicted from the unlocked one while the other is locked, is not read as `unlocked`."""
    tree, alloc, auditor, rec = _recorded_tree()
    slots = alloc.alloc(2)
    tree.insert((1, 2), slots)
    tree.insert((3, 4), slots.clone())  # (the aliasing)
    tree.inc_lock_ref(tree.match_prefix((3, 4)).last_node)
    assert tree.evict(2) == 2
    units = slots.numpy()
    assert rec.freed_by(units, auditor.ledgers["token_to_kv_pool"].last_free[units]) == ["", ""]


def test_the_whole_stack_of_an_unlocked_eviction_goes_on_past_the_receipts_wrappers():
    """The eviction wrappers run between engine frames (``_evict_lru`` calls their ``release``): a whole stack
    of the free goes on past them to ``_evict_lru``, ``evict`` and its caller, as without them; it ended at
    ``release`` before (tg65)."""
    config, _, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", "session-close-while-running.json"))
    found = [f for f in execute(config, SESSION_CLOSE_EVICTED).findings if f.signature.endswith("/unlocked")]
    assert found and [s.function for s in found[0].free_sites] == [
        "release", "_evict_lru", "evict", "process_input_requests"], found[0].free_sites


def test_a_flush_drops_the_receipts_of_the_locks_it_never_releases():
    """A flush (``reset``) drops the tree with the locks on it (a session slot's lock is never released): the
    receipts go with it. Kept, they covered the dropped nodes' units, handed on since, and an unlocked eviction
    of those units in the new tree read as covered (tg65)."""
    tree, alloc, auditor, rec = _recorded_tree()
    slots = alloc.alloc(2)
    tree.insert((1, 2), slots)
    tree.inc_lock_ref(tree.match_prefix((1, 2)).last_node)  # (a session slot's lock: a flush never unlocks it)
    tree.reset()
    alloc.clear()
    again = alloc.alloc(2)
    tree.insert((5, 6), again)
    assert tree.evict(2) == 2 and set(again.tolist()) == set(slots.tolist())
    units = again.numpy()
    assert rec.freed_by(units, auditor.ledgers["token_to_kv_pool"].last_free[units]) == ["unlocked"] * 2


def test_a_session_closed_under_its_turn_after_a_flush_is_still_unlocked(zoo):
    """The flush after a session's first turn (its slot's lock dropped with the tree) leaves the signature of
    session-close-while-running as it is: it shared radix-lock-skips-matched-node's again before (tg65)."""
    config, _, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", "session-close-while-running.json"))
    flushed = [OpenSession(), Submit(0, 1, 2, session=0), Idle(), FlushCache(), Idle()] + SESSION_CLOSE_EVICTED[1:]
    found = set(execute(config, flushed).signatures)
    assert found == set(execute(config, SESSION_CLOSE_EVICTED).signatures), found
    assert not found & {f.signature for f in zoo["radix-lock-skips-matched-node"]}, found


def test_an_aborted_requests_unwritten_slot_read_from_the_tree_is_unwritten(zoo):
    """A slot allocated since its last free that still holds the tag it held then was not written by that
    allocation: its stale read is `unwritten` (the content is older than the free), not `freed:` (ts65's
    collision with radix-lock-skips-matched-node's stale read; ta66)."""
    config, _, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", "aborted-kv-inserted.json"))
    assert set(execute(config, ABORTED_KV_EVICTED).signatures) == {f.signature for f in zoo["aborted-kv-inserted"]}
    # and radix-lock's stale read (`kvaudit fuzz --bug radix-lock-skips-matched-node --seed 4`): the slot evicted
    # under its reader was written by its next tenant, so that eviction is still the cause
    config, _, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", "radix-lock-skips-matched-node.json"))
    found = execute(config, [Submit(0, 5, 2), Submit(2, 34, 1), Submit(1, 89, 3), Idle()]).signatures
    assert "stale-kv/token_to_kv_pool/freed:release@radix_cache.py" in found, found


# radix-lock-skips-matched-node (no aborted-kv-inserted): req 4 (Submit(3, 44, 1)) matched a node it did not lock;
# the node was evicted under it (release@radix_cache.py), its slots handed to a request that wrote them and freed
# them (release_kv_cache), then allocated again; req 4 read them before that allocation's forward wrote them
READ_AFTER_TWO_FREES = [Submit(1, 4, 2), Submit(0, 29, 3), Submit(0, 25, 2), Submit(2, 33, 8), Submit(3, 17, 2), Step(1),
                        Submit(1, 13, 2), MemoryPressure(), Submit(3, 44, 1), PauseGeneration(mode=2), Idle()]


def test_a_slot_freed_under_its_reader_and_rewritten_since_is_not_unwritten():
    """ta66's rule (a slot allocated since its last free, still holding that free's tag, is `unwritten`) looked at
    the last free only: here the content is the second tenant's, written after the free under the reader, and the
    read was classed `unwritten`, aborted-kv-inserted's signature (a collision). The eut's report passes the tags
    the reader wanted: the latest free at which the slot held them took the reader's content, and names the read
    (`freed:release@radix_cache.py`, the bug's). Suppressions let the read be met: a use-after-free of the same
    eviction is found first."""
    from kvaudit.audit.suppress import Suppression, SuppressionSet

    config, _, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", "radix-lock-skips-matched-node.json"))
    others = SuppressionSet([Suppression(kind=k, index=i + 1) for i, k in enumerate(
        ("lock-imbalance", "accounting-drift", "leak", "use-after-free", "double-free"))])
    stale = {s for s in execute(config, READ_AFTER_TWO_FREES, suppressions=others).signatures if s.startswith("stale-kv")}
    assert stale == {"stale-kv/token_to_kv_pool/freed:release@radix_cache.py"}, stale




def test_the_contents_frees_took_are_kept_per_slot_bounded_by_the_pool():
    """The cause above came from a list of every free's slots and tags (freed_tags, kept outside lean runs), an
    entry per free however long the run: 6,836 entries, 3.4 MB of RSS over a 12,000-op replay of default. Each
    slot keeps the last FREED_CONTENTS contents its frees took now: the store is the pool's size from the first
    op to the last (and the read above still names its free)."""
    from kvaudit.audit.hooks import FREED_CONTENTS
    from kvaudit.audit.runner import AuditedRun
    from kvaudit.program.generate import random_program

    config = get_preset("default").config()
    program = random_program(random.Random(1), 3000, features=program_features(config))
    sizes = []
    with AuditedRun(config) as run:
        pools = {p: t.size for p, t in run.auditor.shadow.tags.items()}
        for i, op in enumerate(program):
            assert not run.apply(op), run.findings
            if i in (0, 500, len(program) - 1):
                sizes.append(sum(a.nbytes for arrays in run.auditor.freed_contents.values() for a in arrays))
        frees = sum(e.kind == "free" for e in run.auditor.events)
    assert frees > 2000  # (many frees: a store kept per free would have grown)
    assert sizes == [sum(pools.values()) * FREED_CONTENTS * 16] * 3


def test_a_fresh_auditors_store_of_freed_contents_is_all_zeros_so_the_os_hands_out_its_pages_as_frees_touch_them():
    """The store's free ids were np.full(-1) (none): every Auditor outside a lean run (each replay, each program a
    minimization tries) wrote its whole [slots, FREED_CONTENTS] at once: on a 1,048,576-slot pool 32 MiB resident
    and ~40 ms before the first op (benchmarks/audit_scale.py's engine). It holds a free's id + 1 now (0: none), so
    both arrays are np.zeros, untouched until a free writes them; the read above still names its free."""
    from kvaudit.audit.runner import AuditedRun

    with AuditedRun(get_preset("default").config()) as run:
        store = run.auditor.freed_contents
        assert store and not any(a.any() for arrays in store.values() for a in arrays)
        assert run.auditor._freed_what_was_wanted("token_to_kv_pool", np.arange(4), np.ones(4, np.int64)) == -1
        for op in (Submit(0, 8, 2), Idle(), FlushCache(), Idle()):  # (the flush frees what the tree cached)
            assert not run.apply(op), run.findings
        contents, frees = store["token_to_kv_pool"]
        taken = np.flatnonzero(frees[:, 0])  # (the slots a free took content from: their newest entry)
        assert taken.size and (frees[taken, 0] - 1 < len(run.auditor.events)).all()
        last = int(frees[taken, 0].max()) - 1
        assert run.auditor.events[last].kind == "free"
        slot = int(taken[frees[taken, 0] == last + 1][0])
        assert run.auditor._freed_what_was_wanted("token_to_kv_pool", np.array([slot]), contents[[slot], 0]) == last


# aborted-kv-inserted on hicache (the bug's preset is overlap): the aborted request's unwritten position 10, cached in
# the tree, demoted to host and loaded back into another slot; req 10 reads it there
ABORTED_KV_LOADED_BACK = [Submit(0, 1, 1), Submit(0, 1, 1), Submit(0, 10, 1), Submit(0, 10, 4), Idle(), Submit(1, 48, 1),
                          Submit(0, 1, 1), Abort(None), Submit(2, 9, 3), Submit(0, 12, 2, extends=4), Step(2), Abort(0),
                          Submit(0, 42, 3), Submit(0, 12, 1, extends=7), Submit(0, 1, 1, extends=6), Idle()]


# the same, a position never written (seed 25 of 150 random 16-64-op programs on hicache, minimized): its read
# was named by the load-back's allocation, `load_back@hicache.py/unwritten`, in 4 of 150 random programs (a split)
NEVER_WRITTEN_LOADED_BACK = [Submit(0, 1, 2), Step(1), Abort(None), Step(2), Submit(0, 1, 1, extends=0), MemoryPressure(),
                             Idle()]


@pytest.mark.parametrize("program", [ABORTED_KV_LOADED_BACK, NEVER_WRITTEN_LOADED_BACK])
def test_an_unwritten_position_loaded_back_from_host_is_still_unwritten(program, zoo):
    """The copy back from host writes the old tenant's tag into a slot last freed by a demote of another node:
    the read was `freed:demote@hicache.py`, radix-lock-skips-matched-node's stale read on hicache (a collision
    tb66 found: 4 of 150 random programs at 8f16904, 3 of 150 before session 67). A copy now carries that its source
    was unwritten and the allocation that handed it out (Auditor._copy_keeping_unwritten: the demote's and the
    load-back's), so the read is the bug's own, not the load-back's allocation's either."""
    config = get_preset("hicache").config(bugs=frozenset({"aborted-kv-inserted"}))
    found = execute(config, program).signatures
    assert found and set(found) <= {f.signature for f in zoo["aborted-kv-inserted"]}, found


@pytest.mark.parametrize("full_stacks", [True, False])
def test_a_wrapper_of_the_release_entry_does_not_cut_a_retractions_path(full_stacks):
    """The built-in target wraps release_kv_cache (the release entry) to record each request's last release
    (Target.dropped_by); the wrapper is a pass_through frame between the entry and the path that chose the
    release. The fast stacks' walk (a search's per-step replay) stopped at any framework frame past an entry,
    so retract-unaligned-page's leak was named by the entry itself, release_kv_cache@scheduler.py; now both
    walks go past the wrapper, to the retraction's release_req, as recorded."""
    config, program, recorded, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", "retract-unaligned-page.json"))
    got = execute(config, program, full_stacks=full_stacks).findings
    assert recorded[0].signature == "leak/token_to_kv_pool/request-kv/release_req@scheduler_decode_mixin.py"
    assert [f.signature for f in got][:1] == [recorded[0].signature]

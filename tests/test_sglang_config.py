"""The real-SGLang target's configuration, probe and CLI errors: these run with or without SGLang."""

import dataclasses
import json
import os
import re

import pytest

from cli_helpers import invoke, one_error_line
from kvaudit import replay
from kvaudit.program import Idle
from kvaudit.targets import config_from_dict
from kvaudit.targets.sglang import boot
from kvaudit.config import UnknownFaultError
from kvaudit.targets.sglang.config import FAULTS, SGLANG_PRESETS, SglangConfig


def test_presets_cover_the_configurations():
    assert set(SGLANG_PRESETS) == {"sglang", "sglang-paged", "sglang-pd", "sglang-session", "sglang-overlap",
                                   "sglang-chunked", "sglang-pd-decode", "sglang-pd-decode-radix",
                                   "sglang-hisparse", "sglang-hicache",
                                   "sglang-hicache-l3", "sglang-priority", "sglang-mixed",
                                   "sglang-session-nonstreaming",
                                   # config-only paths (eviction policies, the timeout prefetch policy, a failing L3)
                                   "sglang-evict-tlru", "sglang-evict-priority", "sglang-evict-slru",
                                   "sglang-hicache-l3-timeout", "sglang-hicache-l3-fail",
                                   # PD prefill
                                   "sglang-pd-prefill", "sglang-pd-prefill-chunked", "sglang-pd-prefill-reads",
                                   "sglang-pd-prefill-optimistic", "sglang-pd-prefill-session",
                                   # SWA hybrid
                                   "sglang-swa", "sglang-swa-chunked", "sglang-swa-small", "sglang-swa-paged",
                                   "sglang-swa-chunkcache", "sglang-swa-session", "sglang-swa-unaligned",
                                   # Mamba
                                   "sglang-mamba", "sglang-mamba-small", "sglang-mamba-overlap", "sglang-mamba-session",
                                   "sglang-mamba-mixed",
                                   # speculative decoding (spec v2)
                                   "sglang-spec-eagle", "sglang-spec-eagle-paged", "sglang-spec-ngram",
                                   "sglang-spec-ngram-deep",
                                   "sglang-spec-overlap", "sglang-spec-retract", "sglang-spec-session",
                                   "sglang-spec-swa", "sglang-spec-mamba",
                                   }
    tlru = SGLANG_PRESETS["sglang-evict-tlru"].config()
    assert (tlru.radix_eviction_policy, json.loads(tlru.radix_eviction_policy_config)) == \
        ("tlru", {"threshold": 32, "next_prompt_estimate": 8})
    assert SGLANG_PRESETS["sglang-evict-priority"].config().enable_priority_scheduling
    assert SGLANG_PRESETS["sglang"].config().radix_eviction_policy == "lru"
    assert {SGLANG_PRESETS[p].config().disaggregation_mode for p in ("sglang-pd-prefill", "sglang-pd-prefill-chunked",
                                                                    "sglang-pd-prefill-reads")} == {"prefill"}
    assert SGLANG_PRESETS["sglang-pd-prefill-reads"].config().prefill_reads_after_failure
    opt, ses = (SGLANG_PRESETS[f"sglang-pd-prefill-{p}"].config() for p in ("optimistic", "session"))
    assert (opt.optimistic_prefill_attempts, opt.enable_streaming_session, ses.enable_streaming_session) == (2, False, True)
    assert ses.disaggregation_mode == "prefill" and ses.optimistic_prefill_attempts == 2
    assert SGLANG_PRESETS["sglang-session-nonstreaming"].config().session_streaming is False
    l3 = SGLANG_PRESETS["sglang-hicache-l3"].config()
    assert l3.enable_hierarchical_cache and l3.hicache_storage_backend == "file"
    assert (l3.hicache_storage_prefetch_policy, l3.hicache_storage_ack_steps) == ("wait_complete", 1)
    assert SGLANG_PRESETS["sglang-hicache"].config().hicache_storage_backend is None
    mixed = SGLANG_PRESETS["sglang-mixed"].config()
    assert mixed.enable_mixed_chunk and mixed.chunked_prefill_size == 16 and mixed.enable_overlap
    prio = SGLANG_PRESETS["sglang-priority"].config()
    assert prio.enable_priority_scheduling and prio.max_queued_requests == 4
    assert (prio.request_waiting_timeout_steps, prio.request_running_timeout_steps) == (12, 24)
    assert SGLANG_PRESETS["sglang-pd-decode"].config().disaggregation_mode == "decode"
    assert SGLANG_PRESETS["sglang-hisparse"].config().enable_hisparse is True
    assert SGLANG_PRESETS["sglang-overlap"].config().enable_overlap is True
    chunked = SGLANG_PRESETS["sglang-chunked"].config()
    assert (chunked.chunked_prefill_size, chunked.enable_overlap) == (16, True)
    assert SGLANG_PRESETS["sglang"].config().chunked_prefill_size is None
    assert SGLANG_PRESETS["sglang-paged"].config().page_size == 16
    assert SGLANG_PRESETS["sglang-pd"].config().need_sort is True
    assert SGLANG_PRESETS["sglang-session"].config().enable_streaming_session is True
    assert SGLANG_PRESETS["sglang"].config(tree_core="python").tree_core == "python"


def test_a_preset_restates_no_default():
    """A preset's overrides (its base preset's included) set only values the defaults do not give: the
    preset table says what each preset changes, once (the spec, HiCache, SWA and Mamba rows restated
    defaults, e.g. speculative_num_steps 3, hicache_write_policy write_through, max_mamba_cache_size 24)."""
    defaults = SglangConfig()
    restated = [(name, key) for name, p in SGLANG_PRESETS.items() for key, value in p.overrides.items()
                if getattr(defaults, key) == value]
    assert not restated, restated


def test_config_round_trips_and_dispatches_on_target():
    cfg = SGLANG_PRESETS["sglang-pd"].config(bugs=frozenset({"lock-leak"}), tree_core="python")
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["target"] == "sglang"
    assert config_from_dict(d) == cfg
    assert type(config_from_dict({"preset": "default"})).__name__ == "EutConfig"  # the built-in engine's


@pytest.mark.parametrize("bad, match", [
    ({"tree_core": "go"}, "tree_core"),
    ({"num_slots": 8, "page_size": 16}, "num_slots"),
    ({"new_token_ratio": 2}, "new_token_ratio"),
    ({"need_sort": 1}, "need_sort"),
    ({"chunked_prefill_size": 2, "page_size": 4}, "chunked_prefill_size"),
    ({"chunked_prefill_size": True}, "chunked_prefill_size"),
    ({"disaggregation_mode": "encode"}, "disaggregation_mode"),
    ({"disaggregation_mode": "prefill", "enable_overlap": True}, "prefill is driven without enable_overlap"),
    ({"bootstrap_lost_every": 3}, "bootstrap_lost_every .*disaggregation_mode prefill"),
    ({"bootstrap_timeout_steps": 0}, "bootstrap_timeout_steps"),
    ({"fake_bootstrap_every": 0}, "fake_bootstrap_every must be null or a positive integer"),
    ({"disaggregation_mode": "decode", "fake_bootstrap_every": 2}, "decode is driven without fake_bootstrap_every"),
    ({"prefill_reads_after_failure": True}, "prefill_reads_after_failure .*disaggregation_mode prefill"),
    ({"optimistic_prefill_attempts": 1}, "optimistic_prefill_attempts .*disaggregation_mode prefill"),
    ({"disaggregation_mode": "prefill", "optimistic_prefill_attempts": -1}, "optimistic_prefill_attempts must be"),
    ({"disaggregation_mode": "prefill", "optimistic_prefill_attempts": True}, "optimistic_prefill_attempts must be"),
    ({"disaggregation_mode": "prefill", "enable_streaming_session": True, "session_streaming": False},
     "prefill drives streaming sessions only"),
    ({"bugs": frozenset({"prefill-skip-failed-release"})}, "prefill-skip-failed-release is for the sglang-pd-prefill presets"),
    ({"disaggregation_mode": "decode", "enable_overlap": True}, "enable_overlap"),
    ({"abort_ack_steps": -1}, "abort_ack_steps"),
    ({"transfer_latency_steps": 1.5}, "transfer_latency_steps"),
    ({"enable_priority_scheduling": 1}, "enable_priority_scheduling"),
    ({"max_queued_requests": 0}, "max_queued_requests"),
    ({"request_running_timeout_steps": True}, "request_running_timeout_steps"),
    ({"disaggregation_mode": "decode", "enable_priority_scheduling": True}, "enable_priority_scheduling"),
    ({"enable_mixed_chunk": True}, "enable_mixed_chunk"),
    ({"disaggregation_mode": "decode", "kv_checksum_mismatch_every": 0}, "kv_checksum_mismatch_every"),
    ({"disaggregation_mode": "decode", "kv_checksum_mismatch_every": True}, "kv_checksum_mismatch_every"),
    ({"kv_checksum_mismatch_every": 3}, "kv_checksum_mismatch_every .*disaggregation_mode decode"),
    ({"hicache_storage_backend": "file"}, "needs enable_hierarchical_cache"),
    ({"disaggregation_mode": "prefill", "enable_hierarchical_cache": True},
     "enable_hierarchical_cache is driven without disaggregation_mode prefill "),  # (it said decode)
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake"}, "hicache_storage_backend"),
    ({"hicache_storage_ack_steps": 0}, "hicache_storage_ack_steps"),
    ({"hicache_storage_prefetch_policy": "deadline"}, "hicache_storage_prefetch_policy must be one of best_effort, "
                                                      "wait_complete, timeout"),
    ({"hicache_storage_prefetch_timeout_steps": 0}, "hicache_storage_prefetch_timeout_steps"),
    ({"hicache_storage_fail_every": 3}, "hicache_storage_fail_every .*with a hicache_storage_backend"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file", "hicache_storage_fail_every": 0},
     "hicache_storage_fail_every must be"),
    ({"hicache_storage_prefetch_threshold": 0}, "hicache_storage_prefetch_threshold"),
])
def test_bad_config_values_are_value_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        SglangConfig(**bad)


def test_unknown_fault_names_the_valid_ones():
    with pytest.raises(UnknownFaultError) as e:
        SglangConfig(bugs=frozenset({"nope"}))
    for name in FAULTS:
        assert name in str(e.value)


def test_version_probe_refuses_missing_and_other_versions(monkeypatch):
    monkeypatch.setattr(boot, "installed_version", lambda: None)
    with pytest.raises(boot.SglangUnavailable, match=r"drives 0.5.10.post1, 0.5.11 .* and 0.5.19, .*0.5.23\), "
                                                     r"which is not installed.*requirements/sglang-cpu.txt"):
        boot.probe_version()
    monkeypatch.setattr(boot, "installed_version", lambda: "0.4.9")
    with pytest.raises(boot.SglangUnavailable, match="SGLang 0.4.9 is installed.*drives only 0.5.10.post1, 0.5.11 .* and 0.5.19, 0.5.20, 0.5.21, 0.5.22, 0.5.23"):
        boot.probe_version()


def test_cli_says_in_one_line_when_sglang_cannot_be_driven(monkeypatch, tmp_path):
    monkeypatch.setattr(boot, "_LOADED", None)
    monkeypatch.setattr(boot, "installed_version", lambda: "0.4.9")
    r = invoke("fuzz", "--target", "sglang", "--max-time", "1", "--out", str(tmp_path))
    assert r.exit_code == 69  # (a release this host lacks: as a missing atheris or redis-py)
    assert "drives only 0.5.10.post1, 0.5.11 (cache_finished_req era) and 0.5.19, 0.5.20, 0.5.21, 0.5.22, 0.5.23" in one_error_line(r)
    # a replay file of the real target, on the same machine (one op: a file with no program and no finding is
    # "nothing recorded", exit 5, before any engine is asked for)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(replay.to_doc(SGLANG_PRESETS["sglang"].config(), [Idle()], [])))
    r = invoke("replay", str(path))
    assert r.exit_code == 69
    assert "drives only 0.5.10.post1, 0.5.11 (cache_finished_req era) and 0.5.19, 0.5.20, 0.5.21, 0.5.22, 0.5.23" in one_error_line(r)


@pytest.mark.parametrize("args, match", [
    (["--target", "sglang", "--preset", "paged"], 'unknown preset "paged" for --target sglang'),
    (["--target", "sglang", "--bug", "overlap-abort-double-free"], "unknown fault"),
    (["--target", "sglang", "--bug", "overlap-abort-double-free"], "is a bug of --target eut: drop --target sglang"),
    (["--bug", "skip-release"], "skip-release is a bug of --target sglang: add --target sglang"),
    (["--target", "sglang", "--model", "tiny"], "--model tiny is for the built-in engine"),
    (["--target", "sglang", "--fuzzer", "atheris"], "atheris instruments the built-in engine only"),
    (["--preset", "sglang-paged"], "add --target sglang"),
    (["--tree-core", "python"], "--tree-core applies to --target sglang only"),
])
def test_cli_rejects_bad_target_flags(args, match, tmp_path, monkeypatch):
    # the flag checks come before SGLang is imported: pretend it is loaded so they run everywhere
    monkeypatch.setattr(boot, "load", lambda: None)
    r = invoke("fuzz", *args, "--max-time", "1", "--out", str(tmp_path))
    assert r.exit_code == 2, r.output
    assert match in one_error_line(r)


def test_replay_rejects_an_unknown_sglang_preset(tmp_path):
    doc = replay.to_doc(SGLANG_PRESETS["sglang"].config(), [], [])
    doc["config"]["preset"] = "default"
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(replay.ReplayFormatError, match='unknown preset "default".*sglang-session'):
        replay.load(str(path))


@pytest.mark.parametrize("kw, says", [
    ({"radix_eviction_policy": "fifo"}, "radix_eviction_policy must be one of lru, lfu, slru, priority, tlru"),
    ({"radix_eviction_policy_config": "[2]"}, "radix_eviction_policy_config must be a JSON object"),
    ({"radix_eviction_policy_config": "{oops"}, "radix_eviction_policy_config must be a JSON object"),
])
def test_an_eviction_policy_sglang_does_not_take_is_refused(kw, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        SglangConfig(**kw)


@pytest.mark.parametrize("name", sorted(f.name for f in dataclasses.fields(SglangConfig) if f.type == "bool"))
def test_every_switch_refuses_a_value_that_is_not_a_bool(name):
    """A switch given 1 (or "yes") is refused in one line naming it: every bool field, by the field's type."""
    for value, spelled in ((1, "1"), ("yes", '"yes"')):
        with pytest.raises(ValueError, match=f"^{name} must be true or false, got {re.escape(spelled)}$"):
            SglangConfig(**{name: value})


def test_the_legacy_era_refuses_an_eviction_policy_it_is_not_driven_with():
    from kvaudit.targets.sglang.config import legacy_refusal
    assert "a radix eviction policy other than lru" in legacy_refusal(SGLANG_PRESETS["sglang-evict-slru"].config())
    assert legacy_refusal(SglangConfig()) is None


@pytest.mark.parametrize("preset, feature", [
    ("sglang-spec-eagle", "speculative decoding"), ("sglang-swa-session", "SWA"),
    ("sglang-spec-swa", "SWA, speculative decoding"), ("sglang-mamba", "Mamba")])
def test_the_legacy_era_refuses_the_hybrid_and_speculative_paths_it_does_not_drive(preset, feature):
    """The cache_finished_req era's driver has no SWA, Mamba or speculative-decoding path: a preset with one
    and nothing else the era refuses (sglang-spec-eagle, sglang-swa-session) ran there as a plain session
    preset, clean, its own path never reached (the tester, on the 0.5.10.post1 overlay)."""
    from kvaudit.targets.sglang.config import legacy_refusal
    assert legacy_refusal(SGLANG_PRESETS[preset].config()).endswith(feature)


LEGACY_LISTED = {"sglang", "sglang-session", "sglang-session-nonstreaming"}


@pytest.mark.parametrize("version", ["0.5.10.post1", "0.5.11"])
def test_the_legacy_era_lists_only_the_presets_it_drives_and_says_why_of_the_rest(monkeypatch, tmp_path, version):
    """``kvaudit presets --target sglang`` listed all of them on the legacy overlays, which refuse SWA, Mamba,
    speculative and most other presets at a run's start; vLLM's kind lists only what the installed release
    drives (``refused``). Now SGLang's does too, and ``--preset sglang-mamba`` there says why and where."""
    from kvaudit.config import UnknownPresetError
    from kvaudit.history.catalogue import BUGS, target_config
    from kvaudit.targets import registry
    from kvaudit.targets.sglang.config import legacy_refusal

    monkeypatch.setattr(boot, "installed_version", lambda: version)
    kind = registry.get("sglang")
    assert set(kind.presets()) == LEGACY_LISTED
    assert all(legacy_refusal(p.config()) is None for p in kind.presets().values())
    with pytest.raises(UnknownPresetError) as e:
        kind.preset("sglang-mamba")
    why = (f'preset "sglang-mamba": SGLang 0.5.10.post1-0.5.11 (the cache_finished_req era) is driven with core pools, '
           "the radix cache and sessions (and PD decode with HiSparse), not chunked prefill, Mamba (driven on SGLang "
           f"0.5.22, 0.5.23; installed {version})")
    assert str(e.value) == why
    r = invoke("presets", "--target", "sglang")
    assert r.exit_code == 0 and "sglang-session" in r.output and "sglang-mamba" not in r.output, r.output
    r = invoke("fuzz", "--target", "sglang", "--preset", "sglang-mamba", "--max-time", "1", "--out", str(tmp_path))
    assert r.exit_code == 69 and one_error_line(r).endswith(why), r.output
    # the history suite's PD decode + HiSparse bug: its preset is driven there with the catalogue's overrides
    # only (the probe judges the config), and its replay file's preset is a preset of a release, not unknown
    assert target_config(BUGS["sglang-22882"]).enable_hisparse
    replay.load(os.path.join(os.path.dirname(__file__), "data", "sglang_history", "sglang-22882.json"))


@pytest.mark.parametrize("version, listed", [("0.5.19", 9), ("0.5.20", 10), ("0.5.23", len(SGLANG_PRESETS)),
                                             (None, len(SGLANG_PRESETS))])
def test_the_current_family_lists_what_its_release_drives(monkeypatch, version, listed):
    """0.5.19-0.5.21 drive the plain and PD-prefill paths only (kind.older_refusal); 0.5.22 on, and with no
    SGLang installed (nothing to judge by: the probe says it is missing), every preset."""
    from kvaudit.targets import registry

    monkeypatch.setattr(boot, "installed_version", lambda: version)
    kind = registry.get("sglang")
    assert len(kind.presets()) == listed
    assert (kind.refusal("sglang-mamba") is None) is (listed == len(SGLANG_PRESETS))
    assert kind.refusal("nope") is None


def test_an_older_current_release_s_refusal_names_a_file_not_a_python_name():
    """On 0.5.20 `--preset sglang-mamba` said `... Mamba (compat.OLDER_CURRENT)`: a name only kvaudit's own
    source knows; the line now points at the file that lists what those releases drive."""
    from kvaudit.targets.sglang.kind import older_refusal

    why = older_refusal(SGLANG_PRESETS["sglang-session"].config(), "0.5.20")
    assert why.endswith("not driven there: sessions (kvaudit/targets/sglang/compat.py)"), why
    assert older_refusal(SGLANG_PRESETS["sglang-session"].config(), "0.5.23") is None


def test_0_5_19_refuses_an_eviction_policy_config_it_would_drop():
    """0.5.19's CacheInitParams has no eviction_policy_config (0.5.20 added it): the driver left it out, so
    `sglang-evict-slru` ran SLRU with the release's defaults, not its preset's (docs60's reading)."""
    from kvaudit.targets.sglang.kind import older_refusal

    config = SGLANG_PRESETS["sglang-evict-slru"].config()
    assert config.radix_eviction_policy_config is not None
    assert "takes no --radix-eviction-policy-config" in older_refusal(config, "0.5.19")
    assert older_refusal(config, "0.5.20") is None
    assert older_refusal(SGLANG_PRESETS["sglang-evict-priority"].config(), "0.5.19") is None

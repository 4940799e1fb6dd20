"""The vLLM target's config (no vLLM needed): vLLM's start-up rule that the pool holds one request of
``max_model_len`` in every KV-cache group."""

import os
import sys

import pytest

from kvaudit.targets.vllm.config import VLLM_PRESETS, VllmConfig

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.mark.parametrize("name", list(VLLM_PRESETS))
def test_every_preset_holds_a_request_of_its_max_model_len(name):
    c = VLLM_PRESETS[name].config()
    assert c.blocks_per_request() <= c.num_gpu_blocks - 1
    assert c.context_len == c.max_model_len


def test_a_pool_too_small_for_max_model_len_is_refused_as_vllm_refuses_to_start():
    """24 blocks of 4 with a 8-token window: a 92-token request may hold 23 full-attention blocks and 11
    sliding-window ones. The driver once ran such a config: requests that can never fit waited for ever
    (a false hang), where a real vLLM would not have started."""
    with pytest.raises(ValueError, match="check_enough_kv_cache_memory"):
        VllmConfig(num_gpu_blocks=24, block_size=4, sliding_window=8, max_num_batched_tokens=32, max_model_len=92)
    ok = VllmConfig(num_gpu_blocks=24, block_size=4, sliding_window=8, max_num_batched_tokens=32, max_model_len=48)
    assert ok.blocks_per_request() == 12 + 10 + 1 == 23  # full cdiv(48, 4); window cdiv(7 + 32, 4) + 1
    # async scheduling keeps a second batch in flight: the window group reserves for both (cdiv(48, 4) + 1)
    with pytest.raises(ValueError, match="may need 25 blocks"):
        ok.replace(async_scheduling=True)
    with pytest.raises(ValueError, match="more than the pool's 15"):
        VllmConfig(num_gpu_blocks=16, block_size=4, max_num_batched_tokens=32, max_model_len=64)


@pytest.fixture
def release(monkeypatch):
    """Say which vLLM is installed (by its metadata, as kvaudit reads it before any import)."""
    from kvaudit.targets.vllm import boot

    def installed(version):
        monkeypatch.setattr(boot, "installed_version", lambda: version)
    return installed


@pytest.mark.parametrize("version, preset, needs", [
    ("0.30.0", "vllm-mamba", "vLLM >= 0.33.0"),
    ("0.16.0", "vllm-cpu-offload-swa", "vLLM >= 0.19.0"),
    ("0.20.0", "vllm-kv-push-fail", "vLLM >= 0.24.0"),
    (None, "vllm-mamba", "vLLM >= 0.33.0"),
])
def test_a_known_preset_the_installed_release_cannot_drive_says_which_release_can(release, tmp_path, version, preset,
                                                                                  needs):
    """vllm-mamba on vLLM 0.30.0 read 'unknown preset'; vllm-cpu-offload-swa was listed on 0.16.0, which has
    no SimpleCPUOffloadConnector (refused only once a run began)."""
    import json

    from cli_helpers import invoke, one_error_line
    from kvaudit.config import UnknownPresetError
    from kvaudit.targets import registry

    release(version)
    kind = registry.get("vllm")
    said = f'preset "{preset}": '
    assert preset in VLLM_PRESETS and preset not in kind.presets()  # known, not listed
    with pytest.raises(UnknownPresetError) as e:
        kind.preset(preset)
    assert str(e.value).startswith(said) and "unknown" not in str(e.value)
    assert f"{needs}" in str(e.value) and str(e.value).endswith(f", not {version}" if version else
                                                                "; vLLM is not installed"), e.value
    for args in (["fuzz", "--target", "vllm", "--preset", preset, "--max-time", "1", "--out", str(tmp_path)],
                 ["ci", "--target", "vllm", "--presets", f"vllm,{preset}", "--max-time", "1"]):
        r = invoke(*args)
        assert r.exit_code == 69 and said in one_error_line(r), r.output  # (a release this host lacks)
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"format": "kvaudit.replay/1", "config": {"target": "vllm", "preset": preset},
                                "program": [{"op": "idle"}]}))
    r = invoke("report", str(path))  # runs nothing: renders (tester 61a A4)
    assert r.exit_code == 0 and "no findings" in r.output.lower(), r.output
    if "vllm" not in sys.modules:  # (a vLLM an earlier test imported is the one a replay runs, whatever is faked)
        assert invoke("replay", str(path)).exit_code == 69  # the probe refuses what this release cannot run


@pytest.mark.parametrize("name", ["fault-skip-offload-flush.json", "fault-free-cow-source-before-copy.json",
                                  "own/vllm-46283.json"])
@pytest.mark.parametrize("version", [None, "0.20.0"])
def test_a_file_of_a_preset_another_release_drives_is_reported_and_exported_statically(release, tmp_path, name,
                                                                                       version):
    """(tester 61a A4: with no vLLM installed, `report` and `export --no-resolve` of these three shipped files
    exited 2, 'bad config: ... not none installed': the release check ran though nothing is driven)"""
    from cli_helpers import invoke

    release(version)
    path = os.path.join(ROOT, "corpora", "vllm", name)
    r = invoke("report", path)
    assert r.exit_code == 0 and "SUMMARY: kvaudit:" in r.output, r.output
    r = invoke("export", path, "--no-resolve", "--issue", str(tmp_path / "x.md"))
    assert r.exit_code == 0 and "statically (--no-resolve)" in r.output, r.output
    assert (tmp_path / "x.md").read_text().startswith("#")


def test_an_unknown_preset_is_still_unknown_and_a_drivable_one_is_listed(release):
    from kvaudit.config import UnknownPresetError
    from kvaudit.targets import registry

    release("0.33.0")
    kind = registry.get("vllm")
    assert {"vllm-mamba", "vllm-cpu-offload-swa"} <= set(kind.presets())
    assert kind.refusal("vllm-mamba") is None and kind.refusal("nope") is None
    with pytest.raises(UnknownPresetError, match='unknown preset "nope" for --target vllm; valid presets: vllm'):
        kind.preset("nope")

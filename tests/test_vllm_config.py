"""The vLLM target's config (no vLLM needed): vLLM's start-up rule that the pool holds one request of
``max_model_len`` in every KV-cache group."""

import pytest

from kvaudit.targets.vllm.config import VLLM_PRESETS, VllmConfig


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

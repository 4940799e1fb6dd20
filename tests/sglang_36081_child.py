"""Child process of ``tests/test_sglang_releases.py::test_sglang_36081_on_sglangs_own_tree_and_allocator``: sglang#36081
on SGLang's own SWA allocator, unified radix tree and ``Req`` of the installed release (0.5.18 or 0.5.19), with the
call order of ``SchedulerBatchResultProcessor.process_batch_result_prefill``: two requests of one family admitted in
one prefill batch (A: 30 tokens, B: A's first 12; an 8-token window, page 1), each matched and locked at admission
(``PrefillAdder``), then both checkpointed (``UnifiedRadixCache.cache_unfinished_req``) inside the batch's one free
group (argument ``ungrouped``: the control, no group). Prints the SWA slots in use, those the full-to-SWA
mapping of the full slots in use names, and the difference (slots no one can free). Not the driver (kvaudit's SWA
feature does not run on these releases yet): SGLang's objects called by hand, for issue 37's record
(corpora/sglang/README.md, "0.5.19 and sglang#36081")."""

import json
import os
import sys
import warnings
from array import array
from dataclasses import fields
from importlib.metadata import version
from types import SimpleNamespace

warnings.simplefilter("ignore")
os.environ.setdefault("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
from kvaudit.targets.sglang import boot  # noqa: E402

boot.prepare_import()
import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ReqKvInfo  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

WINDOW, FULL, SWA = 8, 256, 128
TOKENS = list(range(100, 130))


def build():
    """``kv_cache_configurator``'s hybrid SWA pool and allocator, and the tree through ``create_tree_cache``."""
    sa = ServerArgs(model_path="dummy", page_size=1, attention_backend="torch_native", chunked_prefill_size=-1)
    set_global_server_args_for_scheduler(sa)
    kv = SWAKVPool(size=FULL, size_swa=SWA, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=8,
                   swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu", enable_memory_saver=False)
    alloc = SWATokenToKVPoolAllocator(FULL, SWA, page_size=1, dtype=torch.bfloat16, device="cpu", kvcache=kv,
                                      need_sort=False)
    rows = ReqToTokenPool(size=8, max_context_len=64, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=alloc, page_size=1,
                             sliding_window_size=WINDOW)
    ctx = dict(server_args=sa, params=params, is_hybrid_swa=True, is_hybrid_ssm=False, enable_hierarchical_cache=False,
               disable_radix_cache=False, tp_worker=None, model_config=SimpleNamespace(), tp_size=1, tp_rank=0,
               tp_group=None, full_tokens_per_layer=FULL)
    if "effective_chunked_prefill_size" in {f.name for f in fields(TreeCacheBuildContext)}:
        ctx["effective_chunked_prefill_size"] = None
    return alloc, rows, create_tree_cache(TreeCacheBuildContext(**ctx))


def admit(alloc, rows, tree, rid, n):
    """A prefilled request of ``n`` tokens: its row and KV (``alloc_for_extend``), matched and locked at admission
    (``PrefillAdder``: nothing cached yet, so the root). 0.5.18 keeps the row and lengths on ``Req``, 0.5.19 on
    ``ReqKvInfo``."""
    r = Req(rid, "", array("i", TOKENS[:n]), SamplingParams(max_new_tokens=4))
    kv_row = hasattr(ReqKvInfo, "holds_kv")
    if not kv_row:
        r.kv = ReqKvInfo(kv_allocated_len=n, swa_evicted_seqlen=0)
    rows.alloc([r])
    if kv_row:
        r.kv.kv_allocated_len = r.kv.kv_committed_len = n
    else:
        r.kv_committed_len = n
    rows.req_to_token[r.kv.req_pool_idx if kv_row else r.req_pool_idx, :n] = alloc.alloc(n).to(torch.int32)
    r.output_ids = []
    r.full_untruncated_fill_ids = array("q", TOKENS[:n])
    r.set_extend_range(0, n)
    r.last_node = tree.match_prefix(MatchPrefixParams(key=RadixKey(TOKENS[:n]), req=r)).last_device_node
    lock = tree.inc_lock_ref(r.last_node)
    r.swa_uuid_for_lock = lock.swa_uuid_for_lock
    r.skip_lock_node_ids = getattr(lock, "skip_lock_node_ids", None)
    return r


def main():
    alloc, rows, tree = build()
    a, b = admit(alloc, rows, tree, "a", 30), admit(alloc, rows, tree, "b", 12)
    grouped = "ungrouped" not in sys.argv[1:]  # the control: the same frees, each at once
    if grouped:
        alloc.free_group_begin()  # process_batch_result_prefill's free group
    tree.cache_unfinished_req(a)
    tree.cache_unfinished_req(b)
    if grouped:
        alloc.free_group_end()
    used_full = torch.ones(FULL + 1, dtype=torch.bool)
    used_full[0] = False
    used_full[alloc.full_attn_allocator.free_pages] = False
    peers = alloc.full_to_swa_index_mapping[torch.nonzero(used_full).flatten()]
    mapped = set(peers[peers > 0].tolist())
    free = set(alloc.swa_attn_allocator.free_pages.tolist())
    used = set(range(1, SWA + 1)) - free
    print(json.dumps({"version": version("sglang"), "swa_used": len(used), "swa_mapped": len(mapped),
                      "unreachable": len(used - mapped), "mapped_but_free": len(mapped & free)}))


if __name__ == "__main__":
    main()

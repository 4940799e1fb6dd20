"""SGLang's rows of the history suite's catalogue (:mod:`kvaudit.history.catalogue`): its known public
KV-lifecycle bugs, each with the last release that ships it and the first that does not, and the ones the
suite does not rediscover. Facts from the releases' own code and the public trackers
(``../shared/reference/history-facts.md``)."""

from __future__ import annotations

from kvaudit.targets.catalogue import HistoryBug, Unreached

BUGS: tuple[HistoryBug, ...] = (
    # the three run on kvaudit's legacy driver family (kvaudit/targets/sglang/legacy.py); its Python
    # RadixCache is the era's only tree, so the tree_core override only keeps the reports honest
    HistoryBug(
        id="sglang-22273", engine="sglang",
        title="a streaming-session turn aborted before it runs is still treated as a session turn: it borrows the "
              "slot, overwrites its row and saves a 1-token KV back (the history is lost, session_held goes "
              "negative), or, queued beside the session's first turn, becomes the slot that turn then overwrites",
        sources=("sgl-project/sglang#22273",), buggy="0.5.10.post1", fixed="0.5.11", clean_because="fix",
        preset="sglang-session", config={"tree_core": "python"}, finding="leak",
        signature="/from:session",
        reach="a streaming session whose next turn is rejected at intake (its history no longer fits the context, "
              "or it asks for replace / offset / drop_previous_output): set_finish_with_abort leaves it queued "
              "with to_finish, match_prefix restores the slot into it, alloc_for_extend overwrites the row and "
              "cache_finished_req saves kv_committed_len=1 into the slot; the history's KV is unreachable"),
    HistoryBug(
        id="sglang-21875", engine="sglang",
        title="closing a streaming session while its turn decodes releases the slot's row and KV under the running "
              "turn (use-after-free), which then fails at finish on the slot's virtual node",
        sources=("sgl-project/sglang#21875",), buggy="0.5.10.post1", fixed="0.5.11", clean_because="fix",
        preset="sglang-session", config={"tree_core": "python"}, finding="use-after-free",
        signature="use-after-free/req_to_token_pool/request-kv/_close@session_controller.py",
        reach="a client closes a streaming session (/close_session) while that session's latest turn is still "
              "decoding: SessionController._close detaches the turn and release_session frees the row and KV "
              "the turn was restored into; the next decode writes into freed slots"),
    HistoryBug(
        id="sglang-22213", engine="sglang",
        title="the busy memory check counts a streaming session's borrowed KV twice (session_held and the running "
              "turn's uncached): a false 'Mem Leak Detected' while memory is intact",
        sources=("sgl-project/sglang#22213", "sgl-project/sglang#22753"), buggy="0.5.10.post1", fixed="0.5.11",
        clean_because="fix", preset="sglang-session", config={"tree_core": "python", "strict_mem_check_during_busy": True},
        finding="accounting-drift",
        signature="accounting-drift/token_to_kv_pool/engine_check",
        reach="a server run with SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY (the streaming-session CI does): any "
              "second turn of a streaming session that decodes while its slot lends it the KV; the assertion "
              "in self_check_during_busy stops the scheduler"),
    HistoryBug(
        id="sglang-22862", engine="sglang",
        title="a streaming session's retracted turn, retried, restores the slot one token short of what the slot "
              "holds (prefix_len = committed - 1): the KV past prefix_len is overwritten in the row and leaks",
        sources=("sgl-project/sglang#22862",), buggy="0.5.10.post1", fixed="0.5.11", clean_because="fix",
        preset="sglang-session", config={"tree_core": "python", "num_slots": 48, "new_token_ratio": 0.1},
        finding="leak",
        signature="leak/token_to_kv_pool/request-kv/from:retracted",
        reach="a streaming session's turn decoding when the KV pool runs short: retract_decode retracts it "
              "(release_kv_cache(is_insert=False) saves it into the session slot), its retry's match_prefix "
              "restores the slot with prefix_len = committed - 1 (init_next_round_input's 1-token reserve) and "
              "alloc_for_extend overwrites the row past prefix_len; the slot's last KV index is unreachable. The "
              "PR's other source, speculative over-allocation (allocated > committed), is not driven on the "
              "legacy family"),
    # kvaudit's own seed (engine_under_test's hisparse-prebuilt-skip-finish), on the legacy family's PD decode
    # with HiSparse (kvaudit/targets/sglang/legacy_pd.py); no preset lists this mode (0.5.23 refuses it)
    HistoryBug(
        id="sglang-22882", engine="sglang",
        title="on a PD decode server with HiSparse, a request that finishes in the prebuilt batch (a /health_generate "
              "check, or any 1-token request) is released without HiSparseCoordinator.request_finished: its "
              "device buffer pages and host slots leak",
        sources=("sgl-project/sglang#22882",), buggy="0.5.10.post1", fixed="0.5.11", clean_because="fix",
        preset="sglang-pd-decode",
        config={"enable_hisparse": True, "page_size": 64, "num_slots": 2048, "hisparse_device_buffer_size": 64,
                "transfer_latency_steps": 0, "max_running_requests": 4},
        finding="leak", signature="/request-kv/process_batch_result_prebuilt@scheduler_output_processor_mixin.py",
        reach="a load balancer's /health_generate on an idle PD decode server run with --enable-hisparse: the "
              "1-token check lands from the fake bootstrap host, admit_request_direct gives it a device buffer "
              "and process_batch_result_prebuilt finishes it with release_kv_cache alone; every check leaks a "
              "padded device buffer (two 64-token pages) and its host slot"),
    # the current driver family (0.5.22 and 0.5.23); a correctness bug, not a leak: SGLang's own integrity check
    # aborts a request whose KV kvaudit tracked as intact (kvaudit/targets/sglang/pd_checksum.py)
    HistoryBug(
        id="sglang-39500", engine="sglang",
        title="a PD decode server run with --disaggregation-enable-kv-checksum verifies a transfer's KV digest again "
              "at every join: a request retracted under memory pressure and restored from its host backup is "
              "re-digested after decode has written its own tokens into its last prompt page, and a healthy "
              "request is aborted with 'KV checksum mismatch' (a 500; in CI the scheduler raises)",
        sources=("sgl-project/sglang#39500",), buggy="0.5.22", fixed="0.5.23", clean_because="fix",
        preset="sglang-pd-decode", config={"num_slots": 128}, finding="accounting-drift", check="spurious-abort",
        reach="a PD decode server with the opt-in KV checksum (#39500) and the default cpu_tensor retraction backup: "
              "any request whose prompt does not end on a page boundary, retracted by decode when the pool runs "
              "short (retract_decode) and resumed (resume_retracted_reqs): at its next prebuilt batch "
              "_verify_kv_checksums digests the prompt's pages again, now holding decode's tokens, and "
              "_handle_kv_checksum_mismatch aborts it"),
    # the current family (0.5.22 and 0.5.23, kvaudit/targets/sglang/swa.py). No fixing PR found: the fix is the code
    # diff of mem_cache/common.py (#29860 brought in max(window, page)). The check names the cause; what follows
    # it in the same program is aliasing (after a prefill) or a use-after-free (at finish) of the tree's full KV
    HistoryBug(
        id="sglang-swa-evict-page-round", engine="sglang",
        title="on an SWA hybrid model whose window and window + 1 are both off the page grid, the out-of-window SWA "
              "eviction keeps max(window, page) tokens, not whole pages: the key a checkpoint inserts ends with "
              "less than a window of live SWA, the match after the insert stops short of it, and the request "
              "keeps as its own the KV the tree has just taken over (aliasing after a prefill; at finish "
              "release_kv_cache frees it under the tree: use-after-free, and the idle memory check fails)",
        sources=("sgl-project/sglang#29860",), buggy="0.5.22", fixed="0.5.23", clean_because="fix",
        preset="sglang-swa-unaligned", finding="unmatchable-prefix", check="swa-window-at-key-end",
        signature="/swa_token_to_kv_pool/",
        reach="one request on an SWA hybrid model with --page-size > 1 where (window + 1) mod page >= 2: SGLang's "
              "window is the config's (MiMo-V2, Llama 4's 8192 chunk) or the config's minus one (gpt-oss 127, "
              "Gemma 4095), so those models at power-of-two pages are safe; another page size or window is not. "
              "A prompt whose page-floored length lies less than a window past floor(length - 1 - window) (the "
              "prefill's checkpoint frees out of window by default: SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS), "
              "or a decode that stops so after its last window eviction: checkpoint_into_tree's re-match refuses the "
              "short live tail and cache_protected_len stays behind the inserted key"),
    # the current family (0.5.22 and 0.5.23 share the driver); the Mamba extra buffer (mamba.py)
    HistoryBug(
        id="sglang-39526", engine="sglang",
        title="with --enable-mixed-chunk and the Mamba extra buffer, a prefill that rides a mixed step loses its "
              "track fields in merge_batch: the forward writes no checkpoint state, yet the request's tracked "
              "ping-pong slot is donated to the tree as the state of its prefix (a later prefix hit restores "
              "a stale or never-written SSM state)",
        sources=("sgl-project/sglang#39342", "sgl-project/sglang#39526"), buggy="0.5.22", fixed="0.5.23",
        clean_because="fix", preset="sglang-mamba-mixed", finding="stale-kv", signature="/mamba-track-state",
        reach="a hybrid SSM model (Qwen3-Next / GDN) served with --enable-mixed-chunk and --mamba-radix-cache-strategy "
              "extra_buffer: a prompt (or its next chunk) of at least one mamba cache chunk arrives while other "
              "requests decode; mix_with_running drops its mamba_track_indices, and its checkpoint or final "
              "insert gives the tree the unwritten slot at mamba_last_track_seqlen"),
    # the current family's PD prefill path on 0.5.19 to 0.5.21 (pd_prefill.py, chunked); the fix is 0.5.22's
    # checkpoint_kv_cache (the next extend always resumes at extend_end), no merged PR names it
    HistoryBug(
        id="sglang-36855", engine="sglang",
        title="a chunked request that skips the radix-cache insert (skip_radix_cache_insert: its bootstrap_host is "
              "FAKE_BOOTSTRAP_HOST) never advances its prefix: maybe_cache_unfinished_req returns before the "
              "tree's cache_unfinished_req, so every chunk re-extends the prompt from the same prefix, allocates "
              "it again and overwrites the row; the earlier chunks' KV leaks (a livelock that ends in OOM)",
        sources=("sgl-project/sglang#36855", "sgl-project/sglang#33996", "sgl-project/sglang#37024"),
        buggy="0.5.21", fixed="0.5.22", clean_because="fix",
        preset="sglang-pd-prefill-chunked", config={"fake_bootstrap_every": 2}, finding="leak",
        reach="any client that sends bootstrap_host \"2.2.2.2\" (FAKE_BOOTSTRAP_HOST; a fake-prefill benchmark "
              "client does, and the field is the client's) with a prompt longer than --chunked-prefill-size, on a "
              "PD prefill server or an aggregated one: Req sets skip_radix_cache_insert from the host, "
              "maybe_cache_unfinished_req skips cache_unfinished_req, prefix_indices never grows and "
              "PrefillAdder.add_chunked_req schedules the first chunk again, each step leaking a chunk of KV"),
)

# what a release's overlay installs beside it (--no-deps): SGLang 0.5.11, 0.5.18 and 0.5.19 register 'qwen3_asr'
# without exist_ok (0.5.20 adds it), which transformers >= 5.7 also registers: its own pin, and the hub 1.x stack
_QWEN3_ASR_PIN = ("transformers==5.6.0", "huggingface_hub==1.33.0", "tokenizers==0.22.2", "httpx==0.28.1",
                  "httpcore==1.0.9")
PINS: dict[str, tuple[str, ...]] = {"0.5.11": _QWEN3_ASR_PIN, "0.5.18": _QWEN3_ASR_PIN, "0.5.19": _QWEN3_ASR_PIN}

UNREACHED: tuple[Unreached, ...] = (
    Unreached("sglang-0.5.22-pd-requeue-abort-release", "sglang",
              ("sglang 0.5.22 disaggregation/prefill.py::optimistic_release_and_requeue",), "0.5.22 -> 0.5.23",
              "0.5.22's requeue calls Scheduler._release_aborted_request (Session.abort_req, the multimodal "
              "inputs dropped), 0.5.23's only tree_cache.finish(ABORT); no KV difference: in both the release "
              "that follows ends in StreamingSession.try_cache_finished_req -> Session.finish_req, which clears "
              "the in-flight mark anyway (both reach corpora/sglang/crash-pd-prefill-requeued-first-turn-prefix-"
              "shrank.json), and the dropped multimodal inputs are no KV lifecycle kvaudit drives"),
    Unreached("sglang-28652", "sglang", ("sgl-project/sglang#28652",), "0.5.20 -> 0.5.21",
              "0.5.20's FakeKVSender (every FAKE_BOOTSTRAP_HOST request: warmup, /health_generate) inherits "
              "BaseKVSender.should_send_kv_chunk (num_pages > 0), so a last chunk with no page is never sent and "
              "the request never leaves the inflight queue; but a fake sender's decode prefix is always 0 "
              "(BaseKVSender.pop_decode_prefix_len), the match stops at input_len - 1 and every earlier send "
              "(a chunk, the early send of the cached prefix) ends page-aligned below it: the last chunk always "
              "carries a page. Driven on 0.5.20 (sglang-pd-prefill, health checks through SGLang's own "
              "FakeKVSender): concluded; a planted zero-page gate reads hang/-/idle/inflight:kv-transfer. The "
              "PR's other half, the waiting timeout, fails a bootstrapped request whose send never comes, which "
              "needs a request that never fits, which intake's max_new_tokens clip (0.5.20's "
              "init_req_max_new_tokens) rules out as far as read; random programs with health checks on 0.5.20 "
              "(sglang-pd-prefill, -chunked) stay clean"),
    Unreached("sglang-28374", "sglang", ("sgl-project/sglang#28374",), "all, to 0.5.23",
              "the PR was closed unmerged: no fixing release"),
    Unreached("sglang-10871", "sglang", ("sgl-project/sglang#10871",), "0.5.2-0.5.5",
              "the PR was closed 'DO NOT MERGE' and the path was refactored away in 0.5.5.post3: no "
              "confirmed bug/fix pair"),
    Unreached("sglang-9817", "sglang", ("sgl-project/sglang#9817",), "0.5.1 -> 0.5.2",
              "SGLang 0.5.1's API needs a third driver family (no release_kv_cache, no sessions)"),
    Unreached("sglang-9874", "sglang", ("sgl-project/sglang#9874",), "0.5.1 -> 0.5.2",
              "0.5.1's HiCache controller creates torch.cuda.Stream() at construction: needs a GPU or CUDA "
              "shims, and the 0.5.1 driver family"),
)

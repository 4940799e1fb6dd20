"""SGLang's own result processing: ``SchedulerBatchResultProcessor.process_batch_result_prefill`` and
``process_batch_result_decode`` (SGLang 0.5.23 ``srt/managers/scheduler_components/batch_result_processor.py``,
the component ``Scheduler.process_batch_result`` hands each batch's result to), run on the driver's
objects. The driver plays what needs a GPU or zmq: the model's result (``GenerationBatchResult`` with the
stand-in sampler's tokens), the batch as the processor reads it, and the detokenizer (the output streamer
is :class:`OutputRecorder`). A finished request's ``release_kv_cache`` goes through the target's
``_release`` (features' ``release`` hooks, injected faults), the one call the driver routes.

Also the output-after-abort oracle: once an aborted request's release ran (its abort processed), it gains
no output token.

Design notes: docs/internals/sglang.md ("Result processing")."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import torch

from kvaudit.targets.base import TargetFinding
from kvaudit.targets.sglang.intake import SglangIntake


class OutputRecorder:
    """The processor's ``output_streamer`` (``SchedulerOutputStreamer.stream_output``): what would be sent
    to the detokenizer is recorded, never sent. ``sent``: rid -> output tokens sent so far; ``finishes``:
    rid -> the finish reason's type name once its finish was sent."""

    def __init__(self):
        self.sent: dict[str, int] = {}
        self.finishes: dict[str, str] = {}
        self.batches = 0  # stream_output calls

    def stream_output(self, reqs, return_logprob: bool, skip_req=None) -> None:
        """Record each request's output (``skip_req``: the chunked one, not streamed)."""
        self.batches += 1
        for req in reqs:
            if req is skip_req:
                continue
            self.sent[req.rid] = len(req.output_ids)
            if req.finished() and req.rid not in self.finishes:
                self.finishes[req.rid] = type(req.finished_reason).__name__

    def _stream_output_generation(self, reqs, return_logprob: bool, skip_req=None, is_idle_batch: bool = False):
        self.stream_output(reqs, return_logprob, skip_req)


class MetricsStandIn:
    """The processor's ``metrics_reporter`` (``SchedulerMetricsReporter``) and ``metrics_collector``: the
    counters the processors bump, the reports dropped (no metrics endpoint here)."""

    num_generated_tokens = 0
    forward_ct_decode = 0

    def report_prefill_stats(self, **kwargs) -> None:
        pass

    def report_decode_stats(self, *args, **kwargs) -> None:
        pass

    def update_spec_metrics(self, *args, **kwargs) -> None:
        pass

    def increment_decode_cuda_graph_pass(self, value) -> None:
        pass

    def snapshot_spec_decode_metrics(self, batch, result) -> None:
        pass


class SpecWorkerStandIn:
    """The processor's ``model_worker`` as a spec-v2 worker reads it (``BaseSpecWorker.on_verify_complete_cpu``:
    the adaptive controller's feed, model-side)."""

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int) -> None:
        pass


def result_batch(S, kind: str, reqs: list, decoding, spec_algorithm=None,
                 mamba_track: bool = False) -> SimpleNamespace:
    """What the processors read of the ``ScheduleBatch`` that ran: ``reqs`` in batch order,
    ``decoding_reqs`` (mixed chunk's decode rows, as ``mix_with_running`` sets them), no logprobs, hidden
    states or grammar barrier. ``spec_algorithm``: the batch's ``SpeculativeAlgorithm`` (None: NONE), with
    which a decode batch's grammar requests are flagged (``has_grammar``: the spec-v2 FSM advances in
    ``advance_grammar_fsm``). ``mamba_track`` (the Mamba extra buffer): a decode batch's track fields as
    ``prepare_for_decode`` sets them when no row sits on a track boundary (the config keeps ``context_len``
    below the 256-token track interval); else no Mamba state."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    n = len(reqs)
    return SimpleNamespace(
        reqs=reqs, decoding_reqs=list(decoding) or None, return_logprob=False, return_hidden_states=False,
        return_hidden_states_mode=CaptureHiddenMode.NULL, spec_info=None,
        spec_algorithm=S.SpeculativeAlgorithm.NONE if spec_algorithm is None else spec_algorithm,
        forward_mode=S.ForwardMode.EXTEND if kind == "extend" else S.ForwardMode.DECODE, prefill_stats=None,
        dp_cooperation_info=None, forward_iter=0,
        has_grammar=spec_algorithm is not None and any(r.grammar is not None for r in reqs), batch_size=lambda: n,
        **(_no_track(reqs) if mamba_track and kind == "decode" else {"mamba_track_mask_cpu": None}))


def _no_track(reqs: list) -> dict:
    """``prepare_for_decode``'s extra-buffer fields for ``reqs``, none at a track boundary."""
    n = len(reqs)
    return {"mamba_track_mask_cpu": [False] * n, "mamba_track_mask_next_cpu": [False] * n,
            "mamba_decode_batch_idx_cpu": [r.decode_batch_idx for r in reqs], "mamba_track_buffer_indices": None}


RESULT_FAULTS = ("decode-token-after-abort", "decode-skip-release")  # planted inside SGLang's processor


def processor_class(S, faults: set):
    """SGLang's ``SchedulerBatchResultProcessor``, or, when ``faults`` holds a fault planted inside it
    (:data:`RESULT_FAULTS`), a subclass whose ``_handle_finish_state_updated_req`` (the decode result's
    per-request finish handling) carries the fault."""
    import sglang.srt.managers.scheduler_components.batch_result_processor as module

    if not faults & set(RESULT_FAULTS):
        return module.SchedulerBatchResultProcessor

    class Faulty(module.SchedulerBatchResultProcessor):
        __slots__ = ()

        def _handle_finish_state_updated_req(self, req, batch, result, i, logits_output):
            # decode-skip-release: the first finished request's release_kv_cache call in here is lost
            skip = "decode-skip-release" in faults and req.finished()
            if skip:
                faults.discard("decode-skip-release")
            with patch.object(module, "release_kv_cache", lambda *a, **k: None) if skip else nullcontext():
                super()._handle_finish_state_updated_req(req, batch, result, i, logits_output)
            # decode-token-after-abort: an aborted request's token is committed once more after its release
            # (the abort processed), as if the finish check ran before the commit
            if "decode-token-after-abort" in faults and isinstance(req.finished_reason, S.FINISH_ABORT):
                faults.discard("decode-token-after-abort")
                req.output_ids.append((req.output_ids or [2])[-1])

    return Faulty


class SglangResults(SglangIntake):
    """The driver's result processing through SGLang's processor (``self._results``); ``_aborted``: rid ->
    (request, output tokens at its release, the row it held) for the output-after-abort oracle."""

    def _results_processor(self):
        """SGLang's processor over this target's objects (built on first use: the features' ``attach``
        may have replaced the allocator's or tree's methods by then, never the objects)."""
        proc = getattr(self, "_results", None)
        if proc is None:
            from sglang.srt.disaggregation.utils import DisaggregationMode

            metrics = MetricsStandIn()
            self.output_recorder = OutputRecorder()
            self._aborted: dict[str, tuple] = {}
            mode = DisaggregationMode.DECODE if self.config.disaggregation_mode == "decode" else DisaggregationMode.NULL
            proc = self._results = processor_class(self.S, self._faults)(
                is_generation=True, disaggregation_mode=mode, enable_overlap=self.config.enable_overlap,
                enable_overlap_mlx=False, model_config=self.model_config, token_to_kv_pool_allocator=self.allocator,
                tree_cache=self.tree_cache, hisparse_coordinator=self._hisparse_coordinator(),
                req_to_token_pool=self.req_to_token_pool, decode_offload_manager=None, metrics_collector=metrics,
                metrics_reporter=metrics, draft_worker=None, model_worker=SpecWorkerStandIn(), logprob_result_processor=None,
                output_streamer=self.output_recorder, beam_coordinator=None, abort_request=self._abort)
        return proc

    @contextmanager
    def _releases_routed(self):
        """Inside it, the processor module's ``release_kv_cache`` is the target's ``_release`` (its features'
        ``release`` hooks and injected faults), recording each aborted request's release for the oracle; with
        a HiSparse coordinator, ``get_memory().enable_hisparse`` is set as on a HiSparse server (SGLang's
        scoped ``override``: the server args kvaudit publishes leave it off, for SGLang's other paths)."""
        import sglang.srt.managers.scheduler_components.batch_result_processor as module
        from sglang.srt.runtime_context import get_memory

        abort = self.S.FINISH_ABORT

        def release(req, tree_cache, is_insert: bool = True, *, checkpoint: bool | None = None) -> None:
            # checkpoint: 0.5.22's keyword-only flag; is_insert: the same flag before (change release-checkpoint)
            checkpoint = is_insert if checkpoint is None else checkpoint
            if isinstance(req.finished_reason, abort):
                self._aborted[req.rid] = (req, len(req.output_ids), req.kv.req_pool_idx)
            self._release(req, checkpoint)

        hisparse = nullcontext() if self._hisparse_coordinator() is None else get_memory().override(enable_hisparse=True)
        with patch.object(module, "release_kv_cache", release), hisparse:
            yield

    def _process_by_sglang(self, kind: str, reqs: list, decoding=()) -> None:
        """``Scheduler.process_batch_result`` for an extend or decode batch: SGLang's processor, then the
        event loop's own part (the driver's): unfinished prefilled requests join the running batch
        (``_prefilled``; ``decoding`` rows rejoin it without overlap), a decode batch's finished ones leave."""
        proc = self._results_processor()
        self._result_batches = getattr(self, "_result_batches", 0) + 1
        # the requests whose prefill result this is (not skipped, not a middle chunk)
        fresh = [r for r in reqs if not (r.finished() and r.inflight_middle_chunks <= 0) and not r.is_retracted
                 and r.inflight_middle_chunks <= 0] if kind == "extend" else []
        algo = self._spec_algorithm()
        batch = result_batch(self.S, kind, reqs, decoding, None if algo.is_none() else algo,
                             self.config.mamba_extra_buffer)
        result = self._model_result(kind, batch)
        with self._releases_routed():
            if kind == "extend":
                proc.process_batch_result_prefill(batch, result)
            else:
                proc.process_batch_result_decode(batch, result)
        for req in fresh:  # get_next_batch_to_run's merge of the last batch, for the event loop's order
            if req.finished():
                continue
            if any(req is d for d in decoding):
                if not self.config.enable_overlap:  # (under overlap the last-batch merge brings it back)
                    self.running.append(req)
            else:
                self._prefilled(req)
        if kind == "decode":
            self.running = [r for r in self.running if not r.finished()]

    def _model_result(self, kind: str, batch):
        """The model's ``GenerationBatchResult`` for ``batch`` (what the processors read): the stand-in sampler's
        token per request."""
        from sglang.srt.managers.utils import GenerationBatchResult

        tokens = [self._sample(r) for r in batch.reqs]
        return GenerationBatchResult(next_token_ids=torch.tensor(tokens, dtype=torch.int64))

    def output_after_abort(self) -> list[TargetFinding]:
        """The oracle: a request whose abort was processed (its ``release_kv_cache`` ran with a
        ``FINISH_ABORT``) gained an output token since (``use-after-free`` of its row: the token was computed
        over released KV), checked ``output-after-abort``."""
        out = []
        for rid, (req, n, row) in getattr(self, "_aborted", {}).items():
            if len(req.output_ids) > n:
                units = np.array([row] if row is not None else [], dtype=np.int64)
                out.append(TargetFinding(
                    "use-after-free", "req_to_token_pool", units,
                    f"request {rid} gained {len(req.output_ids) - n} output token(s) after its abort was processed "
                    f"(release_kv_cache ran with {n} tokens; {self.output_recorder.sent.get(rid, 0)} sent)",
                    check="output-after-abort"))
        return out

    def invariant_findings(self) -> list[TargetFinding]:
        """:meth:`output_after_abort`."""
        return self.output_after_abort()

    def results_reach(self) -> dict[str, int]:
        """Path counters: batch results SGLang's processor handled, aborted requests it released."""
        return {"sglang_result_batches": getattr(self, "_result_batches", 0),
                "aborts_processed": len(getattr(self, "_aborted", ()))}

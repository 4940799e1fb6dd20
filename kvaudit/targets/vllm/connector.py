"""vLLM's Scheduler with a KV connector of vLLM's (the ``kv_connector`` presets): its SCHEDULER role is vLLM's own,
built by the Scheduler; its WORKER role a kvaudit stand-in on the step clock (no memory moved): each transfer
completes 1 to ``kv_transfer_latency_steps`` steps after it starts (:class:`StepClock`), reported once through
``ModelRunnerOutput.kv_connector_output``.

``NixlConnector`` (:class:`NixlWorkerStandIn`): its scheduler half (``nixl/pull_scheduler.py``) is plain Python
(its thread starts only in ``set_xfer_handshake_metadata``, never called here) with the whole contract: a
``do_remote_prefill`` request (a decode instance's) waits in ``WAITING_FOR_REMOTE_KVS`` with its blocks until a
``finished_recving``; a ``do_remote_decode`` one (a prefill instance's) keeps its blocks after ``request_finished``
until a ``finished_sending``; the ``kv_both`` role is a consumer (``deferred_frees`` with async scheduling). The
``n``-th submit (from 1) loads remote KV when ``n % 3 == 1``, sends it when ``n % 3 == 2`` (:func:`transfer_params`).

Failures (presets with ``kv_load_failure_policy``, :meth:`VllmConnectorTarget.apply`): a failed read is reported
as ``NixlBaseConnectorWorker.get_transfer_results`` does in 0.33.0 (``nixl/base_worker.py``): in
``finished_recving``, its blocks in ``invalid_block_ids`` and, from 0.30.0 (compat "failed-recving"), in
``failed_recving``; a failed send ends as on lease expiry (``_reap_expired_send_leases``): in ``finished_sending``
at its due step. ``memory_pressure`` reports the cached blocks running requests hold invalid (as a connector that
loaded them synchronously would). Other stand-ins: ``SimpleCPUOffloadConnector`` (:class:`OffloadWorkerStandIn`),
``OffloadingConnector`` (:class:`OffloadingWorkerStandIn`), ``LMCacheMPConnector`` and kvaudit's save connector
(:class:`SaveWorkerStandIn`), ``MultiConnector`` (:class:`MultiWorkerStandIn`).
"""

from __future__ import annotations

import zlib
from collections import Counter
from types import SimpleNamespace

import numpy as np

from kvaudit.program import MemoryPressure, TransferFail
from kvaudit.targets.base import TargetFinding
from kvaudit.targets.vllm.config import NIXL, OFFLOADING
from kvaudit.targets.vllm.observer import POOL, after_call, count
from kvaudit.targets.vllm.target import VllmSchedulerTarget

REMOTE_ENGINE = "kvaudit-remote"  # the other instance of the P/D pair (never contacted)


def transfer_params(n: int, rid: str, prompt_len: int, block_size: int) -> dict | None:
    """``kv_transfer_params`` of the ``n``-th submit (request ``rid``, ``prompt_len`` tokens), as a P/D
    proxy writes them (see the module docstring for which submits get which), or None."""
    if n % 3 == 1:  # decode instance: the prompt's KV is read from the remote prefill instance
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [list(range(1, 1 + -(-prompt_len // block_size)))],
                "remote_engine_id": REMOTE_ENGINE, "remote_request_id": f"remote-{rid}",
                "remote_host": "localhost", "remote_port": 1, "tp_size": 1}
    if n % 3 == 2:  # prefill instance: the remote decode instance reads this request's KV when it ends
        return {"do_remote_prefill": False, "do_remote_decode": True}
    return None


class ArrivalOrder(set):
    """A set of request ids that iterates them sorted (``req-000012``: arrival order): what a worker stand-in
    reports in ``finished_sending`` / ``finished_recving`` / ``failed_recving``. vLLM frees in their iteration
    order (``Scheduler._update_from_kv_xfer_finished``); a plain set of str iterates in ``PYTHONHASHSEED``'s."""

    def __iter__(self):
        return iter(sorted(set.__iter__(self)))


class StepClock:
    """A worker stand-in's clock: a transfer keyed ``key`` started at ``step`` is due at ``step + 1 + crc32(key) %
    latency_steps``; ``len``: the transfers in flight."""

    loading: dict = {}  # request id -> [n] int64 GPU blocks its outstanding load writes (none by default)

    def __init__(self, latency_steps: int):
        self.latency_steps = latency_steps

    def due(self, key, step: int) -> int:
        return step + 1 + zlib.crc32(str(key).encode()) % self.latency_steps

    @staticmethod
    def split(queue: list, step: int) -> tuple[list, list]:
        """``(keys due by step, the rest)`` of ``queue``, ``(key, step due)`` pairs in start order."""
        return [k for k, due in queue if due <= step], [(k, due) for k, due in queue if due > step]

    def __len__(self) -> int:
        return len(self.recving) + len(self.sending)


class NixlWorkerStandIn(StepClock):
    """The worker role of ``NixlConnector`` (module docstring); a load completes even when its request was aborted.
    ``recving`` / ``sending``: request id -> step due; ``to_process``: ``NixlPullConnectorWorker._reqs_to_process``;
    ``failing``: requests whose next report is a failure; ``invalid``: block ids the next output reports invalid;
    ``faults``, ``reached``: the target's. ``push`` (``NixlPushConnector``): a read is the prefill side's write; a
    failed one is never reported (0.33.0's ``nixl/push_worker.py`` reports only on the writer's notification, the
    scheduler's watchdog drops the registration silently)."""

    def __init__(self, latency_steps: int, awaiting_field: bool = True, failed_field: bool = False,
                 faults: set | None = None, reached: Counter | None = None, push: bool = False):
        super().__init__(latency_steps)
        self.push = push
        self.awaiting_field = awaiting_field and not push  # ReqMeta.awaiting_kvs is read (pull, vLLM >= 0.30.0)
        self.failed_field = failed_field  # KVConnectorOutput.failed_recving exists (vLLM >= 0.30.0)
        self.faults = set() if faults is None else faults
        self.reached = Counter() if reached is None else reached
        self.failing: set[str] = set()
        self.invalid: set[int] = set()
        self.recving: dict[str, int] = {}
        self.loading: dict[str, np.ndarray] = {}  # rid -> [n] int64 local blocks its outstanding read writes
        self.sending: dict[str, int] = {}
        self.to_process: set[str] = set()

    def start(self, meta, step: int) -> None:
        """Take one ``NixlConnectorMetadata`` (``start_load_kv``): reads that await KV start; readable requests
        (``reqs_in_batch``, less ``reqs_not_processed``) in ``reqs_to_send`` start being read."""
        if meta is None:
            return
        for rid, m in meta.reqs_to_recv.items():
            # a full local hit or an aborted request's cleanup only notifies: ``awaiting_kvs`` from vLLM
            # 0.30.0 (compat "nixl-awaiting-kvs"); before, such a read has no local block
            awaiting = m.awaiting_kvs if self.awaiting_field else any(m.local_block_ids)
            if awaiting:
                self.recving[rid] = self.due(rid, step)
                # per KV-cache group (a list of lists) in later releases, one flat list in 0.15/0.16
                ids = [b for g in m.local_block_ids for b in (g if isinstance(g, (list, tuple)) else [g])]
                self.loading[rid] = np.array(ids, dtype=np.int64)
        self.to_process |= meta.reqs_in_batch
        self.to_process -= meta.reqs_not_processed
        for rid in meta.reqs_to_send:
            if rid in self.to_process:
                self.sending[rid] = self.due(rid, step)

    def finished(self, step: int, output_cls):
        """The ``KVConnectorOutput`` of the transfers done by ``step`` (each reported once) and of the
        blocks found invalid (module docstring), or None."""
        recv = {r for r, due in self.recving.items() if due <= step}
        send = {r for r, due in self.sending.items() if due <= step}
        if not recv and not send and not self.invalid:
            return None
        failed = (recv | send) & self.failing
        self.failing -= failed
        failed_recv, invalid = recv & failed, self.invalid
        self.invalid = set()
        lost = set(failed_recv) if self.push else set()
        if failed_recv - lost and "lose-failed-load" in self.faults:  # the fault: the worker only logs it
            self.faults.discard("lose-failed-load")
            lost.add(min(failed_recv))
        invalid |= {b for r in failed_recv - lost for b in self.loading[r].tolist()}
        for r in recv:  # lost ones too: never reported
            del self.recving[r]
            self.loading.pop(r, None)
        recv, failed_recv = recv - lost, failed_recv - lost
        for r in send:
            del self.sending[r]
            self.to_process.discard(r)
        self.reached.update(failed_transfers=len(failed), invalid_blocks=len(invalid), kv_loads_done=len(recv - failed),
                            kv_sends_done=len(send - failed))
        extra = {"failed_recving": failed_recv} if self.failed_field else {}
        return output_cls(finished_sending=send or None, finished_recving=recv or None, invalid_block_ids=invalid,
                          **extra)


class SaveWorkerStandIn(StepClock):
    """The worker side of kvaudit's save connector (:mod:`kvaudit.targets.vllm.save_connector`): each id in a
    step's ``reqs_to_send`` is reported in ``finished_sending`` when due, once per save. No loads."""

    recving: dict = {}

    def __init__(self, latency_steps: int):
        super().__init__(latency_steps)
        self.sending: list[tuple[str, int]] = []  # (rid, step due), in start order
        self.saved: set[str] = set()  # LMCacheMPConnector's finished requests seen (start_finished)

    def start(self, meta, step: int) -> None:
        for rid in getattr(meta, "reqs_to_send", ()):
            self.sending.append((rid, self.due(rid, step)))

    def start_finished(self, out, step: int) -> None:
        """``LMCacheMPConnector``'s worker (``LMCacheMPWorkerAdapter.get_finished``) with ``SchedulerOutput``
        ``out``: each of its ``finished_req_ids`` is saved once (async scheduling may repeat one)."""
        new = set(out.finished_req_ids) - self.saved
        self.saved |= new
        self.start(SimpleNamespace(reqs_to_send=sorted(new)), step)

    def finished(self, step: int, output_cls):
        due, self.sending = self.split(self.sending, step)
        if not due:
            return None
        # one report per save: a second save of an id waits for the next step's output
        send = set(due)
        self.sending.extend((rid, step + 1) for rid in (Counter(due) - Counter(send)).elements())
        return output_cls(finished_sending=send, finished_recving=None)


class OffloadWorkerStandIn(StepClock):
    """The worker role of ``SimpleCPUOffloadConnector`` (``simple_kv_offload/worker.py``): a step's load and store
    events (monotonic indices) are due by :meth:`due`, in order per kind (one CUDA stream each), reported in
    ``finished_recving`` (``load_event_to_reqs``) and ``completed_store_events``; ``need_flush`` completes every
    outstanding one first. No transfer fails. ``loads`` / ``stores``: ``(event index, step due)``, in order.
    ``reached``: the target's, counting ``offload_stores`` / ``offload_loads`` (events started) and
    ``offload_flushes`` (``need_flush`` with a transfer outstanding)."""

    def __init__(self, latency_steps: int, reached: Counter):
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata
        super().__init__(latency_steps)
        self.worker_meta, self.reached = SimpleCPUOffloadWorkerMetadata, reached
        self.reached.update(offload_stores=0, offload_loads=0, offload_flushes=0)
        self.loads: list[tuple[int, int]] = []
        self.stores: list[tuple[int, int]] = []
        self.load_reqs: dict[int, list[str]] = {}  # the latest metadata's load_event_to_reqs (no ``loading``:
        # the scheduler side pins its loads' blocks itself)

    recving = property(lambda self: self.loads)
    sending = property(lambda self: self.stores)

    def _due(self, queue: list, kind: str, event: int, step: int) -> int:
        due = self.due(f"{kind}{event}", step)
        return max(due, queue[-1][1]) if queue else due

    def start(self, meta, step: int) -> None:
        if meta is None:
            return
        if meta.need_flush:
            self.reached["offload_flushes"] += bool(self.loads or self.stores)
            self.loads = [(e, min(d, step)) for e, d in self.loads]
            self.stores = [(e, min(d, step)) for e, d in self.stores]
        self.load_reqs = dict(meta.load_event_to_reqs)
        if meta.load_event >= 0:
            self.loads.append((meta.load_event, self._due(self.loads, "load", meta.load_event, step)))
            self.reached["offload_loads"] += 1
        if meta.store_event >= 0:
            self.stores.append((meta.store_event, self._due(self.stores, "store", meta.store_event, step)))
            self.reached["offload_stores"] += 1

    def finished(self, step: int, output_cls):
        """The ``KVConnectorOutput`` of the transfers done by ``step`` (each reported once), or None."""
        (loads, self.loads), (stores, self.stores) = self.split(self.loads, step), self.split(self.stores, step)
        if not loads and not stores:
            return None
        recv = {rid for e in loads for rid in self.load_reqs.get(e, ())}
        meta = self.worker_meta(completed_store_events={e: 1 for e in stores}) if stores else None
        return output_cls(finished_recving=recv or None, kv_connector_worker_meta=meta)


class OffloadingWorkerStandIn(StepClock):
    """The worker role of the job-based ``OffloadingConnector`` (``offloading/worker.py``): each store or load job
    is due by :meth:`due`, one in ``jobs_to_flush`` at once, reported in ``completed_jobs`` (a load also in
    ``finished_recving``). ``jobs``: job id -> ``(step named, step due, request id, load, [n] int64 GPU
    blocks)``. The fault ``skip-offload-flush`` drops the first flush of an older store."""

    def __init__(self, latency_steps: int, faults: set, reached: Counter):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        super().__init__(latency_steps)
        self.faults, self.reached = faults, reached
        self.worker_meta = OffloadingWorkerMetadata
        self.jobs: dict[int, tuple[int, int, str, bool, np.ndarray]] = {}
        self.reached.update(offload_stores=0, offload_loads=0, offload_flushes=0)

    recving = property(lambda self: [j for j, job in self.jobs.items() if job[3]])
    sending = property(lambda self: [j for j, job in self.jobs.items() if not job[3]])
    loading = property(lambda self: {rid: blocks for _, _, rid, load, blocks in self.jobs.values() if load})

    def start(self, meta, step: int) -> None:
        flush = set(meta.jobs_to_flush or ()) if meta is not None else set()
        older = {j for j in flush if j in self.jobs and not self.jobs[j][3]}
        if older and "skip-offload-flush" in self.faults:
            self.faults.discard("skip-offload-flush")
            flush -= older
        for j in flush & set(self.jobs):
            self.jobs[j] = (self.jobs[j][0], step, *self.jobs[j][2:])
        for load, jobs in ((True, meta.load_jobs), (False, meta.store_jobs)) if meta is not None else ():
            for j, job in jobs.items():
                due = step if j in flush else self.due(j, step)
                spec = job.dst_spec if load else job.src_spec
                self.jobs[j] = (step, due, job.req_id, load, np.asarray(spec.block_ids, dtype=np.int64))
                self.reached["offload_loads" if load else "offload_stores"] += 1
        self.reached["offload_flushes"] += len(flush)

    def reading(self, allocated: set[int], step: int) -> tuple[int, str, int] | None:
        """``(job id, request id, block)`` of a store named before ``step``, unfinished, reading a block of
        ``allocated`` (what this step's ``schedule()`` reallocated); None if there is none."""
        for j, (named, due, rid, load, blocks) in self.jobs.items():
            hit = [int(b) for b in blocks if int(b) in allocated]
            if not load and named < step < due and hit:
                return j, rid, hit[0]
        return None

    def finished(self, step: int, output_cls):
        done = [j for j, (_, due, *_) in self.jobs.items() if due <= step]
        if not done:
            return None
        jobs = [self.jobs.pop(j) for j in done]
        recv = {rid for _, _, rid, load, _ in jobs if load}
        return output_cls(finished_recving=recv or None,
                          kv_connector_worker_meta=self.worker_meta(completed_jobs={j: 1 for j in done}))


class MultiWorkerStandIn(StepClock):
    """The worker role of ``MultiConnector`` over ``parts``, one stand-in per sub-connector given its metadata;
    outputs merged. Only NIXL delays a free, so there are no ``extra_async_saves``."""

    def __init__(self, parts: list):
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorWorkerMetadata
        self.parts, self.worker_meta = parts, MultiKVConnectorWorkerMetadata

    recving = property(lambda self: [x for p in self.parts for x in p.recving])
    sending = property(lambda self: [x for p in self.parts for x in p.sending])
    loading = property(lambda self: {r: b for p in self.parts for r, b in p.loading.items()})

    def start(self, meta, step: int) -> None:
        for part, m in zip(self.parts, meta.metadata if meta is not None else [None] * len(self.parts)):
            part.start(m, step)

    def finished(self, step: int, output_cls):
        outs = [p.finished(step, output_cls) for p in self.parts]
        if all(o is None for o in outs):
            return None
        merged = {f: set().union(*(getattr(o, f) or () for o in outs if o is not None)) or None
                  for f in ("finished_sending", "finished_recving", "invalid_block_ids")}
        merged["invalid_block_ids"] = merged["invalid_block_ids"] or set()
        metas = tuple(o.kv_connector_worker_meta if o is not None else None for o in outs)
        return output_cls(**merged, kv_connector_worker_meta=self.worker_meta(metas) if any(metas) else None)


def offload_holders(manager) -> list[tuple[str, str, np.ndarray]]:
    """The GPU-block references ``SimpleCPUOffloadScheduler`` (``manager``; ``simple_kv_offload/manager.py``)
    holds, ``(owner, where, [n] int64 ids)``, one per id: stores in flight (``_store_event_to_blocks``,
    ``_abandoned_store_event_to_blocks``), queued (``_pending_finished_stores``, 0.33.0), and loads
    (``_reqs_to_load``, ``_abandoned_reqs_to_load``). Names missing in a release (or no ``manager``) count as empty."""
    held = [(f"offload-store:{e}", t) for name in ("_store_event_to_blocks", "_abandoned_store_event_to_blocks")
            for e, t in getattr(manager, name, {}).items()]
    held += [(f"offload-store:pending{i}", t) for i, t in enumerate(getattr(manager, "_pending_finished_stores", ()))]
    held += [(f"offload-load:{rid}", s.transfer_meta) for name in ("_reqs_to_load", "_abandoned_reqs_to_load")
             for rid, s in getattr(manager, name, {}).items() if s.transfer_meta is not None]
    out = [(owner, "offload", np.asarray(t.gpu_block_ids, dtype=np.int64)) for owner, t in held]
    return [h for h in out if h[2].size]


class VllmConnectorTarget(VllmSchedulerTarget):
    """:class:`~kvaudit.targets.vllm.target.VllmSchedulerTarget` with a KV connector (module docstring)."""

    def __init__(self, config):
        super().__init__(config)
        if config.kv_connector in NIXL:
            self.worker = NixlWorkerStandIn(config.kv_transfer_latency_steps, self.V.has("nixl-awaiting-kvs"),
                                            self.V.has("failed-recving"), self._faults, self.reached,
                                            push=config.kv_connector == "NixlPushConnector")
            self.reached.update(failed_transfers=0, invalid_blocks=0, kv_loads_done=0, kv_sends_done=0)
        elif config.kv_connector == "SimpleCPUOffloadConnector":
            self.worker = OffloadWorkerStandIn(config.kv_transfer_latency_steps, self.reached)
        elif config.kv_connector in OFFLOADING:
            self.offload = OffloadingWorkerStandIn(config.kv_transfer_latency_steps, self._faults, self.reached)
            self.worker = self.offload if config.kv_connector == "OffloadingConnector" else MultiWorkerStandIn(
                [NixlWorkerStandIn(config.kv_transfer_latency_steps, faults=self._faults), self.offload])
            self._watch_offloading()
        else:
            self.worker = SaveWorkerStandIn(config.kv_transfer_latency_steps)
        self._load_violations: list = []  # inflight-load findings seen as their load reported done
        self.finished_calls: dict[str, list[str]] = {}  # rid -> request status at each request_finished
        self.reached["connector_held_frees"] = 0
        self._count_request_finished(self.scheduler.connector)

    def _watch_offloading(self) -> None:
        """Wrap the pool's ``get_new_blocks`` (what each ``schedule()`` reallocates: ``inflight-store``) and the
        connector's ``take_events`` (CPU-tier events replayed into ``cpu_events``, (hash, group) -> chunks)."""
        self.allocated, self.store_findings, self.cpu_events = set(), [], Counter()
        connector = self.scheduler.connector
        take = connector.take_events

        def take_events(*a, **k):
            events = list(take(*a, **k))
            self._replay_events(events, self.cpu_events)
            return events

        connector.take_events = take_events
        after_call(self.pool, "get_new_blocks", lambda out, *a, **k: self.allocated.update(b.block_id for b in out))

    def _count_request_finished(self, connector) -> None:
        """Record each ``request_finished`` / ``request_finished_all_groups`` the Scheduler makes on the
        connector *instance* (the outer call only: one may call the other)."""
        depth = [0]

        def counted(fn):
            def call(request, *a, **k):
                depth[0] += 1
                try:
                    if depth[0] == 1:
                        self.finished_calls.setdefault(request.request_id, []).append(request.status.name)
                    out = fn(request, *a, **k)
                    self.reached["connector_held_frees"] += depth[0] == 1 and bool(out[0])
                    return out
                finally:
                    depth[0] -= 1
            return call

        for name in ("request_finished", "request_finished_all_groups"):
            if hasattr(connector, name):
                setattr(connector, name, counted(getattr(connector, name)))

    def apply(self, op) -> None:
        """:meth:`VllmSchedulerTarget.apply`; with ``kv_load_failure_policy``, ``transfer_fail`` fails the next
        transfer report of request ``handle`` (:meth:`_abort`'s pick), ``memory_pressure`` (module docstring)."""
        if self.config.kv_load_failure_policy is not None:
            if isinstance(op, TransferFail):
                self.worker.failing |= set(self._abort(op.handle))
            elif isinstance(op, MemoryPressure):
                self.worker.invalid |= {b.block_id for r in self.scheduler.running for b in
                                        self.groups[0].req_to_blocks.get(r.request_id, ())
                                        if b.block_hash is not None and not b.is_null}
        super().apply(op)

    def reach(self) -> dict[str, int]:
        """:meth:`VllmSchedulerTarget.reach`; without ``kv_load_failure_policy`` no transfer fails and no block is
        reported invalid (only :meth:`apply` fails them), so ``failed_transfers`` and ``invalid_blocks`` are not
        given: at 0 there they would read as paths a longer search could reach."""
        out = super().reach()
        if self.config.kv_load_failure_policy is None:
            out.pop("failed_transfers", None), out.pop("invalid_blocks", None)
        return out

    def connector_holders(self) -> list:  # (only SimpleCPUOffloadConnector has a scheduler_manager)
        return offload_holders(getattr(self.scheduler.connector, "scheduler_manager", None))

    def invariant_findings(self) -> list:
        out = (super().invariant_findings() + (self._load_violations[:1] or self._inflight_load_findings())
               + self._finished_once_findings())
        offloading = self.config.kv_connector in OFFLOADING
        return out + self.store_findings[:1] + self._cpu_event_findings() if offloading else out

    def _cpu_event_findings(self) -> list:
        """The offloading connector's CPU-tier KV-cache events, taken and still queued (``CPUOffloadingManager.
        events``), replay to the chunks its cache policy holds ready (check ``kv-events:cpu``)."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as convert
        from vllm.v1.kv_offload.base import get_offload_block_hash as block_hash, get_offload_group_idx as group
        connector = self.scheduler.connector
        manager = getattr(connector, "_connectors", [connector])[-1].connector_scheduler.manager
        replayed = Counter(self.cpu_events)
        for e in (e for e in manager.events or () if not getattr(e, "metadata_only", False)):
            count(replayed, [(convert(block_hash(k)), group(k)) for k in e.keys], -1 if e.removed else 1)
        real = Counter((convert(block_hash(k)), group(k)) for k, c in manager._policy.chunks.items() if c.is_ready)
        if real == replayed:
            return []
        return [TargetFinding("accounting-drift", POOL, np.array([1], dtype=np.int64),
                              f"the offloading connector's CPU KV-cache events replayed give {sum(replayed.values())} "
                              f"chunks, its CPU tier holds {sum(real.values())} ready "
                              f"({len((real - replayed) or (replayed - real))} differ)", check="kv-events:cpu")]

    def _inflight_load_findings(self) -> list:
        """vLLM's contract for a read in flight (the fix of vLLM #32255, in 0.16.0): every local block an
        outstanding KV load writes stays in its request's tables until ``finished_recving`` (else the load
        writes a free block, or another request's: a use-after-free)."""
        known = self.known() if self.worker.loading else {}
        for rid, blocks in self.worker.loading.items():
            lost = blocks[~self._held(rid)[blocks]] if rid in known else blocks
            if lost.size:
                b = int(lost[0])
                return [TargetFinding("use-after-free", POOL, lost,
                                      f"block {b} was freed while req:{rid}'s KV load still writes it "
                                      f"(ref_cnt={self._ref_counts()[b]}, no finished_recving yet)",
                                      check="inflight-load", free_sites=self.free_sites(b),
                                      used_by=(f"req:{rid}'s KV load in flight",))]
        return []

    def _finished_once_findings(self) -> list:
        """The connector API's contract (``KVConnectorBase_V1.request_finished``, whose ``delay_free_blocks``
        promises one ``finished_sending``): one call per request. A second (vLLM #33377, fixed in 0.16.0)
        starts a second send of blocks the first one frees: a double free."""
        for rid, calls in self.finished_calls.items():
            if len(calls) > 1:
                blocks = [b.block_id for mgr in self.groups for b in mgr.req_to_blocks.get(rid, ()) if not b.is_null]
                return [TargetFinding("double-free", POOL, np.array(blocks or [1], dtype=np.int64),
                                      f"the connector's request_finished was called {len(calls)} times for "
                                      f"req:{rid} (statuses {', '.join(calls)})", check="finished-once")]
        return []

    def _extra_args(self, rid: str, prompt_len: int) -> dict | None:
        if self.config.kv_connector not in (*NIXL, "MultiConnector"):
            return None
        params = transfer_params(len(self.submitted) + 1, rid, prompt_len, self.config.block_size)
        return None if params is None else {"kv_transfer_params": params}

    def step(self) -> None:
        """:meth:`VllmSchedulerTarget.step`; with ``wake_for_transfers``, an engine with nothing to schedule but
        transfers outstanding (vLLM < 0.22.0 stops then, #43433) runs an empty schedule that reports them."""
        s = self.scheduler
        if self.config.wake_for_transfers and not s.has_requests() and not self.batch_queue and len(self.worker):
            out = s.schedule()
            if self._unsettled:  # (audited: VllmSchedulerTarget.step)
                self._settle_tables()
            self._on_schedule(out)
            s.update_from_output(out, self._empty_output())
            self.steps += 1
            return
        super().step()

    def _on_schedule(self, out) -> None:
        """The worker stand-in takes the step's metadata (``LMCacheMPConnector``'s: its finished requests). With
        an ``OffloadingConnector``, an unflushed older store must not read a block this ``schedule()``
        reallocated (vLLM's fence, ``jobs_to_flush``; check ``inflight-store``)."""
        if self.config.kv_connector == "LMCacheMPConnector":
            return self.worker.start_finished(out, self.steps)
        self.worker.start(out.kv_connector_metadata, self.steps)
        if self.config.kv_connector in OFFLOADING:
            hit, self.allocated = self.offload.reading(self.allocated, self.steps), set()
            if hit is not None and not self.store_findings:
                j, rid, b = hit
                self.store_findings.append(TargetFinding(
                    "use-after-free", POOL, np.array([b], dtype=np.int64), f"block {b} was reallocated while "
                    f"offload store job {j} of req:{rid} still reads it (not in jobs_to_flush)",
                    check="inflight-store", free_sites=self.free_sites(b),
                    used_by=(f"offload store job {j} of req:{rid}",)))

    def _kv_output(self):
        # a load about to report done is checked now: once reported it is no longer outstanding
        self._load_violations.extend(self._inflight_load_findings())
        loading = self._loads() if self._shadow is not None else {}
        output = self.worker.finished(self.steps, self.V.KVConnectorOutput)
        for field in ("finished_sending", "finished_recving", "failed_recving"):
            if getattr(output, field, None):
                setattr(output, field, ArrivalOrder(getattr(output, field)))
        for rid in (output.finished_recving or ()) if output is not None else ():
            self._shadow_load(rid, loading.get(rid, np.zeros(0, dtype=np.int64)))
        return output

    def _loads(self) -> dict[str, np.ndarray]:
        """Request id -> ``[n] int64`` GPU blocks its outstanding KV load writes (worker's, :func:`offload_holders`)."""
        return {**self.worker.loading, **{owner.removeprefix("offload-load:"): blocks for owner, _, blocks in
                                          self.connector_holders() if owner.startswith("offload-load:")}}

    def is_idle(self) -> bool:
        return super().is_idle() and not len(self.worker)

    def stuck(self) -> str:
        """Also ``connector:recving`` / ``connector:sending``: a transfer that never completes, nothing left to run."""
        out, w = super().stuck(), self.worker
        if out in ("", "finished:held") and (w.recving or w.sending):
            return "connector:" + ("recving" if w.recving else "sending")
        return out

    def describe_busy(self) -> str:
        w = self.worker
        return f"{super().describe_busy()} recving={len(w.recving)} sending={len(w.sending)}"

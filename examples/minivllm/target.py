"""kvaudit's target for the minivllm example engine, written only against kvaudit's public API.

Importing this module registers the target kind ``minivllm`` (:func:`kvaudit.targets.registry.register`):
``KVAUDIT_PLUGINS=examples.minivllm.target kvaudit fuzz --target minivllm`` (from the repository root)
fuzzes it. See ``docs/writing-a-target.md``.

The engine's one pool, ``block_pool``, is reference-counted (a ``"blocks"`` pool: ``get_new_blocks``
allocates, ``touch`` adds a reference, ``free_blocks`` drops one). Roots: every request the scheduler
holds references its blocks (``req_to_blocks``); a block two requests share is not private to either.
The identity is vLLM's: free blocks (cached-but-free ones included) plus referenced blocks make the
pool, so ``identity_terms`` is ``("available", "referenced")``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from examples.minivllm.engine import BUGS, BlockPool, MiniVllmConfig, Scheduler, sample_token
from kvaudit.config import ConfigBase, Preset
from kvaudit.program import Abort, prompt_tokens, Submit
from kvaudit.targets.base import Accounting, PoolSpec, Root, Target, TargetFinding
from kvaudit.targets.registry import TargetKind, register

POOL = "block_pool"


@dataclass(frozen=True)
class MiniVllmTargetConfig(ConfigBase):
    """The engine's :class:`MiniVllmConfig` plus what kvaudit records (``preset``, ``seed``,
    ``target``). ``num_slots``/``page_size`` (tokens) are derived from blocks for the generators."""

    num_gpu_blocks: int = 32
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 32
    enable_prefix_caching: bool = True
    bugs: frozenset = field(default_factory=frozenset)
    seed: int = 0
    preset: str = "custom"
    target: str = "minivllm"

    def __post_init__(self):
        object.__setattr__(self, "bugs", frozenset(self.bugs))
        self.engine_config()  # validates (ValueError)

    def engine_config(self) -> MiniVllmConfig:
        return MiniVllmConfig(self.num_gpu_blocks, self.block_size, self.max_num_seqs,
                              self.max_num_batched_tokens, self.enable_prefix_caching, self.bugs)

    @property
    def page_size(self) -> int:
        return self.block_size

    @property
    def num_slots(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @property
    def context_len(self) -> int:
        return (self.num_gpu_blocks - 1) * self.block_size


class MiniVllmTarget(Target):
    name = "minivllm"
    owner_hint_vars = ("request",)
    owner_stop_vars = ()

    def __init__(self, config: MiniVllmTargetConfig):
        self.config, self.steps = config, 0
        self.engine = Scheduler(config.engine_config())
        self.pool = self.engine.kv_cache_manager.block_pool
        self.submitted: list[str] = []

    # -- the pool and its hooks ----------------------------------------------------------------
    def pools(self) -> list[PoolSpec]:
        return [PoolSpec(POOL, self.pool, "blocks", self.config.block_size, self.config.num_gpu_blocks - 1)]

    def install_pool(self, spec, auditor, wrap) -> None:
        ids = lambda blocks: [b.block_id for b in blocks]  # noqa: E731
        auditor.wrap_blocks(spec, ids, alloc="get_new_blocks", ref="touch", unref="free_blocks")

    def framework_classes(self) -> list[type]:
        return [BlockPool]  # the pool shares engine.py with the scheduler: only its methods are skipped

    @staticmethod
    def owner_hint(frame_locals: dict) -> str | None:
        r = frame_locals.get("request")
        return f"req:{r.request_id}" if hasattr(r, "request_id") else None

    # -- driving --------------------------------------------------------------------------------
    def apply(self, op) -> None:
        if isinstance(op, Submit):
            rid = f"req-{len(self.submitted) + 1:06d}"
            limit = self.config.context_len - op.max_new_tokens
            prompt = prompt_tokens(op.family, max(1, min(op.prompt_len, limit)))
            try:
                self.engine.add_request(rid, prompt, max(1, op.max_new_tokens))
            except ValueError:
                return  # the server rejects it at intake, as vLLM's input processor would
            self.submitted.append(rid)
        elif isinstance(op, Abort) and self.engine.requests:
            live = list(self.engine.requests)  # handle: modulo the live set; None aborts them all
            for rid in (live if op.handle is None else [live[op.handle % len(live)]]):
                self.engine.abort_request(rid)
        # health checks, flushes, sessions, pauses: this engine has none (ignored)

    def step(self) -> None:
        self.engine.step()
        self.steps += 1

    def is_idle(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def progress(self) -> dict[str, int]:
        return {r.request_id: r.num_computed_tokens + 1000 * r.num_preemptions
                for r in self.engine.running}

    # -- what the oracles read ------------------------------------------------------------------
    def roots(self, aborting: bool = True) -> list[Root]:
        blocks = self.engine.kv_cache_manager.req_to_blocks
        counts = self.pool.ref_counts()
        out = []
        for rid, req in self.engine.requests.items():
            units = np.fromiter((b.block_id for b in blocks.get(rid, ())), dtype=np.int64)
            shared = counts[units] > 1
            # where: the engine's queue holding the request (its status' value: "running", "waiting",
            # "preempted"); a leak whose request was dropped without a release names it (``from:running``)
            where = req.status.value
            out.append(Root(POOL, f"req:{rid}", units[~shared], where=where))
            if shared.any():
                out.append(Root(POOL, f"req:{rid}", units[shared], private=False, where=where))
        return out

    def identity_terms(self, pool: str) -> tuple[str, ...]:
        return ("available", "referenced")

    def accounting(self) -> dict[str, Accounting]:
        bs = self.config.block_size
        return {POOL: Accounting(available=self.pool.get_num_free_blocks() * bs, evictable=0, protected=0,
                                 session_held=0, total=(self.config.num_gpu_blocks - 1) * bs)}

    def free_lists(self) -> dict[str, np.ndarray]:
        return {POOL: self.pool.free_block_ids()}

    def invariant_findings(self) -> list[TargetFinding]:
        """A block's ``ref_cnt`` must equal the requests holding it (vLLM's invariant)."""
        held = np.zeros(self.config.num_gpu_blocks, dtype=np.int64)
        for blocks in self.engine.kv_cache_manager.req_to_blocks.values():
            np.add.at(held, [b.block_id for b in blocks], 1)
        counts = self.pool.ref_counts()
        bad = np.flatnonzero(counts[1:] != held[1:]) + 1
        if not bad.size:
            return []
        return [TargetFinding("accounting-drift", POOL, bad, f"block {bad[0]} has ref_cnt={counts[bad[0]]} but "
                              f"{held[bad[0]]} request(s) hold it", check="ref_cnt")]

    def engine_check(self) -> list[str]:
        counts = self.pool.ref_counts()
        free = self.pool.get_num_free_blocks()
        used = int(np.count_nonzero(counts[1:] > 0))
        if (counts < 0).any() or free + used != self.config.num_gpu_blocks - 1:
            return [f"[{POOL}] free={free} + used={used} != {self.config.num_gpu_blocks - 1}"
                    + (" (a negative ref_cnt)" if (counts < 0).any() else "")]
        return []

    def describe_busy(self) -> str:
        return f"{len(self.engine.waiting)} waiting, {len(self.engine.running)} running"

    def text(self, rid: str) -> list[int]:
        """The tokens ``rid`` has produced so far (deterministic: :func:`sample_token`)."""
        r = self.engine.requests.get(rid)
        return [] if r is None else [sample_token(rid, i) for i in range(len(r.prompt_token_ids), r.num_tokens)]


PLANTED = {  # what --bug takes: the engine's planted bugs (examples/minivllm/engine.py), each with its kind
    "preempt-double-free": ("double-free", "preemption frees the victim's blocks twice (a second ref_cnt decrement)"),
    "abort-leak": ("leak", "aborting a request drops it from the queues without freeing its blocks"),
}
assert set(PLANTED) == set(BUGS)


def _preset(name: str, description: str, **overrides) -> Preset:
    return Preset(name, description, overrides, config_class=MiniVllmTargetConfig)


PRESETS = {p.name: p for p in [
    _preset("minivllm", "32 blocks of 4 tokens, prefix caching on, 8 sequences"),
    _preset("minivllm-tight", "12 blocks of 4 tokens: decode runs out and preempts by recompute",
            num_gpu_blocks=12, max_num_batched_tokens=16),
]}

KIND = register(TargetKind(
    name="minivllm", summary="the minivllm example (examples/minivllm): vLLM-style ref-counted blocks",
    config_class=MiniVllmTargetConfig, presets=lambda: PRESETS, make=MiniVllmTarget,
    bugs=lambda: {name: SimpleNamespace(finding=kind, description=what) for name, (kind, what) in PLANTED.items()},
    bugs_title="planted bugs (--target minivllm)",
    default_preset="minivllm",
    capabilities=lambda config: {"prefix_cache"} if config.enable_prefix_caching else set()))

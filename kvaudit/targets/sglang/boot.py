"""Bootstrap of the real-SGLang target: version probe, import stubs, and SGLang's own memory-manager
objects built as the scheduler builds them (its constructors and its tree-cache factory,
``mem_cache/registry.py::create_tree_cache``)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
import types
import warnings
from types import SimpleNamespace

from kvaudit.data import install_hint
from kvaudit.targets.compat import engine_import, installed
from kvaudit.targets.sglang import compat

SUPPORTED_VERSIONS = compat.LEGACY + compat.CURRENT  # two driver families (compat.family)
INSTALL_HINT = install_hint("sglang-cpu.txt")  # (a wheel's: its shipped copy's path)


class SglangUnavailable(RuntimeError):
    """SGLang is missing, or not a version (or API) this target drives; a one-line message (exit 69)."""


def installed_version() -> str | None:
    return installed("sglang")  # the installed distribution's version, or None (read once per sys.path)


def probe_version() -> str:
    """The installed SGLang version, if supported. Raises :class:`SglangUnavailable`."""
    v = installed_version()
    if v is None:
        raise SglangUnavailable(f"--target sglang needs SGLang (it drives {compat.supported()}), which is not "
                                f"installed (install {compat.CURRENT[-1]} with: {INSTALL_HINT})")
    if v not in SUPPORTED_VERSIONS:
        raise SglangUnavailable(compat.refusal(v))
    return v


# NOTE: SGLang imports triton and torchvision at module level; the memory-manager paths never run
# them on CPU, and neither imports beside CPU torch here (docs/internals/sglang.md, "Import stubs").


class _InertMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Inert(metaclass=_InertMeta):
    def __init__(self, *args, **kwargs):  # older releases build triton.Config(...) at import
        pass

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__()


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


class _StubModule(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
        self.__kvaudit_stub__ = True

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            value = type(name, (_Inert,), {"__module__": self.__name__})
        else:
            full = f"{self.__name__}.{name}"
            value = sys.modules.get(full) or _StubModule(full)
            sys.modules[full] = value
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn


class _StubFinder(importlib.abc.MetaPathFinder):
    def __init__(self, roots: set[str]):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


STUBS = {"triton": "3.0.0", "torchvision": "0.28.0"}


def install_stubs() -> list[str]:
    """Stub the packages of :data:`STUBS` that do not import for real; returns the ones stubbed."""
    need = []
    for name in STUBS:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # absent, or a CUDA build that fails beside CPU torch
            for k in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[k]
            need.append(name)
    if need:
        sys.meta_path.insert(0, _StubFinder(set(need)))
        for name in need:
            mod = _StubModule(name)
            mod.__version__ = STUBS[name]
            sys.modules[name] = mod
    return need


def prepare_import() -> list[str]:
    """What both eras' imports need: no ``SGLANG_USE_CPU_ENGINE``, and the stubs (returns the ones
    installed). Raises :class:`SglangUnavailable`."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE"):
        raise SglangUnavailable("unset SGLANG_USE_CPU_ENGINE: it makes SGLang import sgl_kernel's CPU ops, which "
                                "this target does not need")
    # SGLang imports vLLM, whose platform probe logs "Failed to import from vllm._C" on every CPU-only
    # start: expected here (no kernel runs), and noise on every run's stderr (the legacy era's too). A
    # level the user set stays.
    probe_log = logging.getLogger("vllm.platforms.interface")
    if probe_log.level == logging.NOTSET:
        probe_log.setLevel(logging.ERROR)
    return install_stubs()


def quiet_loggers() -> None:
    """SGLang's loggers, and the root logger some of its modules log through: the CLI's output is kvaudit's."""
    for name in ("sglang", "transformers", "torch._dynamo"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger().setLevel(logging.CRITICAL)


_LOADED: SimpleNamespace | None = None
_RANK_SCOPE: list = []  # 0.5.20's rank override, entered once (change rank-override-permanent)
_LENT_SCOPES: list = []  # 0.5.19's scoped overrides of lent groups (change parallel-override-permanently)


def load() -> SimpleNamespace:
    """Import SGLang 0.5.23's memory manager once per process; returns the symbols the target uses.
    Raises :class:`SglangUnavailable` for a missing or unsupported SGLang, or an API that differs from
    the one this target drives (checked by signature, not by version string alone)."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    version = probe_version()
    if compat.family(version) == "legacy":  # (legacy builds on this module: it is not imported from here)
        raise SglangUnavailable(f"SGLang {version} is of the legacy family: its memory manager is loaded by "
                                "kvaudit.targets.sglang.legacy.load_legacy, not boot.load")
    stubbed = prepare_import()
    S = imported(lambda: _import_current(version), lambda exc: f"SGLang {version} is installed but its memory "
                 f"manager does not import: {exc} (reinstall with: {INSTALL_HINT})")
    S.stubbed = stubbed
    _check_api(S)
    quiet_loggers()
    _LOADED = S
    return _LOADED


def override_parallel(S, **fields) -> None:
    """``ParallelContext.override_permanently(**fields)`` (a group the process lends SGLang, e.g.
    ``attn_tp_group``), or before change ``parallel-override-permanently`` (0.5.19) the scoped
    ``override(**fields)`` entered for the rest of the process."""
    if compat.has("parallel-override-permanently", S.version):
        S.get_parallel().override_permanently(**fields)
    else:
        scope = S.get_parallel().override(**fields)
        scope.__enter__()
        _LENT_SCOPES.append(scope)  # kept (never left), as the rank scope


def imported(importer, fail) -> SimpleNamespace:
    """What ``importer()`` returns (a function's ``locals()`` after it imported SGLang's symbols) as a
    namespace, SGLang's import-time warnings silenced. Raises :class:`SglangUnavailable` with ``fail(exc)``
    for the ``ImportError`` of a symbol that does not import."""
    with warnings.catch_warnings(), engine_import():
        warnings.simplefilter("ignore")
        try:
            return SimpleNamespace(**importer())
        except ImportError as exc:
            raise SglangUnavailable(fail(exc)) from None


def _import_current(version: str) -> dict:
    """The symbols of SGLang 0.5.23's memory manager the target uses, by name (``version`` too)."""
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject, register_grammar_backend
    from sglang.srt.constrained.grammar_manager import GrammarManager
    from sglang.srt.managers.io_struct import CloseSessionReqInput, FlushCacheReqInput, OpenSessionReqInput, \
        SessionParams, TokenizedGenerateReqInput
    from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper
    from sglang.srt.disaggregation.utils import prepare_abort
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ReqKvInfo, ScheduleBatch, retract_all
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
    if compat.has("cache-request-handle", version):
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
    else:  # 0.5.18/0.5.19: release_aborted_request(rid) instead (intake._release_aborted_request)
        CacheRequestOutcome = None
    from sglang.srt.mem_cache import allocation, common
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang.srt.session.session_controller import SessionController
    from sglang.srt.session.streaming_session import StreamingSession
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    return locals()


def _check_api(S) -> None:
    """The API probe of the loaded symbols ``S``: raises :class:`SglangUnavailable` naming the 0.5.23 shapes
    that are missing."""
    version, rel = S.version, inspect.signature(S.common.release_kv_cache).parameters
    problems = []
    if not compat.has("release-checkpoint", version):  # 0.5.20/0.5.21: the is_insert flag, no session take()
        if "is_insert" not in rel:
            problems.append("release_kv_cache(req, cache, is_insert)")
    elif "checkpoint" not in rel or rel["checkpoint"].kind is not inspect.Parameter.KEYWORD_ONLY:
        problems.append("release_kv_cache(req, cache, *, checkpoint)")
    elif not hasattr(S.StreamingSession, "take"):
        problems.append("StreamingSession.take")
    if not hasattr(S.ReqKvInfo, "holds_kv"):
        problems.append("ReqKvInfo.holds_kv")
    problems += [name for name in ("alloc_for_extend", "alloc_for_decode") if not hasattr(S.allocation, name)]
    if problems:
        raise SglangUnavailable(f"SGLang {version}'s memory-manager API differs from the one this target drives "
                                f"(missing: {', '.join(problems)})")


class _Launch:
    """``kernel[grid](*args)`` for a CPU stand-in of a triton kernel: the grid is dropped."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _alloc_decode(seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size) -> None:
    """What ``alloc_decode_kernel`` stores: ``[bs]`` slots of each request's next token (``seq_lens``
    counts it): the next slot of its last page, or the first slot of the next free page when it starts
    a page (the free pages taken in batch order)."""
    import torch

    new = ((seq_lens + page_size - 1) // page_size - (seq_lens + page_size - 2) // page_size).to(torch.int64)
    start = torch.cumsum(new, 0) - new
    pages = free_pages[start.clamp(max=max(len(free_pages) - 1, 0))] if len(free_pages) else start
    out_indices.copy_(torch.where(new > 0, pages * page_size, last_loc + 1))


def torch_paged_kernels(module) -> None:
    """Idempotent: ``module``'s two paged-allocator triton kernels (its globals ``alloc_extend_kernel`` and
    ``alloc_decode_kernel``) by torch code that computes the same slots: ``alloc_extend_kernel`` by SGLang's own
    ``alloc_extend_naive`` of that module (the NPU path's), ``alloc_decode_kernel`` by :func:`_alloc_decode`.
    Shims S2 (0.5.20/0.5.21) and L4 (the legacy family)."""
    if isinstance(module.alloc_extend_kernel, _Launch):
        return

    def extend(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
        module.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size,
                                  out_indices.device)

    module.alloc_extend_kernel = _Launch(extend)
    module.alloc_decode_kernel = _Launch(_alloc_decode)


def shim_paged_kernels() -> str:
    """CPU shim S2 (before change ``platform-triton-check``: 0.5.20/0.5.21), idempotent: the paged allocator's
    two triton kernels, module globals of ``allocator/paged.py``, by torch (:func:`torch_paged_kernels`; 0.5.22
    picks ``alloc_*_naive`` itself on a CPU platform)."""
    import sglang.srt.mem_cache.allocator.paged as paged

    torch_paged_kernels(paged)
    return "S2 allocator.paged.alloc_extend_kernel / alloc_decode_kernel -> torch"


def shim_cuda_host_register() -> str:
    """CPU shim S1 (HiSparse, HiCache), idempotent: ``pool_host.common._cuda_host_register`` -> no-op
    (pinned host pools register through CUDA, which a CPU build lacks). Returns the shim's name."""
    import sglang.srt.mem_cache.pool_host.common as pool_host_common

    if not getattr(pool_host_common._cuda_host_register, "__kvaudit_shim__", False):
        def no_register(*a, **k):
            return None

        no_register.__kvaudit_shim__ = True
        pool_host_common._cuda_host_register = no_register
    return "S1 pool_host.common._cuda_host_register no-op"


def one_rank_group():
    """A one-process gloo group over an in-memory store (``torch.distributed.group.WORLD``), for the parts
    of SGLang that all-reduce over a tensor-parallel group of one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


GRAMMAR_BACKEND = "kvaudit-steps"  # registered with SGLang's register_grammar_backend by the driver


def cpu_server_args(version: str) -> dict:
    """``ServerArgs`` fields a CPU run of ``version`` needs: before change ``platform-triton-check``,
    ``attention_backend="torch_native"`` (only the backend tells ``alloc_for_extend`` to write ``req_to_token``
    with torch, not triton)."""
    return {} if compat.has("platform-triton-check", version) else {"attention_backend": "torch_native"}


def publish_server_args(config, **extra):
    """``ServerArgs`` for ``config`` with a mode's ``extra`` fields, published for this process (SGLang
    reads it process-wide through ``get_schedule()``, ``get_memory()``...)."""
    S = load()
    extra.setdefault("radix_eviction_policy", config.radix_eviction_policy)
    for k, v in cpu_server_args(S.version).items():
        extra.setdefault(k, v)
    if getattr(config, "speculative_algorithm", None) is not None:  # (the legacy era's config has none)
        extra.update(speculative_algorithm=config.speculative_algorithm.upper(),
                     speculative_num_steps=config.speculative_num_steps,
                     speculative_eagle_topk=config.speculative_eagle_topk,
                     speculative_num_draft_tokens=config.speculative_num_draft_tokens)
    if config.radix_eviction_policy_kwargs is not None:
        extra.setdefault("radix_eviction_policy_config", config.radix_eviction_policy_kwargs)
    sa = S.ServerArgs(model_path="dummy", page_size=config.page_size, grammar_backend=GRAMMAR_BACKEND,
                      schedule_low_priority_values_first=config.schedule_low_priority_values_first, **extra)
    S.set_global_server_args_for_scheduler(sa)
    return sa


def row_width(config) -> int:
    """A ``req_to_token`` row's width in tokens: ``context_len`` plus 8, or, with speculative decoding, plus
    SGLang's own headroom for the decode over-allocation if wider (``allocation_sizing.
    get_req_to_token_extra_context_len``, read from the published server args)."""
    if getattr(config, "speculative_algorithm", None) is None:
        return config.context_len + 8
    from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
    return config.context_len + max(8, get_req_to_token_extra_context_len())


def build(config, *, server_args=None, make_rows=None, make_kv=None, disable_radix_cache: bool = False,
          tp_worker=None, enable_hierarchical_cache: bool = False, hybrid: dict | None = None) -> SimpleNamespace:
    """SGLang's pools and tree cache for ``config`` (``kv_cache_configurator``, then
    ``create_tree_cache``). ``server_args``: a mode's own, already published; ``make_rows`` /
    ``make_kv`` (callables of the device): a mode's own request pool / ``(kvcache, allocator)``;
    ``hybrid``: a hybrid model's ``TreeCacheBuildContext`` fields (``is_hybrid_swa``, ``is_hybrid_ssm``:
    a model with mamba state, whose ``make_rows`` builds a ``HybridReqToTokenPool``;
    ``full_tokens_per_layer``) and ``CacheInitParams`` fields (``sliding_window_size``), as
    ``kv_cache_builder`` passes them. Raises :class:`SglangUnavailable` if SGLang picked another tree
    core than the one asked for (Rust falls back to Python silently outside its torch range)."""
    S = load()
    import torch

    ps, size = config.page_size, config.total_tokens
    if server_args is None:
        server_args = publish_server_args(config)
    # this process is rank 0 of a 1-GPU tensor-parallel group (Req.set_finish_with_abort reads it) and
    # the one stage of a one-stage pipeline (GrammarManager and HiCache's storage config read that)
    if compat.has("rank-override-permanent", S.version):
        S.get_parallel().override_permanently(tp_rank=0, pp_rank=0, pp_size=1)
    elif not _RANK_SCOPE:  # 0.5.19/0.5.20: ranks read the live group unless a scope overrides them; the scope
        _RANK_SCOPE.append(S.get_parallel().override(tp_rank=0, pp_rank=0))  # is this process (kept, never left)
        _RANK_SCOPE[0].__enter__()
    dev = config.device
    if not compat.has("platform-triton-check", S.version):
        shim_paged_kernels()
    if make_kv is not None:
        kvcache, allocator = make_kv(dev)
    else:
        kvcache = S.MHATokenToKVPool(size, ps, torch.bfloat16, head_num=1, head_dim=8, layer_num=1, device=dev,
                                     enable_memory_saver=False)
        if ps == 1:
            allocator = S.TokenToKVPoolAllocator(size, torch.bfloat16, dev, kvcache, config.need_sort)
        else:
            allocator = S.PagedTokenToKVPoolAllocator(size, ps, torch.bfloat16, dev, kvcache, config.need_sort)
    if make_rows is not None:
        req_to_token_pool = make_rows(dev)
    else:
        req_to_token_pool = S.ReqToTokenPool(size=config.max_req_rows, max_context_len=row_width(config),
                                             device=dev, enable_memory_saver=False)
    hybrid = dict(hybrid or {})
    ctx_fields = {k: hybrid.pop(k) for k in ("is_hybrid_swa", "is_hybrid_ssm", "full_tokens_per_layer") if k in hybrid}
    # the eviction policy, as kv_cache_builder passes the published --radix-eviction-policy(-config)
    policy, policy_config = config.radix_eviction_policy, config.radix_eviction_policy_kwargs
    if compat.has("tree-core-param", S.version):
        hybrid["tree_core_backend"] = config.tree_core
    else:  # UnifiedRadixCache.__init__ reads the core from the environment
        os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = config.tree_core
    if compat.has("eviction-policy-config", S.version):  # (0.5.19: kind.older_refusal refuses a config)
        hybrid["eviction_policy_config"] = policy_config
    # an EAGLE server's tree keys its nodes by token pairs: kv_cache_builder passes is_eagle=spec_algorithm.is_eagle()
    # (the scheduler's SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm), the published args';
    # SGLang's tree core drops it beside a Mamba component)
    hybrid["is_eagle"] = S.SpeculativeAlgorithm.from_string(server_args.speculative_algorithm).is_eagle()
    params = S.CacheInitParams(disable=disable_radix_cache, req_to_token_pool=req_to_token_pool,
                               token_to_kv_pool_allocator=allocator, page_size=ps, eviction_policy=policy, **hybrid)
    # what SGLang reads of ModelConfig on these paths (the PD-decode queues: num_hidden_layers, the think ids)
    model_config = SimpleNamespace(vocab_size=config.vocab_size, is_encoder_decoder=False, hf_eos_token_id=None,
                                   num_hidden_layers=1, self_opened_think_start_ids=None, think_end_ids=None)
    ctx_fields.setdefault("is_hybrid_swa", False)
    ctx_fields.setdefault("is_hybrid_ssm", False)
    if not compat.has("chunk-cache-gone", S.version):  # kv_cache_builder passes the chunk size (None: no chunking)
        ctx_fields["effective_chunked_prefill_size"] = server_args.chunked_prefill_size
    ctx = S.TreeCacheBuildContext(server_args=server_args, params=params, **ctx_fields,
                                  enable_hierarchical_cache=enable_hierarchical_cache,
                                  disable_radix_cache=disable_radix_cache,
                                  tp_worker=tp_worker,
                                  model_config=model_config, tp_size=1, tp_rank=0, tp_group=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree_cache = S.create_tree_cache(ctx)
    core = type(getattr(tree_cache, "tree_core", None)).__name__
    if (config.tree_core == "rust") != core.startswith("Rust"):
        raise SglangUnavailable(f"asked for the {config.tree_core} tree core but SGLang built {core} "
                                "(the Rust core needs torch 2.11-2.14 on Linux)")
    return SimpleNamespace(server_args=server_args, kvcache=kvcache, allocator=allocator,
                           req_to_token_pool=req_to_token_pool, tree_cache=tree_cache, model_config=model_config,
                           tree_core=core)

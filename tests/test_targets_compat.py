"""kvaudit/targets/compat.py: the installed engine's version, read from its metadata once per sys.path."""

import importlib.metadata

import pytest

from kvaudit.targets import compat


@pytest.fixture
def reads(monkeypatch):
    """A metadata stand-in: ``versions[entry]`` is ``kvaudit-dist``'s version on that ``sys.path`` entry (the
    first entry that has one wins, as ``importlib.metadata`` reads; no other distribution is installed); every
    read is logged."""
    log, versions = [], {}

    def version(name):
        log.append(name)
        import sys
        for entry in sys.path:
            if name == "kvaudit-dist" and entry in versions:
                return versions[entry]
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(compat, "_found", {}, raising=False)
    compat._installed.cache_clear()
    yield log, versions
    compat._installed.cache_clear()


def test_a_version_found_is_not_read_again_when_sys_path_only_grows_at_its_end(reads, monkeypatch):
    # importing vLLM appends setuptools' _vendor folder between the probe's read and the first build's
    log, versions = reads
    monkeypatch.setattr("sys.path", ["/overlay", "/site"])
    versions["/overlay"], versions["/site"] = "0.30.0", "0.33.0"
    assert compat.installed("kvaudit-dist") == "0.30.0"
    monkeypatch.setattr("sys.path", ["/overlay", "/site", "/site/setuptools/_vendor"])
    assert compat.installed("kvaudit-dist") == "0.30.0"
    assert log == ["kvaudit-dist"]


def test_an_entry_put_in_front_or_a_distribution_not_found_reads_again(reads, monkeypatch):
    log, versions = reads
    monkeypatch.setattr("sys.path", ["/site"])
    versions["/site"] = "0.33.0"
    assert compat.installed("kvaudit-dist") == "0.33.0"
    monkeypatch.setattr("sys.path", ["/overlay", "/site"])  # a release overlay in front wins
    versions["/overlay"] = "0.30.0"
    assert compat.installed("kvaudit-dist") == "0.30.0"
    assert compat.installed("other-dist") is None
    monkeypatch.setattr("sys.path", ["/overlay", "/site", "/more"])  # the appended entry may hold it
    assert compat.installed("other-dist") is None
    assert log == ["kvaudit-dist", "kvaudit-dist", "other-dist", "other-dist"]

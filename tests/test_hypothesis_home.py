"""kvaudit points Hypothesis's files at its own directories and gives an in-process caller's home back, with
every Hypothesis that pyproject.toml admits (>= 6.100): before 6.155, ``storage_directory()`` returned the
home itself, a Path with no ``home_directory`` (kvaudit.cli's and kvaudit.testing's read of it raised
AttributeError there)."""

from __future__ import annotations

import pytest
from hypothesis import configuration


@pytest.fixture
def older_hypothesis(monkeypatch, tmp_path):
    home = tmp_path / "home"
    monkeypatch.setattr(configuration, "storage_directory",
                        lambda *names, intent_to_write=True: home.joinpath(*names))
    set_to: list = []
    monkeypatch.setattr(configuration, "set_hypothesis_home_dir", set_to.append)
    return home, set_to


def test_the_cli_gives_the_callers_hypothesis_home_back_with_an_older_hypothesis(older_hypothesis):
    from kvaudit import cli

    home, set_to = older_hypothesis
    with cli._keeping_hypothesis_home():
        pass
    assert set_to == [home]


def test_the_pytest_fixtures_scratch_home_works_with_an_older_hypothesis(older_hypothesis):
    from kvaudit import testing

    home, set_to = older_hypothesis
    with testing._hypothesis_home_in_scratch():
        assert len(set_to) == 1 and set_to[0] != home  # the scratch folder's
    assert set_to[-1] == home

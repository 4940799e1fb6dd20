"""What every target kind's config shares (:class:`ConfigBase`), and named presets (:class:`Preset`).

A target kind registered with :mod:`kvaudit.targets.registry` brings a frozen dataclass config with
``preset`` and ``bugs`` fields; subclassing :class:`ConfigBase` gives it the JSON form a replay file
stores (``to_dict``/``from_dict``) and ``replace``. Imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol


class UnknownPresetError(ValueError):
    """A preset name that the target kind does not have."""


class UnknownFaultError(ValueError):
    """An injected-fault name (``--bug``) that a real engine's target kind does not have."""

    def __init__(self, name: str, target: str, valid):
        super().__init__(f"unknown fault {name!r} for --target {target}; valid faults: {', '.join(valid)}")


class ConfigBase:
    """Mixin for a target's frozen dataclass config with a ``bugs`` set, ``num_slots`` and
    ``page_size`` (tokens): its JSON form (a replay file's ``config``) and ``replace``.
    ``BUGS_NOUN`` names the bugs in errors."""

    BUGS_NOUN = "bug names"
    device = "cpu"  # a config with no ``device`` field runs on the CPU
    model = "none"  # ... and computes no KV

    @property
    def num_pages(self) -> int:
        """Device KV pages, excluding the reserved page 0."""
        return self.num_slots // self.page_size

    @property
    def total_tokens(self) -> int:
        """Usable device KV slots, whole pages only."""
        return self.num_pages * self.page_size

    def _freeze_faults(self, valid, target: str) -> None:
        """For a frozen dataclass's ``__post_init__``: ``bugs`` as a frozenset, each a name in ``valid``
        (the kind's injected faults). Raises :class:`UnknownFaultError` for the first unknown one."""
        object.__setattr__(self, "bugs", frozenset(self.bugs))
        unknown = sorted(self.bugs - set(valid))
        if unknown:
            raise UnknownFaultError(unknown[0], target, valid)

    def replace(self, **changes):
        """A copy with ``changes`` (validated again by the dataclass's ``__post_init__``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The JSON form: every field, ``bugs`` as a sorted list."""
        d = dataclasses.asdict(self)
        d["bugs"] = sorted(self.bugs)
        return d

    @classmethod
    def from_dict(cls, d: dict):
        """Build a config from :meth:`to_dict` output. Raises ``TypeError``/``ValueError`` on bad keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown config key {unknown[0]!r}")
        d = dict(d)
        if "bugs" in d:
            if not isinstance(d["bugs"], (list, tuple, set, frozenset)) or not all(isinstance(b, str) for b in d["bugs"]):
                raise ValueError(f"bugs must be a list of {cls.BUGS_NOUN}")
            d["bugs"] = frozenset(d["bugs"])
        return cls(**d)


@dataclass(frozen=True)
class Preset:
    """A named configuration: ``overrides`` on the defaults of ``config_class`` (a frozen dataclass
    with a ``preset`` field)."""

    name: str
    description: str
    overrides: dict
    config_class: type

    def config(self, **changes):
        """The config, with ``changes`` over the overrides. Raises what the config class raises."""
        return self.config_class(preset=self.name, **{**self.overrides, **changes})


class TargetConfig(Protocol):
    """What kvaudit reads from any target kind's config (for type hints; a registered kind's
    ``config_class`` provides it): ``preset``, ``bugs``, ``seed``, ``device``, ``model``,
    ``page_size``/``num_slots``/``context_len`` (tokens), ``to_dict()`` and ``replace(**changes)``."""

    preset: str
    bugs: frozenset

    def to_dict(self) -> dict: ...

    def replace(self, **changes) -> "TargetConfig": ...

"""What every target kind's frozen dataclass config shares (:class:`ConfigBase`: its JSON form and
``replace``), and named presets (:class:`Preset`). Imports nothing heavy."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Protocol


def json_value(v, limit: int | None = None) -> str:
    """``v`` spelled as a user who wrote the config in JSON or TOML wrote it (``true``, ``null``, ``"x"``,
    ``[1, 2]``), for the ``got ...`` of a config error; what JSON has no spelling for as TOML spells it
    (``nan``, ``-inf``, a date ``2024-01-01``), ``repr`` for the rest. A spelling longer than ``limit``
    characters (at least 8) is cut to ``limit``: a string inside its quotes, so that it still reads as one
    (``"xxxx..."``), anything else at its end (``[1, 2, ...``)."""
    s = _spelled(v)
    if limit is None or len(s) <= limit:
        return s
    if not isinstance(v, str):
        return s[:limit - 3] + "..."
    room = limit - 5  # the two quotes and "..."
    inner = []
    for c in v[:room]:  # (an escape is never cut in two)
        e = json.dumps(c)[1:-1]
        if len(e) > room:
            break
        inner.append(e)
        room -= len(e)
    return '"' + "".join(inner) + '..."'


def shown_path(path) -> str:
    """``path`` (str, bytes or path-like) as one printable line for a console or report: the bytes of a file name
    that are not UTF-8 (which ``os.fsdecode`` holds as lone surrogates: a strict UTF-8 stream refuses them, a lenient
    one writes them raw) as ``\\xNN``, and a control character (a newline) as Python escapes it; any other path as
    it is."""
    path = os.fspath(path)
    try:
        raw = path if isinstance(path, bytes) else os.fsencode(path)
    except UnicodeEncodeError:  # (a surrogate os.fsdecode never makes: from JSON's "\ud800", say)
        raw = path.encode("utf-8", "backslashreplace")
    text = raw.decode("utf-8", "backslashreplace")
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


# C0 controls but tab and newline, DEL and C1 (0x9b is a CSI of its own): a terminal acts on them
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def shown_controls(text: str) -> str:
    """``text`` with each control character but tab and newline written as ``\\x1b`` (four characters), so that
    text read from a file (a replay file's message, a frame's source line) cannot drive a terminal, nor hold a
    NUL in a generated script; any other text as it is."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _spelled(v) -> str:
    if isinstance(v, float) and not math.isfinite(v):  # (json.dumps writes NaN, which JSON does not have)
        return "nan" if math.isnan(v) else "inf" if v > 0 else "-inf"
    if isinstance(v, (datetime.date, datetime.time)):  # a TOML date, time or date-time, as written
        return v.isoformat()
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(_spelled, v)) + "]"
    if isinstance(v, dict):  # (keys and values each spelled: a dict holding objects was all repr)
        return "{" + ", ".join(f"{_spelled(k)}: {_spelled(x)}" for k, x in v.items()) + "}"
    try:
        return json.dumps(v, allow_nan=False)
    except (TypeError, ValueError):
        return " ".join(repr(v).split())  # (one line: a numpy array's repr wraps)


def device_unavailable(device) -> str | None:
    """Why a config's torch ``device`` (``cpu``, ``cuda``, ``cuda:N``) cannot run here, in one line, or None.
    Imports torch for a CUDA device only; the device's spelling is the config's own check."""
    if not (isinstance(device, str) and device.startswith("cuda")):
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return f"device {device}: no CUDA device is available here (torch {torch.__version__})"


class UnknownPresetError(ValueError):
    """A preset name that the target kind does not have."""


class UnknownFaultError(ValueError):
    """An injected-fault name (``--bug``) that a real engine's target kind does not have."""

    def __init__(self, name: str, target: str, valid):
        super().__init__(f"unknown fault {json_value(name)} for --target {target}; valid faults: {', '.join(valid)}")


class ConfigBase:
    """Mixin for a frozen dataclass config with ``bugs``, ``num_slots`` and ``page_size`` (tokens).
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
        """For ``__post_init__``: ``bugs`` frozen. Raises :class:`UnknownFaultError` for one not in ``valid``."""
        object.__setattr__(self, "bugs", frozenset(self.bugs))
        unknown = sorted(self.bugs - set(valid))
        if unknown:
            raise UnknownFaultError(unknown[0], target, valid)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["bugs"] = sorted(self.bugs)
        return d

    @classmethod
    def from_dict(cls, d: dict):
        """Raises ``TypeError``/``ValueError`` on bad keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown config key {json_value(unknown[0])}")
        d = dict(d)
        if "bugs" in d:
            if not isinstance(d["bugs"], (list, tuple, set, frozenset)) or not all(isinstance(b, str) for b in d["bugs"]):
                raise ValueError(f"bugs must be a list of {cls.BUGS_NOUN}, got {json_value(d['bugs'], 60)}")
            d["bugs"] = frozenset(d["bugs"])
        return cls(**d)


@dataclass(frozen=True)
class Preset:
    """A named configuration: ``overrides`` on the defaults of ``config_class``."""

    name: str
    description: str
    overrides: dict
    config_class: type

    def config(self, **changes):
        return self.config_class(preset=self.name, **{**self.overrides, **changes})


class TargetConfig(Protocol):
    """What kvaudit reads from any kind's config (type hints): also ``seed``, ``device``, ``model``,
    ``page_size``/``num_slots``/``context_len`` (tokens)."""

    preset: str
    bugs: frozenset

    def to_dict(self) -> dict: ...

    def replace(self, **changes) -> "TargetConfig": ...

"""Where the files kvaudit reads beside its code (``corpora/``, ``harnesses/``, ``requirements/``) are: in a checkout's
root, or in a wheel's ``kvaudit/_data/``. Design notes: docs/internals/app.md."""

from __future__ import annotations

import os

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_SHIPPED = os.path.join(_PACKAGE, "_data")  # in an installed wheel
_CHECKOUT = os.path.dirname(_PACKAGE)  # a source checkout (editable install, PYTHONPATH)


def data_path(*parts: str) -> str:
    """The path of ``corpora/...`` or ``harnesses/...``, the installed copy first; it may not exist."""
    root = _SHIPPED if os.path.isdir(_SHIPPED) else _CHECKOUT
    return os.path.join(root, *parts)


def install_hint(requirements: str) -> str:
    """``pip install --no-deps -r PATH``: the pinned set ``requirements/<requirements>`` (``sglang-cpu.txt``)
    as this install has it: a wheel's copy under ``kvaudit/_data/requirements/`` (absolute), a checkout's
    (relative to the current directory when under it, ``requirements/sglang-cpu.txt`` from the root)."""
    import shlex

    path = data_path("requirements", requirements)
    here = os.path.relpath(path)
    shipped = os.path.isdir(_SHIPPED) or here.startswith(os.pardir)
    return f"pip install --no-deps -r {shlex.quote(path if shipped else here)}"

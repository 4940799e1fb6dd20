"""Where the files kvaudit reads beside its code are: ``corpora/regressions/`` (the replay files
``kvaudit ci`` replays), ``corpora/seeds/<preset>/`` (atheris's seed inputs) and
``harnesses/fuzz_engine.py`` (the atheris harness, an executable script).

In a source checkout they are at the repository root, beside the ``kvaudit`` package. A wheel
carries them inside the package, as ``kvaudit/_data/corpora/...`` and ``kvaudit/_data/harnesses/...``
(pyproject.toml maps the checkout's root to the package ``kvaudit._data`` and lists the files as its
package data), so a plain ``pip install`` needs no checkout.
"""

from __future__ import annotations

import os

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_SHIPPED = os.path.join(_PACKAGE, "_data")  # in an installed wheel
_CHECKOUT = os.path.dirname(_PACKAGE)  # a source checkout (editable install, PYTHONPATH)


def data_path(*parts: str) -> str:
    """The path of ``corpora/...`` or ``harnesses/...`` (``parts`` joined): in the installed
    package's copy when there is one, else in the source checkout. It may not exist (a checkout
    without corpora); callers check."""
    root = _SHIPPED if os.path.isdir(_SHIPPED) else _CHECKOUT
    return os.path.join(root, *parts)

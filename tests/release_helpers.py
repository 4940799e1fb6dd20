"""Engine releases as overlays, for the tests marked ``releases`` (left out of the default run: they
read the user-wide cache ``~/.cache/kvaudit/releases``, which a machine may hold without the packages the
overlays run over; ``.ci/run`` installs both, then runs ``pytest -m releases``).

An overlay (``kvaudit.history.releases``) is one release installed ``--no-deps`` over the *base*
environment: the base must hold the engine's CPU requirements (``requirements/<engine>-cpu.txt``), or the
overlay's import fails on a missing dependency (``tqdm``, ``psutil``, ...)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvaudit.history import releases

BASE = {"sglang": "0.5.23", "vllm": "0.33.0"}  # what requirements/<engine>-cpu.txt installs


def overlay(engine: str, version: str) -> Path | None:
    """The overlay folder of ``engine==version`` (None when the base has that version). Skips the test,
    saying what to install, when the base lacks the engine's requirements or the overlay is absent."""
    if releases.base_version(engine) != BASE[engine]:
        pytest.skip(f"{engine} {version} runs as an overlay over {engine} {BASE[engine]}'s requirements, which "
                    f"this environment lacks: pip install --no-deps -r requirements/{engine}-cpu.txt")
    if releases.base_version(engine) == version:
        return None
    path = releases.overlay_path(engine, version)
    if not path.is_dir():
        pytest.skip(f"{engine} {version} overlay absent: python -m kvaudit.history.releases {engine}=={version}")
    return path


def child_env(engine: str, version: str, root: str | Path) -> dict[str, str]:
    """The environment of a child process that imports ``engine==version`` (its overlay first on
    ``PYTHONPATH``, then the checkout ``root``). Skips as :func:`overlay` does."""
    import os

    env = releases.env(engine, version, overlay(engine, version))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(root)]))
    return env


def run_programs(child: str, programs: list, engine: str, version: str, root: str | Path) -> dict:
    """Run the script ``child`` (``python -c``) over ``programs`` (passed as its JSON argument) under
    ``engine==version`` (:func:`child_env`); its last stdout line is a JSON object whose ``version`` must be
    ``version`` (the overlay, not the base's engine, was imported). Returns that object."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", child, json.dumps(programs)], capture_output=True, text=True,
                       env=child_env(engine, version, root), cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["version"] == version, out["version"]
    return out

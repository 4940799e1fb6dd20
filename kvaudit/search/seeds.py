"""The atheris seed corpora, ``corpora/seeds/<preset>/``: the regression reproducers' programs and
:func:`kvaudit.program.bytes_program.hand_seeds`, in both byte layouts. Written by ``python -m
kvaudit.search.seeds --write-seeds [DIR]``. Design notes: docs/internals/search.md.
"""

from __future__ import annotations

import hashlib
import os
import sys

from kvaudit.config import TargetConfig
from kvaudit.program import Op
from kvaudit.program.bytes_program import hand_seeds, program_to_bytes
from kvaudit.replay import load
from kvaudit.targets import registry


def seed_programs(preset: str, regressions_dir: str, version: int = 1) -> list[tuple[str, list[Op], TargetConfig]]:
    """``(name, program, config)`` of every seed for ``preset``: the programs of the replay files in
    ``regressions_dir`` found in ``preset``, then :func:`hand_seeds` of layout ``version``."""
    out = []
    if os.path.isdir(regressions_dir):
        for name in sorted(os.listdir(regressions_dir)):
            if not name.endswith(".json"):
                continue
            config, program, _, _ = load(os.path.join(regressions_dir, name))
            if config.preset == preset:
                out.append((f"regression-{name[:-5]}", program, config))
    config = registry.get("eut").preset(preset).config()  # atheris instruments the built-in engine only
    out += [(f"hand-{i}", p, config) for i, p in enumerate(hand_seeds(config, version))]
    return out


def write_seeds(out_dir: str, regressions_dir: str) -> list[str]:
    """Write ``out_dir/<preset>/<name>-<sha1[:8]>`` (layout 1) and ``.../v2-<name>-<sha1[:8]>`` (layout 2)
    for every preset, replacing what those directories held; an input already written for the preset is
    skipped. Returns the paths written."""
    written = []
    for preset in registry.get("eut").presets():
        d = os.path.join(out_dir, preset)
        os.makedirs(d, exist_ok=True)
        for old in os.listdir(d):
            os.unlink(os.path.join(d, old))
        seen = set()
        for version, prefix in ((1, ""), (2, "v2-")):
            for name, program, config in seed_programs(preset, regressions_dir, version):
                data = program_to_bytes(program, config, version)
                if data in seen:
                    continue
                seen.add(data)
                path = os.path.join(d, f"{prefix}{name}-{hashlib.sha1(data).hexdigest()[:8]}")
                with open(path, "wb") as fh:
                    fh.write(data)
                written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
    if not argv or argv[0] != "--write-seeds" or len(argv) > 2:
        print("usage: python -m kvaudit.search.seeds --write-seeds [DIR]  (default DIR: corpora/seeds of this "
              "checkout)", file=sys.stderr)
        return 2
    out = argv[1] if len(argv) == 2 else os.path.join(root, "corpora", "seeds")
    paths = write_seeds(out, os.path.join(root, "corpora", "regressions"))
    print(f"wrote {len(paths)} seed inputs under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

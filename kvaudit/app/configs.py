"""Selecting and validating the target config a command runs: the built-in engine's presets and
bug-zoo switches, or real SGLang's presets and injected faults (``--target sglang``), the click
options that choose them, the checks that the target and device are usable here, and the data the
``presets`` and ``bugs`` commands list.

Everything that knows the target kinds by name lives here, in one place (issue 19: a registry of
target kinds replaces it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from engine_under_test import BUGS, PRESETS, UnknownBugError, UnknownPresetError, get_preset
from kvaudit.app.errors import InputError
from kvaudit.targets.sglang_config import TREE_CORES

if TYPE_CHECKING:
    from rich.console import Console

COMMON_OPTIONS = [
    click.option("--preset", default="default", show_default=True, metavar="NAME",
                 help="Engine preset (see 'kvaudit presets'); with --target sglang, 'default' means 'sglang'."),
    click.option("--bug", "bugs", multiple=True, metavar="NAME",
                 help="Switch a bug-zoo bug on (repeatable; see 'kvaudit bugs')."),
    click.option("--model", type=click.Choice(["none", "tiny"]), default="none", show_default=True,
                 help="'tiny' runs the dummy transformer over real KV tensors; 'none' skips compute."),
    click.option("--device", default="cpu", show_default=True, help="Torch device for the engine: cpu or cuda."),
    click.option("--page-size", type=click.IntRange(min=1), default=None, help="Override the preset's page size (tokens)."),
    click.option("--target", type=click.Choice(["eut", "sglang"]), default="eut", show_default=True,
                 help="eut: the built-in engine_under_test; sglang: SGLang 0.5.23's own memory manager on CPU "
                      "(its presets start with 'sglang', see 'kvaudit presets'; --bug takes its injected faults, "
                      "see 'kvaudit bugs')."),
    click.option("--tree-core", type=click.Choice(TREE_CORES), default=None,
                 help="--target sglang: the UnifiedRadixCache tree core [default: rust, SGLang's own default]."),
]

replay_tree_core_option = click.option(
    "--tree-core", type=click.Choice(TREE_CORES), default=None,
    help="A --target sglang file: run it with this UnifiedRadixCache tree core instead of its own.")


def common_options(f):
    """The target options (:data:`COMMON_OPTIONS`) on a command; it takes ``preset, bugs, model,
    device, page_size, target, tree_core``."""
    for opt in reversed(COMMON_OPTIONS):
        f = opt(f)
    return f


def require_target(config) -> None:
    """A real-SGLang config needs SGLang importable: say so in one line (exit 2) before any run."""
    if getattr(config, "target", "eut") == "sglang":
        from kvaudit.targets.sglang_boot import SglangUnavailable, load
        try:
            load()
            if getattr(config, "disaggregation_mode", "null") == "decode":
                from kvaudit.targets.sglang_pd import load_pd
                load_pd()
        except SglangUnavailable as e:
            raise InputError(str(e)) from None


def sglang_version() -> str:
    from kvaudit.targets.sglang_boot import installed_version
    return installed_version() or "?"


def sglang_config(preset: str, bugs: tuple[str, ...], model: str, device: str, page_size: int | None,
                  tree_core: str | None):
    from kvaudit.targets.sglang_config import SGLANG_PRESETS, UnknownFaultError
    preset = "sglang" if preset == "default" else preset
    if preset not in SGLANG_PRESETS:
        raise InputError(f"unknown preset {preset!r} for --target sglang; valid presets: {', '.join(SGLANG_PRESETS)}")
    if model != "none":
        raise InputError("--model tiny is for the built-in engine: --target sglang computes no KV")
    changes = {"device": device, "bugs": frozenset(bugs), "tree_core": tree_core or "rust"}
    if page_size is not None:
        changes["page_size"] = page_size
    try:
        config = SGLANG_PRESETS[preset].config(**changes)
    except UnknownFaultError as e:
        raise InputError(str(e)) from None
    except ValueError as e:
        raise InputError(f"bad configuration: {e}") from None
    require_target(config)
    return config


def select_config(preset: str, bugs: tuple[str, ...], model: str, device: str, page_size: int | None,
                  target: str = "eut", tree_core: str | None = None):
    """The config the :data:`COMMON_OPTIONS` name; a bad combination is an :class:`InputError`."""
    check_device(device)
    if target == "sglang":
        return sglang_config(preset, bugs, model, device, page_size, tree_core)
    if tree_core is not None:
        raise InputError("--tree-core applies to --target sglang only")
    if preset.startswith("sglang"):
        raise InputError(f"preset {preset!r} drives real SGLang: add --target sglang")
    try:
        changes = {"model": model, "device": device, "bugs": frozenset(bugs)}
        if page_size is not None:
            changes["page_size"] = page_size
        return get_preset(preset).config(**changes)
    except (UnknownPresetError, UnknownBugError) as e:
        raise InputError(str(e)) from None
    except ValueError as e:
        raise InputError(f"bad configuration: {e}") from None


def with_tree_core(config, tree_core: str | None):
    """A replay file's ``config`` run with another tree core (``replay --tree-core``), or as it is."""
    if tree_core is None:
        return config
    if getattr(config, "target", "eut") != "sglang":
        raise InputError("--tree-core applies to replay files of --target sglang only")
    return config.replace(tree_core=tree_core)


def check_fuzzer(fuzzer: str, target: str) -> None:
    if fuzzer == "atheris" and target != "eut":
        raise InputError("--fuzzer atheris instruments the built-in engine only; use hypothesis or random with "
                         "--target sglang")


def check_device(device: str) -> None:
    if isinstance(device, str) and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"device {device}: no CUDA device is available here (torch {torch.__version__})")


def warn_unreachable_bugs(config, err: Console) -> None:
    if getattr(config, "target", "eut") != "eut":
        return
    for name in sorted(config.bugs):
        want = BUGS[name].preset
        if want != config.preset:
            err.print(f"warning: bug {name} is reached through preset {want}; with preset {config.preset} "
                      "it may never trigger", soft_wrap=True)


def presets_table():
    """``kvaudit presets``: every target's presets, as a rich table."""
    from rich.table import Table

    t = Table(title="presets")
    t.add_column("preset", no_wrap=True)
    t.add_column("description")
    t.add_column("target", no_wrap=True)
    for p in PRESETS.values():
        t.add_row(p.name, p.description, "eut")
    from kvaudit.targets.sglang_config import SGLANG_PRESETS
    for p in SGLANG_PRESETS.values():
        t.add_row(p.name, p.description, "sglang (--target sglang)")
    return t


def bugs_renderables() -> list:
    """``kvaudit bugs``: the bug zoo's table, each bug's description, and real SGLang's injected
    faults, as rich renderables to print in order."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title="bug zoo")
    t.add_column("bug", no_wrap=True)  # the name is what --bug takes: never cut it
    for col in ("preset", "source", "finding"):
        t.add_column(col, overflow="fold")
    for b in BUGS.values():
        t.add_row(b.name, b.preset, b.source, b.finding)
    out = [t]
    for b in BUGS.values():
        out.append(Text.assemble((b.name, "bold"), f": {b.description}"))
    from kvaudit.targets.sglang_config import FAULTS
    f = Table(title="injected faults (--target sglang)")
    f.add_column("fault", no_wrap=True)
    f.add_column("finding")
    f.add_column("what it does", overflow="fold")
    for name, (kind, what) in FAULTS.items():
        f.add_row(name, kind, what)
    out.append(f)
    return out

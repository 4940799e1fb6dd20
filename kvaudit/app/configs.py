"""The target config a command runs, chosen from the registry of target kinds: its click options,
the checks that it can run here, and what ``presets`` and ``bugs`` list. Design notes:
docs/internals/app.md."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import click

from kvaudit.app.errors import InputError, UnavailableError
from kvaudit.config import UnknownPresetError, device_unavailable, json_value, shown_path
from kvaudit.search import fuzzers
from kvaudit.targets import make_target, registry

if TYPE_CHECKING:
    from rich.console import Console


def _target_help() -> str:
    return "; ".join(f"{k.name}: {k.summary}" for k in registry.kinds().values()) + (
        f" ('kvaudit presets' lists each one's presets, 'kvaudit bugs' what --bug takes; more kinds load from "
        f"{registry.PLUGINS_ENV}=<module>)")


class TargetChoice(click.ParamType):
    """``--target``: a registered kind's name (read when checked: a plugin's kind counts)."""

    name = "target"

    def get_metavar(self, param, *a, **k):
        return "[" + "|".join(registry.kinds()) + "]"

    def convert(self, value, param, ctx):
        try:
            return registry.get(value).name
        except registry.UnknownTargetError as e:
            self.fail(str(e), param, ctx)


def _with_option(option: str) -> list[str]:
    return [k.name for k in registry.kinds().values() if option in k.options]


def _option_choices(option: str) -> list[str]:
    return list(dict.fromkeys(c for k in registry.kinds().values() for c in k.options.get(option, ((), ""))[0]))


def _option_help(option: str) -> str:
    return "; ".join(f"--target {k.name}: {k.options[option][1]}" for k in registry.kinds().values()
                     if option in k.options) + "."


COMMON_OPTIONS = [
    click.option("--preset", default="default", show_default=True, metavar="NAME",
                 help="Engine preset (see 'kvaudit presets'); 'default' means the target's default preset."),
    click.option("--bug", "bugs", multiple=True, metavar="NAME",
                 help="Switch a bug-zoo bug (or a target's injected fault) on, in addition to any the preset "
                      "switches on (repeatable; see 'kvaudit bugs'; an unknown name is an error)."),
    click.option("--model", type=click.Choice(["none", "tiny"]), default="none", show_default=True,
                 help="'tiny' runs the dummy transformer over real KV tensors; 'none' skips compute."),
    click.option("--device", default="cpu", show_default=True, help="Torch device for the engine: cpu or cuda."),
    # (the built-in engine's bound, engine_under_test/config.py _INT_RANGES; a test holds them equal)
    click.option("--page-size", type=click.IntRange(1, 256), default=None,
                 help="Override the preset's page size (tokens)."),
    click.option("--target", type=TargetChoice(), default=registry.DEFAULT_KIND, show_default=True,
                 help=_target_help()),
    click.option("--tree-core", type=click.Choice(_option_choices("tree_core")), default=None,
                 help=_option_help("tree_core")),
]

replay_tree_core_option = click.option(
    "--tree-core", type=click.Choice(_option_choices("tree_core")), default=None,
    help=f"A --target {', '.join(_with_option('tree_core'))} file: run it with this tree core instead of its own.")


def common_options(f):
    """:data:`COMMON_OPTIONS`: the command takes ``preset, bugs, model, device, page_size, target, tree_core``."""
    for opt in reversed(COMMON_OPTIONS):
        f = opt(f)
    return f


def require_target(config, recorded_in: str | None = None) -> None:
    """Raises :class:`UnavailableError` (69) unless the config's engine can run here (its kind's ``probe``: not
    installed, or a release that cannot drive it), :class:`InputError` for a kind not registered, and
    :class:`kvaudit.targets.registry.TargetDefinitionError` unless a plugin kind's target, built once now,
    keeps the target API (the built-in kinds' tests hold theirs): each a one-line error. ``recorded_in``: the
    replay file ``config`` came from, named first (the user gave no ``--target``: the file did)."""
    try:
        kind = registry.kind_of(config)
        kind.probe(config)
    except (registry.TargetUnavailable, registry.UnknownTargetError) as e:
        where = f"{shown_path(recorded_in)} was recorded on --target {config.target}: " if recorded_in else ""
        # NOTE: what this host lacks, as atheris and redis-py: 69, not the user's input (2)
        raise (UnavailableError if isinstance(e, registry.TargetUnavailable) else InputError)(where + str(e)) from None
    if kind.name in registry.BUILTIN_KINDS:
        return
    target = make_target(config)  # (TargetDefinitionError: one line, exit 2, a constructor's error among them)
    try:
        target.close()
    except Exception as e:  # noqa: BLE001 -- the plugin's own code: named in one line, not a kvaudit bug
        raise InputError(f"target {kind.name}: its close() failed: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None


def select_config(preset: str, bugs: tuple[str, ...], model: str, device: str, page_size: int | None,
                  target: str = registry.DEFAULT_KIND, tree_core: str | None = None):
    """The config the :data:`COMMON_OPTIONS` name. Raises :class:`InputError` for a bad combination,
    :class:`UnavailableError` where its engine cannot run here (:func:`require_target`)."""
    check_device(device)
    kind = registry.get(target)  # --target's TargetChoice checked the name
    if tree_core is not None and "tree_core" not in kind.options:
        raise InputError(f"--tree-core applies to --target {', '.join(_with_option('tree_core'))} only")
    try:
        chosen = kind.preset(preset)
    except UnknownPresetError as e:  # (one the installed release cannot drive: a release this host lacks, 69)
        raise (UnavailableError(str(e)) if kind.refusal(kind.default_preset if preset == "default" else preset)
               else InputError(str(e) + _other_kind_hint(kind, preset))) from None
    except registry.TargetUnavailable as e:  # a plugin's presets() that needs its engine (as require_target says)
        raise UnavailableError(str(e)) from None
    if model not in kind.model_choices:
        raise InputError(f"--model {model} is for the built-in engine: --target {kind.name} computes no KV")
    check_bugs(kind, bugs)
    changes = {}
    if len(kind.model_choices) > 1:
        changes["model"] = model
    if _has_field(kind.config_class, "device"):
        changes["device"] = device
    elif device != "cpu":
        raise InputError(f"--device {device} does not apply to --target {kind.name}: it computes no KV (CPU only)")
    if "tree_core" in kind.options:
        changes["tree_core"] = tree_core or kind.options["tree_core"][0][0]
    if page_size is not None:
        if not _has_field(kind.config_class, "page_size"):
            raise InputError(f"--page-size does not apply to --target {kind.name}: its presets set the page "
                             f"(block) size; see kvaudit presets")
        changes["page_size"] = page_size
    try:
        config = chosen.config(**changes)
        if bugs:  # --bug adds to the preset's own bugs
            config = config.replace(bugs=frozenset(config.bugs) | frozenset(bugs))
    except ValueError as e:
        raise InputError(f"bad configuration: {e}") from None
    require_target(config)
    return config


def _other_kind_hint(kind, preset: str) -> str:
    """`` ("x" is a preset of --target K: add --target K)`` when another kind K (the first) has ``preset``, else "";
    never for ``default`` or the kind's own default preset (the name was not the user's choice of a preset)."""
    if preset in ("default", kind.default_preset):
        return ""
    other = next((k.name for k in registry.kinds().values() if k is not kind and preset in _presets_here(k)), None)
    return f" ({json_value(preset)} is a preset of --target {other}: add --target {other})" if other else ""


def _presets_here(kind):
    """``kind.presets()``, or nothing where its engine is not installed (a plugin's that raises TargetUnavailable)."""
    try:
        return kind.presets()
    except registry.TargetUnavailable:
        return {}


def names_arg(value: str, valid, what: str, hint: str, every: str | None = "all") -> list[str]:
    """A comma-separated list of names in ``valid`` (``every``: all), each once (the first kept; a name given
    twice is one line of warning). ``what`` starts with the option (``--bugs: unknown bug``). Raises
    :class:`InputError`."""
    given = list(valid) if value == every else [n.strip() for n in value.split(",")]  # "" is bad
    names = list(dict.fromkeys(given))
    bad = [n for n in names if n not in valid]
    if every is not None and every in bad:
        raise InputError(f"{what} {json_value(every)} in a list ({json_value(value)}): {json_value(every)} stands "
                         f"alone ({hint})")
    if bad:  # (a list of nothing but commas and blanks: the whole value)
        raise InputError(f"{what} {json_value(value if not any(names) else bad[0])} ({hint})")
    if len(names) < len(given):
        twice = [n for n in names if given.count(n) > 1]
        click.echo(f"warning: {what.split(':')[0]} names {', '.join(map(json_value, twice))} more than once; "
                   "each runs once", err=True)
    return names


def presets_arg(option: str, value: str, target: str = registry.DEFAULT_KIND) -> list[str]:
    """``option``'s ``all`` or comma-separated list of the ``target`` kind's presets (:func:`names_arg`); a
    preset the kind knows but the installed release cannot drive says which release can (``kind.refusal``:
    :class:`UnavailableError`, 69), one that another kind has says to add its ``--target``."""
    kind = registry.get(target)
    try:
        presets = kind.presets()
    except registry.TargetUnavailable as e:  # (as select_config says it)
        raise UnavailableError(str(e)) from None
    # `default` names the kind's default preset, as --preset's default does
    value = ",".join(kind.default_preset if n.strip() == "default" else n for n in value.split(","))
    try:
        return names_arg(value, presets, f"{option}: unknown preset", f"valid: {', '.join(presets)}, or all")
    except InputError as e:
        bad = next((n.strip() for n in value.split(",") if n.strip() and n.strip() not in presets), None)
        refused = bad and kind.refusal(bad)
        if refused:
            raise UnavailableError(f"{option}: {refused}") from None
        raise InputError(str(e) + (_other_kind_hint(kind, bad) if bad else "")) from None


def check_bugs(kind, bugs) -> None:
    """Raises :class:`InputError` naming the first ``--bug`` that is not in ``kind.bugs()``, the valid
    names, and the kind that has it when exactly one other does."""
    valid = kind.bugs()
    unknown = [b for b in bugs if b not in valid]
    if not unknown:
        return
    noun = "fault" if getattr(kind.config_class, "BUGS_NOUN", "").startswith("fault") else "bug"
    msg = (f"unknown {noun} {json_value(unknown[0])}"
           + ("" if kind.name == registry.DEFAULT_KIND else f" for --target {kind.name}")
           + f"; valid {noun}s: {', '.join(valid) or 'none'}")
    others = sorted({k.name for b in unknown for k in registry.kinds().values() if k is not kind and b in _bugs_of(k)})
    if len(others) == 1:  # as for a preset: the bug is another target kind's
        fix = f"drop --target {kind.name}" if others[0] == registry.DEFAULT_KIND else f"add --target {others[0]}"
        msg += f" ({', '.join(unknown)} is a bug of --target {others[0]}: {fix})"
    raise InputError(msg)


def _bugs_of(kind) -> dict:
    # NOTE: only for a hint: a plugin kind that fails to list its bugs has none
    try:
        return kind.bugs()
    except Exception:
        return {}


def _has_field(cls, name: str) -> bool:
    return dataclasses.is_dataclass(cls) and any(f.name == name for f in dataclasses.fields(cls))


def with_tree_core(config, tree_core: str | None):
    if tree_core is None:
        return config
    if "tree_core" not in registry.kind_of(config).options:
        raise InputError(f"--tree-core applies to replay files of --target {', '.join(_with_option('tree_core'))} only")
    return config.replace(tree_core=tree_core)


def check_fuzzer(fuzzer: str, target: str) -> None:
    """Raises :class:`InputError` naming the fuzzers that can when ``fuzzer`` cannot search ``target``."""
    kind = fuzzers.get(fuzzer)
    if not kind.takes(target):
        raise InputError(f"--fuzzer {fuzzer} {kind.targets_why or 'cannot search this target'}; use "
                         f"{fuzzers.words(fuzzers.alternatives(target, fuzzer))} with --target {target}")


def check_available(fuzzer: str) -> None:
    """Raises :class:`UnavailableError` (exit 69) when what ``fuzzer`` needs is not installed here."""
    why = fuzzers.unavailable(fuzzer)
    if why is not None:
        raise UnavailableError(str(why))


def check_db(url: str, reach: bool = True):
    """The ``redis.Redis`` client of ``--db`` ``url``, which answered a PING (``reach`` False: the URL's form
    only, and None, for a run that will not use it). Raises :class:`InputError` for a bad URL,
    :class:`UnavailableError` when nothing answers there."""
    from kvaudit.search.hub import BadURL, HubError, connect, fleet_ttl, safe_url

    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise InputError(f"--db {json_value(safe_url(url))}: want a Redis URL (redis://HOST:PORT/N, rediss://... or unix://...)")
    try:
        fleet_ttl()  # (read by the campaign once its engine is built: a bad one refused here, before)
    except ValueError as e:
        raise InputError(str(e)) from None
    try:
        client = connect(url, check=reach)  # (not reached: the URL parsed as redis-py parses it, nothing sent)
    except BadURL as e:  # redis-py could not parse it (a non-numeric port)
        raise InputError(str(e)) from None
    except HubError as e:
        if not reach:  # (no redis-py: a run that will not use --db does not need it)
            return None
        raise UnavailableError(str(e)) from None
    return client if reach else None


class FuzzerChoice(click.Choice):
    """``--fuzzer``: a registered fuzzer's name (read when checked or shown: a plugin's fuzzer counts)."""

    def __init__(self):
        super().__init__(())

    @property
    def choices(self):
        return tuple(fuzzers.kinds())

    @choices.setter
    def choices(self, _value):  # click.Choice.__init__ sets it: the registry is the list
        pass


def check_device(device: str) -> None:
    """Raises :class:`InputError` (one line) for a CUDA device on a machine without one."""
    why = device_unavailable(device)
    if why is not None:
        raise InputError(why)


def check_plugins() -> None:
    """Raises :class:`InputError` naming each ``KVAUDIT_PLUGINS`` module that did not import (a typo is
    not silently a missing target); warns on stderr of plugins that failed to load or registered no kind."""
    try:
        registry.check_plugins()
    except registry.PluginError as e:
        raise InputError(str(e)) from None
    for line in registry.plugin_warnings():
        click.echo(f"warning: {line}", err=True)


def warn_campaign_without_db(campaign_name: str, db: str | None, err: Console) -> None:
    if db is None and campaign_name != "default":
        err.print(f"warning: --campaign {campaign_name} names a campaign shared through --db; without --db it is "
                  "ignored", soft_wrap=True, markup=False)


def note_campaign_keeps_nothing(fuzzer: str, target: str, err: Console) -> None:
    """A campaign of a fuzzer that keeps no programs (``FuzzerKind.resumes`` False: random, random-96): its rerun
    resumes the findings only, and under the same ``--seed`` draws the same programs again (tester 59). Names
    the fuzzers that resume and can search ``target``."""
    if fuzzers.get(fuzzer).resumes is False:
        others = sorted(n for n, k in fuzzers.kinds().items() if k.resumes and k.takes(target))
        err.print(f"note: --fuzzer {fuzzer} keeps no programs: a rerun of this campaign resumes its findings only and, "
                  f"with the same --seed, runs the same programs again (vary --seed"
                  + (f", or use --fuzzer {fuzzers.words(others)})" if others else ")"),
                  soft_wrap=True, markup=False)


def warn_unreachable_bugs(config, err: Console) -> None:
    rows = registry.kind_of(config).bugs()
    for name in sorted(config.bugs):
        want = getattr(rows.get(name), "preset", None)
        if want is not None and want != config.preset:
            err.print(f"warning: bug {name} is reached through preset {want}; with preset {config.preset} "
                      "it may never trigger", soft_wrap=True)


def presets_table(target: str | None = None):
    """``kvaudit presets``: every registered kind's presets (``target``: that kind's only)."""
    from rich.table import Table

    t = Table(title="presets")
    t.add_column("preset", no_wrap=True)
    t.add_column("description")
    t.add_column("target", no_wrap=True)
    for kind in (k for k in registry.kinds().values() if target in (None, k.name)):
        label = kind.name if kind.name == registry.DEFAULT_KIND else f"{kind.name} (--target {kind.name})"
        try:
            presets = kind.presets()
        except registry.TargetUnavailable as e:  # (a plugin's engine not installed here: the others still list)
            t.add_row("-", f"unavailable here: {e}", label)
            continue
        for p in presets.values():
            t.add_row(p.name, p.description, label)
    return t


def bugs_renderables(target: str | None = None) -> list:
    """``kvaudit bugs``: per registered kind (``target``: that one only), a zoo's table and descriptions
    (rows with a public ``source``) or a table of injected faults."""
    from rich.table import Table
    from rich.text import Text

    out = []
    for kind in (k for k in registry.kinds().values() if target in (None, k.name)):
        try:
            rows = kind.bugs()
        except registry.TargetUnavailable:  # (its engine is not installed here: kvaudit presets says why)
            continue
        if not rows:
            continue
        if all(hasattr(b, "source") for b in rows.values()):
            t = Table(title=kind.bugs_title, caption_justify="left",
                      caption="finding: the first that `kvaudit fuzz --preset PRESET --bug BUG --seed 1` reports; "
                              "another seed can meet another symptom of the same bug first (a crash, a drift)")
            t.add_column("bug", no_wrap=True)  # the name is what --bug takes: never cut it
            for col in ("preset", "source", "finding"):
                t.add_column(col, overflow="fold")
            for name, b in rows.items():
                t.add_row(name, b.preset, b.source, b.finding)
            out.append(t)
            out += [Text.assemble((name, "bold"), f": {b.description}") for name, b in rows.items()]
            continue
        f = Table(title=kind.bugs_title)
        f.add_column("fault", no_wrap=True)
        f.add_column("finding")
        f.add_column("what it does", overflow="fold")
        for name, b in rows.items():
            f.add_row(name, getattr(b, "finding", ""), getattr(b, "description", str(b)))
        out.append(f)
    return out

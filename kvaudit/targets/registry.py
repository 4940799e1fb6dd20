"""The registry of target kinds: everything kvaudit knows about an engine it can drive.

A target kind registers, once, its config class and presets, the bugs or faults ``--bug`` takes,
how a target is built, its dependency probe with the install hint, its report header, where a
finding with no stack is anchored in SARIF, the program features it models and where its engine's
source lives. The CLI's ``--target`` choices and help, ``kvaudit presets``, ``kvaudit bugs``,
replay files' ``config.target`` and the reports all read it, so adding an engine touches only its
own folder.

Kinds come from three places, in order: the built-ins (``eut``, ``sglang``, ``vllm``), the modules named in
the ``KVAUDIT_PLUGINS`` environment variable (comma-separated, imported on first use: each calls
:func:`register`), and installed packages' ``kvaudit.targets`` entry points (each names a module, or
a callable returning a :class:`TargetKind`). A ``KVAUDIT_PLUGINS`` module that is not on ``sys.path``
is looked for in the current directory too, as ``python -m kvaudit`` and pytest (its rootdir) find it:
the directory is appended to ``sys.path``, after the installed packages, which it never shadows.
Nothing here imports torch or an engine: a kind's callables import what they need when called.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Mapping

from kvaudit.config import Preset, json_value

PLUGINS_ENV = "KVAUDIT_PLUGINS"
DEFAULT_KIND = "eut"  # --target's default, and a replay file's when its config names no target
ENTRY_POINT_GROUP = "kvaudit.targets"


class UnknownTargetError(ValueError):
    """A target name, or a replay file's ``config.target``, that no registered kind has."""


class TargetDefinitionError(ValueError):
    """A mistake in a target's own code, not in its engine: a :class:`TargetKind` or a built target
    that does not keep the target API (a pool kind kvaudit does not know, a required method left out,
    ``roots()`` that are not :class:`kvaudit.targets.base.Root` objects). The message is one line naming
    the target kind and what is wrong (the CLI: exit 2)."""


class PluginError(RuntimeError):
    """A module named in ``KVAUDIT_PLUGINS`` could not be imported: one line per module, ``; ``-joined."""


class TargetUnavailable(RuntimeError):
    """A kind's engine cannot be driven here (not installed, wrong version): the message is one line
    with the install hint."""


def _none(*_a, **_k):
    return None


def _no_features(_config) -> frozenset[str]:
    return frozenset()


def server_args_capabilities(config) -> frozenset[str]:
    """``capabilities`` of a config named after SGLang's server arguments (the built-in engine's and
    real SGLang's): ``sessions`` with ``enable_streaming_session``, ``prefix_cache`` unless
    ``disable_radix_cache``."""
    return (frozenset({"sessions"} if config.enable_streaming_session else ())
            | frozenset({"prefix_cache"} if not config.disable_radix_cache else ()))


def fault_rows(faults: Mapping[str, tuple[str, str]]) -> Callable[[], dict]:
    """A kind's ``bugs`` from its table ``name -> (finding kind, description)``: the rows of ``kvaudit bugs``."""
    return lambda: {name: SimpleNamespace(name=name, finding=kind, description=what)
                    for name, (kind, what) in faults.items()}


def preset_label(config, presets: Mapping, ignore: tuple[str, ...] = ()) -> str:
    """``config.preset`` for a report header, with ``(modified: field=value, ...)`` for the fields that differ
    from that preset's (``bugs``, ``seed``, ``preset`` and ``ignore`` left out)."""
    preset = config.preset
    if preset in presets:
        base, mine = presets[preset].config().to_dict(), config.to_dict()
        changed = [f"{k}={mine[k]}" for k in mine
                   if k not in ("bugs", "seed", "preset", *ignore) and mine[k] != base.get(k)]
        if changed:
            preset += f" (modified: {', '.join(changed)})"
    return preset


@dataclass(frozen=True)
class TargetKind:
    """One kind of target.

    ``name``: the ``--target`` choice and a config's ``target`` in replay files. ``summary``: one line
    for ``--target``'s help. ``config_class``: the kind's config (a frozen dataclass with ``preset``
    and ``bugs`` fields and ``to_dict``/``from_dict``/``replace``, e.g. :class:`kvaudit.config.ConfigBase`);
    a config belongs to the kind whose class is nearest its own (:func:`kind_of`). ``presets()``: name ->
    preset (``.name``, ``.description``, ``.config(**changes)``), in the order ``kvaudit presets``
    lists them; ``default_preset`` is what ``--preset default`` means. ``bugs()``: name -> one-line
    description of what ``--bug NAME`` switches on (a zoo bug or an injected fault); ``bugs_title``
    heads ``kvaudit bugs``' table. ``make(config)``: the :class:`kvaudit.targets.base.Target`.

    Optional: ``from_dict(d)`` builds the config from a replay file's ``config`` (default
    ``config_class.from_dict`` without the ``target`` key); ``probe(config)`` raises
    :class:`TargetUnavailable` when the engine cannot be driven here; ``header(config)`` is the
    report's first line; ``anchor(kind)`` returns ``(callable, label)``: the function whose first line
    anchors a finding of finding-kind ``kind`` that has no usable frame (SARIF); ``features(config)``
    the :data:`kvaudit.program.FEATURES` the target models; ``capabilities(config)`` which of
    :data:`kvaudit.program.CAPABILITIES` it has (``sessions``, ``prefix_cache``: the generators draw
    session turns and history-resending submits only then); ``engine_source()`` an
    :class:`EngineSource` when the engine is an installed package; ``describe(config)`` what a run's
    first line says of the target (``"target sglang 0.5.23 (rust tree core)"``), ``notes(config)``
    lines a run prints first about what is checked less there; ``model_choices`` the
    ``--model`` values it accepts (``("none",)``: it computes no KV); ``options``: the extra CLI
    options it reads, ``{name: (choices, help)}`` (``{"tree_core": (("rust", "python"), "...")}``:
    ``--tree-core``, whose first choice is the default); ``regressions``: the corpus directory (relative
    to the repository, shipped in the wheel) whose replay files ``kvaudit ci --target NAME`` checks by
    default (each reproduces with its bugs on, is deterministic and clean with them off), None: none;
    ``history()`` the engine's rows of the history suite's catalogue, ``(bugs, unreached, pins)``: the known
    public bugs of its releases (:class:`kvaudit.targets.catalogue.HistoryBug`), those the suite does
    not rediscover (:class:`kvaudit.targets.catalogue.Unreached`) and ``{version: requirements}`` a
    release's overlay installs beside it (``--no-deps``), None: none; ``export()`` what
    ``kvaudit export`` needs of the engine's server (:class:`kvaudit.targets.export_api.EngineExport`: its
    HTTP API, launch, client script and issue text parts), None: the kind has no server to export to;
    ``engine_check(config, program)`` the engine's own memory check over ``program``, run bare: (first
    step whose idle check fails, first step whose busy or idle check fails), None for never
    (``kvaudit bench``'s "SGLang idle check" column), None: the kind has none; ``warm_up()`` imports
    what ``make`` needs (the slow part of a first run), for an entry point that imports under its own
    interrupt guard (:mod:`kvaudit.entry`); by default nothing. A kind whose own invariants see state
    that lasts a single step says when it holds through its targets (``Target.transient``), not here.
    ``search_per_step_first``: how many of a search's first programs run with a check after every step
    (a hit there needs no localizing replay), for a kind whose check costs little beside its engine's
    step; None: the searches' default (:mod:`kvaudit.search.schedule`). ``refused(name)``: for a preset the
    kind knows but the installed release cannot drive (which ``presets()`` leaves out), why, in one line that
    names the releases that can and the installed one; None for any other name (by the engine's metadata: no
    import). ``all_presets()``: every preset of every release the kind drives, for a caller that adds the
    overrides a release needs and lets ``probe`` judge the result (the history suite's catalogue, a replay
    file's preset name); None: ``presets()``. ``own_findings``: the engine release the kind's own findings
    (the replay files of ``corpora/<name>/``, analysed in its ``notes.toml``) were made on: the history suite
    rediscovers each from scratch on that release; None: the kind has none.
    """

    name: str
    summary: str
    config_class: type
    presets: Callable[[], Mapping]
    make: Callable
    bugs: Callable[[], Mapping[str, str]] = dict
    bugs_title: str = "bugs"
    default_preset: str = "default"
    from_dict: Callable | None = None
    probe: Callable = _none
    header: Callable | None = None
    anchor: Callable | None = None
    features: Callable = _no_features
    capabilities: Callable = _no_features
    engine_source: Callable = _none
    describe: Callable | None = None
    notes: Callable = lambda config: []
    model_choices: tuple[str, ...] = ("none",)
    options: Mapping[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    regressions: str | None = None
    history: Callable[[], tuple[tuple, tuple, Mapping]] | None = None
    export: Callable[[], object] | None = None
    engine_check: Callable | None = None
    warm_up: Callable = _none
    search_per_step_first: int | None = None
    refused: Callable = _none
    all_presets: Callable[[], Mapping] | None = None
    own_findings: str | None = None

    def config_from_dict(self, d: dict):
        """The config of a replay file's ``config`` object. Raises ``ValueError``/``TypeError``."""
        if self.from_dict is not None:
            return self.from_dict(d)
        return self.config_class.from_dict({k: v for k, v in d.items() if k != "target"})

    def preset(self, name: str, any_release: bool = False):
        """The preset called ``name`` (``default`` is :attr:`default_preset`). Raises
        :class:`kvaudit.config.UnknownPresetError` listing the valid ones (and naming this kind unless
        it is :data:`DEFAULT_KIND`), or for a preset the installed release cannot drive, :meth:`refusal`;
        with ``any_release``, a preset of any release the kind drives (:attr:`all_presets`)."""
        from kvaudit.config import UnknownPresetError

        presets = self.any_release_presets() if any_release else self.presets()
        name = self.default_preset if name == "default" else name
        if name not in presets:
            for_kind = "" if self.name == DEFAULT_KIND else f" for --target {self.name}"
            raise UnknownPresetError(self.refusal(name) or f"unknown preset {json_value(name)}{for_kind}; "
                                                           + (f"valid presets: {', '.join(presets)}" if presets else
                                                              f"--target {self.name} has no presets (its presets() "
                                                              "is empty)"))
        return presets[name]

    def any_release_presets(self) -> Mapping:
        """Every preset of every release the kind drives (:attr:`all_presets`; without it, :attr:`presets`)."""
        return (self.all_presets or self.presets)()

    def refusal(self, name: str) -> str | None:
        """``preset "NAME": why`` for a preset the kind knows but the installed release cannot drive
        (:attr:`refused`), else None."""
        why = self.refused(name)
        return None if why is None else f"preset {json_value(name)}: {why}"


_KINDS: dict[str, TargetKind] = {}
_loaded = False


_plugin_errors: list[str] = []  # KVAUDIT_PLUGINS modules that failed to import: an error for commands
_entry_point_errors: list[str] = []  # installed entry points that failed to load: a warning
_plugin_warnings: list[str] = []  # KVAUDIT_PLUGINS modules that imported but registered no kind: a warning
_origins: dict[str, str] = {}  # kind name -> the module that called register() for it (or the plugin imported then)
_importing: list[str] = []  # the KVAUDIT_PLUGINS module being imported
_noted: set[str] = set()  # KVAUDIT_PLUGINS modules that registered something through another registry (a fuzzer)


_CALLABLES = ("presets", "make", "bugs", "probe", "features", "capabilities", "engine_source", "notes", "refused")
_OPTIONAL_CALLABLES = ("from_dict", "header", "anchor", "describe", "export", "all_presets")


def check_kind(kind: TargetKind) -> None:
    """What :func:`register` checks of a kind before it lists it: a name that ``--target`` can take
    (letters, digits, ``-``, ``_``), a one-line ``summary``, a class for ``config_class`` and callables
    where the fields are called. Raises :class:`TargetDefinitionError`."""
    name = kind.name
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_" for c in name):
        raise TargetDefinitionError(f"a target kind's name must be letters, digits, '-' or '_' (it is what --target "
                                    f"takes), got {json_value(name, 60)}")
    bad = None
    if not isinstance(kind.summary, str) or not kind.summary.strip() or "\n" in kind.summary:
        bad = f"summary must be one line of text, got {json_value(kind.summary, 60)}"
    elif not isinstance(kind.config_class, type):
        bad = f"config_class must be a class (a frozen dataclass), got {json_value(kind.config_class, 60)}"
    elif _config_fields_problem(kind.config_class):
        bad = (f"config_class {kind.config_class.__name__} must be a dataclass with the fields preset and bugs "
               f"(docs/writing-a-target.md); {_config_fields_problem(kind.config_class)}")
    else:
        bad = next((f"{f} must be callable, got {json_value(getattr(kind, f), 60)}" for f in _CALLABLES
                    if not callable(getattr(kind, f))), None) or next(
            (f"{f} must be None or callable, got {json_value(getattr(kind, f), 60)}"
             for f in _OPTIONAL_CALLABLES
             if getattr(kind, f) is not None and not callable(getattr(kind, f))), None)
    if bad:
        raise TargetDefinitionError(f"target {name}: {bad}")


def _config_fields_problem(cls: type) -> str | None:
    """What keeps ``cls`` from being a kind's config class (a preset builds it with ``preset=``, ``--bug`` sets
    ``bugs``): not a dataclass, or a dataclass without one of those fields; None when nothing."""
    if not dataclasses.is_dataclass(cls):
        return "it is not a dataclass"
    names = {f.name for f in dataclasses.fields(cls)}
    lacking = [f for f in ("preset", "bugs") if f not in names]
    return f"it has no {' and no '.join(lacking)}" if lacking else None


def _check_tables(kind: TargetKind) -> None:
    """A plugin kind's ``presets()`` and ``bugs()`` as every command reads them: each returns a mapping
    without raising, the presets :class:`~kvaudit.config.Preset` s of the kind's own config class (a
    subclass will do) that include ``default_preset``. Raises :class:`TargetDefinitionError`."""
    def bad(msg: str):
        raise TargetDefinitionError(f"target {kind.name}: {msg}")

    tables = {}
    for field_name in ("presets", "bugs"):
        try:
            tables[field_name] = getattr(kind, field_name)()
        except TargetUnavailable:  # (its engine is not installed here: the commands that need it say so)
            return
        except Exception as e:
            bad(f"{field_name}() raised {type(e).__name__}: {e}")
        if not isinstance(tables[field_name], Mapping):
            bad(f"{field_name}() must return a mapping of name -> "
                f"{'Preset' if field_name == 'presets' else 'one-line description'}, got {json_value(tables[field_name], 60)}")
    presets = tables["presets"]
    for name, p in presets.items():
        if not isinstance(p, Preset) or not (isinstance(p.config_class, type)
                                             and issubclass(p.config_class, kind.config_class)):
            bad(f"preset {json_value(name)} must be a Preset of config_class {kind.config_class.__name__} (or a "
                f"subclass), got {json_value(p, 60) if not isinstance(p, Preset) else p.config_class.__name__}")
    if presets and kind.default_preset not in presets:
        bad(f"default_preset {json_value(kind.default_preset)} is not one of its presets ({', '.join(presets)})")


def register(kind: TargetKind) -> TargetKind:
    """Add ``kind`` (or replace the kind of the same name the same module registered: a reloaded plugin).
    Returns it. Raises :class:`TargetDefinitionError` for a kind :func:`check_kind` refuses, or whose
    name another module's kind (a built-in's, another plugin's) has (a plugin module that registers one
    fails to load)."""
    global _by_class_of
    check_kind(kind)
    # (a plugin's: its replay hint names KVAUDIT_PLUGINS; a KVAUDIT_PLUGINS module another one imports is its
    # own kinds' origin, else "registered no target kind" when its own turn comes)
    caller = sys._getframe(1).f_globals.get("__name__", "")
    origin = caller if caller in _plugin_modules() or not _importing else _importing[-1]
    # (the built-ins' tables are read lazily and checked by their tests; an entry point's kind is registered
    # from this module)
    builtin = origin.startswith("kvaudit.targets.") and origin != __name__
    if (kind.name in BUILTIN_KINDS and not builtin) or (kind.name in _KINDS and _origins.get(kind.name) != origin):
        raise TargetDefinitionError(f"target {kind.name}: the name is taken ("
                                    + ("a kind kvaudit has built in" if kind.name in BUILTIN_KINDS else
                                       f"module {_origins.get(kind.name)} registered it")
                                    + "); --target names one kind: name yours otherwise")
    if not builtin and not _importing:  # (a KVAUDIT_PLUGINS module's, once it has imported whole: _load)
        _check_tables(kind)
    owner = next((k.name for k in _KINDS.values() if k.config_class is kind.config_class and k.name != kind.name), None)
    if owner is not None:  # a config names its kind by its class: --target would run the other one's target
        raise TargetDefinitionError(f"target {kind.name}: config_class {kind.config_class.__name__} is target "
                                    f"{owner}'s; a kind needs a config class of its own (a subclass will do)")
    _KINDS[kind.name] = kind
    _by_class_of = ()  # (kind_of's map is built again)
    _origins[kind.name] = origin
    return kind


def _plugin_modules() -> list[str]:
    """The modules named in ``KVAUDIT_PLUGINS``, in order."""
    return [m for m in (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",")) if m]


def _registered_from(mod: str) -> bool:
    """Whether module ``mod`` (or a module inside it) registered a kind (or, through another registry, a
    fuzzer: :func:`note_plugin_registration`)."""
    return mod in _noted or any(o == mod or o.startswith(mod + ".") for o in _origins.values())


def note_plugin_registration() -> None:
    """Called by another registry's ``register`` (:mod:`kvaudit.search.fuzzers`): the ``KVAUDIT_PLUGINS``
    module being imported now, if any, registered something, so it is not one that "registered no
    target kind"."""
    if _importing:
        _noted.add(_importing[-1])


def load_plugins() -> None:
    """Register the built-in kinds and import the ``KVAUDIT_PLUGINS`` modules and entry points, once (what
    the other registries that plugins add to call before they are read). Errors are kept for
    :func:`plugin_errors`, not raised."""
    _load()


def plugins_env(name: str) -> str | None:
    """``KVAUDIT_PLUGINS=<value>`` when the kind called ``name`` was registered by a module this run's
    ``KVAUDIT_PLUGINS`` names (a command that reads the kind back, ``kvaudit replay FILE``, needs it
    too), else None (a built-in kind or an installed entry point's). Shell-quoted."""
    import shlex

    _load()
    origin = _origins.get(name, "")
    if name in BUILTIN_KINDS or not any(origin == m or origin.startswith(m + ".") for m in _plugin_modules()):
        return None
    return f"{PLUGINS_ENV}={shlex.quote(os.environ[PLUGINS_ENV])}"


def _import_plugin(mod: str) -> None:
    """Import the ``KVAUDIT_PLUGINS`` module ``mod``; one not found on ``sys.path`` is looked for in the
    current directory (appended to ``sys.path``, so installed packages keep precedence). Raises what
    the import raises."""
    try:
        importlib.import_module(mod)
        return
    except ModuleNotFoundError as e:
        parts = mod.split(".")
        here = os.getcwd()
        # only the module itself (or a package above it) missing: not a module the plugin imports
        if e.name not in {".".join(parts[:i]) for i in range(1, len(parts) + 1)} or here in sys.path:
            raise
    sys.path.append(here)
    importlib.invalidate_caches()
    try:
        importlib.import_module(mod)
    except ModuleNotFoundError as e:
        sys.path.remove(here)  # not there either: leave the path as it was
        raise ModuleNotFoundError(f"{e} (looked on sys.path and in the current directory {here})", name=e.name) \
            from None




def _load() -> None:
    """Register the built-ins, then ``KVAUDIT_PLUGINS`` modules, then entry points (once)."""
    global _loaded, _by_class_of
    if _loaded:
        return
    _loaded = True
    for name in BUILTIN_KINDS:  # through the plugins' seam: the registry imports no kind (docs/architecture.md)
        importlib.import_module(f"kvaudit.targets.{name}.kind")
    for mod in _plugin_modules():
        _importing.append(mod)
        try:
            _import_plugin(mod)
            for name in [n for n, o in _origins.items() if o == mod]:  # its kinds' tables, the module whole
                try:
                    _check_tables(_KINDS[name])
                except TargetDefinitionError:
                    _KINDS.pop(name), _origins.pop(name)
                    _by_class_of = ()
                    raise
        except Exception as e:  # noqa: BLE001 -- a broken plugin is named, never a traceback
            why = " ".join(str(e).split())  # one line, whatever the module raised
            why = why if len(why) <= 400 else why[:397] + "..."  # (it may name a module of 100,000 characters)
            # (a kind it registered that register() refuses: the module imported, its kind did not load)
            verb = "cannot load the target kind of" if isinstance(e, TargetDefinitionError) else "cannot import"
            _plugin_errors.append(f"{verb} {json_value(mod, 80)} named in {PLUGINS_ENV}: {type(e).__name__}: {why}")
            continue
        finally:
            _importing.pop()
        if not _registered_from(mod):  # (KVAUDIT_PLUGINS=os: imports, and adds nothing)
            _plugin_warnings.append(f"module {json_value(mod)} named in {PLUGINS_ENV} registered no target kind")
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, type):
                got = obj()
                if isinstance(got, TargetKind):
                    register(got)
        except Exception as e:  # noqa: BLE001
            _entry_point_errors.append(f"cannot load entry point {json_value(ep.name)} ({ep.value}): {type(e).__name__}: {e}")


def plugin_errors() -> list[str]:
    """One line per plugin (``KVAUDIT_PLUGINS`` module or entry point) that failed to load; empty when
    every one loaded. Loads the registry first."""
    _load()
    return _plugin_errors + _entry_point_errors


def plugin_warnings() -> list[str]:
    """One line per plugin problem that does not stop a command: an installed ``kvaudit.targets``
    entry point that failed to load (the user did not name it), a ``KVAUDIT_PLUGINS`` module that
    imported but registered no target kind (``KVAUDIT_PLUGINS=os``). Loads the registry first."""
    _load()
    return _entry_point_errors + _plugin_warnings


def check_plugins() -> None:
    """Every module named in ``KVAUDIT_PLUGINS`` imported: else :class:`PluginError`, one line naming
    each that did not (a misspelled module is the user's input, not a missing target to shrug at).
    Loads the registry first."""
    _load()
    if _plugin_errors:
        raise PluginError(_first_errors(_plugin_errors))


def _first_errors(errors: list[str]) -> str:
    """``errors`` on one line: the first three, then how many more (a list of thousands is no line)."""
    more = f"; and {len(errors) - 3} more" if len(errors) > 3 else ""
    return "; ".join(errors[:3]) + more


BUILTIN_KINDS = ("eut", "sglang", "vllm")
"""The built-in kinds; each registers itself in ``kvaudit/targets/<name>/kind.py``, imported by name on first use."""


def kinds() -> dict[str, TargetKind]:
    """Every registered kind, by name: the built-ins first, then the others in registration order (a
    plugin module imported before the registry first loaded registered ahead of them)."""
    _load()
    order = [n for n in BUILTIN_KINDS if n in _KINDS] + [n for n in _KINDS if n not in BUILTIN_KINDS]
    return {n: _KINDS[n] for n in order}


def get(name: str) -> TargetKind:
    """The kind called ``name``. Raises :class:`UnknownTargetError` naming the valid ones."""
    _load()
    if name not in _KINDS:
        why = _first_errors(plugin_errors()) or (f"a target from a plugin needs {PLUGINS_ENV}=<module> or an installed "
                                            f"{json_value(ENTRY_POINT_GROUP)} entry point")
        raise UnknownTargetError(f"unknown target {json_value(name)} (valid: {', '.join(_KINDS)}; {why})")
    return _KINDS[name]


_by_class: dict[type, TargetKind] = {}  # kind_of's map of config classes, built once for the kinds registered
_by_class_of: tuple = ()


def kind_of(config) -> TargetKind:
    """The kind whose config class ``config`` is an instance of; of several (a kind's config class
    subclassing another kind's), the one nearest ``config``'s own class, so a plugin that extends
    another kind's config runs its own kind. Raises :class:`UnknownTargetError`."""
    global _by_class, _by_class_of
    _load()
    state = (id(_KINDS), len(_KINDS))  # (register resets it; a test may swap _KINDS or pop a kind)
    if state != _by_class_of:
        _by_class_of, _by_class = state, {k.config_class: k for k in reversed(_KINDS.values())}  # (the first wins)
    for cls in type(config).__mro__:
        if cls in _by_class:
            return _by_class[cls]
    raise UnknownTargetError(f"no registered target takes a {type(config).__name__}")


def kind_name(target) -> str:
    """The registered kind of a built ``target`` (of its ``config``), for messages; its class name when
    no kind takes the config."""
    try:
        return kind_of(target.config).name
    except (AttributeError, UnknownTargetError):
        return type(target).__name__


def kind_of_dict(d: object) -> TargetKind:
    """The kind of a replay file's ``config`` object: its ``target`` key, :data:`DEFAULT_KIND` when absent."""
    name = d.get("target", DEFAULT_KIND) if isinstance(d, dict) else DEFAULT_KIND
    if not isinstance(name, str):
        raise UnknownTargetError(f"config.target must be a string, got {json_value(name)}")
    return get(name)

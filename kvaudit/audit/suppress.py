"""Suppressions: known findings to leave out of a run, read from a TOML file of ``[[suppress]]``
rules (``kind``, ``pool``, ``site``, ``signature`` globs and a ``reason``), in the manner of LeakSanitizer's.

Design notes (the file format, what a rule matches): docs/internals/audit.md.
"""

from __future__ import annotations

import codecs
import dataclasses
import os
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Iterable, Iterator

from kvaudit.config import json_value
from kvaudit.audit.findings import KINDS, Finding, installed, source_path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tomli backport has the same API, when installed
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

KEYS = ("kind", "pool", "site", "signature", "reason")
_PATTERN_KEYS = ("kind", "pool", "site", "signature")


class SuppressionError(ValueError):
    """A suppression file that cannot be used. The message is one line and names the file (and,
    for a bad rule, its 1-based ``[[suppress]]`` entry number)."""


@dataclass
class Suppression:
    """One ``[[suppress]]`` rule. ``None`` in ``kind``/``pool``/``site``/``signature`` means "any";
    ``signature`` is a glob on :attr:`Finding.signature` (the one key that tells apart two findings with no
    frame, such as two accounting drifts of one pool); ``index`` is its 1-based position in its file;
    ``hits`` and ``signatures``: the findings it suppressed."""

    kind: str | None = None
    pool: str | None = None
    site: str | None = None
    signature: str | None = None
    reason: str = ""
    index: int = 0
    hits: int = dataclasses.field(default=0, compare=False)
    signatures: set[str] = dataclasses.field(default_factory=set, compare=False, repr=False)

    def matches(self, finding: Finding) -> bool:
        """Whether this rule covers ``finding`` (no hit is counted)."""
        if self.kind is not None and self.kind != "*" and self.kind != finding.kind:
            return False
        if self.pool is not None and not fnmatchcase(finding.pool, self.pool):
            return False
        if self.signature is not None and not fnmatchcase(finding.signature, self.signature):
            return False
        if self.site is not None:
            return any(fnmatchcase(text, self.site) for text in _site_texts(finding))
        return True

    def describe(self) -> str:
        """``kind=leak pool=hisparse_*``: the keys this rule gives, for one-line messages."""
        return " ".join(f"{k}={getattr(self, k)}" for k in _PATTERN_KEYS if getattr(self, k) is not None)


def _site_texts(finding: Finding) -> Iterator[str]:
    # NOTE: the lost release's stack too: a leak's signature names that path, so a rule for one leak names it
    sites = (*finding.alloc_sites, *finding.free_sites, *finding.prev_free_sites, *finding.read_sites, *finding.lost_sites)
    if not sites:  # (an accounting drift, a hang: no frame; tried as the empty text, so site="*" covers it)
        yield ""
    for site in sites:
        yield site.short()
        yield f"{site.file.replace(os.sep, '/')}:{site.line} in {site.function}"
        if installed(site.file):  # an installed package's frame (vllm/...): also its path on this machine, as
            # rules written before frames were recorded package-relative (2026-12) name it
            yield f"{source_path(site.file).replace(os.sep, '/')}:{site.line} in {site.function}"


def _key(finding: Finding) -> tuple:
    # NOTE: a leak is re-reported after every step while it lasts (with more slots): counted once
    return (finding.signature, tuple(finding.alloc_sites), tuple(finding.free_sites))


def load_suppressions(path: str) -> list[Suppression]:
    """The rules of the TOML suppression file at ``path``, in file order. Raises
    :class:`SuppressionError` (one line, naming ``path`` and the entry) for a missing or unreadable
    file, one that is not TOML (or not UTF-8), a top-level key other than ``suppress``, an entry that
    is not a table, an unknown key, a value that is not a non-empty string (``reason`` may be empty),
    an unknown ``kind``, or an entry with none of ``kind``, ``pool``, ``site`` and ``signature``."""
    if tomllib is None:
        raise SuppressionError(f"cannot read {path}: suppression files need Python 3.11 (tomllib) or the "
                               "tomli package")
    bom = 0
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # an editor's byte-order mark: skipped
        doc = tomllib.loads(data[bom:].decode("utf-8"))
    except OSError as e:
        raise SuppressionError(f"cannot read suppression file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SuppressionError(f"{path} is not a TOML suppression file: {' '.join(str(e).split())}") from None
    except UnicodeDecodeError as e:
        raise SuppressionError(f"{path} is not a TOML suppression file: not UTF-8 ({e.reason} at byte "
                               f"{bom + e.start})") from None
    except RecursionError:  # (arrays or inline tables nested thousands deep)
        raise SuppressionError(f"{path} is not a TOML suppression file: nested too deeply") from None
    extra = sorted(set(doc) - {"suppress"})
    if extra:
        raise SuppressionError(f"{path}: unknown top-level key {json_value(extra[0], 60)} (want [[suppress]] tables)")
    entries = doc.get("suppress", [])
    if not isinstance(entries, list):
        raise SuppressionError(f"{path}: \"suppress\" must be an array of tables ([[suppress]]), "
                               f"got {json_value(entries, 60)}")
    return [_entry(path, i, e) for i, e in enumerate(entries, start=1)]


def _entry(path: str, index: int, entry) -> Suppression:
    where = f"{path}: [[suppress]] entry {index}"
    if not isinstance(entry, dict):
        raise SuppressionError(f"{where}: must be a table, got {json_value(entry, 60)}")
    unknown = [k for k in entry if k not in KEYS]
    if unknown:
        raise SuppressionError(f"{where}: unknown key {json_value(unknown[0], 60)} (valid keys: {', '.join(KEYS)})")
    for k, v in entry.items():
        if not isinstance(v, str):
            raise SuppressionError(f"{where}: {k} must be a string, got {json_value(v, 60)}")
        if k != "reason" and not v:
            raise SuppressionError(f"{where}: {k} must not be empty (leave the key out to match any {k})")
    if not any(k in entry for k in _PATTERN_KEYS):
        raise SuppressionError(f"{where}: give at least one of kind, pool, site, signature")
    kind = entry.get("kind")
    if kind is not None and kind != "*" and kind not in KINDS:
        raise SuppressionError(f"{where}: unknown kind {json_value(kind, 60)} (valid kinds: {', '.join(KINDS)}, or \"*\")")
    return Suppression(kind=kind, pool=entry.get("pool"), site=entry.get("site"), signature=entry.get("signature"),
                       reason=entry.get("reason", ""), index=index)


class SuppressionSet:
    """The rules of one suppression file, matched in order, with their hit counts."""

    def __init__(self, suppressions: Iterable[Suppression], path: str | None = None):
        self.suppressions = list(suppressions)
        self.path = path

    @classmethod
    def load(cls, path: str) -> "SuppressionSet":
        """:func:`load_suppressions` as a set."""
        return cls(load_suppressions(path), path)

    def __iter__(self) -> Iterator[Suppression]:
        return iter(self.suppressions)

    def __len__(self) -> int:
        return len(self.suppressions)

    @property
    def needs_full_stacks(self) -> bool:
        """Some rule has a ``site`` glob: it may name any frame, not only the fast mode's innermost."""
        return any(s.site is not None for s in self.suppressions)

    def match(self, finding: Finding) -> Suppression | None:
        """The first rule that covers ``finding``, its hit counted; None if no rule does."""
        rule = next((s for s in self.suppressions if s.matches(finding)), None)
        if rule is not None:
            rule.hits += 1
            rule.signatures.add(finding.signature)
        return rule

    def sift(self, findings: list[Finding], suppressed: list[Finding]) -> list[Finding]:
        """The findings no rule covers. Covered ones are appended to ``suppressed`` (one run's list), unless
        already there (a leak re-reported on a later step); a hit is counted once per signature in the run,
        as the run reports one finding per signature (the units of one bug allocated in two steps are two
        findings here, merged into one after the sift: they counted two hits)."""
        kept = []
        seen = {_key(g) for g in suppressed} if findings else set()
        counted = {(self._rule(g), g.signature) for g in suppressed} if findings else set()
        for f in findings:
            rule = self._rule(f)
            if rule is None:
                kept.append(f)
            elif _key(f) not in seen:
                if (rule, f.signature) not in counted:
                    self.match(f)
                    counted.add((rule, f.signature))
                suppressed.append(f)
                seen.add(_key(f))
        return kept

    def _rule(self, finding: Finding) -> int | None:
        """The index of the first rule that covers ``finding`` (no hit counted); None if none does."""
        return next((i for i, s in enumerate(self.suppressions) if s.matches(finding)), None)

    def unused(self) -> list[Suppression]:
        """The rules that have matched nothing so far, in file order."""
        return [s for s in self.suppressions if s.hits == 0]

    def fresh(self) -> "SuppressionSet":
        """The same rules with every hit count at zero."""
        return SuppressionSet([dataclasses.replace(s, hits=0, signatures=set()) for s in self.suppressions], self.path)

    def usage(self) -> list[tuple[int, list[str]]]:
        """Each rule's ``(hits, sorted signatures)`` so far, in file order (what a campaign's worker sends its
        parent, :meth:`add_usage`)."""
        return [(s.hits, sorted(s.signatures)) for s in self.suppressions]

    def add_usage(self, usages) -> None:
        """Count ``usages`` (each a :meth:`usage` of a set of the same rules: a worker's) into these rules."""
        for usage in usages:
            for rule, (hits, signatures) in zip(self.suppressions, usage):
                rule.hits += hits
                rule.signatures.update(signatures)

    def suppressed_signatures(self) -> set[str]:
        """The signatures of every finding suppressed so far."""
        return set().union(*(s.signatures for s in self.suppressions))

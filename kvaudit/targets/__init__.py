"""Targets: adapters between kvaudit and an engine."""

from kvaudit.targets.base import Accounting, PoolSpec, Root, Target
from kvaudit.targets.eut import EutTarget

__all__ = ["Accounting", "PoolSpec", "Root", "Target", "EutTarget"]

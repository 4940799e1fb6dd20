"""From a finding to an upstream report: ``kvaudit export FILE --issue OUT.md --client OUT.py``.
Design notes: docs/internals/export.md.
"""

from kvaudit.export.exporter import export

__all__ = ["export"]

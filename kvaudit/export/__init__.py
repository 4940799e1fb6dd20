"""From a finding to an upstream report: ``kvaudit export FILE --issue OUT.md --client OUT.py``.
Design notes: docs/internals/export.md.
"""

"""The jobs behind the ``kvaudit`` commands: fuzz (single runs and campaigns), replay, minimize,
ci, bench and report, with their progress display, target-config selection and errors. The click
layer (:mod:`kvaudit.cli`) parses options into plain values and calls into these modules.

Keep imports here lazy: ``kvaudit --help`` imports this package and must not pull in torch,
Hypothesis or rich (tests/test_entry.py)."""

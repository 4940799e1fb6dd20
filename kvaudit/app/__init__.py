"""The jobs behind the ``kvaudit`` commands; :mod:`kvaudit.cli` parses options and calls them.
Keep imports here lazy (``kvaudit --help`` imports this package). Design notes: docs/internals/app.md."""

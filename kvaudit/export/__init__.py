"""From a finding to an upstream report: ``kvaudit export FILE --issue OUT.md --client OUT.py``.

:mod:`.http_api` is the one table of op -> HTTP call per engine; :mod:`.trace` resolves a program's
handles on the target; :mod:`.plan` turns the program into client calls; :mod:`.client` renders the
standalone script, :mod:`.issue` the Markdown report; :mod:`.notes` reads the analyses per signature
(``corpora/<kind>/notes.toml``).
"""

from kvaudit.export.exporter import export

__all__ = ["export"]

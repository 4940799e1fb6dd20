"""``kvaudit export``: a replay file as an issue report and a client-level reproducer."""

from __future__ import annotations

import click

from kvaudit.app.errors import EXIT_CLEAN, InputError, unreadable, write_error
from kvaudit.app.files import check_paths


def run(file: str, issue_out: str | None, client_out: str | None, resolve: bool) -> int:
    """Returns 0 once written. Raises :class:`InputError` for a bad file or flag, :class:`DiskFull`,
    :class:`UnavailableError` for a file whose target is a plugin's not loaded here, :class:`NothingChecked` for
    the ``--json`` of a run interrupted at start-up."""
    from kvaudit.export.exporter import ExportError, export
    from kvaudit.replay import NothingRecordedError, TargetNotLoadedError

    if issue_out is None and client_out is None:
        raise InputError("nothing to export: give --issue OUT.md and/or --client OUT.py")
    check_paths((file,), issue=issue_out, client=client_out)
    try:
        done = export(file, issue_out, client_out, resolve=resolve)
    except ExportError as e:
        raise InputError(str(e)) from None
    except (TargetNotLoadedError, NothingRecordedError) as e:
        raise unreadable(e) from None
    except OSError as e:
        raise write_error(e, e.filename or issue_out or client_out) from None
    for path in (done.issue, done.client):
        if path is not None:
            click.echo(f"wrote {path}")
    how = "on the target" if done.traced else "statically (--no-resolve)" if not resolve else \
        "statically (engine not installed here)"
    click.echo(f"client: {'exact' if done.exact else 'approximate'}; handles resolved {how}")
    if done.unsent is not None and done.client is not None:
        click.echo(f"note: the client cannot send this program as written, so it ends NOT CHECKED (exit 3), never "
                   f"NOT REPRODUCED: {done.unsent}", err=True)
    return EXIT_CLEAN

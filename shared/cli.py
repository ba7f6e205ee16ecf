"""What every `dls` subcommand shares: ``CliError``. The dispatcher is ``services/cli.py`` (it reaches
into the services, which ``shared`` never imports)."""

from __future__ import annotations


class CliError(Exception):
    """A user error: printed as `dls: error: ...` with exit code 2, no traceback."""

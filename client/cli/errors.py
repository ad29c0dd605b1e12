"""The CLI's one-line error (exit status 2)."""


class CliError(Exception):
    """A one-line error for the user (exit status 2)."""

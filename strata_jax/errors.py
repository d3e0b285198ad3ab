"""The one exception type a user sees: its message is a complete, single line."""


class StrataError(Exception):
    """Bad input or a failed request; the CLI prints `error: <message>` and exits non-zero."""

"""The one exception type a user sees: its message is a complete, single line."""


class StrataError(Exception):
    """Bad input or a failed request; the CLI prints `error: <message>` and exits non-zero."""


def make_writable_folder(path, what: str) -> None:
    """Create `path` (and its parents) and check that a file can be written in it; else one StrataError line that
    starts with `what`."""
    import tempfile
    from pathlib import Path
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        # A probe of its own: runs sharing the folder must not delete each other's probe.
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_probe"):
            pass
    except OSError as e:
        raise StrataError(f"{what}: {e.strerror or e} (it must be a folder you can write, or a new path whose "
                          "parents are folders)") from None

"""The one exception type a user sees: its message is a complete, single line."""


class StrataError(Exception):
    """Bad input or a failed request; the CLI prints `error: <message>` and exits non-zero."""


def unreadable_folder(folder, e: OSError) -> StrataError:
    """The one line for a model folder (or a file in it) that cannot be read: permissions, mostly (Path.is_file()
    raises PermissionError where the folder cannot be searched)."""
    name = getattr(e, "filename", None)
    return StrataError(f"cannot read the model folder {folder}: {e.strerror or e}" + (f" ({name})" if name else ""))


def os_error_behind(exc: BaseException) -> OSError | None:
    """The first OSError in exc's chain of causes (itself included), or None: libraries (orbax) wrap a full disk
    in their own exception types."""
    seen = []
    while exc is not None and all(exc is not s for s in seen):
        if isinstance(exc, OSError):
            return exc
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return None


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

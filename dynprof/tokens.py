"""The sidecars' access token: read from a private file, checked for shape.

Used by `dynprof serve` (the token it asks for) and by every client of the sidecars (the token
it sends)."""

from __future__ import annotations

import os
import stat

from dynprof import errors
from dynprof.untrusted import open_regular

MIN_TOKEN_CHARS = 16
MAX_TOKEN_FILE_BYTES = 4096


def read_token_file(path: str) -> str:
    """The token in ``path``: the file must be a regular file owned by us (or root), not
    readable or writable by group or others, and hold one token of 16+ characters (UTF-8 text:
    other bytes are refused, never replaced)."""
    with open_regular(
        path, f"cannot open the token file {path}", f"the token file {path} is not a regular file", errors.UsageError
    ) as fh:
        st = os.fstat(fh.fileno())
        if st.st_uid not in (os.getuid(), 0):
            raise errors.PermissionDenied(
                f"the token file {path} belongs to uid {st.st_uid}, not to you ({os.getuid()})",
                help="Use a token file you own, with mode 0600.",
            )
        if st.st_mode & 0o077:
            raise errors.PermissionDenied(
                f"the token file {path} is open to other users (mode {stat.S_IMODE(st.st_mode):04o})",
                help=f"chmod 600 {path}",
            )
        data = fh.read(MAX_TOKEN_FILE_BYTES + 1)
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise errors.UsageError(f"the token file {path} is over {MAX_TOKEN_FILE_BYTES} bytes: not a token")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.UsageError(
            f"the token file {path} is not UTF-8 text (byte {exc.start}): not a token",
            help=f"Write a token into it: python -c 'import secrets; print(secrets.token_urlsafe(24))' > {path}",
        ) from None
    return check_token(text.strip(), f"the token in {path}")


def check_token(token: str, what: str) -> str:
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in token):
        raise errors.UsageError(
            f"{what} must be at least {MIN_TOKEN_CHARS} printable characters without spaces",
            help="Generate one: python -c 'import secrets; print(secrets.token_urlsafe(24))'",
        )
    return token

"""The one error type for a user's mistake.

Raise `UserError` (or a subclass) with a message that names the problem and the fix; the `selfdraft`
command prints it as one line and exits with status 2 (the traceback only with `--debug`). It is a
`ValueError`, so library callers that already catch bad values keep working. Anything else that
escapes is a bug in selfdraft and keeps its traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """A bad input, file or setting; the message says what to do about it."""


class MissingFileError(UserError, FileNotFoundError):
    """A file, folder or package the user named (or must install) is not there."""

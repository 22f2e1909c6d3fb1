"""Errors a user can cause. The CLI prints them as one line and exits with status 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: a missing file, a malformed recipe, an incompatible checkpoint.

    The message names the file, field or key and says what to do.
    """


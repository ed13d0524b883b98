"""The launcher's user errors: a refusal that ``trl-fused-cpo`` prints as one ``error:`` line (exit 2), no traceback.

A :class:`LauncherError` says what is wrong (the file, row or key), why, and the fix; it is a ``ValueError``, so code
that calls the data and model loaders directly catches it as before. ``TRL_FUSED_CPO_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

DEBUG_ENV = "TRL_FUSED_CPO_DEBUG"  # set to 1: the CLI re-raises a refusal with its traceback


class LauncherError(ValueError):
    """A recipe, command line, data file, model or machine the launcher refuses, with the fix in the message."""


class MissingPackageError(LauncherError, ImportError):
    """An optional package a setting needs is not installed (``load_in_4bit`` and bitsandbytes): the install command."""

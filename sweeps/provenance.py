"""Where a sweep came from, for its ``sweeps`` row and its report: the mixdepth version, the git commit of the source
tree, the command line (every storage URL in it without its password)."""

from __future__ import annotations

import shlex
import subprocess
from importlib import metadata
from pathlib import Path

from sweeps.queue import is_url, redact

SOURCE = Path(__file__).resolve().parent  # the tree this code runs from (a checkout, or site-packages)


def version() -> str | None:
    """The installed mixdepth distribution's version, or None when it is not installed (a bare checkout)."""
    try:
        return metadata.version("mixdepth")
    except metadata.PackageNotFoundError:
        return None


def commit() -> str | None:
    """The git commit the code runs from, with ``-dirty`` appended when tracked files differ from it (the code that
    ran is then not that commit's), or None outside a git checkout (or without git); never raises."""
    git = ["git", "-C", str(SOURCE)]
    try:
        r = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if r.returncode != 0 or not r.stdout.strip():
            return None
        changed = subprocess.run([*git, "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() + ("-dirty" if changed.returncode == 1 else "")


def command(argv: list[str]) -> str:
    """``python -m sweeps <argv>`` as it may be stored: a URL argument (``--storage URL``, ``sweep.storage=URL``)
    without its password."""

    def shown(arg: str) -> str:
        if not is_url(arg):
            return arg
        key, eq, value = arg.partition("=")
        return f"{key}={redact(value)}" if eq and not is_url(key) else redact(arg)

    return shlex.join(["python", "-m", "sweeps", *map(shown, argv)])

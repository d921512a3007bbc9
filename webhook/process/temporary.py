"""Directories a process makes for itself and removes when it exits (the metrics files, the runtime store)."""

from __future__ import annotations

import atexit
import os
import shutil


def remove_at_exit(path: str) -> None:
    """`path` removed when this process exits; a child forked from it (a gunicorn worker) inherits the hook
    but leaves the directory to its parent."""
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)

"""Files that survive a crash: atomic writes (temporary file, fsync, rename, fsync)."""

import os
import socket
from pathlib import Path


def atomic_write(path, write) -> None:
    """Write `path` so that readers see the old file or the new one, never half of it.

    `write(tmp)` fills a temporary file in the same folder. The file is fsynced, renamed
    over `path`, and the folder fsynced, so the new name survives a crash too.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The same folder keeps the rename atomic; host and pid keep nodes that share a
    # folder from writing the same temporary file.
    tmp = path.with_name(f".{path.name}.tmp.{socket.gethostname()}.{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # A write that failed leaves no litter.
    fsync_dir(path.parent)


def fsync_dir(path) -> None:
    """Flush a folder's entries: new names and renames reach the disk only this way."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

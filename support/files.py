"""Crash-safe, idempotent writes: atomic files, a lock, fingerprints, a staging folder.

01_data.py writes its shards with these, train.py its checkpoints and logs. A reader of
either sees an old file or a new one, never half of one, even after a crash or a kill.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
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


@contextlib.contextmanager
def locked(folder):
    """Hold an exclusive lock on `folder` (a file `.NAME.lock` beside it) while inside.

    Two processes preparing one folder take turns: the second waits, then finds the
    first's work done instead of clearing the first's staging folder under it.
    """
    folder = Path(os.path.abspath(folder))
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f".{folder.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # The lock goes when the file closes, also when the process dies.


def fingerprint(*inputs) -> str:
    """A hash of everything that decides an output (JSON-serialisable inputs)."""
    return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()


def file_stats(files) -> list:
    """Each file's path, size and modification time: what a fingerprint sees of it."""
    stats = []
    for f in files:
        st = Path(f).stat()
        stats.append([str(f), st.st_size, st.st_mtime_ns])
    return stats


def finished_meta(folder, expected: str, meta_name: str = "meta.json") -> dict | None:
    """The folder's meta, if it was written from the same fingerprint and every file it
    lists (its "files") is still there; else None: the work must be done again."""
    meta_path = Path(folder) / meta_name
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("fingerprint") != expected:
        return None
    if not all((Path(folder) / f).exists() for f in meta.get("files", [])):
        return None
    return meta


@contextlib.contextmanager
def staging(folder):
    """A fresh, empty sibling folder `.NAME.partial` to write into, removed after.

    It sits beside `folder`, on the same disk, so renaming its files into `folder` is
    atomic. An interrupted run's staging folder is cleared first: the work restarts.
    """
    folder = Path(os.path.abspath(folder))
    stage = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def publish(stage, folder, meta: dict, meta_name: str = "meta.json") -> None:
    """Move meta["files"] from `stage` into `folder`, then write the meta, last.

    The old meta goes first, so from then until the new one is written the folder
    reads as unfinished; the renames are fsynced before the meta says "done".
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta_path = folder / meta_name
    meta_path.unlink(missing_ok=True)
    for name in meta["files"]:
        os.replace(Path(stage) / name, folder / name)
    fsync_dir(folder)
    text = json.dumps(meta, indent=1)
    atomic_write(meta_path, lambda tmp: tmp.write_text(text))


def remove_unlisted(folder, pattern: str, listed) -> None:
    """Delete the files of `folder` that match `pattern` but are not in `listed`."""
    keep = set(listed)
    for old in Path(folder).glob(pattern):
        if old.name not in keep:
            old.unlink()


def build_once(folder, inputs, build, before_publish=None, pattern="*") -> dict:
    """Fill `folder` from `inputs` once: a process at a time, atomically, idempotently.

    Under a lock on the folder: if its meta.json holds the fingerprint of `inputs` and
    every file it lists, the work is done and that meta is returned. Otherwise
    `build(stage)` writes into a fresh staging folder and returns the meta, whose
    "files" list what it wrote; `before_publish()` runs (every check has passed), the
    files are renamed into `folder`, and meta.json is written last. Files that match
    `pattern` and the new meta does not list (an earlier run's) are removed.
    """
    folder = Path(os.path.abspath(folder))
    expected = fingerprint(*inputs)
    with locked(folder):
        meta = finished_meta(folder, expected)
        if meta is not None:
            print(f"{folder}: already prepared from the same inputs, nothing to do")
            if before_publish:
                before_publish()
            return meta
        with staging(folder) as stage:
            meta = build(stage)
            meta["fingerprint"] = expected
            if before_publish:
                before_publish()
            publish(stage, folder, meta)
        remove_unlisted(folder, pattern, meta["files"])
    return meta

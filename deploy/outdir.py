"""Writing an output directory safely: one writer per destination, no leftovers, the umask.

Commands that create a checkpoint directory (`make-checkpoint`, `convert`) write into a hidden
temporary folder `.NAME.tmp-*` beside the destination and rename it into place at the end. This
module holds what they share:

* `destination_lock(dst)`: an exclusive `flock` on `.NAME.lock` beside the destination, taken
  without waiting, so two runs writing one destination cannot both proceed (the second gets
  `DestinationBusy`). The lock file is removed on release; a run that opened the file just
  before it was removed notices (the path no longer names its inode) and opens it again, so
  removing it never lets two holders in.
* `clean_stale_temps(dst)`: called under the lock, removes the `.NAME.tmp-*` / `.NAME.old-*`
  folders a killed run left (no other run can be using them while the lock is held).
* `temp_dir_beside(dst)`: the temporary folder, made by `mkdir` so it follows the umask
  (`tempfile.mkdtemp` makes 0700, which a serving user other than the writer cannot read).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
from pathlib import Path


class DestinationBusy(RuntimeError):
    """Another process holds the lock on this destination."""


def temp_dir_beside(dst: str | os.PathLike, kind: str = "tmp") -> Path:
    """A new empty hidden folder `.NAME.<kind>-XXXXXXXX` beside `dst`, created with `mkdir`'s
    mode (0777 less the umask; `tempfile.mkdtemp` would make it 0700)."""
    dst = Path(dst)
    while True:
        p = dst.parent / f".{dst.name}.{kind}-{secrets.token_hex(4)}"
        try:
            os.mkdir(p)
            return p
        except FileExistsError:
            continue


def unwritable_reason(path: str | os.PathLike) -> str | None:
    """Why `path` could not be created (its nearest existing ancestor is not a writable
    directory), or None; checked before slow work so it fails at once."""
    parent = Path(path).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"no write permission on {parent}"
    return None


def lock_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.lock"


@contextlib.contextmanager
def destination_lock(dst: str | os.PathLike):
    """Hold an exclusive lock on `dst` (a lock file beside it) for the `with` block."""
    path = lock_path(Path(dst))
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DestinationBusy(f"{dst}: another dsv41 process is writing it (lock {path.name} is held); "
                                  "wait for it to finish or choose another destination") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed the file after we opened it: open the new one
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def stale_temps(dst: str | os.PathLike) -> list[Path]:
    """Hidden `.NAME.tmp-*` / `.NAME.old-*` folders of earlier runs writing `dst`."""
    dst = Path(dst)
    if not dst.parent.is_dir():
        return []
    return sorted(p for pattern in (f".{dst.name}.tmp-*", f".{dst.name}.old-*")
                  for p in dst.parent.glob(pattern) if p.is_dir())


def clean_stale_temps(dst: str | os.PathLike) -> list[Path]:
    """Remove what `stale_temps` finds (call it holding `destination_lock(dst)`); returns them."""
    found = stale_temps(dst)
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found

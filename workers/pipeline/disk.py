"""A full artifacts disk, said plainly.

When the disk fills while the trainer writes a checkpoint, the error it raises rarely says
so (torch's serializer reports "unexpected pos ..."). Training that stopped with less than
:data:`FULL_BELOW` bytes free on the run's artifacts disk, or with ENOSPC anywhere in its
causes, ends as :class:`DiskFull`, naming the disk, what is free, and the checkpoint it was
writing; that checkpoint's half-written folder is removed, so the space is free again and no
later attempt mistakes it for a checkpoint (none is recorded before its folder is complete).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

FULL_BELOW = 1 << 20  # bytes free


class DiskFull(OSError):
    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)


def _enospc(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def raise_if_disk_full(root: Path, staging: Path, exc: BaseException) -> None:
    """Raise :class:`DiskFull` (from ``exc``) if the disk of ``root`` is why training
    stopped; ``staging`` holds the checkpoints being written, which are removed then."""
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return
    if not (_enospc(exc) or usage.free < FULL_BELOW):
        return
    writing = sorted(staging.glob("checkpoint-*"), key=lambda p: p.stat().st_mtime)
    shutil.rmtree(staging, ignore_errors=True)
    what = f"writing {writing[-1].name}" if writing else "writing to it"
    raise DiskFull(
        f"No space left on device: the artifacts disk is full ({root}: {usage.free} of "
        f"{usage.total} bytes free) while {what}; the half-written checkpoint was removed "
        f"and none was recorded. Free space there (or point TRAINYARD_ARTIFACTS_DIR at a "
        f"larger disk) and start the run again."
    ) from exc

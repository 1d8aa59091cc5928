"""Writing a run directory's files: whole or absent, and one clear line when the disk says no.

Every file gem writes goes through `write_atomic`: the bytes go to `<name>.tmp`, which is renamed over the target
only once complete. A write that fails (disk full, a read-only or vanished directory) removes its temporary file
and raises `WriteError` naming the path and the OS's reason, so that the run can end with `status: failed` and no
half-written file.
"""

from __future__ import annotations

import os
from pathlib import Path


class WriteError(OSError):
    """One line: a file of the run directory could not be written."""


def write_atomic(path, data: bytes | memoryview | str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w" if isinstance(data, str) else "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise WriteError(f"cannot write {path}: {e.strerror or e}") from None

"""Imported at start-up by every Python process that has this folder on PYTHONPATH (tests/test_distributed.py
puts it there for a two-rank run). In a submitit task, it records each write its process makes under
$WRITE_AUDIT_ROOT, through Python's audit events (PEP 578), one line per write, into
$WRITE_AUDIT_LOG/rank<rank>.<job id>.<pid>.txt: so a test can say which rank of which job wrote what."""

import os
import sys

_root = os.environ.get("WRITE_AUDIT_ROOT")
_rank = os.environ.get("SUBMITIT_LOCAL_GLOBALID")
if _root and _rank is not None:
    _job = os.environ.get("SUBMITIT_LOCAL_JOB_ID", "nojob")
    _log = open(os.path.join(os.environ["WRITE_AUDIT_LOG"], f"rank{_rank}.{_job}.{os.getpid()}.txt"), "a", buffering=1)
    _write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def _record(event, args):
        if event == "open":  # io.open and os.open: (path, mode, flags)
            path, writes = args[0], bool(args[2] & _write_flags) if isinstance(args[2], int) else False
        elif event == "os.rename":  # os.rename and os.replace: (src, dst, ...)
            path, writes = args[1], True
        elif event in ("os.remove", "os.mkdir", "os.rmdir", "os.truncate", "os.chmod"):
            path, writes = args[0], True
        else:
            return
        if writes and isinstance(path, (str, bytes, os.PathLike)):
            text = os.fsdecode(os.fspath(path))
            if os.path.abspath(text).startswith(_root):
                _log.write(f"{event}\t{os.path.abspath(text)}\n")

    sys.addaudithook(_record)

"""A fault injected into one rank of a job: imported at start-up by every Python process that has this folder on
PYTHONPATH (the fault tests of tests/test_faults.py put it there). In the submitit task whose global rank is
$FAULT_RANK, the function $FAULT_TARGET ("module:function") raises on its $FAULT_CALL-th call ($FAULT_KIND=raise),
never returns (hang), or kills its process with SIGKILL (kill). The module is patched as it is first imported, so
the stage's own call reaches the fault."""

import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time

_target = os.environ.get("FAULT_TARGET")
_rank = os.environ.get("SUBMITIT_LOCAL_GLOBALID", os.environ.get("SLURM_PROCID"))
if _target and _rank is not None and _rank == os.environ.get("FAULT_RANK"):
    _module, _function = _target.split(":")
    _at = int(os.environ.get("FAULT_CALL", "1"))
    _kind = os.environ.get("FAULT_KIND", "raise")

    def _patch(module):
        original = getattr(module, _function)
        calls = [0]

        def faulty(*args, **kwargs):
            calls[0] += 1
            if calls[0] == _at:
                if _kind == "hang":
                    while True:
                        time.sleep(3600)
                if _kind == "kill":  # as kill -9 or the OOM killer: no exception, no failure record
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected fault: {_target} call {_at} on rank {_rank}")
            return original(*args, **kwargs)

        setattr(module, _function, faulty)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _module:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())

"""Starts `sglang.launch_server` on a CPU that has no sgl-kernel CPU build (docs/engines.md#sglang-on-a-cpu).

    python launch.py SGLANG_ARGS...        # with SGLang's python (serve.python); never the project's

Runs in SGLang's environment only and imports nothing of the project. Where `import sgl_kernel` works (a GPU
machine, or SGLang's own CPU kernel build), it runs `sglang.launch_server` unchanged. Otherwise, and only for the
SGLang version it was read against (CHECKED), it changes two things in SGLang's start-up, and nothing else:

1. this folder goes first on the path (and on PYTHONPATH, for SGLang's spawned scheduler processes), so
   `import sgl_kernel` finds the project's PyTorch stand-in (`sgl_kernel/__init__.py`: the attention and EAGLE
   bookkeeping ops SGLang's CPU engine calls); where no torchvision loads (PyPI's wheels are built against CUDA
   torch), `import torchvision` finds a stand-in (no_torchvision/) that SGLang's multimodal modules import and
   transformers does not see (it asked first), in this process and the ones SGLang spawns (they run this file's
   top level first: `spawn` re-runs the main module);
2. `_attention_backend_platform_fallbacks` (sglang/srt/arg_groups/overrides.py) stops swapping the CPU attention
   backend `intel_amx` for `torch_native` on a processor without AMX: EAGLE refuses `torch_native`
   (sglang/srt/speculative/draft_utils.py), and with the stand-in the `intel_amx` backend runs on any processor.
   SGLang's AMX matmuls stay off: `cpu_has_amx_support()` also asks for `torch.ops.sgl_kernel.
   convert_weight_packed`, which the stand-in does not define, so every linear layer takes SGLang's PyTorch path.

Anything else SGLang's CPU path asks of sgl_kernel fails by name (the stand-in's `__getattr__`).
"""

from __future__ import annotations

import os
import runpy
import sys
from importlib.metadata import version

CHECKED = "0.5.23"
HERE = os.path.dirname(os.path.abspath(__file__))
STAND_IN = "ORCHESTRATOR_SGL_KERNEL_STAND_IN"
NO_TORCHVISION = os.path.join(HERE, "no_torchvision")
if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == HERE:
    del sys.path[0]  # python put this folder first; the stand-in goes there only where no sgl_kernel loads


def _loads(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # a CUDA-only build fails with OSError (libcuda.so.1) or ImportError
        sys.modules.pop(module, None)
        return False
    return True


def _stand_in_torchvision() -> None:
    """transformers decides once whether torchvision is there: asked before the stand-in is importable, it says no
    and never imports it for its own image code."""
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    import_utils.is_torchvision_v2_available()
    sys.path.insert(0, NO_TORCHVISION)
    try:
        import torchvision.transforms.functional  # noqa: F401
    finally:
        sys.path.remove(NO_TORCHVISION)


if os.environ.get(STAND_IN) == "torchvision" and "torchvision" not in sys.modules:
    _stand_in_torchvision()  # a process SGLang spawned


def _keep_intel_amx_backend() -> None:
    from sglang.srt.arg_groups import attention_hook, overrides

    original = overrides._attention_backend_platform_fallbacks
    if getattr(attention_hook, "_attention_backend_platform_fallbacks", None) is not original:
        sys.exit(
            f"sglang {version('sglang')}: attention_hook no longer calls overrides._attention_backend_platform_"
            f"fallbacks; the CPU launcher was read against sglang {CHECKED} (orchestrator/engines/sglang/"
            "cpu_kernels/launch.py)"
        )

    def fallbacks(view):
        if view.attention_backend == "intel_amx" and view.device == "cpu":
            return {}
        return original(view)

    attention_hook._attention_backend_platform_fallbacks = fallbacks


def use_stand_in() -> None:
    """Puts the stand-ins on the path of this process and of every process it starts."""
    installed = version("sglang")
    if installed != CHECKED:
        sys.exit(
            f"sglang {installed} has no sgl_kernel for this machine, and the project's CPU stand-in was written "
            f"against sglang {CHECKED}'s call sites only; install sglang=={CHECKED} (scripts/make_sglang_env.sh)"
        )
    sys.path.insert(0, HERE)
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *[p for p in [os.environ.get("PYTHONPATH")] if p]])
    os.environ[STAND_IN] = "sgl_kernel"
    if not _loads("torchvision"):
        os.environ[STAND_IN] = "torchvision"
        _stand_in_torchvision()
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sgl_kernel

    if not getattr(sgl_kernel, "STAND_IN", False):
        sys.exit(f"{sgl_kernel.__file__} was imported in place of the project's stand-in in {HERE}")
    _keep_intel_amx_backend()


def main() -> None:
    if not _loads("sgl_kernel"):
        use_stand_in()
    sys.argv = ["sglang.launch_server", *sys.argv[1:]]
    # alter_sys=False: __main__ stays this file, so the processes SGLang spawns run its top level first
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()

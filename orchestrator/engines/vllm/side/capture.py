"""Capture a target's hidden states with vLLM's own extractor (`extract_hidden_states`).

Runs inside vLLM's environment, standalone (it imports vLLM, torch and safetensors, nothing of this project):

    python orchestrator/engines/vllm/side/capture.py REQUEST.json ENGINE_ARGS...
    python orchestrator/engines/vllm/side/capture.py --parse-only ENGINE_ARGS...
    python orchestrator/engines/vllm/side/capture.py --serve QUEUE ENGINE_ARGS...

ENGINE_ARGS are the engine's flags as `vllm serve` takes them (`orchestrator.engines.vllm.cli.capture_engine_args`:
the target, `--speculative-config {"method": "extract_hidden_states", ...}` with the layer ids, and
`--kv-transfer-config` naming the hidden-states connector, `hidden_states_connector.CPUHiddenStatesConnector`,
vLLM's own on GPUs). They are read by vLLM's own parser (EngineArgs' command line), so what a dry run prints and
checks is what the engine runs with; `--parse-only` stops there.

REQUEST.json: {"prompts": [[token ids], ...], "out": dir, "include_output_tokens": false, "max_tokens": 1,
"write_timeout_s": 600}.
Request i's states land in `out/<i>.safetensors`: `hidden_states` [tokens, len(ids), hidden] in the order of the
ids, and `token_ids`. With `include_output_tokens` the tokens are the prompt and the generated response but its
last token (vLLM's one-pass mode: generate, then the states of prompt plus response). Prints one JSON line:
vLLM's version, the files, and each request's generated token ids.

--serve: the engine stays up and takes requests from the folder QUEUE, as the extract stage sends its shards
(orchestrator/engines/vllm/capture.py, `CaptureEngine`) and the project's capture service streams states to a
trainer (orchestrator/states/stream.py): `QUEUE/ready` appears once the engine is up; each
`QUEUE/req-NNNNNNNN.json` (a REQUEST as above, written atomically) is answered, in order, by
`QUEUE/req-NNNNNNNN.done` (the report, or {"error": ...}), and removed. It stops when `QUEUE/stop` appears, and
exits within a second of the process that started it, even mid-request, so that a killed task leaves no engine
holding its devices.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WRITE_TIMEOUT_S = 600.0  # extract.write_timeout_s


def engine_kwargs(argv: list[str]) -> dict:
    """The engine arguments `argv` sets, parsed by vLLM's own parser: those that differ from its defaults."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="capture.py"))
    parsed = EngineArgs.from_cli_args(parser.parse_args(argv))
    defaults = EngineArgs.from_cli_args(parser.parse_args(["--model", parsed.model]))
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    changed = {n: getattr(parsed, n) for n in names if getattr(parsed, n) != getattr(defaults, n)}
    return {"model": parsed.model} | changed


def main(request: dict, argv: list[str]) -> dict:
    return capture(open_engine(argv), request)


def open_engine(argv: list[str]):
    """vLLM's offline engine with `argv`'s engine arguments."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # the connector module, for vLLM to import by name in whichever process runs the engine
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, str(HERE))
    from vllm import LLM

    _llvmlite_lib_without_dunders()
    return LLM(**engine_kwargs(argv))


def serve(queue: Path, argv: list[str]) -> None:
    """Answers the requests of `queue` in order until `queue/stop` appears or the parent process is gone."""
    import threading
    import time

    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    llm = open_engine(argv)
    (queue / "ready").touch()
    print("[vllm capture] engine up: serving requests from", queue, flush=True)
    while not (queue / "stop").exists() and os.getppid() == parent:
        requests = sorted(queue.glob("req-*.json"))
        if not requests:
            time.sleep(0.01)
            continue
        try:
            report = capture(llm, json.loads(requests[0].read_text()))
        except Exception as err:  # the service reads it and fails naming this log
            report = {"error": f"{type(err).__name__}: {err}"}
        done = requests[0].with_suffix(".done")
        done.with_suffix(".tmp").write_text(json.dumps(report))
        os.replace(done.with_suffix(".tmp"), done)
        requests[0].unlink()


def _exit_with_parent(parent: int) -> None:
    import time

    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def capture(llm, request: dict) -> dict:
    """One REQUEST through the engine: its states moved to `out/<i>.safetensors`; the report."""
    import vllm
    from vllm import SamplingParams

    out = Path(request["out"])
    out.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(
        max_tokens=request.get("max_tokens", 1),
        temperature=0.0,
        extra_args={"kv_transfer_params": {"include_output_tokens": bool(request.get("include_output_tokens"))}},
    )
    prompts = [{"prompt_token_ids": list(p)} for p in request["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    paths = [(result.kv_transfer_params or {}).get("hidden_states_path") for result in outputs]
    for i, path in enumerate(paths):
        if not path:
            raise RuntimeError(f"request {i}: vLLM returned no hidden_states_path ({outputs[i].kv_transfer_params})")
    _wait_written(llm, paths, float(request.get("write_timeout_s", WRITE_TIMEOUT_S)))
    files, generated = [], []
    for i, (result, path) in enumerate(zip(outputs, paths)):
        target = out / f"{i}.safetensors"
        shutil.move(path, target)
        if os.path.exists(path + ".lock"):
            os.remove(path + ".lock")
        files.append(str(target))
        generated.append(list(result.outputs[0].token_ids))
    return {"vllm_version": vllm.__version__, "files": files, "generated": generated}


def _llvmlite_lib_without_dunders() -> None:
    """On a CPU without Triton, vLLM 0.32 points its kernels at C++ fallbacks by scanning every loaded module's
    attributes with `vars()` (`register_kernels`, vllm/triton_utils/dispatcher.py). llvmlite's `ffi.lib` answers
    any attribute name with a C-function wrapper, `__dict__` included, and the scan fails ("'_lib_fn_wrapper' object
    has no attribute 'get'") once numba is loaded, which vLLM's Kimi-K2.5 image processor imports
    (vllm/transformers_utils/processors/kimi_k25_vision_fused.py). Dunder names are not C functions: refuse them."""
    import importlib.util

    if importlib.util.find_spec("llvmlite") is None:
        return
    from llvmlite.binding import ffi

    lookup = ffi._lib_wrapper.__getattr__

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    ffi._lib_wrapper.__getattr__ = __getattr__


def _wait_written(llm, paths: list[str], timeout_s: float) -> None:
    """Returns once every file of `paths` is whole. vLLM's connector starts a finished request's write at the
    engine's next step and, on a GPU, reports the request done once its states are copied to the host: the file is
    written afterwards by a thread pool, which holds the file's `.lock` exclusively until then (vLLM's own reader,
    `load_hidden_states`, blocks on that lock; so does hs-connectors' `wait_for_lock`). So the idle engine is
    stepped (to start the writes) until each file is there and its lock is free. The clock restarts as each file
    is done: a file not whole `timeout_s` after the one before it (extract.write_timeout_s) fails the request,
    naming it."""
    import time

    waiting, since = list(paths), time.monotonic()
    while waiting:
        done = [p for p in waiting if _written(p)]
        if done:
            waiting, since = [p for p in waiting if p not in done], time.monotonic()
            continue
        if time.monotonic() - since > timeout_s:
            path = waiting[0]
            state = "its lock still held" if os.path.exists(path + ".lock") else "no file and no lock"
            raise RuntimeError(
                f"vLLM's connector had not finished writing {path} ({state}) {timeout_s:g} s after "
                f"{'the request was done' if len(waiting) == len(paths) else 'the file before it'} "
                f"(extract.write_timeout_s); {len(waiting)} of {len(paths)} files unwritten"
            )
        llm.llm_engine.step()  # an idle engine returns at once; a finished request's write starts at a step
        time.sleep(0.005)


def _written(path: str) -> bool:
    """Whether the connector's file at `path` is whole: it exists and its companion lock, which the connector holds
    exclusively from before the path is returned until the file is written, is free (or was never taken)."""
    import fcntl

    if not os.path.exists(path):
        return False
    try:
        lock = open(path + ".lock")
    except FileNotFoundError:  # a connector without the lock (use_synchronization_lock off) writes synchronously
        return True
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(lock, fcntl.LOCK_UN)
    return True


if __name__ == "__main__":
    if sys.argv[1] == "--parse-only":
        engine_kwargs(sys.argv[2:])  # vLLM's parser exits with its message on a bad argument
    elif sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]), sys.argv[3:])
    else:
        print(json.dumps(main(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2:])), flush=True)

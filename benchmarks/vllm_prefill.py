"""vLLM's own prefill rate, for benchmarks/bench_stream.py: runs in vLLM's environment.

    python benchmarks/vllm_prefill.py REQUEST.json ENGINE_ARGS...

ENGINE_ARGS are a capture engine's (orchestrator.engines.vllm.cli.capture_engine_args). REQUEST.json:
{"prompts": [[token ids], ...], "batch": n, "capture": false}. Without `capture`, the extractor's
`--speculative-config` and `--kv-transfer-config` are dropped, so the engine is vLLM's plain one on the same
target, dtype and CPU flags; with it, the engine is the capture service's, and each call also waits until every
state file is whole (side/capture.py `_wait_written`) and deletes the files: the capture alone, without the
service's hand-over. Generates one token for each prompt, `batch` prompts a call as the capture service sends
them, once to warm up and once timed; prints one JSON line: the prompt tokens, the seconds and tokens/s of the
timed pass.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

# side/capture.py (standalone in vLLM's environment): vLLM's engine from a `vllm serve` command line, its capture wait
SIDE = Path(__file__).resolve().parents[1] / "orchestrator" / "engines" / "vllm" / "side" / "capture.py"
_spec = importlib.util.spec_from_file_location("side_capture", SIDE)
side = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(side)

EXTRACTOR = ("--speculative-config", "--kv-transfer-config")


def plain(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in EXTRACTOR:
            skip = True
        else:
            out.append(arg)
    return out


def main() -> None:
    from vllm import SamplingParams

    request = json.loads(Path(sys.argv[1]).read_text())
    captures = bool(request.get("capture"))
    llm = side.open_engine(sys.argv[2:] if captures else plain(sys.argv[2:]))
    prompts, batch = request["prompts"], request["batch"]
    extra = {"kv_transfer_params": {"include_output_tokens": False}} if captures else None
    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
    seconds = 0.0
    for _ in range(2):  # the first pass warms the engine up; the second is timed
        began = time.perf_counter()
        for first in range(0, len(prompts), batch):
            chunk = [{"prompt_token_ids": p} for p in prompts[first : first + batch]]
            outputs = llm.generate(chunk, params, use_tqdm=False)
            if captures:
                paths = [o.kv_transfer_params["hidden_states_path"] for o in outputs]
                side._wait_written(llm, paths, 600.0)
                for path in paths:
                    Path(path).unlink()
                    Path(path + ".lock").unlink(missing_ok=True)
        seconds = time.perf_counter() - began
    tokens = sum(len(p) for p in prompts)
    print(json.dumps({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}), flush=True)


if __name__ == "__main__":
    main()

"""Capture a target's hidden states with vLLM's own extractor (`extract_hidden_states`).

Runs inside vLLM's environment, standalone (it imports vLLM, torch and safetensors, nothing of this project):

    python orchestrator/serving/vllm_side/capture.py REQUEST.json

REQUEST.json: {"target": dir, "ids": [vLLM layer ids], "prompts": [[token ids], ...], "out": dir,
"dtype": "float32", "max_model_len": int, "include_output_tokens": false, "max_tokens": 1,
"tensor_parallel_size": 1}. vLLM runs the target
with `speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}` and the hidden-states connector
(`hidden_states_connector.CPUHiddenStatesConnector`, vLLM's own on GPUs). Request i's states land in
`out/<i>.safetensors`: `hidden_states` [tokens, len(ids), hidden] in the order of `ids`, and `token_ids`. With
`include_output_tokens` the tokens are the prompt and the generated response but its last token (vLLM's one-pass
mode: generate, then the states of prompt plus response). Prints one JSON line: vLLM's version, the files, and
each request's generated token ids.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(request: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # the connector module, for vLLM to import by name in whichever process runs the engine
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, str(HERE))
    import vllm
    from vllm import LLM, SamplingParams

    out = Path(request["out"])
    raw = out / "raw"
    llm = LLM(
        model=request["target"],
        dtype=request.get("dtype", "float32"),
        max_model_len=request.get("max_model_len", 512),
        enforce_eager=True,
        seed=0,
        tensor_parallel_size=request.get("tensor_parallel_size", 1),
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(request["ids"])}},
        },
        kv_transfer_config={
            "kv_connector": "CPUHiddenStatesConnector",
            "kv_connector_module_path": "hidden_states_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(raw)},
        },
    )
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
    # A finished request's states are written by the connector at the engine's next step (its blocks are held
    # until then): step the idle engine until every file is there.
    for _ in range(100):
        if all(os.path.exists(p) and not _locked(p) for p in paths):
            break
        llm.llm_engine.step()
    files, generated = [], []
    for i, (result, path) in enumerate(zip(outputs, paths)):
        if not os.path.exists(path):
            raise RuntimeError(f"request {i}: vLLM's connector wrote no {path}")
        target = out / f"{i}.safetensors"
        shutil.move(path, target)
        if os.path.exists(path + ".lock"):
            os.remove(path + ".lock")
        files.append(str(target))
        generated.append(list(result.outputs[0].token_ids))
    return {"vllm_version": vllm.__version__, "files": files, "generated": generated}


def _locked(path: str) -> bool:
    """The connector holds the companion lock file exclusively until the write is done."""
    import fcntl

    if not os.path.exists(path + ".lock"):
        return False
    with open(path + ".lock") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
    return False


if __name__ == "__main__":
    print(json.dumps(main(json.loads(Path(sys.argv[1]).read_text()))), flush=True)

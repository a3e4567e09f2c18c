"""Load an exported EAGLE-3 draft with vLLM's own model loader and report what it did not load.

Runs inside vLLM's environment (`serve.python`), standalone: it imports vLLM and torch, nothing of this project.

    python orchestrator/serving/vllm_side/load_check.py TARGET DRAFT NUM_SPECULATIVE_TOKENS

TARGET needs only its config.json and tokenizer (vLLM builds the draft against the target's config; no target
weight is read). The draft is built as vLLM's engine builds it (`EngineArgs(...).create_engine_config()`, then
the model loader's `create_model`), every parameter is filled with a sentinel, and the draft's tensors are fed
to the model's own `load_weights`, one at a time, through the loader's own weight iterator:

- a checkpoint tensor after whose load no parameter changed is **unused**: vLLM read it and dropped it;
- a parameter that still holds the sentinel after every tensor was loaded is **missing**: vLLM serves it with
  whatever memory held.

Then the whole checkpoint is loaded again through `DefaultModelLoader.load_weights`, the path the server takes,
which must raise nothing. Prints one JSON line: vLLM's version, the architecture and model class, `loaded` and
`missing` (parameter names as vLLM names them), `unused` (checkpoint names), `refused` (checkpoint names whose
load raised, with the error) and `load_error` (the whole load's error, or null).
"""

from __future__ import annotations

import json
import os
import socket
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(target: str, draft: str, num_steps: int) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    args = EngineArgs(
        model=target,
        speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": num_steps},
        enforce_eager=True,
        dtype="float32",
        max_model_len=256,
        seed=0,
        language_model_only=True,  # a multimodal wrapper (Kimi-K2.5) as a text model: no image processor needed
    )
    vllm_config = args.create_engine_config()
    draft_config = vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        )  # fmt: skip
        initialize_model_parallel(1, 1)
        loader = get_model_loader(vllm_config.load_config)
        with set_default_torch_dtype(draft_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=vllm_config, model_config=draft_config)
        params = dict(model.named_parameters())

        def fill() -> None:
            with torch.no_grad():
                for p in params.values():
                    p.fill_(float("nan") if p.is_floating_point() else -7)

        def unset(p: torch.Tensor) -> torch.Tensor:
            return p.isnan() if p.is_floating_point() else p == -7

        fill()
        loaded, unused, refused = set(), [], {}
        for name, tensor in loader.get_all_weights(draft_config, model):
            before = {k: unset(p).clone() for k, p in params.items()}
            try:
                model.load_weights([(name, tensor)])
            except Exception as exc:  # noqa: BLE001 - reported, with the name vLLM refused
                refused[name] = f"{type(exc).__name__}: {exc}"
                continue
            changed = [k for k, p in params.items() if not torch.equal(unset(p), before[k])]
            if changed:
                loaded.update(changed)
            else:
                unused.append(name)
        fill()
        try:
            loader.load_weights(model, draft_config)
            load_error = None
        except Exception as exc:  # noqa: BLE001 - the server would fail the same way
            load_error = f"{type(exc).__name__}: {exc}"
        missing = sorted(k for k, p in params.items() if bool(unset(p).any()))
    return {
        "vllm_version": vllm.__version__,
        "architecture": (draft_config.hf_config.architectures or [None])[0],
        "model_class": type(model).__name__,
        "loaded": sorted(loaded),
        "unused": sorted(unused),
        "missing": missing,
        "refused": refused,
        "load_error": load_error,
    }


if __name__ == "__main__":
    target_dir, draft_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps(main(target_dir, draft_dir, steps)), flush=True)

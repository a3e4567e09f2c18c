"""Load an exported EAGLE-3 draft with vLLM's own model loader and report what it did not load.

Runs inside vLLM's environment (`serve.python`), standalone: it imports vLLM and torch, nothing of this project.

    python orchestrator/engines/vllm/side/load_check.py TARGET DRAFT NUM_SPECULATIVE_TOKENS

TARGET needs only its config.json and tokenizer (vLLM builds the draft against the target's config; no target
weight is read). The draft is built as vLLM's engine builds it (`EngineArgs(...).create_engine_config()`, then
the model loader's `create_model`), every parameter is filled with a sentinel, and the draft's tensors are fed
to the model's own `load_weights`, one at a time, through the loader's own weight iterator:

- a checkpoint tensor after whose load no parameter changed is **unused**: vLLM read it and dropped it;
- a parameter that still holds the sentinel after every tensor was loaded is **missing**: vLLM serves it with
  whatever memory held.

Then the whole checkpoint is loaded again through `DefaultModelLoader.load_weights`, the path the server takes,
which must raise nothing.

The layer ids each of vLLM's model runners will capture for the draft are read by the runners' own functions
from the speculative config the engine built: V1's `GPUModelRunner._get_eagle3_aux_layers_from_config` and Model
Runner V2's `get_eagle3_aux_layers_from_config`, and where a runner finds none, the target's defaults by
`SupportsEagle3.get_eagle3_default_aux_hidden_state_layers` (what both runners then capture). Which runner this
machine's engine picks is `VllmConfig.use_v2_model_runner`; which one a GPU with Triton picks for the same config
is MRV2 unless `_get_v2_model_runner_unsupported_features` names something.

Prints one JSON line: vLLM's version, the architecture and model class, `loaded` and `missing` (parameter names
as vLLM names them; not those the runners give the target's instead, `shared`: a draft without its own embedding
or lm_head), `unused` (checkpoint names), `refused` (checkpoint names whose load raised, with the error),
`load_error` (the whole load's error, or null), and `runners` (per runner: the ids it reads from the config, or
null, and the ids it captures), `runner_here` and `mrv2_unsupported`.
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
    runners = runner_ids(vllm_config)
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
        shared = target_shares(model, missing, vllm_config.model_config.hf_text_config.hidden_size, params)
        missing = [k for k in missing if k not in shared]
    return {
        "vllm_version": vllm.__version__,
        "architecture": (draft_config.hf_config.architectures or [None])[0],
        "model_class": type(model).__name__,
        "loaded": sorted(loaded),
        "unused": sorted(unused),
        "missing": missing,
        "shared": shared,
        "refused": refused,
        "load_error": load_error,
        **runners,
    }


def target_shares(model, missing: list, target_hidden: int, params: dict) -> dict:
    """The draft parameters left unloaded that vLLM's runners give the target's instead, by their own rules: an
    EAGLE model whose checkpoint held no `embed_tokens` (`has_own_embed_tokens` false, set by
    `process_eagle_weight` as it loads) takes the target's embedding, V1's proposer only where the widths match
    (`_maybe_share_embeddings`, vllm/v1/spec_decode/llm_base_proposer.py), Model Runner V2's whatever they are
    (`maybe_share_target_embed`, vllm/v1/worker/gpu/spec_decode/eagle/utils.py); one with no `lm_head` takes the
    target's (`_maybe_share_lm_head`, and V2's `_should_share`). {parameter: what is shared and by which runners}."""
    shared = {}
    if not getattr(model, "has_own_embed_tokens", True):  # V1 shares it only at the target's width: else missing
        for name in (k for k in missing if k.endswith("embed_tokens.weight")):
            if params[name].shape[-1] == target_hidden:
                shared[name] = "the target's embedding (v1 and mrv2)"
    if not getattr(model, "has_own_lm_head", True):
        for name in (k for k in missing if k.split(".")[0] == "lm_head"):
            shared[name] = "the target's lm_head (v1 and mrv2)"
    return shared


def runner_ids(vllm_config) -> dict:
    """The layer ids each of vLLM's runners captures for this engine config's draft, by the runners' own code."""
    from types import SimpleNamespace

    from vllm.model_executor.models.interfaces import SupportsEagle3
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    spec = vllm_config.speculative_config
    layers = vllm_config.model_config.hf_text_config.num_hidden_layers
    # the default reads only the decoder's layer count (`len(holder.layers)`); a stand-in with that many layers
    defaults = SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(
        SimpleNamespace(model=SimpleNamespace(layers=[None] * layers))
    )
    read = {
        "v1": GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec)),
        "mrv2": get_eagle3_aux_layers_from_config(spec),
    }
    try:
        unsupported = list(vllm_config._get_v2_model_runner_unsupported_features())
    except Exception as exc:  # noqa: BLE001 - reported: the GPU's choice is then unknown
        unsupported = [f"unknown ({type(exc).__name__}: {exc})"]
    return {
        "runners": {
            name: {"from_config": list(ids) if ids else None, "ids": list(ids) if ids else list(defaults)}
            for name, ids in read.items()
        },
        "default_ids": list(defaults),
        "target_layers": layers,
        "runner_here": "mrv2" if vllm_config.use_v2_model_runner else "v1",
        "mrv2_unsupported": unsupported,
    }


if __name__ == "__main__":
    target_dir, draft_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps(main(target_dir, draft_dir, steps)), flush=True)

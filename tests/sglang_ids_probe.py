"""Run in SGLang's environment (tests/test_sglang.py): the layer ids SGLang 0.5.23 takes from each draft, by its own
`resolve_spec_aux_hidden_state_config` (what its model runner hands `set_eagle3_layers_to_capture`), printed as one
JSON line {draft: ids, null, or {"error": what SGLang raised reading it}}.

    python tests/sglang_ids_probe.py TARGET_DIR DRAFT_DIR [DRAFT_DIR ...]

Only configs are read (the target's and each draft's config.json); the stand-ins of sglang_rope_probe.py let
SGLang's modules import without a GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main(target: str, drafts: list[str]) -> dict:
    import sglang  # noqa: F401
    import transformers.image_processing_utils  # noqa: F401
    from sglang_rope_probe import install_stand_ins

    install_stand_ins()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    def read_ids(draft: str):
        args = ServerArgs(model_path=target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                          device="cpu", skip_tokenizer_init=True)  # fmt: skip
        args.resolve_once()
        get_context().set_server_args(args)
        config = resolve_spec_aux_hidden_state_config(
            server_args=args, model_config=ModelConfig.from_server_args(args),
            spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"), is_draft_worker=False,
        )  # fmt: skip
        ids = config.eagle_aux_hidden_state_layer_ids
        return list(ids) if ids else None

    out = {}
    for draft in drafts:
        try:
            out[draft] = read_ids(draft)
        except Exception as exc:  # noqa: BLE001 - what SGLang says of a draft it cannot read is the answer
            out[draft] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2:])), flush=True)

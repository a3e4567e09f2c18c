"""Convert the project's SGLang-format EAGLE-3 draft into vllm-project/speculators' format with speculators' own code.

Runs inside speculators' environment (scripts/make_speculators_env.sh), standalone: it imports speculators,
torch, safetensors and the standard library, nothing of this project.

    outputs/speculators-env/bin/python scripts/speculators_export.py DRAFT_DIR TARGET_DIR OUT_DIR [--layer-ids 2,5,7]

DRAFT_DIR is a draft as the project writes it (config.json with `LlamaForCausalLMEagle3` and a nested
`eagle_config`; model.safetensors with `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`,
`t2d`, `embed_tokens.weight`). TARGET_DIR is the verifier; only its config.json is read. The conversion is the
one `speculators convert DRAFT_DIR --algorithm eagle3 --verifier TARGET_DIR --output-path OUT_DIR
[--algorithm-kwargs '{"eagle_aux_hidden_state_layer_ids": [2,5,7]}']` runs: `speculators.convert.convert_model`
with the same arguments. Prints the written config's layer-id key and the saved tensors as one JSON line.

Where each fact comes from, in speculators 0.9.0 (site-packages/speculators):

- cli/convert.py `convert`: the CLI's `--algorithm-kwargs` JSON object goes as keyword arguments to
  `convert_model`; validation runs only with `--validate-device` (`validate=validate_device is not None`).
- convert/entrypoints.py `convert_model`: algorithm "eagle3" calls `Eagle3Converter().convert(model,
  output_path, verifier, validate=..., **kwargs)`.
- convert/eagle/eagle3_converter.py `Eagle3Converter.convert`: reads DRAFT_DIR/config.json and
  model.safetensors (convert/utils.py `load_checkpoint_config`, `load_checkpoint_weights`); the target vocab is
  `t2d`'s length (then d2t/t2d buffers are kept), else the verifier config's `vocab_size`.
- `Eagle3Converter._build_eagle3_speculator_config`: builds `Eagle3SpeculatorConfig` (models/eagle3/config.py)
  with `speculators_config` = algorithm "eagle3", one greedy proposal of 3 speculative tokens, verifier =
  {name_or_path: TARGET_DIR as passed, architectures: the target's}; `draft_vocab_size` and
  `target_hidden_size` from the draft config; `norm_before_fc`, `fc_norm`, `norm_output` from the keyword or the
  draft config (default false), `norm_before_residual` from the keyword only; `eagle_aux_hidden_state_layer_ids`
  from the keyword ONLY: the draft's `eagle_config.eagle_aux_hidden_state_layer_ids` is never read, so without
  `--layer-ids` the key is written as null. The ids are stored as given (vLLM's convention, no shift).
- `Eagle3Converter._create_transformer_config_from_eagle`: `transformer_layer_config` is a `LlamaConfig` from
  the draft config (vocab_size = target vocab, max_position_embeddings = max of draft's and target's,
  tie_word_embeddings false), serialised by `to_diff_dict` (config.py field serializer).
- `Eagle3Converter._save_converted_checkpoint`: the weights are loaded into the legacy `Eagle3Speculator`
  (convert/eagle/eagle3_legacy_model.py) after renaming `midlayer.` to `layers.0.`; every other name (fc.weight,
  norm.weight, lm_head.weight, embed_tokens.weight, d2t, t2d) is kept; `load_state_dict(strict=False)`; then
  `save_pretrained(OUT_DIR)` (transformers), which writes config.json and model.safetensors only.

Options: `--layer-ids 2,5,7` passes `eagle_aux_hidden_state_layer_ids=[2, 5, 7]` exactly as the CLI's
`--algorithm-kwargs` would; `--validate-device cpu` also runs the converter's own check (reloading OUT_DIR with
`Eagle3Speculator.from_pretrained`).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version
from pathlib import Path

from safetensors import safe_open
from speculators.convert import convert_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("draft_dir", type=Path, help="SGLang-format EAGLE-3 draft (config.json, model.safetensors)")
    parser.add_argument("target_dir", type=Path, help="verifier (only its config.json is read)")
    parser.add_argument("out_dir", type=Path, help="where speculators writes the converted draft")
    parser.add_argument("--layer-ids", default=None, help="vLLM layer ids, e.g. 2,5,7 (default: none passed)")
    parser.add_argument("--validate-device", default=None, help="run the converter's reload check (e.g. cpu)")
    args = parser.parse_args(argv)

    algorithm_kwargs: dict = {}
    if args.layer_ids is not None:
        algorithm_kwargs["eagle_aux_hidden_state_layer_ids"] = [int(x) for x in args.layer_ids.split(",") if x]

    convert_model(
        model=str(args.draft_dir),
        verifier=str(args.target_dir),
        algorithm="eagle3",
        output_path=str(args.out_dir),
        validate_device=args.validate_device,
        **algorithm_kwargs,
    )

    config = json.loads((args.out_dir / "config.json").read_text())
    with safe_open(str(args.out_dir / "model.safetensors"), framework="pt") as f:
        slices = {key: f.get_slice(key) for key in f.keys()}  # noqa: SIM118
        tensors = {key: [list(s.get_shape()), s.get_dtype()] for key, s in slices.items()}
    print(json.dumps({
        "speculators": version("speculators"),
        "algorithm_kwargs": algorithm_kwargs,
        "eagle_aux_hidden_state_layer_ids": config.get("eagle_aux_hidden_state_layer_ids"),
        "files": sorted(p.name for p in args.out_dir.iterdir()),
        "tensors": tensors,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

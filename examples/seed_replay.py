"""The seed's story replayed on the tiny target: a draft trained on one layer set, served with another.

    .venv/bin/python examples/seed_replay.py [hydra overrides...]

Served by the demo's engine: vLLM where scripts/make_vllm_env.sh built its environment (each draft given vLLM's
ids), else the reference engine; `serve=reference` picks the latter.

1. matched:   aux_layers=[-1, 1, 4] (embedding + two layers, as Kimi's [-1, 2, 30]) trained, evaluated, served.
2. mismatch:  the same draft served with serve.layers=[1, 4, 6] (the seed's serving side: the embedding dropped,
              a later layer appended) and the guard off: standalone accuracy and served speed collapse.
3. guarded:   the same request with the guard on: refused before any job, with the fix.
Writes outputs/seed_replay.json and prints the table the README quotes.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from orchestrator import conf_dir
from orchestrator.artifacts import write_json
from orchestrator.config import load
from orchestrator.pipeline import run_pipeline
from orchestrator.preflight import PreflightError

TRAINED = "[-1,1,4]"
SERVED = "[1,4,6]"


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return load(
            compose(
                "config",
                overrides=["+experiment=tiny_eagle3", f"aux_layers={TRAINED}", "run_name=seed_replay", *overrides],
            )
        )


def row(summary: dict) -> dict:
    ev, sv = summary["stages"]["eval"], summary["stages"]["serve"]
    return {
        "train_val_acc_0": summary["stages"]["train"].get("val_acc_0"),
        "eval_acc_0": ev.get("acc_0"),
        "eval_acc_0_trained_states": ev.get("trained_states_acc_0"),
        "eval_expected_accept_length": ev.get("expected_accept_length"),
        "served_accept_length": sv.get("accept_length"),
        "engine": f"{sv.get('engine')} {sv.get('engine_version')}",
        "engine_fallback": sv.get("engine_fallback"),
        "served_ids": sv.get("eagle_aux_hidden_state_layer_ids"),
        "baseline_tok_s": sv.get("baseline_tok_s"),
        "spec_tok_s": sv.get("spec_tok_s"),
        "speedup": sv.get("speedup"),
        "mismatch_flags": summary["mismatch_flags"],
    }


def main(extra: list[str]) -> None:
    base = Path(tempfile.mkdtemp(prefix="seed_replay_"))
    results = {"matched": row(run_pipeline(config(*extra), base / "matched"))}
    results["mismatch_guard_off"] = row(
        run_pipeline(config(f"serve.layers={SERVED}", "serve.guard=false", *extra), base / "mismatch")
    )
    try:
        run_pipeline(config(f"serve.layers={SERVED}", *extra), base / "guarded")
        results["guard_on"] = "NOT REFUSED"
    except PreflightError as exc:
        results["guard_on"] = str(exc)
    cfg = config(*extra)
    write_json(cfg.outputs / "seed_replay.json", results)
    print(f"\ntrained on aux_layers={TRAINED}; mismatch serves {SERVED}")
    for name in ("matched", "mismatch_guard_off"):
        r = results[name]
        print(f"{name}: served by {r['engine']} with draft config ids {r['served_ids']} {r['engine_fallback'] or ''}")
    print(f"{'':28}{'matched':>12}{'mismatch':>12}")
    for key in (
        "train_val_acc_0",
        "eval_acc_0_trained_states",
        "eval_acc_0",
        "eval_expected_accept_length",
        "served_accept_length",
        "baseline_tok_s",
        "spec_tok_s",
        "speedup",
    ):
        a, b = results["matched"][key], results["mismatch_guard_off"][key]
        print(f"{key:28}{a:12.3f}{b:12.3f}")
    print("\nguard on:", results["guard_on"])
    print(json.dumps(results["mismatch_guard_off"]["mismatch_flags"], indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])

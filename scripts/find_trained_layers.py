"""`check_draft=`'s search for the layers a draft was trained on, on a draft whose layers are known: the demo's
(the README's first command trains it; cached in outputs/ after, trained here otherwise), relabeled as another
tool ships a draft (no provenance, its ids in vLLM's convention under both keys). Prints, as Markdown, what each
engine would feed it, and loss_0 and acc_0 under each candidate reading with their standard errors and loss_0's
distance above the lowest (paired over the same sequences), then the verdict: docs/layers.md's table.

    .venv/bin/python scripts/find_trained_layers.py [hydra overrides ...]    # default: +experiment=tiny_eagle3
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from orchestrator import conf_dir
from orchestrator.config import load
from orchestrator.draft import formats, readings
from orchestrator.pipeline import make_plan, run_pipeline
from orchestrator.preflight import trained_layers_search


def main(overrides: list[str]) -> None:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        raw = compose("config", overrides=["+experiment=tiny_eagle3", *overrides, "cluster=local",
                                           "stages=[extract,train]"])  # fmt: skip
    cfg = load(raw)
    run_dir = Path(tempfile.mkdtemp(prefix="find_trained_layers-"))
    run_pipeline(cfg, run_dir)  # the demo's extraction and draft: cached once the demo has run
    plan = make_plan(cfg, run_dir)
    t, s = cfg.target, cfg.serve
    relabeled = run_dir / "relabeled"
    ids = formats.relabel(plan.dir("train") / "draft", relabeled, "vllm", t.family, t.num_hidden_layers, s.vllm_version)
    trained = list(cfg.train.layers)
    rows = readings.engine_readings(
        json.loads((relabeled / "config.json").read_text()), t.num_hidden_layers, t.family,
        {"sglang": s.sglang_version, "vllm": s.vllm_version},
    )  # fmt: skip
    print(f"The demo's draft, trained on aux_layers={trained}, relabeled with vLLM ids {ids} and no provenance.\n")
    print("| engine | version | runner | reads | ids | feeds |\n|---|---|---|---|---|---|")
    for r in rows:
        fed = (str(list(r.layers)) if r.layers is not None else "-") + (f" ({r.error})" if r.error else "")
        print(f"| {r.engine} | {r.version} | {r.runner} | {r.source} | {list(r.ids)} | {fed} |")
    result = trained_layers_search(cfg, relabeled, Path(plan.target_dir), rows)
    print(
        f"\nloss_0 (the first draft step's cross-entropy against the target's distribution over the draft vocabulary) "
        f"and acc_0 on the target's greedy answers to {result['sequences']} validation prompts "
        f"(eval.max_new_tokens={cfg.eval.max_new_tokens} each), ranked by loss_0:\n"
    )
    print("| layers | loss_0 | se | above the lowest (paired se) | acc_0 | se | as read by |")
    print("|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        mark = " (trained)" if row["layers"] == trained else ""
        above = f"{row['above']:.4f} ({row['above_se']:.4f})"
        by = ", ".join(row["readings"]) or "a reading shifted by one"
        print(
            f"| {row['layers']}{mark} | {row['loss_0']:.4f} | {row['loss_0_se']:.4f} | {above} | {row['acc_0']:.4f} "
            f"| {row['acc_0_se']:.4f} | {by} |"
        )
    verdict = f"fits {result['found']} best" if result["found"] else "none named"
    print(f"\nverdict: {verdict}: {result['why']}")


if __name__ == "__main__":
    main(sys.argv[1:])

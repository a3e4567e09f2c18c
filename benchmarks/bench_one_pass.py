"""One pass against two: what makes the demo's eval acc_0 differ between a draft trained on vLLM's one-pass data
(data.regenerate.engine=one_pass: generated and captured in one request, a response's end token dropped) and one
trained on a separate regeneration (HF's, end token kept).

    .venv/bin/python benchmarks/bench_one_pass.py [outputs folder]

Runs `+experiment=tiny_eagle3 stages=[extract,train,eval]` both ways in the outputs folder (default outputs/, the
demo's cache: cached stages are taken from it), then scores each draft through the same live target (HF, in this
process) on the other mode's validation sequences and on its own without the position after a final end token
(the only position one pass does not have). Prints one JSON line last: each draft's eval acc_0, its acc_0 on the
positions both modes share, the two drafts' validation acc_0 along training, and the modes' sequences.
Run it alone: a second CPU-bound process on 2 cores slows both.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODES = {"regenerated": [], "one_pass": ["extract.engine=vllm", "data.regenerate.engine=one_pass"]}


def run(outputs: Path, overrides: list[str]) -> Path:
    """The pipeline's extract, train and eval stages in `outputs`; the run's folder."""
    command = [sys.executable, "-m", "orchestrator", "+experiment=tiny_eagle3", "stages=[extract,train,eval]",
               f"outputs_dir={outputs}", *overrides]  # fmt: skip
    before = set(outputs.glob("runs/*/*/summary.json"))
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    (summary,) = set(outputs.glob("runs/*/*/summary.json")) - before
    return summary.parent


def loaded(run_dir: Path):
    """(config, draft, validation sequences, the train stage's validation history) of a run."""
    from omegaconf import OmegaConf

    from orchestrator.config.validate import load
    from orchestrator.draft import export as draft_export
    from orchestrator.states.shards import load_split

    cfg = load(OmegaConf.load(run_dir / "config.yaml"))
    plan = json.loads((run_dir / "plan.json").read_text())
    extract = Path(plan["stage_dirs"]["extract"])
    manifest = json.loads((extract / "manifest.json").read_text())
    draft_dir = Path(plan["stage_dirs"]["train"]) / "draft"
    draft, _ = draft_export.load_draft(draft_dir)
    layers = draft_export.provenance(draft_dir)["aux_layers"]
    split = load_split(extract, manifest, "val", layers, verify=False)
    seqs = [s for s in split.take(range(min(cfg.eval.max_conversations, len(split)))) if len(s.input_ids) >= 3]
    history = json.loads((Path(plan["stage_dirs"]["train"]) / "metrics.json").read_text())["history"]
    return cfg, draft, seqs, [round(h["acc_0"], 4) for h in history], Path(plan["target_dir"]), layers


def main() -> None:
    from orchestrator.compute import cpu
    from orchestrator.engines.hf import HFEval
    from orchestrator.stages.eval import text_accuracy

    outputs = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "outputs").resolve()
    runs = {mode: loaded(run(outputs, overrides)) for mode, overrides in MODES.items()}
    cfg, _, _, _, target, layers = runs["regenerated"]
    live = HFEval(cfg, target, layers, cpu())
    eos = live.tokenizer.eos_token_id

    def shared(seqs):  # the position after a final end token, which one pass never has, left unscored
        out = []
        for s in seqs:
            mask = s.loss_mask.clone()
            if int(s.input_ids[-1]) == eos:
                mask[-1] = False
            out.append(type(s)(s.input_ids, mask, s.aux, s.teacher))
        return out

    line: dict = {}
    for mode, (_, draft, seqs, history, _, _) in runs.items():
        other = runs["one_pass" if mode == "regenerated" else "regenerated"][2]
        score = {}
        for name, sequences in (("own", seqs), ("own_shared_positions", shared(seqs)), ("other_modes", other)):
            served = list(live.served([s.input_ids.tolist() for s in sequences]))
            acc = text_accuracy(draft, sequences, served, 1, torch.device("cpu"))
            score[name] = {"acc_0": round(acc["acc_0"], 4), "positions": acc["positions_0"]}
        ended = sum(int(s.input_ids[-1]) == eos for s in seqs)
        line[mode] = {"draft_scored_on": score, "val_acc_0_by_validation": history, "sequences": len(seqs),
                      "ending_in_the_end_token": ended}  # fmt: skip
    print(json.dumps(line))


if __name__ == "__main__":
    main()

"""The tiny demo under a published chat template, beside the project's own: docs/data.md's table.

    .venv/bin/python examples/template_demo.py [--template tests/data/chat_templates/<file>.jinja]

Writes the demo's stdlib conversations to a JSON Lines file, then runs `+experiment=tiny_eagle3` on it with
`data=jsonl` and regeneration off (the draft learns the data set's assistant turns, under the template's mask),
`stages=[extract,train,eval]`, in a fresh outputs folder (reusing a tiny target built before when one is there):
once with the target's own template and once with the published one (`data.chat_template`), each trained as the
demo trains and after one training step (a draft that has learned nothing yet). Prints, per template: the
fraction of tokens the mask covers, training's validation acc_0, eval's acc_0 to acc_2, and the trained draft's
acc_0 over the one-step draft's. (Eval's greedy accept length is left out: the tiny target was trained on its own
template and, prompted in another, answers in a few tokens, too few for a rate.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEMPLATE = ROOT / "tests" / "data" / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"


def write_conversations(path: Path) -> int:
    from orchestrator.tiny.corpus import stdlib_conversations

    train, val = stdlib_conversations(seed=0, max_files=None)
    every = train + val
    path.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in every), encoding="utf-8")
    return len(every)


def run(outputs: Path, data: Path, name: str, *overrides: str) -> dict:
    run_dir = outputs / "runs" / name
    command = [
        sys.executable,
        "-m",
        "orchestrator",
        "+experiment=tiny_eagle3",
        f"outputs_dir={outputs}",
        f"hydra.run.dir={run_dir}",
        "data=jsonl",
        f"data.train_files=[{data}]",
        "data.regenerate.enabled=false",
        "stages=[extract,train,eval]",
        *overrides,
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def masked_fraction(summary: dict) -> float:
    plan = json.loads((Path(summary["run_dir"]) / "plan.json").read_text())
    manifest = json.loads((Path(plan["stage_dirs"]["extract"]) / "manifest.json").read_text())
    split = manifest["splits"]["train"]
    return split["num_loss_tokens"] / split["num_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--template", type=Path, default=DEFAULT_TEMPLATE)
    args = ap.parse_args()
    outputs = Path(tempfile.mkdtemp(prefix="template_demo_"))
    built = Path(os.environ.get("EAGLE_ORCH_OUTPUTS", "outputs")) / "cache" / "targets"
    if built.exists():
        shutil.copytree(built, outputs / "cache" / "targets", ignore=shutil.ignore_patterns("*.lock"))
    data = outputs / "conversations.jsonl"
    count = write_conversations(data)
    started = time.perf_counter()
    rows = []
    for label, extra in (
        ("the target's own", []),
        (args.template.name, [f"data.chat_template={args.template.resolve()}"]),
    ):
        tag = "own" if not extra else "published"
        trained = run(outputs, data, f"{tag}-trained", *extra)
        one_step = run(outputs, data, f"{tag}-one-step", *extra, "train.max_steps=1")
        rows.append((label, masked_fraction(trained), trained["stages"], one_step["stages"]))
    seconds = time.perf_counter() - started
    print(f"data=jsonl: {count} stdlib conversations in {data}; regeneration off; {seconds / 60:.1f} min")
    columns = ["template", "tokens masked", "train val acc_0", "eval acc_0 (one step)", "eval acc_1 / acc_2"]
    print("| " + " | ".join([*columns, "trained / one step"]) + " |")
    print("|---|---|---|---|---|---|")
    for label, fraction, trained, one in rows:
        acc, base = trained["eval"]["acc_0"], one["eval"]["acc_0"]
        ratio = f"{acc / base:.1f}x" if base > 0 else "inf (one step: 0)"
        print(
            f"| {label} | {fraction:.1%} | {trained['train']['val_acc_0']:.3f} | {acc:.3f} ({base:.3f}) | "
            f"{trained['eval']['acc_1']:.3f} / {trained['eval']['acc_2']:.3f} | {ratio} |"
        )


if __name__ == "__main__":
    main()

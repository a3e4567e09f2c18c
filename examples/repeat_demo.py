"""The demo run N times: the spread of every figure the README and docs/measurements.md quote, as min / median / max.

    .venv/bin/python examples/repeat_demo.py [--runs 5] [hydra overrides...]

The first run builds (or reuses) the target, the extraction, the draft and eval's result; every run then serves
anew (serve.force=true), so the spread is that of the serve benchmark (timing noise). Also prints the engine that
served (vLLM where scripts/make_vllm_env.sh built it), vLLM's acceptance per position and latencies, or the serve
cycle's profile (the reference engine's mean ms per phase). Writes outputs/repeat_demo.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from orchestrator import conf_dir
from orchestrator.artifacts import write_json
from orchestrator.config import load
from orchestrator.pipeline import run_pipeline
from orchestrator.targets import target_dir
from orchestrator.tiny import load_build_report

FIGURES = {
    "extract: regenerate, s": ("extract", "regenerate_s"),
    "extract: tokens/s": ("extract", "tokens_per_s"),
    "extract: bytes/token": ("extract", "bytes_per_token"),
    "extract: response tokens/seq": ("extract", "loss_tokens_per_sequence"),
    "train val acc_0": ("train", "val_acc_0"),
    "train val acc_1": ("train", "val_acc_1"),
    "train val acc_2": ("train", "val_acc_2"),
    "eval acc_0 (served states)": ("eval", "acc_0"),
    "eval acc_0 (trained states)": ("eval", "trained_states_acc_0"),
    "eval acc_1 (served states)": ("eval", "acc_1"),
    "eval acc_2 (served states)": ("eval", "acc_2"),
    "eval expected accept length": ("eval", "expected_accept_length"),
    "served accept length": ("serve", "accept_length"),
    "served accept length, counted requests": ("serve", "accept_length_counted"),
    "  its 95% interval, low": ("serve", ("accept_length_ci95", 0)),
    "  its 95% interval, high": ("serve", ("accept_length_ci95", 1)),
    "  requests counted": ("serve", "accept_length_requests"),
    "served accept length, eval's prompts": ("serve", "accept_length_eval_prompts"),
    "  its 95% interval on eval's prompts, low": ("serve", ("accept_length_eval_prompts_ci95", 0)),
    "  its 95% interval on eval's prompts, high": ("serve", ("accept_length_eval_prompts_ci95", 1)),
    "served acceptance, position 0": ("serve", ("acceptance_by_position", 0)),
    "served acceptance, position 1": ("serve", ("acceptance_by_position", 1)),
    "served acceptance, position 2": ("serve", ("acceptance_by_position", 2)),
    "served / expected accept length - 1": ("serve", "accept_length_rel_diff"),
    "greedy differing token rate": ("serve", "greedy_differing_token_rate"),
    "baseline time to first token, s": ("serve", "baseline_ttft_mean_s"),
    "speculative time to first token, s": ("serve", "spec_ttft_mean_s"),
    "baseline inter-token latency, s": ("serve", "baseline_itl_mean_s"),
    "speculative inter-token latency, s": ("serve", "spec_itl_mean_s"),
    "baseline tok/s": ("serve", "baseline_tok_s"),
    "speculative tok/s": ("serve", "spec_tok_s"),
    "speedup": ("serve", "speedup"),
    "baseline decode step, ms": ("serve", "baseline_decode_ms"),
    "speculative verify pass, ms": ("serve", "speculative_verify_ms"),
    "speculative draft chain, ms": ("serve", "speculative_draft_chain_ms"),
    "speculative draft extend, ms": ("serve", "speculative_draft_extend_ms"),
}


def _value(result: dict, key):
    if isinstance(key, tuple):  # (list key, index)
        values = result.get(key[0]) or []
        return values[key[1]] if key[1] < len(values) else None
    return result.get(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args, overrides = parser.parse_known_args()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        # serve.force: every run serves anew (its passes are the spread measured); eval is deterministic, cached
        base = ["+experiment=tiny_eagle3", "run_name=repeat_demo", "serve.force=true"]
        cfg = load(compose("config", overrides=[*base, *overrides]))
    summaries = []
    with tempfile.TemporaryDirectory() as runs:
        for i in range(args.runs):
            print(f"=== run {i + 1}/{args.runs}", flush=True)
            summaries.append(run_pipeline(cfg, Path(runs) / str(i)))
    flags = [f for s in summaries for f in s["mismatch_flags"]]
    table = {}
    for name, (stage, key) in FIGURES.items():
        values = [_value(s["stages"].get(stage, {}), key) for s in summaries]
        values = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if values:
            table[name] = {
                "min": min(values),
                "median": statistics.median(values),
                "max": max(values),
                "values": values,
            }
    write_json(
        cfg.outputs / "repeat_demo.json",
        {"runs": args.runs, "overrides": overrides, "figures": table, "mismatch_flags": flags},
    )
    report = load_build_report(target_dir(cfg))
    print(f"\n{args.runs} runs of +experiment=tiny_eagle3 {' '.join(overrides)}")
    print(
        f"target {cfg.target.name}: held-out loss {report['heldout_loss']:.2f} (uniform {report['uniform_loss']:.2f}), "
        f"{'built here' if cfg.target.tiny.rebuild else 'the repository build (orchestrator/tiny/shipped)'}, "
        f"built in {report['total_seconds']:.0f} s with {report['environment']}"
    )
    serve = summaries[-1]["stages"].get("serve", {})
    print(f"served by {serve.get('engine')} {serve.get('engine_version')}; {serve.get('engine_fallback') or ''}")
    print(f"{'figure':44s} {'min':>9s} {'median':>9s} {'max':>9s}")
    for name, row in table.items():
        print(f"{name:44s} {row['min']:9.3f} {row['median']:9.3f} {row['max']:9.3f}")
    print(f"mismatch flags: {flags or 'none'}")
    sys.exit(1 if flags else 0)


if __name__ == "__main__":
    main()

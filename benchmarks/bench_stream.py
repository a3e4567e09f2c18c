"""How fast the capture service delivers states (train.states=stream) against its engine's own prefill, in one run.

    .venv/bin/python benchmarks/bench_stream.py [--steps 40] [--engines hf,vllm] [--transports file,mooncake]

On the demo's tiny Llama (`+experiment=tiny_eagle3`, regeneration off, so every run reads the data set's own
sequences), for each engine (HF transformers; vLLM where its environment is built):
- **prefill**: the engine's own rate on the sequences of the first `--steps` training steps, in the trainers'
  order: tokens/s of a plain forward that yields one token (HF: the target's forward with one position's logits;
  vLLM: `generate` with `max_tokens=1` and no extractor, `benchmarks/vllm_prefill.py`), sent in the requests the
  service sends, after a warm-up pass;
- **stream**: for each transport (`train.stream.transport`: the spool's files, Mooncake Store over loopback TCP),
  the capture service started as a training starts it (`stream.CaptureService`, its buffer sized for the run), and
  a consumer that only reads each step's states (`stream.StreamedSplit.take`, as every rank's trainer reads them)
  and does nothing with them: tokens/s from the moment the service's engine is up (its status says "capturing") to
  the last state read.

The ratio stream / prefill says what capturing and handing the states over cost on top of the engine's own work
(goal: >= 0.9). For vLLM a third row, its extractor capturing alone (the service's engine arguments, each request's
files awaited and deleted, `benchmarks/vllm_prefill.py` with `capture`), parts vLLM's own cost from the service's.
Both run on the same 2 cores, one at a time (the service and its reader are two processes, as in training). Prints
a table and one JSON line last; `--save` keeps that line in `benchmarks/results/bench_stream.json`, whose ratios
the dry run multiplies `train.stream.capture_samples_per_s` by for a service on the same kind of device
(`train.stream.capture_ratio` overrides). Run it alone: a second CPU-bound process on 2 cores slows both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402

from orchestrator import conf_dir  # noqa: E402
from orchestrator.config import load  # noqa: E402
from orchestrator.config.validate import MEASURED_STREAM  # noqa: E402
from orchestrator.engines.vllm import cli  # noqa: E402
from orchestrator.pipeline import make_plan, run_pipeline  # noqa: E402
from orchestrator.states import stream  # noqa: E402
from orchestrator.states.shards import load_split  # noqa: E402
from orchestrator.states.source import step_indices  # noqa: E402
from orchestrator.tiny.build import cpu_identity  # noqa: E402

GOAL = 0.9


def config(outputs: Path, engine: str, transport: str, vllm_python: str):
    overrides = [
        "+experiment=tiny_eagle3", f"outputs_dir={outputs}", "cluster=debug", "stages=[extract]",
        "data.regenerate.enabled=false", "train.states=stream", f"train.stream.transport={transport}",
        f"extract.engine={engine}", f"extract.python={vllm_python}", "extract.dtype=float32",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return load(compose("config", overrides=overrides))


def sequences(cfg, plan, steps: int) -> tuple[list[list[int]], int]:
    """The token ids of the first `steps` steps' sequences, in the trainers' order."""
    from orchestrator.states.manifest import load_manifest_checked

    extract_dir = plan.dir("extract")
    split = load_split(extract_dir, load_manifest_checked(extract_dir, cfg), "train", verify=False, tokens_only=True)
    order = [i for step in range(steps) for i in step_indices(len(split), cfg.train.batch_size, cfg.train.seed, step)]
    return [split.tokens(i)[0].tolist() for i in order], len(split)


def hf_prefill(cfg, plan, prompts: list[list[int]], batch: int) -> dict:
    from orchestrator import compute as compute_mod
    from orchestrator.targets import load_target

    compute_mod.flush_denormals()  # as the service does
    model, tokenizer = load_target(Path(plan.target_dir), cfg.target.trust_remote_code)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    forward = cfg.extract.batch_size
    seconds = 0.0
    with torch.no_grad():
        for _ in range(2):  # warm-up, then timed
            began = time.perf_counter()
            for first in range(0, len(prompts), forward):
                rows = prompts[first : first + forward]
                width = max(map(len, rows))
                ids = torch.full((len(rows), width), pad, dtype=torch.long)
                attn = torch.zeros((len(rows), width), dtype=torch.long)
                for r, row in enumerate(rows):
                    ids[r, : len(row)], attn[r, : len(row)] = torch.tensor(row), 1
                model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=1)
            seconds = time.perf_counter() - began
    tokens = sum(map(len, prompts))
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def vllm_prefill(cfg, plan, prompts: list[list[int]], batch: int, work: Path, capture: bool = False) -> dict:
    """vLLM's plain prefill, or (`capture`) its extractor's capture alone: `benchmarks/vllm_prefill.py`."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "request.json").write_text(json.dumps({"prompts": prompts, "batch": batch, "capture": capture}))
    args = cli.extract_engine_args(cfg, plan.target_dir, work / "engine", 0)
    command = [cfg.extract.python, str(ROOT / "benchmarks" / "vllm_prefill.py"), str(work / "request.json"), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=cli.side_env())
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        sys.exit(f"vLLM's prefill failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(lines[-1])


def streamed(cfg, plan, steps: int, size: int, spool: Path) -> dict:
    """The service's delivery to a reader of every step's states, from its engine up to the last state read."""
    spec = stream.StreamSpec.of(cfg, plan, os.getpid(), (0, steps))
    service = stream.CaptureService(spool, spec).start()
    split = stream.StreamedSplit(spool, size, None, 600, service)
    try:
        while (stream.read_status(spool) or {}).get("state") != "capturing":
            split._check_alive(-1)  # fails naming the service's log if it died starting
            time.sleep(0.01)
        began, tokens = time.perf_counter(), 0
        for step in range(steps):
            got = split.take(step_indices(size, cfg.train.batch_size, cfg.train.seed, step))
            tokens += sum(len(s.input_ids) for s in got)
        seconds = time.perf_counter() - began
        report = split.report()
    finally:
        split.close()
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "wait_s": report["wait_s"],
            "service_blocked_s": report["service_blocked_s"], "peak_bytes": report["peak_spool_bytes"],
            "buffer": [spec.buffer_sequences, spec.buffer_bytes], "store": report["store"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps streamed (train.batch_size each)")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--transports", default="file,mooncake")
    parser.add_argument("--outputs", type=Path, default=None, help="an outputs folder to reuse (its tiny target)")
    parser.add_argument(
        "--save", action="store_true",
        help=f"write the JSON line to {MEASURED_STREAM.relative_to(ROOT)}, whose ratios the dry run prices the stream "
        "with (train.stream.capture_ratio)",
    )  # fmt: skip
    args = parser.parse_args()
    vllm_python = os.environ.get("VLLM_PYTHON") or str(ROOT / "outputs" / "vllm-env" / "bin" / "python")
    outputs = args.outputs or Path(tempfile.mkdtemp(prefix="bench_stream_"))
    # the device the engines ran on: the dry run applies these ratios to a service on the same kind of device only
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, result = [], {"cpu": cpu_identity(), "device": device, "steps": args.steps, "engines": {}}
    for engine in args.engines.split(","):
        if engine == "vllm" and not cli.available(vllm_python):
            print(f"[bench_stream] no vLLM environment at {vllm_python}: vLLM skipped", flush=True)
            continue
        cfg = config(outputs, engine, "file", vllm_python)
        plan = make_plan(cfg, outputs / "runs" / engine)
        run_pipeline(cfg, outputs / "runs" / engine)  # the streamed extraction: the train split's token ids
        prompts, size = sequences(cfg, plan, args.steps)
        request = stream.StreamSpec.of(cfg, plan, None).request_sequences
        if engine == "hf":
            prefill = hf_prefill(cfg, plan, prompts, request)
        else:
            prefill = vllm_prefill(cfg, plan, prompts, request, outputs / "vllm_prefill")
        result["engines"][engine] = {"prefill": prefill, "request_sequences": request, "stream": {}}
        rows.append((engine, "prefill (engine alone)", prefill["tokens_per_s"], None))
        if engine == "vllm":  # what vLLM's extractor costs by itself: the capture without the service's hand-over
            alone = vllm_prefill(cfg, plan, prompts, request, outputs / "vllm_capture", capture=True)
            alone["ratio"] = alone["tokens_per_s"] / prefill["tokens_per_s"]
            result["engines"][engine]["capture_alone"] = alone
            rows.append((engine, "capture alone (extractor)", alone["tokens_per_s"], alone["ratio"]))
        for transport in args.transports.split(","):
            cfg_t = config(outputs, engine, transport, vllm_python)
            got = streamed(cfg_t, plan, args.steps, size, outputs / "spool" / f"{engine}-{transport}")
            got["ratio"] = got["tokens_per_s"] / prefill["tokens_per_s"]
            result["engines"][engine]["stream"][transport] = got
            rows.append((engine, f"stream through {transport}", got["tokens_per_s"], got["ratio"]))
            print(f"[bench_stream] {engine} / {transport}: {json.dumps(got)}", flush=True)
    print(f"\n{len(prompts)} sequences, {sum(map(len, prompts)):,} tokens; {result['cpu']}")
    print(f"{'engine':<8}{'what':<28}{'tokens/s':>12}{'x prefill':>12}")
    for engine, what, rate, ratio in rows:
        print(f"{engine:<8}{what:<28}{rate:>12,.0f}{'' if ratio is None else f'{ratio:.2f}x':>12}")
    result["goal"] = GOAL
    result["meets_goal"] = all(
        s["ratio"] >= GOAL for e in result["engines"].values() for s in e["stream"].values()
    )  # fmt: skip
    result["measured_at"] = time.strftime("%Y-%m-%d")
    print(json.dumps(result))
    if args.save:
        MEASURED_STREAM.parent.mkdir(parents=True, exist_ok=True)
        MEASURED_STREAM.write_text(json.dumps(result, indent=1) + "\n")
        print(f"[bench_stream] saved: {MEASURED_STREAM.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

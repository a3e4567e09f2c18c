"""How long the serve stage's count (each validation prompt's own accept length, `serve.accept_prompts` of them)
takes at several levels of requests in flight (`serve.accept_concurrency`), and whether every request's count is
the same at each: one vLLM speculative server, started once with the command the demo's last run served with, the
levels in turn.

    .venv/bin/python benchmarks/bench_count_concurrency.py [--outputs outputs] [--levels 16 32 64 128 256]

Needs a demo run in `--outputs` (`python -m orchestrator +experiment=tiny_eagle3`, served by vLLM). Prints each
level's seconds and pooled accept length, then one JSON line. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from orchestrator import conf_dir
from orchestrator.config import load
from orchestrator.engines import client
from orchestrator.engines.vllm import cli
from orchestrator.stages import serve
from orchestrator.tiny.build import cpu_identity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outputs", type=Path, default=Path("outputs"))
    parser.add_argument("--levels", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    args = parser.parse_args()
    runs = sorted(args.outputs.glob("runs/tiny_eagle3/*/serve/serve.json"))
    if not runs:
        sys.exit(f"no demo run served in {args.outputs}: python -m orchestrator +experiment=tiny_eagle3")
    command = json.loads(runs[-1].read_text())["servers"]["speculative"]["command"]
    if "vllm.entrypoints.openai.api_server" not in command:
        sys.exit(f"{runs[-1]}: the demo was not served by vLLM (scripts/make_vllm_env.sh builds its environment)")
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = load(compose("config", overrides=["+experiment=tiny_eagle3", f"outputs_dir={args.outputs}"]))
    s = cfg.serve
    target = Path(command[command.index("--model") + 1])
    prompts = serve._prompts(cfg, target)[: serve.accept_prompts(cfg)]
    port = client.free_port()
    command = command[: command.index("--port") + 1] + [str(port)]
    seconds, counts = {}, {}
    with client.ServerProcess(
        command, port, runs[-1].parent / "count_bench_server.log", 600, cli.server_env(cfg)
    ) as server:
        cli.complete(server, prompts[0], 8, s.request_timeout_s)  # warm-up
        for level in args.levels:
            started = time.monotonic()
            counts[level] = cli.request_counts(server, prompts, s.max_new_tokens, s.request_timeout_s, level)
            seconds[level] = round(time.monotonic() - started, 2)
            pooled = serve.accept_interval(counts[level])["accept_length_counted"]
            print(f"{level} in flight: {seconds[level]} s, accept length {pooled}", flush=True)
    first = counts[args.levels[0]]
    line = {
        "cpu": cpu_identity(),
        "prompts": len(prompts),
        "seconds": seconds,
        "same_counts_as_first_level": {level: counts[level] == first for level in args.levels},
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()

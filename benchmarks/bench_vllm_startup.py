"""How long a vLLM server takes to become healthy on this CPU, its model worker in a process of its own (vLLM's
default: the API server, the engine core and the worker each import vLLM) or inside the engine core's
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, what the serve stage sets on a machine without GPUs: two processes), the two
alternated so that the machine's speed moves both alike.

    .venv/bin/python benchmarks/bench_vllm_startup.py [--pairs 2]

Serves the demo's kept tiny target (copied into a scratch folder) with the serve stage's own command and
environment (`serve=vllm`, no draft). Prints each start-up and one JSON line last. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from orchestrator import conf_dir
from orchestrator.config import load
from orchestrator.engines import client, server_command
from orchestrator.engines.vllm import cli
from orchestrator.targets import ensure_target
from orchestrator.tiny.build import cpu_identity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_vllm_startup_") as scratch:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = load(compose("config", overrides=["+experiment=tiny_eagle3", f"outputs_dir={scratch}"]))
        if not cli.available(cfg.serve.python):
            sys.exit(f"no vLLM environment at {cfg.serve.python}: bash scripts/make_vllm_env.sh")
        target = ensure_target(cfg, progress=False)
        seconds: dict[str, list[float]] = {"separate": [], "in_process": []}
        for pair in range(args.pairs):
            for mode, value in (("separate", "1"), ("in_process", "0")):
                port = client.free_port()
                command = server_command(cfg, target, None, port)
                env = cli.server_env(cfg) | {"VLLM_ENABLE_V1_MULTIPROCESSING": value}
                began = time.monotonic()
                with client.ServerProcess(command, port, Path(scratch) / f"{mode}-{pair}.log", 600, env=env):
                    seconds[mode].append(round(time.monotonic() - began, 1))
                print(f"pair {pair + 1}: engine core {mode}: healthy after {seconds[mode][-1]} s", flush=True)
    line = {"cpu": cpu_identity(), "seconds": seconds, "median": {k: statistics.median(v) for k, v in seconds.items()}}
    line["in_process_over_separate"] = round(line["median"]["in_process"] / line["median"]["separate"], 3)
    print(json.dumps(line))


if __name__ == "__main__":
    main()

"""The reference engine: the project's own speculative-decoding server for CPU runs.

An HF target plus an exported EAGLE-3 draft directory, chained greedy drafting with KV caches for both, exact
greedy verification. It reads the draft directory as SGLang does (ids from `eagle_config`, decoded with
SGLang's rule for the target's family and version, so a mis-exported draft misbehaves here as it would
there) and speaks the subset of SGLang's HTTP API the benchmark client uses:

    GET  /health          200 once the models are loaded
    POST /generate        {"input_ids": [...] | [[...], ...], "sampling_params": {"max_new_tokens": N}}
                          -> {"output_ids", "text", "meta_info": {"prompt_tokens", "completion_tokens",
                              "spec_verify_ct", "finish_reason", "e2e_latency"}}
    POST /v1/completions  {"prompt": [ids] | [[ids], ...], "max_tokens": N, "return_token_ids": true}
                          -> {"choices": [{"token_ids", "prompt_token_ids", "text", "finish_reason"}], "usage"}
    GET  /v1/models       {"data": [{"id": "orchestrator-reference"}]}
    GET  /server_info     {"internal_states": [{"avg_spec_accept_length", ...}]}
    POST /flush_cache     resets the running statistics

Decoding is greedy and stops at the tokenizer's end token (included in the ids, as SGLang returns it) or at the
token budget; a request for temperature > 0, or for other stop tokens, is answered 400 rather than served otherwise.

Without `--draft` it is the baseline: the same target, one token per forward.
Run: python -m orchestrator.engines.reference.server --target DIR [--draft DIR] --port P
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from orchestrator import __version__, engines
from orchestrator import compute as compute_mod
from orchestrator.capture import HiddenStateCapture, num_decoder_layers
from orchestrator.compute import Compute
from orchestrator.draft.export import load_draft
from orchestrator.draft.model import DraftCache
from orchestrator.targets import load_target


class Engine:
    def __init__(
        self, target: Path, draft: Path | None, steps: int, family: str, sglang_version: str, compute: Compute
    ):
        self.compute = compute
        self.model, self.tokenizer = load_target(target, compute=compute)
        self.eos = self.tokenizer.eos_token_id
        self.steps = steps
        self.draft = None
        self.layers: list[int] = []
        if draft is not None:
            self.draft, conf = load_draft(draft)
            self.draft.to(compute.device)
            ids = conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
            n = num_decoder_layers(self.model)
            self.layers = engines.from_engine_ids("sglang", ids, n, family, sglang_version)
            if len(self.layers) != self.draft.shape.num_aux_layers:
                raise RuntimeError(
                    f"captured {len(self.layers)} of {self.draft.shape.num_aux_layers} aux hidden states: the draft "
                    f"config's ids {ids} capture {self.layers} on this {n}-layer target "
                    f"({family}, sglang {sglang_version} rules)"
                )
        self.stats_lock = threading.Lock()
        self.flush()

    def flush(self) -> None:
        with self.stats_lock:
            self.total_completion = 0
            self.total_verify = 0
            self.histogram = [0] * (self.steps + 1)
            self.phases: dict[str, list[float]] = {}  # phase -> [seconds, count]

    @contextlib.contextmanager
    def timed(self, phase: str):
        """Wall time of one serving phase (prefill, decode step, draft chain, verify pass, draft extend),
        reported by /get_server_info as the mean per occurrence: the profile of the serve cycle."""
        started = time.perf_counter()
        yield
        compute_mod.synchronize(self.compute.device)
        with self.stats_lock:
            total = self.phases.setdefault(phase, [0.0, 0])
            total[0] += time.perf_counter() - started
            total[1] += 1

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new: int) -> dict[str, Any]:
        if self.draft is None:
            out, verify, hist = self._baseline(prompt, max_new), 0, None
        else:
            out, verify, hist = self._speculative(prompt, max_new)
        with self.stats_lock:
            self.total_completion += len(out)
            self.total_verify += verify
            if hist:
                self.histogram = [a + b for a, b in zip(self.histogram, hist)]
        finish = (
            {"type": "stop", "matched": self.eos}
            if out and out[-1] == self.eos
            else {"type": "length", "length": max_new}
        )
        return {"output_ids": out, "verify": verify, "finish_reason": finish}

    def _baseline(self, prompt: list[int], max_new: int) -> list[int]:
        cache = DynamicCache()
        with self.timed("prefill"):
            logits = self.model(
                input_ids=torch.tensor([prompt], device=self.compute.device), past_key_values=cache, use_cache=True
            ).logits
        out = []
        while True:
            token = int(logits[0, -1].argmax())
            out.append(token)
            if len(out) >= max_new or token == self.eos:
                return out
            with self.timed("decode"):
                logits = self.model(
                    input_ids=torch.tensor([[token]], device=self.compute.device), past_key_values=cache, use_cache=True
                ).logits

    def _speculative(self, prompt: list[int], max_new: int) -> tuple[list[int], int, list[int]]:
        steps = self.steps
        cache, dcache = DynamicCache(), DraftCache()
        histogram = [0] * (steps + 1)
        with HiddenStateCapture(self.model, self.layers) as capture:
            with self.timed("prefill"):
                logits = self.model(
                    input_ids=torch.tensor([prompt], device=self.compute.device), past_key_values=cache, use_cache=True
                ).logits
                token = int(logits[0, -1].argmax())
                # Commit positions 0..P-1: target states there, each with the token that follows it.
                h = self.draft.extend(
                    capture.aux(), torch.tensor([prompt[1:] + [token]], device=self.compute.device), 0, dcache
                )
            out = [token]
            last = len(prompt) - 1
            verify = 0
            while len(out) < max_new and token != self.eos:
                with self.timed("draft_chain"):
                    drafts = self.draft.chain(h, last, dcache, steps)
                with self.timed("verify"):
                    logits = self.model(
                        input_ids=torch.tensor([[token] + drafts], device=self.compute.device),
                        past_key_values=cache,
                        use_cache=True,
                    ).logits
                    preds = logits[0].argmax(-1).tolist()
                accepted = 0
                while accepted < steps and drafts[accepted] == preds[accepted]:
                    accepted += 1
                new = drafts[:accepted] + [preds[accepted]]
                verify += 1
                histogram[accepted] += 1
                with self.timed("draft_extend"):
                    _keep(cache, last + 1 + accepted + 1)
                    h = self.draft.extend(
                        capture.aux()[:, : accepted + 1],
                        torch.tensor([new], device=self.compute.device),
                        last + 1,
                        dcache,
                    )
                last += accepted + 1
                token = new[-1]
                for t in new:  # stop at eos or the token budget, whichever the new tokens reach first
                    out.append(t)
                    if t == self.eos:
                        token = t
                        break
        return out[:max_new], verify, histogram

    def server_info(self) -> dict[str, Any]:
        with self.stats_lock:
            avg = self.total_completion / self.total_verify if self.total_verify else None
            state = {
                "avg_spec_accept_length": avg,
                "spec_accept_histogram": list(self.histogram),
                "total_completion_tokens": self.total_completion,
                "total_verify_ct": self.total_verify,
            }
            phase_ms = {name: 1000 * seconds / count for name, (seconds, count) in self.phases.items()}
        return {
            "internal_states": [state],
            "speculative_algorithm": "EAGLE3" if self.draft is not None else None,
            "speculative_num_steps": self.steps if self.draft is not None else None,
            "aux_layers_captured": self.layers,
            # what the target computes in (--dtype): a bf16 server's verify passes and decode steps round differently
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "phase_ms": phase_ms,
            "engine": "orchestrator-reference",
            # the project's own version; the id rule it applies is SGLang's at --sglang-version (the summary's id_rules)
            "version": __version__,
        }


def _keep(cache: DynamicCache, length: int) -> None:
    """Drops the rejected draft positions from the target's KV cache (transformers 5 `crop` takes the number
    of tokens to remove, as a negative int)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class MainThreadWorker:
    """Runs every generation on the thread that calls `run_forever` (the main thread).

    HTTP requests arrive on the server's threads; computing there would start a second OpenMP team while the
    main thread's team still spins, and on 2 cores that made decoding 1.5-3x slower (measured). One worker
    also serializes requests: the reference engine runs one sequence at a time."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.jobs: queue.Queue = queue.Queue()

    def submit(self, prompt: list[int], max_new: int) -> dict[str, Any]:
        future: Future = Future()
        self.jobs.put((prompt, max_new, future))
        return future.result()

    def run_forever(self) -> None:
        while True:
            prompt, max_new, future = self.jobs.get()
            try:
                future.set_result(self.engine.generate(prompt, max_new))
            except Exception as exc:  # reported to that request as a 400, the server keeps going
                future.set_exception(exc)


MODEL_NAME = "orchestrator-reference"


def make_handler(engine: Engine, worker: MainThreadWorker):
    def prompts_of(batch) -> tuple[list[list[int]], bool]:
        """(prompts, single) of a request's token ids: one list of ids, or a list of them."""
        if not batch:
            raise ValueError("request needs input_ids or text")
        single = isinstance(batch[0], int)
        return ([batch] if single else batch), single

    def run(prompts: list[list[int]], max_new: int, temperature, stop_token_ids) -> list[tuple[dict, dict]]:
        """(result, meta_info) per prompt, one after the other on the engine's worker."""
        if temperature not in (None, 0, 0.0):
            raise ValueError(f"temperature={temperature}: the reference engine decodes greedily only (temperature 0)")
        if stop_token_ids and set(stop_token_ids) != {engine.eos}:
            raise ValueError(
                f"stop_token_ids={stop_token_ids}: the reference engine stops at its end token {engine.eos} only"
            )
        out = []
        for prompt in prompts:
            started = time.perf_counter()
            result = worker.submit(list(prompt), max_new)
            meta = {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(result["output_ids"]),
                "finish_reason": result["finish_reason"],
                "e2e_latency": time.perf_counter() - started,
            }
            if engine.draft is not None:
                meta["spec_verify_ct"] = result["verify"]
            out.append((result, meta))
        return out

    def generate(request: dict[str, Any]) -> Any:
        """SGLang's /generate: the ids generated as top-level `output_ids` (the end token included), as 0.5.23
        answers."""
        batch = request.get("input_ids")
        texts = request.get("text")
        if batch is None and texts is not None:
            batch = [engine.tokenizer(t)["input_ids"] for t in ([texts] if isinstance(texts, str) else texts)]
            if isinstance(texts, str):
                batch = batch[0]
        prompts, single = prompts_of(batch)
        sampling = request.get("sampling_params") or {}
        runs = run(
            prompts,
            int(sampling.get("max_new_tokens", 128)),
            sampling.get("temperature"),
            sampling.get("stop_token_ids"),
        )
        responses = [
            {
                "text": engine.tokenizer.decode(result["output_ids"]),
                "output_ids": result["output_ids"],
                "meta_info": meta,
            }
            for result, meta in runs
        ]
        return responses[0] if single else responses

    def completions(request: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's /v1/completions for token-id prompts, as SGLang 0.5.23 answers it: with `return_token_ids`, each
        choice carries `token_ids` (the same ids /generate returns) and `prompt_token_ids`."""
        prompt = request.get("prompt")
        if not isinstance(prompt, list):
            raise ValueError("prompt: the reference engine takes token ids (a list of ints, or a list of such lists)")
        prompts, _ = prompts_of(prompt)
        runs = run(
            prompts, int(request.get("max_tokens", 16)), request.get("temperature", 1.0), request.get("stop_token_ids")
        )
        choices = []
        for index, (prompt_ids, (result, meta)) in enumerate(zip(prompts, runs)):
            choice = {
                "index": index,
                "text": engine.tokenizer.decode(result["output_ids"]),
                "logprobs": None,
                "finish_reason": result["finish_reason"]["type"],
                "matched_stop": result["finish_reason"].get("matched"),
            }
            if request.get("return_token_ids"):
                choice |= {"token_ids": result["output_ids"], "prompt_token_ids": list(prompt_ids)}
            choices.append(choice)
        usage = {
            "prompt_tokens": sum(m["prompt_tokens"] for _, m in runs),
            "completion_tokens": sum(m["completion_tokens"] for _, m in runs),
        }
        return {
            "id": f"cmpl-{time.monotonic_ns()}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": MODEL_NAME,
            "choices": choices,
            "usage": usage | {"total_tokens": sum(usage.values())},
        }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # one line per request on stderr, like a server log
            print(f"{self.address_string()} {fmt % args}", flush=True)

        def _send(self, code: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length) or b"{}")

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path in ("/server_info", "/get_server_info"):
                self._send(200, engine.server_info())
            elif self.path == "/v1/models":
                self._send(
                    200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "orchestrator"}]}
                )
            else:
                self._send(404, {"error": f"unknown path {self.path}"})

        def do_POST(self):
            if self.path == "/flush_cache":
                engine.flush()
                self._send(200, {"success": True})
                return
            if self.path not in ("/generate", "/v1/completions"):
                self._send(404, {"error": f"unknown path {self.path}"})
                return
            try:
                request = self._body()
                if self.path == "/generate":
                    self._send(200, generate(request))
                else:
                    self._send(200, completions(request))
            except Exception as exc:  # a bad request must not kill the server
                self._send(400, {"error": f"{type(exc).__name__}: {exc}"})

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--draft", type=Path, default=None)
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--family", required=True)
    parser.add_argument("--sglang-version", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the target computes, e.g. cuda:0, or cuda:0,cuda:1 to spread it; the draft takes the first",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(compute_mod.DTYPES),
        help="the target's dtype (the draft keeps its config's)",
    )
    args = parser.parse_args(argv)
    compute_mod.flush_denormals()  # as eval computes, in its job (pipeline.run_stage)
    if args.threads:
        torch.set_num_threads(args.threads)
    compute = compute_mod.Compute(
        devices=tuple(torch.device(d) for d in args.device.split(",")), dtype=compute_mod.DTYPES[args.dtype]
    )
    engine = Engine(args.target, args.draft, args.num_steps, args.family, args.sglang_version, compute)
    worker = MainThreadWorker(engine)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine, worker))
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    print(
        f"reference engine ready on http://{args.host}:{args.port} (draft={args.draft}, layers={engine.layers})",
        flush=True,
    )
    worker.run_forever()


if __name__ == "__main__":
    main()

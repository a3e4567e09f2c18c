"""Server lifecycle and the engine-agnostic benchmark client (SGLang's HTTP API).

`ServerProcess` starts a server command as a child in its own process group on 127.0.0.1, waits for
/health, and always stops the whole group (on errors and Ctrl-C too); a failed start raises with the log's
tail. `benchmark` sends the prompt set greedily at a concurrency level and measures output tok/s, latency and
accept length = Σ completion_tokens / Σ spec_verify_ct over the finished responses.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import requests


class ServerError(RuntimeError):
    """A server that failed to start, hung, or died; the message carries its log tail."""


class ServerLost(ServerError):
    """A request that a server never answered: it timed out, or the connection failed or dropped (the server hangs or
    died). An error status is not one: the server is up and would answer the same request the same way."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    def __init__(self, command: list[str], port: int, log_path: Path, startup_timeout: float, env: dict | None = None):
        self.command, self.port, self.log_path = command, port, Path(log_path)
        self.startup_timeout = startup_timeout
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.launched_at: float | None = None  # time.monotonic() at `launch`
        self.launched_wall: float | None = None  # and time.time()
        self.healthy_at: float | None = None  # time.monotonic() when it first answered /health
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "ServerProcess":
        """Starts the server, unless `launch` already did, and waits until it is healthy."""
        if self.proc is None:
            self.launch()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> "ServerProcess":
        """Starts the server's process and returns at once (`with` then waits until it is healthy)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log.write(("$ " + " ".join(self.command) + "\n").encode())
        self._log.flush()
        self.launched_at, self.launched_wall = time.monotonic(), time.time()
        try:
            self.proc = subprocess.Popen(
                self.command,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(self.env or {})},
            )
        except OSError as exc:
            self._log.close()
            raise ServerError(f"cannot start {self.command[0]!r}: {exc}") from None
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def fail(self, what: str, kind: type[ServerError] = ServerError) -> ServerError:
        return kind(f"{what}\n--- server log tail ({self.log_path}) ---\n{log_tail(self.log_path)}")

    def wait_healthy(self) -> None:
        """Returns once the server answers /health (`healthy_at`: when it first did, time.monotonic())."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise self.fail(f"server exited with code {self.proc.returncode} before becoming healthy")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.healthy_at = self.healthy_at or time.monotonic()
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise self.fail(f"server not healthy after {self.startup_timeout:.0f} s (serve.startup_timeout_s)")

    def stop(self, grace: float = 10.0) -> None:
        """Stops the server's whole process group: SIGTERM, then SIGKILL after `grace` seconds."""
        if self.proc is None:
            return
        try:
            pgid = os.getpgid(self.proc.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is not None:
            _killpg(pgid, signal.SIGTERM)
            _killpg(pgid, signal.SIGCONT)  # a stopped (hung) member takes its SIGTERM now, not at the SIGKILL
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _killpg(pgid, signal.SIGKILL)
            _killpg(pgid, signal.SIGKILL)  # anything the leader left behind in its group
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def post_json(
    server: ServerProcess, path: str, payload: dict[str, Any], timeout: float, setting: str = "serve.request_timeout_s"
) -> Any:
    """POSTs to the server, its JSON answer with the request's `latency_s` (a batch's list of answers without it); a
    timeout or a dropped connection raises ServerLost, an error status ServerError, with the server's log tail.
    `setting` names the timeout's config key in the message."""
    started = time.perf_counter()
    try:
        r = requests.post(f"{server.url}{path}", json=payload, timeout=timeout)
    except requests.Timeout:
        raise server.fail(f"request timed out after {timeout:g} s ({setting}): the server hangs", ServerLost) from None
    except requests.RequestException as exc:
        state = "died" if not server.alive() else "dropped the connection"
        raise server.fail(f"server {state} mid-request ({type(exc).__name__})", ServerLost) from None
    if r.status_code != 200:
        raise server.fail(f"{path} answered {r.status_code}: {r.text[:500]}")
    body = r.json()
    if isinstance(body, dict):  # a batch's answer is a list of them, one per prompt
        body["latency_s"] = time.perf_counter() - started
    return body


def generate(server: ServerProcess, prompt: list[int], max_new_tokens: int, timeout: float) -> dict[str, Any]:
    """One greedy request through SGLang's native /generate (the reference engine speaks it too)."""
    payload = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    return post_json(server, "/generate", payload, timeout)


def benchmark(
    server: ServerProcess,
    prompts: list[list[int]],
    max_new_tokens: int,
    concurrency: int,
    timeout: float,
    request: Callable[..., dict[str, Any]] = generate,
) -> dict[str, Any]:
    """One pass over the prompt set, `concurrency` requests in flight; `request(server, prompt, max_new_tokens,
    timeout)` sends one in the engine's API (SGLang's /generate by default; vLLM's: engines/vllm/cli.py)."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        responses = list(pool.map(lambda p: request(server, p, max_new_tokens, timeout), prompts))
    wall = time.perf_counter() - started
    completion = sum(r["meta_info"]["completion_tokens"] for r in responses)
    verify = [r["meta_info"].get("spec_verify_ct") for r in responses]
    latencies = [r["latency_s"] for r in responses]
    return {
        "concurrency": concurrency,
        "requests": len(responses),
        "completion_tokens": completion,
        "wall_s": wall,
        "output_tok_s": completion / wall,
        "latency_mean_s": statistics.mean(latencies),
        "latency_p50_s": statistics.median(latencies),
        "latency_max_s": max(latencies),
        # Σ completion_tokens / Σ spec_verify_ct over the finished responses (a response that ended on its
        # prefill token has no verify pass); None for a server that does not speculate.
        "accept_length": completion / sum(v or 0 for v in verify) if any(verify) else None,
        "output_ids": [r["output_ids"] for r in responses],
    }


def server_info(server: ServerProcess) -> dict[str, Any]:
    return requests.get(f"{server.url}/server_info", timeout=10).json()


def flush_cache(server: ServerProcess) -> None:
    requests.post(f"{server.url}/flush_cache", timeout=30)


# ------------------------------------------------------------------------- token ids from any serving endpoint


class EndpointError(RuntimeError):
    """An endpoint that cannot be reached, or that answers without the token ids asked for."""


# What each API takes and returns for token ids (checked in sglang 0.5.23's http_server.py, tokenizer_manager.py and
# entrypoints/openai/protocol.py; vLLM's CompletionRequest has the same `return_token_ids` and choice `token_ids`):
#   generate      SGLang's native POST /generate {"input_ids": [...], "sampling_params": {...}} -> top-level
#                 "output_ids", the generated ids including the stop token that ended them (finished_len = match + 1)
#   completions   OpenAI POST /v1/completions {"prompt": [ids], "return_token_ids": true, ...} -> choices[0].token_ids
#                 (SGLang fills it from the same output_ids); "model" is the endpoint's first /v1/models entry


def output_ids(
    url: str, prompt: list[int], sampling: dict[str, Any], api: str, timeout: float, model: str | None = None
) -> list[int]:
    """The token ids an endpoint generates after `prompt`, as it returns them (never re-tokenised text).

    `sampling`: max_new_tokens, temperature, stop_token_ids and, optionally, sampling_seed and top_p, in SGLang's
    names; the completions API gets them in OpenAI's (max_tokens, seed, top_p)."""
    if api == "generate":
        path, payload = "/generate", {"input_ids": prompt, "sampling_params": sampling}
    elif api == "completions":
        path = "/v1/completions"
        payload = {
            "model": model,
            "prompt": prompt,
            "max_tokens": sampling["max_new_tokens"],
            "temperature": sampling["temperature"],
            "stop_token_ids": sampling.get("stop_token_ids"),
            "seed": sampling.get("sampling_seed"),
            "top_p": sampling.get("top_p", 1.0),
            "return_token_ids": True,
        }
    else:
        raise ValueError(f"api={api!r}: expected 'generate' or 'completions'")
    try:
        r = requests.post(url.rstrip("/") + path, json=payload, timeout=timeout)
    except requests.Timeout:
        raise EndpointError(f"{url}{path}: no answer within {timeout:.0f} s") from None
    except requests.RequestException as exc:
        raise EndpointError(f"{url}{path}: {type(exc).__name__} ({exc})") from None
    if r.status_code != 200:
        raise EndpointError(f"{url}{path} answered {r.status_code}: {r.text[:500]}")
    try:
        body = r.json()
        ids = body["output_ids"] if api == "generate" else body["choices"][0]["token_ids"]
    except (ValueError, KeyError, IndexError, TypeError):
        wanted = "a top-level 'output_ids'" if api == "generate" else "choices[0].token_ids (return_token_ids)"
        raise EndpointError(f"{url}{path}: the answer has no {wanted}: {r.text[:300]}") from None
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise EndpointError(f"{url}{path}: expected a list of token ids, got {str(ids)[:200]}")
    return ids


def check_endpoint(url: str, api: str, timeout: float) -> str | None:
    """Raises EndpointError unless the endpoint answers: GET /health for the generate API, GET /v1/models for the
    completions API, whose first model id is returned (the completions requests name it)."""
    path = "/health" if api == "generate" else "/v1/models"
    try:
        r = requests.get(url.rstrip("/") + path, timeout=timeout)
    except requests.RequestException as exc:
        raise EndpointError(f"GET {url}{path}: {type(exc).__name__} ({exc})") from None
    if r.status_code != 200:
        raise EndpointError(f"GET {url}{path} answered {r.status_code}: {r.text[:300]}")
    if api == "generate":
        return None
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise EndpointError(f"GET {url}{path}: no model listed ({r.text[:300]})") from None

"""SGLang's capture for the extract stage and the capture service (train.states=stream): two servers of the target
kept up for a task, side by side on its devices, asked for the same sequences at once.

    aux server     SGLang's capture mode (`--enable-return-aux-hidden-states`, EAGLE-3's ids in SGLang's rule):
                   its /generate answers each prompt's aux states, concatenated in id order
    final server   `--enable-return-hidden-states`: its /generate answers what the target's head reads, the final
                   norm's output (the post_norm teacher)

Two, because SGLang 0.5.23 answers the aux states *in place of* the final ones once capture mode is on (the help of
`--enable-return-aux-hidden-states`, sglang/srt/arg_groups/fields/exec_.py), and its capture hooks take a decoder
layer's *input* (`LlamaModel.forward`, `DeepseekV2Model.forward`), so no id captures the last layer's output: the
teacher comes from the second server, already normed, and a pre_norm teacher cannot come from SGLang at all. Its
capture mode refuses negative ids (validation_hook.py `_handle_aux_hidden_state_capture`), so where SGLang's rule
names the embedding output with id -1 (the Llama loop) it is computed from the checkpoint's embedding table, as
vLLM's DeepSeek extraction computes it (orchestrator/states/assemble.py); where the rule names it with id 0 (the
DeepSeek/Kimi loop with the first-id rule) SGLang captures it.

Each request is one batch of `extract.batch_size` sequences, one new token each (`max_new_tokens=1`): the answer is
the prompt's states alone. They come back as JSON numbers, exact for float32 and bfloat16 alike (each a double that
holds the tensor's value), but at several times the bytes of the tensors: an engine for targets whose states fit a
JSON body, not for Kimi-K2.5's (docs/engines.md#sglang-as-a-capture-engine)."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from orchestrator import families
from orchestrator import layers as layer_contract
from orchestrator.artifacts import ArtifactError
from orchestrator.engines import client
from orchestrator.engines.sglang import cli
from orchestrator.layers import LayerContractError
from orchestrator.states.assemble import Assembler
from orchestrator.states.shards import pack
from orchestrator.targets import load_head_tensors, load_tokenizer


def capture_plan(cfg, layers: list[int]) -> tuple[list[int], bool]:
    """The ids SGLang's capture mode is started with for the canonical `layers`, in its rule for the target's family
    at serve.sglang_version, and whether the embedding output (-1) is computed from the checkpoint's table instead
    (its id would be negative, which capture mode refuses). A LayerContractError says why where neither works."""
    from orchestrator.engines import to_engine_ids

    t, version = cfg.target, cfg.serve.sglang_version
    ids = to_engine_ids("sglang", layers, t.num_hidden_layers, t.family, version)
    if min(ids) >= 0:
        return ids, False
    if not families.FAMILIES[t.family].embedding_lookup:
        raise LayerContractError(
            f"SGLang's {t.family} rule names the embedding output with id -1, which its capture mode refuses, and this "
            "family's embedding output is not its table's rows as stored, so the project cannot compute it either: "
            "start aux_layers with layer 0 or above"
        )
    rest = [k for k in layers if k != layer_contract.EMBEDDING]
    if not rest:
        raise LayerContractError(
            "aux_layers=[-1] through SGLang's capture mode: the embedding output is computed, and nothing is left "
            "for SGLang to capture; extract with extract.engine=hf"
        )
    return to_engine_ids("sglang", rest, t.num_hidden_layers, t.family, version), True


class SGLangCapture:
    """The extract task's capture (`start`, `shard`, `close`) and a capture service's (`states`, `close`) through the
    two servers, up once this is made. A server that does not come up within extract.startup_timeout_s fails the
    task naming its log. A batch that a server never answers (not within extract.request_timeout_s, or its
    connection lost: it hangs or died) stops both servers and starts both again, and the batch is asked again, up
    to extract.engine_restarts times in the task; then the task fails naming the log. The servers keep nothing
    between requests (`--disable-radix-cache`), so a batch asked again is computed anew. A batch a server answers
    with an error fails the task at once (it would answer the same again)."""

    model = None

    def __init__(self, cfg, target_path: Path, layers: list[int], compute, logs: Path, start: bool = True):
        self.cfg, self.layers = cfg, list(layers)
        self.tokenizer = load_tokenizer(target_path, cfg.target.trust_remote_code, cfg.data.chat_template)
        self.ids, computed = capture_plan(cfg, self.layers)
        embed = None
        if computed:
            embed = load_head_tensors(target_path, cfg.target.family, ("embed",), as_stored=True)["embed"]
        self.assemble = Assembler(cfg.extract.dtype, None, 1e-6, embed)
        e = cfg.extract
        self.gpus = sum(d.type == "cuda" for d in compute.devices)
        from orchestrator.compute import resolve_precision

        dtype = resolve_precision(e.precision, self.gpus)
        self.commands = {
            name: cli.capture_command(
                cfg, str(target_path), ids, client.free_port(), python=e.python, gpus=self.gpus, dtype=dtype
            )
            for name, ids in (("aux", self.ids), ("final", None))
        }
        self.logs, self.servers = Path(logs), {}
        self.restarts = self.restarts_left = e.engine_restarts
        self._stack = contextlib.ExitStack()
        if start:
            self.open()

    def open(self) -> None:
        """Both servers up, started together (each loads the target); either failing stops both."""
        e = self.cfg.extract
        servers = {
            name: client.ServerProcess(
                command,
                int(command[command.index("--port") + 1]),
                self.logs / f"sglang_{name}_server.log",
                e.startup_timeout_s,
                cli.gpu_env(self.gpus),
            )
            for name, command in self.commands.items()
        }
        with ThreadPoolExecutor(len(servers)) as pool:
            started = {name: pool.submit(server.__enter__) for name, server in servers.items()}
        try:
            for name, future in started.items():
                self.servers[name] = self._stack.enter_context(_Started(future.result()))
        except BaseException:  # one that came up beside one that failed is stopped too
            for future in started.values():
                if future.exception() is None:
                    future.result().stop()
            self.close()
            raise
        for name, server in self.servers.items():
            print(f"[sglang] {name} server: {' '.join(self.commands[name])} (log {server.log_path})", flush=True)

    def states(self, rendered) -> list:
        """The sequences' `SequenceStates`: each batch asked of both servers at once."""
        out, size = [], max(1, self.cfg.extract.batch_size)
        with ThreadPoolExecutor(2) as pool:
            for i in range(0, len(rendered), size):
                batch = rendered[i : i + size]
                aux, final = self._ask_both(pool, [list(r.input_ids) for r in batch])
                for r, a, f in zip(batch, aux, final, strict=True):
                    out.append(self.assemble.sequence(r, a, f, where="SGLang's capture"))
        return out

    def _ask_both(self, pool: ThreadPoolExecutor, prompts: list[list[int]]) -> list[list[torch.Tensor]]:
        """The batch's states from the aux and the final server, through as many restarts as are left."""
        while True:
            asked = [pool.submit(self._ask, name, prompts) for name in ("aux", "final")]
            try:
                return [future.result() for future in asked]
            except client.ServerLost as lost:
                self._restart(lost, asked)

    def _restart(self, lost: client.ServerLost, asked: list) -> None:
        """Both servers stopped (the other one's request ends with them) and, while restarts are left, both started
        again; else the task fails with what was lost."""
        self.close()
        wait(asked)
        what = str(lost).splitlines()[0]
        if not self.restarts_left:
            raise client.ServerError(
                f"SGLang's capture lost a batch ({what}) with its restarts used up "
                f"(extract.engine_restarts={self.restarts})\n{lost}"
            ) from None
        self.restarts_left -= 1
        for command in self.commands.values():  # fresh ports: a stopped server's socket may linger on its own
            command[command.index("--port") + 1] = str(client.free_port())
        print(
            f"[extract] WARNING: SGLang's capture lost a batch ({what}); starting both servers again (restart "
            f"{self.restarts - self.restarts_left} of extract.engine_restarts={self.restarts}; logs in {self.logs})",
            flush=True,
        )
        self.open()

    def _ask(self, name: str, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Each prompt's states from one server: [length, width] float32, exactly as SGLang computed them."""
        server = self.servers[name]
        payload = {
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_hidden_states": True,
        }
        answers = client.post_json(
            server, "/generate", payload, self.cfg.extract.request_timeout_s, "extract.request_timeout_s"
        )
        answers = answers if isinstance(answers, list) else [answers]
        if len(answers) != len(prompts):
            raise server.fail(f"SGLang's {name} server answered {len(answers)} of {len(prompts)} prompts")
        where = f"SGLang's {name} server ({server.log_path})"
        return [prompt_states(a, len(p), where) for a, p in zip(answers, prompts, strict=True)]

    def start(self, split: str, index: int) -> None:
        pass

    def shard(self, split: str, index: int, rendered) -> dict[str, torch.Tensor]:
        return pack(self.states(rendered))

    def close(self) -> None:
        self._stack.close()
        self.servers = {}


class _Started:
    """A server already up, as a context that stops it."""

    def __init__(self, server: client.ServerProcess):
        self.server = server

    def __enter__(self) -> client.ServerProcess:
        return self.server

    def __exit__(self, *exc) -> None:
        self.server.stop()


def prompt_states(answer: dict, length: int, where: str) -> torch.Tensor:
    """A /generate answer's states of its prompt: `meta_info.hidden_states` holds one [tokens, width] list per
    prefill chunk (a long prompt may be prefilled in several), then one vector per decoded token but the last."""
    entries = answer.get("meta_info", {}).get("hidden_states")
    if not entries:
        raise ArtifactError(f"{where} answered no hidden states (was it started to return them?)")
    chunks = [torch.tensor(e, dtype=torch.float32) for e in entries if e and isinstance(e[0], list)]
    states = torch.cat(chunks) if chunks else torch.empty(0)
    if states.ndim != 2 or states.shape[0] < length:
        raise ArtifactError(f"{where} answered the states of {states.shape[0] if states.ndim else 0} tokens for a "
                            f"prompt of {length}")  # fmt: skip
    return states[:length]

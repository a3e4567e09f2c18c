"""The target's own responses to the data set's prompts (SpecForge's regeneration), so the draft learns the text the
target writes when served. Extraction takes its training sequences from here.

    sequences   a split's training sequences: the conversations rendered, or (data.regenerate.enabled) regenerated
    regenerate  the target's responses to any list of conversations (a split, a shard, a rank's slice), by
                data.regenerate.engine:
                  hf      HF `generate` in this process, left-padded batches of `batch_size` prompts
                  server  a serving endpoint, `concurrency` requests in flight: SGLang's /generate or an
                          OpenAI-compatible /v1/completions (data.regenerate.api), at data.regenerate.url or on a
                          server started with the serve stage's launcher (`Endpoint`)
                  one_pass  vLLM's extractor (extract.engine=vllm) answers and captures in one request; the
                          extract stage does it (`one_pass_rendered` cuts its sequences)

Either way a sequence is prompt ids + the generated ids as the engine returns them (never re-tokenised text), cut
after the first end token and at data.max_seq_len; the loss mask covers the generated ids.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from orchestrator import engines
from orchestrator.config import RootConfig
from orchestrator.data import Rendered, before_first_answer, chat_prompt_ids, render, tools_of, turns_after_answers
from orchestrator.engines import client
from orchestrator.targets import end_token_ids, template_source


class RegenerateError(RuntimeError):
    """Regeneration that cannot run: an endpoint that is unreachable or answers wrongly, or no model for hf."""


def sequences(
    conversations: list,
    split: str,
    cfg: RootConfig,
    tokenizer,
    *,
    model=None,
    log_dir: Path | None = None,
    endpoint: "Endpoint | None" = None,
) -> list[Rendered]:
    """A split's training sequences: the data set's conversations rendered, or, with `data.regenerate.enabled`,
    the target's own responses to their prompts (seeded by the run's seed and the split)."""
    if not cfg.data.regenerate.enabled:
        source = template_source(Path(tokenizer.name_or_path), cfg.data.chat_template)
        return [render(tokenizer, c, cfg.data.max_seq_len, source) for c in conversations]
    split_seed = cfg.seed + (0 if split == "train" else 1)
    return regenerate(
        conversations,
        cfg,
        tokenizer,
        split_seed,
        model=model,
        log_dir=log_dir,
        endpoint=endpoint,
        desc=f"regenerate {split}",
    )


def regenerate(
    conversations: list,
    cfg: RootConfig,
    tokenizer,
    seed: int,
    *,
    model=None,
    log_dir: Path | None = None,
    endpoint: "Endpoint | None" = None,
    desc: str = "regenerate",
) -> list[Rendered]:
    """The target's responses to each conversation's prompt (its turns before the first answer), one `Rendered`
    per conversation, in order.

    engine=hf needs `model`. engine=server uses `endpoint` when given (one server for many calls), else opens one
    for this call: `data.regenerate.url`, or a server the serve stage's launcher starts (its log in `log_dir`)
    and stops on return."""
    r = cfg.data.regenerate
    max_len = cfg.data.max_seq_len
    if r.engine == "one_pass":
        raise RegenerateError(
            "data.regenerate.engine=one_pass regenerates inside vLLM's capture (extract.engine=vllm), not here"
        )
    if r.engine == "hf" and model is None:
        raise RegenerateError(
            "data.regenerate.engine=hf generates with the target in this process, but no model was given"
        )

    def answer(prompts: list[list[int]], turn: int, where) -> list[Rendered]:
        turn_desc = desc if turn == 0 else f"{desc} turn {turn + 1}"
        turn_seed = seed + 1_000_003 * turn
        if r.engine == "hf":
            return hf_responses(model, tokenizer, prompts, max_len, r, turn_seed, turn_desc)
        return server_responses(where, prompts, end_token_ids(tokenizer), max_len, r, turn_seed, turn_desc)

    if r.engine == "hf" or endpoint is not None:
        return turn_by_turn(conversations, tokenizer, r.turns, max_len, lambda p, t: answer(p, t, endpoint))
    with Endpoint(cfg, log_dir) as own:
        return turn_by_turn(conversations, tokenizer, r.turns, max_len, lambda p, t: answer(p, t, own))


def turn_by_turn(conversations: list, tokenizer, turns: int | None, max_len: int, answer) -> list[Rendered]:
    """Each conversation's assistant turns answered in order, `turns` of them at most (None: all), as SpecForge's
    `scripts/regenerate_train_data.py` does: the first answers the turns before the conversation's first assistant
    turn; each later one the conversation so far, the target's earlier answers in place of the data set's, and the
    data set's turns up to the next assistant turn (`turns_after_answers`). An earlier answer goes back as a chat
    client sends it: its text after the thinking (`</think>`), which Kimi's template, like the regeneration scripts,
    drops from history turns. `answer(prompts, turn)` answers one turn's prompts together (one `generate` batch, or
    concurrent requests), so a round costs one pass of the engine.

    One `Rendered` per answered turn, a conversation's in order: the prompt as the template renders it at that turn
    and the answer as the target writes it, thinking included, its tokens the loss tokens. Turns are not merged into
    one sequence: a template that rewrites history (Kimi's drops earlier thinking) makes a later prompt differ from
    the earlier sequence it would extend, and each sequence is what serving sees at its turn."""
    histories = [before_first_answer(c) for c in conversations]
    following = [turns_after_answers(c) for c in conversations]
    out: list[list[Rendered]] = [[] for _ in conversations]
    active, turn = list(range(len(conversations))), 0
    while active:
        prompts = [chat_prompt_ids(tokenizer, histories[i], tools_of(conversations[i]), max(1, max_len - 1))
                   for i in active]  # fmt: skip
        answered = answer(prompts, turn)
        turn += 1
        going = []
        for i, prompt, seq in zip(active, prompts, answered, strict=True):
            out[i].append(seq)
            if (turns is None or turn < turns) and len(following[i]) >= turn:
                histories[i] = [*histories[i], answer_message(tokenizer, seq.input_ids[len(prompt) :]),
                                *following[i][turn - 1]]  # fmt: skip
                going.append(i)
        active = going
    return [seq for seqs in out for seq in seqs]


def answer_message(tokenizer, response: list[int]) -> dict:
    """An answer as the next turn's history: its text without the end token, and without the thinking before
    `</think>` where it has one."""
    if response and response[-1] in end_token_ids(tokenizer):
        response = response[:-1]
    text = tokenizer.decode(response, skip_special_tokens=False)
    return {"role": "assistant", "content": text.split("</think>", 1)[1].strip() if "</think>" in text else text}


def one_pass_rendered(prompt: list[int], generated: list[int], max_new_tokens: int, ends, max_len: int) -> Rendered:
    """The sequence of a one-pass capture (data.regenerate.engine=one_pass): the prompt and the response as a
    separate regeneration cuts it (`max_new_tokens`, the end token, data.max_seq_len), from `generated`, which
    runs one token past the budget. The engine captures the states of the prompt and of every generated token
    but the last (never an input), so a response that ends the generation, at its end token, loses that token:
    the teacher's distribution at the token before it, which predicts the end, is kept."""
    seq = _rendered(prompt, generated[:max_new_tokens], ends, max_len)
    if len(seq.input_ids) > len(prompt) + len(generated) - 1:
        return Rendered(seq.input_ids[:-1], seq.loss_mask[:-1])
    return seq


def _rendered(prompt: list[int], response: list[int], ends: list[int], max_len: int) -> Rendered:
    """The prompt and the response through its first end token (`end_token_ids`), within `max_len`; the loss
    covers the response."""
    response = through_first_end(response, ends)[: max_len - len(prompt)]
    return Rendered(list(prompt) + response, [0] * len(prompt) + [1] * len(response))


def through_first_end(response: list[int], ends) -> list[int]:
    """`response` through its first end token (`end_token_ids`), whole where it has none: an answer as its
    server returns it, which stops there."""
    end = next((i for i, token in enumerate(response) if token in ends), None)
    return list(response) if end is None else list(response[: end + 1])


def hf_responses(model, tokenizer, prompts: list[list[int]], max_len: int, r, seed: int, desc: str) -> list[Rendered]:
    """HF `generate` over left-padded batches of `r.batch_size` prompts: greedy at temperature 0, seeded sampling
    above it."""
    import torch
    from tqdm import tqdm

    ends = end_token_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (ends[0] if ends else 0)
    generator_seed = torch.Generator().manual_seed(seed)
    out: list[Rendered] = []
    starts = range(0, len(prompts), r.batch_size)
    for start in tqdm(starts, desc=desc, unit="batch", total=len(starts)):
        batch = prompts[start : start + r.batch_size]
        width = max(len(p) for p in batch)
        new_tokens = min(r.max_new_tokens, max_len - min(len(p) for p in batch))
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):  # left padding: every row's next token is at the same column
            ids[row, width - len(p) :] = torch.tensor(p)
            attn[row, width - len(p) :] = 1
        sampling = (
            {"do_sample": False}
            if r.temperature == 0
            else {"do_sample": True, "temperature": r.temperature, "top_k": 0, "top_p": r.top_p}
        )
        if r.temperature > 0:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator_seed)))
        with torch.no_grad():
            device = model.get_input_embeddings().weight.device  # a spread target takes its inputs on its first GPU
            generated = model.generate(
                input_ids=ids.to(device),
                attention_mask=attn.to(device),
                max_new_tokens=new_tokens,
                pad_token_id=pad,
                eos_token_id=ends or None,
                **sampling,
            )[:, width:]
        out += [_rendered(p, generated[row].tolist(), ends, max_len) for row, p in enumerate(batch)]
    return out


def server_responses(
    endpoint: "Endpoint", prompts: list[list[int]], ends: list[int], max_len: int, r, seed: int, desc: str
) -> list[Rendered]:
    """One request per prompt, `r.concurrency` in flight, each asking for at most `r.max_new_tokens` (and no more
    than `max_len` allows) and stopping at its end tokens (`end_token_ids`). At temperature 0 the engine decodes
    greedily; above it each request carries a seed drawn from `seed` (SGLang applies it only when launched with
    --enable-deterministic-inference)."""
    from tqdm import tqdm

    url, model_name = endpoint.open()
    seeds = random.Random(seed).sample(range(2**31), len(prompts)) if r.temperature > 0 else [None] * len(prompts)

    def ask(i: int) -> list[int]:
        sampling = {"max_new_tokens": min(r.max_new_tokens, max_len - len(prompts[i])), "temperature": r.temperature}
        if ends:
            sampling["stop_token_ids"] = list(ends)
        if seeds[i] is not None:
            sampling["sampling_seed"] = seeds[i]
            sampling["top_p"] = r.top_p
        try:
            return client.output_ids(url, prompts[i], sampling, r.api, endpoint.request_timeout, model_name)
        except client.EndpointError as exc:
            raise endpoint.fail(f"prompt {i}: {exc}") from None

    pool = ThreadPoolExecutor(max_workers=r.concurrency, thread_name_prefix="regenerate")
    try:
        futures = [pool.submit(ask, i) for i in range(len(prompts))]
        responses = [f.result() for f in tqdm(futures, desc=desc, unit="prompt")]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a failed request stops the ones not yet sent
    return [_rendered(p, response, ends, max_len) for p, response in zip(prompts, responses)]


class Endpoint:
    """Where engine=server sends its requests: `data.regenerate.url`, or, when that is null, the target served by
    the serve stage's launcher (`engines.server_command`: SGLang's command or the reference engine's, as
    serve.* configures it, without a draft) on a free port of 127.0.0.1, started on first use and stopped on close.

    Open it around several `regenerate` calls to start one server for all of them."""

    def __init__(self, cfg: RootConfig, log_dir: Path | None = None):
        self.cfg = cfg
        self.log_dir = Path(log_dir) if log_dir is not None else cfg.outputs / "regenerate"
        self.request_timeout = cfg.serve.request_timeout_s
        self.server: client.ServerProcess | None = None
        self._opened: tuple[str, str | None] | None = None

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        self._opened = None

    def open(self) -> tuple[str, str | None]:
        """(url, model name for the completions API), starting the server on first use."""
        if self._opened is not None:
            return self._opened
        r = self.cfg.data.regenerate
        if r.url is None:
            url = self._start()
        else:
            url = r.url.rstrip("/")
        try:
            model_name = client.check_endpoint(url, r.api, timeout=min(30.0, self.request_timeout))
        except client.EndpointError as exc:
            raise self.fail(f"the endpoint does not answer: {exc}") from None
        self._opened = (url, model_name)
        return self._opened

    def command(self, port: int) -> list[str]:
        """The serve stage's launch command for the target alone (no draft: no speculative arguments)."""
        from orchestrator.engines import server_command
        from orchestrator.targets import ensure_target

        return server_command(self.cfg, ensure_target(self.cfg, progress=False), None, port)

    def _start(self) -> str:
        s = self.cfg.serve
        engine = engines.get(s.engine, engines.SERVE)
        port = client.free_port()
        command = self.command(port)
        engine.check_command(self.cfg, command)
        print(f"[regenerate] serving the target for data.regenerate.engine=server: {' '.join(command)}")
        log = self.log_dir / "regenerate_server.log"
        self.server = client.ServerProcess(command, port, log, s.startup_timeout_s, env=engine.server_env(self.cfg))
        self.server.__enter__()
        return self.server.url

    def fail(self, what: str) -> Exception:
        r = self.cfg.data.regenerate
        if self.server is not None:
            return self.server.fail(
                f"data.regenerate.engine=server, the server started with serve.engine={self.cfg.serve.engine} "
                f"(data.regenerate.url=null, api={r.api}): {what}"
            )
        return RegenerateError(
            f"data.regenerate.url={r.url!r} (data.regenerate.api={r.api}): {what}. Start a server there that speaks "
            f"{'SGLang /generate' if r.api == 'generate' else 'OpenAI /v1/completions with return_token_ids'}, or set "
            "data.regenerate.url=null to start one with the serve stage's launcher"
        )


def regenerated_path(folder: Path, split: str, index: int) -> Path:
    """Where an extraction (or the shared store of the target's answers, `pipeline.make_plan`) keeps a shard's
    regenerated sequences."""
    return Path(folder) / split / f"regenerated_{index:05d}.safetensors"


def keep_regenerated(path: Path, rendered: list[Rendered]) -> None:
    """A shard's regenerated sequences in `path` (input_ids int32[T], seq_lens and response_lens int32[n]), written
    whole or not at all, so that a restarted extraction reads them back (`read_regenerated`) instead of generating
    them again."""
    import torch
    from safetensors.torch import save_file

    from orchestrator.artifacts import atomic_path

    tensors = {
        "input_ids": torch.tensor([t for r in rendered for t in r.input_ids], dtype=torch.int32),
        "seq_lens": torch.tensor([len(r.input_ids) for r in rendered], dtype=torch.int32),
        "response_lens": torch.tensor([sum(r.loss_mask) for r in rendered], dtype=torch.int32),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))


def read_regenerated(path: Path) -> list[Rendered]:
    """The sequences `keep_regenerated` wrote: each response's tokens are the loss tokens."""
    import torch
    from safetensors.torch import load_file

    kept = load_file(str(path))
    offsets = [0] + torch.cumsum(kept["seq_lens"].long(), 0).tolist()
    rendered = []
    for a, b, n in zip(offsets[:-1], offsets[1:], kept["response_lens"].tolist()):
        ids = kept["input_ids"][a:b].tolist()
        rendered.append(Rendered(ids, [0] * (len(ids) - n) + [1] * n))
    return rendered

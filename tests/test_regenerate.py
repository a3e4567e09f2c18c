"""Regeneration through a serving endpoint (data.regenerate.engine=server): the reference engine on the tiny target,
launched by the serve stage's launcher or given as a URL, returns token for token the ids HF `generate` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import compose_config, copy_cache
from safetensors.torch import load_file
from test_config import compose_root

from orchestrator.config import ConfigError
from orchestrator.data import conversations, prompt_ids
from orchestrator.engines import client, server_command
from orchestrator.engines.sglang import cli as sglang_engine
from orchestrator.pipeline import make_plan, run_pipeline, stage_keys
from orchestrator.regenerate import Endpoint, RegenerateError, regenerate
from orchestrator.targets import ensure_target, load_target

# Short responses keep a pass to seconds; at 42 tokens some responses are cut by max_seq_len, others by max_new_tokens.
SHORT = ("data.regenerate.max_new_tokens=24", "data.max_seq_len=42")


@pytest.fixture(scope="module")
def tiny(tiny_config):
    """(cfg, model, tokenizer, prompts' conversations, the HF engine's greedy sequences one prompt at a time)."""
    cfg = tiny_config(*SHORT, "data.regenerate.batch_size=1")
    model, tokenizer = load_target(ensure_target(cfg, progress=False))
    _, val = conversations(cfg.data, cfg.seed)
    convs = val[:6]
    hf = regenerate(convs, cfg, tokenizer, cfg.seed, model=model)
    return cfg, model, tokenizer, convs, hf


def _pairs(seqs):
    return [(s.input_ids, s.loss_mask) for s in seqs]


def test_the_comparison_covers_both_budgets(tiny):
    """The comparisons below mean something: prompts of several lengths, responses cut by data.max_seq_len and by
    max_new_tokens. (The FAST tiny target, trained for 60 steps, does not reach its end token within 24 tokens;
    the cut after it is the same code for both engines, `test_responses_end_after_the_first_end_token`.)"""
    cfg, _, tokenizer, convs, hf = tiny
    prompts = [prompt_ids(tokenizer, c, cfg.data.max_seq_len - 1) for c in convs]
    assert len({len(p) for p in prompts}) > 1
    assert all(
        s.input_ids[: len(p)] == p and s.loss_mask == [0] * len(p) + [1] * (len(s.input_ids) - len(p))
        for s, p in zip(hf, prompts)
    )
    lengths = [len(s.input_ids) for s in hf]
    responses = [len(s.input_ids) - len(p) for s, p in zip(hf, prompts)]
    assert cfg.data.max_seq_len in lengths, "no response cut by data.max_seq_len"
    assert 24 in responses and len(set(responses)) > 1, "no response cut by data.regenerate.max_new_tokens"


def test_responses_end_after_the_first_end_token():
    from orchestrator.regenerate import _rendered

    eos = 2
    cut = _rendered([1, 7], [5, 6, eos, 9, eos], [eos], max_len=10)
    assert (cut.input_ids, cut.loss_mask) == ([1, 7, 5, 6, eos], [0, 0, 1, 1, 1])
    assert _rendered([1, 7], [5, 6, 8], [eos], max_len=4).input_ids == [1, 7, 5, 6]
    # any of the end tokens ends it (the tokenizer's eos, the generation config's): the first one reached
    assert _rendered([1, 7], [5, 3, 6, eos], [eos, 3], max_len=10).input_ids == [1, 7, 5, 3]


def test_launched_server_returns_the_hf_engines_greedy_ids(tiny, tmp_path):
    """url=null: the serve stage's launcher starts the reference engine (no draft) on a free port, and stops it."""
    cfg, _, tokenizer, convs, hf = tiny
    server_cfg = compose_server(cfg, "data.regenerate.concurrency=3")
    with Endpoint(server_cfg, tmp_path) as endpoint:
        served = regenerate(convs, server_cfg, tokenizer, cfg.seed, endpoint=endpoint)
        process = endpoint.server.proc
        command = endpoint.server.command
        again = regenerate(convs[:2], server_cfg, tokenizer, cfg.seed, endpoint=endpoint)  # the same server, reused
        assert endpoint.server.proc is process
    assert _pairs(served) == _pairs(hf), "the server's greedy ids differ from HF generate's"
    assert _pairs(again) == _pairs(hf[:2])
    assert process.poll() is not None, "the launched server outlived the endpoint"
    assert command[1:3] == ["-m", "orchestrator.engines.reference.server"] and "--draft" not in command
    assert "POST /generate" in (tmp_path / "regenerate_server.log").read_text()


def test_regenerate_without_an_endpoint_starts_and_stops_its_own(tiny, tmp_path):
    cfg, _, tokenizer, convs, hf = tiny
    server_cfg = compose_server(cfg)
    served = regenerate(convs[:3], server_cfg, tokenizer, cfg.seed, log_dir=tmp_path)
    assert _pairs(served) == _pairs(hf[:3])
    log = (tmp_path / "regenerate_server.log").read_text()
    assert log.count("POST /generate") == 3 and "reference engine ready" in log


@pytest.mark.parametrize("api", ["generate", "completions"])
def test_given_url(tiny, tmp_path, api):
    """url given: a server the test starts itself, reached through SGLang's /generate or OpenAI's /v1/completions."""
    cfg, _, tokenizer, convs, hf = tiny
    port = client.free_port()
    command = server_command(cfg, ensure_target(cfg, progress=False), None, port)
    with client.ServerProcess(command, port, tmp_path / "server.log", startup_timeout=120) as server:
        given = compose_server(
            cfg, f"data.regenerate.url={server.url}", f"data.regenerate.api={api}", "data.regenerate.concurrency=4"
        )
        with Endpoint(given, tmp_path / "unused") as endpoint:
            served = regenerate(convs, given, tokenizer, cfg.seed, endpoint=endpoint)
            assert endpoint.server is None, "a given url starts no server"
    assert _pairs(served) == _pairs(hf)
    assert not (tmp_path / "unused").exists()
    path = "POST /generate" if api == "generate" else "POST /v1/completions"
    assert (tmp_path / "server.log").read_text().count(path) == len(convs)


def test_unreachable_url_names_the_key(tiny):
    cfg, _, tokenizer, convs, _ = tiny
    url = f"http://127.0.0.1:{client.free_port()}"  # nothing listens there
    given = compose_server(cfg, f"data.regenerate.url={url}")
    with pytest.raises(RegenerateError) as err:
        regenerate(convs[:1], given, tokenizer, cfg.seed)
    message = str(err.value)
    assert (
        f"data.regenerate.url='{url}'" in message and "does not answer" in message and "ConnectionError" in message
    ), message
    assert "data.regenerate.url=null" in message, "the fix is named"


def test_completions_api_against_a_server_without_it_names_the_key(tiny, tmp_path):
    """An endpoint that answers, but not the API asked for: the reference engine has /v1/models and /v1/completions,
    so point the completions API at a plain HTTP server that has neither."""
    import http.server
    import threading

    cfg, _, tokenizer, convs, _ = tiny
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        given = compose_server(cfg, f"data.regenerate.url={url}", "data.regenerate.api=completions")
        with pytest.raises(RegenerateError) as err:
            regenerate(convs[:1], given, tokenizer, cfg.seed)
    finally:
        httpd.shutdown()
    message = str(err.value)
    assert "data.regenerate.url=" in message and "/v1/models answered 404" in message, message


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["data.regenerate.url=localhost:30000"],
            "data.regenerate.url='localhost:30000': expected the server's base URL",
        ),
        (["data.regenerate.url=http://127.0.0.1:30000/generate"], "without a path"),
        (["data.regenerate.url=http://127.0.0.1:99999"], "data.regenerate.url='http://127.0.0.1:99999'"),
        (["data.regenerate.url=ftp://host:1"], "data.regenerate.url='ftp://host:1'"),
        (
            ["data.regenerate.engine=hf", "data.regenerate.url=http://127.0.0.1:30000"],
            "is an endpoint for data.regenerate.engine=server",
        ),
        (
            ["data.regenerate.engine=vllm"],
            "data.regenerate.engine='vllm': expected one of ('hf', 'server', 'one_pass')",
        ),
        (["data.regenerate.api=chat"], "data.regenerate.api='chat'"),
        (["data.regenerate.concurrency=0"], "data.regenerate.concurrency=0"),
        (["data.regenerate.temperature=0.7"], "the reference engine decodes greedily only"),
        (["data.regenerate.turns=0"], "data.regenerate.turns=0: expected >= 1, or null for every turn"),
        (
            ["extract.engine=vllm", "data.regenerate.engine=one_pass", "data.regenerate.turns=null"],
            "data.regenerate.turns=null with data.regenerate.engine=one_pass",
        ),
    ],
)
def test_bad_regenerate_config_names_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        compose_root(["+experiment=tiny_eagle3", "serve=reference", "data.regenerate.engine=server", *overrides])
    assert fragment in str(err.value), str(err.value)


def test_kimi_regenerates_through_the_sglang_command_without_a_draft(tmp_path):
    """kimi_eagle3 defaults to engine=server; with no url the endpoint runs the serve stage's SGLang command for the
    target alone: tp 8, trust-remote-code, the serve dtype, and no speculative argument."""
    cfg = compose_root(["+experiment=kimi_eagle3"])
    r = cfg.data.regenerate
    assert (r.engine, r.url, r.api) == ("server", None, "generate")
    model = tmp_path / "Kimi-K2.5"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"]}))
    cfg = compose_root(["+experiment=kimi_eagle3", "data.regenerate.enabled=true", f"target.path={model}"])
    command = Endpoint(cfg).command(30000)
    assert command == sglang_engine.launch_command(cfg, str(model), None, 30000)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    assert not [a for a in command if a.startswith("--speculative")], command
    for flag in (
        ["--model-path", str(model)],
        ["--tp-size", "8"],
        ["--trust-remote-code"],
        ["--dtype", "bfloat16"],
        ["--port", "30000"],
    ):
        assert any(command[i : i + len(flag)] == flag for i in range(len(command))), (flag, command)


def test_extraction_with_the_server_engine(tiny_config, tmp_path, monkeypatch):
    """The extract stage end to end with engine=server: its regenerated sequences are the HF engine's."""
    small = ("data.max_train_conversations=6", "data.max_val_conversations=2", "extract.shard_conversations=4")
    cfg = tiny_config("stages=[extract]", "cluster=debug", *SHORT, *small, "data.regenerate.engine=server")
    monkeypatch.chdir(tmp_path)
    summary = run_pipeline(cfg, tmp_path / "run")
    out = Path(summary["stages"]["extract"]["output"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["data"]["regenerate"]["engine"] == "server"
    assert manifest["data"]["responses"] == "regenerated by the target"
    assert (out / "logs" / "rank0" / "regenerate_server.log").exists()  # one server for all the task's shards

    hf_cfg = tiny_config(*SHORT, *small, "data.regenerate.batch_size=1")
    model, tokenizer = load_target(ensure_target(hf_cfg, progress=False))
    train, val = conversations(hf_cfg.data, hf_cfg.seed)
    for split, convs, seed in (("train", train, cfg.seed), ("val", val, cfg.seed + 1)):
        served = []
        for shard in sorted((out / split).glob("regenerated_*.safetensors")):  # greedy: the seed plays no part
            kept = load_file(str(shard))
            lens = kept["seq_lens"].tolist()
            starts = [sum(lens[:i]) for i in range(len(lens))]
            served += [kept["input_ids"][a : a + n].tolist() for a, n in zip(starts, lens)]
        assert served == [s.input_ids for s in regenerate(convs, hf_cfg, tokenizer, seed, model=model)], split
    assert manifest["splits"]["train"]["num_sequences"] == 6


def compose_server(cfg, *overrides):
    """The shared tiny config (the outputs folder of `cfg`) with engine=server on the reference engine."""
    return compose_config(cfg.outputs, "data.regenerate.engine=server", *SHORT, *overrides)


def test_a_one_pass_sequence_is_the_separate_regenerations_but_a_final_token_without_a_state():
    """One pass captures the prompt and every generated token but the last (never an input); generation runs one
    token past data.regenerate.max_new_tokens, so only a response that ends at its end token loses that token."""
    from orchestrator.regenerate import _rendered, one_pass_rendered

    prompt, eos = [1, 2, 3], 9
    ends = [eos]
    cut = one_pass_rendered(prompt, [4, 5, 6, 7], 3, ends, 100)  # cut at the budget: every token has a state
    assert (cut.input_ids, cut.loss_mask) == ([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1])
    assert cut == _rendered(prompt, [4, 5, 6], ends, 100)
    ended = one_pass_rendered(prompt, [4, 5, eos], 3, ends, 100)  # the engine stops at the end token
    assert (ended.input_ids, ended.loss_mask) == ([1, 2, 3, 4, 5], [0, 0, 0, 1, 1])
    assert ended.input_ids == _rendered(prompt, [4, 5, eos], ends, 100).input_ids[:-1]
    short = one_pass_rendered(prompt, [4, 5, 6, 7], 3, ends, 5)  # data.max_seq_len cuts first
    assert (short.input_ids, short.loss_mask) == ([1, 2, 3, 4, 5], [0, 0, 0, 1, 1])


def _talk(*turns: str, tool_call_at: int | None = None) -> list[dict]:
    """A conversation of user and assistant turns in alternation; the assistant turn `tool_call_at` calls a tool."""
    messages = []
    for i, text in enumerate(turns):
        message = {"role": ("user", "assistant")[i % 2], "content": text}
        if i == tool_call_at:
            message["tool_calls"] = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
        messages.append(message)
    return messages


def test_every_turn_is_answered_in_turn_given_the_targets_earlier_answers(tiny, tmp_path):
    """data.regenerate.turns=null answers each assistant turn in order, as SpecForge's regenerate_train_data.py does:
    the second prompt is the first user turn, the target's first answer and the second user turn, rendered by the
    template; each answered turn is one sequence whose answer is HF's greedy continuation of that prompt. turns=2
    stops after two; turns=1 is the first-turn regeneration; an answer that calls a tool ends the conversation
    there. The server engine answers through the same loop, token for token."""
    cfg, model, tokenizer, _, _ = tiny
    from orchestrator.data import chat_prompt_ids
    from orchestrator.regenerate import answer_message, hf_responses

    base = ("data.regenerate.max_new_tokens=24", "data.max_seq_len=160", "data.regenerate.batch_size=2")
    every = compose_config(cfg.outputs, *base, "data.regenerate.turns=null")
    convs = [
        _talk("Say a word.", "Word.", "Another one?", "Yes.", "And a third?", "Done."),
        _talk("Count to three.", "1 2 3", "Now to four."),
        _talk("Call f.", "", "Thanks.", "Sure.", tool_call_at=1),
    ]
    seqs = regenerate(convs, every, tokenizer, cfg.seed, model=model)
    assert len(seqs) == 3 + 2 + 1
    first = regenerate(convs, compose_config(cfg.outputs, *base), tokenizer, cfg.seed, model=model)
    assert _pairs([seqs[0], seqs[3], seqs[5]]) == _pairs(first), "turn 1 is the first-turn regeneration"
    r = every.data.regenerate
    for at, conv, k in ((1, convs[0], 1), (2, convs[0], 2), (4, convs[1], 1)):
        history = conv[:1]
        for j in range(k):  # the target's answers, then the data set's next user turn
            earlier = seqs[at - k + j]
            prompt_len = len(earlier.input_ids) - sum(earlier.loss_mask)
            history += [answer_message(tokenizer, earlier.input_ids[prompt_len:]), conv[2 * j + 2]]
        prompt = chat_prompt_ids(tokenizer, history, None, 159)
        assert seqs[at].input_ids[: len(prompt)] == prompt
        assert sum(seqs[at].loss_mask) == len(seqs[at].input_ids) - len(prompt)
        (alone,) = hf_responses(model, tokenizer, [prompt], 160, r, cfg.seed, "check")
        assert seqs[at].input_ids == alone.input_ids, f"turn {k + 1} is not the target's greedy answer to its prompt"
    assert "Word." not in tokenizer.decode(seqs[1].input_ids), "the data set's answer stayed in the history"
    two = compose_config(cfg.outputs, *base, "data.regenerate.turns=2")
    assert _pairs(regenerate(convs, two, tokenizer, cfg.seed, model=model)) == _pairs(seqs[:2] + seqs[3:])

    server_cfg = compose_config(cfg.outputs, "data.regenerate.engine=server", *base, "data.regenerate.turns=null")
    served = regenerate(convs, server_cfg, tokenizer, cfg.seed, log_dir=tmp_path)
    assert _pairs(served) == _pairs(seqs), "the server's turns differ from HF generate's"
    from orchestrator.pipeline import stage_keys

    keys = {stage_keys(c)["extract"] for c in (every, two, compose_config(cfg.outputs, *base))}
    assert len(keys) == 3, "the turns answered key the extraction"


def test_an_earlier_answer_goes_back_without_its_thinking_as_kimis_template_renders_history(tiny):
    """The next turn's history holds an answer's text after `</think>`, without its end token: what a chat client
    sends back, and what Kimi-K2-Thinking's published template renders for a history turn anyway (`<think></think>`
    and the content). The answered turn's own sequence keeps the thinking as the target wrote it."""
    from orchestrator.regenerate import answer_message

    _, _, tokenizer, _, _ = tiny
    ids = tokenizer.encode("<think>the user wants 42</think>\n42", add_special_tokens=False) + [tokenizer.eos_token_id]
    message = answer_message(tokenizer, ids)
    assert message == {"role": "assistant", "content": "42"}
    assert answer_message(tokenizer, tokenizer.encode("plain", add_special_tokens=False))["content"] == "plain"
    template = (Path(__file__).parent / "data" / "chat_templates" / "Kimi-K2-Thinking.jinja").read_text()
    history = [{"role": "user", "content": "q"}, {**message, "reasoning_content": "the user wants 42"},
               {"role": "user", "content": "again"}]  # fmt: skip
    rendered = tokenizer.apply_chat_template(
        history, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert "<think></think>42" in rendered and "the user wants" not in rendered


def test_an_extraction_of_other_layers_reuses_the_targets_answers(fast_cache, tmp_path, monkeypatch):
    """A second extraction of the same data by the same target, at other layers (a layer search's union) or with
    its train split streamed, reads the answers the first one generated instead of generating them again: the
    regeneration is keyed by what decides the answers alone. A setting that changes them generates again."""
    outputs = copy_cache(fast_cache("extract"), tmp_path / "outputs")
    first_cfg = compose_config(outputs, "cluster=debug", "stages=[extract]")
    first = make_plan(first_cfg, tmp_path / "first")
    generated = []
    monkeypatch.setattr("orchestrator.stages.extract.regenerate", lambda *a, **k: generated.append(a) or [])
    for overrides in (["extract.extra_layers=[5]"], ["train.states=stream"]):
        cfg = compose_config(outputs, "cluster=debug", "stages=[extract]", *overrides)
        plan = make_plan(cfg, tmp_path / "again")
        assert plan.dir("extract") != first.dir("extract") and plan.dir("regenerated") == first.dir("regenerated")
        run_pipeline(cfg, tmp_path / "again")
        assert generated == [], overrides
        for shard in sorted(first.dir("extract").glob("*/shard_*.safetensors")):
            ours = load_file(str(plan.dir("extract") / shard.relative_to(first.dir("extract"))))
            theirs = load_file(str(shard))
            for key in ("input_ids", "loss_mask", "seq_lens"):
                assert torch.equal(ours[key], theirs[key]), (overrides, shard.name, key)
    other = compose_config(outputs, "data.regenerate.max_new_tokens=16")
    assert stage_keys(other)["regenerated"] != first.stage_keys["regenerated"]
    assert "regenerated" not in stage_keys(compose_config(outputs, "data.regenerate.enabled=false"))


def test_kimi_samples_its_answers_as_it_is_served_and_the_sampling_keys_the_answers(tmp_path):
    """kimi_eagle3 regenerates as the target is served: at the sampling its checkpoint's generation_config.json
    names, else at Moonshot's thinking-mode settings for the family (temperature 1.0, top_p 0.95), each request
    seeded; greedy where the user asks; the tiny Llama, whose build names none, greedily. The resolved values key
    the answers, and the dry run says where they come from. A top_p outside (0, 1] is refused naming the key."""
    from orchestrator.families import served_sampling
    from orchestrator.pipeline import stage_keys

    cfg = compose_root(["+experiment=kimi_eagle3"])  # target.path holds no checkpoint here: the family's
    r = cfg.data.regenerate
    assert (r.temperature, r.top_p) == (1.0, 0.95)
    checkpoint = tmp_path / "Kimi-K2.5"
    checkpoint.mkdir()
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": 163586, "temperature": 0.6,
                                                                   "top_p": 0.9}))  # fmt: skip
    own = compose_root(["+experiment=kimi_eagle3", f"target.path={checkpoint}"])
    assert (own.data.regenerate.temperature, own.data.regenerate.top_p) == (0.6, 0.9)
    family = compose_root(["+experiment=kimi_eagle3", f"target.path={tmp_path}"])  # no generation_config.json
    assert stage_keys(own)["regenerated"] != stage_keys(family)["regenerated"]
    greedy = compose_root(["+experiment=kimi_eagle3", f"target.path={checkpoint}", "data.regenerate.temperature=0"])
    assert (greedy.data.regenerate.temperature, greedy.data.regenerate.top_p) == (0.0, 1.0)
    tiny = compose_root(["+experiment=tiny_eagle3", "data.regenerate.enabled=true"]).data.regenerate
    assert (tiny.temperature, tiny.top_p) == (0.0, 1.0)
    # the tiny Kimi is of Kimi's family but no model Moonshot documents: greedy, at a target.path too
    for where in ([], [f"target.path={tmp_path}"]):
        small = compose_root(["+experiment=tiny_kimi_eagle3", *where]).data.regenerate
        assert (small.temperature, small.top_p) == (0.0, 1.0), where
    assert served_sampling(own.target)[2] == str(checkpoint / "generation_config.json")
    assert "platform.kimi.ai" in served_sampling(cfg.target)[2]
    sampled = ["+experiment=tiny_eagle3", "data.regenerate.enabled=true", "data.regenerate.engine=server",
               "data.regenerate.temperature=0.7", "serve=sglang"]  # fmt: skip
    keys = {p: stage_keys(compose_root([*sampled, f"data.regenerate.top_p={p}"])) for p in (0.95, 1.0)}
    assert keys[0.95]["regenerated"] != keys[1.0]["regenerated"] and keys[0.95]["extract"] != keys[1.0]["extract"]
    with pytest.raises(ConfigError, match=r"data\.regenerate\.top_p=1\.5: expected in \(0, 1\]"):
        compose_root(["+experiment=tiny_eagle3", "data.regenerate.top_p=1.5"])


def test_kimis_own_tokenizer_code_renders_a_thinking_answer_as_one_loss_span_ended_where_serving_ends_it(tmp_path):
    """Moonshot's tokenization_kimi.py (its current revision, over a small tiktoken vocabulary) with Kimi-K2-Thinking's
    template: `<think>` and `</think>` are one token each; a regenerated answer's loss covers exactly what the target
    wrote after the generation prompt, its thinking included, through `<|im_end|>` where the checkpoint's
    generation_config.json ends a response there, although the tokenizer's own eos is `[EOS]` (without that file the
    answer would run into the next turn); and the next turn's history holds the answer without its thinking."""
    from conftest import kimi_tokenizer_files

    from orchestrator.data import chat_prompt_ids
    from orchestrator.regenerate import _rendered, answer_message
    from orchestrator.targets import end_token_ids, load_tokenizer

    folder = kimi_tokenizer_files(tmp_path / "kimi")
    tokenizer = load_tokenizer(folder, trust_remote_code=True)
    assert type(tokenizer).__name__ == "TikTokenTokenizer" and tokenizer.eos_token == "[EOS]"
    think, end_think, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<|im_end|>"))
    assert tokenizer("<think>", add_special_tokens=False)["input_ids"] == [think]
    assert end_token_ids(tokenizer) == [tokenizer.eos_token_id]  # no generation_config.json: [EOS] alone
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    ends = end_token_ids(tokenizer)
    assert ends == [tokenizer.eos_token_id, im_end]

    conversation = [{"role": "user", "content": "What is 6 x 7?"}]
    prompt = chat_prompt_ids(tokenizer, conversation, None, 200)
    assert tokenizer.decode(prompt).endswith("<|im_assistant|>assistant<|im_middle|>")
    wrote = tokenizer.encode("<think>6 x 7 is 42</think>42", add_special_tokens=False)
    assert wrote[0] == think and end_think in wrote
    runs_on = tokenizer.encode("<|im_user|>user<|im_middle|>more", add_special_tokens=False)
    seq = _rendered(prompt, wrote + [im_end] + runs_on, ends, 200)
    assert seq.input_ids == prompt + wrote + [im_end]
    assert seq.loss_mask == [0] * len(prompt) + [1] * (len(wrote) + 1)
    assert _rendered(prompt, wrote + [im_end] + runs_on, [tokenizer.eos_token_id], 200).input_ids[-len(runs_on):] \
        == runs_on  # fmt: skip
    message = answer_message(tokenizer, wrote + [im_end])
    assert message == {"role": "assistant", "content": "42"}
    history = chat_prompt_ids(tokenizer, [*conversation, message, {"role": "user", "content": "and 6 x 8?"}], None, 400)
    assert "<think></think>42<|im_end|>" in tokenizer.decode(history)

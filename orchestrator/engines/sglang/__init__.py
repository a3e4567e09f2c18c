"""SGLang (sglang 0.5.23; docs/engines.md#sglang): serves the target, with or without an EAGLE-3 draft, from its
own environment (`serve.python`, scripts/make_sglang_env.sh), on GPUs or, through cpu_kernels/launch.py, on a CPU,
and captures the target's states for the extract stage and the capture service (extract.engine=sglang, from
`extract.python`; `extract=sglang` selects both) with its capture mode beside a server that answers the final
states (orchestrator/engines/sglang/capture.py). Its command lines and draft rules are
orchestrator/engines/sglang/cli.py's."""

from __future__ import annotations

import shlex
from pathlib import Path

from orchestrator import families
from orchestrator import layers as layer_contract
from orchestrator.config.schema import ConfigError, captured_layers, tasks_per_node
from orchestrator.engines import CaptureJob, Capturing, Serving, client
from orchestrator.engines.sglang import capture, cli
from orchestrator.layers import IdRule, LayerContractError


def sglang_rule(family: str, version: str | None) -> IdRule:
    """SGLang's id rule for a model family at a version: the Llama loop shifts every id by one; the DeepSeek/Kimi
    loop shifts only when the first id is 1 since PR #25454 (sglang 0.5.13)."""
    if family not in families.FAMILIES:
        raise LayerContractError(
            f"no SGLang layer-id rule recorded for model family {family!r}; known: {families.names()}"
        )
    if version is not None and layer_contract.parse_version(version)[:3] > layer_contract.SGLANG_CHECKED_UNTIL:
        read = ".".join(map(str, layer_contract.SGLANG_CHECKED_UNTIL))
        raise LayerContractError(
            f"no SGLang layer-id rule recorded for version {version} (its model code was read up to {read}); serve "
            f"with sglang {read}, or record the new version's rule in orchestrator/layers.py from its model code"
        )
    if families.FAMILIES[family].decoder_loop == "llama":
        return layer_contract.SGLANG_SHIFT
    if version is None:
        raise LayerContractError(f"SGLang's id rule for {family} depends on the version; set serve.sglang_version")
    since = layer_contract.SGLANG_FIRST_ID_SINCE
    return (
        layer_contract.SGLANG_FIRST_ID
        if layer_contract.parse_version(version) >= since
        else layer_contract.SGLANG_SHIFT
    )


def sglang_rule_versions(family: str, version: str) -> dict[str, str]:
    """The pinned version, and for the DeepSeek/Kimi family the releases before PR #25454, whose rule differs."""
    if families.FAMILIES[family].decoder_loop == "llama":
        return {version: version}
    major, minor, patch = layer_contract.SGLANG_FIRST_ID_SINCE
    return {version: version, f"< {major}.{minor}.{patch}": f"{major}.{minor}.{patch - 1}"}


def sglang_config_ids(conf, num_layers):
    """SGLang 0.5.23 reads a draft's ids from eagle_config.eagle_aux_hidden_state_layer_ids only
    (srt/model_executor/model_runner_components/spec_aux_hidden_state.py, `resolve_spec_aux_hidden_state_config`;
    a top-level key only sizes the fc). With none, every family's `set_eagle3_layers_to_capture(None)` captures
    before layers [2, N//2, N-3] with no shift (llama.py, deepseek_v2.py): returned here as the ids whose decoding
    by every family's rule names those states (entering layer j is canonical j-1, and the Llama rule's id)."""
    from orchestrator.draft.export import nested_ids

    ids = nested_ids(conf)
    if ids:
        return [("-", "eagle_config.eagle_aux_hidden_state_layer_ids", ids)]
    n = num_layers
    return [("-", f"no ids: captures before layers [2, {n // 2}, {n - 3}]", [1, n // 2 - 1, n - 4])]


class SGLang(Serving, Capturing):
    name = "sglang"
    convention = "sglang"
    env_script = "scripts/make_sglang_env.sh"
    loads_quantized = True
    distributions = ("sglang",)
    version_key = "serve.sglang_version"
    target_copies = 2  # its capture's aux server and final server (capture.py)

    def version(self, serve):
        return serve.sglang_version

    def id_rule(self, family, version):
        return sglang_rule(family, version)

    def config_ids(self, conf, num_layers):
        return sglang_config_ids(conf, num_layers)

    def rule_versions(self, family, version):
        return sglang_rule_versions(family, version)

    def check_config(self, cfg):
        cli.check_extra_args(cfg.serve.extra_args)

    def launch_command(self, cfg, target, draft, port, compute):
        return cli.launch_command(cfg, str(target), str(draft) if draft else None, port)

    def server_env(self, cfg):
        return cli.server_env(cfg)

    def check_command(self, cfg, command):
        if not cli.sglang_available(cfg.serve.python):
            return False
        cli.validate_with_sglang(cfg.serve.python, command)
        return True

    def request(self, server, prompt, max_new_tokens, timeout):
        return client.generate(server, prompt, max_new_tokens, timeout)

    def reset(self, server):
        client.flush_cache(server)

    def benchmark(self, server, prompts, cfg, concurrency):
        s = cfg.serve
        return client.benchmark(server, prompts, s.max_new_tokens, concurrency, s.request_timeout_s)

    def server_info(self, server):
        return client.server_info(server)

    # ---------------------------------------------------------------------------------------- capture
    def check_capture(self, cfg):
        """A post_norm teacher (SGLang answers the final norm's output, never the last layer's raw one), its
        environment at extract.python, ids its capture mode takes for the layers, and no regeneration that needs
        the target in this project's environment."""
        e, r = cfg.extract, cfg.data.regenerate
        if e.teacher != "post_norm":
            raise ConfigError(
                f"extract.teacher={e.teacher} with extract.engine=sglang: SGLang answers the final norm's output, and "
                "its capture hooks take a layer's input, so no id captures the last layer's raw output; set "
                "extract.teacher=post_norm, or extract.engine=vllm or hf"
            )
        if not e.python or not Path(e.python).is_file() or self.installed_version(e.python) is None:
            raise ConfigError(
                f"extract.python={e.python!r} holds no sglang: extract.engine=sglang runs SGLang from its own "
                f"environment; select extract=sglang (outputs/sglang-env, or SGLANG_PYTHON), build it with "
                f"bash {self.env_script}, or set extract.python"
            )
        if r.enabled and r.engine == "hf":
            raise ConfigError(
                "data.regenerate.engine=hf with extract.engine=sglang: the HF engine regenerates with the target "
                "loaded in this project's environment, which an SGLang extraction never loads; set "
                "data.regenerate.engine=server"
            )
        try:
            capture.capture_plan(cfg, captured_layers(cfg))
        except LayerContractError as exc:
            raise ConfigError(f"extract.engine=sglang: {exc}") from None

    def capture_key(self, cfg, extract):
        extract["engine_version"] = cfg.serve.sglang_version
        extract.pop("vllm_args")
        return extract

    def capture_record(self, cfg, layers):
        return {
            "name": self.name,
            "sglang_version": cfg.serve.sglang_version,
            # read from extract.python's package metadata (equal to the pin, or the job refused to start)
            "installed_version": self.installed_version(cfg.extract.python),
            "ids": capture.capture_plan(cfg, list(layers))[0],
            "mode": "capture",
        } | _computed_embedding(cfg, layers)

    def capture_ids(self, cfg, layers):
        return {
            "convention": f"sglang {cfg.serve.sglang_version} --return-aux-hidden-state-layer-ids "
            f"({cfg.target.family} rule)",
            "eagle_aux_hidden_state_layer_ids": capture.capture_plan(cfg, list(layers))[0],
            "teacher": {"kind": "post_norm", "from": "a second server's final states (--enable-return-hidden-states)"},
        } | _computed_embedding(cfg, layers)

    def open_capture(self, cfg, job: CaptureJob):
        # this node's environment, as installed, before the servers start: its version's id rule is the one that applies
        self.check_installed(cfg, cfg.extract.python, "extract.python", cfg.extract.resources.gpus_per_node)
        logs = job.out / "logs" / f"rank{job.compute.rank}"
        # started once there is a shard to capture (a rerun may leave only a streamed split's token ids to write)
        return capture.SGLangCapture(cfg, job.target_path, list(job.layers), job.compute, logs, start=bool(job.todo))

    def open_stream(self, cfg, target_path, layers, compute, work, answers_eval=False):
        self.check_installed(cfg, cfg.extract.python, "extract.python", cfg.extract.resources.gpus_per_node)
        return capture.SGLangCapture(cfg, target_path, list(layers), compute, Path(work))

    def check_eval(self, cfg):
        raise ConfigError(
            "eval.engine=sglang: SGLang captures states for the extract stage and the stream, but is not a live "
            "target for eval (its greedy continuations and states would take two servers per request); set "
            "eval.engine=vllm (what serving captures, from the checkpoint as shipped) or hf"
        )

    def print_capture(self, cfg, plan):
        """The two servers' commands each extract task starts, checked by SGLang's own parser where extract.python
        holds it."""
        gpus = cfg.extract.resources.gpus_per_node // tasks_per_node(cfg, "extract")
        self._print_servers(cfg, plan, gpus, "extract")

    def print_stream(self, cfg, plan, answers_eval):
        gpus = cfg.extract.resources.gpus_per_node if cfg.cluster.kind == "slurm" else cfg.train.resources.gpus_per_node
        self._print_servers(cfg, plan, gpus, "stream")

    def _print_servers(self, cfg, plan, gpus, stage):
        from orchestrator.compute import resolve_precision

        e = cfg.extract
        dtype = resolve_precision(e.precision, gpus)
        ids = capture.capture_plan(cfg, captured_layers(cfg))[0]
        for name, server_ids in (("aux", ids), ("final", None)):
            command = cli.capture_command(cfg, str(plan.target_dir), server_ids, 0, python=e.python, gpus=gpus,
                                          dtype=dtype)  # fmt: skip
            print(f"[{stage}] SGLang {name} server (port chosen at start): {shlex.join(command)}")
            if cli.sglang_available(e.python):
                cli.validate_with_sglang(e.python, command)
        if cli.sglang_available(e.python):
            print(f"[{stage}] SGLang's parser in {e.python} accepts both commands")


ENGINE = SGLang()


def _computed_embedding(cfg, layers) -> dict:
    """Where the embedding output (-1) is among `layers` and SGLang's capture mode has no id for it: the layers
    SGLang captures, those computed, and from what; nothing otherwise."""
    if not capture.capture_plan(cfg, list(layers))[1]:
        return {}
    name = dict(families.FAMILIES[cfg.target.family].head_tensors)["embed"]
    return {
        "captured_layers": [k for k in layers if k != layer_contract.EMBEDDING],
        "computed_layers": [layer_contract.EMBEDDING],
        "embedding": f"layer -1 computed from the checkpoint's {name} (SGLang's capture mode refuses its id -1)",
    }

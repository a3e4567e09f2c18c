"""SGLang (sglang 0.5.23; docs/engines.md#sglang): serves the target, with or without an EAGLE-3 draft, from its
own environment (`serve.python`, scripts/make_sglang_env.sh), on GPUs or, through cpu_kernels/launch.py, on a CPU.
Its command lines and draft rules are orchestrator/engines/sglang/cli.py's. Its capture mode (`cli.capture_command`)
is tested against HF's states but is not an extract engine yet."""

from __future__ import annotations

from orchestrator import families
from orchestrator import layers as layer_contract
from orchestrator.engines import Serving, client
from orchestrator.engines.sglang import cli
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


class SGLang(Serving):
    name = "sglang"
    convention = "sglang"
    env_script = "scripts/make_sglang_env.sh"
    loads_quantized = True
    distributions = ("sglang",)
    version_key = "serve.sglang_version"

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


ENGINE = SGLang()

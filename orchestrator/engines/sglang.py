"""SGLang (sglang 0.5.23; docs/engines.md#sglang): serves the target, with or without an EAGLE-3 draft, from its
own environment (`serve.python`, scripts/make_sglang_env.sh). Its command line and draft rules are
orchestrator/serving/sglang.py's; stock SGLang returns only the last layer's state, so it captures nothing here."""

from __future__ import annotations

from orchestrator import layers as layer_contract
from orchestrator.engines import SERVE, Engine
from orchestrator.layers import IdRule, LayerContractError


def sglang_rule(family: str, version: str | None) -> IdRule:
    """SGLang's id rule for a model family at a version: the Llama loop shifts every id by one; the DeepSeek/Kimi
    loop shifts only when the first id is 1 since PR #25454 (sglang 0.5.13)."""
    if family not in layer_contract.SGLANG_FAMILIES:
        raise LayerContractError(
            f"no SGLang layer-id rule recorded for model family {family!r}; known: {layer_contract.SGLANG_FAMILIES}"
        )
    if family == "llama":
        return layer_contract.SGLANG_SHIFT
    if version is None:
        raise LayerContractError(f"SGLang's id rule for {family} depends on the version; set serve.sglang_version")
    since = layer_contract.SGLANG_FIRST_ID_SINCE
    return (
        layer_contract.SGLANG_FIRST_ID
        if layer_contract.parse_version(version) >= since
        else layer_contract.SGLANG_SHIFT
    )


class SGLang(Engine):
    name = "sglang"
    roles = (SERVE,)
    convention = "sglang"
    env_script = "scripts/make_sglang_env.sh"
    loads_quantized = True
    distributions = ("sglang",)
    version_key = "serve.sglang_version"

    def version(self, serve):
        return serve.sglang_version

    def id_rule(self, family, version):
        return sglang_rule(family, version)

    def check_config(self, cfg):
        from orchestrator.serving import sglang

        sglang.check_extra_args(cfg.serve.extra_args)

    def launch_command(self, cfg, target, draft, port, compute):
        from orchestrator.serving import sglang

        return sglang.launch_command(cfg, str(target), str(draft) if draft else None, port)

    def check_command(self, cfg, command):
        from orchestrator.serving import sglang

        if sglang.sglang_available(cfg.serve.python):
            sglang.validate_with_sglang(cfg.serve.python, command)

    def request(self, server, prompt, max_new_tokens, timeout):
        from orchestrator.serving import client

        return client.generate(server, prompt, max_new_tokens, timeout)

    def reset(self, server):
        from orchestrator.serving import client

        client.flush_cache(server)

    def benchmark(self, server, prompts, cfg, concurrency):
        from orchestrator.serving import client

        s = cfg.serve
        return client.benchmark(server, prompts, s.max_new_tokens, concurrency, s.request_timeout_s)

    def server_info(self, server):
        from orchestrator.serving import client

        return client.server_info(server)


ENGINE = SGLang()

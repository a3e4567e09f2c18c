"""vLLM's layer ids: its rule for each target family, where its runners read a draft config's ids, and the ids a
capture asks its extractor for. The adapter (orchestrator/engines/vllm/__init__.py) and the command lines
(orchestrator/engines/vllm/cli.py) both read them here."""

from __future__ import annotations

from orchestrator import families
from orchestrator import layers as layer_contract
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
    if family not in families.FAMILIES:
        known = families.names()
        raise LayerContractError(f"no vLLM layer-id rule recorded for model family {family!r}; known: {known}")
    llama_loop = families.FAMILIES[family].decoder_loop == "llama"
    return layer_contract.VLLM_ENTERING if llama_loop else layer_contract.VLLM_DEEPSEEK


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


def engine_layers(cfg, layers: list[int]) -> tuple[list[int], bool]:
    """The canonical `layers` vLLM's extractor captures for `layers`, and whether the embedding output (-1) is
    computed from the checkpoint's embedding table instead: vLLM's DeepSeek/Kimi loop has no id for it
    (`layers.VLLM_DEEPSEEK`), and for a family whose embedding output is the table's rows as stored
    (`families.Family.embedding_lookup`) those rows are that state exactly. The states' assembler puts it back in
    its place, first (orchestrator/engines/vllm/capture.py, `assembler`)."""
    t = cfg.target
    rule = vllm_rule(t.family, cfg.serve.vllm_version)
    if layer_contract.EMBEDDING not in layers or rule is not layer_contract.VLLM_DEEPSEEK:
        return list(layers), False
    if not families.FAMILIES[t.family].embedding_lookup:
        raise LayerContractError(
            f"vLLM's {t.family} loop captures no embedding output (id 0 fails there), and this family's embedding "
            "output is not its table's rows as stored, so the project cannot compute it either: start aux_layers "
            "with layer 0 or above"
        )
    return [k for k in layers if k != layer_contract.EMBEDDING], True


def capture_ids(cfg, layers: list[int]) -> list[int]:
    """The vLLM ids an extract.engine=vllm extraction captures: `layers` (less the embedding output where it is
    computed, `engine_layers`), then the last layer's output (id N, the teacher's source), in vLLM's rule for the
    target's family."""
    t = cfg.target
    rule = vllm_rule(t.family, cfg.serve.vllm_version)
    captured, _ = engine_layers(cfg, layers)
    return layer_contract.encode(rule, [*captured, t.num_hidden_layers - 1], t.num_hidden_layers)

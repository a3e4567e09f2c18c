"""The draft guard: a draft directory is served only where the serving engine would feed it the states it was
trained on. It refuses a directory SGLang's loading rules reject, a config written for an engine of another id
convention, and above all ids that make `serve.engine` capture other layers than the draft's provenance records
(the seed's bug). The serve stage runs it before any server starts, and the dry run before any job is submitted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator import engines
from orchestrator import layers as layer_contract
from orchestrator.artifacts import ArtifactError
from orchestrator.config import RootConfig
from orchestrator.draft import export as draft_export


class ServingRefused(RuntimeError):
    """A draft or launch command that the serving engine would reject, or worse, accept and serve wrongly."""


def check_draft_for_serving(cfg: RootConfig, draft_dir: str | Path, target_config: dict[str, Any]) -> list[int]:
    """The draft config's aux-layer ids, once the directory passes SGLang's loading rules and the layer contract.

    Raises ServingRefused when the directory is malformed, or when SGLang (at `serve.sglang_version`, with the
    rule for `target.family`) would capture other states from the target than those the draft was trained on,
    as recorded in its provenance file.
    """
    folder = Path(draft_dir)
    problems = draft_export.validate_draft_dir(folder, target_config)
    if problems:
        raise ServingRefused(f"draft {folder} cannot be served by SGLang:\n  - " + "\n  - ".join(problems))
    ids = json.loads((folder / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    try:
        prov = draft_export.provenance(folder)
        trained = prov["aux_layers"]
    except (ArtifactError, KeyError) as exc:
        raise ServingRefused(
            f"draft {folder}: no trained aux_layers in {draft_export.PROVENANCE} ({exc}); without them nobody can "
            f"tell which target layers its fc expects, so it is not served"
        ) from None
    check_exported_engine(cfg, prov, ids, where=f"draft {folder}")
    check_layer_ids(cfg, ids, trained, where=f"draft {folder}")
    return list(ids)


def check_exported_engine(cfg: RootConfig, prov: dict[str, Any], ids: list[int], where: str = "draft") -> None:
    """Refuses a draft whose config was written for an engine of another id convention (its provenance's
    `serving.engine`): an SGLang export served by vLLM feeds the draft the layer below each trained one."""
    s = cfg.serve
    exported = (prov.get("serving") or {}).get("engine")
    if exported is None or engines.id_convention(exported) == engines.id_convention(s.engine):
        return
    rules = (prov.get("serving") or {}).get("id_rules") or exported
    try:
        what = f"{s.engine} would capture {_captured(cfg, ids)[1]}"
    except layer_contract.LayerContractError as exc:
        what = f"{s.engine} has no rule for them ({exc})"
    raise ServingRefused(
        f"{where} was exported for {exported} ({rules}: ids {list(ids)} for aux_layers={prov.get('aux_layers')}), "
        f"not for serve.engine={s.engine} ({engines.id_rules(s)}); {what}. Fix: serve it through the pipeline, whose "
        f"serve stage writes the draft for its engine (orchestrator.draft.served.served_draft_dir), or set "
        f"serve.engine={exported}."
    )


def _captured(cfg: RootConfig, ids: list[int]) -> tuple[list[int], str]:
    """The canonical states serve.engine captures for a draft config's ids, and them in words."""
    t, s = cfg.target, cfg.serve
    captured = engines.from_engine_ids(s.engine, ids, t.num_hidden_layers, t.family, engines.engine_version(s))
    return captured, f"{captured} ({', '.join(layer_contract.describe(k) for k in captured) or 'nothing'})"


def check_layer_ids(cfg: RootConfig, ids: list[int], trained: list[int], where: str = "draft") -> None:
    """Refuses ids that make SGLang capture anything but exactly the canonical `trained` layers, in that order."""
    t, s = cfg.target, cfg.serve
    captured, states = _captured(cfg, ids)
    if captured == list(trained) and len(ids) == len(trained):
        return
    rule = engines.engine_rule(engines.id_convention(s.engine), t.family, engines.engine_version(s))
    if len(captured) < len(ids):
        what = f"captures only {len(captured)} states for {len(ids)} ids: {states}"
    else:
        what = f"captures {states}"
    try:
        fixed_ids = engines.to_engine_ids(s.engine, trained, t.num_hidden_layers, t.family, engines.engine_version(s))
        fix = f"set it to {fixed_ids} (orchestrator.engines.to_engine_ids) or re-export the draft"
    except layer_contract.LayerContractError as exc:
        fix = f"no ids express the trained layers with this rule ({exc}); retrain on layers it can capture"
    raise ServingRefused(
        f"{where}: config.json eagle_config.eagle_aux_hidden_state_layer_ids={list(ids)}, but the draft was trained "
        f"on aux_layers={list(trained)} ({draft_export.PROVENANCE}). {engines.id_rules(s)} ({rule.name} rule for "
        f"target.family={t.family}, {t.num_hidden_layers} layers) {what}. Fix: {fix}."
    )

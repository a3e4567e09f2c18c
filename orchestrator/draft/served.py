"""The draft directory a serving engine gets: the trained draft, or a copy of it whose config says its layers in
that engine's id convention. Eval and serve both take their draft from here, so eval sees what serving sees."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from orchestrator import engines
from orchestrator import layers as layer_contract
from orchestrator.artifacts import read_json, write_json
from orchestrator.config import RootConfig
from orchestrator.draft import export as draft_export


def served_draft_dir(cfg: RootConfig, plan) -> Path:
    """The draft directory serving gets: the trained one when its config is written in the serving engine's id
    convention, under every key that engine's runners read (`draft_export.write_layer_ids`), else a copy in the
    run folder (`draft_<engine>`, the weights hard-linked) whose config ids and
    provenance say, in `serve.engine`'s convention, the layers the export captures in its own engine's (its
    provenance's `serving`). One trained draft so serves on SGLang and on vLLM, each given the ids of its own rule,
    and an export whose ids were wrong stays wrong, for the guard and eval to see. When `serve.layers` differs from
    the trained layers (a deliberate mismatch such as the seed replay) the copy says `serve.layers`, which the guard
    then refuses. Eval and serve both use it, so the standalone eval sees what serving sees."""
    s, t = cfg.serve, cfg.target
    trained = plan.dir("train") / "draft"
    conf = read_json(trained / "config.json", "draft config")
    prov = read_json(trained / draft_export.PROVENANCE, "draft provenance")
    exported = prov.get("serving") or {}
    convention = engines.id_convention(exported.get("engine") or s.engine)
    deliberate = list(s.layers) != list(cfg.train.layers)
    serving_convention = engines.id_convention(s.engine)
    written = draft_export.nested_ids(conf)
    complete = conf == draft_export.write_layer_ids(json.loads(json.dumps(conf)), written or [], serving_convention)
    if convention == serving_convention and not deliberate and complete:
        return trained
    if deliberate:
        layers = list(s.layers)
    else:  # what the export captures where it was meant to be served
        version = exported.get(f"{convention}_version")  # draft_export.serving_record
        layers = engines.from_engine_ids(
            convention, written, t.num_hidden_layers, t.family, version or engines.engine_version(s)
        )
    ids = _ids_as_written(cfg, layers)
    copy = Path(plan.run_dir) / f"draft_{s.engine}"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(trained, copy, copy_function=_link_or_copy)
    for name in ("config.json", draft_export.PROVENANCE):  # rewritten, never through a link to the trained draft
        (copy / name).unlink()
    write_json(copy / "config.json", draft_export.write_layer_ids(conf, ids, serving_convention))
    prov["serving"] = draft_export.serving_record(s, t.family, ids)
    write_json(copy / draft_export.PROVENANCE, prov)
    return copy


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _ids_as_written(cfg: RootConfig, layers: list[int]) -> list[int]:
    t = cfg.target
    try:
        return engines.to_engine_ids(
            cfg.serve.engine, layers, t.num_hidden_layers, t.family, engines.engine_version(cfg.serve)
        )
    except layer_contract.LayerContractError:
        return layers  # written as-is, as a pipeline without the contract would

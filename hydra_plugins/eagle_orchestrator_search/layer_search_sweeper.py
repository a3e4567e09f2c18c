"""`hydra/sweeper=optuna`: Hydra's multirun hands the composed experiment to the layer search.

    python -m orchestrator -m hydra/sweeper=optuna +experiment=tiny_eagle3 +search=tiny_llama

is the same study as `python -m orchestrator +experiment=tiny_eagle3 +search=tiny_llama`: Optuna 5 over
`aux_layers` (`orchestrator/search.py`), with its space, one extraction, pruning, resume and MLflow runs. The
hydra-optuna-sweeper plugin cannot do it (it pins optuna<3, whose sqlite storage fails under the SQLAlchemy 2
that MLflow needs, and its task function gets no trial to report to a pruner; see docs/experiments.md), so this plugin
takes its group name. Hydra loads sweepers only from the `hydra_plugins` package, hence this one's place.
"""

import sys
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict


@dataclass
class LayerSearchSweeperConf:
    _target_: str = "hydra_plugins.eagle_orchestrator_search.layer_search_sweeper.LayerSearchSweeper"


ConfigStore.instance().store(
    group="hydra/sweeper", name="optuna", node=LayerSearchSweeperConf, provider="eagle-orchestrator"
)


class LayerSearchSweeper(Sweeper):
    """Runs `orchestrator.search.main` on the config Hydra composed for the multirun."""

    def __init__(self) -> None:
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config

    def sweep(self, arguments: list[str]) -> Any:
        from orchestrator.search import main as search_main

        assert self.config is not None, "setup() first"
        grids = [o.input_line for o in OverridesParser.create().parse_overrides(arguments) if o.is_sweep_override()]
        if grids:
            print(
                f"error: hydra/sweeper=optuna: {', '.join(grids)}: the layer search samples aux_layers from "
                "search.slots; a grid of values inside it is not supported (run one search per value)",
                file=sys.stderr,
            )
            sys.exit(2)
        cfg = OmegaConf.create(OmegaConf.to_container(self.config, resolve=False))
        with open_dict(cfg):
            cfg.pop("hydra", None)
        if "search" not in cfg:
            print(
                "error: hydra/sweeper=optuna searches aux_layers over a space: add +search=<space> "
                "(conf/search/: tiny_llama, kimi_k25)",
                file=sys.stderr,
            )
            sys.exit(2)
        code = search_main(cfg)
        if code:
            sys.exit(code)
        return []

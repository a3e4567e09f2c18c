"""eagle-orchestrator: train an EAGLE-3 draft for a target LLM and prove it speeds serving up."""

import os
from pathlib import Path

__version__ = "0.1.0"


def conf_dir() -> Path:
    """The Hydra config tree: `EAGLE_ORCH_CONF` or the `conf/` folder beside the package."""
    return Path(os.environ.get("EAGLE_ORCH_CONF", Path(__file__).resolve().parent.parent / "conf"))

"""The channel from a search trial's training job to the Optuna study that decides whether to stop it.

A layer search (`orchestrator/search.py`) puts a `SearchTrial` on the trial's plan. The train stage, which may
run in another process or on another machine, calls the reporter `reporter(plan)` gives it after every
validation: the reporter opens the study in its storage, reports the validation metric as the trial's
intermediate value at that training step and asks the study's pruner whether to go on. When the pruner says
stop, it writes `pruned.json` into the trial's run folder (the driver reads it to record the trial as pruned)
and returns the reason; training then raises `TrialPruned` (on every rank, when the decision of one is shared).
Outside a search the reporter does nothing and returns None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

PRUNED_RECORD = "pruned.json"


class TrialPruned(RuntimeError):
    """Raised by a search trial's training when the study's pruner stops it."""


@dataclass
class SearchTrial:
    """Where a trial's training reports: the study (storage URL and name), the trial, the validation metric
    (a key of training's validation dict, e.g. `expected_accept_length`) and the pruner, as a Hydra `_target_`
    node, rebuilt in the job (a pruner decides from the study's trials, which it reads from the storage)."""

    storage: str
    study_name: str
    trial_id: int
    trial_number: int
    metric: str
    pruner: dict[str, Any]


def reporter(plan) -> Callable[[int, Mapping[str, Any]], str | None]:
    """`report(step, val)` for the train stage: the reason to stop when the study's pruner stops the trial, else
    None; a no-op returning None unless the plan belongs to a search trial."""
    trial_spec = getattr(plan, "search_trial", None)
    if not trial_spec:
        return lambda step, val: None
    spec = SearchTrial(**trial_spec)
    import optuna
    from hydra.utils import instantiate

    study = optuna.load_study(study_name=spec.study_name, storage=spec.storage, pruner=instantiate(spec.pruner))
    trial = optuna.trial.Trial(study, spec.trial_id)
    record = Path(plan.run_dir) / PRUNED_RECORD

    def report(step: int, val: Mapping[str, Any]) -> str | None:
        if spec.metric not in val:
            raise KeyError(f"search.prune_metric={spec.metric!r}: training's validation reports {sorted(val)}")
        value = float(val[spec.metric])
        try:
            trial.report(value, step)
        except RuntimeError as exc:  # the trial was finished meanwhile (its driver was killed and a new one failed it)
            print(f"[search] trial {spec.trial_number}: not reported ({exc}); training goes on unpruned", flush=True)
            return None
        if trial.should_prune():
            reason = (
                f"trial {spec.trial_number} pruned at training step {step}: validation {spec.metric}={value:.4f} "
                f"({type(study.pruner).__name__})"
            )
            record.write_text(json.dumps({"step": step, "metric": spec.metric, "value": value, "reason": reason}))
            return reason
        return None

    return report

"""Layer search: an Optuna study over `aux_layers`, one shared extraction, pruning, one MLflow parent per study.

`python -m orchestrator +experiment=X +search=<space>` composes the experiment as any run does, then drives the
study here (`main`). The space (`conf/search/*.yaml`) is one inclusive layer range per aux slot; a point takes one
layer per slot, ascending and distinct. Before any job, `build_space` enumerates the points and keeps those the
serving engine can capture (the layer contract, `orchestrator/layers.py`); the sampler only ever proposes those,
and every proposed point passes the pipeline's own validation and preflight before its jobs start.

Every trial trains on its subset of one extraction of the union of the candidate layers
(`extract.extra_layers`), which the driver runs once before the trials. A trial is one pipeline run (a child
MLflow run of the study's parent); its training reports validation to the study's pruner
(`orchestrator/pruning.py`). Its value is eval's expected accept length, or serve's speedup when the serve stage
runs; the study maximises it. The study lives in an Optuna storage (sqlite under `<outputs>/search/<study>/`):
running the same command again after the driver was killed continues it, and runs again the trials the killed
driver left unfinished.

Why not the hydra-optuna-sweeper plugin: its last release pins optuna<3 (2.10.1), whose sqlite storage fails
under the SQLAlchemy 2 that MLflow needs (an AssertionError in its schema check), so a study cannot be resumed;
and a Hydra sweeper hands the task function no trial, so training cannot report to a pruner. Optuna is driven
here directly, on the config Hydra composed.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from orchestrator import engines, preflight, pruning, results, runner, tracking
from orchestrator import layers as layer_contract
from orchestrator.artifacts import stable_hash, write_json
from orchestrator.config import ConfigError, RootConfig, load
from orchestrator.estimates import extract_storage, storage_terms

PRUNE_METRICS = ("expected_accept_length", "acc_<k>", "full_acc_<k>")
# A worker whose proposed point is already running in another trial tells its trial failed (not counted) and asks
# for another point, this many times; then it waits for the running trial's outcome and takes it.
IN_FLIGHT_ASKS = 8


@dataclass
class SearchConfig:
    """The `search` node (`conf/search/*.yaml`); values only in YAML, like every schema in config/schema.py."""

    slots: list[list[int]] = MISSING
    candidates: Optional[list[int]] = MISSING
    n_trials: int = MISSING
    n_jobs: int = MISSING
    study_name: str = MISSING
    storage: Optional[str] = MISSING
    baseline: bool = MISSING
    baselines: list[list[int]] = MISSING
    prune_metric: str = MISSING
    sampler: dict[str, Any] = MISSING
    pruner: dict[str, Any] = MISSING


class SearchError(ConfigError):
    """A search that cannot run as configured; raised before any job, naming the key."""


class InFlight(Exception):
    """The proposed point is running in another trial of this driver now."""


@dataclass
class Space:
    """The points a search may propose: per slot, the layers it may take (ascending); every valid point; and
    their union, which one extraction captures for all trials."""

    slots: list[list[int]]
    points: list[tuple[int, ...]]
    union: list[int]

    def allowed(self, prefix: tuple[int, ...]) -> list[int]:
        """The layers the next slot may take after `prefix`, such that a valid point still follows."""
        i = len(prefix)
        return sorted({p[i] for p in self.points if p[:i] == prefix})


# ---- configuration -------------------------------------------------------------------------------------------


def split(cfg: DictConfig) -> tuple[SearchConfig, dict[str, Any]]:
    """The search node, typed and resolved against the whole config, and the rest: the experiment as a plain
    container (interpolations kept, so `${aux_layers}` follows each trial's point)."""
    try:
        node = OmegaConf.to_container(cfg.search, resolve=True)
        search: SearchConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SearchConfig), node))
    except MissingMandatoryValue as exc:
        raise SearchError(
            f"config key 'search.{exc.full_key}' has no value: set it in conf/search/ or as an override"
        ) from None
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        raise SearchError(
            f"config key 'search.{key}': {str(exc).splitlines()[0]}" if key else f"search: {exc}"
        ) from None
    rest = OmegaConf.to_container(cfg, resolve=False)
    rest.pop("search")
    rest.pop("hydra", None)
    return search, rest


def point_config(
    experiment: dict[str, Any], point: list[int], union: list[int], join: Path | None = None
) -> RootConfig:
    """The experiment at one point, extracting the search's union, validated as any run is (`config.load`); with
    `join`, training reads the states of the capture service the search runs there (`train.stream.join`)."""
    raw = copy.deepcopy(experiment)
    raw["aux_layers"] = list(point)
    raw["extract"]["extra_layers"] = list(union)
    raw["cluster"]["wait"] = True  # a trial's value is its result: the driver waits for a Slurm chain too
    if join is not None:
        raw["train"]["stream"]["join"] = str(join)
    return load(raw)


def shares_stream(cfg: RootConfig) -> bool:
    """Whether the trials that run at once read one capture service (`Study.run_shared`): with train.states=stream,
    a process beside the driver (cluster local or debug), or a Slurm job of its own."""
    return cfg.train.states == "stream" and "train" in cfg.stages


def _end_service_job(job, grace_s: float = 60.0) -> None:
    """A search's capture service job, once its trials have left: it stops by itself with no consumer left (within
    seconds); one still running after `grace_s` is cancelled."""
    deadline = time.monotonic() + grace_s
    while not job.done() and time.monotonic() < deadline:
        time.sleep(1.0)
    if not job.done():
        job.cancel(check=False)


def check(search: SearchConfig, base: RootConfig) -> None:
    """What the search needs beyond a valid experiment, each failing with the key, the value and the fix."""
    n = base.target.num_hidden_layers
    k = base.draft.num_aux_layers
    if len(search.slots) != k:
        raise SearchError(
            f"search.slots has {len(search.slots)} ranges: the draft takes draft.num_aux_layers={k} "
            f"states, so give {k} ranges [low, high], one per aux layer"
        )
    for i, slot in enumerate(search.slots):
        if len(slot) != 2 or slot[0] > slot[1]:
            raise SearchError(f"search.slots[{i}]={slot}: expected an inclusive range [low, high] with low <= high")
        if not (layer_contract.EMBEDDING <= slot[0] and slot[1] <= n - 1):
            raise SearchError(f"search.slots[{i}]={slot}: outside the target's layers -1 (embedding) .. {n - 1}")
    if search.candidates is not None:
        try:
            layer_contract.validate_canonical(search.candidates, n, key="search.candidates")
        except layer_contract.LayerContractError as exc:
            raise SearchError(str(exc)) from None
    if search.n_trials < 1 or search.n_jobs < 1:
        raise SearchError(f"search.n_trials={search.n_trials}, search.n_jobs={search.n_jobs}: expected >= 1 each")
    if base.cluster.kind == "debug" and search.n_jobs > 1:
        raise SearchError(
            f"search.n_jobs={search.n_jobs} with cluster=debug: debug jobs run in this process one at a "
            "time; use cluster=local or cluster=slurm for trials in parallel, or search.n_jobs=1"
        )
    if "eval" not in base.stages:
        raise SearchError(
            f"stages={base.stages}: a trial's value is eval's expected accept length (or serve's "
            "speedup), so the search needs stages [extract, train, eval] or all four"
        )
    metric = search.prune_metric
    position = metric.rsplit("_", 1)[-1]
    positional = (
        metric.startswith(("acc_", "full_acc_")) and position.isdigit() and int(position) < base.train.ttt_steps
    )
    if metric != "expected_accept_length" and not positional:
        raise SearchError(
            f"search.prune_metric={metric!r}: expected one of {PRUNE_METRICS} (k < train.ttt_steps="
            f"{base.train.ttt_steps}), a validation value training reports and the study maximises"
        )


def build_space(search: SearchConfig, base: RootConfig) -> Space:
    """Every ascending, distinct point of the slots' ranges that the serving engine can capture."""
    check(search, base)
    t, s = base.target, base.serve
    ranges = [
        [k for k in range(lo, hi + 1) if search.candidates is None or k in search.candidates] for lo, hi in search.slots
    ]
    points, why_not = [], {}
    for point in _ascending(ranges):
        try:
            engines.to_engine_ids(s.engine, point, t.num_hidden_layers, t.family, engines.engine_version(s))
            points.append(point)
        except layer_contract.LayerContractError as exc:
            why_not.setdefault(str(exc).split(":")[0], str(exc))
    if not points:
        reasons = " | ".join(list(why_not.values())[:2]) or "no ascending, distinct point in the ranges"
        raise SearchError(
            f"search.slots={search.slots} (search.candidates={search.candidates}): no point the serving "
            f"engine ({s.engine}, family {t.family}) can capture: {reasons}"
        )
    for i, point in enumerate(search.baselines):
        if tuple(point) not in points:
            try:
                engines.to_engine_ids(s.engine, point, t.num_hidden_layers, t.family, engines.engine_version(s))
                why = f"outside search.slots={search.slots} (ascending, one layer per slot)"
            except layer_contract.LayerContractError as exc:
                why = f"the serving engine ({s.engine}) cannot capture it: {exc}"
            raise SearchError(f"search.baselines[{i}]={point}: not a point the search can run, {why}")
    slots = [sorted({p[i] for p in points}) for i in range(len(ranges))]
    return Space(slots, points, sorted({k for p in points for k in p}))


def _ascending(ranges: list[list[int]], prefix: tuple[int, ...] = ()) -> Iterator[tuple[int, ...]]:
    if len(prefix) == len(ranges):
        yield prefix
        return
    for k in ranges[len(prefix)]:
        if not prefix or k > prefix[-1]:
            yield from _ascending(ranges, prefix + (k,))


def union_storage(search: SearchConfig, experiment: dict[str, Any], space: Space) -> tuple[RootConfig, dict[str, Any]]:
    """The config that extracts the union (at the baseline point when the space holds it, else at its first
    point) and what that writes; a SearchError proposing a smaller candidate set when it exceeds extract.max_bytes."""
    baseline = tuple(experiment["aux_layers"])
    cfg = point_config(experiment, list(baseline if baseline in space.points else space.points[0]), space.union)
    storage = extract_storage(cfg)
    if storage["max_bytes"] <= storage["limit_bytes"]:
        return cfg, storage
    state_bytes = (storage["bytes_per_token"] - 5) // storage["states_per_token"]  # one hidden state of one token
    # the tokens whose states are stored (train.states=stream: the val split's), past the stream's token ids
    room = (storage["limit_bytes"] - storage["ids_only_bytes"]) / storage["stored_tokens"]
    fits = int((room - 5) // state_bytes) - 1  # the teacher state is one
    proposal = smaller_candidates(search, cfg, space, fits)
    raise SearchError(
        f"the search extracts the union of its candidate layers once ({len(space.union)} layers {space.union}): "
        f"at most "
        f"{storage['max_bytes'] / 1e9:,.1f} GB, over extract.max_bytes={storage['limit_bytes'] / 1e9:,.1f} GB; "
        + (
            f"{fits} layers fit. Proposed: search.candidates=[{','.join(map(str, proposal))}] "
            "(the baseline's layers and others evenly spaced over the union, every slot keeping layers); "
            "or lower data.max_train_conversations / data.max_seq_len, or raise "
            "extract.max_bytes if the disk holds it"
            if proposal
            else f"not even {len(search.slots)} layers fit: lower data.max_train_conversations or data.max_seq_len"
        )
    )


def smaller_candidates(search: SearchConfig, base: RootConfig, space: Space, size: int) -> list[int] | None:
    """The largest subset of the union, of at most `size` layers, that keeps the baseline's layers (with
    search.baseline) and spreads the others evenly, and still leaves a valid point."""
    wanted = ({*base.aux_layers} if search.baseline else set()) | {k for p in search.baselines for k in p}
    keep = sorted(wanted & set(space.union))
    rest = [k for k in space.union if k not in keep]
    for m in range(min(size, len(space.union)) - len(keep), len(search.slots) - len(keep) - 1, -1):
        spread = {rest[round(i * (len(rest) - 1) / max(m - 1, 1))] for i in range(m)} if m > 0 and rest else set()
        picked = sorted(set(keep) | spread)
        try:
            build_space(SearchConfig(**{**asdict(search), "candidates": picked}), base)
            return picked
        except SearchError:
            continue
    return None


def print_space(search: SearchConfig, space: Space, cfg: RootConfig, storage: dict[str, Any], study_dir: Path) -> None:
    single = extract_storage(point_config_like(cfg, list(cfg.aux_layers)))
    print(
        f"layer search {search.study_name!r}: {len(space.points):,} points the serving engine can capture "
        f"({cfg.serve.engine}, family {cfg.target.family}); slots:"
    )
    for i, (rng, layers) in enumerate(zip(search.slots, space.slots)):
        print(f"  slot {i}: range {rng} -> {layers}")
    print(
        f"one extraction for every trial: the union {space.union} ({len(space.union)} layers), at most "
        f"{storage['max_bytes'] / 1e9:,.2f} GB ({storage_terms(storage)}); one point alone: "
        f"{single['max_bytes'] / 1e9:,.2f} GB; extract.max_bytes="
        f"{storage['limit_bytes'] / 1e9:,.1f} GB"
    )
    print(
        f"value: {objective_name(cfg)} (maximised); {search.n_trials} trials, {search.n_jobs} at a time; pruner "
        f"{search.pruner['_target_']} on train/val_{search.prune_metric}; study at {study_dir}"
    )
    passes = stream_passes(search, cfg)
    if passes:
        print(passes)
    savings = serving_savings(search, cfg)
    if savings:
        print(savings)


def stream_passes(search: SearchConfig, cfg: RootConfig) -> str | None:
    """What the trials' streamed states cost in capture passes (train.states=stream; docs/streaming.md)."""
    if cfg.train.states != "stream":
        return None
    n, k = search.n_trials, min(search.n_jobs, search.n_trials)
    if not shares_stream(cfg):
        return None
    groups = -(-n // k)
    where = "beside this driver"
    if cfg.cluster.kind == "slurm":
        r = cfg.extract.resources
        where = (
            f"as a Slurm job of its own ({r.nodes} node(s), {r.gpus_per_node} GPU(s) each: extract.resources), which "
            f"needs the group's {k} train jobs running with it; a trial whose job has not started "
            f"{cfg.train.stream.declare_timeout_s:g} s after the first trainer's is left out and fails "
            "(train.stream.declare_timeout_s)"
        )
    return (
        f"stream: the trials run {k} at a time, each group reading one capture service of the union's layers "
        f"{where}: {groups} capture pass{'es' if groups != 1 else ''} per epoch for {n} trials, not {n}"
    )


def serving_savings(search: SearchConfig, cfg: RootConfig) -> str | None:
    """What the serve cache (stages/serve.py) saves the search: every trial that reaches serve shares one baseline
    (the target served without a draft, whatever the layers), so N trials start N + 1 servers, not 2N. Priced at
    serve.startup_estimate_min per start on serve's GPUs. None where the search does not serve."""
    if "serve" not in cfg.stages:
        return None
    n = search.n_trials
    r = cfg.serve.resources
    gpus = r.nodes * r.gpus_per_node
    line = (
        f"serving: at most {n} trials reach serve; they start {n} speculative servers and one baseline (none where "
        f"outputs/cache/serve holds it), not {2 * n}: {n - 1} target start-ups and {n - 1} baseline measurements saved"
    )
    est = cfg.serve.startup_estimate_min
    if est is None:
        return line + " (serve.startup_estimate_min=null: not priced)"
    hours = (n - 1) * est / 60
    return line + (
        f", {hours:,.1f} h of start-up on {gpus} GPU{'s' if gpus != 1 else ''} each: {hours * gpus:,.0f} GPU-hours "
        f"(serve.startup_estimate_min={est:g}, before the measurements themselves)"
    )


def point_config_like(cfg: RootConfig, point: list[int]) -> RootConfig:
    """A copy of `cfg` extracting only `point` (for the storage a single point would cost)."""
    other = copy.deepcopy(cfg)
    other.extract.extra_layers = []
    other.extract.layers = list(point)
    return other


def objective_name(cfg: RootConfig) -> str:
    return "serve/speedup" if "serve" in cfg.stages else "eval/expected_accept_length"


def objective(cfg: RootConfig, summary: dict[str, Any]) -> float:
    """The trial's value: its summary's serve speedup, or eval's expected accept length without a serve stage."""
    stage, key = objective_name(cfg).split("/")
    value = getattr(results.load(stage, summary["stages"][stage]), key)
    if value is None:  # a stage that measured nothing (eval on a draft that cannot consume what serving captures)
        raise KeyError(f"{stage} measured no {key}: the trial has no objective value")
    return float(value)


def fingerprint(experiment: dict[str, Any], search: SearchConfig) -> str:
    """What makes two trials' values comparable: everything but the point, where jobs run and how many trials.
    A study continues only under the same fingerprint."""
    tree = OmegaConf.to_container(OmegaConf.create(experiment), resolve=True)
    for key in ("aux_layers", "run_name", "dry_run", "check", "check_draft", "outputs_dir", "cluster", "tracking"):
        tree.pop(key, None)
    for stage in ("extract", "train", "eval", "serve"):
        tree[stage].pop("resources", None)
        tree[stage].pop("layers", None)
    return stable_hash(
        {"experiment": tree, "slots": search.slots, "candidates": search.candidates, "metric": search.prune_metric}
    )


# ---- the study -------------------------------------------------------------------------------------------------


def study_dir(search: SearchConfig, base: RootConfig) -> Path:
    return base.outputs / "search" / search.study_name


def storage_url(search: SearchConfig, folder: Path) -> str:
    return search.storage or f"sqlite:///{folder / 'optuna.db'}"


def suggest(trial, space: Space) -> list[int]:
    """One layer per slot, ascending, from the layers that still lead to a valid point. Optuna samples an int in
    the allowed range; a value between two allowed layers (candidates with gaps) takes the nearest, lower on a tie."""
    point: tuple[int, ...] = ()
    for i in range(len(space.slots)):
        allowed = space.allowed(point)
        value = trial.suggest_int(f"slot_{i}", allowed[0], allowed[-1])
        point += (min(allowed, key=lambda k: (abs(k - value), k)),)
    return list(point)


def finished_count(study) -> int:
    """Trials that count towards search.n_trials: complete, pruned, or failed while running; not a point
    rejected before its jobs, nor a point proposed while another trial ran it, nor a trial a killed driver left
    behind (it runs again)."""
    import optuna

    states = optuna.trial.TrialState
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    return sum(
        1
        for t in trials
        if t.state in (states.COMPLETE, states.PRUNED)
        or (
            t.state == states.FAIL
            and "rejected" not in t.user_attrs
            and "in_flight_of" not in t.user_attrs
            and t.number not in retried
        )
    )


def recover_interrupted(study) -> list[int]:
    """Trials left RUNNING belong to a driver that was killed (one driver per study holds its lock): failed, and
    their points enqueued again, so the resumed study runs them first."""
    import optuna

    left = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    for t in left:
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={"retry_of": t.number}, skip_if_exists=False)
    return [t.number for t in left]


class Study:
    """One search: the Optuna study, its folder, its MLflow parent run; runs trials as pipeline runs."""

    def __init__(self, search: SearchConfig, experiment: dict[str, Any], space: Space, extract_cfg: RootConfig):
        import optuna
        from hydra.utils import instantiate

        self.search, self.experiment, self.space, self.base = search, experiment, space, extract_cfg
        self.folder = study_dir(search, extract_cfg)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.storage = storage_url(search, self.folder)
        try:
            sampler, pruner = instantiate(search.sampler), instantiate(search.pruner)
        except Exception as exc:
            raise SearchError(f"search.sampler / search.pruner: cannot build them: {exc}") from None
        self.study = optuna.create_study(
            study_name=search.study_name,
            storage=self.storage,
            sampler=sampler,
            pruner=pruner,
            direction="maximize",
            load_if_exists=True,
        )
        mark = fingerprint(experiment, search)
        known = self.study.user_attrs.get("fingerprint")
        if known is None:
            for key, value in {
                "fingerprint": mark,
                "objective": objective_name(extract_cfg),
                "slots": search.slots,
                "union": space.union,
                "prune_metric": search.prune_metric,
            }.items():
                self.study.set_user_attr(key, value)
        elif known != mark:
            raise SearchError(
                f"search.study_name={search.study_name!r}: the study in {self.storage} was run with another "
                "experiment or space (its values would not compare); continue it with its own command, "
                "or name a new study (search.study_name=...)"
            )
        self.uri = tracking.tracking_uri(extract_cfg.tracking.uri, extract_cfg.outputs)
        self.parent = tracking.sweep_parent_run(
            self.uri, extract_cfg.tracking.experiment, self.folder, search.study_name
        )
        self.lock = threading.Lock()  # the report (search.json, the parent run) written by one thread at a time
        # Optuna hands out an enqueued trial (the baseline, a killed driver's retries) by reading it WAITING and
        # then writing it RUNNING. On sqlite that is no atomic claim: SQLAlchemy drops SELECT ... FOR UPDATE there
        # (optuna/optuna#1014 added it for the servers that have it), so two threads asking at once can both
        # take the same trial (optuna/optuna#4002) and run its chain twice. One thread asks and tells at a time.
        self.storage_lock = threading.Lock()
        # The points whose trials are running now, each with an event set when its trial has been told: a point
        # the sampler proposes again while it runs waits for that outcome instead of running the chain again.
        self.claims_lock = threading.Lock()
        self.in_flight: dict[tuple[int, ...], tuple[int, threading.Event]] = {}
        self.stopping = threading.Event()  # set by an error that ends the study: no further trial starts

    def run(self) -> dict[str, Any]:
        import optuna

        interrupted = recover_interrupted(self.study)
        if interrupted:
            print(f"[search] resuming {self.search.study_name!r}: trials {interrupted} of a killed driver run again")
        for number in interrupted:  # their pipeline runs were left RUNNING by the killed driver
            child = tracking.child_run_id(self.uri, self.parent, self.folder / "trials" / f"{number:04d}")
            tracking.trial_ended(self.uri, child, number, "interrupted")
        if not self.study.trials:
            own = [list(self.experiment["aux_layers"])] if self.search.baseline else []
            if own and tuple(own[0]) not in self.space.points:
                raise SearchError(
                    f"search.baseline=true but aux_layers={own[0]} is not a point of search.slots="
                    f"{self.search.slots}: widen the slots or set search.baseline=false"
                )
            enqueued: list[list[int]] = []
            for point in [*own, *map(list, self.search.baselines)]:  # run first, in this order, each once
                if point not in enqueued:
                    enqueued.append(point)
                    self.study.enqueue_trial(
                        {f"slot_{i}": k for i, k in enumerate(point)}, user_attrs={"baseline": True}
                    )
        tracking.search_started(
            self.uri,
            self.parent,
            self.search.study_name,
            self.storage,
            self.folder,
            objective_name(self.base),
            self.search.slots,
            self.space.union,
        )
        self.extract_union()
        while (left := self.search.n_trials - finished_count(self.study)) > 0:
            before = finished_count(self.study)
            self.run_trials(left)
            if finished_count(self.study) == before:
                raise SearchError(
                    f"search.slots={self.search.slots}: {left} proposed points in a row were rejected "
                    "before their jobs; see the study's failed trials (user attribute 'rejected')"
                )
        report = self.report(final=True)
        complete = [t for t in self.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if not complete:
            raise runner.StageFailed(
                f"layer search {self.search.study_name!r}: no trial completed; see {self.folder}/trials"
            )
        return report

    def run_trials(self, n: int) -> None:
        """`n` trials, `search.n_jobs` of them at a time, each in a thread of this driver (a trial is a chain of
        jobs the thread waits on). An error other than a trial's own failure ends the study once the trials in
        flight have ended."""
        from concurrent.futures import ThreadPoolExecutor

        if shares_stream(self.base):
            return self.run_shared(min(self.search.n_jobs, n))
        with ThreadPoolExecutor(max_workers=min(self.search.n_jobs, n), thread_name_prefix="trial") as pool:
            futures = [pool.submit(self.run_one) for _ in range(n)]
            self._results(futures)

    def _results(self, futures, poll=None) -> None:
        """Waits for the trials' threads (calling `poll` meanwhile); an error other than a trial's own failure (a
        bug, or Ctrl-C) starts no further trial, and is raised once those in flight have ended."""
        from concurrent.futures import FIRST_EXCEPTION
        from concurrent.futures import wait as wait_for

        try:
            while wait_for(futures, timeout=0.5, return_when=FIRST_EXCEPTION).not_done:
                if poll is not None:
                    poll()
                if any(f.done() and f.exception() is not None for f in futures):
                    break
            for future in futures:
                future.result()
        except BaseException:
            self.stopping.set()
            for future in futures:
                future.cancel()
            raise

    def run_shared(self, k: int) -> None:
        """`k` trials at once, their trainings reading one capture service of the union's layers
        (`orchestrator/states/stream.py`): one capture pass per epoch for the group, not one per trial. Each trial
        is registered as a consumer before the service starts; it leaves the group when it ends, whatever its
        outcome (a point known already or rejected leaves at once), and the service stops with the group."""
        from concurrent.futures import ThreadPoolExecutor

        from orchestrator.pipeline import eval_in_service, make_plan, submit_stream_service
        from orchestrator.states import stream

        asked = self.ask_distinct(k)
        cfg = self.base
        spool = stream.spool_dir(cfg, self.folder / "stream")
        names = [f"{t.number:04d}" for t in asked]
        # each trial's eval asks the service too (the target loaded once for the group), where the engine can answer
        evals = [f"{name}.eval" for name in names] if eval_in_service(cfg, list(cfg.stages)) else []
        print(f"[search] trials {[t.number for t in asked]} read one capture service: {spool}")
        if cfg.cluster.kind == "slurm":
            # a job of its own with the extraction's resources; each trial's train job starts once it has started,
            # and the service starts capturing once they have declared their steps (train.stream.declare_timeout_s)
            job = submit_stream_service(cfg, make_plan(cfg, self.folder / "extract"), spool, self.folder / "jobs",
                                        names, evals)  # fmt: skip
            print(f"[search] capture service: job {job.job_id}")
            poll, stop = None, lambda: _end_service_job(job)
        else:
            spec = stream.StreamSpec.of(cfg, make_plan(cfg, self.folder / "extract"), os.getpid())
            service = stream.CaptureService(spool, spec).start(consumers=names, evals=evals)
            poll, stop = service.proc.poll, service.stop  # reaped at once: a trainer sees its exit

        def one(trial, name: str) -> None:
            try:
                self.settle(trial, lambda: self.trial(trial, wait=False, join=spool))
            finally:
                stream.unregister(spool, name)
                stream.unregister(spool, f"{name}.eval")

        try:
            with ThreadPoolExecutor(max_workers=k, thread_name_prefix="trial") as pool:
                futures = [pool.submit(one, t, name) for t, name in zip(asked, names)]
                self._results(futures, poll=poll)
        finally:
            stop()

    def run_one(self) -> None:
        """Asks the study for a trial, runs it and tells its outcome: complete, pruned, or failed (a stage's
        failure, or a point rejected before its jobs: the study goes on). A point another trial is running
        is asked again (`IN_FLIGHT_ASKS`)."""
        for ask in range(IN_FLIGHT_ASKS + 1):
            if self.stopping.is_set() or self.run_asked(wait=ask == IN_FLIGHT_ASKS):
                return

    def ask_distinct(self, k: int) -> list:
        """`k` trials at distinct points (fewer where the sampler keeps proposing points the group holds or another
        trial runs): a trial of the group reads the stream from its start, so none waits for another's outcome. A
        repeated proposal is told failed, not counted, as a point in flight is (`claim`)."""
        import optuna

        group: dict[tuple[int, ...], Any] = {}
        with self.storage_lock:
            for _ in range(k + IN_FLIGHT_ASKS):
                if len(group) == k:
                    break
                trial = self.study.ask()
                point = tuple(suggest(trial, self.space))
                owner = group.get(point) or self.in_flight.get(point)
                if owner is None:
                    group[point] = trial
                    continue
                number = owner[0] if isinstance(owner, tuple) else owner.number
                trial.set_user_attr("in_flight_of", number)
                print(f"[search] trial {trial.number}: aux_layers={list(point)} is trial {number}'s: asking again")
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return list(group.values())

    def run_asked(self, wait: bool) -> bool:
        """One trial asked and told; False when its point was in flight elsewhere (told failed, not counted)."""
        with self.storage_lock:
            trial = self.study.ask()
        return self.settle(trial, lambda: self.trial(trial, wait))

    def settle(self, trial, run) -> bool:
        """`run()`'s outcome told for `trial`; False when its point was in flight elsewhere (told failed, not
        counted)."""
        import optuna

        states = optuna.trial.TrialState
        try:
            value = run()
        except InFlight:
            self.tell(trial, state=states.FAIL)
            return False
        except optuna.TrialPruned:
            self.tell(trial, state=states.PRUNED)
        except (runner.StageFailed, ConfigError, preflight.PreflightError) as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"[search] trial {trial.number} failed: {first_line}")
            self.tell(trial, state=states.FAIL)
        except BaseException:
            self.stopping.set()
            self.tell(trial, state=states.FAIL)
            raise
        else:
            self.tell(trial, value)
        finally:
            self.release(trial.number)
        self.report()
        return True

    def tell(self, trial, value: float | None = None, state=None) -> None:
        with self.storage_lock:
            self.study.tell(trial, value, state=state)

    def claim(self, trial, point: list[int], wait: bool):
        """The trial that already ended at `point` (complete or pruned), or None once this trial holds the point.
        While another trial runs the point: InFlight, or with `wait`, the other trial's outcome once told."""
        import optuna

        ended = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        while True:
            with self.claims_lock:
                done = next(
                    (
                        t
                        for t in self.study.get_trials(deepcopy=False, states=ended)
                        if t.user_attrs.get("aux_layers") == point and t.user_attrs.get("duplicate_of") is None
                    ),
                    None,
                )
                owner = self.in_flight.get(tuple(point))
                if done is not None or owner is None:
                    if done is None:
                        self.in_flight[tuple(point)] = (trial.number, threading.Event())
                    return done
            if not wait:
                trial.set_user_attr("in_flight_of", owner[0])
                print(f"[search] trial {trial.number}: aux_layers={point} is running as trial {owner[0]}: asking again")
                raise InFlight(point)
            print(f"[search] trial {trial.number}: aux_layers={point} is running as trial {owner[0]}: waiting for it")
            owner[1].wait()

    def release(self, number: int) -> None:
        with self.claims_lock:
            for point, (owner, event) in list(self.in_flight.items()):
                if owner == number:
                    del self.in_flight[point]
                    event.set()

    def extract_union(self) -> None:
        """The union's extraction, once, before the trials (which then find it cached)."""
        from orchestrator.pipeline import make_plan, run_pipeline

        cfg = copy.deepcopy(self.base)
        cfg.stages = ["extract"]
        run_dir = self.folder / "extract"
        if make_plan(cfg, run_dir).stages[0]["cached"]:
            return
        print(f"[search] extracting the union {self.space.union} once for every trial")
        summary = run_pipeline(cfg, run_dir, sweep_dir=self.folder)
        tracking.union_extracted(self.uri, summary["mlflow_run_id"], self.space.union)

    def trial(self, trial, wait: bool = True, join: Path | None = None) -> float:
        """One trial: its point, validated, as one pipeline run whose value the study maximises; with `join`, its
        training reads the capture service there."""
        import optuna

        from orchestrator.pipeline import run_pipeline

        point = suggest(trial, self.space)
        trial.set_user_attr("aux_layers", point)
        done = self.claim(trial, point, wait)
        if done is not None:  # a sampler re-proposes points of a discrete space: the outcome is known, no job runs
            trial.set_user_attr("duplicate_of", done.number)
            if done.state == optuna.trial.TrialState.PRUNED:  # training is deterministic: it would report the same
                for step, value in sorted(done.intermediate_values.items()):
                    trial.report(value, step)
                print(f"[search] trial {trial.number}: aux_layers={point} as trial {done.number}: pruned, no job")
                raise optuna.TrialPruned(f"aux_layers={point} as trial {done.number}, pruned")
            print(f"[search] trial {trial.number}: aux_layers={point} as trial {done.number}: {done.value:.4f}, no job")
            return done.value
        try:
            cfg = point_config(self.experiment, point, self.space.union, join)
            bad = preflight.failures(preflight.config_findings(cfg))
            if bad:
                raise preflight.PreflightError(bad)
        except (ConfigError, preflight.PreflightError) as exc:  # no job has started for this point
            trial.set_user_attr("rejected", str(exc))
            print(f"[search] trial {trial.number}: point {point} rejected before any job: {exc}")
            raise
        run_dir = self.folder / "trials" / f"{trial.number:04d}"
        spec = pruning.SearchTrial(
            self.storage,
            self.search.study_name,
            trial._trial_id,
            trial.number,
            self.search.prune_metric,
            self.search.pruner,
        )
        print(f"[search] trial {trial.number}: aux_layers={point} ({run_dir})")
        try:
            summary = run_pipeline(cfg, run_dir, sweep_dir=self.folder, search_trial=asdict(spec))
        except runner.StageFailed:
            record = run_dir / pruning.PRUNED_RECORD
            child = tracking.child_run_id(self.uri, self.parent, run_dir)
            if record.exists():
                info = json.loads(record.read_text())
                tracking.trial_ended(self.uri, child, trial.number, "pruned", pruned_at_step=info["step"])
                raise optuna.TrialPruned(info["reason"]) from None
            tracking.trial_ended(self.uri, child, trial.number, "failed")
            raise
        value = objective(cfg, summary)
        tracking.trial_ended(self.uri, summary["mlflow_run_id"], trial.number, "complete", objective_name(cfg), value)
        return value

    def report(self, final: bool = False) -> dict[str, Any]:
        """The study so far on the parent run: best point and value, the trials' table and the plot; with
        `final`, `search.json` in the study folder and the parent closed."""
        with self.lock:
            rows = trial_rows(self.study)
            best = max((r for r in rows if r["state"] == "complete"), key=lambda r: r["value"], default=None)
            baselines = [r for r in rows if r["baseline"] and r["state"] == "complete"]
            own = list(self.experiment["aux_layers"])
            baseline = next((r for r in baselines if r["aux_layers"] == own), baselines[0] if baselines else None)
            plot = plot_objective(
                rows, len(self.space.slots), objective_name(self.base), self.folder / "objective_by_layers.png"
            )
            summary = {
                "study_name": self.search.study_name,
                "storage": self.storage,
                "objective": objective_name(self.base),
                "best": best,
                "baseline": baseline,
                "baselines": baselines,
                "trials": rows,
                "mlflow_parent_run_id": self.parent,
                "union": self.space.union,
                "tracking_uri": self.uri,
            }
            write_json(self.folder / "search.json", summary)
            tracking.search_progress(self.uri, self.parent, summary, plot, finished=final)
            return summary


def trial_rows(study) -> list[dict[str, Any]]:
    return [
        {
            "number": t.number,
            "aux_layers": t.user_attrs.get("aux_layers"),
            "state": t.state.name.lower(),
            "value": t.value,
            "baseline": bool(t.user_attrs.get("baseline")),
            "rejected": t.user_attrs.get("rejected"),
            "retry_of": t.user_attrs.get("retry_of"),
            "duplicate_of": t.user_attrs.get("duplicate_of"),
            "in_flight_of": t.user_attrs.get("in_flight_of"),
            "pruned_at_step": max(t.intermediate_values)
            if t.state.name == "PRUNED" and t.intermediate_values
            else None,
            "seconds": (t.datetime_complete - t.datetime_start).total_seconds()
            if t.datetime_complete and t.datetime_start
            else None,
        }
        for t in study.get_trials(deepcopy=False)
    ]


def plot_objective(rows: list[dict[str, Any]], slots: int, name: str, path: Path) -> Path:
    """A heat map per pair of slots: each cell the best value of the complete trials with those two layers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from orchestrator.artifacts import atomic_path

    done = [r for r in rows if r["state"] == "complete" and r["aux_layers"]]
    pairs = [(i, j) for i in range(slots) for j in range(i + 1, slots)]
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.2 * len(pairs), 3.8), squeeze=False)
    for ax, (i, j) in zip(axes[0], pairs):
        xs = sorted({r["aux_layers"][j] for r in done})
        ys = sorted({r["aux_layers"][i] for r in done})
        grid = np.full((len(ys), len(xs)), np.nan)
        for r in done:
            y, x = ys.index(r["aux_layers"][i]), xs.index(r["aux_layers"][j])
            grid[y, x] = r["value"] if np.isnan(grid[y, x]) else max(grid[y, x], r["value"])
        if done:
            image = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
            fig.colorbar(image, ax=ax, shrink=0.8)
            for (y, x), v in np.ndenumerate(grid):
                if not np.isnan(v):
                    ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white")
        ax.set_xticks(range(len(xs)), [str(x) for x in xs])
        ax.set_yticks(range(len(ys)), [str(y) for y in ys])
        ax.set_xlabel(f"slot {j} layer")
        ax.set_ylabel(f"slot {i} layer")
        ax.set_title(f"best {name} (slots {i}, {j})", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return path


# ---- entry point -----------------------------------------------------------------------------------------------


def main(cfg: DictConfig) -> int:
    """`python -m orchestrator +experiment=X +search=<space> [overrides]`: 0 done, 1 no trial completed,
    2 a config that cannot run (nothing submitted)."""
    import sys

    from filelock import FileLock, Timeout

    try:
        search, experiment = split(cfg)
        base = load(copy.deepcopy(experiment))
        space = build_space(search, base)
        extract_cfg, storage = union_storage(search, experiment, space)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    folder = study_dir(search, base)
    print_space(search, space, extract_cfg, storage, folder)
    if base.dry_run:
        print("dry run: nothing submitted")
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder / "driver.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(
            f"error: another driver is running study {search.study_name!r} ({folder / 'driver.lock'})", file=sys.stderr
        )
        return 2
    try:
        summary = Study(search, experiment, space, extract_cfg).run()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except runner.StageFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        lock.release()
    print_result(summary)
    return 0


def print_result(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"layer search {summary['study_name']}  ({summary['objective']}, maximised)")
    for col in ("trial", "aux_layers", "state", "value", "seconds"):
        table.add_column(col)
    for r in summary["trials"]:
        value = "" if r["value"] is None else f"{r['value']:.4f}"
        state = (
            r["state"]
            + (" (baseline)" if r["baseline"] else "")
            + (f" at step {r['pruned_at_step']}" if r["pruned_at_step"] else "")
        )
        state += f" (= trial {r['duplicate_of']}, no job)" if r["duplicate_of"] is not None else ""
        state += f" (trial {r['in_flight_of']} was running it: asked again)" if r["in_flight_of"] is not None else ""
        table.add_row(
            str(r["number"]), str(r["aux_layers"]), state, value, "" if r["seconds"] is None else f"{r['seconds']:.0f}"
        )
    Console(width=200).print(table)
    best, baseline = summary["best"], summary["baseline"]
    if best:
        print(
            f"best: aux_layers={best['aux_layers']} {summary['objective']}={best['value']:.4f} (trial {best['number']})"
        )
    for row in summary.get("baselines") or ([baseline] if baseline else []):
        print(f"baseline: aux_layers={row['aux_layers']} {summary['objective']}={row['value']:.4f}")
    print(
        f"MLflow parent run {summary['mlflow_parent_run_id']} ({summary['tracking_uri']}); study {summary['storage']}"
    )

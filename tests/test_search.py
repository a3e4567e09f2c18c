"""The layer search: its space through the layer contract, its storage budget, pruning, resume and MLflow.

The space and budget tests compose the real config files and run real Optuna samplers, no job. The study tests
run real trials (submitit local jobs, a sqlite Optuna storage, the test session's MLflow store) on the FAST tiny
target; the resume test kills a real driver process and runs the same command again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest
from conftest import FAST, user_overrides
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from orchestrator import conf_dir, engines, search
from orchestrator import layers as layer_contract
from orchestrator.config import load
from orchestrator.pruning import PRUNED_RECORD

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[1]
# Trials as short as the FAST pipeline allows: extract, train 16 steps (validation at 8 and 16), eval.
TRIAL = ["stages=[extract,train,eval]", "cluster=local"]


def compose_search(outputs: Path, *overrides: str, experiment: str = "tiny_eagle3", space: str = "tiny_llama"):
    fast = FAST if experiment.startswith("tiny") else []  # the Kimi experiment has no tiny target to shrink
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(
            "config",
            overrides=user_overrides(
                [f"+experiment={experiment}", f"+search={space}", f"outputs_dir={outputs}", *fast, *overrides]
            ),
        )


def space_of(outputs: Path, *overrides: str, **kw) -> tuple[search.SearchConfig, dict, search.Space]:
    cfg, experiment = search.split(compose_search(outputs, *overrides, **kw))
    return cfg, experiment, search.build_space(cfg, load(experiment))


def capturable(cfg, point) -> bool:
    t, s = cfg.target, cfg.serve
    try:
        engines.to_engine_ids(s.engine, point, t.num_hidden_layers, t.family, s.sglang_version)
        return True
    except layer_contract.LayerContractError:
        return False


@pytest.mark.parametrize(
    "experiment,space,overrides",
    [
        (
            "tiny_eagle3",
            "tiny_llama",
            ["search.slots=[[-1,3],[0,5],[2,7]]"],
        ),  # SGLang's Llama rule never captures layer 7
        (
            "tiny_eagle3",
            "tiny_llama",
            ["search.slots=[[-1,3],[0,5],[2,7]]", "search.candidates=[-1,1,3,4,6,7]"],
        ),  # gaps
        (
            "kimi_eagle3",
            "kimi_k25",
            [],
        ),  # Kimi's first-id rule: output of layer 0 cannot come first; 60 is never captured
    ],
)
def test_sampled_points_are_valid(tmp_path, experiment, space, overrides):
    """Every point a real sampler proposes is ascending, distinct, inside the slots and capturable by serving:
    the space holds no other point, and `suggest` only ever reaches points of the space."""
    cfg, experiment_tree, sp = space_of(tmp_path, *overrides, experiment=experiment, space=space)
    base = load(experiment_tree)
    everything = list(search._ascending([list(range(lo, hi + 1)) for lo, hi in cfg.slots]))
    invalid = [p for p in everything if not capturable(base, p)]
    assert invalid, "the slots reach points serving cannot capture"
    assert set(sp.points) == {
        p for p in everything if capturable(base, p) and (cfg.candidates is None or set(p) <= set(cfg.candidates))
    }
    for sampler in (optuna.samplers.RandomSampler(seed=1), optuna.samplers.TPESampler(seed=1, n_startup_trials=5)):
        study = optuna.create_study(direction="maximize", sampler=sampler)
        for _ in range(60):
            trial = study.ask()
            point = search.suggest(trial, sp)
            assert tuple(point) in sp.points, point
            assert point == sorted(set(point)) and capturable(base, point)
            study.tell(trial, float(sum(point)))
    if experiment == "kimi_eagle3":
        assert 0 not in sp.slots[0] and base.target.num_hidden_layers - 1 not in sp.union


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["search.slots=[[1,3],[4,6]]"], "search.slots has 2 ranges"),
        (["search.slots=[[1,3],[4,6],[5,8]]"], "search.slots[2]=[5, 8]: outside"),
        (["search.slots=[[3,1],[4,6],[5,7]]"], "search.slots[0]=[3, 1]"),
        (["search.slots=[[7,7],[7,7],[7,7]]"], "no point the serving engine"),
        (["stages=[extract,train]"], "stages=['extract', 'train']"),
        (["search.prune_metric=loss"], "search.prune_metric='loss'"),
        (["search.prune_metric=acc_9"], "search.prune_metric='acc_9'"),
        (["cluster=debug", "search.n_jobs=2"], "search.n_jobs=2 with cluster=debug"),
        (["search.baselines=[[1,4,7]]"], "search.baselines[0]=[1, 4, 7]: not a point the search can run, the serving"),
        (["search.baselines=[[4,1,6]]"], "search.baselines[0]=[4, 1, 6]: .* must be ascending"),
        (["search.baselines=[[4,5,6]]"], "search.baselines[0]=[4, 5, 6]: not a point the search can run, outside"),
    ],
)
def test_bad_search_fails_naming_the_key(tmp_path, overrides, key):
    raw = compose_search(tmp_path, *overrides)
    with pytest.raises(search.SearchError, match=key.replace("[", r"\[").replace("]", r"\]")):
        cfg, experiment = search.split(raw)
        search.build_space(cfg, load(experiment))
    assert search.main(raw) == 2
    assert not (tmp_path / "search").exists(), "nothing is created, let alone submitted"


def test_union_over_budget_proposes_candidates(tmp_path):
    """The union's extraction over extract.max_bytes is refused with a smaller candidate set that fits and keeps
    the baseline's layers; the same command with that set passes."""
    cfg, experiment, sp = space_of(tmp_path, "extract.max_bytes=3e7")
    with pytest.raises(search.SearchError, match=r"search\.candidates=\[") as err:
        search.union_storage(cfg, experiment, sp)
    proposal = str(err.value).split("search.candidates=")[1].split("]")[0] + "]"
    candidates = json.loads(proposal)
    assert set([1, 4, 6]) <= set(candidates) < set(sp.union)
    cfg2, experiment2, sp2 = space_of(tmp_path, "extract.max_bytes=3e7", f"search.candidates={proposal}")
    extract_cfg, storage = search.union_storage(cfg2, experiment2, sp2)
    assert (
        storage["max_bytes"] <= storage["limit_bytes"] and extract_cfg.extract.extra_layers == sp2.union == candidates
    )


def test_dry_run_prints_the_union_storage(tmp_path, capsys):
    assert search.main(compose_search(tmp_path, "dry_run=true")) == 0
    out = capsys.readouterr().out
    assert "one extraction for every trial: the union [-1, 0, 1, 2, 3, 4, 5, 6] (8 layers), at most" in out
    assert "dry run: nothing submitted" in out and not (tmp_path / "search").exists()


def test_the_kimi_dry_run_prices_the_server_starts_the_serve_cache_saves(tmp_path, capsys):
    """40 trials share one baseline: 39 target start-ups saved, each 8 minutes on 8 GPUs (serve.startup_estimate_min,
    its sources in conf/experiment/kimi_eagle3.yaml): 5.2 h, 42 GPU-hours. Without an estimate, counted only."""
    kimi = {"experiment": "kimi_eagle3", "space": "kimi_k25"}
    # the union of 60 candidate layers stores the validation split's states (the train split's stream): 7,907.3 GB
    # at the recipes' scale, over the default extract.max_bytes (docs/experiments.md), and on a disk that holds them
    assert search.main(compose_search(tmp_path, "dry_run=true", **kimi)) != 0
    refused = capsys.readouterr()
    assert "(60 layers [-1, 1, 2," in refused.err + refused.out
    assert "at most 7,907.3 GB, over extract.max_bytes=2,000.0 GB; 14 layers fit" in refused.err + refused.out
    assert search.main(compose_search(tmp_path, "dry_run=true", "extract.max_bytes=8e12", **kimi)) == 0
    out = capsys.readouterr().out
    assert "they start 40 speculative servers and one baseline" in out and "not 80: 39 target start-ups" in out, out
    assert "5.2 h of start-up on 8 GPUs each: 42 GPU-hours (serve.startup_estimate_min=8," in out, out
    unpriced = ("dry_run=true", "extract.max_bytes=8e12", "serve.startup_estimate_min=null")
    unpriced = compose_search(tmp_path, *unpriced, **kimi)
    assert search.main(unpriced) == 0
    assert "(serve.startup_estimate_min=null: not priced)" in capsys.readouterr().out


def _study(outputs: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{outputs / 'search' / name / 'optuna.db'}")


def _trial_points(folder: Path) -> list[list[int]]:
    """The aux_layers of every pipeline the study started, as its training job received them (the plan)."""
    plans = sorted((folder / "trials").glob("*/plan.json"))
    return [
        next(s["layer_ids"]["aux_layers"] for s in json.loads(p.read_text())["stages"] if s["stage"] == "train")
        for p in plans
    ]


def test_study_resumes_after_a_killed_driver(outputs, tmp_path):
    """The driver is killed (with its jobs) mid-trial; the same command continues the study: the unfinished
    trial's point runs again, the parent run is the same, and the study reaches search.n_trials (one trial: the
    resumed one is what is tested, and a second point would only add a training)."""
    name = "resume"
    command = [
        sys.executable,
        "-m",
        "orchestrator",
        "+experiment=tiny_eagle3",
        "+search=tiny_llama",
        f"outputs_dir={outputs}",
        *FAST,
        *TRIAL,
        f"search.study_name={name}",
        "search.n_trials=1",
        "search/pruner=none",
    ]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "first.log").open("w")
    driver = subprocess.Popen(
        command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    db = outputs / "search" / name / "optuna.db"
    deadline = time.time() + 900
    try:
        while time.time() < deadline and driver.poll() is None:
            if db.exists() and (outputs / "search" / name / "trials" / "0000" / "jobs").exists():
                running = _study(outputs, name).get_trials(states=(optuna.trial.TrialState.RUNNING,))
                if running:
                    break
            time.sleep(1)
        assert driver.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and its local jobs, as a Ctrl-C'd terminal would
        driver.wait()
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    killed = _study(outputs, name).trials
    assert [t.state for t in killed] == [optuna.trial.TrialState.RUNNING]
    parent = json.loads((outputs / "search" / name / "mlflow_parent_run.json").read_text())["run_id"]

    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=1200)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "trials [0] of a killed driver run again" in again.stdout
    trials = _study(outputs, name).trials
    assert trials[0].state == optuna.trial.TrialState.FAIL
    assert trials[1].user_attrs["retry_of"] == 0 and trials[1].params == trials[0].params
    assert trials[1].user_attrs["aux_layers"] == [1, 4, 6]  # the baseline, enqueued first, runs again
    finished = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(finished) == 1 and search.finished_count(_study(outputs, name)) == 1
    assert json.loads((outputs / "search" / name / "mlflow_parent_run.json").read_text())["run_id"] == parent
    summary = json.loads((outputs / "search" / name / "search.json").read_text())
    assert summary["mlflow_parent_run_id"] == parent and summary["best"]["value"] == max(t.value for t in finished)
    uri = search.tracking.tracking_uri(None, outputs)
    left = MlflowClient(uri).get_run(
        search.tracking.child_run_id(uri, parent, outputs / "search" / name / "trials" / "0000")
    )
    assert left.info.status == "KILLED" and left.data.tags["search.trial_state"] == "interrupted"


def test_pruned_trials_and_parent_run(outputs):
    """A pruner that stops every trial at its first report: trials after the baseline are recorded as pruned in
    Optuna and in MLflow (child run KILLED, state tag), training stops there; the parent carries the best
    point as a tag, the objective per trial, the heat map and the trials' table."""
    name = "prune"
    raw = compose_search(outputs, *TRIAL, f"search.study_name={name}", "search.n_trials=1", "search/pruner=none")
    assert search.main(raw) == 0  # the baseline completes
    raw = compose_search(
        outputs,
        *TRIAL,
        f"search.study_name={name}",
        "search.n_trials=3",
        "search/pruner=threshold",
        "search.pruner.lower=1e9",
    )
    assert search.main(raw) == 0
    study = _study(outputs, name)
    states = [t.state for t in study.trials]
    assert states[0] == optuna.trial.TrialState.COMPLETE
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned and all(list(t.intermediate_values) == [8] for t in pruned), [t.intermediate_values for t in pruned]
    folder = outputs / "search" / name
    cfg, experiment, space = space_of(outputs, *TRIAL)
    started = _trial_points(folder)
    assert started and all(tuple(p) in space.points and capturable(load(experiment), p) for p in started), started
    parent_id = json.loads((folder / "mlflow_parent_run.json").read_text())["run_id"]
    client = MlflowClient(search.tracking.tracking_uri(None, outputs))
    parent = client.get_run(parent_id)
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    by_trial = {int(r.data.tags["search.trial"]): r for r in children if "search.trial" in r.data.tags}
    for t in pruned:
        run = by_trial[t.number]
        assert run.info.status == "KILLED" and run.data.tags["search.trial_state"] == "pruned"
        assert run.data.tags["search.pruned_at_step"] == "8" and "search/objective" not in run.data.metrics
        assert run.data.params["aux_layers"] == ", ".join(map(str, t.user_attrs["aux_layers"]))
        run_dir = folder / "trials" / f"{t.number:04d}"
        assert json.loads((run_dir / PRUNED_RECORD).read_text())["step"] == 8
    complete = by_trial[0]
    assert complete.data.tags["search.trial_state"] == "complete" and complete.info.status == "FINISHED"
    assert (
        complete.data.metrics["search/objective"]
        == study.trials[0].value
        == complete.data.metrics["eval/expected_accept_length"]
    )
    assert complete.data.params["aux_layers"] == "1, 4, 6"
    assert parent.info.status == "FINISHED"
    assert (
        parent.data.tags["search.best_aux_layers"] == "[1, 4, 6]"
        and parent.data.metrics["search/best_objective"] == study.trials[0].value
    )
    assert int(parent.data.tags["search.trials_pruned"]) == len(pruned)
    artifacts = {a.path for a in client.list_artifacts(parent_id)}
    assert {"objective_by_layers.png", "search.json"} <= artifacts
    png = Path(client.download_artifacts(parent_id, "objective_by_layers.png", str(folder / "dl")))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert "| 0 | L1-4-6 | complete (baseline) |" in parent.data.tags["mlflow.note.content"]


def test_hydra_sweeper_optuna_runs_the_layer_search(outputs, tmp_path):
    """`-m hydra/sweeper=optuna` (hydra_plugins/eagle_orchestrator_search) hands Hydra's composed config to the
    layer search (`search.main`, which the other tests run): a grid inside it and a missing space are refused
    before anything runs, and its dry run prints the study's space and plan."""

    def cli(*args):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "orchestrator",
                "-m",
                "hydra/sweeper=optuna",
                "+experiment=tiny_eagle3",
                f"outputs_dir={outputs}",
                *FAST,
                *args,
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=900,
        )

    grid = cli("+search=tiny_llama", "aux_layers=[1,4,6],[0,3,6]")
    assert grid.returncode == 2 and "aux_layers=[1,4,6],[0,3,6]: the layer search samples aux_layers" in grid.stderr, (
        grid.stderr
    )
    bare = cli()
    assert bare.returncode == 2 and "add +search=<space>" in bare.stderr, bare.stderr
    name = "sweeper"
    run = cli("+search=tiny_llama", *TRIAL, f"search.study_name={name}", "search.n_trials=3", "dry_run=true")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "layer search 'sweeper': 54 points the serving engine can capture" in run.stdout, run.stdout
    assert (
        "eval/expected_accept_length (maximised); 3 trials" in run.stdout and "dry run: nothing submitted" in run.stdout
    )
    assert not (outputs / "search" / name).exists()


def test_a_pruned_point_proposed_again_is_not_run_again(outputs):
    """A sampler re-proposes points of a discrete space. A point that was pruned is pruned again with the same
    reports (training is deterministic), and no job runs for it; a completed one gives its value again."""
    name = "again"
    two_points = ["search.slots=[[1,1],[4,5],[6,6]]", f"search.study_name={name}"]  # [1, 4, 6] and [1, 5, 6]
    assert search.main(compose_search(outputs, *TRIAL, *two_points, "search.n_trials=1", "search/pruner=none")) == 0
    study = _study(outputs, name)
    for _ in range(2):
        study.enqueue_trial({"slot_0": 1, "slot_1": 5, "slot_2": 6}, skip_if_exists=False)
    study.enqueue_trial({"slot_0": 1, "slot_1": 4, "slot_2": 6}, skip_if_exists=False)
    raw = compose_search(
        outputs, *TRIAL, *two_points, "search.n_trials=4", "search/pruner=threshold", "search.pruner.lower=1e9"
    )
    assert search.main(raw) == 0
    trials = _study(outputs, name).trials
    assert [(t.user_attrs["aux_layers"], t.state.name, t.user_attrs.get("duplicate_of")) for t in trials] == [
        ([1, 4, 6], "COMPLETE", None),
        ([1, 5, 6], "PRUNED", None),
        ([1, 5, 6], "PRUNED", 1),
        ([1, 4, 6], "COMPLETE", 0),
    ]
    assert trials[2].intermediate_values == trials[1].intermediate_values == {8: trials[1].intermediate_values[8]}
    assert trials[3].value == trials[0].value
    folder = outputs / "search" / name / "trials"
    assert sorted(p.name for p in folder.iterdir()) == ["0000", "0001"]  # no pipeline ran for the repeats


@pytest.mark.slow
def test_demo_search_finds_at_least_the_baseline(tmp_path):
    """The layer-search demo (docs/experiments.md) as a user runs it (minutes on 2 cores: outside the default
    suite): within its trials, a point the sampler proposed (not the enqueued baseline) does at least as well as the
    experiment's own aux_layers."""
    env = os.environ | {"EAGLE_ORCH_OUTPUTS": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "+experiment=tiny_layer_search"],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(next((tmp_path / "search").glob("*/search.json")).read_text())
    base = summary["baseline"]
    assert base["aux_layers"] == [1, 4, 6] and len(summary["trials"]) >= 10
    sampled = [t for t in summary["trials"] if t["state"] == "complete" and t["aux_layers"] != base["aux_layers"]]
    assert max(t["value"] for t in sampled) >= base["value"], summary["trials"]


def _driver_with_fake_chains(outputs: Path, monkeypatch, *overrides: str, hold_s: float = 0.0):
    """A Study over the tiny space whose trials' pipeline runs are recorded instead of submitted (the driver's
    own code decides what runs; the jobs it would wait on are not what these tests are about). A run waits up
    to `hold_s` for a second run to start beside it, so that two trials are in flight together when they can
    be. Returns (study, calls): calls lists each started run's (run_dir, aux_layers)."""
    from orchestrator import pipeline

    raw = compose_search(outputs, *TRIAL, "search/pruner=none", "search.n_jobs=2", *overrides)
    cfg, experiment = search.split(raw)
    space = search.build_space(cfg, load(experiment))
    extract_cfg, _ = search.union_storage(cfg, experiment, space)
    calls, second = [], threading.Event()
    lock = threading.Lock()

    def run_pipeline(run_cfg, run_dir, sweep_dir=None, search_trial=None):
        with lock:
            calls.append((str(run_dir), list(run_cfg.aux_layers)))
            if len(calls) > 1:
                second.set()
        second.wait(hold_s)
        return {"mlflow_run_id": None, "stages": {"eval": {"expected_accept_length": float(sum(run_cfg.aux_layers))}}}

    monkeypatch.setattr(pipeline, "run_pipeline", run_pipeline)
    monkeypatch.setattr(search.Study, "extract_union", lambda self: None)
    return search.Study(cfg, experiment, space, extract_cfg), calls


def test_two_workers_reaching_the_enqueued_baseline_run_it_once(tmp_path, monkeypatch):
    """search.n_jobs=2: both workers ask for a trial at once while the baseline waits in the queue. A barrier
    holds each between reading the queued trial WAITING and writing it RUNNING (what a busy machine does by
    chance): on sqlite, where SELECT ... FOR UPDATE locks nothing, both would take it and run its chain twice.
    The driver asks one thread at a time: the baseline runs once, and the second worker gets a point of its own."""
    from optuna.storages._rdb import models

    barrier = threading.Barrier(2, timeout=10)  # the other worker arrives within milliseconds when it can
    original = models.TrialModel.find_or_raise_by_id.__func__

    held_reads = []

    def held(cls, trial_id, session, for_update=False):
        row = original(cls, trial_id, session, for_update)
        if for_update and row.state == optuna.trial.TrialState.WAITING:
            held_reads.append(trial_id)
            try:
                barrier.wait()
            except threading.BrokenBarrierError:  # alone: the other worker is not reading the queue now
                pass
        return row

    monkeypatch.setattr(models.TrialModel, "find_or_raise_by_id", classmethod(held))
    # the baseline's chain lasts until the second starts: were it over first (a loaded machine is slow to ask), the
    # second worker could be proposed the finished baseline and take its value, rightly, with no chain of its own
    study, calls = _driver_with_fake_chains(
        tmp_path, monkeypatch, "search.n_trials=2", "search.study_name=race", hold_s=60
    )
    study.run()
    # Optuna took the queued baseline through the held read: the race this test sets up was offered (were Optuna to
    # take queued trials another way, the patch would hold nothing and the assertions below would prove nothing)
    assert held_reads, "no worker read a WAITING trial through TrialModel.find_or_raise_by_id(for_update=True)"
    points = [point for _, point in calls]
    assert len(calls) == 2 and len({run_dir for run_dir, _ in calls}) == 2 and points.count([1, 4, 6]) == 1, calls
    trials = _study(tmp_path, "race").trials
    assert trials[0].user_attrs["baseline"] and trials[0].user_attrs["aux_layers"] == [1, 4, 6]
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert [t.user_attrs["aux_layers"] for t in complete] == points and search.finished_count(
        _study(tmp_path, "race")
    ) == 2


def test_a_point_proposed_while_it_runs_waits_for_its_outcome(tmp_path, monkeypatch):
    """A space of one point, two workers: the second worker proposes the point the first is running. It starts no
    chain of its own: it asks for another point, and when the sampler has no other, waits for the first trial's
    outcome and takes it (`duplicate_of`)."""
    study, calls = _driver_with_fake_chains(
        tmp_path,
        monkeypatch,
        "search.n_trials=2",
        "search.study_name=same",
        "search.baseline=false",
        "search.slots=[[1,1],[4,4],[6,6]]",
        hold_s=10,  # long enough for a second chain to start beside the first, were it allowed to
    )
    study.run()
    # which worker's trial takes the point first is up to the scheduler: trial 0 or trial 1
    trials = _study(tmp_path, "same").trials
    fail, complete = optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE
    ran = [t for t in trials if t.state == complete and "duplicate_of" not in t.user_attrs]
    assert len(ran) == 1 and ran[0].number in (0, 1), trials
    first = ran[0].number
    assert calls == [(str(tmp_path / "search" / "same" / "trials" / f"{first:04d}"), [1, 4, 6])], calls
    # the second worker asked again IN_FLIGHT_ASKS times (each told failed, not counted), then waited
    others = [t for t in trials if t.number != first]
    assert [t.state for t in others] == [fail] * search.IN_FLIGHT_ASKS + [complete], trials
    assert all(t.user_attrs["in_flight_of"] == first for t in others[:-1])
    assert others[-1].user_attrs["duplicate_of"] == first and others[-1].value == ran[0].value == 11.0
    assert search.finished_count(_study(tmp_path, "same")) == 2


def test_baselines_run_first_each_once(tmp_path, monkeypatch):
    """The experiment's own layers, then search.baselines (a repeat of the first dropped), run before any sampled
    point; all are marked baselines, and the summary lists each."""
    study, calls = _driver_with_fake_chains(
        tmp_path, monkeypatch, "search.n_trials=3", "search.study_name=bases", "search.baselines=[[0,3,6],[1,4,6]]"
    )
    summary = study.run()
    trials = _study(tmp_path, "bases").trials
    assert [t.user_attrs["aux_layers"] for t in trials[:2]] == [[1, 4, 6], [0, 3, 6]]
    assert all(t.user_attrs.get("baseline") for t in trials[:2]) and not trials[2].user_attrs.get("baseline")
    points = [p for _, p in calls]
    assert points.count([1, 4, 6]) == 1 and points.count([0, 3, 6]) == 1, calls
    assert summary["baseline"]["aux_layers"] == [1, 4, 6]
    assert sorted(r["aux_layers"] for r in summary["baselines"]) == [[0, 3, 6], [1, 4, 6]]


def test_an_unexpected_error_starts_no_further_trial(tmp_path, monkeypatch):
    """An error that is not a trial's own failure (a bug, an interrupt) ends the study: the trials not yet
    started never start."""
    from orchestrator import pipeline

    study, calls = _driver_with_fake_chains(
        tmp_path, monkeypatch, "search.n_trials=6", "search.study_name=bug", "search.n_jobs=1"
    )

    def broken(run_cfg, run_dir, sweep_dir=None, search_trial=None):
        calls.append((str(run_dir), list(run_cfg.aux_layers)))
        raise RuntimeError("a bug in a trial")

    monkeypatch.setattr(pipeline, "run_pipeline", broken)
    with pytest.raises(RuntimeError, match="a bug in a trial"):
        study.run()
    assert len(calls) == 1, calls
    assert [t.state for t in _study(tmp_path, "bug").trials] == [optuna.trial.TrialState.FAIL]


@pytest.mark.parametrize(
    "cluster,line",
    [
        ("cluster=local", "3 capture passes per epoch for 7 trials, not 7"),
        (
            "cluster=slurm",
            "as a Slurm job of its own (1 node(s), 0 GPU(s) each: extract.resources), which needs the "
            "group's 3 train jobs running with it; a trial whose job has not started 600 s after the "
            "first trainer's is left out and fails (train.stream.declare_timeout_s): 3 capture passes "
            "per epoch for 7 trials, not 7",
        ),
    ],
)
def test_the_dry_run_says_how_many_capture_passes_streamed_trials_cost(tmp_path, capsys, cluster, line):
    raw = compose_search(tmp_path, *TRIAL[:1], cluster, "train.states=stream", "search.n_trials=7", "search.n_jobs=3",
                         "dry_run=true")  # fmt: skip
    assert search.main(raw) == 0
    assert line in capsys.readouterr().out

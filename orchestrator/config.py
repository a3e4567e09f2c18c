"""Typed schema of the composed config, and its validation.

The Hydra tree under `conf/` is the only place values live; this module holds the types and no defaults (every
field is MISSING, so a key the YAML leaves out fails at load, naming it). `load()` merges a composed config into
the schema (missing keys, unknown keys and wrong types fail there, naming the key), resolves the `${aux_layers}`
interpolations, and runs the cross-field checks that no type can express. Everything downstream receives a
`RootConfig` object, never a DictConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from orchestrator import engines, families
from orchestrator import layers as layer_contract

# `${project_root:}`: the checkout's root, where scripts/make_vllm_env.sh builds vLLM's environment by default
OmegaConf.register_new_resolver("project_root", lambda: str(Path(__file__).resolve().parents[1]), replace=True)

STAGES = ("extract", "train", "eval", "serve")
CLUSTERS = ("local", "debug", "slurm")
DTYPES = ("float32", "bfloat16", "float16")
DATA_SETS = ("stdlib_chat", "jsonl", "hf")
DATA_FORMATS = ("auto", "openai", "sharegpt", "ultrachat")
# data=hf's own keys (conf/data/hf.yaml); the other data sets leave them at their defaults
HF_KEYS = {"path": None, "subset": None, "data_files": None, "revision": None, "val_split": None, "column": None}
REGENERATE_ENGINES = ("hf", "server", "one_pass")
REGENERATE_APIS = ("generate", "completions")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key, the value and what is allowed."""


@dataclass
class Resources:
    """What one stage job asks of the cluster."""

    nodes: int = MISSING
    gpus_per_node: int = MISSING
    # Processes per node (submitit tasks, one torch.distributed rank each). null: one per GPU for the stages that
    # run data-parallel (extract, train), one per node for eval and serve; see `tasks_per_node`.
    tasks_per_node: Optional[int] = MISSING
    cpus_per_task: int = MISSING
    mem_gb: int = MISSING
    timeout_min: int = MISSING


@dataclass
class TinySpec:
    """How to build a tiny target when no model path is given."""

    arch: str = MISSING
    model: dict[str, Any] = MISSING
    train: dict[str, Any] = MISSING


@dataclass
class TargetConfig:
    name: str = MISSING
    family: str = MISSING
    num_hidden_layers: int = MISSING
    hidden_size: int = MISSING
    vocab_size: int = MISSING
    max_position_embeddings: int = MISSING
    # A local HF model directory. None: build the tiny target described by `tiny`.
    path: Optional[str] = MISSING
    tiny: Optional[TinySpec] = MISSING
    trust_remote_code: bool = MISSING
    # The architecture name of the target's HF config (recorded in plans and draft configs).
    architecture: str = MISSING
    rope_theta: float = MISSING
    rope_scaling: Optional[dict[str, Any]] = MISSING
    # Python packages the target's remote code (trust_remote_code: its tokenizer) imports beyond transformers and
    # tokenizers; the dry run checks each imports. An extra of the project's named after the target declares them.
    remote_code_imports: list[str] = MISSING


@dataclass
class RegenerateConfig:
    """Replace the assistant turns by the target's own responses to the same prompts (SpecForge's
    regeneration), so the draft learns the text the target produces when served, not the data set's."""

    enabled: bool = MISSING
    # hf: HF `generate` in the extract job; server: a serving endpoint (orchestrator/regenerate.py); one_pass:
    # with extract.engine=vllm, vLLM generates the response and captures the states of prompt plus response in
    # the same request (orchestrator/engines/vllm/capture.py, `capture_all`).
    engine: str = MISSING
    max_new_tokens: int = MISSING
    # 0: greedy, what the serve stage benchmarks; > 0 samples (seeded).
    temperature: float = MISSING
    # engine=hf: prompts per `generate` call.
    batch_size: int = MISSING
    # engine=server: the endpoint's base URL (http://HOST:PORT); null: start the target with the serve stage's
    # launcher (serve.engine's command, no draft) for the extraction and stop it afterwards.
    url: Optional[str] = MISSING
    # engine=server: generate (SGLang's /generate, input_ids in, output_ids out) or completions (OpenAI
    # /v1/completions with a token-id prompt and return_token_ids: SGLang, vLLM).
    api: str = MISSING
    # engine=server: requests in flight.
    concurrency: int = MISSING


@dataclass
class DataConfig:
    name: str = MISSING
    # stdlib_chat: a seeded sample of this many stdlib files (null: all of them).
    max_files: Optional[int] = MISSING
    # jsonl: the user's conversation files, one JSON object per line (relative paths: from the working directory).
    train_files: list[str] = MISSING
    # Empty: `val_fraction` of the train files' conversations, picked under the seed, are held out instead.
    val_files: list[str] = MISSING
    val_fraction: Optional[float] = MISSING
    # auto (each line by its key), openai (`messages`: role/content) or sharegpt (`conversations`: from/value).
    format: str = MISSING
    max_train_conversations: int = MISSING
    max_val_conversations: int = MISSING
    max_seq_len: int = MISSING
    # A Jinja chat template file that replaces the target's (as serving engines' --chat-template); null: the target's.
    chat_template: Optional[str] = MISSING
    # Extraction fails when a shard's loss tokens are a smaller fraction of its tokens than this.
    min_loss_fraction: float = MISSING
    regenerate: RegenerateConfig = MISSING
    # hf: a Hugging Face `datasets` data set (conf/data/hf.yaml): a local file, folder or save_to_disk folder, a
    # builder name ("json", "parquet") with data_files, or a hub name already in the local cache (never downloaded).
    path: Optional[str] = None
    subset: Optional[str] = None  # load_dataset's `name` (the data set's configuration)
    data_files: Optional[list[str]] = None
    revision: Optional[str] = None  # a hub data set's revision; keys the extraction (hub names have no file to hash)
    train_split: str = "train"
    val_split: Optional[str] = None  # null: a seeded val_fraction of the train split's rows
    column: Optional[str] = None  # the column holding each row's turns; null: the layout's (messages, ...)
    streaming: bool = True  # rows read as they are used: the data set is never whole in memory


@dataclass
class DraftConfig:
    """The EAGLE-3 draft's shape. `hidden_size`/`intermediate_size`/vocab None: take the target's."""

    num_aux_layers: int = MISSING
    hidden_size: Optional[int] = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: Optional[int] = MISSING
    intermediate_size: Optional[int] = MISSING
    draft_vocab_size: Optional[int] = MISSING
    rms_norm_eps: float = MISSING
    max_position_embeddings: Optional[int] = MISSING
    torch_dtype: str = MISSING


@dataclass
class ExtractConfig:
    layers: list[int] = MISSING
    # Also capture these (e.g. the union of a sweep's aux_layers): sweep points then share one extraction
    # and each training reads its own subset.
    extra_layers: list[int] = MISSING
    teacher: str = MISSING
    dtype: str = MISSING
    shard_conversations: int = MISSING
    batch_size: int = MISSING
    # Refuse, before any job, an extraction whose estimated size (extract_storage) exceeds this many bytes.
    max_bytes: float = MISSING
    # What the target computes in (auto: bfloat16 on GPUs, float32 on CPUs); `dtype` is what is stored.
    precision: str = MISSING
    # Extract every shard again, over an existing (e.g. corrupt) extraction of the same key.
    force: bool = MISSING
    # A collective that waits longer than this for a peer fails (the process group's timeout; the job's own time
    # limit is far longer), so a rank that died or hangs ends a multi-task job in minutes.
    collective_timeout_min: float = MISSING
    resources: Resources = MISSING
    # What computes the states: hf (transformers, in this project's environment) or vllm (vLLM's own extractor,
    # `extract_hidden_states`, in its environment `python`: orchestrator/engines/vllm/side/capture.py).
    engine: str = "hf"
    python: Optional[str] = None
    # extract.engine=vllm: more engine flags, as `vllm serve` takes them (checked by vLLM's own parser)
    vllm_args: list[str] = MISSING


@dataclass
class TrainConfig:
    layers: list[int] = MISSING
    # A draft trained elsewhere (SGLang/SpecForge, vLLM or speculators format): the train stage imports it instead
    # of training one, as reading `layers`, and eval and serve measure it like a trained draft. null: train.
    from_draft: Optional[str] = None
    ttt_steps: int = MISSING
    epochs: int = MISSING
    max_steps: Optional[int] = MISSING
    batch_size: int = MISSING
    lr: float = MISSING
    min_lr_ratio: float = MISSING
    warmup_ratio: float = MISSING
    weight_decay: float = MISSING
    beta1: float = MISSING
    beta2: float = MISSING
    grad_clip: float = MISSING
    step_weight_decay: float = MISSING
    # auto: bfloat16 autocast on GPUs (float32 master weights), float32 on CPUs.
    precision: str = MISSING
    checkpoint_every: int = MISSING
    val_every: int = MISSING
    log_every: int = MISSING
    seed: int = MISSING
    threads: Optional[int] = MISSING
    # A collective that waits longer than this for a peer fails (the process group's timeout; the job's own time
    # limit is far longer), so a rank that died or hangs ends a multi-task job in minutes.
    collective_timeout_min: float = MISSING
    resources: Resources = MISSING


@dataclass
class EvalConfig:
    layers: list[int] = MISSING
    draft_steps: int = MISSING
    max_conversations: int = MISSING
    prompts: int = MISSING
    max_new_tokens: int = MISSING
    acc_tolerance: float = MISSING
    # What the target computes in (auto: bfloat16 on GPUs, float32 on CPUs); the draft runs in its config's dtype.
    precision: str = MISSING
    # A collective that waits longer than this for a peer fails (the process group's timeout; the job's own time
    # limit is far longer), so a rank that died or hangs ends a multi-task job in minutes.
    collective_timeout_min: float = MISSING
    resources: Resources = MISSING


@dataclass
class ServeConfig:
    layers: list[int] = MISSING
    engine: str = MISSING
    sglang_version: str = MISSING
    # The vLLM version serving (serve.engine=vllm): its layer-id rule is recorded per version (orchestrator/layers.py).
    vllm_version: str = MISSING
    # Python of the separate serving environment (sglang and vLLM never live in the project's environment).
    python: str = MISSING
    # An engine to serve with instead when serve.python does not exist (the demo: vLLM where its environment was
    # built, the reference engine elsewhere); null: none, a missing serve.python is an error. The summary says which.
    fallback: Optional[str] = MISSING
    num_steps: int = MISSING
    eagle_topk: int = MISSING
    num_draft_tokens: int = MISSING
    tp_size: int = MISSING
    mem_fraction_static: Optional[float] = MISSING
    dtype: Optional[str] = MISSING
    cuda_graph_max_bs_decode: Optional[int] = MISSING
    extra_args: list[str] = MISSING
    prompts: int = MISSING
    max_new_tokens: int = MISSING
    concurrency: list[int] = MISSING
    # Passes over the prompt set per concurrency level; tok/s is the median pass (timing noise), and every
    # pass must produce the same greedy outputs.
    repeats: int = MISSING
    startup_timeout_s: float = MISSING
    # What one server start takes on the cluster (loading the target, building graphs), in minutes: what the layer
    # search's dry run prices the server starts the cache saves at. None: starts are counted, not priced.
    startup_estimate_min: Optional[float] = MISSING
    request_timeout_s: float = MISSING
    accept_length_tolerance: float = MISSING
    # Where arithmetic is not exact (bf16; an engine that batches), the fraction of greedy output tokens that may
    # differ with and without speculation before it is flagged; the reference engine in float32 must match exactly.
    greedy_token_tolerance: float = MISSING
    # Refuse to serve a draft whose config ids do not capture the layers it was trained on.
    guard: bool = MISSING
    # Measure again instead of taking the passes cached under the same key (outputs/cache/serve/; stages/serve.py).
    force: bool = MISSING
    threads: Optional[int] = MISSING
    # The reference engine's target (auto: bfloat16 on GPUs, float32 on CPUs); SGLang is told `serve.dtype`.
    precision: str = MISSING
    # A collective that waits longer than this for a peer fails (the process group's timeout; the job's own time
    # limit is far longer), so a rank that died or hangs ends a multi-task job in minutes.
    collective_timeout_min: float = MISSING
    resources: Resources = MISSING
    # Set by `load` when serve.fallback replaced serve.engine: why (the summary and MLflow say so).
    fallback_reason: Optional[str] = None

    @property
    def engine_version(self) -> str:
        """The version whose layer-id rule applies: vLLM's for serve.engine=vllm, else SGLang's (the reference
        engine reads SGLang's convention)."""
        return engines.get(self.engine).version(self)

    @property
    def id_rules(self) -> str:
        """Whose layer-id rules apply, for messages: 'vllm 0.32.0' or 'sglang 0.5.23'."""
        return f"{engines.get(self.engine).convention} {self.engine_version}"


@dataclass
class ClusterConfig:
    kind: str = MISSING
    # Slurm site settings (ignored by local/debug).
    partition: Optional[str] = MISSING
    account: Optional[str] = MISSING
    qos: Optional[str] = MISSING
    constraint: Optional[str] = MISSING
    setup: list[str] = MISSING
    wait: bool = MISSING
    # Memory of one of the site's GPUs: dry runs check that a target's weights fit the GPUs a task gets.
    gpu_memory_gb: Optional[float] = MISSING
    # One node's CPUs (hardware threads Slurm schedules), GPUs and memory (GB); null: not known. A dry run
    # refuses a stage whose request exceeds one, before a chain is half-submitted and then rejected by sbatch.
    cpus_per_node: Optional[int] = MISSING
    gpus_per_node: Optional[int] = MISSING
    mem_gb_per_node: Optional[float] = MISSING


@dataclass
class TrackingConfig:
    uri: Optional[str] = MISSING
    experiment: str = MISSING


@dataclass
class RootConfig:
    aux_layers: list[int] = MISSING
    stages: list[str] = MISSING
    dry_run: bool = MISSING
    # Run only the preflight checks (config, and any artifacts the run would use or `check_draft`) and report.
    check: bool = MISSING
    check_draft: Optional[str] = MISSING
    run_name: str = MISSING
    seed: int = MISSING
    outputs_dir: str = MISSING
    target: TargetConfig = MISSING
    data: DataConfig = MISSING
    draft: DraftConfig = MISSING
    extract: ExtractConfig = MISSING
    train: TrainConfig = MISSING
    eval: EvalConfig = MISSING
    serve: ServeConfig = MISSING
    cluster: ClusterConfig = MISSING
    tracking: TrackingConfig = MISSING

    @property
    def outputs(self) -> Path:
        return Path(self.outputs_dir).resolve()


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
    validate(root)
    return root


def apply_fallback(cfg: RootConfig) -> None:
    """serve.fallback in place of serve.engine when serve.python does not exist on this machine (the demo: vLLM
    where scripts/make_vllm_env.sh built it, the reference engine elsewhere); `fallback_reason` records why."""
    s = cfg.serve
    if s.fallback in (None, s.engine) or s.engine not in engines.names(engines.SERVE):
        return
    script = engines.get(s.engine).env_script
    if script is None or Path(s.python).is_file():  # an engine of the project's own environment is always here
        return
    s.fallback_reason = (
        f"serve.engine={s.engine} needs serve.python={s.python}, which does not exist on this machine "
        f"(build it: bash {script}); serving with serve.fallback={s.fallback} instead"
    )
    s.engine = s.fallback
    s.fallback = None
    if s.engine in engines.names(engines.SERVE) and engines.get(s.engine).env_script is None:
        s.python, s.extra_args, s.dtype = "python", [], None  # the project's own environment takes no engine flags


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
    check(
        list(cfg.stages) == list(STAGES[: len(cfg.stages)]) and cfg.stages,
        f"stages={cfg.stages}: expected a non-empty prefix of {list(STAGES)}, e.g. [extract] or [extract, train]",
    )
    try:
        layer_contract.validate_canonical(captured_layers(cfg), t.num_hidden_layers, key="extract.extra_layers")
    except layer_contract.LayerContractError as exc:
        raise ConfigError(str(exc)) from None
    check_data(cfg.data)
    r = cfg.data.regenerate
    check(r.max_new_tokens >= 1, f"data.regenerate.max_new_tokens={r.max_new_tokens}: expected >= 1")
    check(r.temperature >= 0, f"data.regenerate.temperature={r.temperature}: expected >= 0 (0 = greedy)")
    check(r.batch_size >= 1, f"data.regenerate.batch_size={r.batch_size}: expected >= 1")
    check_regenerate(cfg)
    check(
        cfg.extract.teacher in layer_contract.TEACHER_KINDS,
        f"extract.teacher={cfg.extract.teacher!r}: expected one of {layer_contract.TEACHER_KINDS}",
    )
    check(cfg.extract.dtype in DTYPES, f"extract.dtype={cfg.extract.dtype!r}: expected one of {DTYPES}")
    check_extract_engine(cfg)
    check(cfg.draft.torch_dtype in DTYPES, f"draft.torch_dtype={cfg.draft.torch_dtype!r}: expected one of {DTYPES}")
    check(cfg.train.ttt_steps >= 1, f"train.ttt_steps={cfg.train.ttt_steps}: expected >= 1")
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
        bool(s.concurrency) and min(s.concurrency) >= 1,
        f"serve.concurrency={s.concurrency}: expected a non-empty list of levels >= 1",
    )
    engines.get(s.engine).check_config(cfg)
    check(
        s.fallback is None or s.fallback in serving,
        f"serve.fallback={s.fallback!r}: expected null or one of {serving}",
    )
    try:
        layer_contract.to_engine_ids(s.engine, cfg.aux_layers, t.num_hidden_layers, t.family, s.engine_version)
    except layer_contract.LayerContractError as exc:
        raise ConfigError(f"aux_layers={cfg.aux_layers} cannot be served by serve.engine={s.engine}: {exc}") from None


PRECISIONS = ("auto", "float32", "bfloat16")


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


def tasks_per_node(cfg: RootConfig, stage: str) -> int:
    """The stage's processes per node: its config's, or one per GPU for data-parallel stages (one on a CPU node),
    one for eval and serve."""
    r = getattr(cfg, stage).resources
    if r.tasks_per_node is not None:
        return r.tasks_per_node
    return max(1, r.gpus_per_node) if stage in ("extract", "train") else 1


def world_size(cfg: RootConfig, stage: str) -> int:
    return getattr(cfg, stage).resources.nodes * tasks_per_node(cfg, stage)


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


def one_pass(cfg: RootConfig) -> bool:
    """Whether vLLM answers each prompt and captures prompt plus answer in one request (extract.engine=vllm)."""
    return cfg.data.regenerate.enabled and cfg.data.regenerate.engine == "one_pass"


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


def check_speculative_args(s: ServeConfig) -> None:
    """EAGLE's steps / topk / draft tokens as SGLang takes them; `validate` and the SGLang launcher both call it."""
    if s.num_steps < 1:
        raise ConfigError(f"serve.num_steps={s.num_steps}: expected >= 1")
    if s.eagle_topk < 1:
        raise ConfigError(f"serve.eagle_topk={s.eagle_topk}: expected >= 1")
    if s.eagle_topk == 1 and s.num_draft_tokens != s.num_steps + 1:
        raise ConfigError(
            f"serve.num_draft_tokens={s.num_draft_tokens}: with serve.eagle_topk=1 SGLang silently replaces it by "
            f"serve.num_steps+1={s.num_steps + 1}; set serve.num_draft_tokens={s.num_steps + 1} "
            "so the config says what runs"
        )
    if s.num_draft_tokens < 2:
        raise ConfigError(
            f"serve.num_draft_tokens={s.num_draft_tokens}: expected >= 2 "
            "(the verified root plus at least one draft token)"
        )


def extract_storage(cfg: RootConfig) -> dict[str, Any]:
    """What the extract stage will write, at most: every conversation at `data.max_seq_len` tokens, each token
    with K captured states and the teacher state of `target.hidden_size` in `extract.dtype`, plus its id and mask."""
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.extract.dtype]
    states = len(captured_layers(cfg)) + 1
    per_token = states * cfg.target.hidden_size * dtype_bytes + 5  # int32 id + uint8 loss mask
    conversations = cfg.data.max_train_conversations + cfg.data.max_val_conversations
    tokens = conversations * cfg.data.max_seq_len
    return {
        "conversations": conversations,
        "max_tokens": tokens,
        "states_per_token": states,
        "bytes_per_token": per_token,
        "max_bytes": tokens * per_token,
        "limit_bytes": cfg.extract.max_bytes,
    }


def captured_layers(cfg: RootConfig) -> list[int]:
    """What extraction captures: the stage's layers plus `extract.extra_layers`, ascending."""
    return sorted(set(cfg.extract.layers) | set(cfg.extract.extra_layers))

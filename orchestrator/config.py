"""Typed schema of the composed config, and its validation.

The Hydra tree under `conf/` holds values only; this module holds the types. `load()` merges a composed config
into the schema (unknown keys and wrong types fail there, naming the key), resolves the `${aux_layers}`
interpolations, and runs the cross-field checks that no type can express. Everything downstream receives a
`RootConfig` object, never a DictConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from orchestrator import layers as layer_contract

STAGES = ("extract", "train", "eval", "serve")
FAMILIES = ("llama", "deepseek_v3", "kimi_k25")
ENGINES = ("reference", "sglang")
CLUSTERS = ("local", "debug", "slurm")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key, the value and what is allowed."""


@dataclass
class Resources:
    """What one stage job asks of the cluster."""

    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    mem_gb: int = 8
    timeout_min: int = 60


@dataclass
class TinySpec:
    """How to build a tiny target when no model path is given."""

    arch: str = "llama"
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


@dataclass
class TargetConfig:
    name: str = MISSING
    family: str = MISSING
    num_hidden_layers: int = MISSING
    hidden_size: int = MISSING
    vocab_size: int = MISSING
    max_position_embeddings: int = MISSING
    # A local HF model directory. None: build the tiny target described by `tiny`.
    path: Optional[str] = None
    tiny: Optional[TinySpec] = None
    trust_remote_code: bool = False
    # The architecture name of the target's HF config (recorded in plans and draft configs).
    architecture: str = MISSING
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None


@dataclass
class RegenerateConfig:
    """Replace the assistant turns by the target's own responses to the same prompts (SpecForge's
    regeneration), so the draft learns the text the target produces when served, not the data set's."""

    enabled: bool = False
    max_new_tokens: int = 128
    # 0: greedy, what the serve stage benchmarks; > 0 samples (seeded).
    temperature: float = 0.0
    batch_size: int = 64


@dataclass
class DataConfig:
    name: str = "stdlib_chat"
    max_files: Optional[int] = None
    max_train_conversations: int = 2000
    max_val_conversations: int = 200
    max_seq_len: int = 512
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)


@dataclass
class DraftConfig:
    """The EAGLE-3 draft's shape. `hidden_size`/`intermediate_size`/vocab None: take the target's."""

    num_aux_layers: int = 3
    hidden_size: Optional[int] = None
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: Optional[int] = None
    intermediate_size: Optional[int] = None
    draft_vocab_size: Optional[int] = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: Optional[int] = None
    torch_dtype: str = "bfloat16"


@dataclass
class ExtractConfig:
    layers: list[int] = MISSING
    # Also capture these (e.g. the union of a sweep's aux_layers): sweep points then share one extraction
    # and each training reads its own subset.
    extra_layers: list[int] = field(default_factory=list)
    teacher: str = "post_norm"
    dtype: str = "bfloat16"
    shard_conversations: int = 256
    batch_size: int = 8
    resources: Resources = field(default_factory=Resources)


@dataclass
class TrainConfig:
    layers: list[int] = MISSING
    ttt_steps: int = 7
    epochs: int = 2
    max_steps: Optional[int] = None
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 0.5
    step_weight_decay: float = 0.8
    autocast_bf16: str = "auto"
    checkpoint_every: int = 100
    val_every: int = 100
    log_every: int = 10
    seed: int = 0
    threads: Optional[int] = None
    resources: Resources = field(default_factory=Resources)


@dataclass
class EvalConfig:
    layers: list[int] = MISSING
    draft_steps: int = 3
    max_conversations: int = 64
    prompts: int = 16
    max_new_tokens: int = 64
    acc_tolerance: float = 0.03
    resources: Resources = field(default_factory=Resources)


@dataclass
class ServeConfig:
    layers: list[int] = MISSING
    engine: str = "reference"
    sglang_version: str = "0.5.23"
    # Python of the separate serving environment (sglang never lives in the project's environment).
    python: str = "python"
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4
    tp_size: int = 1
    mem_fraction_static: Optional[float] = None
    dtype: Optional[str] = None
    cuda_graph_max_bs_decode: Optional[int] = None
    extra_args: list[str] = field(default_factory=list)
    prompts: int = 16
    max_new_tokens: int = 64
    concurrency: list[int] = field(default_factory=lambda: [1])
    # Passes over the prompt set per concurrency level; tok/s is the median pass (timing noise), and every
    # pass must produce the same greedy outputs.
    repeats: int = 1
    startup_timeout_s: float = 120.0
    request_timeout_s: float = 120.0
    accept_length_tolerance: float = 0.10
    # Refuse to serve a draft whose config ids do not capture the layers it was trained on.
    guard: bool = True
    threads: Optional[int] = None
    resources: Resources = field(default_factory=Resources)


@dataclass
class ClusterConfig:
    kind: str = "local"
    # Slurm site settings (ignored by local/debug).
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    setup: list[str] = field(default_factory=list)
    wait: bool = False


@dataclass
class TrackingConfig:
    uri: Optional[str] = None
    experiment: str = "eagle-orchestrator"


@dataclass
class RootConfig:
    aux_layers: list[int] = MISSING
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    dry_run: bool = False
    # Run only the preflight checks (config, and any artifacts the run would use or `check_draft`) and report.
    check: bool = False
    check_draft: Optional[str] = None
    run_name: str = "run"
    seed: int = 0
    outputs_dir: str = "outputs"
    run_dir: Optional[str] = None
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

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
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"config key {key!r}: {msg}" if key else f"config: {msg}") from None
    validate(root)
    return root


def validate(cfg: RootConfig) -> None:
    """Cross-field checks, each failing with the key, the value and what is allowed."""

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    t = cfg.target
    check(t.family in FAMILIES, f"target.family={t.family!r}: expected one of {FAMILIES}")
    check(t.num_hidden_layers >= 2, f"target.num_hidden_layers={t.num_hidden_layers}: expected >= 2")
    check(t.path is not None or t.tiny is not None, f"target {t.name!r}: set target.path (an HF model dir) or target.tiny")
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
    r = cfg.data.regenerate
    check(r.max_new_tokens >= 1, f"data.regenerate.max_new_tokens={r.max_new_tokens}: expected >= 1")
    check(r.temperature >= 0, f"data.regenerate.temperature={r.temperature}: expected >= 0 (0 = greedy)")
    check(r.batch_size >= 1, f"data.regenerate.batch_size={r.batch_size}: expected >= 1")
    check(cfg.extract.teacher in layer_contract.TEACHER_KINDS, f"extract.teacher={cfg.extract.teacher!r}: expected one of {layer_contract.TEACHER_KINDS}")
    check(cfg.extract.dtype in DTYPES, f"extract.dtype={cfg.extract.dtype!r}: expected one of {DTYPES}")
    check(cfg.draft.torch_dtype in DTYPES, f"draft.torch_dtype={cfg.draft.torch_dtype!r}: expected one of {DTYPES}")
    check(cfg.train.ttt_steps >= 1, f"train.ttt_steps={cfg.train.ttt_steps}: expected >= 1")
    check(cfg.serve.engine in ENGINES, f"serve.engine={cfg.serve.engine!r}: expected one of {ENGINES}")
    check(cfg.cluster.kind in CLUSTERS, f"cluster.kind={cfg.cluster.kind!r}: expected one of {CLUSTERS}")
    vd = cfg.draft.draft_vocab_size
    check(vd is None or 0 < vd <= t.vocab_size, f"draft.draft_vocab_size={vd}: expected 1..target.vocab_size={t.vocab_size} or null")
    s = cfg.serve
    check(s.num_steps >= 1, f"serve.num_steps={s.num_steps}: expected >= 1")
    check(s.repeats >= 1, f"serve.repeats={s.repeats}: expected >= 1")
    check(s.prompts >= 1 and s.max_new_tokens >= 1, f"serve.prompts={s.prompts}, serve.max_new_tokens={s.max_new_tokens}: expected >= 1 each")
    check(bool(s.concurrency) and min(s.concurrency) >= 1, f"serve.concurrency={s.concurrency}: expected a non-empty list of levels >= 1")
    check(s.eagle_topk >= 1, f"serve.eagle_topk={s.eagle_topk}: expected >= 1")
    if s.eagle_topk == 1:
        check(
            s.num_draft_tokens == s.num_steps + 1,
            f"serve.num_draft_tokens={s.num_draft_tokens}: with serve.eagle_topk=1 SGLang forces it to "
            f"serve.num_steps+1={s.num_steps + 1}; set that value so the config says what runs",
        )
    if s.engine == "reference":
        check(s.eagle_topk == 1, f"serve.eagle_topk={s.eagle_topk}: the reference engine drafts a chain (topk 1)")
    try:
        layer_contract.to_engine_ids(s.engine, cfg.aux_layers, t.num_hidden_layers, t.family, s.sglang_version)
    except layer_contract.LayerContractError as exc:
        raise ConfigError(f"aux_layers={cfg.aux_layers} cannot be served by serve.engine={s.engine}: {exc}") from None


def captured_layers(cfg: RootConfig) -> list[int]:
    """What extraction captures: the stage's layers plus `extract.extra_layers`, ascending."""
    return sorted(set(cfg.extract.layers) | set(cfg.extract.extra_layers))

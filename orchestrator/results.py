"""Typed stage results: what each stage's `run` returns, and what tracking, the run's summary and the layer search
read, by attribute.

A stage's result is stored flat in its manifest's "result" (and, with "cached", in summary.json): keys such as
`acc_0`, `acc_1`, ... that runs of earlier code wrote too, and that a cached stage's manifest keeps for every later
run to read. The dataclasses here give the code named, typed fields (accuracies by position as lists, not one key per
position), while the JSON stays what it was: `to_dict` writes the flat object the stage has always written, and
`from_dict` reads any such object back key for key. A result read from a manifest and written again is the same
object, in the same key order, whatever code wrote it: keys no field names are kept in `extra`, and the keys read,
None-valued ones included, are remembered and written again in their order.

Only the standard library is imported: stages, tracking, the pipeline and the search all read this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping


@dataclass
class StageResult:
    """What every stage's result has: where it ran, the figures the console summary prints, and whether this run
    took it from the cache."""

    compute: dict[str, Any] | None = None  # `Compute.describe()` of the job that ran the stage
    headline: dict[str, Any] | None = None  # what the console summary prints for the stage
    cached: bool = False  # taken from the cache by this run (pipeline.finish; written to summary.json only)
    extra: dict[str, Any] = field(default_factory=dict)  # keys of a stored result that no field names
    # the keys of the dict it was read from, in their order (None when a stage built it): see `to_dict`
    _keys: tuple[str, ...] | None = field(default=None, init=False, repr=False, compare=False)

    STAGE: ClassVar[str] = ""

    def _flat(self) -> dict[str, Any]:
        """Every field under its stored key, in the order the stage writes them (None for an unset field)."""
        raise NotImplementedError

    @classmethod
    def _take(cls, rest: dict[str, Any]) -> dict[str, Any]:
        """The fields' values from a stored result, popped from `rest` (what is left goes to `extra`)."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """The flat dict the stage writes to its manifest: a stage's result less its unset (None) fields; a result
        read by `from_dict`, the keys it was read with, in their order, and any field set since."""
        flat = self._flat() | self.extra | ({"cached": True} if self.cached else {})
        if self._keys is None:
            return {k: v for k, v in flat.items() if v is not None}
        out = {k: flat[k] for k in self._keys if k in flat}
        return out | {k: v for k, v in flat.items() if k not in out and v is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        """A stored result (a manifest's "result", a summary's stage), whatever code wrote it."""
        rest = dict(d)
        fields = cls._take(rest)
        common = {"compute": rest.pop("compute", None), "headline": rest.pop("headline", None)}
        result = cls(**fields, **common, cached=bool(rest.pop("cached", False)), extra=rest)
        result._keys = tuple(d)
        return result


def _positions(rest: dict[str, Any], stem: str) -> list[Any]:
    """`stem0`, `stem1`, ... popped from `rest` as a list, up to the first index missing."""
    out: list[Any] = []
    while f"{stem}{len(out)}" in rest:
        out.append(rest.pop(f"{stem}{len(out)}"))
    return out


def _pop(rest: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: rest.pop(k, None) for k in keys}


@dataclass
class ExtractResult(StageResult):
    """The extraction's figures over all ranks: tokens, the extraction's own speed (its slowest rank's, less the
    regeneration's seconds), bytes per token."""

    tokens: int | None = None  # in the train and val splits
    tokens_extracted_now: int | None = None  # by this job (0 when every shard was already done)
    tokens_per_s: float | None = None  # hidden-state extraction alone
    regenerate_s: float | None = None  # the target's own responses, before extraction
    bytes_per_token: float | None = None
    loss_tokens_per_sequence: float | None = None  # in the train split
    output: str | None = None  # the extraction's folder

    STAGE: ClassVar[str] = "extract"
    _FIELDS: ClassVar[tuple[str, ...]] = (
        "tokens", "tokens_extracted_now", "tokens_per_s", "regenerate_s", "bytes_per_token",
        "loss_tokens_per_sequence", "output",
    )  # fmt: skip

    def _flat(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._FIELDS} | {"compute": self.compute, "headline": self.headline}

    @classmethod
    def _take(cls, rest: dict[str, Any]) -> dict[str, Any]:
        return _pop(rest, *cls._FIELDS)

    def make_headline(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "tokens_per_s": self.tokens_per_s, "bytes_per_token": self.bytes_per_token}


@dataclass
class TrainResult(StageResult):
    """The exported draft and its final validation, the draft drafting from its own tokens as served; an imported
    draft (train.from_draft) has no validation."""

    draft_dir: str | None = None
    eagle_aux_hidden_state_layer_ids: list[int] | None = None  # in serve.engine's convention
    imported_from: str | None = None  # train.from_draft
    val_step: int | None = None  # the training step of the final validation (none when it ran no step)
    val_loss: float | None = None
    val_acc: list[float] = field(default_factory=list)  # by TTT position (val_acc_0, val_acc_1, ...)
    val_full_acc: list[float] = field(default_factory=list)  # cumulative, by position (val_full_acc_k)
    val_expected_accept_length: float | None = None
    # train.states=stream: what the stream cost (orchestrator/states/stream.py, StreamedSplit.report)
    stream: dict[str, Any] | None = None

    STAGE: ClassVar[str] = "train"

    def _flat(self) -> dict[str, Any]:
        out = {
            "draft_dir": self.draft_dir,
            "eagle_aux_hidden_state_layer_ids": self.eagle_aux_hidden_state_layer_ids,
            "imported_from": self.imported_from,
            "val_step": self.val_step,
            "val_loss": self.val_loss,
        }
        for k in range(max(len(self.val_acc), len(self.val_full_acc))):
            out |= {f"val_acc_{k}": self.val_acc[k]} if k < len(self.val_acc) else {}
            out |= {f"val_full_acc_{k}": self.val_full_acc[k]} if k < len(self.val_full_acc) else {}
        out["val_expected_accept_length"] = self.val_expected_accept_length
        out |= {"stream": self.stream} if self.stream is not None else {}  # offline results keep their keys
        return out | {"headline": self.headline, "compute": self.compute}

    @classmethod
    def _take(cls, rest: dict[str, Any]) -> dict[str, Any]:
        out = _pop(rest, "draft_dir", "eagle_aux_hidden_state_layer_ids", "imported_from", "val_step", "val_loss")
        out |= {"val_acc": _positions(rest, "val_acc_"), "val_full_acc": _positions(rest, "val_full_acc_")}
        return out | _pop(rest, "val_expected_accept_length", "stream")

    @classmethod
    def from_validation(cls, final: Mapping[str, float], **fields: Any) -> TrainResult:
        """A trained draft's result from its final validation (`stages.train.evaluate`: loss, acc_k, full_acc_k,
        expected_accept_length; and the step, when it is the last entry of the validation history)."""
        val = dict(final)
        return cls(
            val_step=val.get("step"),
            val_loss=val.get("loss"),
            val_acc=_positions(val, "acc_"),
            val_full_acc=_positions(val, "full_acc_"),
            val_expected_accept_length=val.get("expected_accept_length"),
            **fields,
        )

    def make_headline(self) -> dict[str, Any]:
        """The first three positions' accuracies and the expected accept length, under validation's own names."""
        head = {f"acc_{k}": a for k, a in enumerate(self.val_acc[:3])}
        if self.val_expected_accept_length is not None:
            head["expected_accept_length"] = self.val_expected_accept_length
        return head


@dataclass
class _Checked(StageResult):
    """A stage that checks train/serve agreement: whether it found a mismatch, and each one in words."""

    mismatch: bool | None = None
    mismatch_flags: list[str] | None = None


@dataclass
class EvalResult(_Checked):
    """The exported draft run as served against the live target: accuracy by draft position on the validation
    sequences, paired with the same draft fed its training states, and the simulated accept length. A draft that
    cannot consume what serving captures has none of the measured fields."""

    served_layers: list[int] | None = None  # canonical, as serving captures them for the draft config's ids
    trained_layers: list[int] | None = None
    draft_steps: int | None = None
    draft_dtype: str | None = None
    positions: list[int] = field(default_factory=list)  # scored positions, by draft position
    acc: list[float] = field(default_factory=list)  # fed what serving captures, by draft position
    full_acc: list[float] = field(default_factory=list)  # every position up to k right
    trained_states_acc: list[float] = field(default_factory=list)  # fed the extracted states
    acc_gap: list[float] = field(default_factory=list)  # trained_states_acc - acc
    acc_gap_se: list[float] = field(default_factory=list)  # its standard error over sequences
    expected_accept_length: float | None = None
    completion_tokens: int | None = None
    verify_passes: int | None = None
    accept_histogram: list[int] | None = None
    accept_rate_by_position: list[float] | None = None
    mean_accepted_per_cycle: float | None = None
    # of its prompts, those whose continuation is the extraction's regenerated answer (`answered_by_extraction`)
    continuations_reused: int | None = None
    sequences: int | None = None
    # the served states' relative L2 distance from the trained ones (stages/eval.py, `text_accuracy`)
    served_states_rel_diff: float | None = None
    train_val_acc: list[float | None] | None = None  # training's validation accuracies, by position
    engine: str | None = None  # what ran the live target (eval.engine, as installed)
    sequences_from: str | None = None  # what the validation sequences are (`stages.eval.sequences_from`)
    # how the expected accept length's continuations were decoded (`results.GREEDY`), whatever the training data's
    # sampling (data.regenerate.temperature)
    decoding: str | None = None

    STAGE: ClassVar[str] = "eval"
    _BY_POSITION: ClassVar[tuple[str, ...]] = ("acc", "full_acc", "trained_states_acc", "acc_gap", "acc_gap_se")
    _MEASURED: ClassVar[tuple[str, ...]] = (
        "expected_accept_length", "completion_tokens", "verify_passes", "accept_histogram", "accept_rate_by_position",
        "mean_accepted_per_cycle", "continuations_reused", "sequences", "served_states_rel_diff", "train_val_acc",
    )  # fmt: skip

    def _flat(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("served_layers", "trained_layers", "draft_steps", "draft_dtype")}
        out["compute"] = self.compute
        out["engine"] = self.engine
        out["sequences_from"] = self.sequences_from
        out["decoding"] = self.decoding
        out |= {f"positions_{k}": n for k, n in enumerate(self.positions)}
        for k in range(max(len(getattr(self, name)) for name in self._BY_POSITION)):
            out |= {f"{name}_{k}": getattr(self, name)[k] for name in self._BY_POSITION if k < len(getattr(self, name))}
        out |= {k: getattr(self, k) for k in self._MEASURED}
        return out | {"mismatch": self.mismatch, "mismatch_flags": self.mismatch_flags, "headline": self.headline}

    @classmethod
    def _take(cls, rest: dict[str, Any]) -> dict[str, Any]:
        out = _pop(rest, "served_layers", "trained_layers", "draft_steps", "draft_dtype", "mismatch", "mismatch_flags")
        out["engine"] = rest.pop("engine", None)
        out["sequences_from"] = rest.pop("sequences_from", None)
        out["decoding"] = rest.pop("decoding", None)
        out["positions"] = _positions(rest, "positions_")
        out |= {name: _positions(rest, f"{name}_") for name in cls._BY_POSITION}
        return out | _pop(rest, *cls._MEASURED)

    def make_headline(self) -> dict[str, Any]:
        head: dict[str, Any] = {"acc_0": self.acc[0]} if self.acc else {}
        head |= {"trained_states_acc_0": self.trained_states_acc[0]} if self.trained_states_acc else {}
        if self.served_states_rel_diff is not None:  # how far what serving feeds is from what training read
            head["served_states_rel_diff"] = self.served_states_rel_diff
        if self.expected_accept_length is not None:
            head["expected_accept_length"] = self.expected_accept_length
            head |= {"decoding": self.decoding} if self.decoding else {}
        head |= {"sequences_from": self.sequences_from} if self.sequences_from else {}
        return head | {"mismatch": self.mismatch}


# How serve measures and eval simulates every answer: the target's and the draft's greedy tokens. Training data may
# be sampled (data.regenerate.temperature, top_p); the accept lengths are measured greedy all the same.
GREEDY = "greedy (temperature 0)"

# what an engine reports that the client cannot see, per server (vLLM: from its /metrics)
ENGINE_LATENCY_SUFFIXES = ("ttft_mean_s", "itl_mean_s")


@dataclass
class ServeResult(_Checked):
    """The target served without and with the draft: the first concurrency level's speeds and accept length, every
    level's row, the greedy outputs' agreement, how and by whom the servers were measured, and what the engine
    counted."""

    baseline_tok_s: float | None = None
    spec_tok_s: float | None = None
    speedup: float | None = None
    accept_length: float | None = None  # None: the target ended every answer before a verify pass
    # `baseline_ttft_mean_s`, `spec_itl_mean_s`, ...: the first level's, where the engine reports them
    engine_latency: dict[str, float] = field(default_factory=dict)
    greedy_outputs_identical: bool | None = None
    greedy_differing_token_rate: float | None = None
    greedy_check: str | None = None
    # how every answer here was decoded, so each accept length and speed says at which temperature it was measured
    decoding: str | None = None
    per_concurrency: list[dict[str, Any]] | None = None  # one row per concurrency level, the first the headline's
    engine: str | None = None
    engine_version: str | None = None
    id_rules: str | None = None
    engine_fallback: str | None = None
    servers_started: dict[str, bool] | None = None
    # per started server: startup_s, waited_s, warmup_s, measure_s, count_s (stages/serve.py, run_server)
    server_seconds: dict[str, dict[str, float]] | None = None
    measured_by: dict[str, list[dict[str, Any]]] | None = None
    serve_keys: dict[str, str] | None = None
    baseline_from: str | None = None  # a baseline another machine or day measured
    passes_apart: str | None = None  # passes divided or pooled that were measured more than 10 minutes apart
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    load_check: dict[str, Any] | None = None  # the engine's loader on the draft, stored as `<engine>_load_check`
    accept_rate_by_position: list[float] | None = None
    accept_histogram: list[int] | None = None
    acceptance_by_position: list[float] | None = None
    phase_ms: dict[str, float] = field(default_factory=dict)  # `<mode>_<phase>_ms`: the serve cycle's profile
    eval_expected_accept_length: float | None = None
    accept_length_rel_diff: float | None = None
    # the speculative server's counted requests, untimed (serve.accept_prompts): the accept length over them as the
    # engine counted each, how many, and its 95% interval (a bootstrap over requests)
    accept_length_counted: float | None = None
    accept_length_requests: int | None = None
    accept_length_ci95: list[float] | None = None
    # the same over the first eval.prompts of them, the prompts eval predicts it on: the figure held to eval's
    accept_length_eval_prompts: float | None = None
    accept_length_eval_prompts_ci95: list[float] | None = None

    STAGE: ClassVar[str] = "serve"
    _HEAD: ClassVar[tuple[str, ...]] = ("baseline_tok_s", "spec_tok_s", "speedup", "accept_length")
    _AGREEMENT: ClassVar[tuple[str, ...]] = (
        "greedy_outputs_identical", "greedy_differing_token_rate", "greedy_check", "decoding", "per_concurrency",
        "engine", "engine_version", "id_rules", "engine_fallback", "servers_started", "server_seconds", "measured_by",
        "serve_keys", "baseline_from", "passes_apart", "eagle_aux_hidden_state_layer_ids",
    )  # fmt: skip
    _COUNTED: ClassVar[tuple[str, ...]] = ("accept_rate_by_position", "accept_histogram", "acceptance_by_position")
    _INTERVAL: ClassVar[tuple[str, ...]] = (
        "accept_length_counted", "accept_length_requests", "accept_length_ci95", "accept_length_eval_prompts",
        "accept_length_eval_prompts_ci95",
    )  # fmt: skip

    def _flat(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self._HEAD} | self.engine_latency
        out |= {k: getattr(self, k) for k in self._AGREEMENT} | {"compute": self.compute}
        out |= {f"{self.engine}_load_check": self.load_check} if self.load_check is not None else {}
        out |= {k: getattr(self, k) for k in self._COUNTED} | self.phase_ms
        out |= {"eval_expected_accept_length": self.eval_expected_accept_length}
        out |= {"accept_length_rel_diff": self.accept_length_rel_diff}
        out |= {k: getattr(self, k) for k in self._INTERVAL}
        return out | {"mismatch": self.mismatch, "mismatch_flags": self.mismatch_flags, "headline": self.headline}

    @classmethod
    def _take(cls, rest: dict[str, Any]) -> dict[str, Any]:
        out = _pop(rest, *cls._HEAD, *cls._AGREEMENT, *cls._COUNTED, "mismatch", "mismatch_flags")
        out |= _pop(rest, "eval_expected_accept_length", "accept_length_rel_diff", *cls._INTERVAL)
        out["engine_latency"] = {k: rest.pop(k) for k in list(rest) if k.endswith(ENGINE_LATENCY_SUFFIXES)}
        out["phase_ms"] = {k: rest.pop(k) for k in list(rest) if k.endswith("_ms")}
        if isinstance(rest.get(f"{out['engine']}_load_check"), dict):
            out["load_check"] = rest.pop(f"{out['engine']}_load_check")
        return out

    def make_headline(self) -> dict[str, Any]:
        """The speeds, accept lengths and the outputs' agreement, the engine that served them and, where it stood in
        for the one asked for, why; beside them, a baseline measured elsewhere."""
        head = {k: getattr(self, k) for k in (*self._HEAD, "eval_expected_accept_length", "greedy_outputs_identical")}
        head |= {"decoding": self.decoding} if self.decoding else {}
        head["engine"] = " ".join(str(v) for v in (self.engine, self.engine_version) if v) or None
        if self.engine_fallback:
            head["engine_fallback"] = self.engine_fallback
        if self.accept_length_counted is not None:
            head |= {k: getattr(self, k) for k in self._INTERVAL}
        head |= {"baseline_from": self.baseline_from} if self.baseline_from is not None else {}
        return head | ({"passes_apart": self.passes_apart} if self.passes_apart is not None else {})


RESULTS: dict[str, type[StageResult]] = {c.STAGE: c for c in (ExtractResult, TrainResult, EvalResult, ServeResult)}


def load(stage: str, d: Mapping[str, Any]) -> StageResult:
    """`stage`'s result read from its stored dict (a manifest's "result", a summary's stage)."""
    if stage not in RESULTS:
        raise ValueError(f"no result type for stage {stage!r}; stages: {', '.join(RESULTS)}")
    return RESULTS[stage].from_dict(d)


def typed(stage: str, result: StageResult | Mapping[str, Any]) -> StageResult:
    """`result` as `stage`'s typed result: as it is, or read from its stored dict."""
    return result if isinstance(result, StageResult) else load(stage, result)

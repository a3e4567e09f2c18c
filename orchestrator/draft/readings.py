"""Which target layers a draft reads: as each engine reads its config, and as its weights say it was trained.

A draft trained elsewhere (SpecForge, speculators, a published checkpoint) carries its ids in some engine's
convention, or none, and no record of the layers it was trained on. Two answers, for `check_draft=<dir>`:

    engine_readings   the canonical states each engine, version and runner would feed it: where the engine
                      reads the ids (`Engine.config_ids`) decoded by its rule for the family at that version
    find_trained      the layers its weights agree with: the draft fed the target's own states under each
                      candidate reading (every engine reading, and it with every id shifted by -1 and +1), scored by
                      loss_0, its first step's cross-entropy against the target's distribution over the draft
                      vocabulary (what EAGLE-3 training minimizes), and by acc_0 (the first draft token's top-1
                      agreement with the target's greedy token), each with its standard error; a reading is named
                      only when its loss_0 is below every other's by `MARGIN` standard errors of the paired
                      difference, with sequences as the units (a draft is right or wrong on runs of tokens, so
                      tokens are not independent), and by `MIN_LEAD` of its loss_0

Why loss_0 decides and acc_0 is only reported: where adjacent layers' states differ little (the tiny Llama's), a
draft's top-1 token barely moves when it is fed a neighbouring layer: the demo's draft's acc_0 one layer above its
trained layers is within a third of a standard error of its acc_0 on them; the distribution it was fitted to moves
measurably, and loss_0 names the trained layers by 20 standard errors (docs/layers.md's table, printed by
scripts/find_trained_layers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from orchestrator import engines
from orchestrator import layers as layer_contract

# A reading is named as the trained one only when it leads every other by this many standard errors,
MARGIN = 3.0
# and by at least this share of its loss_0. A lead smaller than that is a tie however many standard errors it is:
# a draft that learned little (the test suite's 16-step draft on its weak tiny target: loss_0 6.09, leads of 0.0001,
# 0.002%) gives every reading nearly the same loss, and its tiny, consistent differences then name a wrong reading
# at 12.7 standard errors over 48 sequences. The demo's draft leads by 0.0253 on 4.3146 (0.59%).
MIN_LEAD = 1e-3


@dataclass(frozen=True)
class Reading:
    engine: str
    version: str
    runner: str
    source: str  # where the ids came from: a config key, or the engine's defaults
    ids: tuple[int, ...]
    layers: tuple[int, ...] | None  # canonical states fed; None: the rule cannot decode them (named in `error`)
    error: str = ""

    @property
    def label(self) -> str:
        runner = "" if self.runner == "-" else f" {self.runner}"
        return f"{self.engine} {self.version}{runner}"


def engine_readings(conf: dict[str, Any], num_layers: int, family: str, versions: dict[str, str]) -> list[Reading]:
    """Every serving engine's reading of the draft config, at each version whose rule differs (`versions`: the
    pinned version of each engine's convention, `{"sglang": "0.5.23", "vllm": "0.32.0"}`)."""
    out = []
    for name in engines.names(engines.SERVE):
        engine = engines.get(name)
        if engine.convention != name:  # the reference engine reads SGLang's convention: SGLang's rows say it
            continue
        for label, version in engine.rule_versions(family, versions[name]).items():
            for runner, source, ids in engine.config_ids(conf, num_layers):
                try:
                    rule = engine.id_rule(family, version)
                    layers = tuple(layer_contract.captured_layers(rule, ids, num_layers))
                    error = "" if len(layers) == len(ids) else f"captures {len(layers)} states for {len(ids)} ids"
                except layer_contract.LayerContractError as exc:
                    layers, error = None, str(exc)
                out.append(Reading(name, label, runner, source, tuple(ids), layers, error))
    return out


def candidates(readings: list[Reading], num_layers: int, num_aux: int) -> dict[tuple[int, ...], list[str]]:
    """The canonical layer lists to try, each with the readings it comes from: every engine reading of the right
    length, and it with every id shifted by -1 and by +1 (where valid): the engines' conventions differ from one
    another by such shifts, so a reading of a convention nobody listed is tried too."""
    out: dict[tuple[int, ...], list[str]] = {}
    for r in readings:
        if r.layers is None or len(r.layers) != num_aux:
            continue
        out.setdefault(r.layers, []).append(r.label)
        for shift in (-1, 1):
            layers = tuple(k + shift for k in r.layers)
            try:
                layer_contract.validate_canonical(layers, num_layers)
            except layer_contract.LayerContractError:
                continue
            out.setdefault(layers, [])
    return out


@dataclass(frozen=True)
class SequenceScore:
    """One sequence under one reading: its first draft tokens right, its scored positions, and its loss_0 summed."""

    right: int
    positions: int
    loss: float


@torch.no_grad()
def score(model, draft, options: list[tuple[int, ...]], sequences, device: torch.device) -> list[dict[str, Any]]:
    """acc_0 and loss_0 of `draft` fed the target's states at each option's layers, on `sequences` (token ids and
    loss masks): per option each statistic, its standard error, and the per-sequence scores for paired
    comparisons. The target's states are captured once per sequence, at the union of the options' layers; the
    target's distribution over the draft vocabulary is the one training distils (`stages/train.py`: step_loss)."""
    from orchestrator.capture import HiddenStateCapture

    union = sorted({k for layers in options for k in layers})
    column = {k: i for i, k in enumerate(union)}
    kept = torch.arange(draft.d2t.numel(), device=draft.d2t.device) + draft.d2t  # draft id -> target id
    per_option: list[list[SequenceScore]] = [[] for _ in options]
    with HiddenStateCapture(model, union) as capture:
        for input_ids, loss_mask in sequences:
            length = len(input_ids)
            if length < 3:
                continue
            ids = torch.tensor([input_ids], device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0]
            target_argmax = logits.argmax(-1)[1:]
            target_p = torch.softmax(logits[1:, kept.to(logits.device)].float(), dim=-1)
            states = capture.aux()[0]  # [T, len(union) * H]
            capture.clear()
            hidden = states.shape[-1] // len(union)
            by_layer = states.view(length, len(union), hidden)
            mask = torch.tensor(loss_mask[1:], dtype=torch.bool, device=device)  # the predicted token's
            valid = torch.ones(1, length - 1, dtype=torch.bool, device=device)
            for i, layers in enumerate(options):
                aux = by_layer[:-1, [column[k] for k in layers]].flatten(1)[None]
                unrolled = draft.unroll(aux.to(device), ids[:, 1:], valid, 1)
                right = (unrolled.tokens[0][0] == target_argmax) & mask
                loss = -(target_p * torch.log_softmax(unrolled.logits[0][0].float(), dim=-1)).sum(-1)
                per_option[i].append(SequenceScore(int(right.sum()), int(mask.sum()), float(loss[mask].sum())))
    rows = []
    for layers, seqs in zip(options, per_option):
        total = sum(s.positions for s in seqs)
        row: dict[str, Any] = {"layers": list(layers), "positions": total, "per_sequence": seqs}
        for stat, value in (("acc_0", lambda s: s.right), ("loss_0", lambda s: s.loss)):
            mean = sum(value(s) for s in seqs) / total if total else float("nan")
            # sequences as the units: the spread of each sequence's sum around the mean times its positions
            spread = sum((value(s) - mean * s.positions) ** 2 for s in seqs)
            row[stat], row[f"{stat}_se"] = mean, (math.sqrt(spread) / total if total else float("nan"))
        rows.append(row)
    return rows


def paired_se(a: list[SequenceScore], b: list[SequenceScore], stat: str = "loss") -> tuple[float, float]:
    """(the mean of `stat` ("loss" or "right") per position under a minus under b, its standard error) over the
    same sequences, sequences as the units."""
    total = sum(s.positions for s in a)
    diffs = [(getattr(x, stat) - getattr(y, stat), x.positions) for x, y in zip(a, b, strict=True)]
    mean = sum(d for d, _ in diffs) / total
    return mean, math.sqrt(sum((d - mean * n) ** 2 for d, n in diffs)) / total


def verdict(rows: list[dict[str, Any]]) -> tuple[list[int] | None, str]:
    """The reading whose loss_0 is clearly the lowest (its layers), or None, with why in words."""
    ranked = sorted(rows, key=lambda r: r["loss_0"])
    best = ranked[0]
    if len(ranked) == 1:
        return best["layers"], "the only reading"
    # how far each other reading's loss_0 is above the best's, in paired standard errors; the closest decides
    leads = [paired_se(r["per_sequence"], best["per_sequence"]) for r in ranked[1:]]
    closest = min(range(len(leads)), key=lambda i: leads[i][0] / leads[i][1] if leads[i][1] else math.inf)
    diff, se = leads[closest]
    z = diff / se if se else math.inf
    runner_up = ranked[1 + closest]["layers"]
    nearest = min(range(len(leads)), key=lambda i: leads[i][0])
    if z >= MARGIN and leads[nearest][0] < MIN_LEAD * best["loss_0"]:
        return None, (
            f"cannot tell: {best['layers']} has the lowest loss_0 ({best['loss_0']:.4f}), but only "
            f"{leads[nearest][0]:.4f} below {ranked[1 + nearest]['layers']} ({leads[nearest][0] / best['loss_0']:.3%}, "
            f"under {MIN_LEAD:.1%}): the readings feed this draft nearly the same, as for a draft that learned little "
            "or a target whose neighbouring layers' states barely differ"
        )
    if z >= MARGIN:
        return best["layers"], (
            f"its loss_0 is below every other reading's by >= {z:.1f} standard errors (closest: {runner_up}, "
            f"+{diff:.4f})"
        )
    return None, (
        f"cannot tell: {best['layers']} has the lowest loss_0, {diff:.4f} below {runner_up}, {z:.1f} standard "
        f"errors (< {MARGIN:g}); more validation sequences would separate them if they differ"
    )


def find_trained(model, draft, readings: list[Reading], num_layers: int, sequences, device) -> dict[str, Any]:
    """loss_0 and acc_0 under every candidate reading (`candidates`), ranked by loss_0, and the verdict."""
    num_aux = draft.fc.weight.shape[1] // draft.shape.target_hidden_size
    options = candidates(readings, num_layers, num_aux)
    rows = score(model, draft, list(options), sequences, device)
    for row in rows:
        row["readings"] = options[tuple(row["layers"])]
    found, why = verdict(rows)
    ranked = sorted(rows, key=lambda r: r["loss_0"])
    for row in ranked:  # how far above the best, paired over the same sequences
        row["above"], row["above_se"] = paired_se(row["per_sequence"], ranked[0]["per_sequence"])
    return {"found": found, "why": why, "rows": [{k: v for k, v in r.items() if k != "per_sequence"} for r in ranked]}

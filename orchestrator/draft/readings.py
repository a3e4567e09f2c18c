"""Which target layers a draft reads: as each engine reads its config, and as its weights say it was trained.

A draft trained elsewhere (SpecForge, speculators, a published checkpoint) carries its ids in some engine's
convention, or none, and no record of the layers it was trained on. Two answers, for `check_draft=<dir>`:

    engine_readings   the canonical states each engine, version and runner would feed it: where the engine
                      reads the ids (`Engine.config_ids`) decoded by its rule for the family at that version
    find_trained      the layers its weights agree with: acc_0 (the first draft token's top-1 agreement with the
                      target's greedy token) of the draft fed the target's own states under each candidate
                      reading (every engine reading, and it with every id shifted by -1 and +1), with its standard
                      error; a reading is named only when it is ahead of every other by `MARGIN` standard errors
                      of the paired difference, with sequences as the units (a draft is right or wrong on runs of
                      tokens, so tokens are not independent)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from orchestrator import engines
from orchestrator import layers as layer_contract

# A reading is named as the trained one only when it leads every other by this many standard errors.
MARGIN = 3.0


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


@torch.no_grad()
def acc0(model, draft, options: list[tuple[int, ...]], sequences, device: torch.device) -> list[dict[str, Any]]:
    """acc_0 of `draft` fed the target's states at each option's layers, on `sequences` (token ids and loss
    masks): per option the accuracy, its standard error, and per sequence (right, positions) for paired
    comparisons. The target's states are captured once per sequence, at the union of the options' layers."""
    from orchestrator.capture import HiddenStateCapture

    union = sorted({k for layers in options for k in layers})
    column = {k: i for i, k in enumerate(union)}
    per_option: list[list[tuple[int, int]]] = [[] for _ in options]
    with HiddenStateCapture(model, union) as capture:
        for input_ids, loss_mask in sequences:
            length = len(input_ids)
            if length < 3:
                continue
            ids = torch.tensor([input_ids], device=device)
            target_argmax = model(input_ids=ids, use_cache=False).logits.argmax(-1)[0]
            states = capture.aux()[0]  # [T, len(union) * H]
            capture.clear()
            hidden = states.shape[-1] // len(union)
            by_layer = states.view(length, len(union), hidden)
            mask = torch.tensor(loss_mask[1:], dtype=torch.bool, device=device)  # the predicted token's
            valid = torch.ones(1, length - 1, dtype=torch.bool, device=device)
            for i, layers in enumerate(options):
                aux = by_layer[:-1, [column[k] for k in layers]].flatten(1)[None]
                first = draft.unroll(aux.to(device), ids[:, 1:], valid, 1).tokens[0][0]
                right = (first == target_argmax[1:]) & mask
                per_option[i].append((int(right.sum()), int(mask.sum())))
    rows = []
    for layers, seqs in zip(options, per_option):
        right, total = sum(r for r, _ in seqs), sum(n for _, n in seqs)
        p = right / total if total else 0.0
        # sequences as the units: the spread of each sequence's right count around p times its positions
        se = math.sqrt(sum((r - p * n) ** 2 for r, n in seqs)) / total if total else float("nan")
        rows.append({"layers": list(layers), "acc_0": p, "se": se, "positions": total, "per_sequence": seqs})
    return rows


def paired_se(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> tuple[float, float]:
    """(acc_0 of a minus b, its standard error) over the same sequences, sequences as the units."""
    total = sum(n for _, n in a)
    diff = (sum(r for r, _ in a) - sum(r for r, _ in b)) / total
    spread = sum(((ra - rb) - diff * n) ** 2 for (ra, n), (rb, _) in zip(a, b, strict=True))
    return diff, math.sqrt(spread) / total


def verdict(rows: list[dict[str, Any]]) -> tuple[list[int] | None, str]:
    """The reading clearly ahead (its layers), or None, with why in words."""
    ranked = sorted(rows, key=lambda r: -r["acc_0"])
    best = ranked[0]
    if len(ranked) == 1:
        return best["layers"], "the only reading"
    leads = [paired_se(best["per_sequence"], r["per_sequence"]) for r in ranked[1:]]
    closest = min(range(len(leads)), key=lambda i: leads[i][0] / leads[i][1] if leads[i][1] else math.inf)
    diff, se = leads[closest]
    z = diff / se if se else math.inf
    runner_up = ranked[1 + closest]["layers"]
    if z >= MARGIN:
        return best["layers"], f"ahead of every other reading by >= {z:.1f} standard errors (closest: {runner_up})"
    return None, (
        f"cannot tell: {best['layers']} leads {runner_up} by {diff:.4f} acc_0, {z:.1f} standard errors "
        f"(< {MARGIN:g}); more validation sequences would separate them if they differ"
    )


def find_trained(model, draft, readings: list[Reading], num_layers: int, sequences, device) -> dict[str, Any]:
    """acc_0 under every candidate reading (`candidates`), ranked, and the verdict."""
    num_aux = draft.fc.weight.shape[1] // draft.shape.target_hidden_size
    options = candidates(readings, num_layers, num_aux)
    rows = acc0(model, draft, list(options), sequences, device)
    for row in rows:
        row["readings"] = options[tuple(row["layers"])]
    found, why = verdict(rows)
    ranked = sorted(rows, key=lambda r: -r["acc_0"])
    for row in ranked:  # how far behind the leader, paired over the same sequences
        row["behind"], row["behind_se"] = paired_se(ranked[0]["per_sequence"], row["per_sequence"])
    return {"found": found, "why": why, "rows": [{k: v for k, v in r.items() if k != "per_sequence"} for r in ranked]}

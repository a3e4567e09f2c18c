"""Standalone evaluation: the exported draft run exactly as serving runs it, against the live target.

The draft comes from its directory (never the trainer's object), in the dtype its config says serving runs it
in; the target's states are captured where the serving engine captures them for the ids written in the draft
config (decoded through the layer contract), and the draft consumes its own tokens. Two measurements:

  * accuracy per draft position on the validation sequences training validated on (the extraction's token
    ids), paired position by position with the same draft fed the extracted states it was trained on: a gap
    means train and serve feed the draft different inputs (the seed's bug), and nothing else;
  * accept length on the target's own greedy continuations of the serving prompt set, simulated cycle by
    cycle as a chain-drafting server with `draft_steps` steps runs it (completion tokens / verify passes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from orchestrator import engines
from orchestrator.artifacts import ArtifactError, read_manifest, write_json, write_manifest
from orchestrator.compute import Compute
from orchestrator.config import RootConfig
from orchestrator.data import conversations, prompt_ids
from orchestrator.draft import export as draft_export
from orchestrator.draft.served import served_draft_dir
from orchestrator.results import GREEDY, EvalResult
from orchestrator.states import stream
from orchestrator.states.shards import load_split
from orchestrator.targets import end_token_ids, tokenizer_hash


def served_layers(cfg: RootConfig, draft_conf: dict[str, Any]) -> list[int]:
    """The canonical states the serving engine captures for the draft config's ids."""
    ids = draft_conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    t = cfg.target
    return engines.from_engine_ids(
        cfg.serve.engine, ids, t.num_hidden_layers, t.family, engines.engine_version(cfg.serve)
    )


@torch.no_grad()
def text_accuracy(draft, seqs, live, steps: int, device: torch.device) -> dict[str, float]:
    """Per draft position k, on the validation sequences training validated on: the accuracy of the draft fed
    the states the serving engine captures from the live target (`live`: per sequence, those states [L, K*H] and
    the target's greedy token at each position [L], as the eval engine computes them), and, paired with it
    position by position, the accuracy of the same draft fed the extracted states it was trained on
    (`seqs[i].aux`).

    Both runs draft from their own tokens and are scored against the live target's greedy token, so the paired
    gap measures what serving feeds the draft differently from training, and nothing else: the same sequences,
    the same positions, the same draft in the same dtype.

    Beside them, `served_states_rel_diff`: how far the served states are from the trained ones, whatever the draft
    makes of them (the relative L2 distance over every position and column, in float32). About 0 where serving
    captures what training read (another engine's or precision's rounding aside); near 1 or more where it captures
    other layers, even for a draft too weak for its accuracy to show it."""
    counts, live_right, ref_right, live_chain = (torch.zeros(steps, dtype=torch.float64) for _ in range(4))
    squares = torch.zeros(2, dtype=torch.float64)  # sum of (served - trained)^2, sum of trained^2
    per_sequence = []  # (positions, sum of ref - live) per sequence and position k, for the noise
    for s, (served, target_argmax) in zip(seqs, live, strict=True):
        length = len(s.input_ids)
        ids = s.input_ids[None].to(device)
        valid = torch.ones(1, length - 1, dtype=torch.bool, device=device)
        aux = served[None, : length - 1].to(device)
        if served.shape == s.aux.shape:
            trained, fed = s.aux[: length - 1].float(), served[: length - 1].float()
            squares += torch.stack([(fed - trained).pow(2).sum(), trained.pow(2).sum()]).double()
        live_tokens = [x[0].cpu() for x in draft.unroll(aux, ids[:, 1:], valid, steps).tokens]
        reference = [x[0].cpu() for x in draft.unroll(s.aux[None, :-1].to(device), ids[:, 1:], valid, steps).tokens]
        t = torch.arange(length - 1)
        chain = torch.ones(length - 1, dtype=torch.bool)
        n_seq, d_seq = torch.zeros(steps, dtype=torch.float64), torch.zeros(steps, dtype=torch.float64)
        for k in range(steps):
            pos = (t + k + 1).clamp(max=length - 1)
            mask = (t + k + 1 < length) & s.loss_mask[pos]
            right_live = live_tokens[k] == target_argmax[pos]
            right_ref = reference[k] == target_argmax[pos]
            chain &= right_live
            counts[k] += mask.sum()
            live_right[k] += (right_live & mask).sum()
            ref_right[k] += (right_ref & mask).sum()
            live_chain[k] += (chain & mask).sum()
            n_seq[k] = mask.sum()
            d_seq[k] = (right_ref & mask).sum() - (right_live & mask).sum()
        per_sequence.append((n_seq, d_seq))
    out: dict[str, float] = {f"positions_{k}": int(counts[k]) for k in range(steps)}
    out["served_states_rel_diff"] = float((squares[0] / squares[1]).sqrt()) if squares[1] > 0 else None
    n = counts.clamp(min=1)
    gap = (ref_right - live_right) / n
    # Standard error of the gap with sequences as the independent units (positions within a sequence are
    # correlated: a weak target repeats itself, and a draft is right or wrong on a whole run of tokens).
    spread = sum(((d - gap * m) ** 2 for m, d in per_sequence), torch.zeros(steps, dtype=torch.float64))
    se = spread.sqrt() / n
    for k in range(steps):
        out |= {
            f"acc_{k}": float(live_right[k] / n[k]),
            f"full_acc_{k}": float(live_chain[k] / n[k]),
            f"trained_states_acc_{k}": float(ref_right[k] / n[k]),
            f"acc_gap_{k}": float(gap[k]),
            f"acc_gap_se_{k}": float(se[k]),
        }
    return out


def simulate_cycles(
    draft_tokens: list[list[int]], sequence: list[int], prompt_len: int, steps: int, max_new: int
) -> tuple[int, int, list[int]]:
    """(completion tokens, verify passes, accepted-count histogram) of a chain-drafting server on `sequence`.

    `draft_tokens[k][c]` is the draft's k-th token from last committed position c; the target's greedy
    continuation is `sequence[prompt_len:]`. The first token comes from prefill (no verify pass).
    """
    generated = len(sequence) - prompt_len
    completion = min(1, generated)
    verify = 0
    histogram = [0] * (steps + 1)
    c = prompt_len - 1  # last position whose target state is committed; token c+1 is known
    while completion < min(max_new, generated):
        accepted = 0
        while (
            accepted < steps
            and c + accepted + 2 < len(sequence)
            and draft_tokens[accepted][c] == sequence[c + accepted + 2]
        ):
            accepted += 1
        verify += 1
        histogram[accepted] += 1
        completion = min(completion + accepted + 1, generated, max_new)
        c += accepted + 1
    return completion, verify, histogram


@torch.no_grad()
def chain_tokens(draft, sequence: list[int], served: torch.Tensor, steps: int, device: torch.device) -> list[list[int]]:
    """The draft's `steps` chained tokens from every position of `sequence` but the last (`draft_tokens[k][c]`, as
    `simulate_cycles` reads them), fed `served`, the states serving captures for at least all but its last token."""
    length = len(sequence)
    if length < 2:  # nothing to draft from (`greedy_accept_length` skips it)
        return []
    full = torch.tensor([sequence], device=device)
    aux = served[None, : length - 1].to(device)
    valid = torch.ones(1, length - 1, dtype=torch.bool, device=device)
    return [u[0].tolist() for u in draft.unroll(aux, full[:, 1:], valid, steps).tokens]


def greedy_accept_length(drafted, steps: int, max_new: int) -> dict[str, Any]:
    """The expected accept length of a chain-drafting server on the target's greedy continuations of the serving
    prompts (`drafted`: per prompt, its length, the prompt and continuation's ids, and the draft's tokens from each
    of their positions, `chain_tokens`)."""
    completion_total = verify_total = 0
    histogram = [0] * (steps + 1)
    for prompt_len, sequence, tokens in drafted:
        if len(sequence) < 2:
            continue
        completion, verify, hist = simulate_cycles(tokens, sequence, prompt_len, steps, max_new)
        completion_total += completion
        verify_total += verify
        histogram = [a + b for a, b in zip(histogram, hist)]
    cycles = max(sum(histogram), 1)
    # P(draft token k accepted | tokens < k accepted), from the accepted-count histogram.
    reached = [sum(histogram[j:]) for j in range(steps + 1)]
    return {
        "expected_accept_length": completion_total / max(verify_total, 1),
        "completion_tokens": completion_total,
        "verify_passes": verify_total,
        "accept_histogram": histogram,
        "accept_rate_by_position": [reached[k + 1] / reached[k] if reached[k] else 0.0 for k in range(steps)],
        "mean_accepted_per_cycle": sum(i * h for i, h in enumerate(histogram)) / cycles,
    }


def answered_by_extraction(cfg: RootConfig, seqs, prompts: list[list[int]], ends: list[int]) -> dict[int, int]:
    """{index in `seqs`: index in `prompts`} for the validation sequences that are a serving prompt's greedy
    continuation as a server writes it: regenerated greedy, first answers only, to eval's token bound, the prompt's
    ids exactly, and the answer whole (through an end token, or as long as the bound). Eval runs the draft on those
    sequences' served states anyway, so their continuations need no second generation; any other prompt is
    generated (`live.continuations`)."""
    r, max_new = cfg.data.regenerate, cfg.eval.max_new_tokens
    if not (r.enabled and r.temperature == 0 and r.turns == 1 and r.max_new_tokens == max_new):
        return {}
    out = {}
    for i, (s, prompt) in enumerate(zip(seqs, prompts)):
        ids, n = s.input_ids.tolist(), len(prompt)
        answer, mask = ids[n:], s.loss_mask.tolist()
        if ids[:n] != prompt or not answer or any(mask[:n]) or not all(mask[n:]):
            continue
        if len(answer) == max_new or (answer[-1] in ends and not any(t in ends for t in answer[:-1])):
            out[i] = i
    return out


def significant_gaps(acc: dict[str, float], steps: int, tolerance: float) -> tuple[dict[int, float], dict[int, float]]:
    """The per-position paired gaps (trained states' accuracy minus served states' accuracy) beyond both the
    tolerance and the sampling noise of the paired difference (2 standard errors over sequences), and that
    noise: a handful of sequences that happen to differ cannot raise a false alarm."""
    noise = {k: 2 * acc[f"acc_gap_se_{k}"] for k in range(steps)}
    gaps = {k: acc[f"acc_gap_{k}"] for k in range(steps)}
    return {k: g for k, g in gaps.items() if g > max(tolerance, noise[k])}, noise


def mismatch_causes(cfg: RootConfig, prov: dict[str, Any], layers: list[int], target_tok_hash: str | None) -> list[str]:
    causes = []
    if layers != prov.get("aux_layers"):
        causes.append(
            f"the draft config's eagle_aux_hidden_state_layer_ids make {cfg.serve.engine} capture {layers}, "
            f"but the draft was trained on aux_layers={prov.get('aux_layers')}: export the ids with the layer "
            f"contract (orchestrator.engines.to_engine_ids) for the serving engine, family and version"
        )
    if target_tok_hash and prov.get("tokenizer_hash") != target_tok_hash:
        causes.append("the target's tokenizer/chat template differs from the one used at extraction")
    if not causes:
        causes.append(
            "no layer or tokenizer difference found; check the capture points (pre/post norm), the target weights "
            "(content hash) and the extraction dtype between extraction and serving"
        )
    return causes


def sequences_from(cfg: RootConfig) -> str:
    """What the validation sequences' responses are, for reading their per-position accuracies beside another run's:
    `one_pass` (the target's own, generated and captured in one request: a response that ended loses its end token,
    so the position after it is not scored), `regenerated` (the target's own, by a separate generation, end token
    kept), or `dataset` (the data set's). Measured on the demo (docs/data.md#one-pass-and-two-passes), the one
    position per sequence that one pass drops moves acc_0 by 0.002; two drafts trained on the two modes' data differ
    by more, as training on this CPU does from any small change of its data."""
    r = cfg.data.regenerate
    if not r.enabled:
        return "dataset"
    return "one_pass" if r.engine == "one_pass" else "regenerated"


def run(cfg: RootConfig, plan, tracker, compute: Compute) -> EvalResult:
    """The exported draft, as serving gets it, run against the live target: its accuracy on the validation
    sequences paired with the same draft fed its training states, its expected accept length, and a flag for every
    train/serve difference found."""
    out = plan.dir("eval")
    out.mkdir(parents=True, exist_ok=True)
    draft_dir = served_draft_dir(cfg, plan)
    draft, draft_conf = draft_export.load_draft(draft_dir)
    draft.to(compute.device)
    prov = draft_export.provenance(draft_dir)
    extract_dir = plan.dir("extract")
    manifest = _extraction_trained_on(extract_dir, prov, draft_dir)
    layers = served_layers(cfg, draft_conf)
    engine = engines.get(cfg.eval.engine, engines.CAPTURE)
    measured: dict[str, Any] = {  # the result's stored keys, in their order, as the measurements give them
        "served_layers": layers,
        "trained_layers": prov.get("aux_layers"),
        "draft_steps": cfg.eval.draft_steps,
        "draft_dtype": str(draft.fc.weight.dtype).removeprefix("torch."),
        "compute": compute.describe(),
        "engine": engine.name,
        "sequences_from": sequences_from(cfg),
        "decoding": GREEDY,  # the expected accept length's continuations, whatever the training data's sampling
    }
    flags: list[str] = []
    if len(layers) != draft.shape.num_aux_layers:
        # Nothing can be measured: the draft cannot consume what serving captures. No accuracy is reported.
        flags.append(
            f"eval: serving captures {len(layers)} states ({layers}) for the draft config's ids, "
            f"but the draft's fc takes {draft.shape.num_aux_layers}; SGLang would fail or drop a state, "
            "so no accuracy or accept length was measured. Causes: "
            + "; ".join(mismatch_causes(cfg, prov, layers, None))
        )
        measured |= {"mismatch": True, "mismatch_flags": flags}
    else:
        # the capture service that trained the draft, where the run registered eval with it; else its own
        live = stream.open_eval(cfg, plan, layers, compute) or engine.open_eval(
            cfg, Path(plan.target_dir), layers, compute, out / "engine"
        )
        try:
            measured |= _measured(cfg, (live, draft), (extract_dir, manifest), prov, compute)
        finally:
            live.close()
        flags += _mismatch_flags(cfg, plan, measured, prov)
        measured |= {"mismatch": bool(flags), "mismatch_flags": flags}
    result = EvalResult.from_dict(measured)
    result.headline = result.make_headline()
    _record(plan, tracker, out, result)
    return result


def _extraction_trained_on(extract_dir: Path, prov: dict[str, Any], draft_dir: Path) -> dict[str, Any]:
    """The extraction's manifest, once it is the one the draft was trained on: eval compares the draft on the
    validation sequences training validated on."""
    manifest = read_manifest(extract_dir, "extract")
    if manifest["key"] != prov.get("extract_key"):
        raise ArtifactError(
            f"{extract_dir}/manifest.json: extraction {manifest['key']} is not the one the draft at {draft_dir} was "
            f"trained on ({prov.get('extract_key')}); eval compares the draft on the same validation sequences, so it "
            "needs that extraction"
        )
    return manifest


def _measured(cfg: RootConfig, models, extraction, prov: dict[str, Any], compute: Compute):
    """The paired accuracies on the validation sequences (`text_accuracy`) and the greedy accept length on the
    serving prompts (`greedy_accept_length`), with training's own validation accuracies beside them. The live
    target's states, greedy tokens and continuations are the eval engine's (`live`, `Capturing.open_eval`)."""
    (live, draft), (extract_dir, manifest) = models, extraction
    steps, positions, device = cfg.eval.draft_steps, _positions(cfg, prov), compute.device
    max_new = cfg.eval.max_new_tokens
    split = load_split(extract_dir, manifest, "val", prov["aux_layers"])
    taken = split.take(range(min(cfg.eval.max_conversations, len(split))))
    _, val_convs = conversations(cfg.data, cfg.seed)
    prompts = [prompt_ids(live.tokenizer, c, cfg.data.max_seq_len) for c in val_convs[: cfg.eval.prompts]]
    reused = answered_by_extraction(cfg, taken, prompts, end_token_ids(live.tokenizer))
    drafted: dict[int, tuple] = {}  # per prompt index: (prompt length, continuation, the draft's chained tokens)

    def served(pairs):  # the validation sequences' live states, the draft run on the reused ones as they pass
        for i, s, (states, argmax) in pairs:
            if i in reused:
                ids = s.input_ids.tolist()
                drafted[reused[i]] = (len(prompts[reused[i]]), ids, chain_tokens(draft, ids, states, steps, device))
            yield states, argmax

    kept = [(i, s) for i, s in enumerate(taken) if len(s.input_ids) >= 3]
    val_seqs = [s for _, s in kept]
    live_states = live.served([s.input_ids.tolist() for s in val_seqs])
    acc = text_accuracy(draft, val_seqs, served((i, s, x) for (i, s), x in zip(kept, live_states)), positions, device)
    rest = [j for j in range(len(prompts)) if j not in drafted]
    generated = live.continuations([prompts[j] for j in rest], max_new) if rest else []
    for j, (prompt_len, sequence, states) in zip(rest, generated, strict=True):
        drafted[j] = (prompt_len, sequence, chain_tokens(draft, sequence, states, steps, device))
    greedy = greedy_accept_length([drafted[j] for j in range(len(prompts))], steps, max_new)
    greedy["continuations_reused"] = len(prompts) - len(rest)
    val = prov.get("val_metrics", {})
    trained = [val.get(f"acc_{k}") for k in range(positions)]
    return acc | greedy | {"sequences": len(val_seqs), "train_val_acc": trained, "engine": live.describe()}


def _positions(cfg: RootConfig, prov: dict[str, Any]) -> int:
    """The draft positions scored: eval.draft_steps, or fewer where the draft was trained to a shallower depth."""
    trained_steps = prov.get("trained_ttt_steps", cfg.eval.draft_steps)
    return min(cfg.eval.draft_steps, trained_steps) if trained_steps else cfg.eval.draft_steps


def _mismatch_flags(cfg: RootConfig, plan, result: dict[str, Any], prov: dict[str, Any]) -> list[str]:
    """A gap beyond noise between the draft fed what serving captures and fed its training states, served layers
    other than the trained ones, or more draft steps than it was trained for: each with its likely causes."""
    flags = []
    layers, steps = result["served_layers"], cfg.eval.draft_steps
    significant, noise = significant_gaps(result, _positions(cfg, prov), cfg.eval.acc_tolerance)
    worst = max(significant, key=significant.get) if significant else None
    if worst is not None:
        flags.append(
            f"eval: on the same {result['sequences']} validation sequences, the draft fed what serving captures "
            f"scores acc_{worst}={result[f'acc_{worst}']:.3f}, {result[f'acc_gap_{worst}']:.3f} below the "
            f"{result[f'trained_states_acc_{worst}']:.3f} it scores on the states it was trained on (tolerance "
            f"eval.acc_tolerance={cfg.eval.acc_tolerance}, sampling noise {noise[worst]:.3f} over "
            f"{result[f'positions_{worst}']} positions): train/serve mismatch. Likely causes: "
            + "; ".join(mismatch_causes(cfg, prov, layers, tokenizer_hash(Path(plan.target_dir))))
        )
    elif layers != prov.get("aux_layers"):
        flags.append("eval: " + mismatch_causes(cfg, prov, layers, None)[0])
    trained_steps = prov.get("trained_ttt_steps", steps)
    if steps > trained_steps:
        flags.append(f"eval: eval.draft_steps={steps} exceeds the draft's trained TTT depth {trained_steps}")
    return flags


def _record(plan, tracker, out: Path, result: EvalResult) -> None:
    """The result in MLflow (metrics, the mismatch tags), eval.json and the manifest, last; each flag printed."""
    flags = result.mismatch_flags
    tracker.stage_result("eval", result)
    tracker.tags(
        {"eval.mismatch": str(result.mismatch).lower(), "eval.sequences_from": str(result.sequences_from)}
        | ({"eval.mismatch_flags": " | ".join(flags)} if flags else {})
    )
    write_json(out / "eval.json", result.to_dict())
    write_manifest(out, {"stage": "eval", "key": plan.stage_keys["eval"], "result": result.to_dict()})
    for flag in flags:
        print(f"[eval] MISMATCH: {flag}")

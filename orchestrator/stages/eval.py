"""Standalone evaluation: the exported draft run exactly as serving runs it, against the live target.

The draft comes from its directory (never the trainer's object); the target's states are captured where the
serving engine captures them for the ids written in the draft config (decoded through the layer contract),
and the draft consumes its own tokens. Two measurements:

  * accuracy on held-out conversations, per draft position, comparable with training's validation metrics
    (position 0 is defined identically in both, so a gap there means train and serve feed the draft
    different inputs: the seed's bug);
  * accept length on the target's own greedy continuations of the serving prompt set, simulated cycle by
    cycle as a chain-drafting server with `draft_steps` steps runs it (completion tokens / verify passes).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from orchestrator import layers as layer_contract
from orchestrator.artifacts import write_json, write_manifest
from orchestrator.capture import HiddenStateCapture
from orchestrator.config import RootConfig
from orchestrator.data import conversations, prompt_ids, sequences
from orchestrator.draft import export as draft_export
from orchestrator.targets import load_target


def served_layers(cfg: RootConfig, draft_conf: dict[str, Any]) -> list[int]:
    """The canonical states the serving engine captures for the draft config's ids."""
    ids = draft_conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    t = cfg.target
    return layer_contract.from_engine_ids(cfg.serve.engine, ids, t.num_hidden_layers, t.family, cfg.serve.sglang_version)


@torch.no_grad()
def text_accuracy(model, draft, layers: list[int], rendered, steps: int) -> dict[str, float]:
    counts = torch.zeros(steps)
    correct = torch.zeros(steps)
    all_correct = torch.zeros(steps)
    with HiddenStateCapture(model, layers) as capture:
        for r in rendered:
            ids = torch.tensor([r.input_ids])
            length = ids.shape[1]
            if length < 3:
                continue
            target_argmax = model(input_ids=ids, use_cache=False).logits.argmax(-1)[0]
            aux = capture.aux()
            valid = torch.ones(1, length - 1, dtype=torch.bool)
            unrolled = draft.unroll(aux[:, :-1], ids[:, 1:], valid, steps)
            mask_all = torch.tensor(r.loss_mask, dtype=torch.bool)
            chain = torch.ones(length - 1, dtype=torch.bool)
            t = torch.arange(length - 1)
            for k in range(steps):
                pos = t + k + 1
                inside = pos < length
                pos_c = pos.clamp(max=length - 1)
                mask = inside & mask_all[pos_c]
                right = unrolled.tokens[k][0] == target_argmax[pos_c]
                chain &= right
                counts[k] += mask.sum()
                correct[k] += (right & mask).sum()
                all_correct[k] += (chain & mask).sum()
            capture.clear()
    out = {f"positions_{k}": int(counts[k]) for k in range(steps)}
    counts = counts.clamp(min=1)
    out |= {f"acc_{k}": float(correct[k] / counts[k]) for k in range(steps)}
    out |= {f"full_acc_{k}": float(all_correct[k] / counts[k]) for k in range(steps)}
    return out


def simulate_cycles(draft_tokens: list[list[int]], sequence: list[int], prompt_len: int, steps: int, max_new: int) -> tuple[int, int, list[int]]:
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
        while accepted < steps and c + accepted + 2 < len(sequence) and draft_tokens[accepted][c] == sequence[c + accepted + 2]:
            accepted += 1
        verify += 1
        histogram[accepted] += 1
        completion = min(completion + accepted + 1, generated, max_new)
        c += accepted + 1
    return completion, verify, histogram


@torch.no_grad()
def greedy_accept_length(model, tokenizer, draft, layers: list[int], prompts: list[list[int]], steps: int, max_new: int) -> dict[str, Any]:
    completion_total = verify_total = 0
    histogram = [0] * (steps + 1)
    eos = tokenizer.eos_token_id
    with HiddenStateCapture(model, layers) as capture:
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            sequence = out[0].tolist()
            capture.clear()
            full = torch.tensor([sequence])
            model(input_ids=full, use_cache=False)
            aux = capture.aux()
            length = full.shape[1]
            unrolled = draft.unroll(aux[:, :-1], full[:, 1:], torch.ones(1, length - 1, dtype=torch.bool), steps)
            tokens = [u[0].tolist() for u in unrolled.tokens]
            completion, verify, hist = simulate_cycles(tokens, sequence, len(prompt), steps, max_new)
            completion_total += completion
            verify_total += verify
            histogram = [a + b for a, b in zip(histogram, hist)]
            capture.clear()
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


def significant_gaps(gaps: dict[int, float], acc: dict[str, float], tolerance: float) -> tuple[dict[int, float], dict[int, float]]:
    """The per-position gaps (training's acc_k minus the standalone acc_k) beyond both the tolerance and the
    sampling noise of the standalone estimate (2 standard errors over its positions), and that noise: a handful
    of held-out positions cannot raise a false alarm."""
    noise = {}
    for k in gaps:
        p, n = acc[f"acc_{k}"], max(acc.get(f"positions_{k}", 0), 1)
        noise[k] = 2 * math.sqrt(max(p * (1 - p), 1e-4) / n)
    return {k: g for k, g in gaps.items() if g > max(tolerance, noise[k])}, noise


def mismatch_causes(cfg: RootConfig, prov: dict[str, Any], layers: list[int], target_tok_hash: str | None) -> list[str]:
    causes = []
    if layers != prov.get("aux_layers"):
        causes.append(
            f"the draft config's eagle_aux_hidden_state_layer_ids make {cfg.serve.engine} capture {layers}, "
            f"but the draft was trained on aux_layers={prov.get('aux_layers')}: export the ids with the layer "
            f"contract (orchestrator.layers.to_sglang_ids) for the serving engine, family and version"
        )
    if target_tok_hash and prov.get("tokenizer_hash") != target_tok_hash:
        causes.append("the target's tokenizer/chat template differs from the one used at extraction")
    trained_regen = (prov.get("data") or {}).get("regenerate", {}).get("enabled")
    if trained_regen is not None and trained_regen != cfg.data.regenerate.enabled:
        kind = {True: "the target's regenerated responses", False: "the data set's responses"}
        causes.append(
            f"the draft was trained on {kind[trained_regen]} but this eval uses {kind[cfg.data.regenerate.enabled]} "
            "(data.regenerate.enabled): different texts, different accuracies"
        )
    if not causes:
        causes.append(
            "no layer or tokenizer difference found; check the teacher kind (pre/post norm), the draft vocabulary "
            "map (d2t offsets) and the target weights (content hash) between extraction and serving"
        )
    return causes


def run(cfg: RootConfig, plan, tracker) -> dict[str, Any]:
    out = plan.dir("eval")
    out.mkdir(parents=True, exist_ok=True)
    from orchestrator.stages.serve import served_draft_dir

    draft_dir = served_draft_dir(cfg, plan)
    draft, draft_conf = draft_export.load_draft(draft_dir)
    prov = draft_export.provenance(draft_dir)
    model, tokenizer = load_target(Path(plan.target_dir), cfg.target.trust_remote_code)
    from orchestrator.targets import tokenizer_hash

    layers = served_layers(cfg, draft_conf)
    steps = cfg.eval.draft_steps
    trained_steps = prov.get("trained_ttt_steps", steps)
    flags: list[str] = []
    result: dict[str, Any] = {"served_layers": layers, "trained_layers": prov.get("aux_layers"), "draft_steps": steps}
    if len(layers) != draft.shape.num_aux_layers:
        flags.append(
            f"eval: serving captures {len(layers)} states ({layers}) for the draft config's ids, but the draft's fc takes "
            f"{draft.shape.num_aux_layers}; SGLang would fail or drop a state. Causes: "
            + "; ".join(mismatch_causes(cfg, prov, layers, None))
        )
        result |= {"acc_0": 0.0, "expected_accept_length": 1.0, "mismatch": True, "mismatch_flags": flags}
    else:
        _, val_convs = conversations(cfg.data, cfg.seed)
        # The validation sequences training saw (the target's own responses when data.regenerate is on),
        # produced here by the live target.
        rendered = sequences(model, tokenizer, val_convs[: cfg.eval.max_conversations], cfg.data, "val", cfg.seed)
        acc = text_accuracy(model, draft, layers, rendered, min(steps, trained_steps) if trained_steps else steps)
        prompts = [prompt_ids(tokenizer, c, cfg.data.max_seq_len) for c in val_convs[: cfg.eval.prompts]]
        greedy = greedy_accept_length(model, tokenizer, draft, layers, prompts, steps, cfg.eval.max_new_tokens)
        val = prov.get("val_metrics", {})
        # Training validates with the draft's own tokens too, so every position is comparable, not only 0.
        gaps = {k: val[f"acc_{k}"] - acc[f"acc_{k}"] for k in range(steps) if f"acc_{k}" in val and f"acc_{k}" in acc}
        result |= acc | greedy | {"train_val_acc_0": val.get("acc_0"), "acc_0_gap": gaps.get(0, 0.0),
                                  "train_val_acc": [val.get(f"acc_{k}") for k in range(steps)],
                                  "max_acc_gap": max(gaps.values(), default=0.0)}
        significant, noise = significant_gaps(gaps, acc, cfg.eval.acc_tolerance)
        result["acc_gap_noise"] = [noise[k] for k in sorted(noise)]
        worst = max(significant, key=significant.get) if significant else None
        if worst is not None:
            flags.append(
                f"eval: standalone acc_{worst}={acc[f'acc_{worst}']:.3f} is {gaps[worst]:.3f} below training's validation "
                f"acc_{worst}={val[f'acc_{worst}']:.3f} (tolerance eval.acc_tolerance={cfg.eval.acc_tolerance}, sampling noise "
                f"{noise[worst]:.3f} over {acc[f'positions_{worst}']} positions): train/serve mismatch. Likely causes: "
                + "; ".join(mismatch_causes(cfg, prov, layers, tokenizer_hash(Path(plan.target_dir))))
            )
        elif layers != prov.get("aux_layers"):
            flags.append("eval: " + mismatch_causes(cfg, prov, layers, None)[0])
        if steps > trained_steps:
            flags.append(f"eval: eval.draft_steps={steps} exceeds the draft's trained TTT depth {trained_steps}")
        result |= {"mismatch": bool(flags), "mismatch_flags": flags}
    result["headline"] = {k: result[k] for k in ("acc_0", "train_val_acc_0", "expected_accept_length", "mismatch") if k in result}
    tracker.metrics({k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}, prefix="eval/")
    tracker.metrics({"mismatch": float(result["mismatch"])}, prefix="eval/")
    tracker.tags({"eval.mismatch": str(result["mismatch"]).lower()} | ({"eval.mismatch_flags": " | ".join(flags)} if flags else {}))
    write_json(out / "eval.json", result)
    write_manifest(out, {"stage": "eval", "key": plan.stage_keys["eval"], "result": result})
    for flag in flags:
        print(f"[eval] MISMATCH: {flag}")
    return result

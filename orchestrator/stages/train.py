"""Training: the EAGLE-3 draft on extracted states, with the training-time test, exported for SGLang.

Alignment (docs/training.md#alignment): position t gets the aux states at t and the embedding of token t+1; TTT step k
at t predicts the target's distribution at position t+k+1, counted where the loss mask at t+k+1 is set.
Output folder: checkpoints/ (resume), draft/ (SGLang draft directory), metrics.json, accuracy plot, manifest.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from tqdm import tqdm

from orchestrator import engines, pruning
from orchestrator.artifacts import ArtifactError, atomic_path, write_json, write_manifest
from orchestrator.compute import Compute
from orchestrator.config import RootConfig
from orchestrator.draft import export as draft_export
from orchestrator.draft import rope as draft_rope
from orchestrator.draft.model import Eagle3Draft, default_shape
from orchestrator.estimates import stream_buffer
from orchestrator.results import TrainResult
from orchestrator.states import stream
from orchestrator.states.manifest import load_manifest_checked
from orchestrator.states.shards import SequenceStates, load_split, verify_shards
from orchestrator.states.source import StateSource, step_indices
from orchestrator.states.teacher import TeacherHead
from orchestrator.targets import load_head_tensors, target_config_json, tokenizer_hash


@dataclass
class Batch:
    ids: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L]
    lengths: torch.Tensor  # [B]
    aux: torch.Tensor  # [B, L, K*Ht] float32
    teacher: torch.Tensor  # [B, L, Ht] float32

    def to(self, device: torch.device) -> "Batch":
        return Batch(
            *(t.to(device, non_blocking=True) for t in (self.ids, self.loss_mask, self.lengths, self.aux, self.teacher))
        )


def collate(seqs: list[SequenceStates]) -> Batch:
    width = max(len(s.input_ids) for s in seqs)
    b = len(seqs)
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.bool)
    aux = torch.zeros(b, width, seqs[0].aux.shape[-1])
    teacher = torch.zeros(b, width, seqs[0].teacher.shape[-1])
    for i, s in enumerate(seqs):
        n = len(s.input_ids)
        ids[i, :n], mask[i, :n], aux[i, :n], teacher[i, :n] = s.input_ids, s.loss_mask, s.aux.float(), s.teacher.float()
    return Batch(ids, mask, torch.tensor([len(s.input_ids) for s in seqs]), aux, teacher)


def ttt_step_targets(batch: Batch, teacher: torch.Tensor, steps: int):
    """Per TTT step k: (a per-position teacher tensor [B, L, ...] at t+k+1, e.g. its argmax ids, loss mask, token
    t+k+1), over t in 0..L-2.

    Step k at t predicts the target's distribution at t+k+1 (the token t+k+2) from the embedding of token
    t+k+1: the text's token under teacher forcing, the draft's own step k-1 token when served. Positions whose
    t+k+1 falls past the batch's width are masked out (their teacher entry is the last position's)."""
    width = batch.ids.shape[1]
    length = width - 1
    t = torch.arange(length, device=batch.ids.device)
    out = []
    for k in range(steps):
        pos = t + k + 1
        inside = pos[None, :] < batch.lengths[:, None]
        pos_c = pos.clamp(max=width - 1)
        mask = inside & batch.loss_mask[:, pos_c]
        out.append((teacher[:, pos_c], mask, batch.ids[:, pos_c]))
    return out


def step_counts(batch: Batch, steps: int) -> torch.Tensor:
    """Loss-masked positions per TTT step in the batch, int64 [steps] on the CPU: each step's loss is a mean over
    these, taken over the global batch when it is split between ranks."""
    return torch.stack([mask.sum() for _, mask, _ in ttt_step_targets(batch, batch.loss_mask, steps)]).cpu()


# The rows of the counts `ttt_forward` returns, per TTT step: positions whose draft token is the teacher's argmax,
# positions whose chain is right up to this step, loss-masked positions, and the summed cross-entropy.
COUNT_ROWS = ("correct", "all_correct", "count", "ce_sum")


def counts_dict(counts: torch.Tensor) -> dict[str, list[float]]:
    """`ttt_forward`'s counts [4, steps] as {row name: per-step values} (one transfer to the host)."""
    return dict(zip(COUNT_ROWS, counts.tolist()))


def ttt_forward(
    draft: Eagle3Draft,
    head: TeacherHead,
    batch: Batch,
    steps: int,
    kept: torch.Tensor,
    weights: list[float],
    own_tokens: bool = False,
    denominators: torch.Tensor | None = None,
):
    """Loss and per-step counts of one batch: steps k >= 1 consume the text's tokens (teacher forcing, for
    training) or, with `own_tokens`, the draft's own previous tokens as a serving engine does (validation).

    Step k's loss is its cross-entropy summed over the loss-masked positions and divided by `denominators[k]`:
    by default this batch's count of them; for a rank's share of a global batch, the global count times 1/N, so
    that DDP's mean of the N ranks' gradients is the gradient of the global batch's loss.

    The counts are a float64 tensor [4, steps] on the batch's device (rows `COUNT_ROWS`), summed over ranks or
    read with `counts_dict`: nothing in the step waits for the device. Memory: the teacher's distribution is one
    softmax [B, W, Vd] whose shifted views are every step's target, and each step's loss is taken as the unroll
    makes its logits, which are then dropped: at most one step's draft logits exist at a time."""
    width = batch.ids.shape[1]
    with torch.no_grad():
        teacher_kept, teacher_best = head(batch.teacher, kept)
        teacher_p = F.softmax(teacher_kept.float(), dim=-1)  # [B, W, Vd]: step k's target at t is row t+k+1
        del teacher_kept
    targets = ttt_step_targets(batch, teacher_best, steps)
    valid = torch.arange(width - 1, device=batch.ids.device)[None, :] < (batch.lengths[:, None] - 1)
    source = None if own_tokens else (lambda k, _tokens: targets[k + 1][2])
    loss = torch.zeros((), device=batch.ids.device)
    counts = torch.zeros(len(COUNT_ROWS), steps, dtype=torch.float64, device=batch.ids.device)
    chain_ok = None

    def step_loss(k: int, d_logits: torch.Tensor, d_tokens: torch.Tensor) -> None:
        nonlocal loss, chain_ok
        t_best, mask, _ = targets[k]
        n = max(0, width - 1 - k)  # positions t with t+k+1 inside the batch's width: the others are masked out
        p = teacher_p[:, k + 1 : k + 1 + n]
        ce = -(p * F.log_softmax(d_logits[:, :n].float(), dim=-1)).sum(-1)
        inside = mask[:, :n]
        denom = mask.sum().clamp(min=1) if denominators is None else denominators[k]
        masked = (ce * inside).sum()
        loss = loss + weights[k] * masked / denom
        right = d_tokens == t_best
        chain_ok = right if chain_ok is None else chain_ok & right
        counts[:, k] = torch.stack(
            [x.to(counts.dtype) for x in ((right & mask).sum(), (chain_ok & mask).sum(), mask.sum(), masked.detach())]
        )

    draft.unroll(batch.aux[:, :-1], batch.ids[:, 1:], valid, steps, token_source=source, on_step=step_loss)
    return loss, counts


def summarize(stats_list: list[dict], steps: int, draft_steps: int) -> dict[str, float]:
    """Per-step accuracies over all positions of `stats_list` (one entry per batch and rank), and the expected
    accept length they imply."""
    out: dict[str, float] = {}
    for k in range(steps):
        count = sum(s["count"][k] for s in stats_list) or 1
        out[f"acc_{k}"] = sum(s["correct"][k] for s in stats_list) / count
        out[f"full_acc_{k}"] = sum(s["all_correct"][k] for s in stats_list) / count
    out["expected_accept_length"] = 1.0 + sum(out[f"full_acc_{k}"] for k in range(min(draft_steps, steps)))
    return out


def lr_at(step: int, total: int, cfg) -> float:
    warmup = max(1, int(total * cfg.warmup_ratio))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(
    draft, head, seqs: StateSource, steps, kept, weights, batch_size, draft_steps, compute: Compute
) -> dict[str, float]:
    """Validation metrics of the draft run as served (its own tokens feed later steps), so that the standalone
    eval's per-position accuracies are the same quantities. Each rank takes every N-th sequence; the counts are
    summed over ranks, so every rank gets the metrics of the whole split, the same whatever N is. The loss is each
    step's cross-entropy averaged over all the split's positions, weighted as in training."""
    draft.eval()
    mine = list(range(compute.rank, len(seqs), compute.world_size))
    totals = torch.zeros(len(COUNT_ROWS), steps, dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, len(mine), batch_size):
            batch = collate(seqs.take(mine[i : i + batch_size])).to(compute.device)
            _, counts = ttt_forward(draft, head, batch, steps, kept, weights, own_tokens=True)
            totals += counts.cpu()
    totals = compute.all_reduce_sum(totals)
    draft.train()
    merged = counts_dict(totals)
    loss = sum(w * c / max(n, 1) for w, c, n in zip(weights, merged["ce_sum"], merged["count"]))
    return {"loss": loss} | summarize([merged], steps, draft_steps)


class TrainStep(torch.nn.Module):
    """The draft's training loss as a module's forward: DDP synchronises the gradients of what its wrapped
    module's forward computes, and the draft's unroll is not its forward. The teacher head is an argument, not a
    submodule, so DDP neither broadcasts nor holds its frozen [vocabulary, hidden] weights."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(
        self,
        head: TeacherHead,
        batch: Batch,
        steps: int,
        kept: torch.Tensor,
        weights: list[float],
        denominators: torch.Tensor,
    ):
        return ttt_forward(self.draft, head, batch, steps, kept, weights, denominators=denominators)


def optimizer_step(
    model: torch.nn.Module,
    head: TeacherHead,
    batch: Batch,
    steps: int,
    kept: torch.Tensor,
    weights: list[float],
    denominators: torch.Tensor,
    optim: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    grad_clip: float,
    bf16: bool,
):
    """One training step of `model` (a `TrainStep`, DDP-wrapped or not): loss under bf16 autocast when asked (the
    weights and the optimizer stay float32), backward, gradient clipping, the optimizer's update. The train stage
    and `benchmarks/bench_train_gpu.py` both run it."""
    optim.zero_grad(set_to_none=True)  # before the forward: last step's gradients do not sit beside its activations
    with torch.autocast(batch.ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss, stats = model(head, batch, steps, kept, weights, denominators)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optim.step()
    return loss, stats


def rank_share(indices: list[int], compute: Compute) -> tuple[list[int], bool]:
    """This rank's sequences of a global batch (every N-th), and whether they count: an epoch's short last batch
    can leave a rank none, and that rank then runs a sequence with no loss positions so that DDP's collective
    calls still match."""
    share = indices[compute.rank :: compute.world_size]
    return (share, True) if share else (indices[:1], False)


def build_draft(
    cfg: RootConfig, target_path: Path, extract_dir: Path, manifest: dict
) -> tuple[Eagle3Draft, TeacherHead]:
    tconf = target_config_json(target_path)
    # The draft uses the target's rope, scaling included (as SGLang's EAGLE-3 drafts for Kimi do), read in either
    # spelling; the export writes the same rope into the draft config and records it in provenance.
    rope = draft_rope.config_keys(draft_rope.read(tconf, f"{target_path}/config.json"))
    d = cfg.draft
    shape = default_shape(
        cfg.target.hidden_size,
        cfg.target.vocab_size,
        len(cfg.train.layers),
        d.hidden_size,
        d.num_attention_heads,
        d.num_key_value_heads,
        d.head_dim,
        d.intermediate_size,
        d.draft_vocab_size,
        d.rms_norm_eps,
        rope["rope_theta"],
        d.max_position_embeddings or cfg.target.max_position_embeddings,
        rope.get("rope_scaling"),
    )
    torch.manual_seed(cfg.train.seed)
    draft = Eagle3Draft(shape)
    tensors = load_head_tensors(target_path, cfg.target.family)
    if shape.hidden_size != cfg.target.hidden_size:
        raise ValueError(
            f"draft.hidden_size={shape.hidden_size}: the draft shares the target's embedding, "
            f"so it must equal target.hidden_size={cfg.target.hidden_size}"
        )
    draft.embed_tokens.weight.data.copy_(tensors["embed"])
    with safe_open(str(extract_dir / manifest["token_freq"]), framework="pt") as f:
        counts = f.get_tensor("counts")
    d2t, t2d = draft_export.build_vocab_map(counts, shape.draft_vocab_size)
    draft.set_vocab_map(d2t, t2d)
    head = TeacherHead(tensors, manifest["teacher"]["kind"], tconf.get("rms_norm_eps", 1e-6))
    return draft, head


def run(cfg: RootConfig, plan, tracker, compute: Compute) -> TrainResult | None:
    """Trains on every rank of the job (DDP: one process per GPU, or gloo processes on CPUs). Each global batch
    is the same whatever the number of ranks, split between them; rank 0 alone writes checkpoints, the export,
    metrics and the manifest."""
    try:
        return _run(cfg, plan, tracker, compute)
    except Exception:
        if cfg.train.stream.join is not None and compute.is_main:  # the service it joined stops waiting for it
            stream.unregister(Path(cfg.train.stream.join), Path(plan.run_dir).name)
        raise


def _run(cfg: RootConfig, plan, tracker, compute: Compute) -> TrainResult | None:
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    out = plan.dir("train")
    if compute.is_main:  # the other ranks only read from it (a checkpoint to resume from)
        out.mkdir(parents=True, exist_ok=True)
    extract_dir = plan.dir("extract")
    manifest = load_manifest_checked(extract_dir, cfg)
    target_path = Path(plan.target_dir)
    _check_tokenizer(extract_dir, manifest, target_path)
    if tc.from_draft is not None:
        return import_draft(cfg, plan, manifest, target_path) if compute.is_main else None
    verification = verify_shards(extract_dir, manifest, compute)  # beside training, each rank its share
    val_seqs = load_split(extract_dir, manifest, "val", list(tc.layers), verify=False)
    draft, head = build_draft(cfg, target_path, extract_dir, manifest)
    loop = _Loop(cfg, compute, draft, head, out / "checkpoints" / "latest.pt")
    total = loop.total(len(load_split(extract_dir, manifest, "train", verify=False, tokens_only=True)))
    loop.resume(total)
    # a layer search's pruner may stop the trial (asked by rank 0 alone, its answer shared); else a no-op
    report_to_search = pruning.reporter(plan) if compute.is_main else (lambda _step, _val: None)
    if tc.states == "stream" and loop.step >= total:  # requeued after its last checkpoint: nothing left to read
        train_seqs = stream.read_nothing(cfg, plan, manifest)
    elif tc.states == "stream":  # a capture service computes the states from the step the loop resumes at
        train_seqs = stream.open_stream(cfg, plan, manifest, list(tc.layers), compute, loop.step, total)
    else:
        train_seqs = load_split(extract_dir, manifest, "train", list(tc.layers), verify=False)
    try:
        history = loop.run(train_seqs, val_seqs, total, tracker, report_to_search, verification.check)
    except SystemExit:  # submitit's handler requeued this job: a stream's service keeps its place for the next start
        if isinstance(train_seqs, stream.StreamedSplit):
            train_seqs.close(requeued=True)
        else:
            train_seqs.close()
        raise
    except BaseException:
        train_seqs.close()
        raise
    train_seqs.close()
    verification.finish()  # before the draft is exported: a draft of a corrupt extraction is never written
    final = history[-1] if history else loop.validate(val_seqs)
    if not compute.is_main:
        return None
    result = export_draft(cfg, plan, draft, manifest, target_path, final, tc.ttt_steps)
    result.compute = compute.describe()
    if tc.states == "stream":
        result.stream = _stream_report(cfg, train_seqs, tracker)
    write_json(out / "metrics.json", {"history": history, "final": final})
    plot = plot_accuracy(final, tc.ttt_steps, out / "accuracy_by_position.png")
    tracker.artifact(plot, "train")
    write_manifest(
        out,
        {"stage": "train", "key": plan.stage_keys["train"], "extract_key": manifest["key"], "result": result.to_dict()},
    )
    return result


def _stream_report(cfg: RootConfig, stream, tracker) -> dict[str, Any]:
    """What streaming cost this training, printed and logged: the trainer's wait, the capture rate, and the spool's
    peak against its bound."""
    report = stream.report() | {"buffer_bytes": stream_buffer(cfg)[2]}
    print(
        f"[train] stream: waited {report['wait_s']:.1f} s for states; captured {report['captured_tokens']} tokens at "
        f"{report['capture_tokens_per_s']:.0f} tokens/s; spool peak {report['peak_spool_bytes']} bytes "
        f"(train.stream.buffer_bytes={report['buffer_bytes']})"
    )
    store = report.get("store") or {}
    print(f"[train] stream: states through {report['transport']}" + (
        f" ({store['protocol']}, master {store['master']})" if report["transport"] == "mooncake" else ""
    ))  # fmt: skip
    tracker.params({f"train/stream_{k}": store[k] for k in ("transport", "protocol") if k in store})
    numbers = {k: float(v) for k, v in report.items() if isinstance(v, (int, float))}
    tracker.metrics(numbers, prefix="train/stream_")
    return report


def _check_tokenizer(extract_dir: Path, manifest: dict[str, Any], target_path: Path) -> None:
    """The extracted token ids mean the target tokenizer's tokens: its hash is the one extraction recorded."""
    tok_hash = tokenizer_hash(target_path)
    if manifest["tokenizer_hash"] != tok_hash:
        raise ArtifactError(
            f"{extract_dir}/manifest.json: tokenizer_hash {manifest['tokenizer_hash']} differs from the target's "
            f"tokenizer at {target_path} ({tok_hash}); the extracted token ids do not mean the same tokens. Re-extract."
        )


class _Loop:
    """The training loop on one rank: the draft and its optimizer, resumed from rank 0's last checkpoint (whatever
    the world size was then), the global steps in `step_indices`' order, a validation and a checkpoint every so
    many steps, each step's loss and counts logged summed over the ranks."""

    def __init__(self, cfg: RootConfig, compute: Compute, draft: Eagle3Draft, head: TeacherHead, ckpt_path: Path):
        tc = self.tc = cfg.train
        self.compute, self.draft, self.head, self.ckpt_path = compute, draft, head, ckpt_path
        draft.to(compute.device)
        head.to(compute.device)
        self.kept = draft.to_target_ids(torch.arange(draft.shape.draft_vocab_size, device=compute.device))
        self.steps = tc.ttt_steps
        self.weights = [tc.step_weight_decay**k for k in range(self.steps)]
        self.draft_steps = cfg.serve.num_steps
        self.params = [p for p in draft.parameters() if p.requires_grad]
        self.optim = torch.optim.AdamW(self.params, lr=tc.lr, betas=(tc.beta1, tc.beta2), weight_decay=tc.weight_decay)
        self.bf16 = compute.dtype == torch.bfloat16  # autocast; the weights and the optimizer stay float32
        self.step, self.history = 0, []

    def resume(self, total: int) -> None:
        if self.ckpt_path.exists():  # every rank resumes from rank 0's last checkpoint, whatever its world size
            state = torch.load(self.ckpt_path, weights_only=False, map_location=self.compute.device)
            self.draft.load_state_dict(state["model"])
            self.optim.load_state_dict(state["optim"])
            self.step, self.history = state["step"], state["history"]
            print(f"[train] resumed from {self.ckpt_path} at step {self.step}/{total}")

    def save_checkpoint(self) -> None:
        if self.compute.is_main:
            state = {
                "model": self.draft.state_dict(),
                "optim": self.optim.state_dict(),
                "step": self.step,
                "history": self.history,
            }
            with atomic_path(self.ckpt_path) as tmp:
                torch.save(state, tmp)

    def validate(self, val_seqs: StateSource) -> dict[str, float]:
        return evaluate(
            self.draft, self.head, val_seqs, self.steps, self.kept, self.weights, self.tc.batch_size,
            self.draft_steps, self.compute,
        )  # fmt: skip

    def total(self, sequences: int) -> int:
        """The run's global steps: train.max_steps, or its epochs over `sequences`."""
        return self.tc.max_steps or self.tc.epochs * math.ceil(sequences / self.tc.batch_size)

    def run(
        self, train_seqs: StateSource, val_seqs: StateSource, total: int, tracker, report_to_search, check=None
    ) -> list[dict]:
        """Trains from the resumed step to `total`; returns the validation history. `report_to_search(step, val)`
        may stop a layer search's trial after a validation; `check()`, at each logging step (every rank reaches it
        together), may end the training (the shards' verification)."""
        tc, compute = self.tc, self.compute
        model = TrainStep(self.draft)
        if compute.distributed:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[compute.device] if compute.device.type == "cuda" else None, broadcast_buffers=False
            )
        self.draft.train()
        tokens, window_started = 0, time.time()
        bar = tqdm(
            total=total,
            initial=self.step,
            desc="train" + (f" (rank {compute.rank}/{compute.world_size})" if compute.distributed else ""),
            unit="step",
        )

        def load_batch(at: int) -> tuple[Batch, bool]:
            share, counts = rank_share(step_indices(len(train_seqs), tc.batch_size, tc.seed, at), compute)
            batch = collate(train_seqs.take(share))
            if not counts:
                batch.loss_mask.zero_()
            return batch, counts

        # Bounded prefetch: one batch is read from the shards and collated while the step before it computes.
        prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        upcoming = prefetch.submit(load_batch, self.step) if self.step < total else None
        while self.step < total:
            host_batch, counts = upcoming.result()
            upcoming = prefetch.submit(load_batch, self.step + 1) if self.step + 1 < total else None
            batch = host_batch.to(compute.device)  # the counts below come from the host copy: no wait on the device
            denominators = compute.all_reduce_sum(step_counts(host_batch, self.steps)).clamp(min=1) / compute.world_size
            for group in self.optim.param_groups:
                group["lr"] = lr_at(self.step, total, tc)
            loss, stats = optimizer_step(
                model, self.head, batch, self.steps, self.kept, self.weights, denominators.to(compute.device),
                self.optim, self.params, tc.grad_clip, self.bf16,
            )  # fmt: skip
            self.step += 1
            tokens += int(host_batch.lengths.sum()) if counts else 0
            bar.update(1)
            if self.step % tc.log_every == 0 or self.step == total:
                self.log(tracker, bar, loss, stats, tokens, time.time() - window_started)
                tokens, window_started = 0, time.time()
                if check is not None:
                    check()
            if self.step % tc.val_every == 0 or self.step == total:
                self.validate_and_report(val_seqs, tracker, report_to_search)
            if self.step % tc.checkpoint_every == 0 or self.step == total:
                self.save_checkpoint()
        bar.close()
        prefetch.shutdown()
        return self.history

    def log(self, tracker, bar, loss: torch.Tensor, stats: torch.Tensor, tokens: int, elapsed: float) -> None:
        """The step's loss and teacher-forced counts, and the window's tokens, summed over ranks: the global
        batch's."""
        compute = self.compute
        summed = compute.all_reduce_sum(
            torch.cat(
                [
                    torch.tensor([float(loss.detach()) / compute.world_size, tokens], dtype=torch.float64),
                    stats.cpu().flatten(),
                ]
            )
        )
        last = counts_dict(summed[2:].view(len(COUNT_ROWS), self.steps))
        teacher_forced = summarize([last], self.steps, self.draft_steps)
        if compute.is_main:
            lr = self.optim.param_groups[0]["lr"]
            tracker.train_step(self.step, float(summed[0]), lr, float(summed[1]) / max(elapsed, 1e-9), teacher_forced)
        bar.set_postfix(loss=f"{float(summed[0]):.3f}", acc0=f"{teacher_forced['acc_0']:.2f}")

    def validate_and_report(self, val_seqs: StateSource, tracker, report_to_search) -> None:
        val = self.validate(val_seqs)
        self.history.append({"step": self.step} | val)
        if self.compute.is_main:
            tracker.train_validation(self.step, val)
        pruned = report_to_search(self.step, val)
        if self.compute.all_reduce_max(torch.tensor([float(pruned is not None)]))[0]:
            raise pruning.TrialPruned(pruned or "pruned by the study (rank 0's decision)")


def export_draft(
    cfg: RootConfig, plan, draft: Eagle3Draft, manifest: dict, target_path: Path, final: dict, steps: int
) -> TrainResult:
    t, s = cfg.target, cfg.serve
    ids = engines.to_engine_ids(s.engine, cfg.train.layers, t.num_hidden_layers, t.family, engines.engine_version(s))
    tconf = target_config_json(target_path)
    conf = draft_export.draft_config(
        draft.shape,
        ids,
        cfg.draft.torch_dtype,
        tconf,
        cfg.draft.max_position_embeddings or tconf.get("max_position_embeddings", t.max_position_embeddings),
        engines.id_convention(s.engine),
    )
    provenance = draft_provenance(cfg, plan, manifest, ids) | {
        "trained_ttt_steps": steps,
        "val_metrics": final,
        "rope": draft.shape.rope.as_dict(),
    }
    draft_dir = plan.dir("train") / "draft"
    draft_export.export(draft, draft_dir, conf, provenance, tconf)
    result = TrainResult.from_validation(final, draft_dir=str(draft_dir), eagle_aux_hidden_state_layer_ids=ids)
    result.headline = result.make_headline()
    return result


def draft_provenance(cfg: RootConfig, plan, manifest: dict, ids: list[int]) -> dict[str, Any]:
    """What a draft of this stage's records of itself: the layers it reads, the engine its ids are written for,
    and the target, tokenizer, teacher, data and extraction it goes with."""
    return {
        "aux_layers": list(cfg.train.layers),
        "serving": draft_export.serving_record(cfg.serve, cfg.target.family, ids),
        "target": manifest["target"],
        "tokenizer_hash": manifest["tokenizer_hash"],
        "teacher": manifest["teacher"],
        # what the draft learned from: the data set's responses or the target's own (data.regenerate)
        "data": manifest.get("data"),
        "extract_key": manifest["key"],
        "train_key": plan.stage_keys["train"],
    }


def import_draft(cfg: RootConfig, plan, manifest: dict, target_path: Path) -> TrainResult:
    """train.from_draft: a draft trained elsewhere, written as this stage's draft (the project's format, the ids of
    `train.layers` for serve.engine, provenance naming the folder it came from) instead of training one, so that
    eval and serve measure it on this target and data like a trained draft. Its TTT depth is not known."""
    from orchestrator.draft import formats

    t, s = cfg.target, cfg.serve
    ids = engines.to_engine_ids(s.engine, cfg.train.layers, t.num_hidden_layers, t.family, engines.engine_version(s))
    provenance = draft_provenance(cfg, plan, manifest, ids)
    out = plan.dir("train")
    draft_dir = out / "draft"
    formats.import_draft(
        Path(cfg.train.from_draft), draft_dir, target_path, list(cfg.train.layers), ids,
        engines.id_convention(s.engine), provenance,
    )  # fmt: skip
    result = TrainResult(
        draft_dir=str(draft_dir), eagle_aux_hidden_state_layer_ids=ids, imported_from=cfg.train.from_draft
    )
    write_manifest(
        out,
        {"stage": "train", "key": plan.stage_keys["train"], "extract_key": manifest["key"], "result": result.to_dict()},
    )
    print(f"[train] imported {cfg.train.from_draft} as reading aux_layers={list(cfg.train.layers)}: {draft_dir}")
    return result


def plot_accuracy(final: dict, steps: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = list(range(steps))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(ks, [final[f"acc_{k}"] for k in ks], marker="o", label="acc_k (marginal)")
    ax.plot(ks, [final[f"full_acc_{k}"] for k in ks], marker="s", label="full_acc_k (cumulative)")
    ax.set_xlabel("TTT position k")
    ax.set_ylabel("validation accuracy")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return path

"""The project's training step against SpecForge's, on one GPU, at the Kimi draft shape.

    python benchmarks/bench_train_gpu.py --json bench_train_gpu.json          # one GPU: seq 2048 and 8192
    python benchmarks/bench_train_gpu.py --device cpu --shape tiny --seqs 64 --steps 2 --warmup 1   # CI smoke run
    python benchmarks/bench_train_gpu.py --device cpu --estimate-memory --steps 0   # Kimi's peak memory, no GPU

In one process, on synthetic data (batch 1; random aux states [1, L, 3H] and teacher states [1, L, H], loss mask
all ones), it times per sequence length:
  * the project: `Eagle3Draft` and a random frozen `TeacherHead` through `TrainStep` (`ttt_forward`), TTT 7, step
    weights 0.8^k, bf16 autocast over float32 weights on a GPU (train.precision=auto), AdamW, gradient clipping;
  * SpecForge (`pip install --no-deps` its wheel): `OnlineEagle3Model` over `LlamaForCausalLMEagle3` with the same
    shape, vocabulary map and data, per attention backend in --specforge-backends; bf16 weights with float32
    master copies in its `BF16Optimizer`, loss sum(0.8^i * loss_i), as its trainer does. Its teacher logits come
    from a frozen bf16 [V, H] head over the same teacher states inside the timed step, as its strategy does for
    stored hidden states (--specforge-teacher head), or are made once outside the timing (logits).
It prints tokens/s, peak memory, model FLOPs utilisation and the ratio to SpecForge's flex_attention per length
(with --estimate-memory, also the project's peak estimated on fake tensors: see `estimate_memory`),
checks the two targets (>= 1.0x SpecForge flex_attention at 2048; 8192 within 80 GiB), and writes --json.
An out-of-memory configuration is reported as such; the others still run.

A script of its own rather than `bench_train.py --gpu`: that one composes Hydra configs and runs extraction on the
tiny target, and the GPU machine has neither hydra nor mlflow nor submitit. This one imports torch, transformers,
rich and the project's `orchestrator.draft`, `orchestrator.stages.train` and `orchestrator.compute`, and SpecForge
only when it times it. On the H200 image (torch, transformers, triton, safetensors, tqdm, requests, rich, pyyaml) it
needs two more wheels, omegaconf and antlr4-python3-runtime==4.9.3, because `orchestrator.stages.train` imports
`orchestrator.config` (omegaconf) directly and through `stages.extract` and `targets`; and the SpecForge wheel, with
--no-deps. Run from the repository root with PYTHONPATH=. (or the project installed with --no-deps).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from rich.console import Console
from rich.table import Table

from orchestrator.compute import DTYPES, peak_memory_bytes, resolve_precision, synchronize
from orchestrator.draft.export import build_vocab_map
from orchestrator.draft.model import DraftShape, Eagle3Draft, default_shape
from orchestrator.stages.train import Batch, TeacherHead, TrainStep, optimizer_step, step_counts, ttt_forward

# conf/draft/kimi_k25.yaml over conf/target/kimi_k25.yaml (hidden, vocabulary, rope theta); a test keeps them equal.
SHAPES = {
    "kimi": dict(
        target_hidden=7168,
        vocab=163840,
        num_aux=3,
        hidden=7168,
        heads=64,
        kv_heads=64,
        head_dim=128,
        intermediate=18432,
        draft_vocab=32000,
        eps=1e-6,
        rope_theta=50000.0,
    ),
    "tiny": dict(
        target_hidden=64,
        vocab=1024,
        num_aux=3,
        hidden=64,
        heads=4,
        kv_heads=4,
        head_dim=16,
        intermediate=128,
        draft_vocab=256,
        eps=1e-6,
        rope_theta=10000.0,
    ),
}
# conf/train/default.yaml
TTT_STEPS, STEP_WEIGHT_DECAY = 7, 0.8
LR, BETAS, WEIGHT_DECAY, GRAD_CLIP = 1e-3, (0.9, 0.95), 0.0, 0.5
TEACHER_KIND = "post_norm"  # conf/extract/default.yaml
GIB = 2**30
# float32 rounding between two implementations of one loss: 2e-7 measured on a CPU (TRITON_INTERPRET=1); the rope
# positions of TTT steps >= 1 left unshifted give 6e-4, aux blocks in another order 5e-2
AGREEMENT_REL = 5e-5
MEMORY_TARGET_GIB, RATIO_TARGET = 80.0, 1.0
PROJECT = "project"
# MFU's default peak: NVIDIA's H200 SXM data sheet, dense bf16 Tensor Core (1,979 with sparsity); docs/training.md#mfu
H200_DATASHEET_BF16_DENSE_TFLOPS = 989.0
DATASHEET_BASIS = "NVIDIA H200 SXM data sheet, dense bf16 Tensor Core"
MEASURED_BASIS = "given with --peak-tflops"


def shape_of(name: str, seq: int) -> DraftShape:
    s = SHAPES[name]
    return default_shape(
        s["target_hidden"],
        s["vocab"],
        s["num_aux"],
        s["hidden"],
        s["heads"],
        s["kv_heads"],
        s["head_dim"],
        s["intermediate"],
        s["draft_vocab"],
        s["eps"],
        s["rope_theta"],
        max(seq + TTT_STEPS, 2048),
    )


def flops_per_token(s: DraftShape, seq: int, ttt: int = TTT_STEPS) -> float:
    """Model FLOPs of one training token (docs/training.md#model-flops-per-token), multiply-adds counted as 2 FLOPs:

        6 x (K*Ht*H + T x (attention projections + 3*H*I + H*Vd + causal attention)) + 2*Ht*V

    6 = forward and backward of the draft; the fc runs once, the decoder layer and the draft head once per TTT step
    (T); attention projections = q, k, v from the 2H input and o; causal attention = QK^T and AV over on average
    half the sequence, heads*D*seq multiply-adds; 2*Ht*V = the frozen teacher head, forward only."""
    h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    projections = 2 * h * q + 2 * (2 * h * kv) + q * h
    causal_attention = q * seq
    per_step = projections + 3 * h * s.intermediate_size + h * s.draft_vocab_size + causal_attention
    fc = s.num_aux_layers * s.target_hidden_size * h
    return 6 * (fc + ttt * per_step) + 2 * s.target_hidden_size * s.vocab_size


@dataclass
class Data:
    """One synthetic batch: what the train stage's collate gives (float32 states), on the device."""

    batch: Batch
    d2t: torch.Tensor
    t2d: torch.Tensor


def vocab_map(s: DraftShape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.randint(0, 1000, (s.vocab_size,), generator=torch.Generator().manual_seed(seed))
    return build_vocab_map(counts, s.draft_vocab_size)


def synthetic(
    s: DraftShape, seq: int, device: torch.device, seed: int, mapping: tuple[torch.Tensor, torch.Tensor] | None = None
) -> Data:
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, s.vocab_size, (1, seq), generator=gen, device=device)
    aux = torch.randn(1, seq, s.num_aux_layers * s.target_hidden_size, generator=gen, device=device)
    teacher = torch.randn(1, seq, s.target_hidden_size, generator=gen, device=device)
    mask = torch.ones(1, seq, dtype=torch.bool, device=device)
    lengths = torch.tensor([seq], device=device)
    d2t, t2d = mapping or vocab_map(s, seed)
    return Data(Batch(ids, mask, lengths, aux, teacher), d2t.to(device), t2d.to(device))


def teacher_weights(s: DraftShape, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    lm_head = torch.randn(s.vocab_size, s.target_hidden_size, generator=gen, device=device)
    return {
        "norm": torch.ones(s.target_hidden_size, device=device),
        "lm_head": lm_head.mul_(s.target_hidden_size**-0.5),
    }


def project_step(
    s: DraftShape, data: Data, device: torch.device, dtype: torch.dtype, seed: int, held: list | None = None
) -> Callable[[], None]:
    """One optimizer step of the train stage's loop (`train.run`) on a world of one. `held`, when given,
    receives what the step holds between steps (the draft, the teacher head, the optimizer)."""
    torch.manual_seed(seed)
    with torch.device(device):
        draft = Eagle3Draft(s)
    draft.set_vocab_map(data.d2t, data.t2d)
    head = TeacherHead(teacher_weights(s, device, seed), TEACHER_KIND, s.rms_norm_eps)
    kept = draft.to_target_ids(torch.arange(s.draft_vocab_size, device=device))
    weights = [STEP_WEIGHT_DECAY**k for k in range(TTT_STEPS)]
    params = [p for p in draft.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    bf16 = dtype == torch.bfloat16  # autocast; the weights and the optimizer stay float32
    model = TrainStep(draft)
    draft.train()
    batch = data.batch
    if held is not None:
        held += [draft, head, optim]

    def step() -> None:
        denominators = step_counts(batch, TTT_STEPS).clamp(min=1)
        optimizer_step(
            model, head, batch, TTT_STEPS, kept, weights, denominators.to(device), optim, params, GRAD_CLIP, bf16
        )

    return step


def specforge_unavailable(device: torch.device, backend: str | None = None) -> str | None:
    """Why SpecForge (with attention `backend`, when given) cannot be timed here, or None."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            f"device is {device.type}: SpecForge's loss is a triton GPU kernel (specforge/core/loss.py); on a CPU it "
            "runs in triton's interpreter, with TRITON_INTERPRET=1 in the environment (scripts/make_specforge_env.sh)"
        )
    if device.type != "cuda" and backend == "flex_attention":
        return (
            f"device is {device.type}: torch {torch.__version__}'s flex_attention has no backward on a CPU "
            "(torch/nn/attention/flex_attention.py, _validate_device)"
        )
    try:
        import specforge.algorithms.eagle3.model  # noqa: F401  (imports triton for the loss)
        import specforge.modeling.draft.llama3_eagle  # noqa: F401
        import specforge.optimizer  # noqa: F401
    except Exception as exc:  # an ImportError, or one of its dependencies failing at import
        return f"cannot import specforge ({type(exc).__name__}: {exc}); install its wheel with pip install --no-deps"
    return None


def specforge_step(
    s: DraftShape, data: Data, device: torch.device, backend: str, teacher_mode: str, seed: int
) -> Callable[[], None]:
    """One step of SpecForge 0.2.0's trainer for EAGLE-3 on a world of one (no FSDP wrapper): its strategy's
    forward (`training/strategies/base.py` Eagle3TrainStrategy.forward_loss), backward and `BF16Optimizer.step`."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from specforge.utils import padding

    config = specforge_config(s)
    torch.manual_seed(seed)
    with torch.device(device):  # its builder: from_config, then .to(device, torch_dtype=bfloat16), embedding frozen
        draft = LlamaForCausalLMEagle3(config, attention_backend=backend)
    draft = draft.to(device=device, dtype=torch.bfloat16)
    draft.t2d.copy_(data.t2d)
    draft.d2t.copy_(data.d2t)
    draft.freeze_embedding()
    model = OnlineEagle3Model(draft_model=draft, length=TTT_STEPS, attention_backend=backend).to(device, torch.bfloat16)
    model.train()
    optimizer = BF16Optimizer(draft, lr=1e-4, max_grad_norm=GRAD_CLIP, total_steps=10**6, warmup_ratio=0.015)
    target_head = torch.nn.Linear(s.target_hidden_size, s.vocab_size, bias=False, device=device, dtype=torch.bfloat16)
    target_head.weight.requires_grad_(False)
    target_head.weight.copy_(teacher_weights(s, device, seed)["lm_head"])

    b = data.batch
    ids, teacher = b.ids, b.teacher.to(torch.bfloat16)
    hidden = b.aux.to(torch.bfloat16)
    attention_mask = b.loss_mask.long()
    loss_mask = b.loss_mask.long()
    precomputed = None
    if teacher_mode == "logits":  # online capture delivers the target's logits: no head in the step
        with torch.no_grad():
            precomputed = target_head(padding(teacher, left=False))

    def step() -> None:
        # TargetHead.preprocess (shift by one, mask [B, L, 1]) and TargetHead.forward (fc over the states)
        input_ids, mask = padding(ids, left=False), loss_mask[..., None]
        if precomputed is None:
            with torch.no_grad():
                target = target_head(padding(teacher, left=False))
        else:
            target = precomputed
        plosses, *_ = model(
            input_ids=input_ids, attention_mask=attention_mask, target=target, loss_mask=mask, hidden_states=hidden
        )
        loss = sum(STEP_WEIGHT_DECAY**i * p for i, p in enumerate(plosses))
        loss.backward()
        optimizer.step()

    return step


def specforge_config(s: DraftShape):
    """SpecForge's draft config for shape `s`: a transformers LlamaConfig, as its builder makes it."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=s.hidden_size,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate_size,
        vocab_size=s.vocab_size,
        rms_norm_eps=s.rms_norm_eps,
        max_position_embeddings=s.max_position_embeddings,
        rope_theta=s.rope_theta,
        hidden_act="silu",
        num_hidden_layers=1,
        pretraining_tp=1,
        tie_word_embeddings=False,
    )
    config.draft_vocab_size = s.draft_vocab_size
    config.target_hidden_size = s.target_hidden_size
    config.architectures = ["LlamaForCausalLMEagle3"]
    if s.num_aux_layers != 3:
        raise ValueError(f"SpecForge's draft takes 3 aux states; the shape has {s.num_aux_layers}")
    return config


def specforge_agreement(
    device: torch.device, seed: int, seq: int = 64, shape: str = "tiny", train_steps: int = 40
) -> dict[str, Any]:
    """The project's TTT loss and SpecForge's on one draft's weights and one batch, in float32: what the timed
    steps compute is the same training, or this says by how much it is not.

    The project's `Eagle3Draft` (random weights, norms included, then `train_steps` of the project's step on the
    batch) goes into SpecForge's `LlamaForCausalLMEagle3`
    by `load_state_dict(strict=True)` (the two share SGLang's names), and both run the 7-step unroll under teacher
    forcing on the same aux states, teacher states (through the same frozen head) and a random loss mask. Each
    side's conventions are met as its own trainer meets them: SpecForge's inputs are shifted by its
    `TargetHead.preprocess` (`specforge.utils.padding`), its loss mask is the project's one position on (the
    project masks the predicted token's position t+k+1, SpecForge position t+k of its shifted mask), and SpecForge
    leaves out of its loss the positions whose teacher token is outside the draft vocabulary, which the project
    counts (a token the draft can never be right on): the project's loss mask here leaves them out too. Compared
    per TTT step: the summed cross-entropy (SpecForge's loss is a mean over all B x L positions, times B x L), the
    right-token count and the counted positions. `wrong_layers` feeds SpecForge the aux states with their layer
    blocks rotated by one, as a draft served on other layers than it was trained on: the same comparison then
    differs, so the agreement is not one that any input would give."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.utils import padding

    s = shape_of(shape, seq)
    data = synthetic(s, seq, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    loss_mask = torch.rand(data.batch.ids.shape, generator=gen, device=device) > 0.25
    torch.manual_seed(seed)
    with torch.device(device):
        draft = Eagle3Draft(s)
    with torch.no_grad():  # norms away from 1, so that a norm applied in the wrong place shows
        for p in draft.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5, generator=gen)
    draft.set_vocab_map(data.d2t, data.t2d)
    head = TeacherHead(teacher_weights(s, device, seed), TEACHER_KIND, s.rms_norm_eps)
    kept = draft.to_target_ids(torch.arange(s.draft_vocab_size, device=device))
    weights = [STEP_WEIGHT_DECAY**k for k in range(TTT_STEPS)]
    b = data.batch
    # trained on the batch first (the project's own step), so that it gets tokens right and its loss depends on
    # which aux states it is given
    params = [p for p in draft.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    model = TrainStep(draft)
    for _ in range(train_steps):
        denominators = step_counts(b, TTT_STEPS).clamp(min=1).to(device)
        optimizer_step(model, head, b, TTT_STEPS, kept, weights, denominators, optim, params, GRAD_CLIP, False)
    draft.eval()
    with torch.no_grad():
        _, teacher_best = head(b.teacher, kept)
        in_draft_vocab = data.t2d[teacher_best]
        counted = Batch(b.ids, loss_mask, b.lengths, b.aux, b.teacher)
        folded = Batch(b.ids, loss_mask & in_draft_vocab, b.lengths, b.aux, b.teacher)
        ce_sum = ttt_forward(draft, head, folded, TTT_STEPS, kept, weights)[1][3]
        right, count = ttt_forward(draft, head, counted, TTT_STEPS, kept, weights)[1][[0, 2]]
        project = {"ce_sum": ce_sum.tolist(), "correct": right.tolist(), "count": count.tolist()}

        specforge = LlamaForCausalLMEagle3(specforge_config(s), attention_backend="sdpa").to(device)
        specforge.load_state_dict(draft.state_dict(), strict=True)
        model = OnlineEagle3Model(draft_model=specforge, length=TTT_STEPS, attention_backend="sdpa").eval()
        target = padding(b.teacher, left=False) @ head.lm_head.T
        width = b.ids.shape[0] * b.ids.shape[1]

        def run(aux: torch.Tensor) -> dict[str, list[float]]:
            plosses, _, _, corrects, denoms, *_ = model(
                input_ids=padding(b.ids, left=False),
                attention_mask=torch.ones_like(b.ids),
                target=target,
                loss_mask=padding(loss_mask.long(), left=False)[..., None],
                hidden_states=aux,
            )
            return {
                "ce_sum": [float(x) * width for x in plosses],
                "correct": [float(x) for x in corrects],
                "count": [float(x) for x in denoms],
            }

        ours = run(b.aux)
        h = s.target_hidden_size
        wrong = run(torch.cat([b.aux[..., h:], b.aux[..., :h]], dim=-1))

    def rel(a: list[float], c: list[float]) -> float:
        return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, c))

    return {
        "shape": shape,
        "seq": seq,
        "train_steps": train_steps,
        "project": project,
        "specforge": ours,
        "ce_sum_rel_diff": rel(ours["ce_sum"], project["ce_sum"]),
        "correct_equal": ours["correct"] == project["correct"],
        "count_equal": ours["count"] == project["count"],
        "wrong_layers_ce_sum_rel_diff": rel(wrong["ce_sum"], project["ce_sum"]),
    }


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":  # a benchmark's own bookkeeping; compute.py has no helper for it
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def timed(build: Callable[[], Callable[[], None]], device: torch.device, steps: int, warmup: int) -> float:
    """Seconds of `steps` steps after `warmup` untimed ones; the models die with this frame (or its traceback)."""
    step = build()
    for _ in range(warmup):
        step()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return time.perf_counter() - started


def measure(
    name: str,
    seq: int,
    build: Callable[[], Callable[[], None]],
    device: torch.device,
    steps: int,
    warmup: int,
    flops: float,
    peak_tflops: float | None,
) -> dict[str, Any]:
    """Times `steps` steps after `warmup` ones; the peak memory covers building, warming up and the timed steps."""
    row: dict[str, Any] = {"implementation": name, "seq": seq, "tokens_per_step": seq, "flops_per_token": flops}
    release(device)
    try:
        elapsed = timed(build, device, steps, warmup)
    except Exception as exc:
        oom = is_out_of_memory(exc)
        row |= {
            "status": "out of memory" if oom else "error",
            "reason": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
        }
        if not oom:
            traceback.print_exc()
    else:
        tps = steps * seq / elapsed
        row |= {
            "status": "measured",
            "step_s": elapsed / steps,
            "tokens_per_s": tps,
            "mfu": tps * flops / (peak_tflops * 1e12) if peak_tflops else None,
        }
    peak = peak_memory_bytes(device)
    row["peak_allocated_gib"] = None if peak is None else peak / GIB
    row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB if device.type == "cuda" else None
    release(device)
    return row


def _mem_tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker

    class FrozenAware(MemTracker):
        """torch 2.13's MemTracker puts a gradient hook on every parameter of each module it enters, and
        `register_hook` refuses a frozen one (the draft's embedding): a module with frozen parameters gets none.
        Its trainable submodules still get theirs when they run, so gradients are still counted as such."""

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            frozen = any(not p.requires_grad for p in module.parameters())
            return super()._track_module_params_and_buffers(
                module, install_grad_hooks=install_grad_hooks and not frozen
            )

    return FrozenAware


def estimate_memory(shape_name: str, seq: int, seed: int, steps: int = 2, fake: bool = True) -> dict[str, Any]:
    """The project's peak memory at one sequence length without a GPU: `steps` optimizer steps (the second one
    holds the optimizer's state beside the activations) run on fake tensors (torch's FakeTensorMode: shapes and
    dtypes, no data, no arithmetic) while torch's own MemTracker (torch.distributed._tools) records every live
    tensor's bytes by kind. The step is the benchmark's own (bf16 autocast over float32 weights and AdamW) with
    SDPA held to its flash kernel, the one CUDA picks for the bf16 TTT attention, so the attention keeps its
    output and log-sum-exp, not an [L, L] score tensor. Fake CUDA tensors need a CUDA build of torch, so the
    tensors are fake CPU ones under CPU autocast; the CUDA caching allocator's rounding and fragmentation and
    the kernels' workspaces are not in the figure. `fake=False` runs the same on real CPU tensors (a test compares
    the two at a small shape)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    FrozenAwareMemTracker = _mem_tracker_class()
    s = shape_of(shape_name, seq)
    cpu = torch.device("cpu")
    mapping = vocab_map(s, seed)
    with (
        FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(),
        sdpa_kernel([SDPBackend.FLASH_ATTENTION]),
    ):
        data = synthetic(s, seq, cpu, seed, mapping)
        held: list = []
        step = project_step(s, data, cpu, torch.bfloat16, seed, held)
        tracker = FrozenAwareMemTracker()
        tracker.track_external(*held, data.batch.aux, data.batch.teacher)
        with tracker:
            for _ in range(steps):
                step()
                tracker.reset_mod_stats()  # per-module figures are per call; the peak is the tracker's own
        peak = tracker.get_tracker_snapshot("peak")[cpu]
    kinds = {str(kind).split(".")[-1].lower(): value / GIB for kind, value in peak.items() if str(kind) != "Total"}
    return {
        "implementation": PROJECT,
        "seq": seq,
        "status": "estimated",
        "peak_estimated_gib": peak["Total"] / GIB,
        "by_kind_gib": {k: v for k, v in kinds.items() if v > 0},
    }


def skipped(name: str, seq: int, reason: str) -> dict[str, Any]:
    return {"implementation": name, "seq": seq, "status": "skipped", "reason": reason}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    flex = {
        r["seq"]: r for r in rows if r["implementation"] == "specforge:flex_attention" and r["status"] == "measured"
    }
    for r in rows:
        if r["implementation"] == PROJECT and r["status"] != "estimated":
            other = flex.get(r["seq"])
            r["ratio_to_specforge_flex"] = (
                r["tokens_per_s"] / other["tokens_per_s"] if other and r["status"] == "measured" else None
            )


def check_targets(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """PASS/FAIL/UNMEASURED: the project at >= 1.0x SpecForge flex_attention's tokens/s at 2048; at 8192 a peak
    below 80 GiB (an out-of-memory project step fails it)."""
    project = {r["seq"]: r for r in rows if r["implementation"] == PROJECT and r["status"] != "estimated"}
    flex = {r["seq"]: r for r in rows if r["implementation"] == "specforge:flex_attention"}
    ratio: dict[str, Any] = {
        "target": f">= {RATIO_TARGET}x SpecForge flex_attention tokens/s at seq 2048",
        "status": "UNMEASURED",
    }
    p, f = project.get(2048), flex.get(2048)
    if p and f and f["status"] == "measured":
        if p["status"] == "measured":
            ratio |= {
                "value": p["ratio_to_specforge_flex"],
                "status": "PASS" if p["ratio_to_specforge_flex"] >= RATIO_TARGET else "FAIL",
            }
        elif p["status"] == "out of memory":
            ratio["status"] = "FAIL"
    memory: dict[str, Any] = {
        "target": f"seq 8192 trains with a peak below {MEMORY_TARGET_GIB:.0f} GiB",
        "status": "UNMEASURED",
    }
    estimate = next((r for r in rows if r["status"] == "estimated" and r["seq"] == 8192), None)
    if estimate:  # a figure without a GPU; the target's status still needs the GPU's own peak
        memory["estimate_gib"] = estimate["peak_estimated_gib"]
    p = project.get(8192)
    if p and p["status"] == "out of memory":
        memory["status"] = "FAIL"
    elif p and p["status"] == "measured" and p["peak_allocated_gib"] is not None:
        memory |= {
            "value": p["peak_allocated_gib"],
            "status": "PASS" if p["peak_allocated_gib"] < MEMORY_TARGET_GIB else "FAIL",
        }
    return {"ratio_2048": ratio, "memory_8192": memory}


def same_loss_target(agreement: dict[str, Any] | None) -> dict[str, Any]:
    """PASS when SpecForge's per-step losses on the project's draft are the project's within AGREEMENT_REL (and
    its right-token and position counts equal), FAIL otherwise, UNMEASURED where SpecForge did not run."""
    target: dict[str, Any] = {
        "target": f"SpecForge's TTT loss on the project's draft within {AGREEMENT_REL:g} of the project's",
        "status": "UNMEASURED",
    }
    if agreement is None:
        return target
    ok = (
        "error" not in agreement
        and agreement["ce_sum_rel_diff"] <= AGREEMENT_REL
        and agreement["correct_equal"]
        and agreement["count_equal"]
    )
    return target | {"status": "PASS" if ok else "FAIL"}


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(result: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"Training step, {result['shape_name']} draft shape, batch 1, TTT {TTT_STEPS}, {result['device_name']}"
    )
    for column in (
        "implementation",
        "seq",
        "status",
        "tokens/s",
        "step ms",
        "peak GiB",
        "reserved GiB",
        "MFU",
        "x SpecForge flex",
    ):
        table.add_column(column, justify="left" if column in ("implementation", "status") else "right")
    for r in result["results"]:
        peak = r.get("peak_allocated_gib", r.get("peak_estimated_gib"))
        table.add_row(
            r["implementation"],
            str(r["seq"]),
            r["status"],
            fmt(r.get("tokens_per_s"), ",.0f"),
            fmt(r["step_s"] * 1e3 if r.get("step_s") else None, ",.1f"),
            fmt(peak, ".1f"),
            fmt(r.get("peak_reserved_gib"), ".1f"),
            fmt(r.get("mfu"), ".1%"),
            fmt(r.get("ratio_to_specforge_flex"), ".2f"),
        )
    console.print(table)
    reasons = dict.fromkeys(
        f"{r['implementation']} {r['status']}: {r['reason']}" for r in result["results"] if r.get("reason")
    )
    for line in reasons:
        console.print(line, soft_wrap=True)
    if result["peak_tflops"]:
        console.print(
            f"MFU: model FLOPs per token (docs/training.md#model-flops-per-token) x tokens/s over a peak of "
            f"{result['peak_tflops']:g} TFLOP/s ({result['peak_tflops_basis']})."
        )
    for r in result["results"]:
        if r["status"] == "estimated":
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in r["by_kind_gib"].items())
            console.print(
                f"estimated peak at seq {r['seq']}: {r['peak_estimated_gib']:.1f} GiB ({kinds}): fake tensors "
                "under torch's MemTracker, no GPU (--estimate-memory)",
                soft_wrap=True,
            )
    a = result.get("agreement")
    if a and "error" in a:
        console.print(f"SpecForge's loss on the project's draft: error: {a['error']}", soft_wrap=True)
    elif a:
        console.print(
            f"SpecForge's loss on the project's draft ({a['shape']} shape, seq {a['seq']}, float32, after "
            f"{a['train_steps']} of the project's steps): per-step cross-entropy within {a['ce_sum_rel_diff']:.1e} "
            f"(relative), right tokens {a['specforge']['correct']} "
            f"({'equal' if a['correct_equal'] else 'the project: ' + str(a['project']['correct'])}), positions "
            f"{'equal' if a['count_equal'] else 'differ'}; fed its aux blocks rotated by one: "
            f"{a['wrong_layers_ce_sum_rel_diff']:.1e}",
            soft_wrap=True,
        )
    t = result["targets"]
    parts = [
        f"{v['target']}: {v['status']}"
        + (f" ({v['value']:.2f})" if v.get("value") is not None else "")
        + (f" (estimated without a GPU: {v['estimate_gib']:.1f} GiB)" if v.get("estimate_gib") is not None else "")
        for v in t.values()
    ]
    console.print("targets: " + "; ".join(parts), soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="kimi")
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (SpecForge compiles in them)")
    ap.add_argument(
        "--specforge-backends", nargs="*", default=["flex_attention", "sdpa"], choices=["flex_attention", "sdpa", "fa"]
    )
    ap.add_argument(
        "--specforge-teacher",
        choices=["head", "logits"],
        default="head",
        help="head: SpecForge's teacher logits from the same teacher states in the step (the project's work); "
        "logits: made once outside the timing, as online capture delivers them",
    )
    ap.add_argument(
        "--precision", choices=["auto", "float32", "bfloat16"], default="auto", help="the project's train.precision"
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help=f"peak TFLOP/s for MFU, e.g. a measured bf16 matmul peak (default {H200_DATASHEET_BF16_DENSE_TFLOPS:g}: "
        f"the H200 data sheet's dense bf16)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--estimate-memory",
        action="store_true",
        help="also estimate the project's peak memory per length on fake tensors (seconds, no GPU needed)",
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="check the arguments and the shapes they name, print what would run, and stop (no device needed)",
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        plan = {
            "dry_run": True,
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "dry_run"},
            "flops_per_token": {seq: flops_per_token(shape_of(args.shape, seq), seq) for seq in args.seqs},
        }
        print(json.dumps(plan))
        if args.json:
            args.json.write_text(json.dumps(plan, indent=2) + "\n")
        return 0

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            ap.error(
                f"--device {args.device}: torch {torch.__version__} sees no CUDA device; use --device cpu --shape tiny"
            )
        torch.cuda.set_device(device)
    dtype = DTYPES[resolve_precision(args.precision, 1 if device.type == "cuda" else 0)]
    if args.peak_tflops is None:
        peak_tflops, peak_basis = H200_DATASHEET_BF16_DENSE_TFLOPS, DATASHEET_BASIS
    else:
        peak_tflops, peak_basis = args.peak_tflops, MEASURED_BASIS
    if device.type != "cuda":
        peak_tflops = None
    unavailable = specforge_unavailable(device) if args.specforge_backends else None
    console = Console(width=None if sys.stdout.isatty() else 200)

    rows = []
    for seq in args.seqs if args.estimate_memory else []:
        try:
            rows.append(estimate_memory(args.shape, seq, args.seed))
        except Exception as exc:  # e.g. an older torch without MemTracker on the GPU machine: the timing still runs
            rows.append(skipped(f"{PROJECT} (memory estimate)", seq, f"{type(exc).__name__}: {exc}"))
    for seq in args.seqs if args.steps > 0 else []:  # --steps 0: the estimate alone (what a CPU gives at Kimi's shape)
        s = shape_of(args.shape, seq)
        flops = flops_per_token(s, seq)
        data = synthetic(s, seq, device, args.seed)
        rows.append(
            measure(
                PROJECT,
                seq,
                lambda: project_step(s, data, device, dtype, args.seed),
                device,
                args.steps,
                args.warmup,
                flops,
                peak_tflops,
            )
        )
        for backend in args.specforge_backends:
            name = f"specforge:{backend}"
            why = unavailable or specforge_unavailable(device, backend)
            if why:
                rows.append(skipped(name, seq, why))
                continue
            rows.append(
                measure(
                    name,
                    seq,
                    lambda: specforge_step(s, data, device, backend, args.specforge_teacher, args.seed),
                    device,
                    args.steps,
                    args.warmup,
                    flops,
                    peak_tflops,
                )
            )
        data = None  # this length's tensors go before the next length's
        release(device)
        console.print(f"seq {seq}: done", style="dim")
    add_ratios(rows)
    for r in rows:
        if device.type == "cpu" and r["implementation"].startswith("specforge:") and r["status"] == "measured":
            r["reason"] = "its loss kernel ran in triton's interpreter (TRITON_INTERPRET=1): it runs; not a speed"
    agreement = None
    if not unavailable and args.steps > 0:  # what the SpecForge rows time is the project's training, or says not
        try:
            agreement = specforge_agreement(device, args.seed)
        except Exception as exc:
            traceback.print_exc()
            agreement = {"error": f"{type(exc).__name__}: {exc}"}
    targets = check_targets(rows)
    targets["same_loss"] = same_loss_target(agreement)

    try:
        specforge_version = metadata.version("specforge")
    except metadata.PackageNotFoundError:
        specforge_version = None
    result = {
        "benchmark": "benchmarks/bench_train_gpu.py",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specforge": specforge_version,
        "shape_name": args.shape,
        "shape": shape_of(args.shape, max(args.seqs)).as_dict(),
        "batch_size": 1,
        "ttt_steps": TTT_STEPS,
        "step_weight_decay": STEP_WEIGHT_DECAY,
        "steps": args.steps,
        "warmup": args.warmup,
        "precision": {
            "project": f"{str(dtype).removeprefix('torch.')} autocast over float32 weights and AdamW"
            if dtype == torch.bfloat16
            else str(dtype).removeprefix("torch."),
            "specforge": "bfloat16 weights, float32 master weights and AdamW (BF16Optimizer), no FSDP",
        },
        "specforge_teacher": args.specforge_teacher,
        "peak_tflops": peak_tflops,
        "peak_tflops_assumed": peak_tflops is not None and args.peak_tflops is None,  # the data sheet's, not given
        "peak_tflops_basis": peak_basis if peak_tflops is not None else None,
        "results": rows,
        "agreement": agreement,
        "targets": targets,
    }
    report(result, console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(r["status"] == "error" for r in rows) or targets["same_loss"]["status"] == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())

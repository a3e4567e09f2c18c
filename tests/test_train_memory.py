"""Training memory that does not grow with the vocabulary: the teacher head works a block of vocabulary rows at a
time and gives the loss and accuracy counts that the full-vocabulary logits gave."""

import pytest
import torch
import torch.nn.functional as F

from orchestrator.draft import export as E
from orchestrator.draft.model import DraftShape, Eagle3Draft
from orchestrator.stages.train import Batch, TeacherHead, counts_dict, ttt_forward, ttt_step_targets

VOCAB, DRAFT_VOCAB, HIDDEN = 50, 20, 32
SHAPE = DraftShape(
    hidden_size=HIDDEN,
    target_hidden_size=HIDDEN,
    num_aux_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=VOCAB,
    draft_vocab_size=DRAFT_VOCAB,
)


def make_case(seed=0, teacher="pre_norm", block_elements=2**28):
    torch.manual_seed(seed)
    draft = Eagle3Draft(SHAPE)
    for p in draft.parameters():
        p.data.normal_(0, 0.3)
    draft.set_vocab_map(*E.build_vocab_map(torch.randint(0, 100, (VOCAB,)), DRAFT_VOCAB))
    # a draft that reads one coordinate, so it drafts one of two tokens, and a teacher that mostly prefers one of
    # them: about half the draft's tokens are right, so the accuracy counts say something
    draft.norm.weight.data.zero_()
    draft.norm.weight.data[0] = 1
    likely = int(draft.lm_head.weight[:, 0].argmax())
    kept = draft.to_target_ids(torch.arange(DRAFT_VOCAB))
    direction = torch.randn(HIDDEN)
    lm_head = torch.randn(VOCAB, HIDDEN)
    lm_head[kept[likely]] = 4 * direction
    head = TeacherHead(
        {"norm": 1 + 0.1 * torch.randn(HIDDEN), "lm_head": lm_head}, teacher, 1e-6, block_elements=block_elements
    )
    lengths = torch.tensor([14, 9, 5])
    width = int(lengths.max())
    ids = torch.randint(0, VOCAB, (3, width))
    inside = torch.arange(width)[None] < lengths[:, None]
    batch = Batch(
        ids * inside,
        inside & (torch.rand(3, width) < 0.8),
        lengths,
        torch.randn(3, width, 3 * HIDDEN) * inside[..., None],
        (torch.randn(3, width, HIDDEN) + direction) * inside[..., None],
    )
    return draft, head, batch, kept


def _reference_ttt_forward(draft, head, batch, steps, kept, weights, own_tokens=False):
    """ttt_forward as first written, on the full-vocabulary teacher logits: the oracle."""
    with torch.no_grad():
        state = batch.teacher
        if head.teacher == "pre_norm":
            state = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + head.eps) * head.norm
        teacher_logits = state @ head.lm_head.T
    targets = ttt_step_targets(batch, teacher_logits, steps)
    valid = torch.arange(batch.ids.shape[1] - 1)[None, :] < (batch.lengths[:, None] - 1)
    source = None if own_tokens else (lambda k, _tokens: targets[k + 1][2])
    unrolled = draft.unroll(batch.aux[:, :-1], batch.ids[:, 1:], valid, steps, token_source=source)
    loss = torch.zeros(())
    stats = {"correct": [], "all_correct": [], "count": [], "ce_sum": []}
    chain_ok = None
    for k, ((t_logits, mask, _), d_logits, d_tokens) in enumerate(zip(targets, unrolled.logits, unrolled.tokens)):
        p = F.softmax(t_logits[..., kept], dim=-1)
        ce = -(p * F.log_softmax(d_logits.float(), dim=-1)).sum(-1)
        loss = loss + weights[k] * (ce * mask).sum() / mask.sum().clamp(min=1)
        right = d_tokens == t_logits.argmax(-1)
        chain_ok = right if chain_ok is None else chain_ok & right
        stats["correct"].append(int((right & mask).sum()))
        stats["all_correct"].append(int((chain_ok & mask).sum()))
        stats["count"].append(int(mask.sum()))
        stats["ce_sum"].append(float((ce * mask).sum().detach()))
    return loss, stats


@pytest.mark.parametrize("own_tokens", [False, True])
@pytest.mark.parametrize("teacher", ["pre_norm", "post_norm"])
@pytest.mark.parametrize("rows_per_block", [None, 7, 1])
def test_ttt_forward_equals_full_vocabulary_reference(own_tokens, teacher, rows_per_block):
    steps = 4
    block = 2**28 if rows_per_block is None else 3 * 14 * rows_per_block  # B * L logits per vocabulary row
    draft, head, batch, kept = make_case(teacher=teacher, block_elements=block)
    weights = [0.8**k for k in range(steps)]
    loss, counts = ttt_forward(draft, head, batch, steps, kept, weights, own_tokens=own_tokens)
    stats = counts_dict(counts)
    ref_loss, ref_stats = _reference_ttt_forward(draft, head, batch, steps, kept, weights, own_tokens=own_tokens)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert stats["ce_sum"] == pytest.approx(ref_stats.pop("ce_sum"), rel=1e-6)
    assert {k: v for k, v in stats.items() if k != "ce_sum"} == ref_stats
    assert stats["correct"][0] > 0 and stats["correct"][0] < stats["count"][0]
    g = torch.autograd.grad(loss, draft.fc.weight)[0]
    torch.testing.assert_close(g, torch.autograd.grad(ref_loss, draft.fc.weight)[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rows_per_block", [1, 3, 16, 50])
def test_teacher_head_blocks_give_full_vocabulary_argmax_and_kept_logits(rows_per_block):
    """Ties across blocks go to the lower id, as with one argmax; a winner outside the draft vocabulary is kept."""
    _, _, _, kept = make_case()
    # small integers: every logit is exact whatever the summation order, so ties are exact ties
    lm_head = torch.randint(-3, 4, (VOCAB, HIDDEN)).float()
    outside = [i for i in range(VOCAB) if i not in set(kept.tolist())]
    lm_head[outside[-1]] = lm_head[kept[0]] = lm_head[3] = 3  # a three-way tie far apart in the vocabulary
    state = torch.randint(0, 3, (3, 14, HIDDEN)).float()
    head = TeacherHead(
        {"norm": torch.ones(HIDDEN), "lm_head": lm_head}, "post_norm", 1e-6, block_elements=3 * 14 * rows_per_block
    )
    full = state @ lm_head.T
    kept_logits, best = head(state, kept)
    assert torch.equal(kept_logits, full[..., kept])
    assert torch.equal(best, full.argmax(-1))
    assert int((best == min(3, int(kept[0]))).sum()) > 0, "the tie is exercised"


def write_split(folder, shards, per_shard=6, hidden=16, aux_layers=(1, 2, 3), seed=0):
    """A split of synthetic shards in the extraction's format, and its manifest."""
    from safetensors.torch import save_file

    from orchestrator.artifacts import file_sha256

    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(shards):
        lens = torch.randint(3, 40, (per_shard,), generator=g, dtype=torch.int32)
        n = int(lens.sum())
        tensors = {
            "input_ids": torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int32),
            "loss_mask": (torch.rand(n, generator=g) < 0.7).to(torch.uint8),
            "seq_lens": lens,
            "aux_hidden_states": torch.randn(n, len(aux_layers) * hidden, generator=g).to(torch.bfloat16),
            "teacher_hidden_state": torch.randn(n, hidden, generator=g).to(torch.bfloat16),
        }
        path = folder / "train" / f"shard_{i:05d}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path))
        records.append({"file": f"train/{path.name}", "bytes": path.stat().st_size, "sha256": file_sha256(path)})
    return {"hidden_size": hidden, "aux_layers": list(aux_layers), "splits": {"train": {"shards": records}}}


def eager_sequences(folder, manifest, columns):
    """Every sequence read at once, as the loader did before it streamed: the oracle."""
    from safetensors.torch import load_file

    out = []
    for record in manifest["splits"]["train"]["shards"]:
        t = load_file(str(folder / record["file"]))
        offsets = [0] + torch.cumsum(t["seq_lens"].long(), 0).tolist()
        for a, b in zip(offsets[:-1], offsets[1:]):
            out.append(
                (
                    t["input_ids"][a:b].long(),
                    t["loss_mask"][a:b].bool(),
                    t["aux_hidden_states"][a:b][:, columns],
                    t["teacher_hidden_state"][a:b],
                )
            )
    return out


def test_streaming_split_reads_what_was_written(tmp_path):
    from orchestrator.states.shards import load_split

    manifest = write_split(tmp_path, shards=3)
    split = load_split(tmp_path, manifest, "train", [3, 1])
    columns = torch.cat([torch.arange(16) + 2 * 16, torch.arange(16)])
    expected = eager_sequences(tmp_path, manifest, columns)
    assert len(split) == len(expected) == 18
    for got, want in zip([*split[:5], *(split[i] for i in range(5, len(split)))], expected):
        for a, b in zip((got.input_ids, got.loss_mask, got.aux, got.teacher), want):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(split[-1].input_ids, expected[-1][0])
    with pytest.raises(IndexError):
        split[len(split)]


def _live_tensor_bytes() -> int:
    import gc

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_streaming_split_holds_bounded_ram_whatever_the_data_set_size(tmp_path):
    """A training pass over a data set 10x larger holds no more tensor memory: only the offsets (8 bytes a sequence,
    three times) and the batch in hand, never the shards."""
    import gc

    peaks = {}
    # Objects alive before the test are moved out of the collector's sight: counting the tensors then walks only
    # what the test makes (seconds, not the whole session's heap at every step).
    gc.collect()
    gc.freeze()
    try:
        _stream_passes(tmp_path, peaks)
    finally:
        gc.unfreeze()
    # the largest batch: 4 sequences of at most 39 tokens, float32 aux (3 * 64) and teacher (64) states
    batch_bytes = 4 * 39 * (3 * 64 + 64) * 4 * 2
    peak, data_bytes = peaks[20]
    assert peak <= batch_bytes + 3 * 8 * 120 + 4096 and peak < data_bytes / 4, peaks


def _stream_passes(tmp_path, peaks: dict) -> None:
    from orchestrator.stages.train import collate
    from orchestrator.states.shards import load_split
    from orchestrator.states.source import step_indices

    for shards in (2, 20):
        manifest = write_split(tmp_path / str(shards), shards=shards, per_shard=6, hidden=64)
        data_bytes = sum(r["bytes"] for r in manifest["splits"]["train"]["shards"])
        before = _live_tensor_bytes()
        split = load_split(tmp_path / str(shards), manifest, "train")
        peak = 0
        for step in range(len(split) // 4):
            batch = collate([split[i] for i in step_indices(len(split), 4, 0, step)])
            peak = max(peak, _live_tensor_bytes() - before)
            del batch
        held = _live_tensor_bytes() - before
        assert held <= 3 * 8 * len(split) + 4096, f"{held} bytes held after a pass over {data_bytes} bytes of shards"
        peaks[shards] = peak, data_bytes

"""The project's CPU stand-in for sgl_kernel (orchestrator/engines/sglang/cpu_kernels/sgl_kernel), run in the project's
own environment (no SGLang needed): the attention ops against PyTorch's scaled_dot_product_attention over the K/V
gathered from the cache, and each EAGLE bookkeeping op against a small result written out by hand from its contract
(SGLang 0.5.23's call sites and the Triton kernels beside them).

The package is loaded from its file under a private module name, so `sgl_kernel` never enters sys.modules; its
torch.ops.sgl_kernel registrations are process-wide, which no other test uses."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

PACKAGE = Path(__file__).parents[1] / "orchestrator/engines/sglang/cpu_kernels/sgl_kernel/__init__.py"


def _load_stand_in():
    spec = importlib.util.spec_from_file_location("orchestrator_tests_sgl_kernel_stand_in", PACKAGE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sgl_kernel = _load_stand_in()
OPS = torch.ops.sgl_kernel

HEADS, KV_HEADS, QK_DIM, V_DIM = 4, 2, 32, 16
SCALE = QK_DIM**-0.5
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class Pool:
    """A KV cache of 64 slots and a req_to_token table of 4 rows whose slots are shuffled, as an allocator leaves
    them; slot 0 stays unused (SGLang's padding slot)."""

    def __init__(self, dtype, v_dim=V_DIM, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.k_buffer = torch.randn(64, KV_HEADS, QK_DIM, generator=generator).to(dtype)
        self.v_buffer = torch.randn(64, KV_HEADS, v_dim, generator=generator).to(dtype)
        slots = torch.randperm(63, generator=generator)[: 4 * 15] + 1
        self.req_to_token = slots.view(4, 15).to(torch.int32)
        self.generator = generator

    def randn(self, *shape, dtype):
        return torch.randn(*shape, generator=self.generator).to(dtype)

    def gathered(self, req, length):
        slots = self.req_to_token[req, :length].long()
        return self.k_buffer[slots].float(), self.v_buffer[slots].float()


def sdpa(q, k, v, visible=None):
    """q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv] -> [T, H, Dv] by PyTorch's SDPA (visible: [T, S], True attends)."""
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible, scale=SCALE, enable_gqa=True
    )
    return out.transpose(0, 1)


def capped_attention(q, k, v, cap, visible=None, sinks=None):
    """The contract written out: softmax over cap * tanh(q.k * scale / cap), a sink adding exp(sink[h]) to head h's
    denominator; kv head h // 2 serves query head h."""
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    logits = torch.einsum("thd,shd->hts", q.float(), k) * SCALE
    if cap:
        logits = cap * torch.tanh(logits / cap)
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    weights = logits.exp()
    denominator = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + sinks.view(-1, 1, 1).exp()
    return torch.einsum("hts,shd->thd", weights / denominator, v)


def extend(pool, q, k, v, seqs, *, logit_cap=0.0, window=0, tree_mask=None, is_causal=True):
    """Calls extend_attention_cpu as intel_amx_backend.py does, seqs [(req, prefix, extend)]; returns the output."""
    extend_lens = [n for _, _, n in seqs]
    starts = torch.tensor([0, *extend_lens[:-1]]).cumsum(0).to(torch.int32)
    out = torch.full((q.shape[0], HEADS * pool.v_buffer.shape[-1]), float("nan"), dtype=q.dtype)
    OPS.extend_attention_cpu(
        q, k, v, out.view(-1, HEADS, pool.v_buffer.shape[-1]), pool.k_buffer, pool.v_buffer, 1.0, 1.0,
        pool.req_to_token, torch.tensor([r for r, _, _ in seqs]), torch.tensor([p + n for _, p, n in seqs]),
        torch.tensor(extend_lens, dtype=torch.int32), starts, max(extend_lens), SCALE, logit_cap, False, window,
        None, None, tree_mask, is_causal,
    )  # fmt: skip
    return out.view(-1, HEADS, pool.v_buffer.shape[-1])


def new_tokens(pool, seqs, dtype):
    """q, k, v for the seqs' new tokens, k/v written into the cache at their slots first, as the backend's
    set_kv_buffer does before extend_attention_cpu."""
    total = sum(n for _, _, n in seqs)
    q = pool.randn(total, HEADS, QK_DIM, dtype=dtype)
    k = pool.randn(total, KV_HEADS, QK_DIM, dtype=dtype)
    v = pool.randn(total, KV_HEADS, pool.v_buffer.shape[-1], dtype=dtype)
    start = 0
    for req, prefix, n in seqs:
        slots = pool.req_to_token[req, prefix : prefix + n].long()
        pool.k_buffer[slots], pool.v_buffer[slots] = k[start : start + n], v[start : start + n]
        start += n
    return q, k, v


def causal(prefix, n):
    return torch.arange(prefix + n).view(1, -1) <= prefix + torch.arange(n).view(-1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_matches_sdpa_over_prefix_and_causal_new_tokens(dtype):
    pool = Pool(dtype)
    seqs = [(2, 5, 3), (0, 0, 4), (3, 3, 2)]  # (req_to_token row, prefix, extend): GQA, qk 32 / v 16
    q, k, v = new_tokens(pool, seqs, dtype)
    out = extend(pool, q, k, v, seqs)
    assert out.dtype == dtype
    start = 0
    for req, prefix, n in seqs:
        keys, values = pool.gathered(req, prefix + n)
        expected = sdpa(q[start : start + n], keys, values, causal(prefix, n))
        torch.testing.assert_close(out[start : start + n].float(), expected, atol=TOLERANCE[dtype], rtol=0)
        start += n
    # KV-shared layers (Gemma4) pass no k/v: the new tokens' K/V come from the cache, where the backend put them
    torch.testing.assert_close(extend(pool, q, None, None, seqs), out, atol=0, rtol=0)


def test_extend_with_equal_head_dims_and_no_causal_mask():
    pool = Pool(torch.float32, v_dim=QK_DIM)
    seqs = [(1, 4, 3), (2, 2, 5)]
    q, k, v = new_tokens(pool, seqs, torch.float32)
    out = extend(pool, q, k, v, seqs, is_causal=False)
    start = 0
    for req, prefix, n in seqs:
        keys, values = pool.gathered(req, prefix + n)
        torch.testing.assert_close(out[start : start + n], sdpa(q[start : start + n], keys, values), atol=1e-5, rtol=0)
        start += n


# Two verify trees of 5 tokens (0 is the bonus, the root), each row a token's ancestors and itself: SGLang's
# QLEN_ONLY layout, which its CPU path builds (eagle_utils.default_tree_mask_mode)
TREE_ROWS = [
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 1]],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_verify_follows_the_tree_mask_in_either_layout(dtype):
    pool = Pool(dtype, seed=1)
    seqs = [(3, 6, 5), (1, 2, 5)]
    q, k, v = new_tokens(pool, seqs, dtype)
    blocks = torch.tensor(TREE_ROWS, dtype=torch.bool)
    out = extend(pool, q, k, v, seqs, tree_mask=blocks.flatten())
    start = 0
    for (req, prefix, n), block in zip(seqs, blocks):
        keys, values = pool.gathered(req, prefix + n)
        visible = torch.cat([torch.ones(n, prefix, dtype=torch.bool), block], dim=1)
        expected = sdpa(q[start : start + n], keys, values, visible)
        torch.testing.assert_close(out[start : start + n].float(), expected, atol=TOLERANCE[dtype], rtol=0)
        start += n
    # FULL_MASK (the GPU layout): per sequence [n, prefix + n] with the prefix columns, padded with True at the end
    full = [torch.cat([torch.ones(5, p, dtype=torch.bool), b], dim=1).flatten() for (_, p, _), b in zip(seqs, blocks)]
    full_mask = torch.cat([*full, torch.ones(7, dtype=torch.bool)])
    torch.testing.assert_close(extend(pool, q, k, v, seqs, tree_mask=full_mask), out, atol=0, rtol=0)


def test_extend_logit_cap_and_sliding_window():
    pool = Pool(torch.float32, seed=2)
    seqs = [(0, 6, 4), (2, 1, 3)]
    q, k, v = new_tokens(pool, seqs, torch.float32)
    q = q * 4  # logits well past the cap
    window = 3  # the backend's layer.sliding_window_size + 1: a query sees itself and the 2 keys before it
    out = extend(pool, q, k, v, seqs, logit_cap=5.0, window=window)
    start = 0
    for req, prefix, n in seqs:
        keys, values = pool.gathered(req, prefix + n)
        distance = prefix + torch.arange(n).view(-1, 1) - torch.arange(prefix + n).view(1, -1)
        visible = (distance >= 0) & (distance < window)
        expected = capped_attention(q[start : start + n], keys, values, 5.0, visible)
        torch.testing.assert_close(out[start : start + n], expected, atol=1e-5, rtol=0)
        uncapped = capped_attention(q[start : start + n], keys, values, 0.0, visible)
        assert not torch.allclose(expected, uncapped, atol=1e-3)  # the cap matters in this case
        start += n


def decode(pool, q, key, value, loc, reqs, seq_lens, *, window=0, sinks=None):
    """Calls decode_attention_cpu as intel_amx_backend.py does; returns the output (written into a flat buffer's
    view, as the backend's `o.view(-1, H, Dv)`)."""
    v_dim = pool.v_buffer.shape[-1]
    out = torch.full((len(reqs), HEADS * v_dim), float("nan"), dtype=q.dtype)
    attn_logits = torch.zeros(len(reqs), HEADS, 8, v_dim + 1)
    OPS.decode_attention_cpu(
        q, pool.k_buffer, pool.v_buffer, 1.0, 1.0, out.view(-1, HEADS, v_dim), key, value, loc, attn_logits,
        pool.req_to_token, torch.tensor(reqs), torch.tensor(seq_lens), SCALE, 0.0, False, window, None, sinks,
    )  # fmt: skip
    return out.view(-1, HEADS, v_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_writes_the_new_kv_at_cache_loc_then_matches_sdpa(dtype):
    pool = Pool(dtype, seed=3)
    reqs, seq_lens = [1, 3, 0], [6, 1, 9]
    loc = torch.tensor([int(pool.req_to_token[r, n - 1]) for r, n in zip(reqs, seq_lens)])
    untouched = pool.k_buffer.clone()
    q = pool.randn(3, HEADS, QK_DIM, dtype=dtype)
    key, value = pool.randn(3, KV_HEADS, QK_DIM, dtype=dtype), pool.randn(3, KV_HEADS, V_DIM, dtype=dtype)
    out = decode(pool, q, key, value, loc, reqs, seq_lens)
    assert torch.equal(pool.k_buffer[loc], key) and torch.equal(pool.v_buffer[loc], value)
    others = torch.ones(64, dtype=torch.bool)
    others[loc] = False
    assert torch.equal(pool.k_buffer[others], untouched[others])
    for i, (req, n) in enumerate(zip(reqs, seq_lens)):
        keys, values = pool.gathered(req, n)
        torch.testing.assert_close(out[i].float(), sdpa(q[i : i + 1], keys, values)[0], atol=TOLERANCE[dtype], rtol=0)


def test_decode_sliding_window_and_sinks_without_new_kv():
    pool = Pool(torch.float32, seed=4)
    reqs, seq_lens = [2, 0], [9, 3]
    q = pool.randn(2, HEADS, QK_DIM, dtype=torch.float32)
    before = pool.k_buffer.clone(), pool.v_buffer.clone()
    windowed = decode(pool, q, None, None, None, reqs, seq_lens, window=4)  # the last 4 keys
    assert torch.equal(pool.k_buffer, before[0]) and torch.equal(pool.v_buffer, before[1])
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    sunk = decode(pool, q, None, None, None, reqs, seq_lens, sinks=sinks)
    for i, (req, n) in enumerate(zip(reqs, seq_lens)):
        keys, values = pool.gathered(req, n)
        expected = sdpa(q[i : i + 1], keys[-4:], values[-4:])[0]
        torch.testing.assert_close(windowed[i], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(sunk[i], capped_attention(q[i : i + 1], keys, values, 0.0, sinks=sinks)[0])


def test_attention_refuses_cross_attention_by_name():
    pool = Pool(torch.float32)
    q = pool.randn(1, HEADS, QK_DIM, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="decode_attention_cpu: is_cross_attn / encoder_lens"):
        OPS.decode_attention_cpu(
            q, pool.k_buffer, pool.v_buffer, 1.0, 1.0, torch.empty(1, HEADS, V_DIM), None, None, None,
            torch.zeros(1, HEADS, 8, V_DIM + 1), pool.req_to_token, torch.tensor([0]), torch.tensor([2]), SCALE,
            0.0, True, 0, torch.tensor([2]), None,
        )  # fmt: skip


def test_unknown_names_fail_naming_themselves():
    with pytest.raises(AttributeError, match=r"sgl_kernel\.rotary_embedding_cpu: not provided by the project's CPU"):
        sgl_kernel.rotary_embedding_cpu  # noqa: B018
    assert not hasattr(sgl_kernel, "fused_experts_cpu")  # SGLang's optional probes see a plain absence
    # cpu_has_amx_support() asks for this op: absent, every linear layer takes SGLang's PyTorch path
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
    assert sgl_kernel.STAND_IN  # what launch.py checks


def test_attention_ops_accept_sglangs_fake_kernels():
    """SGLang's CPU torch.compile path registers fake kernels for both ops (cpu_graph_runner.register_fake_ops),
    which works only while the stand-in registers no Meta kernel of its own."""
    scope = torch.library.Library("sgl_kernel", "FRAGMENT")
    try:
        for op in ("decode_attention_cpu", "extend_attention_cpu"):
            torch.library.register_fake(f"sgl_kernel::{op}", lambda *args: None, lib=scope)
    finally:
        scope._destroy()


def test_assign_req_to_token_pool_writes_each_requests_run():
    req_to_token = torch.zeros(3, 8, dtype=torch.int32)
    out_cache_loc = torch.tensor([10, 11, 20, 21, 22])
    sgl_kernel.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), req_to_token, torch.tensor([1, 3]), torch.tensor([3, 6]), out_cache_loc, 8
    )
    assert req_to_token.tolist() == [[0, 0, 0, 20, 21, 22, 0, 0], [0] * 8, [0, 10, 11, 0, 0, 0, 0, 0]]


def test_assign_extend_cache_locs_packs_the_ranges_and_leaves_the_tail():
    req_to_token = torch.tensor([[100, 101, 102, 103, 104], [200, 201, 202, 203, 204]], dtype=torch.int32)
    out = torch.full((6,), -7)
    sgl_kernel.assign_extend_cache_locs_cpu(
        torch.tensor([1, 0]), req_to_token, torch.tensor([3, 0], dtype=torch.int32), torch.tensor([5, 2]), out, 5
    )
    assert out.dtype == torch.int64 and out.tolist() == [203, 204, 100, 101, -7, -7]


def test_assign_draft_cache_locs_copies_topk_times_steps_slots_from_seq_len():
    req_to_token = torch.arange(20).view(2, 10) + 100
    out = torch.zeros(8, dtype=torch.int64)
    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(
        torch.tensor([1, 0]), req_to_token, torch.tensor([3, 1]), out, 10, 2, 2
    )
    assert out.tolist() == [113, 114, 115, 116, 101, 102, 103, 104]


def test_build_draft_decode_metadata_gives_each_branch_prefix_then_its_chain():
    req_to_token = torch.stack([torch.arange(100, 110), torch.arange(200, 210)]).to(torch.int32)
    table = sgl_kernel.build_draft_decode_metadata_cpu(
        req_to_token, torch.tensor([1, 0]), torch.tensor([2, 3]), 2, 2, 10
    )
    assert table.dtype == torch.int32
    assert table.tolist() == [
        [200, 201, 202, 203, 0, 0, 0, 0, 0, 0],  # request 0 (row 1, 2 tokens), branch 0: slots 2, 3
        [200, 201, 204, 205, 0, 0, 0, 0, 0, 0],  # branch 1: slots 4, 5
        [100, 101, 102, 103, 104, 0, 0, 0, 0, 0],  # request 1 (row 0, 3 tokens), branch 0: slots 3, 4
        [100, 101, 102, 105, 106, 0, 0, 0, 0, 0],  # branch 1: slots 5, 6
    ]


def test_fill_bonus_tokens_takes_each_requests_last_accepted_token():
    bonus = torch.zeros(2, dtype=torch.int32)
    sgl_kernel.fill_bonus_tokens_cpu(torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([2, 3]), bonus, 3)
    assert bonus.tolist() == [6, 10]


def test_fill_accept_out_cache_loc_packs_accepted_slots_skipping_padding():
    accepted = torch.zeros(6, dtype=torch.int64)
    out_cache_loc = torch.tensor([50, 51, 52, 53, 54, 55])
    sgl_kernel.fill_accept_out_cache_loc_cpu(torch.tensor([[0, 2, -1], [4, -1, -1]]), out_cache_loc, accepted)
    assert accepted.tolist() == [50, 52, 54, 0, 0, 0]


def test_copy_all_layer_kv_cache_moves_slots_in_every_buffer_reading_first():
    k = torch.randn(6, 2, 4).to(torch.bfloat16)
    v = torch.randn(6, 2, 3)
    before_k, before_v = k.clone(), v.clone()
    data_ptrs = torch.tensor([k.data_ptr(), v.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([k.stride(0) * k.element_size(), v.stride(0) * v.element_size()])
    # slot 2 is written by the first move and read by the second: it must be read before it is overwritten
    sgl_kernel.copy_all_layer_kv_cache_cpu(data_ptrs, strides, torch.tensor([2, 1]), torch.tensor([4, 2]))
    for after, before in ((k, before_k), (v, before_v)):
        assert torch.equal(after[2], before[4]) and torch.equal(after[1], before[2])
        assert torch.equal(after[[0, 3, 4, 5]], before[[0, 3, 4, 5]])


# topk 2, 2 steps, 5 verify tokens. Selected ids index the draft's flattened scores (0..1: the root's children A, B;
# 2..5: child c of step-0 token p at 2 + 2p + c); id // topk indexes parent_list, whose entry is the parent's id.
# Request 0 picks A, B, AA, BA; request 1 picks A, AA, AB and BB, whose parent B it did not pick.
PARENT_LIST = [[-1, 0, 1], [-1, 0, 1]]
SELECTED = [[0, 1, 2, 4], [0, 2, 3, 5]]


def build_tree(seq_lens, mode, tree_mask):
    n = 5
    positions = torch.full((2 * n,), -9)
    retrieve = torch.full((3, 2, n), -1)
    sgl_kernel.build_tree_kernel_efficient_cpu(
        torch.tensor(PARENT_LIST), torch.tensor(SELECTED), torch.tensor(seq_lens), tree_mask, positions,
        retrieve[0], retrieve[1], retrieve[2], 2, 2, n, mode,
    )  # fmt: skip
    return positions, retrieve


def test_build_tree_links_positions_and_qlen_mask():
    tree_mask = torch.ones(2 * 5 * 5, dtype=torch.bool)
    positions, (index, next_token, next_sibling) = build_tree([3, 2], 1, tree_mask)
    assert index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    # request 0: root -> A (then sibling B); A -> AA; B -> BA. Request 1: root -> A; A -> AA (then sibling AB)
    assert next_token.tolist() == [[1, 3, 4, -1, -1], [1, 2, -1, -1, -1]]
    assert next_sibling.tolist() == [[-1, 2, -1, -1, -1], [-1, -1, 3, -1, -1]]
    assert positions.tolist() == [3, 4, 4, 5, 5, 2, 3, 4, 4, 3]
    assert tree_mask.view(2, 5, 5).int().tolist() == TREE_ROWS


def test_build_tree_full_mask_writes_the_draft_block_after_each_prefix():
    tree_mask = torch.ones(5 * (3 + 5) + 5 * (2 + 5), dtype=torch.bool)
    positions, _ = build_tree([3, 2], 0, tree_mask)
    assert positions.tolist() == [3, 4, 4, 5, 5, 2, 3, 4, 4, 3]
    first, second = tree_mask[:40].view(5, 8), tree_mask[40:].view(5, 7)
    assert first[:, :3].all() and second[:, :2].all()  # prefix columns: the caller's fill
    assert [first[:, 3:].int().tolist(), second[:, 2:].int().tolist()] == TREE_ROWS


def test_build_tree_refuses_the_bit_packed_mask_by_name():
    with pytest.raises(NotImplementedError, match="build_tree_kernel_efficient_cpu: tree_mask_mode 2"):
        build_tree([3, 2], 2, torch.zeros(10, dtype=torch.uint8))


def test_verify_tree_greedy_walks_children_then_siblings():
    # the trees of test_build_tree_links_positions_and_qlen_mask; candidates by tree position
    predicts = torch.zeros(10, dtype=torch.int32)
    accept_index = torch.full((2, 3), -1)
    accept_token_num = torch.zeros(2, dtype=torch.int32)
    sgl_kernel.verify_tree_greedy_cpu(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
        candidates=torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]),
        retrive_index=torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),
        retrive_next_token=torch.tensor([[1, 3, 4, -1, -1], [1, 2, -1, -1, -1]]),
        retrive_next_sibling=torch.tensor([[-1, 2, -1, -1, -1], [-1, -1, 3, -1, -1]]),
        # request 0: the target says B (not A) after the root, BA after B, then 99; request 1: A, then 50 (no child)
        target_predict=torch.tensor([[12, 0, 14, 0, 99], [21, 50, 0, 0, 0]]),
    )
    assert accept_index.tolist() == [[0, 2, 4], [5, 6, -1]]
    assert accept_token_num.tolist() == [2, 1]
    assert predicts.tolist() == [12, 0, 14, 0, 99, 21, 50, 0, 0, 0]

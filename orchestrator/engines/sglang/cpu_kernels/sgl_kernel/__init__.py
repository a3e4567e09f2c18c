"""The project's PyTorch stand-in for `sgl_kernel` on a CPU: the ops SGLang 0.5.23's CPU engine calls for the
`intel_amx` attention backend and EAGLE speculative decoding, where PyPI's sgl_kernel is CUDA-only. Put on the path
by ../launch.py only where no real sgl_kernel loads; imports nothing but torch and the standard library.

Written from SGLang 0.5.23's call sites and the ops' documented behaviour; no SGLang code is copied. Each op's
contract comes from its call site and from the Triton or PyTorch version SGLang keeps beside it (SGLang is
Apache-2.0), named in the op's docstring. Outputs are written in place, as the real ops do; only
`build_draft_decode_metadata_cpu` returns a tensor.

- `torch.ops.sgl_kernel.decode_attention_cpu` and `extend_attention_cpu` (sglang/srt/layers/attention/
  intel_amx_backend.py) compute in float32 and write the output in its own dtype. Not supported, and refused by
  name: cross-attention and `encoder_lens` (encoder-decoder models) and, in extend, a prefix read through a KV
  cache whose head count differs from the new keys' (MLA).
- The EAGLE bookkeeping ops are plain functions (`from sgl_kernel import NAME`).

There are no submodules: `from sgl_kernel.speculative import ...` (SGLang's NGRAM worker), `sgl_kernel.mamba` and the
like raise ModuleNotFoundError, which SGLang's optional probes catch as the ImportError it is.

SGLang's AMX matmuls stay off: `cpu_has_amx_support()` asks for `torch.ops.sgl_kernel.convert_weight_packed`, which
is not defined here. Any other name asked of this module fails with an AttributeError naming it (`__getattr__`):
an AttributeError, not NotImplementedError, so that `from sgl_kernel import X` raises the ImportError and
`hasattr` the False that SGLang's optional probes expect.
"""

from __future__ import annotations

import ctypes

import torch

STAND_IN = True  # ../launch.py checks that `import sgl_kernel` found this package

# sglang/kernels/ops/speculative/spec_tree.py, TreeMaskMode
FULL_MASK, QLEN_ONLY = 0, 1


# -------------------------------------------------------------------------------------- attention: torch.ops.sgl_kernel


def _is_fp8(buffer: torch.Tensor) -> bool:
    return buffer.dtype.is_floating_point and buffer.dtype.itemsize == 1


def _load(buffer: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache rows at `slots` in float32; an FP8 cache holds value / scale (the backend's `set_kv_buffer`)."""
    rows = buffer[slots].float()
    return rows * scale if _is_fp8(buffer) else rows


def _store(buffer: torch.Tensor, loc: torch.Tensor, new: torch.Tensor, scale: float) -> None:
    new = new.float() / scale if _is_fp8(buffer) else new
    buffer[loc.long()] = new.to(buffer.dtype)


def _refuse_encoder_decoder(op: str, is_cross_attn: bool, encoder_lens: torch.Tensor | None) -> None:
    if is_cross_attn or encoder_lens is not None:
        raise NotImplementedError(
            f"sgl_kernel.{op}: is_cross_attn / encoder_lens (encoder-decoder attention) are not supported by the "
            "project's CPU stand-in for sgl_kernel (orchestrator/engines/sglang/cpu_kernels)"
        )


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    logit_cap: float,
    visible: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention of q [T, H, D] over k [S, Hkv, D], v [S, Hkv, Dv], all float32 -> [T, H, Dv].

    Query head h reads kv head h // (H // Hkv). The logit cap is that of SGLang's Triton attention kernels
    (sglang/kernels/ops/attention/decode_attention.py, extend_attention.py): `cap * tanh(qk * scale / cap)`; a sink
    adds exp(sink[h]) to head h's softmax denominator and nothing to its output."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"sgl_kernel attention: {heads} query heads are not a multiple of {kv_heads} kv heads")
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_column = sinks.float().view(heads, 1, 1).expand(heads, q.shape[0], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : k.shape[0]]
    return torch.einsum("hts,shd->thd", probs, v)


def decode_attention(
    query: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k_scale: float,
    v_scale: float,
    output: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    loc: torch.Tensor | None,
    attn_logits: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool,
    sliding_window_size: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> None:
    """One new token per sequence. With key/value, first writes them into k_buffer/v_buffer at `loc` (one slot per
    sequence); then sequence i's query [H, D] attends over the cache slots req_to_token[req_pool_indices[i],
    :seq_lens[i]], only the last `sliding_window_size` of them when that is > 0 (the backend passes the layer's
    window + 1, so 0 is none). Writes output [bs, H, Dv]. attn_logits is the real kernel's split-KV scratch
    ([bs, H, splits, Dv + 1]), which nothing reads after the call; it is left untouched."""
    _refuse_encoder_decoder("decode_attention_cpu", is_cross_attn, encoder_lens)
    if key is not None:
        if value is None or loc is None:
            raise ValueError("sgl_kernel.decode_attention_cpu: key needs value and loc")
        _store(k_buffer, loc, key, k_scale)
        _store(v_buffer, loc, value, v_scale)
    for i, (req, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        first = max(seq_len - sliding_window_size, 0) if sliding_window_size > 0 else 0
        slots = req_to_token[req, first:seq_len].long()
        if slots.numel() == 0:  # no keys to attend
            output[i].zero_()
            continue
        keys, values = _load(k_buffer, slots, k_scale), _load(v_buffer, slots, v_scale)
        attended = _attend(query[i : i + 1].float(), keys, values, sm_scale, logit_cap, None, sinks)
        output[i] = attended[0].to(output.dtype)


def _tree_mask_rows(tree_mask: torch.Tensor, lengths: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Per sequence, the verify tree mask as [extend_len, seq_len] bool (True: may attend).

    Two layouts (build_tree_kernel_efficient in sglang/srt/speculative/eagle_utils.py): QLEN_ONLY, which SGLang
    builds on a CPU (`default_tree_mask_mode`): per sequence an extend x extend block over the draft tokens, the
    prefix visible to all; FULL_MASK (the GPU layout, and SGLang's all-True mask for a one-token verify):
    per sequence an extend x seq_len block whose columns cover prefix + extend, possibly padded at the end.
    The sizes tell them apart: they coincide only when every prefix is empty, where the layouts do too."""
    flat = tree_mask.reshape(-1) != 0
    qlen_size = sum(extend * extend for extend, _ in lengths)
    full_size = sum(extend * seq_len for extend, seq_len in lengths)
    if flat.numel() != qlen_size and flat.numel() < full_size:
        raise ValueError(
            f"sgl_kernel.extend_attention_cpu: tree_mask has {flat.numel()} entries; expected {qlen_size} "
            f"(QLEN_ONLY) or at least {full_size} (FULL_MASK) for extend/seq lengths {lengths}"
        )
    rows, offset = [], 0
    for extend, seq_len in lengths:
        if flat.numel() == qlen_size:
            block = flat[offset : offset + extend * extend].view(extend, extend)
            prefix = torch.ones(extend, seq_len - extend, dtype=torch.bool)
            rows.append(torch.cat([prefix, block], dim=1))
            offset += extend * extend
        else:
            rows.append(flat[offset : offset + extend * seq_len].view(extend, seq_len))
            offset += extend * seq_len
    return rows


def _extend_visibility(
    prefix: int, extend: int, is_causal: bool, window: int, tree_rows: torch.Tensor | None
) -> torch.Tensor:
    """[extend, prefix + extend] bool: which keys each new token sees. The tree mask, else causal, else all; a
    window keeps keys less than `window` positions back (and, non-causal, ahead), as SGLang's Triton extend
    kernel's `q <= k + sliding_window_size` does with the layer's window (the argument here is that + 1)."""
    q_pos = prefix + torch.arange(extend).view(-1, 1)
    k_pos = torch.arange(prefix + extend).view(1, -1)
    if tree_rows is not None:
        visible = tree_rows.clone()
    elif is_causal:
        visible = k_pos <= q_pos
    else:
        visible = torch.ones(extend, prefix + extend, dtype=torch.bool)
    if window > 0:
        visible &= q_pos - k_pos < window
        if tree_rows is None and not is_causal:
            visible &= k_pos - q_pos < window
    return visible


def extend_attention(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor | None,
    v_extend: torch.Tensor | None,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k_scale: float,
    v_scale: float,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_len_extend: int,
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool,
    sliding_window_size: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    is_causal: bool,
) -> None:
    """Sequence i's extend_seq_lens[i] new tokens, rows extend_start_loc[i]... of q_extend [N, H, D], attend over
    its seq_lens[i] = prefix + extend keys: the prefix from the cache slots req_to_token[req_pool_indices[i],
    :prefix], the new tokens from k_extend/v_extend (the backend has already written them into the cache; with
    k_extend None, as for Gemma4's KV-shared layers, they are read from the cache too). Masked causally, or by
    `tree_mask` (a speculative verify, see _tree_mask_rows), or not at all when not is_causal; `sliding_window_size`
    as in decode_attention. Writes o_extend [N, H, Dv]; max_len_extend only sizes the real kernel's blocks."""
    _refuse_encoder_decoder("extend_attention_cpu", is_cross_attn, encoder_lens)
    sequences = list(
        zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist(), extend_start_loc.tolist())
    )
    tree_rows = None
    if tree_mask is not None:
        tree_rows = _tree_mask_rows(tree_mask, [(extend, seq_len) for _, seq_len, extend, _ in sequences])
    for i, (req, seq_len, extend, start) in enumerate(sequences):
        prefix = seq_len - extend
        slots = req_to_token[req, :seq_len].long()
        if k_extend is None:
            keys, values = _load(k_buffer, slots, k_scale), _load(v_buffer, slots, v_scale)
        else:
            if prefix and k_extend.shape[1] != k_buffer.shape[1]:
                raise NotImplementedError(
                    f"sgl_kernel.extend_attention_cpu: a prefix read from a cache of {k_buffer.shape[1]} heads for "
                    f"new keys of {k_extend.shape[1]} (MLA) is not supported by the project's CPU stand-in"
                )
            new = slice(start, start + extend)
            keys = torch.cat([_load(k_buffer, slots[:prefix], k_scale), k_extend[new].float()])
            values = torch.cat([_load(v_buffer, slots[:prefix], v_scale), v_extend[new].float()])
        visible = _extend_visibility(
            prefix, extend, is_causal, sliding_window_size, None if tree_rows is None else tree_rows[i]
        )
        queries = q_extend[start : start + extend].float()
        attended = _attend(queries, keys, values, sm_scale, logit_cap, visible, sinks)
        o_extend[start : start + extend] = attended.to(o_extend.dtype)


# The schemas follow the positional arguments intel_amx_backend.py passes; (a!) marks what an op writes.
_LIBRARY = torch.library.Library("sgl_kernel", "DEF")
_LIBRARY.define(
    "decode_attention_cpu(Tensor query, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float k_scale, float v_scale, "
    "Tensor(c!) output, Tensor? key, Tensor? value, Tensor? loc, Tensor attn_logits, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, "
    "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
)
_LIBRARY.define(
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
    "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, Tensor req_pool_indices, "
    "Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, float sm_scale, "
    "float logit_cap, bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, "
    "Tensor? tree_mask, bool is_causal) -> ()"
)
# CPU only: SGLang registers its own fake kernels for torch.compile (cpu_graph_runner.py, `register_fake_ops`).
_LIBRARY.impl("decode_attention_cpu", decode_attention, "CPU")
_LIBRARY.impl("extend_attention_cpu", extend_attention, "CPU")


# ----------------------------------------------------------------------- EAGLE bookkeeping: from sgl_kernel import NAME


def _check_row_stride(op: str, req_to_token: torch.Tensor, pool_len: int) -> None:
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"sgl_kernel.{op}: pool_len {pool_len} != req_to_token's row length {req_to_token.shape[1]}")


def _packed_ranges(start_offset: torch.Tensor, end_offset: torch.Tensor):
    """(row, start, end, packed offset) per request: request i's range packs after those of the requests before."""
    packed = 0
    for row, (start, end) in enumerate(zip(start_offset.tolist(), end_offset.tolist())):
        yield row, start, end, packed
        packed += end - start


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = request i's run of the packed
    out_cache_loc (sglang/srt/mem_cache/allocation.py, Triton `assign_req_to_token_pool`)."""
    _check_row_stride("assign_req_to_token_pool_cpu", req_to_token, pool_len)
    requests = req_pool_indices.tolist()
    for row, start, end, packed in _packed_ranges(start_offset, end_offset):
        req_to_token[requests[row], start:end] = out_cache_loc[packed : packed + end - start].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """The reverse of assign_req_to_token_pool_cpu: packs req_to_token[req_pool_indices[i],
    start_offset[i]:end_offset[i]] into out_cache_loc, request after request (sglang/kernels/ops/speculative/
    cache_locs.py, Triton `assign_extend_cache_locs`); entries past the packed total are left as they are."""
    _check_row_stride("assign_extend_cache_locs_cpu", req_to_token, pool_len)
    requests = req_pool_indices.tolist()
    for row, start, end, packed in _packed_ranges(start_offset, end_offset):
        out_cache_loc[packed : packed + end - start] = req_to_token[requests[row], start:end].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """out_cache_loc[i * topk * num_cols:][: topk * num_cols] = req_to_token[req_pool_indices[i], seq_lens[i]:][:
    topk * num_cols]: the draft's write slots, read [bs, topk, num_steps] by the draft loop (sglang/kernels/ops/
    speculative/cache_locs.py, Triton `assign_draft_cache_locs_contiguous`; the CPU path writes no positions)."""
    _check_row_stride("assign_draft_cache_locs_contiguous_cpu", req_to_token, pool_len)
    width = topk * num_cols
    for row, (req, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        window = req_to_token[req, seq_len : seq_len + width]
        out_cache_loc[row * width : (row + 1) * width] = window.to(out_cache_loc.dtype)


def build_draft_decode_metadata_cpu(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    pool_len: int,
) -> torch.Tensor:
    """Returns a new req_to_token table of bs * topk rows of pool_len, one per draft branch: row i * topk + t is
    request i's prefix req_to_token[req, :seq_len] followed by branch t's chain, the slots req_to_token[req,
    seq_len + t * num_steps:][:num_steps] that assign_draft_cache_locs_contiguous_cpu handed it. The multi-step
    draft backend (intel_amx_backend.py) reads it with req_pool_indices arange(bs * topk) and seq_len + step + 1;
    the layout is that of `generate_draft_decode_kv_indices` at page size 1 (sglang/kernels/ops/speculative/
    cache_locs.py). Entries past seq_len + num_steps are zero."""
    _check_row_stride("build_draft_decode_metadata_cpu", req_to_token, pool_len)
    table = torch.zeros(len(seq_lens) * topk, pool_len, dtype=req_to_token.dtype, device=req_to_token.device)
    for i, (req, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        for branch in range(topk):
            chain = seq_len + branch * num_steps
            table[i * topk + branch, :seq_len] = req_to_token[req, :seq_len]
            table[i * topk + branch, seq_len : seq_len + num_steps] = req_to_token[req, chain : chain + num_steps]
    return table


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """bonus_tokens[i] = request i's last accepted token, accept_tokens.flatten()[i * accept_stride + accept_lens[i]
    - 1]; accept_lens counts the bonus (sglang/kernels/ops/speculative/eagle.py, Triton `fill_bonus_tokens`)."""
    last = torch.arange(len(accept_lens)) * accept_stride + accept_lens.long() - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[last].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """Packs out_cache_loc[j] for every accepted index j of the flattened accept_index, in order, skipping the -1
    padding, at the front of accept_out_cache_loc; the rest is left as it is (sglang/kernels/ops/speculative/
    eagle.py, Triton `fill_accept_out_cache_loc`)."""
    accepted = accept_index.reshape(-1)
    accepted = accepted[accepted != -1].long()
    accept_out_cache_loc[: accepted.numel()] = out_cache_loc[accepted].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer (data_ptrs[b], a raw address; strides[b], the bytes of one slot), copies slot src_loc[i] to
    slot tgt_loc[i]: all sources are read before any target is written, so overlapping moves are safe
    (sglang/kernels/ops/kvcache/cache_move.py, Triton `copy_all_layer_kv_cache_tiled`; the CPU call passes only
    the first num_locs locations)."""
    if tgt_loc.numel() == 0:
        return
    targets, sources = tgt_loc.long(), src_loc.long()
    slots = int(max(targets.max(), sources.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (slots * stride)).from_address(address)
        buffer = torch.frombuffer(raw, dtype=torch.uint8).view(slots, stride)
        buffer[targets] = buffer[sources]


def _tree_parent(chosen: list[int], parents: list[int], position: int, topk: int) -> int | None:
    """The tree position (0 = the root, p + 1 = draft token chosen[p]) of draft token `position`'s parent, found
    as SGLang's tree builder does: chosen[position] // topk indexes the parent list, whose entry is the parent's own
    chosen id; None when it is not among the chosen."""
    slot = chosen[position] // topk
    if slot == 0:
        return 0
    parent_id = parents[slot]
    return chosen.index(parent_id) + 1 if parent_id in chosen else None


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Builds the verify tree of each request's draft_token_num tokens (the bonus at position 0, then the
    selected_index [bs, n - 1] draft tokens) in place, following the Triton `sgl_build_tree_kernel_efficient_triton`
    in sglang/kernels/ops/speculative/spec_tree.py:

    - retrieve_index[i, x] = i * n + x; retrieve_next_token[i, p] = p's first child (lowest position),
      retrieve_next_sibling[i, x] = x's next sibling (the next higher position); -1 where none, from the caller's
      fill;
    - positions[i * n + x] = verified_seq_len[i] + x's depth (the root's is 0);
    - tree_mask: row x marks x and its ancestors among the draft tokens; QLEN_ONLY is [bs, n, n]; FULL_MASK is per
      request [n, seq_len + n] with the draft block at column seq_len, the prefix columns left to the caller (True).
    """
    mode = int(tree_mask_mode)
    if mode not in (FULL_MASK, QLEN_ONLY):
        raise NotImplementedError(
            f"sgl_kernel.build_tree_kernel_efficient_cpu: tree_mask_mode {mode} (bit-packed) is not supported by the "
            "project's CPU stand-in for sgl_kernel; FULL_MASK (0) and QLEN_ONLY (1) are"
        )
    n = draft_token_num
    next_token, next_sibling = retrieve_next_token.tolist(), retrieve_next_sibling.tolist()
    mask_start = 0
    for i, (chosen, parents, seq_len) in enumerate(
        zip(selected_index.tolist(), parent_list.tolist(), verified_seq_len.tolist())
    ):
        retrieve_index[i] = torch.arange(i * n, (i + 1) * n, dtype=retrieve_index.dtype)
        for x in range(n - 1, 0, -1):
            parent = _tree_parent(chosen, parents, x - 1, topk)
            if parent is not None:
                if next_token[i][parent] != -1:
                    next_sibling[i][x] = next_token[i][parent]
                next_token[i][parent] = x

        block = torch.zeros(n, n, dtype=torch.bool)
        block[:, 0] = True
        for x in range(1, n):
            node, level = x, 0
            while node != 0 and level < depth:
                block[x, node] = True
                level += 1
                node = _tree_parent(chosen, parents, node - 1, topk)
                node = 0 if node is None else node
            positions[i * n + x] = seq_len + level
        positions[i * n] = seq_len

        if mode == QLEN_ONLY:
            tree_mask[i * n * n : (i + 1) * n * n] = block.reshape(-1)
        else:
            rows = tree_mask[mask_start : mask_start + n * (seq_len + n)].view(n, seq_len + n)
            rows[:, seq_len:] = block
            mask_start += n * (seq_len + n)
    retrieve_next_token.copy_(torch.tensor(next_token, dtype=retrieve_next_token.dtype))
    retrieve_next_sibling.copy_(torch.tensor(next_sibling, dtype=retrieve_next_sibling.dtype))


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy walk of each request's tree (sglang/kernels/ops/speculative/spec_tree.py, Triton
    `verify_tree_greedy_kernel_triton`; keyword names `retrive_*` as SGLang passes them). From the root, at each of
    up to accept_index.shape[1] - 1 levels, accept the first child (by next_token, then next_sibling) whose candidate
    equals the target's prediction at the last accepted node, setting predicts[that node] = the prediction. Writes
    accept_index[i, :1 + accepted] (the flat retrieve indices, root first; the rest left as it is),
    accept_token_num[i] = accepted, and predicts[last accepted node] = the target's next token there."""
    target = target_predict.reshape(-1).tolist()
    retrieve = retrive_index.tolist()
    next_token, next_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    for i, tokens in enumerate(candidates.tolist()):
        last = retrieve[i][0]
        path = [last]
        node = 0
        for _ in range(1, accept_index.shape[1]):
            child = next_token[i][node]
            while child != -1 and tokens[child] != target[last]:
                child = next_sibling[i][child]
            if child == -1:
                break
            predicts[last] = target[last]
            last, node = retrieve[i][child], child
            path.append(last)
        accept_index[i, : len(path)] = torch.tensor(path, dtype=accept_index.dtype)
        accept_token_num[i] = len(path) - 1
        predicts[last] = target[last]


def __getattr__(name: str):
    raise AttributeError(
        f"sgl_kernel.{name}: not provided by the project's CPU stand-in for sgl_kernel "
        "(orchestrator/engines/sglang/cpu_kernels/sgl_kernel), which has only the ops SGLang 0.5.23's intel_amx "
        "attention backend and EAGLE worker call"
    )


__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]

"""The EAGLE-3 draft in plain PyTorch, with SGLang's `LlamaForCausalLMEagle3` parameter names and shapes.

    h0      = fc(cat(aux states))                              [T, K*Ht] -> [T, H]
    x       = cat(input_layernorm(embed(next token)), hidden_norm(h))     [T, 2H]
    a       = o_proj(attention(q/k/v_proj(x)))      residual r = h + a
    out     = r + mlp(post_attention_layernorm(r))  (pre-norm state: fed to the next draft step as h)
    logits  = lm_head(norm(out))                    over the draft vocabulary; target id = id + d2t[id]

Two ways to run it, mathematically the same:
  * `unroll` (training-time test, and standalone eval): every position of a sequence drafts a chain of
    `steps` tokens at once. Step k at position t attends to step 0's keys at positions <= t and to its own
    chain's keys (steps 1..k at t); its position id is t + k.
  * `extend` / `chain` with a `DraftCache` (the reference engine): what a serving engine does token by token.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from orchestrator.draft import rope as rope_lib


@dataclass
class DraftShape:
    hidden_size: int
    target_hidden_size: int
    num_aux_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    rope_scaling: dict[str, Any] | None = None  # the HF `rope_scaling` dict; None: plain rope

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def rope(self) -> rope_lib.RopeSpec:
        return rope_lib.read({"rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling}, "draft shape")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x.to(dtype)
        # Under autocast (float32 weights, bf16 compute) the product is float32, and every linear it feeds would
        # cast it and keep its own bf16 copy: hand them one (4 GiB less at Kimi's shape, seq 8192). The linears
        # compute with the same values; the gradients they send back meet in bf16 rather than float32, as in a
        # draft with bf16 weights (SpecForge's).
        if torch.is_autocast_enabled(x.device.type):
            return out.to(torch.get_autocast_dtype(x.device.type))
        return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rope(nn.Module):
    """Llama (neox-style) rotary embedding as SGLang builds it from the draft config (`draft/rope.py`: default,
    linear, llama3, yarn), for position ids of any shape."""

    def __init__(self, head_dim: int, spec: rope_lib.RopeSpec):
        super().__init__()
        inv_freq, self.scale = rope_lib.rotary(spec, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., D] of position ids [...], YaRN's attention factor included."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.scale == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.scale, emb.sin() * self.scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [B, heads, T, D]; positions [B, T]
        cos, sin = self.cos_sin(positions[:, None, :])
        return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.q_proj = nn.Linear(2 * s.hidden_size, self.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden_size, self.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden_size, self.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * s.head_dim, s.hidden_size, bias=False)
        self.rope = Rope(s.head_dim, s.rope)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, positions), self.rope(k, positions)
        rep = self.heads // self.kv_heads
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def out(self, ctx: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = ctx.shape
        return self.o_proj(ctx.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def attn_input(self, embeds: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1)

    def finish(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        r = h + attn_out
        return r + self.mlp(self.post_attention_layernorm(r))


@dataclass
class DraftCache:
    """Keys/values of committed positions (step-0 entries), [1, heads, T, D] each."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


@dataclass
class Unrolled:
    logits: list[torch.Tensor]  # per step [B, L, Vd]; empty when `unroll` handed them to `on_step`
    tokens: list[torch.Tensor]  # per step [B, L] target ids of the draft's argmax


class Eagle3Draft(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.shape = s
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(s.num_aux_layers * s.target_hidden_size, s.hidden_size, bias=False)
        self.midlayer = MidLayer(s)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(s.vocab_size, dtype=torch.bool))

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    # ------------------------------------------------------------------ training-time test / standalone eval
    def unroll(
        self,
        aux: torch.Tensor,
        next_ids: torch.Tensor,
        valid: torch.Tensor,
        steps: int,
        token_source: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        on_step: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> Unrolled:
        """Drafts `steps` tokens from every position at once.

        aux [B, L, K*Ht] target states at t; next_ids [B, L] token t+1 (its embedding joins step 0); valid [B, L].
        `token_source(k, draft_tokens)` gives the token ids whose embeddings step k+1 consumes, [B, L]
        (teacher forcing: the text's token t+k+2; serving: the draft's own `draft_tokens`). None: own tokens.
        `on_step(k, logits, tokens)`, when given, receives each step's logits as they are made, and they are not
        kept (`Unrolled.logits` stays empty): training takes its loss there, so that no step's [B, L, Vd] logits
        outlive it.
        """
        b, length, _ = aux.shape
        positions = torch.arange(length, device=aux.device).expand(b, length)
        attn = self.midlayer.self_attn

        h = self.fc(aux.to(self.fc.weight.dtype))
        ids = next_ids
        keys = vals = None
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        out_logits, out_tokens = [], []
        for k in range(steps):
            x = self.midlayer.attn_input(self.embed_tokens(ids), h)
            q, key, val = attn.qkv(x, positions + k)
            if k == 0:
                keys, vals = _ttt_keys(key, val, valid, steps - 1)
            else:
                chain_k.append(key)
                chain_v.append(val)
            ctx = _ttt_attention(q, keys, vals, chain_k, chain_v, steps - 1)
            h = self.midlayer.finish(h, attn.out(ctx))
            logits = self.logits(h)
            tokens = self.to_target_ids(logits.argmax(-1))
            if on_step is None:
                out_logits.append(logits)
            else:
                on_step(k, logits, tokens)
            out_tokens.append(tokens)
            if k + 1 < steps:
                ids = tokens if token_source is None else token_source(k, tokens)
        return Unrolled(out_logits, out_tokens)

    # ------------------------------------------------------------------------- incremental (serving) path
    def _cached_step(
        self, h: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, cache: DraftCache, commit: bool
    ):
        attn = self.midlayer.self_attn
        x = self.midlayer.attn_input(self.embed_tokens(ids), h)
        q, k, v = attn.qkv(x, positions)
        keys = k if cache.k is None else torch.cat([cache.k, k], dim=2)
        vals = v if cache.v is None else torch.cat([cache.v, v], dim=2)
        t_new, t_all = q.shape[2], keys.shape[2]
        mask = torch.ones(t_new, t_all, dtype=torch.bool, device=h.device).tril(t_all - t_new)
        ctx = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        out = self.midlayer.finish(h, attn.out(ctx))
        if commit:
            cache.k, cache.v = keys, vals
        return out, keys, vals

    @torch.no_grad()
    def extend(self, aux: torch.Tensor, next_ids: torch.Tensor, start: int, cache: DraftCache) -> torch.Tensor:
        """Commits positions start..start+T-1 (target states `aux` [1, T, K*Ht], tokens t+1 `next_ids` [1, T]).

        Returns the pre-norm output at the last position, the chain's starting state."""
        if cache.length != start:
            raise RuntimeError(f"draft cache holds {cache.length} positions, extend starts at {start}")
        positions = torch.arange(start, start + aux.shape[1], device=aux.device)[None]
        out, _, _ = self._cached_step(self.fc(aux.to(self.fc.weight.dtype)), next_ids, positions, cache, commit=True)
        return out[:, -1:]

    @torch.no_grad()
    def chain(self, out: torch.Tensor, last_position: int, cache: DraftCache, steps: int) -> list[int]:
        """Greedy chain of `steps` draft tokens (target ids) from the state `extend` returned."""
        committed = cache.length
        tokens: list[int] = []
        h = out
        token = self.to_target_ids(self.logits(h).argmax(-1))
        tokens.append(int(token))
        for k in range(1, steps):
            positions = torch.tensor([[last_position + k]], device=h.device)
            h, keys, vals = self._cached_step(h, token.view(1, 1), positions, cache, commit=True)
            token = self.to_target_ids(self.logits(h).argmax(-1))
            tokens.append(int(token))
        cache.crop(committed)
        return tokens


# TTT attention without an [L, L] score tensor. Step k at t attends to step 0's keys at valid positions <= t and to
# its own chain's keys (steps 1..k at t): one softmax over both. The chain's keys differ per query, so each becomes a
# "slot" key shared by all queries whose score is carried by the query: an extra coordinate of the query holds
# q . k_j (its own chain key j), the slot key holds 1 there, and the slot's value is one-hot in a column of its own,
# so that column of the output is the softmax weight of chain key j, which then scales that query's own value j.
# A further coordinate (query 1, key 0 or a huge negative) drops padded keys. Slots sit before step 0's keys, in
# reverse order, so that with k slots in use the keys start at the first of them and one causal SDPA, its queries
# preceded by k rows that are thrown away, gives each query every slot and step 0's keys up to its own position.
# The extra columns are zero in step 0's keys and values, so scores and outputs there are unchanged.
def _ttt_width(head_dim: int, slots: int) -> int:
    return -(-(head_dim + 1 + slots) // 8) * 8  # a multiple of 8, as fused attention kernels want


def _ttt_keys(
    key: torch.Tensor, val: torch.Tensor, valid: torch.Tensor, slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0's keys and values [B, h, L, D] widened, after `slots` slot rows: [B, h, slots + L, width]."""
    b, heads, length, dim = key.shape
    width = _ttt_width(dim, slots)
    slot_rows = key.new_zeros(b, heads, slots, width)
    for j in range(slots):  # chain key j (step j + 1) at row slots - 1 - j, one-hot in column dim + 1 + j
        slot_rows[:, :, slots - 1 - j, dim + 1 + j] = 1
    drop = torch.finfo(key.dtype).min / 4  # times the query's 1: exp of it is exactly 0
    padded = torch.where(valid, 0.0, drop).to(key.dtype)[:, None, :, None].expand(b, heads, length, 1)
    tail = key.new_zeros(b, heads, length, width - dim - 1)
    keys = torch.cat([slot_rows, torch.cat([key, padded, tail], dim=-1)], dim=2)
    vals = torch.cat([slot_rows, F.pad(val, (0, width - dim))], dim=2)
    return keys, vals


def _ttt_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    chain_k: list[torch.Tensor],
    chain_v: list[torch.Tensor],
    slots: int,
) -> torch.Tensor:
    """Attention output [B, h, L, D] of one TTT step's queries q [B, h, L, D] over step 0's keys (causal, valid ones)
    and the chain keys so far (chain_k[j]: step j + 1's key at the query's own position)."""
    b, heads, length, dim = q.shape
    used = len(chain_k)
    width = keys.shape[-1]
    parts = [q, q.new_ones(b, heads, length, 1)]
    parts += [(q * ck).sum(-1, keepdim=True) for ck in chain_k]
    parts.append(q.new_zeros(b, heads, length, width - dim - 1 - used))
    query = torch.cat(parts, dim=-1)
    if used:
        query = torch.cat([query.new_zeros(b, heads, used, width), query], dim=2)
    first = slots - used
    out = F.scaled_dot_product_attention(
        query, keys[:, :, first:], vals[:, :, first:], is_causal=True, scale=1.0 / math.sqrt(dim)
    )[:, :, used:]
    ctx = out[..., :dim]
    for j, cv in enumerate(chain_v):
        ctx = ctx + out[..., dim + 1 + j, None] * cv
    return ctx


def default_shape(
    target_hidden: int,
    vocab: int,
    num_aux: int,
    hidden: int | None,
    heads: int,
    kv_heads: int,
    head_dim: int | None,
    intermediate: int | None,
    draft_vocab: int | None,
    eps: float,
    rope_theta: float,
    max_positions: int,
    rope_scaling: dict[str, Any] | None = None,
) -> DraftShape:
    hidden = hidden or target_hidden
    return DraftShape(
        hidden_size=hidden,
        target_hidden_size=target_hidden,
        num_aux_layers=num_aux,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        intermediate_size=intermediate or int(hidden * 8 / 3 // 16 * 16),
        vocab_size=vocab,
        draft_vocab_size=draft_vocab or vocab,
        rms_norm_eps=eps,
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        rope_scaling=rope_scaling,
    )

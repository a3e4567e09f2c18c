"""Captured hidden states equal HF's `output_hidden_states` entries, for both tiny architectures."""

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from orchestrator.capture import HiddenStateCapture, base_model, teacher_logits

N_LAYERS = 5


def llama():
    torch.manual_seed(0)
    conf = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(conf).eval()


def deepseek():
    torch.manual_seed(0)
    conf = DeepseekV3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=64,
    )
    return DeepseekV3ForCausalLM(conf).eval()


@pytest.fixture(params=[llama, deepseek], ids=["llama", "deepseek_v3"])
def model(request):
    return request.param()


@torch.no_grad()
def test_aux_capture_equals_hidden_states(model):
    ids = torch.randint(0, 97, (2, 11))
    layers = [-1, 1, 3]
    with HiddenStateCapture(model, layers, "post_norm") as capture:
        out = model(input_ids=ids, output_hidden_states=True)
        aux, teacher = capture.aux(), capture.teacher()
    hs = out.hidden_states
    expected = torch.cat([hs[k + 1] for k in layers], dim=-1)  # hidden_states[k+1] = output of layer k
    torch.testing.assert_close(aux, expected)
    # post_norm teacher = HF's last hidden_states entry, and lm_head of it gives the model's logits
    torch.testing.assert_close(teacher, hs[-1])
    torch.testing.assert_close(teacher_logits(model, teacher, "post_norm"), out.logits)


@torch.no_grad()
def test_last_layer_raw_output_is_not_the_last_hidden_state(model):
    ids = torch.randint(0, 97, (1, 9))
    with HiddenStateCapture(model, [N_LAYERS - 1], "pre_norm") as capture:
        out = model(input_ids=ids, output_hidden_states=True)
        raw_last, teacher = capture.aux(), capture.teacher()
    torch.testing.assert_close(raw_last, teacher)  # pre-norm teacher = raw output of the last layer
    assert not torch.allclose(raw_last, out.hidden_states[-1]), "HF's last entry is after the final norm"
    torch.testing.assert_close(base_model(model).norm(raw_last), out.hidden_states[-1])
    torch.testing.assert_close(teacher_logits(model, teacher, "pre_norm"), out.logits)


def test_capture_removes_its_hooks(model):
    with HiddenStateCapture(model, [0, 2, 4]):
        pass
    assert all(not m._forward_hooks for m in model.modules())

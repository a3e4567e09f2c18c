"""HF transformers: captures the target's states in this project's environment, by forward hooks on the decoder
(orchestrator/capture.py) at the layer contract's capture points, spread over one task's devices
(`targets.load_target`). It serves nothing: the serving engines are vLLM, SGLang and the reference engine."""

from __future__ import annotations

import torch

from orchestrator import layers as layer_contract
from orchestrator.capture import HiddenStateCapture, base_model
from orchestrator.engines import CaptureJob, Capturing
from orchestrator.layers import LayerContractError
from orchestrator.states.assemble import Assembler
from orchestrator.states.shards import SequenceStates, pack
from orchestrator.targets import load_target


class HF(Capturing):
    name = "hf"

    def id_rule(self, family, version):
        raise LayerContractError("HF capture uses hook points, not ids: see layers.hf_capture_point")

    def check_capture(self, cfg):
        """Nothing beyond the layer contract, which config.validate checks for every engine."""

    def capture_key(self, cfg, extract):
        # the keys of extractions made before engines were chosen stay the same
        extract.pop("engine")
        extract.pop("vllm_args")
        return extract

    def capture_ids(self, cfg, layers):
        n = cfg.target.num_hidden_layers
        indices = []
        for k in layers:
            try:
                indices.append(layer_contract.hf_hidden_states_index(k, n))
            except LayerContractError:
                indices.append(None)  # the last layer's raw output is only reachable by a hook
        return {
            "convention": "hf",
            "capture_points": [layer_contract.hf_capture_point(k, n) for k in layers],
            "hidden_states_indices": indices,
            "teacher": {
                "kind": cfg.extract.teacher,
                "capture_point": layer_contract.hf_teacher_capture_point(cfg.extract.teacher, n),
            },
        }

    def open_capture(self, cfg, job: CaptureJob):
        model, tokenizer = load_target(
            job.target_path, cfg.target.trust_remote_code, job.compute, cfg.data.chat_template
        )
        return HFCapture(model, tokenizer, job.layers, cfg, job.compute)

    def open_stream(self, cfg, target_path, layers, compute, work, answers_eval=False):
        return HFStream(cfg, target_path, layers, compute)

    def eval_layers(self, captured):
        """Any: the service's model is hooked where eval asks."""
        return None

    def open_eval(self, cfg, target_path, layers, compute, work):
        return HFEval(cfg, target_path, layers, compute)


class HFEval:
    """The live target loaded on the eval job's devices: the served states by forward hooks at the layer contract's
    capture points, the greedy tokens from its logits, the continuations from its `generate`."""

    def __init__(self, cfg, target_path, layers, compute, loaded=None):
        self.layers, self.device = layers, compute.device
        remote, template = cfg.target.trust_remote_code, cfg.data.chat_template
        # `loaded`: the (model, tokenizer) a capture service holds already (`HFStream.evaluator`)
        self.model, self.tokenizer = loaded or load_target(target_path, remote, compute, template)

    @torch.no_grad()
    def served(self, sequences):
        with HiddenStateCapture(self.model, self.layers) as capture:
            for sequence in sequences:
                ids = torch.tensor([sequence], device=self.device)
                argmax = self.model(input_ids=ids, use_cache=False).logits.argmax(-1)[0].cpu()
                yield capture.aux()[0], argmax
                capture.clear()

    @torch.no_grad()
    def continuations(self, prompts, max_new):
        eos = self.tokenizer.eos_token_id
        with HiddenStateCapture(self.model, self.layers) as capture:
            for prompt in prompts:
                ids = torch.tensor([prompt], device=self.device)
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                    eos_token_id=eos, pad_token_id=eos,
                )  # fmt: skip
                sequence = out[0].tolist()
                capture.clear()
                self.model(input_ids=torch.tensor([sequence], device=self.device), use_cache=False)
                yield len(prompt), sequence, capture.aux()[0]
                capture.clear()

    def describe(self) -> str:
        import transformers

        return f"hf transformers {transformers.__version__}"

    def close(self) -> None:
        self.model = None


class HFStream:
    """The target loaded once, for a capture service: each batch's states by the extract stage's own forward."""

    def __init__(self, cfg, target_path, layers, compute):
        self.cfg, self.layers, self.compute = cfg, layers, compute
        remote, template = cfg.target.trust_remote_code, cfg.data.chat_template
        self.model, self.tokenizer = load_target(target_path, remote, compute, template)

    def states(self, rendered) -> list[SequenceStates]:
        return sequence_states(self.model, self.tokenizer, rendered, self.layers, self.cfg, self.compute)

    def evaluator(self, layers) -> HFEval:
        """The eval stage's live target at the served `layers` (`Capturing.open_eval`), on the model loaded here."""
        return HFEval(self.cfg, None, layers, self.compute, loaded=(self.model, self.tokenizer))

    def close(self) -> None:
        pass


class HFCapture:
    """The target loaded on the task's devices; each shard's states by one forward of the decoder per batch."""

    def __init__(self, model, tokenizer, layers, cfg, compute):
        self.model, self.tokenizer, self.layers, self.cfg, self.compute = model, tokenizer, layers, cfg, compute

    def start(self, split, index):
        pass

    def shard(self, split, index, rendered):
        return extract_chunk(self.model, self.tokenizer, rendered, self.layers, self.cfg, self.compute)

    def close(self):
        pass


def extract_chunk(model, tokenizer, chunk, layers: list[int], cfg, compute) -> dict:
    """A shard's tensors (orchestrator/states/shards.py)."""
    return pack(sequence_states(model, tokenizer, chunk, layers, cfg, compute))


def sequence_states(model, tokenizer, chunk, layers: list[int], cfg, compute) -> list[SequenceStates]:
    """The rendered sequences' states, `extract.batch_size` sequences per forward, right-padded: a shard's, or a
    capture service's batch (orchestrator/states/stream.py). The hooks capture the teacher where `extract.teacher`
    says (after the final norm for post_norm), so the assembler norms nothing."""
    assemble = Assembler(cfg.extract.dtype)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sequences = []
    decoder = base_model(model)
    with torch.no_grad(), HiddenStateCapture(model, layers, cfg.extract.teacher) as capture:
        for i in range(0, len(chunk), cfg.extract.batch_size):
            batch = chunk[i : i + cfg.extract.batch_size]
            width = max(len(r.input_ids) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attn = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):
                ids[row, : len(r.input_ids)] = torch.tensor(r.input_ids)
                attn[row, : len(r.input_ids)] = 1
            # The decoder stack alone: the head's logits, [batch, length, vocab] (163,840 wide at Kimi's
            # vocabulary), are not stored, so they are not computed; the teacher's are, from its state, in training.
            decoder(input_ids=ids.to(compute.device), attention_mask=attn.to(compute.device), use_cache=False)
            aux, teacher = capture.aux().cpu(), capture.teacher().cpu()
            sequences += [assemble.sequence(r, aux[row], teacher[row]) for row, r in enumerate(batch)]
            capture.clear()
    return sequences


ENGINE = HF()

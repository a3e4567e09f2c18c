"""What a plan writes and streams, on paper: the extraction's storage (`extract_storage`, which the dry run prints
and the config check holds to extract.max_bytes) and train.states=stream's costs (`stream_cost`, its service
priced at the stream's measured share of its engine's rate), from the config and, where every turn is answered,
the data files' own count of turns."""

from __future__ import annotations

import math
from typing import Any

from orchestrator.config import RootConfig, captured_layers
from orchestrator.config.validate import stream_capture_ratio
from orchestrator.data import answered_turns

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def extract_storage(cfg: RootConfig) -> dict[str, Any]:
    """What the extract stage will write, at most: every conversation at `data.max_seq_len` tokens, each token
    with K captured states and the teacher state of `target.hidden_size` in `extract.dtype`, plus its id and mask."""
    states = len(captured_layers(cfg)) + 1
    per_token = states * cfg.target.hidden_size * DTYPE_BYTES[cfg.extract.dtype] + 5  # int32 id + uint8 loss mask
    conversations = cfg.data.max_train_conversations + cfg.data.max_val_conversations
    per_conversation = sequences_per_conversation(cfg)
    sequences = round(conversations * per_conversation)
    tokens = sequences * cfg.data.max_seq_len
    # train.states=stream: the train split's shards hold its token ids alone (5 bytes a token)
    stored = round(cfg.data.max_val_conversations * per_conversation) if cfg.train.states == "stream" else sequences
    ids_only = (sequences - stored) * cfg.data.max_seq_len * 5
    return {
        "conversations": conversations,
        "sequences_per_conversation": per_conversation,
        "sequences": sequences,
        "max_tokens": tokens,
        "states_per_token": states,
        "bytes_per_token": per_token,
        "stored_tokens": stored * cfg.data.max_seq_len,
        "ids_only_bytes": ids_only,
        "max_bytes": stored * cfg.data.max_seq_len * per_token + ids_only,
        "limit_bytes": cfg.extract.max_bytes,
    }


def storage_terms(st: dict[str, Any]) -> str:
    """`extract_storage`'s bytes as the product they are: the tokens whose states are stored x bytes a token, plus
    the streamed split's token ids where there are some."""
    terms = f"{st['stored_tokens']:,} tokens x {st['bytes_per_token']:,} bytes/token"
    if st["ids_only_bytes"]:
        terms += f" + {(st['max_tokens'] - st['stored_tokens']):,} streamed tokens' ids x 5 bytes"
    return terms


def sequences_per_conversation(cfg: RootConfig) -> float:
    """The training sequences a conversation gives: one, or with regeneration one per answered turn: at most
    data.regenerate.turns, or, with every turn answered (turns=null), the mean number of assistant turns a
    conversation of data=jsonl's train files has (counted once per files' content; 1 for other data sets)."""
    r = cfg.data.regenerate
    if not r.enabled:
        return 1.0
    if r.turns is not None:
        return float(r.turns)
    return answered_turns(cfg.data) if cfg.data.name == "jsonl" else 1.0


def stream_bytes_per_token(cfg: RootConfig) -> int:
    """A token's states on the stream: the captured aux layers and the teacher, `target.hidden_size` values each,
    in `extract.dtype`."""
    return (len(captured_layers(cfg)) + 1) * cfg.target.hidden_size * DTYPE_BYTES[cfg.extract.dtype]


def stream_buffer(cfg: RootConfig) -> tuple[int, int, int]:
    """The capture service's sequences a request, and how far it may run ahead of its trainers, in sequences and
    in bytes: `train.stream.request_sequences` (null: one step's batch, `train.batch_size`),
    `train.stream.buffer_sequences` (null: two requests) and `train.stream.buffer_bytes` (null: that many
    sequences at `data.max_seq_len` tokens, `stream_bytes_per_token` each)."""
    st = cfg.train.stream
    request = st.request_sequences or cfg.train.batch_size
    sequences = st.buffer_sequences or 2 * request
    return request, sequences, st.buffer_bytes or sequences * cfg.data.max_seq_len * stream_bytes_per_token(cfg)


def stream_cost(cfg: RootConfig) -> dict[str, Any] | None:
    """train.states=stream on paper (the dry run prints it): the bytes a token's states take on the stream, an epoch
    at most (`data.max_train_conversations` x `data.max_seq_len` tokens), what each choice of epochs costs (capture
    passes against bytes kept, `train.stream.replay_bytes`), and, where the rates are estimated
    (`train.stream.train_samples_per_s`, `train.stream.capture_samples_per_s`), the link each side needs."""
    t, st = cfg.train, cfg.train.stream
    if t.states != "stream":
        return None
    per_token = stream_bytes_per_token(cfg)
    samples = round(cfg.data.max_train_conversations * sequences_per_conversation(cfg))
    epoch_bytes = samples * cfg.data.max_seq_len * per_token
    epochs = t.max_steps * t.batch_size / samples if t.max_steps else float(t.epochs)
    kept = min(st.replay_bytes, epoch_bytes)
    later = max(epochs - 1, 0.0)
    out = {
        "bytes_per_token": per_token,
        "epoch_tokens": samples * cfg.data.max_seq_len,
        "epoch_bytes": epoch_bytes,
        "epochs": epochs,
        "recapture": {"capture_passes": epochs, "bytes_kept": 0},
        "replay": {"capture_passes": min(epochs, 1.0) + later * (1 - kept / epoch_bytes), "bytes_kept": kept},
        "buffer_bytes": stream_buffer(cfg)[2],
        "buffer_sequences": stream_buffer(cfg)[1],
        # where the service runs: a Slurm job of its own with the extraction's resources, or beside rank 0
        "service_job": cfg.cluster.kind == "slurm" and st.join is None,
        "service_resources": {k: getattr(cfg.extract.resources, k) for k in ("nodes", "gpus_per_node")},
    }
    trainers = t.resources.nodes * max(t.resources.gpus_per_node, 1)
    sample_bytes = cfg.data.max_seq_len * per_token  # a sample at most
    if st.train_samples_per_s is not None:
        out["trainers_bytes_per_s"] = st.train_samples_per_s * trainers * sample_bytes
    if st.capture_samples_per_s is not None:
        ratio, source = stream_capture_ratio(cfg)
        out["capture_ratio"], out["capture_ratio_source"] = ratio, source
        out["capture_bytes_per_s"] = st.capture_samples_per_s * ratio * sample_bytes
    out["links"] = stream_links(cfg, out)
    return out


def stream_links(cfg: RootConfig, cost: dict[str, Any]) -> list[tuple[str, float]]:
    """Every link a streamed state crosses, with its bytes/s at the rate the stream runs (the slower of the priced
    sides): vLLM's files on the service node's own disk (written, then read), then the transport, the spool's file
    system (written by the service's node, read by the trainers') or the service node's network (Mooncake). Empty
    where neither side is priced."""
    rates = [cost[k] for k in ("trainers_bytes_per_s", "capture_bytes_per_s") if k in cost]
    if not rates:
        return []
    flow, st = min(rates), cfg.train.stream
    nodes = cfg.train.resources.nodes
    links = []
    if cfg.extract.engine == "vllm":
        links.append(("vLLM's files on the service node's own disk (written and read)", 2 * flow))
    if st.transport == "file":
        links.append(("the spool's file system: written by the service's node", flow))
        links.append((f"the spool's file system: read by each of {nodes} trainer node(s)", flow / nodes))
    else:
        links.append((f"the service node's network to the trainers' (Mooncake, {st.mooncake.protocol})", flow))
        links.append((f"into each of {nodes} trainer node(s)", flow / nodes))
    return links


def train_time(cfg: RootConfig, most: int | None) -> dict[str, Any] | None:
    """The training on paper where its rate is estimated (`train.stream.train_samples_per_s` a training GPU, and
    with train.states=stream the capture service's `capture_samples_per_s` a capture node at the stream's share of
    it): samples, steps, tokens at most (`data.max_seq_len` a sample) and hours, the slower side setting the pace;
    split into allocations of the partition's longest job (`most` minutes, None: one), each resuming where the last
    stopped; and the GPU-hours of the trainers and the service together. None where no rate is set."""
    t, st = cfg.train, cfg.train.stream
    if st.train_samples_per_s is None:
        return None
    per_epoch = math.ceil(round(cfg.data.max_train_conversations * sequences_per_conversation(cfg)) / t.batch_size)
    steps = t.max_steps or t.epochs * per_epoch
    trainers = t.resources.nodes * max(t.resources.gpus_per_node, 1)
    rate, paced_by = st.train_samples_per_s * trainers, "the trainers (train.stream.train_samples_per_s)"
    gpus = t.resources.nodes * t.resources.gpus_per_node
    if t.states == "stream" and st.join is None:
        gpus += cfg.extract.resources.nodes * cfg.extract.resources.gpus_per_node
        if st.capture_samples_per_s is not None:
            ratio, _ = stream_capture_ratio(cfg)
            served = st.capture_samples_per_s * ratio * cfg.extract.resources.nodes
            if served < rate:
                rate, paced_by = served, "the capture service (train.stream.capture_samples_per_s x the stream's share)"
    hours = steps * t.batch_size / rate / 3600
    count = 1 if most is None else max(1, math.ceil(hours * 60 / most))
    per = math.ceil(steps / count)
    spans = [(i * per, min(steps, (i + 1) * per)) for i in range(count)]
    return {
        "steps": steps,
        "samples": steps * t.batch_size,
        "tokens": steps * t.batch_size * cfg.data.max_seq_len,
        "samples_per_s": rate,
        "paced_by": paced_by,
        "hours": hours,
        "gpu_hours": hours * gpus,
        "allocations": [
            {
                "steps": span,
                "tokens": (span[1] - span[0]) * t.batch_size * cfg.data.max_seq_len,
                "hours": (span[1] - span[0]) * t.batch_size / rate / 3600,
            }
            for span in spans
        ],  # fmt: skip
        "max_time_min": most,
    }

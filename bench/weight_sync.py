"""Seconds and peak memory of one full-weight sync, trainer -> rollout, on CPU: the path before
bucketed streaming (bench/weight_sync_baseline.py) against today's gRPC one
(services/modeling/weights.py) and the same-host shared-memory one
(services/modeling/shared_weights.py).

The model: a random-init Qwen2 shaped like Qwen2.5-0.5B (hidden 896, 14 heads / 2 KV heads,
intermediate 4864, vocabulary 151,936, tied embeddings), 24 layers by default (494M
parameters); ``--layers`` takes fewer where memory is short. Two copies live in each process:
the trainer's model and the rollout's TransformersEngine, both float32.

Each sync goes through the wire format: every WeightChunk is serialized and parsed again, as
gRPC does, then applied to the engine.

  old: pack every trainable tensor (each copied whole to bytes, then sliced), buffer the whole
       update on the receiver, copy it into fresh tensors, apply them all at the end.
  new: only the tensors changed since the last acknowledged sync (ChangedTensors), chunks cut
       lazily one bucket at a time, each tensor applied as soon as its last piece arrives
       (WeightStream).

  shm: the same changed tensors, bucket by bucket copied from the parameters into a reused
       shared-memory ring (SegmentWriter), the rollout copying from zero-copy views of its own
       mapping of the segment (SegmentReader) into the engine; only descriptors would travel.
       Both mappings live in the one process here, so the segment's pages count twice in the
       resident set: the peak shown is an upper bound (across two processes they count once).

Syncs: 1 = the first (everything), 2 = after a step that changed every tensor, 3 = after a
step that changed the transformer layers only (frozen embeddings; the old path cannot tell and
sends everything). Each path runs in a fresh subprocess; peak = growth of the resident set's
high-water mark (VmHWM, reset through /proc/self/clear_refs before each sync) over the resident
size at that moment.

    .venv/bin/python bench/weight_sync.py [--layers 24] [--chunk-mib 16]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.modeling import shared_weights, weights
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.rollout.engines.engine import TransformersEngine

sys.path.insert(0, str(Path(__file__).parent))
import weight_sync_baseline as baseline  # noqa: E402 - bench/ is not a package

Tensors = dict[str, torch.Tensor]
Sync = Callable[[TransformersEngine, Tensors, int, int], int]  # returns the tensor bytes sent


def qwen05b_config(layers: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _wire(chunk: rollout_pb2.WeightChunk) -> rollout_pb2.WeightChunk:
    """What the rollout receives: the chunk serialized and parsed again, as gRPC does."""
    return rollout_pb2.WeightChunk.FromString(chunk.SerializeToString())


def old_sync(engine: TransformersEngine, state: Tensors, version: int, chunk: int) -> int:
    assembler, sent = baseline.WeightAssembler(), 0
    for message in baseline.pack_weights(
        state, policy_version=version, is_adapter=False, max_chunk_bytes=chunk
    ):
        sent += sum(len(t.data) for t in message.tensors)
        done = assembler.add(_wire(message))
        if done is not None:
            engine.apply_weights(done, version)
    return sent


class NewSender:
    """The trainer side as GrpcRolloutSession.sync_weights runs it (the ack is immediate)."""

    def __init__(self) -> None:
        self.tracker = weights.ChangedTensors()

    def __call__(self, engine: TransformersEngine, state: Tensors, version: int, chunk: int) -> int:
        changed, stamps = self.tracker.changed(state)
        stream, sent = weights.WeightStream(), 0
        for message in weights.pack_weights(
            changed, policy_version=version, is_adapter=False, max_chunk_bytes=chunk
        ):
            sent += sum(len(t.data) for t in message.tensors)
            done = stream.add(_wire(message))
            engine.apply_weights(done, version if message.last else engine.policy_version)
        self.tracker.acknowledge(stamps)
        return sent


class ShmSender:
    """The trainer side as StreamTransport.send_shared runs it, the rollout's answer immediate
    (the segment made on the first sync is reused after)."""

    def __init__(self) -> None:
        self.tracker = weights.ChangedTensors()
        self.writer = shared_weights.SegmentWriter()
        self.reader = shared_weights.SegmentReader()

    def __call__(self, engine: TransformersEngine, state: Tensors, version: int, chunk: int) -> int:
        changed, stamps = self.tracker.changed(state)
        buckets, capacity = shared_weights.plan_buckets(changed, chunk)
        self.writer.ensure(capacity)
        for seq, bucket in enumerate(buckets):
            start = self.writer.reserve(shared_weights.region_bytes(bucket))
            assert start is not None, "every earlier chunk was answered"
            described, end = self.writer.write(bucket, start)
            self.writer.sent(seq, start, end)
            message = rollout_pb2.WeightChunk(segment=self.writer.name, shared=described)
            views = self.reader.views(_wire(message))
            last = seq == len(buckets) - 1
            engine.apply_weights(views, version if last else engine.policy_version)
            del views
            self.writer.taken(seq)
        self.tracker.acknowledge(stamps)
        return 0  # no tensor bytes in the messages


@torch.no_grad()
def _step(model: Qwen2ForCausalLM, *, layers_only: bool) -> None:
    """A stand-in for optimizer.step(): every (or every layer's) parameter written in place."""
    for name, param in model.named_parameters():
        if not layers_only or ".layers." in name:
            param.add_(1e-3)


def measure(path: str, layers: int, chunk_mib: int) -> list[dict[str, float]]:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(Path(tempfile.mkdtemp()) / "tok"))
    trainer = Qwen2ForCausalLM(qwen05b_config(layers))
    engine = TransformersEngine(Qwen2ForCausalLM(qwen05b_config(layers)).eval(), tokenizer)
    state = {n: p.detach() for n, p in trainer.named_parameters()}
    makers: dict[str, Callable[[], Sync]] = {
        "old": lambda: old_sync,
        "new": NewSender,
        "shm": ShmSender,
    }
    sync = makers[path]()
    rows = []
    for version, before_sync in enumerate(
        [None, lambda: _step(trainer, layers_only=False), lambda: _step(trainer, layers_only=True)],
        start=1,
    ):
        if before_sync is not None:
            before_sync()
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
        rss = _status_kib("VmRSS")
        started = time.perf_counter()
        sent = sync(engine, state, version, chunk_mib * 2**20)
        seconds = time.perf_counter() - started
        peak = _status_kib("VmHWM") - rss
        served = dict(engine.model.named_parameters())
        assert all(torch.equal(served[n], t) for n, t in state.items()), "rollout differs"
        rows.append(
            {"sync": version, "s": seconds, "peak_mib": peak / 1024, "sent_mib": sent / 2**20}
        )
    if isinstance(sync, ShmSender):
        print(f"shm segment: {sync.writer.size / 2**20:.0f} MiB, mapped twice in this process")
    return rows


def _measure_into(conn, *args) -> None:
    conn.send(measure(*args))
    conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24 = 0.5B)")
    parser.add_argument("--chunk-mib", type=int, default=16, help="bucket size (MiB)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = sum(p.numel() for p in Qwen2ForCausalLM(qwen05b_config(1)).parameters())
    per_layer = 14_912_384  # one Qwen2.5-0.5B decoder layer
    total = params + (args.layers - 1) * per_layer
    print(
        f"model: Qwen2 hidden 896, {args.layers} layers, {total / 1e6:.0f}M parameters "
        f"({total * 4 / 2**30:.2f} GiB float32), chunks of {args.chunk_mib} MiB, CPU"
    )
    print(f"{'path':<5}{'sync':>5}{'seconds':>10}{'peak MiB':>10}{'sent MiB':>10}")
    ctx = mp.get_context("fork")
    for path in ("old", "new", "shm"):
        receive, send = ctx.Pipe(duplex=False)
        worker = ctx.Process(target=_measure_into, args=(send, path, args.layers, args.chunk_mib))
        worker.start()
        rows = receive.recv()
        worker.join()
        for row in rows:
            print(
                f"{path:<5}{row['sync']:>5}{row['s']:>10.2f}{row['peak_mib']:>10.0f}"
                f"{row['sent_mib']:>10.0f}"
            )


if __name__ == "__main__":
    main()

"""Pipeline parallelism: which layers each stage (and virtual stage) holds, and the
point-to-point exchange of activations and gradients between stages."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from gigatron.errors import GigatronError


def chunk_layer_ranges(
    num_layers: int,
    pp_size: int,
    num_virtual_stages: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    v_shape: bool = False,
) -> list[list[range]]:
    """Global layer indices of every model chunk: result[pp_rank][virtual_index] -> range.

    Layers go to virtual stages round-robin over pipeline ranks, as in Megatron: with pp = 2 and
    2 virtual stages of 2 layers, rank 0 holds layers [0, 1] and [4, 5], rank 1 [2, 3] and [6, 7].
    `v_shape` (DualPipeV, two chunks per rank): rank r holds stages r and 2 pp - 1 - r, so the
    model goes down the ranks and back up: rank 0 holds [0, 1] and [6, 7], rank 1 [2, 3], [4, 5].
    """
    vp = num_virtual_stages or 1
    if v_shape:
        return v_shape_layer_ranges(num_layers, pp_size, vp)
    if first_stage_layers is not None or last_stage_layers is not None:
        if vp > 1:
            raise GigatronError(
                "--decoder-first/last-pipeline-num-layers cannot be combined with virtual "
                "pipeline stages; drop one of them"
            )
        first = first_stage_layers
        last = last_stage_layers
        middle_stages = pp_size - (first is not None) - (last is not None)
        remaining = num_layers - (first or 0) - (last or 0)
        if (
            remaining < 0
            or (middle_stages > 0 and remaining % middle_stages)
            or (middle_stages == 0 and remaining != 0)
        ):
            raise GigatronError(
                f"--num-layers {num_layers} minus the first ({first}) and last ({last}) stage layers "
                f"leaves {remaining} layers, which do not split evenly over the other "
                f"{middle_stages} pipeline stages; change the layer counts"
            )
        per_middle = remaining // middle_stages if middle_stages else 0
        counts = [per_middle] * pp_size
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        starts = [sum(counts[:r]) for r in range(pp_size)]
        return [[range(starts[r], starts[r] + counts[r])] for r in range(pp_size)]

    stages = pp_size * vp
    if num_layers % stages:
        hint = (
            f"pipeline size {pp_size} x virtual stages {vp} = {stages}"
            if vp > 1
            else f"pipeline size {pp_size}"
        )
        raise GigatronError(
            f"--num-layers {num_layers} is not divisible by the {hint}; change --num-layers, "
            "the pipeline sizes, or give --decoder-first-pipeline-num-layers / "
            "--decoder-last-pipeline-num-layers for an uneven split"
        )
    per_stage = num_layers // stages
    return [
        [range((v * pp_size + r) * per_stage, (v * pp_size + r + 1) * per_stage) for v in range(vp)]
        for r in range(pp_size)
    ]


def v_shape_layer_ranges(num_layers: int, pp_size: int, num_chunks: int) -> list[list[range]]:
    """DualPipeV's placement: 2 pp stages of equal size, rank r holds stages r and 2 pp - 1 - r."""
    stages = 2 * pp_size
    if num_chunks != 2 or num_layers % stages:
        raise GigatronError(
            f"--pipeline-schedule dualpipev: needs --num-virtual-stages-per-pipeline-rank 2 "
            f"(got {num_chunks}) and --num-layers {num_layers} divisible by 2 x the pipeline "
            f"size = {stages}; change the layer count or the pipeline flags"
        )
    per = num_layers // stages
    return [
        [range(r * per, (r + 1) * per), range((stages - 1 - r) * per, (stages - r) * per)]
        for r in range(pp_size)
    ]


# ---- point-to-point exchange between stages -------------------------------------------------
#
# A message is identified by (kind, chunk, micro-batch) where `chunk` is the model chunk that
# consumes it. A message is one tensor (the hidden states) or, for models that pass several
# streams between stages (T5: [decoder hidden, encoder output]), a list of tensors whose shapes
# depend on the sending stage (`stage_shapes`). Every shape is known ahead from the schedule
# configuration, so nothing is exchanged to learn them. On Gloo the tag encodes the message and
# the tensor's place in it, so sends and receives match whatever order they are posted in; NCCL ignores tags, which is fine because both ends post a given direction's
# messages in the same order (the schedules guarantee it), and the ops one step issues together
# go through batch_isend_irecv (one NCCL group, so a send and a receive cannot wait on each other).

ACTIVATION = 0
GRADIENT = 1
# The most tensors one message may carry (their index is part of the tag).
MAX_TENSORS_PER_MESSAGE = 4

Shape = tuple[int, ...]
# stage_shapes(pp_rank) -> the shapes of the tensors that pipeline stage sends forward (and
# receives gradients for), in order.
StageShapes = Callable[[int], list[Shape]]


def pipeline_tensor_shape(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    tp_size: int = 1,
    cp_size: int = 1,
    sequence_parallel: bool = False,
) -> tuple[int, int, int]:
    """Shape of the hidden states between stages: [seq / cp (/ tp with SP), batch, hidden]."""
    seq = seq_length // cp_size
    if sequence_parallel:
        seq //= tp_size
    return (seq, micro_batch_size, hidden_size)


def deallocate_output(output: torch.Tensor | None) -> None:
    """Free the storage of a stage output that has been sent, keeping its autograd graph.

    Backward from this output needs only its grad_fn and the gradient received from the next
    stage, not its values; `backward_from_output` runs that backward. Views are left alone: their
    storage belongs to the base tensor, so replacing the view's data would free nothing; so are
    tensors without a grad_fn (a stage's input passed on unchanged, e.g. T5's encoder output,
    is still read by this stage's backward).
    """
    if output is None or output._base is not None or output.numel() <= 1:
        return
    if output.grad_fn is None:
        return
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def backward_from_output(
    output: torch.Tensor | list[torch.Tensor],
    grad_output: torch.Tensor | list[torch.Tensor] | None,
    inputs: tuple[torch.Tensor, ...] = (),
    keep_graph: bool = False,
) -> None:
    """Backward from `output` with `grad_output` (or from lists of both: a stage sending several
    tensors), also when `deallocate_output` freed an output.

    torch.autograd.backward checks that the gradient's shape equals the output's, which no longer
    holds once the output's data is a 1-element placeholder; the engine call below skips that
    check and otherwise does the same. `inputs`: only their gradients are accumulated (the
    zero-bubble schedule's input-gradient and weight-gradient passes); `keep_graph` keeps the
    graph for a second pass.
    """
    if grad_output is None:
        output.backward(inputs=inputs or None, retain_graph=keep_graph)
        return
    outputs = tuple(output) if isinstance(output, (list, tuple)) else (output,)
    grads = tuple(grad_output) if isinstance(grad_output, (list, tuple)) else (grad_output,)
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=outputs,
        grad_tensors=grads,
        keep_graph=keep_graph,
        create_graph=False,
        inputs=inputs,
        allow_unreachable=True,
        accumulate_grad=True,
    )


class PipelineCommunicator:
    """Activations forward and gradients backward for one call of a pipeline schedule.

    `chunk` arguments name the model chunk on THIS rank that produced or consumes the tensor;
    the communicator works out the peer rank and the peer's chunk (with virtual stages the last
    rank's chunk k feeds the first rank's chunk k + 1). Receives are posted early with
    `post_recv` (so they overlap compute) and waited for with `recv`. A sent output is
    deallocated at once: the send holds its own reference to the storage, which is released as
    soon as the send has completed.

    Messages are single tensors of `shape`, or, with `stage_shapes` (one chunk per rank), lists
    of tensors: what stage r sends forward has the shapes `stage_shapes(r)`, and so do the
    gradients it receives for them; `recv` then returns a list and `send` takes one.

    `v_shape` (DualPipeV): chunk 0's activations go down the ranks (r to r + 1), chunk 1's back up
    (r + 1 to r); a message's peer chunk is the same chunk index. The last rank's hand-over from
    chunk 0 to chunk 1 is local (the schedule's, no message).
    """

    def __init__(
        self,
        pctx,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        num_microbatches: int,
        num_chunks: int = 1,
        stage_shapes: StageShapes | None = None,
        v_shape: bool = False,
    ) -> None:
        if stage_shapes is not None and num_chunks > 1:
            raise GigatronError(
                "pipeline messages of several tensors need one model chunk per pipeline rank; "
                "drop the virtual pipeline stages"
            )
        self.pctx = pctx
        self.shape = tuple(shape)
        self.stage_shapes = stage_shapes
        self.dtype = dtype
        self.num_microbatches = num_microbatches
        self.num_chunks = num_chunks
        self.v_shape = v_shape
        self.use_batched = pctx.backend == "nccl"
        if v_shape and self.use_batched:
            raise GigatronError(
                "--pipeline-schedule dualpipev needs a backend that matches pipeline messages by "
                "tag (gloo): NCCL matches them by order, and the two ends of a link run the V's "
                "two message streams in different orders; use --distributed-backend gloo or "
                "another schedule (zb-h1, interleaved 1f1b)"
            )
        self._recvs: dict[tuple[int, int, int], tuple[torch.Tensor, list]] = {}
        # (work handles, tensor being sent): dropped once the send has completed
        self._sends: dict[tuple[int, int, int], tuple[list, torch.Tensor]] = {}
        self.recv_wait_s = 0.0

    def _tag(self, kind: int, chunk: int, microbatch: int, index: int = 0) -> int:
        message = (kind * self.num_chunks + chunk) * self.num_microbatches + microbatch
        return message * MAX_TENSORS_PER_MESSAGE + index

    def _shapes(self, kind: int, sending: bool) -> list[Shape]:
        """Shapes of one message: activations travel from stage r to r + 1 with stage r's
        shapes, gradients back from r + 1 to r with the same shapes."""
        if self.stage_shapes is None:
            return [self.shape]
        rank = self.pctx.pp_rank
        producer = rank if (kind == ACTIVATION) == sending else rank - 1
        shapes = [tuple(shape) for shape in self.stage_shapes(producer)]
        if not 0 < len(shapes) <= MAX_TENSORS_PER_MESSAGE:
            raise GigatronError(
                f"pipeline stage {producer} sends {len(shapes)} tensors; a message carries 1 to "
                f"{MAX_TENSORS_PER_MESSAGE}"
            )
        return shapes

    def _start(self, ops: list[tuple[str, torch.Tensor, int, int]]) -> list:
        """Start ('send' | 'recv', tensor, peer, tag) ops; returns their work handles."""
        if self.use_batched:
            p2p = [
                dist.P2POp(dist.isend if op == "send" else dist.irecv, tensor, peer, tag=tag)
                for op, tensor, peer, tag in ops
            ]
            return list(dist.batch_isend_irecv(p2p)) if p2p else []
        return [
            dist.isend(tensor, dst=peer, tag=tag)
            if op == "send"
            else dist.irecv(tensor, src=peer, tag=tag)
            for op, tensor, peer, tag in ops
        ]

    def _downstream(self, chunk: int) -> int:
        """The rank that a chunk's output goes to (and its output's gradient comes from)."""
        if self.v_shape and chunk == 1:
            return self.pctx.prev_pipeline_rank
        return self.pctx.next_pipeline_rank

    def _upstream(self, chunk: int) -> int:
        """The rank that a chunk's input comes from (and its input's gradient goes to)."""
        if self.v_shape and chunk == 1:
            return self.pctx.next_pipeline_rank
        return self.pctx.prev_pipeline_rank

    # --- receives --------------------------------------------------------------------------
    def _recv_key_and_peer(self, kind: int, chunk: int, microbatch: int) -> tuple[tuple, int, int]:
        pp_rank, pp_size = self.pctx.pp_rank, self.pctx.pp_size
        if self.v_shape:
            peer = self._upstream(chunk) if kind == ACTIVATION else self._downstream(chunk)
            return (kind, chunk, microbatch), peer, self._tag(kind, chunk, microbatch, 0)
        if kind == ACTIVATION:
            # Input of (this rank, chunk) comes from the previous stage of the model.
            peer_chunk = chunk if pp_rank > 0 else chunk - 1
            peer = self.pctx.prev_pipeline_rank
        else:
            # Gradient for (this rank, chunk)'s output comes from the next stage of the model.
            peer_chunk = chunk if pp_rank < pp_size - 1 else chunk + 1
            peer = self.pctx.next_pipeline_rank
        return (kind, chunk, microbatch), peer, self._tag(kind, peer_chunk, microbatch, 0)

    def post_recv(self, kind: int, chunk: int, microbatch: int) -> None:
        """Start receiving the tensor (kind, chunk, microbatch) unless already started."""
        self._start_ops(None, (kind, chunk, microbatch))

    def _start_ops(self, send: tuple | None, recv: tuple[int, int, int] | None) -> None:
        """Start one send (kind, chunk, microbatch, payload) and/or one receive together: on
        NCCL they form one group, so the two peers' sends cannot block each other."""
        ops, keys = [], []
        if send is not None:
            kind, chunk, microbatch, payloads = send
            peer = self._downstream(chunk) if kind == ACTIVATION else self._upstream(chunk)
            for index, payload in enumerate(payloads):
                ops.append(("send", payload, peer, self._tag(kind, chunk, microbatch, index)))
            keys.append(("send", (kind, chunk, microbatch), payloads))
        if recv is not None:
            key, peer, tag = self._recv_key_and_peer(*recv)
            if key not in self._recvs:
                buffers = [
                    torch.empty(shape, dtype=self.dtype, device=self.pctx.device)
                    for shape in self._shapes(recv[0], sending=False)
                ]
                for index, buffer in enumerate(buffers):
                    ops.append(("recv", buffer, peer, tag + index))
                keys.append(("recv", key, buffers))
        if not ops:
            return
        works = self._start(ops)
        first = 0
        for op, key, tensors in keys:
            # A coalesced (NCCL) batch may return one handle for all its ops.
            if len(works) == len(ops):
                handles = works[first : first + len(tensors)]
            else:
                handles = works
            first += len(tensors)
            if op == "send":
                self._sends[key] = (handles, tensors)
            else:
                self._recvs[key] = (tensors, handles)

    def recv(self, kind: int, chunk: int, microbatch: int) -> torch.Tensor | list[torch.Tensor]:
        """Wait for the message (kind, chunk, microbatch), posting the receive if needed: one
        tensor, or a list with `stage_shapes`."""
        self.post_recv(kind, chunk, microbatch)
        buffers, works = self._recvs.pop((kind, chunk, microbatch))
        began = time.perf_counter()
        for work in works:
            work.wait()
        self.recv_wait_s += time.perf_counter() - began
        self.poll_sends()
        return buffers if self.stage_shapes is not None else buffers[0]

    # --- sends -----------------------------------------------------------------------------
    def send(
        self,
        kind: int,
        chunk: int,
        microbatch: int,
        tensor: torch.Tensor | list[torch.Tensor],
        free_after: torch.Tensor | list[torch.Tensor] | None = None,
        then_recv: tuple[int, int, int] | None = None,
    ) -> None:
        """Start sending `tensor` (or a list of tensors), and the receive `then_recv` (kind,
        chunk, microbatch) with it; `free_after` (the stage output, or its list) has its storage
        released as soon as the send completes."""
        tensors = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]
        shapes = [tuple(t.shape) for t in tensors]
        expected = self._shapes(kind, sending=True)
        if shapes != expected:
            raise GigatronError(
                f"pipeline stage output of shape {_shapes_text(shapes)} does not match the "
                f"shape {_shapes_text(expected)} set by --seq-length / --micro-batch-size / "
                "--hidden-size (divided by cp, and by tp with --sequence-parallel); stages must "
                "return hidden states [seq, batch, hidden]"
            )
        payloads = []
        for t in tensors:
            payload = t.detach()
            if payload.dtype != self.dtype or not payload.is_contiguous():
                payload = payload.to(self.dtype).contiguous()
            payloads.append(payload)
        self._start_ops((kind, chunk, microbatch, payloads), then_recv)
        # A payload shares its output's storage and keeps it alive until the send completes;
        # the output itself no longer needs it (see deallocate_output).
        frees = free_after if isinstance(free_after, (list, tuple)) else [free_after]
        for output in frees:
            deallocate_output(output)
        self.poll_sends()

    def poll_sends(self) -> None:
        """Free the outputs whose sends have completed."""
        for key in [
            k for k, (works, _) in self._sends.items() if all(w.is_completed() for w in works)
        ]:
            self._finish_send(key)

    def wait_send(self, kind: int, chunk: int, microbatch: int) -> None:
        """Wait for one send (e.g. before the backward of the output it carried)."""
        if (kind, chunk, microbatch) in self._sends:
            self._finish_send((kind, chunk, microbatch), wait=True)

    def _finish_send(self, key: tuple, wait: bool = False) -> None:
        works, _ = self._sends.pop(key)
        if wait:
            for work in works:
                work.wait()

    def finish(self) -> None:
        """Wait for every outstanding send; every receive must have been consumed."""
        for key in list(self._sends):
            self._finish_send(key, wait=True)
        if self._recvs:
            raise RuntimeError(f"pipeline receives posted but never used: {sorted(self._recvs)}")


def _shapes_text(shapes: list[Shape]) -> str:
    return str(shapes[0]) if len(shapes) == 1 else str(shapes)

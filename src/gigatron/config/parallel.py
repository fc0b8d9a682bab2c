"""Parallel layout and distributed runtime options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field, off_switch
from gigatron.config.rules import Section, positive_problems
from gigatron.errors import GigatronError


@dataclass
class ParallelConfig(Section):
    tensor_model_parallel_size: int = flag_field(1, "tensor-parallel size (tp)")
    pipeline_model_parallel_size: int = flag_field(1, "pipeline-parallel size (pp)")
    context_parallel_size: int = flag_field(1, "context-parallel size (cp)")
    cp_comm_type: list[str] = flag_field(
        ["p2p"],
        "context-parallel attention: p2p (ring), a2a (all-to-all), allgather; one for all layers or one per layer",
        choices=["p2p", "a2a", "allgather"],
    )
    expert_model_parallel_size: int = flag_field(1, "expert-parallel size (ep)")
    expert_tensor_parallel_size: Optional[int] = flag_field(
        None, "tensor-parallel size of the experts: 1 or the tensor-parallel size (default)"
    )
    sequence_parallel: bool = flag_field(False, "shard norms and dropout along the sequence over tp")
    num_layers_per_virtual_pipeline_stage: Optional[int] = flag_field(
        None, "layers in each virtual pipeline stage (interleaved 1F1B)"
    )
    num_virtual_stages_per_pipeline_rank: Optional[int] = flag_field(
        None, "model chunks per pipeline rank (interleaved 1F1B)"
    )
    microbatch_group_size_per_vp_stage: Optional[int] = flag_field(
        None,
        "micro-batches run per virtual stage before switching (default pp)",
        flag="--microbatch-group-size-per-virtual-pipeline-stage",
    )
    pipeline_model_parallel_split_rank: Optional[int] = flag_field(
        None,
        "encoder-decoder models (T5): pipeline stages below this rank hold the encoder, the "
        "others the decoder; default half of the stages",
    )
    decoder_first_pipeline_num_layers: Optional[int] = flag_field(
        None, "layers on the first pipeline stage (uneven split)"
    )
    decoder_last_pipeline_num_layers: Optional[int] = flag_field(
        None, "layers on the last pipeline stage (uneven split)"
    )
    distributed_backend: str = flag_field(
        "auto",
        "torch.distributed backend; auto = nccl on GPU, gloo on CPU",
        choices=["auto", "nccl", "gloo"],
    )
    device: str = flag_field("auto", "where to run", choices=["auto", "cuda", "cpu"])
    distributed_timeout_minutes: int = flag_field(10, "timeout of collective operations")
    use_distributed_optimizer: bool = flag_field(
        False, "shard optimizer state and fp32 main params over data-parallel ranks"
    )
    overlap_grad_reduce: bool = flag_field(False, "reduce gradient buckets during the backward pass")
    overlap_param_gather: bool = flag_field(
        False, "gather updated parameters during the next forward pass (distributed optimizer)"
    )
    align_param_gather: bool = off_switch(
        "with --overlap-param-gather, start each chunk's parameter all-gathers at its next "
        "forward instead of every chunk's together after the optimizer step"
    )
    ddp_bucket_size: Optional[int] = flag_field(None, "elements per gradient bucket")
    accumulate_allreduce_grads_in_fp32: bool = flag_field(
        False, "accumulate and reduce gradients in fp32 under bf16/fp16"
    )
    grad_reduce_in_bf16: bool = flag_field(False, "accumulate and reduce gradients in bf16 under --bf16 (default fp32)")
    gradient_accumulation_fusion: bool = off_switch(
        "no fused weight-gradient accumulation into the fp32 gradient buffer"
    )
    use_torch_fsdp2: bool = flag_field(False, "fully sharded data parallelism with PyTorch's FSDP2 (fully_shard)")
    use_megatron_fsdp: bool = flag_field(
        False,
        "fully sharded data parallelism (gigatron: PyTorch's FSDP2 with the sharding strategy)",
    )
    data_parallel_sharding_strategy: str = flag_field(
        "optim_grads_params",
        "with FSDP: what is sharded over data-parallel ranks",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
    )
    nccl_ub: bool = flag_field(False, "NCCL user buffers for FSDP", flag="--use-nccl-ub")
    fsdp_double_buffer: bool = flag_field(False, "Megatron-FSDP double buffering")
    fsdp_manual_registration: bool = flag_field(False, "Megatron-FSDP manual NCCL registration")
    megatron_fsdp_grad_comm_dtype: str = flag_field(
        "auto",
        "Megatron-FSDP gradient communication dtype",
        choices=["fp32", "fp16", "bf16", "auto"],
    )
    megatron_fsdp_main_grads_dtype: str = flag_field(
        "auto", "Megatron-FSDP main gradient dtype", choices=["fp32", "bf16", "fp16", "auto"]
    )
    calculate_per_token_loss: bool = flag_field(
        False, "average the loss over all tokens of the global batch instead of per micro-batch"
    )
    pipeline_schedule: str = flag_field(
        "1f1b",
        "pipeline schedule (gigatron's flag): 1f1b (interleaved with virtual stages), zb-h1 "
        "(zero bubble: backward split into input- and weight-gradient steps) or dualpipev "
        "(two chunks per rank in a V, with --num-virtual-stages-per-pipeline-rank 2)",
        choices=["1f1b", "zb-h1", "dualpipev"],
    )
    overlap_p2p_comm: bool = off_switch(
        "post each pipeline receive one step early (overlapped with compute)", flag="--no-overlap-p2p-communication"
    )
    inprocess_restart: bool = flag_field(
        False,
        "under torchrun: on a failed collective or an error in a training step, every rank "
        "leaves its process groups, meets the others again and resumes from the newest "
        "checkpoint in --save, in the same processes (docs/resilience.md)",
    )
    inprocess_max_iterations: Optional[int] = flag_field(None, "in-process restarts at most", default_help="3")
    inprocess_barrier_timeout: float = flag_field(
        120, "seconds the ranks wait for each other to meet again after an in-process restart"
    )
    inprocess_active_world_size: Optional[int] = flag_field(
        None,
        "with --inprocess-restart: processes that train; the other launched processes wait as "
        "warm spares and replace ranks that die",
        default_help="WORLD_SIZE",
    )
    inprocess_heartbeat_interval: float = flag_field(
        30, "seconds between the heartbeats each process writes to the store (in-process restart)"
    )
    inprocess_heartbeat_timeout: float = flag_field(
        60, "seconds without a heartbeat after which a process counts as dead (in-process restart)"
    )

    def problems(self) -> list[str]:
        """Sizes, gradient reduction, overlap and the fully sharded data-parallel choices."""
        found = positive_problems(
            (
                (self.tensor_model_parallel_size, "--tensor-model-parallel-size"),
                (self.pipeline_model_parallel_size, "--pipeline-model-parallel-size"),
                (self.context_parallel_size, "--context-parallel-size"),
                (self.expert_model_parallel_size, "--expert-model-parallel-size"),
            )
        )
        if self.grad_reduce_in_bf16 and self.accumulate_allreduce_grads_in_fp32:
            found.append("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict; give one")
        if self.overlap_param_gather and not (self.use_distributed_optimizer and self.overlap_grad_reduce):
            found.append("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")
        if not self.align_param_gather and not self.overlap_param_gather:
            found.append(
                "--no-align-param-gather changes when --overlap-param-gather's all-gathers "
                "start; add --overlap-param-gather or drop it"
            )
        if self.pipeline_schedule == "zb-h1" and (
            self.num_virtual_stages_per_pipeline_rank or self.num_layers_per_virtual_pipeline_stage
        ):
            found.append("--pipeline-schedule zb-h1: one model chunk per rank; drop the virtual stages")
        if self.pipeline_schedule == "dualpipev" and (
            self.pipeline_model_parallel_size < 2 or self.num_virtual_stages_per_pipeline_rank != 2
        ):
            found.append(
                "--pipeline-schedule dualpipev: needs --pipeline-model-parallel-size > 1 and "
                "--num-virtual-stages-per-pipeline-rank 2 (two chunks per rank in a V)"
            )
        return found + self.fsdp_problems()

    def fsdp_problems(self) -> list[str]:
        """Which fully sharded data parallelism, and its own options."""
        found = []
        if self.use_torch_fsdp2 and self.use_megatron_fsdp:
            found.append("--use-torch-fsdp2 and --use-megatron-fsdp: give one")
        if self.use_torch_fsdp2 and self.use_distributed_optimizer:
            found.append("--use-torch-fsdp2 shards the optimizer state itself; drop --use-distributed-optimizer")
        fsdp = self.use_torch_fsdp2 or self.use_megatron_fsdp
        if not fsdp and self.megatron_fsdp_grad_comm_dtype != "auto":
            found.append("--megatron-fsdp-grad-comm-dtype needs --use-megatron-fsdp")
        if not self.use_megatron_fsdp and self.data_parallel_sharding_strategy != "optim_grads_params":
            found.append("--data-parallel-sharding-strategy needs --use-megatron-fsdp")
        return found

    @property
    def fully_sharded(self) -> bool:
        """Whether parameters are sharded over data-parallel ranks (FSDP2 or Megatron-FSDP)."""
        return self.use_torch_fsdp2 or (
            self.use_megatron_fsdp and self.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")
        )


def check_pipeline_schedule(
    pp_size: int, num_microbatches: int, num_chunks: int = 1, group_size: int | None = None
) -> int:
    """Validate a pipeline schedule's sizes; returns the micro-batch group size G."""
    if num_microbatches < 1:
        raise GigatronError(
            f"number of micro-batches {num_microbatches}: must be at least 1; raise "
            "--global-batch-size or lower --micro-batch-size"
        )
    group = pp_size if group_size is None else group_size
    if num_chunks == 1:
        return group
    if not pp_size <= group <= num_microbatches:
        raise GigatronError(
            f"--microbatch-group-size-per-virtual-pipeline-stage {group} must lie between the "
            f"pipeline size {pp_size} and the number of micro-batches {num_microbatches} "
            "(global batch / (micro-batch size x data-parallel size)) for the interleaved "
            "schedule (smaller groups deadlock: the first stage would wait for an output still "
            "going round the pipeline); change it, or the batch sizes"
        )
    remainder = num_microbatches % group
    if remainder and remainder < pp_size:
        raise GigatronError(
            f"number of micro-batches {num_microbatches} leaves a last group of {remainder} "
            f"with micro-batch groups of {group}; the interleaved schedule needs every group to "
            f"hold at least the pipeline size {pp_size} micro-batches (a smaller group waits for "
            "outputs still going round the pipeline and loses the benefit of interleaving). "
            "Make the number of "
            f"micro-batches a multiple of {group} (global batch / (micro-batch size x "
            "data-parallel size)) or change --microbatch-group-size-per-virtual-pipeline-stage"
        )
    return group

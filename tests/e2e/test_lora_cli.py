"""LoRA end to end on a Llama-shaped tiny model. A base is trained briefly at dp 2 (torch_dist,
so it loads at any layout, and --save-hf, its transformers folder); LoRA runs fine-tune it
through --pretrained-checkpoint. Checked: the validation loss improves from the base's (new
adapters change nothing); the start-up record counts the adapters as the trainable parameters;
checkpoints hold the adapters only and resume exactly; tp 2 and FSDP (its torch_dist checkpoints
resumed at one process, its base read with --load --finetune) train the losses of one process;
`convert --merge-lora` (a gigatron checkpoint re-split to tp 2, and a Hugging Face folder), the
run's own --save-hf folders (adapters merged, also from tp 2) and
`convert --to peft` (loaded by `peft` on the base's transformers model) give the adapted
model's logits; `generate` and `serve` with --lora-checkpoint generate with the adapters."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch
from inference_helpers import start_server, stop_server
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from gigatron.checkpoint.pipeline import Target, convert
from gigatron.models.lora import is_adapter_name
from gigatron.torch_files import safe_load
from helpers import NO_DROPOUT, eval_record, gigatron_runs, records, tiny_gpt_flags, train_values
from hf_helpers import checkpoint_model, transformers_logits

pytestmark = pytest.mark.distributed

LLAMA = [
    *tiny_gpt_flags(), "--padded-vocab-size", "128", "--group-query-attention",
    "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size", "128", "--normalization",
    "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--global-batch-size", "4", "--num-workers", "0",
    "--log-interval", "1", "--eval-iters", "4", "--lr", "1e-2", "--train-iters", "20",
    "--eval-interval", "20", "--deterministic-mode", *NO_DROPOUT,  # masks differ by layout
]  # fmt: skip
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA = ["--lora-target-modules", *TARGETS, "--lora-rank", "4", "--lora-alpha", "8"]
# LoRA on the experts too (linear_fc1/fc2 name them): from the same random base at ep 2 and 1.
MOE = [
    *LLAMA, *LORA, "--num-experts", "4", "--moe-router-topk", "2", "--exit-interval", "3",
    "--save-interval", "3",
]  # fmt: skip
TOKENS = torch.tensor([[3, 17, 40, 41, 99, 5, 64, 12, 7, 100, 33, 2]])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    base = ["--pretrained-checkpoint", root / "base"]
    lora = ["--from", "gigatron", "--load", root / "lora"]
    gigatron_runs(
        root,
        {
            "base": (2, ["pretrain", "gpt", *LLAMA, "--save", root / "base", "--ckpt-format",
                         "torch_dist", "--save-hf", root / "base_hf"]),
            "tp2": (2, ["pretrain", "gpt", *LLAMA, *LORA, *base, "--tensor-model-parallel-size",
                        "2", "--exit-interval", "5", "--metrics-file", root / "tp2.jsonl",
                        "--save", root / "tp2", "--save-hf", root / "tp2_hf"]),
            # FSDP, torch_dist saves, the base from --load --finetune (torch_dist) this time.
            "fsdp": (2, ["pretrain", "gpt", *LLAMA, *LORA, "--load", root / "base", "--finetune",
                         "--use-torch-fsdp2", "--ckpt-format", "torch_dist", "--exit-interval",
                         "5", "--save-interval", "3", "--save", root / "fsdp", "--metrics-file",
                         root / "fsdp.jsonl"]),
            "moe_ep2": (2, ["pretrain", "gpt", *MOE, "--expert-model-parallel-size", "2",
                            "--save-hf", root / "moe_ep2_hf", "--metrics-file",
                            root / "moe_ep2.jsonl"]),
            "lora": (1, ["pretrain", "gpt", *LLAMA, *LORA, *base, "--eval-at-start", "--save",
                         root / "lora", "--save-interval", "10", "--save-hf", root / "lora_hf"]),
            "resume": (1, ["pretrain", "gpt", *LLAMA, *LORA, *base, "--load", root / "lora",
                           "--ckpt-step", "10", "--metrics-file", root / "resume.jsonl"]),
            "fsdp_resume": (1, ["pretrain", "gpt", *LLAMA, *LORA, *base, "--load", root / "fsdp",
                                "--ckpt-step", "3", "--ckpt-format", "torch_dist",
                                "--exit-interval", "5", "--metrics-file",
                                root / "fsdp_resume.jsonl"]),
            "moe_ep1": (1, ["pretrain", "gpt", *MOE, "--save-hf", root / "moe_ep1_hf",
                            "--metrics-file", root / "moe_ep1.jsonl"]),
            "dora": (1, ["pretrain", "gpt", *LLAMA, *LORA, *base, "--lora-dora", "--eval-at-start",
                         "--exit-interval", "5", "--save", root / "dora", "--metrics-file",
                         root / "dora.jsonl"]),
            "dora_peft": (1, ["convert", "--from", "gigatron", "--load", root / "dora", "--to",
                              "peft", "--save", root / "dora_peft"]),
            "dora_hf": (1, ["convert", "--from", "gigatron", "--load", root / "dora", "--to",
                            "hf", "--merge-lora", "--save", root / "dora_hf", "--no-tokenizer"]),
            "merged": (1, ["convert", *lora, "--to", "gigatron", "--merge-lora", "--save",
                           root / "merged", "--target-tensor-parallel-size", "2"]),
            "merged_hf": (1, ["convert", *lora, "--to", "hf", "--merge-lora", "--save",
                              root / "merged_hf", "--no-tokenizer"]),
            "peft": (1, ["convert", *lora, "--to", "peft", "--save", root / "peft"]),
            "tp2_merged": (1, ["convert", "--from", "gigatron", "--load", root / "tp2", "--to",
                               "gigatron", "--merge-lora", "--save", root / "tp2_merged",
                               "--target-tensor-parallel-size", "1"]),
            "generate": (1, ["generate", "--load", root / "base", "--lora-checkpoint",
                             root / "lora", "--prompt", "3 17 40 41", "--greedy", "--device",
                             "cpu", "--max-tokens", "6", "--ignore-eos", "--output",
                             root / "generated.jsonl"]),
        },
    )  # fmt: skip
    return root


@pytest.fixture(scope="module")
def adapted(runs) -> torch.nn.Module:
    """The base with the LoRA run's last adapters, as generate/serve load it."""
    return checkpoint_model(runs / "base", lora=runs / "lora")


def test_lora_fine_tune_improves_the_validation_loss(runs):
    evals = [r for r in records(runs / "lora", "eval") if r["split"] == "valid"]
    assert [r["iteration"] for r in evals] == [0, 20]
    # New adapters (B = 0) leave the base model: the base's own validation loss on those samples.
    base_valid = eval_record(runs / "base", "valid")["lm_loss"]
    assert evals[0]["lm_loss"] == pytest.approx(base_valid, rel=1e-5)
    assert evals[1]["lm_loss"] < evals[0]["lm_loss"] - 0.1


def test_trainable_parameters_and_optimizer_memory_are_reported(runs):
    (startup,) = records(runs / "lora", "startup")
    # A [4, in] and B [out, 4] of qkv 64 -> 128, proj 64 -> 64, fc1 64 -> 2 x 128, fc2 128 -> 64.
    per_layer = 4 * (64 + 128) + 4 * (64 + 64) + 4 * (64 + 256) + 4 * (128 + 64)
    assert startup["trainable_parameters"] == 2 * per_layer
    (memory,) = startup["bytes_per_rank"]
    assert memory["gradient_bytes"] == 4 * 2 * per_layer  # frozen weights get no gradient
    assert 8 * 2 * per_layer <= memory["optimizer_state_bytes"] < 16 * 2 * per_layer
    assert f"> trainable parameters: {2 * per_layer:,}" in (runs / "lora.out").read_text()


def test_checkpoints_hold_the_adapters_only_and_resume_exactly(runs):
    saved = safe_load(runs / "lora" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt")
    names = list(saved["model"])
    assert len(names) == 2 * 4 * 2 and all(is_adapter_name(n) for n in names)
    full, resumed = train_values(runs / "lora"), train_values(runs / "resume.jsonl")
    assert sorted(resumed) == list(range(11, 21))
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(full[iteration], rel=1e-6), iteration


def test_lora_at_tp2_trains_as_one_process(runs):
    tp2, tp1 = train_values(runs / "tp2.jsonl"), train_values(runs / "lora")
    assert sorted(tp2) == list(range(1, 6))
    for iteration, loss in tp2.items():
        assert loss == pytest.approx(tp1[iteration], rel=1e-5), iteration
    assert tp1[5] != pytest.approx(tp1[1], rel=1e-3)  # the adapters did train


def test_lora_with_fsdp_and_torch_dist_checkpoints(runs):
    """FSDP (dp 2) trains the one-process losses; its torch_dist checkpoints hold the adapters
    only and resume at another layout (one process) exactly."""
    fsdp, tp1 = train_values(runs / "fsdp.jsonl"), train_values(runs / "lora")
    assert sorted(fsdp) == list(range(1, 6))
    for iteration, loss in fsdp.items():
        assert loss == pytest.approx(tp1[iteration], rel=1e-5), iteration
    names = FileSystemReader(runs / "fsdp" / "iter_0000003").read_metadata().state_dict_metadata
    model = [name for name in names if name.startswith("model.")]
    assert len(model) == 2 * 4 * 2 and all(is_adapter_name(n) for n in model)
    resumed = train_values(runs / "fsdp_resume.jsonl")
    assert sorted(resumed) == [4, 5]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(fsdp[iteration], rel=1e-6), iteration


def test_lora_on_moe_experts_at_ep2_trains_as_ep1(runs):
    """Expert adapters split over ep 2 train the losses of one process, and the --save-hf
    folders (adapters merged into each expert's weights) hold the same tensors."""
    ep2, ep1 = train_values(runs / "moe_ep2.jsonl"), train_values(runs / "moe_ep1.jsonl")
    assert sorted(ep2) == [1, 2, 3] and ep1[3] != pytest.approx(ep1[1], rel=1e-3)
    for iteration, loss in ep2.items():
        assert loss == pytest.approx(ep1[iteration], rel=1e-5), iteration
    (startup,) = records(runs / "moe_ep1.jsonl", "startup")
    # Attention adapters as the dense model's; per layer, 4 experts' fc1 and fc2 adapters.
    dense = 4 * (64 + 128) + 4 * (64 + 64)
    experts = 4 * (4 * (64 + 2 * 128) + 4 * (128 + 64))
    assert startup["trainable_parameters"] == 2 * (dense + experts)
    one = load_file(runs / "moe_ep1_hf" / "iter_0000003" / "model.safetensors")
    two = load_file(runs / "moe_ep2_hf" / "iter_0000003" / "model.safetensors")
    assert one.keys() == two.keys() and any("experts" in name for name in one)
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS, torch.arange(TOKENS.shape[1]).unsqueeze(0))[..., :128].float()


def test_merged_checkpoint_gives_the_adapted_logits(runs, adapted):
    base = checkpoint_model(runs / "base")
    assert (_logits(adapted) - _logits(base)).abs().max() > 1e-2  # the adapters matter
    parts = [
        safe_load(runs / "merged" / "iter_0000020" / f"mp_rank_0{r}" / "model_optim_rng.pt")
        for r in (0, 1)
    ]
    assert parts[0]["model"]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
        64, 64,  # [2 groups x (2 + 2) heads x 16 channels] / tp 2
    )  # fmt: skip
    assert not any(is_adapter_name(name) for name in parts[0]["model"])
    single = runs / "merged_tp1"  # back to one process through the same pipeline
    convert("gigatron", runs / "merged", "gigatron", single, Target(tp=1))
    merged = checkpoint_model(single)
    torch.testing.assert_close(_logits(merged), _logits(adapted), rtol=1e-5, atol=1e-5)


def test_merged_hugging_face_folder_gives_the_adapted_logits(runs, adapted):
    logits = transformers_logits(runs / "merged_hf", TOKENS)
    torch.testing.assert_close(logits, _logits(adapted), rtol=1e-5, atol=1e-5)


def test_save_hf_of_a_lora_run_writes_the_merged_model(runs, adapted):
    logits = transformers_logits(runs / "lora_hf" / "iter_0000020", TOKENS)
    torch.testing.assert_close(logits, _logits(adapted), rtol=1e-5, atol=1e-5)


def test_tp2_lora_run_save_hf_and_merge_agree(runs):
    # --save-hf of the tp 2 run (each rank merges its slices) and --merge-lora of its tp 2
    # adapter checkpoint, read back at one process, are the same model.
    merged = _logits(checkpoint_model(runs / "tp2_merged"))
    base = _logits(checkpoint_model(runs / "base"))
    assert (merged - base).abs().max() > 1e-3  # five steps moved the adapters
    logits = transformers_logits(runs / "tp2_hf" / "iter_0000005", TOKENS)
    torch.testing.assert_close(logits, merged, rtol=1e-5, atol=1e-5)


def test_peft_export_loads_with_peft_and_gives_the_adapted_logits(runs, adapted):
    config = json.loads((runs / "peft" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    logits = transformers_logits(runs / "base_hf" / "iter_0000020", TOKENS, peft=runs / "peft")
    torch.testing.assert_close(logits, _logits(adapted), rtol=1e-5, atol=1e-5)


def test_generate_with_the_adapters_follows_the_adapted_model(runs, adapted):
    (record,) = [json.loads(line) for line in (runs / "generated.jsonl").read_text().splitlines()]
    ids = [3, 17, 40, 41]
    with torch.no_grad():
        for _ in range(6):
            logits = adapted(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))
            ids.append(int(logits[0, -1, :128].argmax()))
    assert record["tokens"] == ids[4:]


def test_serve_with_the_adapters_answers_as_generate(runs):
    process, url = start_server(runs / "base", "--lora-checkpoint", str(runs / "lora"))
    body = {"prompts": ["3 17 40 41"], "tokens_to_generate": 6, "top_k": 1}
    request = urllib.request.Request(
        url + "/api", data=json.dumps(body).encode(), method="PUT",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
    finally:
        stop_server(process)
    (record,) = [json.loads(line) for line in (runs / "generated.jsonl").read_text().splitlines()]
    served = answer["tokens"][0][4:]
    assert served and served == record["tokens"][: len(served)]


def test_dora_merged_and_peft_exports_give_the_adapted_logits(runs):
    """--lora-dora: a new adapter leaves the base's loss; after training, the merged Hugging Face
    folder and the PEFT export (use_dora, loaded by peft) give the adapted model's logits."""
    (start,) = [r for r in records(runs / "dora.jsonl", "eval") if r["iteration"] == 0]
    assert start["lm_loss"] == pytest.approx(eval_record(runs / "base", "valid")["lm_loss"])
    adapted = _logits(checkpoint_model(runs / "base", lora=runs / "dora"))
    assert (adapted - _logits(checkpoint_model(runs / "base"))).abs().max() > 1e-2
    config = json.loads((runs / "dora_peft" / "adapter_config.json").read_text())
    assert config["use_dora"] is True
    names = load_file(runs / "dora_peft" / "adapter_model.safetensors")
    assert sum(name.endswith("lora_magnitude_vector") for name in names) == 2 * 7
    base_hf = runs / "base_hf" / "iter_0000020"
    peft_logits = transformers_logits(base_hf, TOKENS, peft=runs / "dora_peft")
    torch.testing.assert_close(peft_logits, adapted, rtol=1e-5, atol=1e-5)
    merged = transformers_logits(runs / "dora_hf", TOKENS)
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)

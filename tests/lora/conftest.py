"""LoRA adapters for the tiny checkpoints, written by ``peft`` itself (fixed seeds)."""

from __future__ import annotations

import pytest

ATTENTION_QV = ("q_proj", "v_proj")
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(base_path, folder, target_modules, seed: int, rank: int = 8, alpha: int = 16,
                  std: float = 0.15, **lora_options):
    """A random LoRA adapter (both factors random, so it changes the outputs) saved by ``peft``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        init_lora_weights=False, **lora_options)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def lora_adapters(tiny_checkpoint, tmp_path_factory):
    """``lora_adapters(name)`` -> folder: ``qv`` and ``qv2`` (rank 8 on q/v, two seeds), ``all`` (rank 8 on
    every projection, rsLoRA scaling)."""
    specs = {"qv": (ATTENTION_QV, 1, {}), "qv2": (ATTENTION_QV, 2, {}),
             "all": (ALL_PROJECTIONS, 3, {"use_rslora": True})}
    built = {}

    def get(name: str):
        if name not in built:
            targets, seed, options = specs[name]
            built[name] = write_adapter(tiny_checkpoint("llama"), tmp_path_factory.mktemp(f"lora-{name}"),
                                        targets, seed, **options)
        return built[name]

    return get

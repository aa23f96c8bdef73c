"""A stand-in for peft: LoRA freezes the base parameters and adds a small trainable one."""

import torch

__version__ = "0.0-fake"


def LoraConfig(**kwargs):
    return kwargs


def get_peft_model(model, config):
    for p in model._params:
        p.requires_grad = False
    model._params.append(torch.Tensor(numel=config["r"] * 2 * model.config.hidden_size, dtype="float32"))
    return model

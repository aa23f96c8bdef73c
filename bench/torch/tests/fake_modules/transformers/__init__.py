"""A stand-in for transformers: config classes that keep their arguments and a model whose
forward pass returns a loss (see the fake torch)."""

import torch

__version__ = "0.0-fake"


class _Config:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class OPTConfig(_Config):
    pass


class LlamaConfig(_Config):
    pass


class GPTNeoXConfig(_Config):
    pass


class _Model:
    def __init__(self, config):
        self.config = config
        self._params = [torch.Tensor(numel=config.hidden_size * config.vocab_size, dtype=torch.get_default_dtype())]
        self.checkpointing = False

    def parameters(self):
        return iter(self._params)

    def modules(self):
        return iter([self])

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.checkpointing = True

    def train(self):
        return self

    def to(self, dtype):
        for p in self._params:
            p.dtype = dtype
        return self

    def __call__(self, input_ids, labels):
        torch._forward_step()
        return type("Output", (), {"loss": torch.Tensor(value=10.0)})()


class AutoModelForCausalLM:
    @staticmethod
    def from_config(config, **kwargs):
        return _Model(config)

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


class Qwen2Config(_Config):
    pass


class _Model:
    def __init__(self, config):
        self.config = config
        self._params = [torch.Tensor(numel=config.hidden_size * config.vocab_size, dtype=torch.get_default_dtype())]
        self.checkpointing = False
        self.training = True
        self.generation_config = _Config(eos_token_id=2, pad_token_id=None, temperature=0.7)
        self.generated = []  # (batch, prompt width, new tokens, options) of each generate call

    def parameters(self):
        return iter(self._params)

    def modules(self):
        return iter([self])

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.checkpointing = True

    def train(self):
        self.training = True
        return self

    def eval(self):
        self.training = False
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, **options):
        torch._forward_step()
        rows, width = input_ids.shape
        self.generated.append((rows, width, max_new_tokens, options))
        return torch._Matrix(rows, width + max_new_tokens, dtype="int64")

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

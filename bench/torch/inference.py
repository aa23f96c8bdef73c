"""Inference workloads for finetune.py: Hugging Face `generate` calls, one call per step.

Each workload is a list of calls drawn from one seed, so every allocator sees the same batches,
prompt lengths and token counts. Prompts of one batch differ in length and are left-padded with
an attention mask, as a server batches them. Greedy decoding with no end-of-sequence token, so a
call always makes exactly its number of new tokens (random weights would stop at random places).

  GD  dynamic KV cache (grown by concatenation every token); batch 1..32 and prompt lengths
      32..768 drawn per call; 64 new tokens
  GS  static KV cache (`cache_implementation="static"`, preallocated per call for prompt + new
      tokens); the same draws as GD
  GL  long generation: batch 1..8, prompts 64..512, 512 new tokens
  GV  a serving-like stream: each call batches the requests that arrived while the previous one
      ran (Poisson, mean 6, 1..24 of them); prompt lengths long-tailed (log-normal, median 160,
      16..1536); each request asks for 16..192 new tokens and the batch runs to the largest
      (static batching, as a simple server does)

Pure functions (the draws) are tested without torch; `generate` runs one call on the GPU.
"""

import math
import random

WORKLOADS = {
    "GD": "generate, dynamic KV cache, batch 1-32, prompts 32-768, 64 new tokens",
    "GS": "generate, static KV cache, batch 1-32, prompts 32-768, 64 new tokens",
    "GL": "generate, dynamic KV cache, batch 1-8, prompts 64-512, 512 new tokens",
    "GV": "serving mix: Poisson arrivals batched per call, long-tailed prompts, 16-192 new tokens",
}
BATCHES = (1, 2, 4, 8, 16, 32)


def _rng(strategy, seed):
    # The same draws for GD and GS (they differ only in the cache), distinct ones for the rest.
    salt = {"GD": 1, "GS": 1, "GL": 2, "GV": 3}[strategy]
    return random.Random(seed * 1000 + salt)


def _poisson(rng, mean):
    # Knuth's method; fine for small means.
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def calls(strategy, steps, seed):
    """The `steps` calls of one workload: dicts with `prompts` (one length per sequence) and
    `new_tokens`, and `static` for the static cache."""
    if strategy not in WORKLOADS:
        raise ValueError(f"{strategy!r}: not an inference workload ({', '.join(WORKLOADS)})")
    rng = _rng(strategy, seed)
    out = []
    for _ in range(steps):
        if strategy in ("GD", "GS"):
            batch = rng.choice(BATCHES)
            out.append(dict(prompts=[rng.randint(32, 768) for _ in range(batch)], new_tokens=64))
        elif strategy == "GL":
            batch = rng.choice(BATCHES[:4])
            out.append(dict(prompts=[rng.randint(64, 512) for _ in range(batch)], new_tokens=512))
        else:
            batch = min(24, max(1, _poisson(rng, 6)))
            prompts = [min(1536, max(16, int(rng.lognormvariate(math.log(160), 0.9)))) for _ in range(batch)]
            out.append(dict(prompts=prompts, new_tokens=max(rng.randint(16, 192) for _ in range(batch))))
        out[-1]["static"] = strategy == "GS"
    return out


def prepare(model):
    """Sets the model up for the calls: eval mode, the cache on, no end-of-sequence token, padding
    with token 0."""
    model.eval()
    model.config.use_cache = True
    g = model.generation_config
    g.eos_token_id = None
    g.pad_token_id = 0
    g.do_sample = False
    for name in ("temperature", "top_p", "top_k"):  # greedy: sampling settings would only warn
        if hasattr(g, name):
            setattr(g, name, None)
    return model


def generate(torch, model, vocab_size, call, device, generator):
    """Runs one call; raises if it made another number of tokens than asked."""
    lengths = call["prompts"]
    width = max(lengths)
    ids = torch.randint(1, vocab_size, (len(lengths), width), device=f"cuda:{device}", generator=generator)
    mask = torch.ones((len(lengths), width), dtype=torch.long, device=f"cuda:{device}")
    for row, length in enumerate(lengths):
        if length < width:  # left padding, as generation with a decoder-only model needs
            ids[row, : width - length] = 0
            mask[row, : width - length] = 0
    options = dict(max_new_tokens=call["new_tokens"], min_new_tokens=call["new_tokens"], do_sample=False,
                   pad_token_id=0, disable_compile=True)  # static cache: no torch.compile (it would recompile per shape)
    if call["static"]:
        options["cache_implementation"] = "static"
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, **options)
    made = out.shape[1] - width
    if made != call["new_tokens"]:
        raise RuntimeError(f"generate made {made} tokens, {call['new_tokens']} asked")
    del out, ids, mask

#!/usr/bin/env python3
"""End-to-end fine-tuning under three CUDA allocators: PyTorch's default, expandable_segments, glake.

The method of the H100 baseline in traces/README.md: Hugging Face causal LMs built from their configs with
random weights (no downloads), bf16, batch 8, sequence length drawn uniformly from 64..1024 each step
(one seed, so every allocator sees the same lengths and tokens), 14 steps, AdamW; peaks over the whole
run; step time = median of steps 3..14, each step closed by torch.cuda.synchronize().

  models      opt1.3b (OPT-1.3B shape), llama1b (TinyLlama 1.1B shape), pythia2.8b (GPT-NeoX 2.8B shape)
  strategies  N full fine-tune | R recompute (gradient checkpointing) | LR LoRA r16 + recompute |
              LO LoRA + recompute + saved activations in pinned host memory (save_on_cpu)
  allocators  default | expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before torch
              is imported) | glake (glake_torch.enable() before the first CUDA allocation)

Each (model, strategy, allocator) runs in a process of its own (the driver starts them and collects one
JSON object each; --child runs one). Reported per run:
  peak_active_bytes    torch.cuda.max_memory_allocated() (default, expandable); glake's peak of the
                       bytes requested (glake_torch.stats()); peak_requested_bytes is the requested
                       peak for all three (torch: memory_stats()["requested_bytes.all.peak"])
  peak_reserved_bytes  torch.cuda.max_memory_reserved(); glake's own peak reserved
  utilization          peak_active_bytes / peak_reserved_bytes
  device_used_*        cudaMemGetInfo (torch.cuda.mem_get_info: total - free), sampled right after CUDA
                       is initialised (base) and after the forward pass, the backward pass and the
                       optimizer step of every step; the peak sample, and the peak minus the base
                       (which then holds the allocator's memory plus what CUDA libraries took directly)
  median_step_s        median of steps 3..N; status ok | oom | error (an OOM is reported, not fatal)
With --trace-dir, glake runs record their requests (GLAKE_TRACE) for glake-replay.

  python3 bench/torch/finetune.py --models opt1.3b --strategies R --steps 3          # smoke test
  python3 bench/torch/finetune.py --out results.jsonl --markdown results.md          # everything
  python3 bench/torch/finetune.py --fsdp 2 --models opt1.3b --strategies N,LR        # FSDP on 2 GPUs
  python3 bench/torch/finetune.py --summarize results.jsonl --markdown results.md    # table only

--fsdp N runs each (model, strategy, allocator) under `torchrun --standalone --nproc_per_node N`
with FSDP2 (fully_shard on each decoder layer, then the model; FSDP1 where fully_shard is missing),
one glake allocator per rank (device = LOCAL_RANK), and reports every rank. See bench/torch/README.md
for building the plug-in and the commands used on the GPU machine.
"""

import argparse
import gc
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GLAKE_TORCH = os.path.join(ROOT, "integrations", "torch")

GB = 1e9
BATCH = 8
MIN_LEN, MAX_LEN = 64, 1024
SEED = 1234
ALLOCATORS = ("default", "expandable", "glake")
# Not run unless named: a control that goes through PyTorch's pluggable-allocator path with a
# near-free allocator (bench/torch/size_cache_allocator.cpp), to price the path apart from glake.
CONTROL_ALLOCATORS = ("sizecache",)
SIZE_CACHE_LIBRARY = os.path.join(ROOT, "build", "torch", "libsize_cache.so")
# --allocator-timing: bench/torch/allocator_timing.cpp, built by build_plugin.sh --allocator-timing.
ALLOCATOR_TIMING_LIBRARY = os.path.join(ROOT, "build", "torch", "libglake_allocator_timing.so")
TRAINING_STRATEGIES = ("N", "R", "LR", "LO")
INFERENCE_STRATEGIES = ("GD", "GS", "GL", "GV")  # bench/torch/inference.py
STRATEGIES = TRAINING_STRATEGIES + INFERENCE_STRATEGIES
# Shapes of the public checkpoints, random weights; `kind` picks the config class (CONFIG_CLASSES).
MODELS = {
    "opt1.3b": dict(
        kind="opt", hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, ffn_dim=8192,
        vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=2048,
    ),
    "llama1b": dict(
        kind="llama", hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
        intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048,
    ),
    "pythia2.8b": dict(
        kind="gpt_neox", hidden_size=2560, num_hidden_layers=32, num_attention_heads=32, intermediate_size=10240,
        vocab_size=50304, max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True,
    ),
    # Encoder-decoder: T5-base's shape; batch 16 of source 64..512 and target 16..256 tokens.
    "t5-base": dict(
        kind="t5", d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12, num_heads=12,
        vocab_size=32128, relative_attention_num_buckets=32, feed_forward_proj="relu", tie_word_embeddings=True,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    ),
    # Variable-length full fine-tuning: a 1.2B Mistral shape, sequences 64..2048 in token-budget
    # batches (about TOKEN_BUDGET tokens a batch: many short sequences or a few long ones).
    "mistral1.2b": dict(
        kind="mistral", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=6144, vocab_size=32000, max_position_embeddings=4096, sliding_window=None,
    ),
    # Checks beside the benchmark (bench/results/finetune.md, "Two shapes outside the benchmark"):
    # a BART-large encoder-decoder, batched as t5-base; a Qwen2-1.5B shape in token budgets.
    "bart-large": dict(
        kind="bart", d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
        decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=50265,
        max_position_embeddings=1024, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    ),
    "qwen2-1.5b": dict(
        kind="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
    ),
    # Inference shapes: a ~150k vocabulary (Qwen2) and a 128k-vocabulary 1B Llama (Llama 3.2 1B).
    "qwen2-0.5b": dict(
        kind="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
    ),
    "llama3.2-1b": dict(
        kind="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=True,
        rope_theta=500000.0, head_dim=64,
    ),
}
TRAINING_MODELS = ("opt1.3b", "llama1b", "pythia2.8b")
# Shapes whose batches are not BATCH x a length: seq2seq (source, target) pairs, token budgets.
SEQ2SEQ_MODELS = ("t5-base", "bart-large")
SEQ2SEQ_BATCH = 16
SEQ2SEQ_SOURCE, SEQ2SEQ_TARGET = (64, 512), (16, 256)
TOKEN_BUDGET_MODELS = ("mistral1.2b", "qwen2-1.5b")
TOKEN_BUDGET, TOKEN_BUDGET_LENGTHS = 8192, (64, 2048)
INFERENCE_MODELS = ("llama3.2-1b", "qwen2-0.5b")
CONFIG_CLASSES = {"opt": "OPTConfig", "llama": "LlamaConfig", "gpt_neox": "GPTNeoXConfig", "qwen2": "Qwen2Config",
                  "t5": "T5Config", "mistral": "MistralConfig", "bart": "BartConfig"}
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def inference_module():
    """bench/torch/inference.py, imported once."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import importlib

    return importlib.import_module("inference")


def sequence_lengths(steps, seed=SEED, model=None):
    """The same lengths for every allocator and rank: a length per step; for seq2seq models a
    [source, target] pair; for token-budget models [batch, length] with batch x length about
    TOKEN_BUDGET."""
    rng = random.Random(seed)
    if model in SEQ2SEQ_MODELS:
        return [[rng.randint(*SEQ2SEQ_SOURCE), rng.randint(*SEQ2SEQ_TARGET)] for _ in range(steps)]
    if model in TOKEN_BUDGET_MODELS:
        lengths = [rng.randint(*TOKEN_BUDGET_LENGTHS) for _ in range(steps)]
        return [[max(1, TOKEN_BUDGET // n), n] for n in lengths]
    return [rng.randint(MIN_LEN, MAX_LEN) for _ in range(steps)]


def steal_jiffies(path="/proc/stat"):
    """Jiffies stolen from all CPUs since boot (the 8th number of /proc/stat's cpu line), or None."""
    try:
        with open(path) as f:
            fields = f.readline().split()
        return int(fields[8]) if fields and fields[0] == "cpu" and len(fields) > 8 else None
    except (OSError, ValueError):
        return None


# --host-probe: fixed host work timed after every step, outside its clock, that neither allocator
# serves (no CUDA allocation): how fast this process's host runs, step by step. The scatter of
# step times between processes follows the host's speed (bench/results/finetune.md, "How measured"),
# so tools/analysis/steptime_pairs.py can compare allocators at equal host speed.
PROBE_LOOPS = 400


def python_loop_seconds(n=PROBE_LOOPS * 25):
    """Seconds a fixed interpreter loop of `n` iterations takes: the probe's `python` part."""
    t0 = time.perf_counter()
    total = 0
    for i in range(n):
        total += i & 7
    return time.perf_counter() - t0


def allocator_timing(path):
    """Wraps the CUDA allocator now installed (PyTorch's, or glake's pluggable one) in the timing
    allocator of bench/torch/allocator_timing.cpp. Call after `import torch` (and glake's enable),
    before the model is built: what was allocated earlier is freed untimed. Returns a function
    giving the totals so far:
    {"alloc_ns", "alloc_calls", "free_ns", "free_calls", "untimed"}."""
    import ctypes

    lib = ctypes.CDLL(path)
    code = lib.glake_timing_install()
    if code != 0:
        raise RuntimeError(f"allocator timing: glake_timing_install() returned {code}")
    values = (ctypes.c_uint64 * 5)()

    def read():
        lib.glake_timing_read(values)
        return dict(zip(("alloc_ns", "alloc_calls", "free_ns", "free_calls", "untimed"), values))

    return read


def write_fake_collectives(dist, world):
    """PyTorch's fake process group returns from every collective without writing its output: an
    all-gather's output beyond this rank's shard, and every reduce-scatter's output (the gradient
    shard the optimizer reads), would hold whatever the memory the allocator handed out held, and
    the loss would depend on the allocator (NaN under one, finite under another). From here on each
    first writes what it would if every rank held this rank's data: an all-gather repeats its input,
    a reduce-scatter keeps its input's first chunk (the mean over equal inputs). The copies run on
    the calling stream, where the collective's work would."""
    gather, scatter = dist.all_gather_into_tensor, dist.reduce_scatter_tensor

    def all_gather_into_tensor(output_tensor, input_tensor, *args, **kwargs):
        output_tensor.view(world, -1).copy_(input_tensor.reshape(1, -1).expand(world, -1))
        return gather(output_tensor, input_tensor, *args, **kwargs)

    def reduce_scatter_tensor(output, input, *args, **kwargs):
        output.view(-1).copy_(input.reshape(world, -1)[0])
        return scatter(output, input, *args, **kwargs)

    dist.all_gather_into_tensor = all_gather_into_tensor
    dist.reduce_scatter_tensor = reduce_scatter_tensor


def host_probe(torch, device, tensor):
    """Returns a function timing four kinds of host work, in seconds: `python` (the interpreter
    alone), `dispatch` (view and detach of `tensor`, a model parameter: PyTorch's dispatcher and
    autograd, no kernel), `launch` (empty kernels queued with torch.cuda._sleep(0)) and `memcpy`
    (a 32 MiB copy between host tensors made here, once); and `cpu`, the CPU the thread ran on.
    Under FSDP the parameter is a DTensor, whose local shard is a view that FSDP and the optimizer
    update in place (viewing it again then fails in autograd): a small leaf tensor of the same
    dtype on the same device stands in for it, made here, once."""
    if hasattr(tensor, "to_local"):
        tensor = torch.zeros(1024, dtype=tensor.dtype, device=device, requires_grad=tensor.requires_grad)
    source = torch.ones(8 << 20, dtype=torch.float32)
    target = torch.empty_like(source)

    def probe():
        torch.cuda.synchronize(device)
        python = python_loop_seconds()
        t1 = time.perf_counter()
        cpu = current_cpu()
        for _ in range(PROBE_LOOPS):
            tensor.view(-1).detach()
        t2 = time.perf_counter()
        for _ in range(PROBE_LOOPS):
            torch.cuda._sleep(0)
        t3 = time.perf_counter()
        torch.cuda.synchronize(device)
        t4 = time.perf_counter()
        target.copy_(source)
        t5 = time.perf_counter()
        return dict(python=python, dispatch=t2 - t1, launch=t3 - t2, memcpy=t5 - t4, cpu=cpu)

    return probe


def current_cpu(path="/proc/thread-self/stat"):
    """The CPU this thread last ran on (field 39 of its stat), or None."""
    try:
        with open(path) as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def driver_kind_deltas(now, last):
    """{kind: (calls, milliseconds)} of each driver call kind between two glake_torch.stats()
    snapshots, from the plug-in's driver_<kind> counts and driver_<kind>_ns times (the totals
    driver_calls and driver_ns are not kinds)."""
    out = {}
    for name, value in now.items():
        kind = name[len("driver_"):-len("_ns")] if name.startswith("driver_") and name.endswith("_ns") else None
        if kind and f"driver_{kind}" in now:
            out[kind] = (now[f"driver_{kind}"] - last[f"driver_{kind}"], round((value - last[name]) / 1e6, 3))
    return out


def median_step(times):
    """Median of steps 3..N (all steps when there are fewer than 3)."""
    tail = times[2:] if len(times) >= 3 else times
    return statistics.median(tail) if tail else None


def is_oom(error):
    text = str(error).lower()
    return type(error).__name__ == "OutOfMemoryError" or "out of memory" in text


# ---------------------------------------------------------------------------------------------
# child: one run (one rank under --fsdp)
# ---------------------------------------------------------------------------------------------


def child(args):
    started = time.time()
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)  # before torch starts any thread: they all inherit it
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = args.fake_world or int(os.environ.get("WORLD_SIZE", "1"))
    result = dict(
        model=args.model, strategy=args.strategy, allocator=args.allocator, steps=args.steps, batch=BATCH,
        seed=SEED, fsdp=bool(args.fsdp or args.fake_world), rank=rank, world_size=world, device=local_rank, status="error",
        alloc_conf={k: os.environ[k] for k in ALLOC_CONF_VARIABLES if k in os.environ},
        cpus=sorted(os.sched_getaffinity(0)),
    )
    if args.fake_world:
        result["fake_world"] = args.fake_world
    try:
        run_training(args, result, local_rank)
    except BaseException as error:  # noqa: BLE001 - report whatever stopped the run
        result["status"] = "oom" if is_oom(error) else "error"
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        if result["status"] == "error":
            import traceback

            traceback.print_exc()
    result["wall_s"] = round(time.time() - started, 2)
    text = json.dumps(result)
    if args.result_file:
        with open(args.result_file.replace("{rank}", str(rank)), "w") as f:
            f.write(text + "\n")
    print("RESULT " + text, flush=True)
    if args.fsdp and result["status"] != "ok":
        # The other ranks may wait in a collective for this one: exit at once and non-zero, so that
        # torchrun stops them instead of letting them wait for NCCL's timeout.
        sys.stderr.flush()
        os._exit(3)
    return 0 if result["status"] in ("ok", "oom") else 1


def run_training(args, result, device):
    if args.allocator == "expandable" and "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise RuntimeError("expandable: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True must be set before start")
    if args.allocator != "expandable" and any(k in os.environ for k in ALLOC_CONF_VARIABLES):
        raise RuntimeError(f"{args.allocator}: unset {', '.join(ALLOC_CONF_VARIABLES)} (they change PyTorch's allocator)")

    import torch

    glake = None
    if args.allocator == "glake":
        sys.path.insert(0, GLAKE_TORCH)
        import glake_torch as glake

        glake.enable(conf=args.glake_conf)  # before anything touches CUDA
        result["glake_settings"] = glake.settings()
        result["glake_hooks"] = glake.hooks()
        result["glake_library"] = glake._lib_path
        result["trace"] = os.environ.get("GLAKE_TRACE")
    size_cache = None
    if args.allocator == "sizecache":
        import ctypes

        path = os.environ.get("GLAKE_SIZE_CACHE_LIBRARY", SIZE_CACHE_LIBRARY)
        size_cache = ctypes.CDLL(path)
        torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(path, "sc_malloc", "sc_free"))
        result["size_cache_library"] = path
    timing = None
    if args.allocator_timing:
        path = os.environ.get("GLAKE_ALLOCATOR_TIMING_LIBRARY", ALLOCATOR_TIMING_LIBRARY)
        timing = allocator_timing(path)
        result["allocator_timing_library"] = path

    import transformers
    from transformers import AutoModelForCausalLM

    seq2seq = args.model in SEQ2SEQ_MODELS
    model_class = AutoModelForCausalLM
    if seq2seq:
        from transformers import AutoModelForSeq2SeqLM as model_class

    result.update(torch_version=torch.__version__, transformers_version=transformers.__version__)
    torch.cuda.set_device(device)
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(device)
    used = {"base": total - free, "peak": total - free}
    result.update(gpu=torch.cuda.get_device_name(device), device_total_bytes=total)

    def sample():
        free_now, _ = torch.cuda.mem_get_info(device)
        used["peak"] = max(used["peak"], total - free_now)

    dist = None
    if args.fsdp:
        import torch.distributed as dist

        import datetime

        dist.init_process_group("nccl", device_id=torch.device("cuda", device), timeout=datetime.timedelta(seconds=180))
    elif args.fake_world:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
        write_fake_collectives(dist, args.fake_world)

    spec = dict(MODELS[args.model])
    config = getattr(transformers, CONFIG_CLASSES[spec.pop("kind")])(**spec)
    inferring = args.strategy in INFERENCE_STRATEGIES
    config.use_cache = inferring
    torch.manual_seed(SEED)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters made in bf16 on the GPU, as in the baseline
    try:
        with torch.device("cuda", device):
            try:
                model = model_class.from_config(config, attn_implementation="sdpa")
            except (ValueError, ImportError, TypeError):
                model = model_class.from_config(config)
    finally:
        torch.set_default_dtype(previous_dtype)
    if any(p.dtype != torch.bfloat16 for p in model.parameters()):
        model.to(torch.bfloat16)
    result["params"] = sum(p.numel() for p in model.parameters())
    if inferring:
        if args.fsdp or args.fake_world:
            raise RuntimeError(f"{args.strategy}: inference workloads run on one GPU, without --fsdp/--fake-world")
        inference = inference_module()
        inference.prepare(model)
    elif args.strategy != "N":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.strategy in ("LR", "LO") and not inferring:
        import peft

        task = "SEQ_2_SEQ_LM" if seq2seq else "CAUSAL_LM"
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type=task))
        result["peft_version"] = peft.__version__
    if not inferring:
        model.train()
    if args.fsdp or args.fake_world:
        model, result["fsdp_api"] = shard(model, device)
    if not inferring:
        trainable = [p for p in model.parameters() if p.requires_grad]
        result["trainable_params"] = sum(p.numel() for p in trainable)
        optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    sample()

    if inferring:
        # One generate call per step; `lengths` holds the calls (prompt lengths, new tokens).
        lengths = inference.calls(args.strategy, args.steps, SEED)
        result["calls"] = [dict(batch=len(c["prompts"]), longest_prompt=max(c["prompts"]), new_tokens=c["new_tokens"])
                           for c in lengths]
        result["batch"] = None
    else:
        lengths = sequence_lengths(args.steps, model=args.model)
        result["seq_lengths"] = lengths
        if seq2seq:
            result["batch"] = SEQ2SEQ_BATCH
        elif args.model in TOKEN_BUDGET_MODELS:
            result["batch"] = None
            result["token_budget"] = TOKEN_BUDGET
    generator = torch.Generator(device=f"cuda:{device}")
    generator.manual_seed(SEED + result["rank"])
    saved_on_host = torch.autograd.graph.save_on_cpu if args.strategy == "LO" else None
    times, queued_times, losses = [], [], []
    # Host CPU seconds of the whole process (all threads) per step, and the jiffies the hypervisor
    # took from this machine's CPUs meanwhile (steal): a host-bound step's time depends on both.
    step_cpu, step_steal = [], []
    # glake runs: the driver calls, stitches and repaired cached stitches made during each step
    # (read after the step's clock stops), so step times can be told apart by whether the
    # allocator went to the driver.
    step_calls, step_stitches, step_repairs, step_grows, step_waits, step_host_ms = [], [], [], [], [], []
    step_events, step_event_ms = [], []  # events glake recorded, and its ms in event records and queries
    # Per driver call kind (create, map, set_access, ...): calls and host milliseconds in each step,
    # from the plug-in's driver_<kind> and driver_<kind>_ns statistics (kinds with no call left out).
    step_kind_calls, step_kind_ms = {}, {}
    last = glake.stats(device) if glake is not None else None
    last_host = glake.host_time() if glake is not None else None
    # --allocator-timing: host time inside the allocator's calls (allocations and frees) per step
    # and their number, for whichever allocator runs. Read after each step's clock stops, so a
    # step's figures also hold the few calls between the previous read and the step (the loss
    # freed, memory samples), under both allocators alike.
    step_timed_ms, step_timed_calls = [], []
    last_timed = timing() if timing is not None else None
    # Time in Python's cyclic garbage collector during each step: a pause of the host thread that
    # launches the step's kernels, whichever allocator runs.
    gc_seconds, gc_started, step_gc_ms = [0.0], [None], []

    def on_gc(phase, _info):
        if phase == "start":
            gc_started[0] = time.perf_counter()
        elif gc_started[0] is not None:
            gc_seconds[0] += time.perf_counter() - gc_started[0]
            gc_started[0] = None

    probe = host_probe(torch, device, next(model.parameters())) if args.host_probe else None
    probes = {}

    gc.callbacks.append(on_gc)
    result["gc_outside_steps"] = bool(args.gc_outside_steps)
    if args.gc_outside_steps:
        gc.collect()
        gc.freeze()  # what exists now (model, modules) is never scanned again

    def generate_step(call):
        """One generate call; returns None (no loss), the seconds until it returned and the same
        (generate reads tokens back every step, so nothing stays queued)."""
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        inference.generate(torch, model, config.vocab_size, call, device, generator)
        sample()
        torch.cuda.synchronize(device)
        took = time.perf_counter() - t0
        return None, took, took

    def train_step(length):
        """One step; returns the loss and the seconds until its last kernel was queued."""
        if inferring:
            return generate_step(length)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        cuda = f"cuda:{device}"
        if seq2seq:  # [source, target] tokens, SEQ2SEQ_BATCH rows
            ids = torch.randint(0, config.vocab_size, (SEQ2SEQ_BATCH, length[0]), device=cuda, generator=generator)
            labels = torch.randint(0, config.vocab_size, (SEQ2SEQ_BATCH, length[1]), device=cuda, generator=generator)
        elif isinstance(length, list):  # [batch, length]: a token budget
            ids = torch.randint(0, config.vocab_size, tuple(length), device=cuda, generator=generator)
            labels = ids
        else:
            ids = torch.randint(0, config.vocab_size, (BATCH, length), device=cuda, generator=generator)
            labels = ids
        if saved_on_host is not None:
            with saved_on_host(pin_memory=True):
                loss = model(input_ids=ids, labels=labels).loss
        else:
            loss = model(input_ids=ids, labels=labels).loss
        sample()
        loss.backward()
        sample()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        queued = time.perf_counter() - t0
        torch.cuda.synchronize(device)
        return loss, queued, time.perf_counter() - t0

    try:
        for step, length in enumerate(lengths, 1):
            if args.gc_outside_steps:
                gc.collect()
                gc.disable()
            gc_before = gc_seconds[0]
            cpu_before, steal_before = time.process_time(), steal_jiffies()
            loss, queued, took = train_step(length)
            times.append(took)
            step_cpu.append(round(time.process_time() - cpu_before, 4))
            step_steal.append(steal_jiffies() - steal_before if steal_before is not None else None)
            queued_times.append(round(queued, 4))
            step_gc_ms.append(round((gc_seconds[0] - gc_before) * 1000, 3))
            if args.gc_outside_steps:
                gc.enable()
            if timing is not None:
                now = timing()
                step_timed_ms.append(round((now["alloc_ns"] + now["free_ns"] - last_timed["alloc_ns"] - last_timed["free_ns"]) / 1e6, 3))
                step_timed_calls.append(now["alloc_calls"] + now["free_calls"] - last_timed["alloc_calls"] - last_timed["free_calls"])
                last_timed = now
            if glake is not None:
                now = glake.stats(device)
                step_calls.append(now["driver_calls"] - last["driver_calls"])
                step_stitches.append(now["stitches"] - last["stitches"])
                step_repairs.append(now["stitch_repairs"] - last["stitch_repairs"])
                step_grows.append(now.get("stitch_grows", 0) - last.get("stitch_grows", 0))
                step_waits.append(now.get("device_waits", 0) - last.get("device_waits", 0))
                step_events.append(now.get("events_recorded", 0) - last.get("events_recorded", 0))
                step_event_ms.append(round((now.get("event_ns", 0) - last.get("event_ns", 0)) / 1e6, 3))
                for kind, (calls, ms) in driver_kind_deltas(now, last).items():
                    step_kind_calls.setdefault(kind, []).append(calls)
                    step_kind_ms.setdefault(kind, []).append(ms)
                last = now
                if last_host is not None:
                    host = glake.host_time()
                    step_host_ms.append(round((host["ns"] - last_host["ns"]) / 1e6, 3))
                    last_host = host
            sample()
            if loss is not None:
                losses.append(float(loss.detach()))
            del loss
            if probe is not None:
                for kind, value in probe().items():
                    probes.setdefault(kind, []).append(value if kind == "cpu" else round(value, 6))
            if args.progress:
                what = f"batch {len(length['prompts'])} new {length['new_tokens']}" if inferring else f"len {length}"
                print(f"[rank {result['rank']}] step {step}/{len(lengths)} {what} {times[-1]:.3f} s", file=sys.stderr, flush=True)
        if args.profile_steps:
            result["profiled"] = profile_steps(args, result, lambda length: train_step(length)[1:],
                                         [lengths[k - 1] for k in args.profile_steps if k <= len(lengths)])
        result["status"] = "ok"
    except BaseException as error:  # noqa: BLE001
        if not is_oom(error):
            raise
        result.update(status="oom", error=f"{type(error).__name__}: {error}"[:2000], oom_step=len(times) + 1)
    finally:
        gc.enable()
        gc.callbacks.remove(on_gc)
        result.update(step_times_s=[round(t, 4) for t in times], median_step_s=median_step(times), step_gc_ms=step_gc_ms,
                      step_queued_s=queued_times, step_cpu_s=step_cpu, step_steal_jiffies=step_steal)
        if glake is not None:
            result.update(step_driver_calls=step_calls, step_stitches=step_stitches, step_stitch_repairs=step_repairs,
                          step_stitch_grows=step_grows, step_device_waits=step_waits, step_events_recorded=step_events,
                          step_event_ms=step_event_ms)
            if step_kind_ms:
                called = [k for k in step_kind_calls if any(step_kind_calls[k])]
                result.update(step_driver_kind_calls={k: step_kind_calls[k] for k in called},
                              step_driver_kind_ms={k: step_kind_ms[k] for k in called})
            if last_host is not None:
                result["step_allocator_host_ms"] = step_host_ms
        if timing is not None:
            result.update(step_allocator_ms=step_timed_ms, step_allocator_calls=step_timed_calls,
                          allocator_timing_untimed=timing()["untimed"])
        if probes:
            result["step_probe_s"] = probes
        if losses:
            result.update(loss_first=losses[0], loss_last=losses[-1])
        try:  # after a CUDA error these may fail too; the error that stopped the run matters more
            sample()
            result.update(
                device_used_base_bytes=used["base"], device_used_peak_bytes=used["peak"],
                device_used_peak_over_base_bytes=used["peak"] - used["base"],
                device_used_samples="after CUDA init, then after forward, backward and optimizer step of every step",
            )
            memory_peaks(torch, glake, device, result, size_cache)
        except Exception as error:  # noqa: BLE001
            result["stats_error"] = f"{type(error).__name__}: {error}"[:500]
        if dist is not None and dist.is_initialized() and result["status"] == "ok":
            try:
                dist.barrier()
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer that died must not hide this rank's result
                pass


def profile_steps(args, result, step, lengths):
    """Runs one more step of each length under torch.profiler (host ops, CUDA runtime calls and
    kernels) after the measured steps, so the profiler's overhead stays out of median_step_s, and
    writes each step's Chrome trace, gzipped, to --profile-dir (chrome://tracing or Perfetto
    reads them). The first profiled step is a warm-up of the profiler and is not kept."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(args.profile_dir, exist_ok=True)
    name = f"{args.model}-{args.strategy}-{args.allocator}-rank{result['rank']}"
    profiled = []
    for index, length in enumerate(lengths[:1] + lengths):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            queued, took = step(length)
        if index == 0:
            continue
        path = os.path.join(args.profile_dir, f"{name}-{index}-len{length}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as raw, gzip.open(path + ".gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        os.remove(path)
        profiled.append(dict(length=length, step_s=round(took, 4), queued_s=round(queued, 4), trace=path + ".gz"))
    return profiled


def memory_peaks(torch, glake, device, result, size_cache=None):
    if size_cache is not None:
        import ctypes

        active, reserved = ctypes.c_size_t(), ctypes.c_size_t()
        size_cache.sc_peaks(ctypes.byref(active), ctypes.byref(reserved))
        active, reserved, requested = active.value, reserved.value, None
    elif glake is not None:
        s = glake.stats(device)
        result["glake_stats"] = s
        active, reserved = s["peak_active_bytes"], s["peak_reserved_bytes"]
        requested = active
    else:
        active, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        requested = torch.cuda.memory_stats(device).get("requested_bytes.all.peak")
        result["num_alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries")
    result.update(
        peak_active_bytes=active, peak_reserved_bytes=reserved, peak_requested_bytes=requested,
        utilization=active / reserved if reserved else None,
    )


def shard(model, device):
    """FSDP2: fully_shard each decoder layer, then the whole model. FSDP1 where it is missing."""
    layer_names = set()
    for module in model.modules():
        layer_names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise RuntimeError(f"no decoder layers found to shard (looked for {sorted(layer_names)})")
    try:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
    except ImportError:
        fully_shard = None
    if fully_shard is not None:
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        return model, "FSDP2 fully_shard"
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    wrapped = FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({type(layer) for layer in layers}), device_id=device, use_orig_params=True
    )
    return wrapped, "FSDP1 FullyShardedDataParallel (use_orig_params)"


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def child_environment(allocator, trace, host_timing=False):
    env = dict(os.environ)
    for k in ALLOC_CONF_VARIABLES:
        env.pop(k, None)
    env.pop("GLAKE_TRACE", None)
    env.pop("GLAKE_HOST_TIMING", None)
    if allocator == "glake" and host_timing:
        env["GLAKE_HOST_TIMING"] = "1"
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if allocator == "glake" and trace:
        env["GLAKE_TRACE"] = trace
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def drive(args, driver_command):
    # With --repeat, every round runs each workload under each allocator, the allocators' order
    # reversed in every other round, so that drift within a call falls on both alike.
    runs = [(m, s, a, r) for r in range(args.repeat) for m in args.models for s in args.strategies
            for a in (args.allocators if r % 2 == 0 else args.allocators[::-1])]
    results = []
    begun = time.time()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="finetune-logs-")
    os.makedirs(log_dir, exist_ok=True)
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    print(f"{len(runs)} runs; child logs in {log_dir}", file=sys.stderr, flush=True)
    for index, (model, strategy, allocator, round_) in enumerate(runs, 1):
        again = f"-round{round_}" if args.repeat > 1 else ""
        name = f"{model}-{strategy}-{allocator}" + (f"-fsdp{args.fsdp}" if args.fsdp else "") + (
            f"-fake{args.fake_world}" if args.fake_world else "") + again
        trace = None
        if args.trace_dir and allocator == "glake":
            suffix = f"-fsdp{args.fsdp}-dev%d" if args.fsdp else f"-fake{args.fake_world}" if args.fake_world else ""
            trace = os.path.abspath(os.path.join(args.trace_dir, f"{model}-{strategy}{suffix}{again}.trace"))
        result_dir = tempfile.mkdtemp(prefix="finetune-")
        result_file = os.path.join(result_dir, "rank{rank}.json")
        common = [
            os.path.abspath(__file__), "--child", "--model", model, "--strategy", strategy, "--allocator", allocator,
            "--steps", str(args.steps), "--result-file", result_file,
        ]
        if args.glake_conf is not None:
            common += ["--glake-conf", args.glake_conf]
        if args.progress:
            common.append("--progress")
        if args.gc_outside_steps:
            common.append("--gc-outside-steps")
        if args.host_probe:
            common.append("--host-probe")
        if args.allocator_timing:
            common.append("--allocator-timing")
        if args.cpus:
            common += ["--cpus", ",".join(map(str, args.cpus))]
        if args.fake_world:
            common += ["--fake-world", str(args.fake_world)]
        if args.profile_steps:
            common += ["--profile-steps", ",".join(map(str, args.profile_steps)),
                       "--profile-dir", os.path.join(args.profile_dir, f"round{round_}") if args.repeat > 1 else args.profile_dir]
        if args.fsdp:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.fsdp}"]
            command += common + ["--fsdp", str(args.fsdp)]
        else:
            command = [sys.executable] + common
        if args.budget and time.time() - begun > args.budget:
            print(f"[{index}/{len(runs)}] {name}: skipped, --budget {args.budget:.0f} s used up", file=sys.stderr, flush=True)
            continue
        print(f"[{index}/{len(runs)}] {name} ...", file=sys.stderr, flush=True)
        started = time.time()
        log_path = os.path.join(log_dir, name + ".log")
        with open(log_path, "w") as log:
            code = run_child(command, child_environment(allocator, trace, args.glake_host_timing), log, args.timeout)
        found = []
        for rank in range(args.fsdp or 1):
            path = result_file.replace("{rank}", str(rank))
            if os.path.isfile(path):
                with open(path) as f:
                    found.append(json.loads(f.read()))
            else:
                found.append(dict(model=model, strategy=strategy, allocator=allocator, rank=rank, fsdp=bool(args.fsdp or args.fake_world),
                                  status="error", error=f"no result (exit {code}); see {log_path}"))
        for r in found:
            r["command"] = " ".join(shlex.quote(c) for c in command)
            r["driver_command"] = driver_command
            r["log"] = log_path
            if args.repeat > 1:
                r["round"] = round_
            results.append(r)
            print("    " + one_line(r), file=sys.stderr, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
        if any(r["status"] == "error" for r in found):
            with open(log_path) as f:
                tail = f.read()[-3000:]
            print("    --- log tail ---\n" + tail, file=sys.stderr, flush=True)
        print(f"    ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    return results


def run_child(command, env, log, timeout):
    """Runs one child (or torchrun and its workers) in a session of its own, so that a timeout
    kills all of them and no worker is left holding GPU memory. Returns the exit code or "timeout"."""
    with subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True) as process:
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return "timeout"


def fsdp_label(r):
    """How a result was sharded: "" (not), "FSDP", or "FSDP, fake world N" (--fake-world)."""
    if not r.get("fsdp"):
        return ""
    return f"FSDP, fake world {r['fake_world']}" if r.get("fake_world") else "FSDP"


def one_line(r):
    rank = f" rank {r['rank']}" if r.get("fsdp") else ""
    if r.get("status") == "error":
        return f"{r['allocator']}{rank}: ERROR {r.get('error', '')[:300]}"
    gb = lambda k: f"{r[k] / GB:.2f}" if r.get(k) is not None else "-"  # noqa: E731
    util = f"{r['utilization']:.3f}" if r.get("utilization") else "-"
    step = f"{r['median_step_s']:.3f}" if r.get("median_step_s") else "-"
    oom = f" OOM at step {r.get('oom_step')}" if r.get("status") == "oom" else ""
    return (f"{r['allocator']}{rank}: active {gb('peak_active_bytes')} GB, reserved {gb('peak_reserved_bytes')} GB, "
            f"util {util}, device used over base {gb('device_used_peak_over_base_bytes')} GB, step {step} s{oom}")


# ---------------------------------------------------------------------------------------------
# replaying the recorded traces (glake-replay's peak against the GPU's, within 2%)
# ---------------------------------------------------------------------------------------------


def trace_of(r, trace_dir=None):
    """The trace file a glake run wrote, where it is now: its recorded path, else the same name
    (plain or .gz) in `trace_dir`."""
    pattern = r.get("trace")
    if not pattern:
        return None
    path = pattern.replace("%d", str(r.get("device", 0)))
    places = [path] + ([os.path.join(trace_dir, os.path.basename(path))] if trace_dir else [])
    for place in places:
        for candidate in (place, place + ".gz"):
            if os.path.isfile(candidate):
                return candidate
    return None


def attach_replays(results, replay, trace_dir=None):
    """Replays each glake run's trace with `glake-replay -a glake` under the settings it ran with
    and adds replay_peak_reserved_bytes and replay_ratio (replayed / measured peak reserved)."""
    for r in results:
        if r.get("allocator") != "glake" or r.get("status") == "error":
            continue
        path = trace_of(r, trace_dir)
        if path is None:
            continue
        command = [replay, "--json", "--quiet", "-a", "glake", path]
        if r.get("glake_settings"):
            command[1:1] = ["--glake-conf", r["glake_settings"]]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            r["replay_error"] = run.stderr.strip()[:500]
            continue
        replayed = json.loads(run.stdout.splitlines()[0])
        r["replay_trace"] = path
        r["replay_peak_reserved_bytes"] = replayed["peak_reserved_bytes"]
        r["replay_recorded_peak_reserved_bytes"] = replayed.get("recorded_peak_reserved_bytes")
        if r.get("peak_reserved_bytes"):
            r["replay_ratio"] = replayed["peak_reserved_bytes"] / r["peak_reserved_bytes"]


# ---------------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------------


def shown_run(runs):
    """Of an allocator's runs of one workload (several with --repeat), the one whose memory the
    table shows: the largest peak reserved among those that finished, else the last run."""
    if not runs:
        return None
    ok = [r for r in runs if r.get("status") == "ok"]
    return max(ok, key=lambda r: r.get("peak_reserved_bytes") or 0) if ok else runs[-1]


def median_steps(runs):
    """Each finished run's median step, in run order."""
    return [r["median_step_s"] for r in runs or [] if r.get("status") == "ok" and r.get("median_step_s")]


def markdown(results, command):
    """One row per workload (and rank), one group of columns per allocator, then the targets.
    With repeated runs, memory columns show each allocator's largest peak reserved (and that run's
    other numbers), the step column the median of the runs' medians, and the step target the
    pairs' geometric mean with its 95% interval (tools/analysis/steptime_pairs.py)."""
    rows = {}
    for r in results:
        key = (r["model"], r["strategy"], fsdp_label(r), r.get("rank", 0))
        rows.setdefault(key, {}).setdefault(r["allocator"], []).append(r)
    allocators = [a for a in ALLOCATORS if any(a in v for v in rows.values())]
    first = next((r for r in results if r.get("gpu")), {})
    lines = [
        "# End-to-end fine-tuning: PyTorch's default allocator, expandable_segments and glake",
        "",
        f"GPU: {first.get('gpu', '?')}; torch {first.get('torch_version', '?')}, transformers "
        f"{first.get('transformers_version', '?')}. Method: bench/torch/finetune.py's docstring (bf16, batch {BATCH}, "
        f"sequence length uniform in {MIN_LEN}..{MAX_LEN} per step, AdamW, each run its own process).",
        "",
        "Command:",
        "",
        f"    {command}",
        "",
        "Peak active: torch.cuda.max_memory_allocated (default, expandable), glake's requested-bytes peak. Reserved: "
        "max_memory_reserved, glake's own. util = active / reserved. Device: peak of cudaMemGetInfo's used memory "
        "(sampled after forward, backward and optimizer step) minus its value right after CUDA init. Step: median "
        "of steps 3..N. With repeated runs: the largest peak reserved of each allocator's runs, the median of "
        "their median steps (and their count), and the step target over the runs paired in order.",
        "",
    ]
    header = ["workload"]
    for a in allocators:
        header += [f"{a}: active GB", f"{a}: reserved GB", f"{a}: util", f"{a}: device GB", f"{a}: step s"]
    targets = "glake" in allocators
    if targets:
        header += ["reserved ≤ expandable", "util ≥ 0.97", "step ≤ 1.02× default"]
    replays = any("replay_ratio" in r for r in results)
    if replays:
        header += ["glake replayed GB", "replay within 2%"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def cell(r, key, scale=GB, digits=2):
        if r is None:
            return "-"
        if r.get("status") == "error":
            return "error"
        value = r.get(key)
        if value is None:
            return "-"
        text = f"{value / scale:.{digits}f}"
        return text + (" (OOM)" if r.get("status") == "oom" and key == "peak_reserved_bytes" else "")

    for (model, strategy, fsdp, rank), by in sorted(rows.items()):
        name = f"{model} {strategy}" + (f" {fsdp} rank {rank}" if fsdp else "")
        row = [name]
        for a in allocators:
            r = shown_run(by.get(a))
            steps = median_steps(by.get(a))
            step = cell(r, "median_step_s", 1, 3) if len(steps) < 2 else f"{statistics.median(steps):.3f} ({len(steps)} runs)"
            row += [cell(r, "peak_active_bytes"), cell(r, "peak_reserved_bytes"), cell(r, "utilization", 1, 3),
                    cell(r, "device_used_peak_over_base_bytes"), step]
        if targets:
            row += check_targets(by)
        if replays:
            g = shown_run(by.get("glake")) or {}
            if "replay_ratio" in g:
                ratio = g["replay_ratio"]
                row += [f"{g['replay_peak_reserved_bytes'] / GB:.2f}", f"{'yes' if abs(ratio - 1) <= 0.02 else 'NO'} ({ratio:.3f})"]
            else:
                row += ["-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def analysis_module(name):
    """A module of tools/analysis (shared with this script's reports), imported once."""
    directory = os.path.join(ROOT, "tools", "analysis")
    if directory not in sys.path:
        sys.path.insert(0, directory)
    import importlib

    return importlib.import_module(name)


def check_targets(by):
    """The three target cells of one row; `by` maps an allocator to its runs of the workload."""
    def good(r):
        return r is not None and r.get("status") == "ok"

    g, e, d = (shown_run(by.get(a)) for a in ("glake", "expandable", "default"))
    out = []
    if good(g) and good(e):
        ratio = g["peak_reserved_bytes"] / e["peak_reserved_bytes"]
        out.append(f"{'yes' if ratio <= 1 else 'NO'} ({ratio:.3f})")
    else:
        out.append("-")
    out.append(f"{'yes' if g['utilization'] >= 0.97 else 'NO'} ({g['utilization']:.3f})" if good(g) else "-")
    pairs = [x / y for x, y in zip(median_steps(by.get("glake")), median_steps(by.get("default")))]
    if len(pairs) == 1:
        out.append(f"{'yes' if pairs[0] <= 1.02 else 'NO'} ({pairs[0]:.3f})")
    elif pairs:
        steptime_pairs = analysis_module("steptime_pairs")
        geo, (low, high) = steptime_pairs.ratio_interval(pairs)
        out.append(f"{steptime_pairs.verdict((low, high))} ({geo:.3f}, 95% {low:.3f}-{high:.3f}, {len(pairs)} pairs)")
    else:
        out.append("-")
    return out


def parse(argv):
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Runs: every model x strategy x allocator, allocators innermost, each in its own process.",
    )
    csv = lambda choices: lambda text: check_list(text, choices)  # noqa: E731
    parser.add_argument("--models", type=csv(MODELS), default=list(TRAINING_MODELS),
                        help=f"comma-separated: {','.join(MODELS)} (default: {','.join(TRAINING_MODELS)})")
    parser.add_argument("--strategies", type=csv(STRATEGIES), default=list(TRAINING_STRATEGIES),
                        help=f"comma-separated: {','.join(STRATEGIES)} (default: {','.join(TRAINING_STRATEGIES)}; "
                        "G*: inference, bench/torch/inference.py)")
    parser.add_argument("--allocators", type=csv(ALLOCATORS + CONTROL_ALLOCATORS), default=list(ALLOCATORS),
                        help="comma-separated: default,expandable,glake (default: all), or the control sizecache")
    parser.add_argument("--steps", type=int, default=14, help="training steps (default 14; step time is the median of 3..N)")
    parser.add_argument("--glake-host-timing", action="store_true",
                        help="glake runs also report the host time spent in glake's calls per step (GLAKE_HOST_TIMING=1)")
    parser.add_argument("--allocator-timing", action="store_true",
                        help="every run wraps its CUDA allocator (PyTorch's, or glake behind the pluggable interface) in "
                        "bench/torch/allocator_timing.cpp and reports the host time in its calls per step "
                        "(step_allocator_ms, step_allocator_calls); build it with build_plugin.sh --allocator-timing")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every run, allocator order reversed in odd rounds (default 1)")
    parser.add_argument("--out", help="append one JSON object per run (per rank) to this file")
    parser.add_argument("--markdown", help="write the results table (with the target checks) to this file")
    parser.add_argument("--trace-dir", help="glake runs record their requests here (GLAKE_TRACE) for glake-replay")
    parser.add_argument("--glake-conf", help="GLAKE_ALLOC_CONF for glake runs (default: the plug-in's defaults)")
    parser.add_argument("--fsdp", type=int, default=0, metavar="N", help="run each under torchrun with N processes, FSDP2")
    parser.add_argument("--fake-world", type=int, default=0, metavar="N",
                        help="one process per run, as rank 0 of an N-rank FSDP2 group on PyTorch's fake process group, whose "
                        "collectives only write their outputs as if every rank held rank 0's data: rank 0's allocations and "
                        "streams on one GPU, without communication (a proxy for --fsdp N on a machine with one GPU; results "
                        "carry fake_world)")
    parser.add_argument("--timeout", type=float, default=540, help="seconds per run before it is killed (default 540)")
    parser.add_argument("--budget", type=float, help="start no new run after this many seconds (for command time limits)")
    parser.add_argument("--log-dir", help="where each run's output goes (default: a temporary directory)")
    parser.add_argument("--summarize", metavar="JSONL", help="no runs: read results from JSONL and write --markdown")
    parser.add_argument("--replay", metavar="GLAKE_REPLAY", help="replay glake runs' traces with this glake-replay "
                        "(after the runs, or with --summarize; traces looked up in --trace-dir too) and report the ratio")
    # child mode
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--strategy", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--allocator", choices=ALLOCATORS + CONTROL_ALLOCATORS, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--profile-steps", type=step_list, default=[], metavar="K,...",
                        help="after the measured steps, run one more step with step K's length under torch.profiler, "
                        "for each K, and write its Chrome trace to --profile-dir")
    parser.add_argument("--cpus", type=cpu_list, metavar="LIST",
                        help="run each child on these CPUs only, e.g. 0,2,4-6 (the same for every allocator)")
    parser.add_argument("--profile-dir", help="where --profile-steps' traces go (default: --log-dir)")
    parser.add_argument("--progress", action="store_true", help="children print every step on stderr")
    parser.add_argument("--gc-outside-steps", action="store_true",
                        help="Python's cyclic garbage collector runs between steps, outside their clocks, not during them")
    parser.add_argument("--host-probe", action="store_true",
                        help="after every step, outside its clock, time fixed host work no allocator serves "
                        "(step_probe_s: python, dispatch, launch, memcpy) to measure the process's host speed")
    args = parser.parse_args(argv)
    if args.child and not (args.model and args.strategy and args.allocator):
        parser.error("--child needs --model, --strategy and --allocator")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.fake_world and (args.fsdp or args.fake_world < 2):
        parser.error("--fake-world needs N >= 2 and no --fsdp")
    if args.profile_steps and not (args.profile_dir or args.log_dir):
        parser.error("--profile-steps needs --profile-dir or --log-dir")
    args.profile_dir = args.profile_dir or args.log_dir
    if args.profile_dir:
        args.profile_dir = os.path.abspath(args.profile_dir)
    return args


def step_list(text):
    try:
        steps = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        steps = []
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give step numbers from 1, comma-separated")
    return steps


def cpu_list(text):
    cpus = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        cpus = set()
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give CPU numbers, e.g. 0,2,4-6")
    return sorted(cpus)


def check_list(text, choices):
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in choices]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{','.join(bad) or 'nothing'}: choose from {','.join(choices)}")
    return items


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.child:
        return child(args)
    command = "python3 bench/torch/finetune.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if args.summarize:
        with open(args.summarize) as f:
            results = [json.loads(line) for line in f if line.strip()]
        command = results[0].get("driver_command", command) if results else command
    else:
        results = drive(args, command)
    if args.replay:
        attach_replays(results, args.replay, args.trace_dir)
        for r in results:
            if "replay_ratio" in r or "replay_error" in r:
                rank = f" rank {r['rank']}" if r.get("fsdp") else ""
                print(f"replay {r['model']} {r['strategy']}{rank}: " + (f"{r['replay_ratio']:.4f} of the measured peak reserved"
                      if "replay_ratio" in r else r["replay_error"]), file=sys.stderr)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results, command))
        print(f"wrote {args.markdown}", file=sys.stderr)
    failed = [r for r in results if r.get("status") == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

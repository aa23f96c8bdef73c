#!/usr/bin/env python3
"""Several LoRA fine-tuning processes on one GPU whose peaks together exceed the device, sharing
one budget through the glake-budget coordinator (docs/scheduling.md, "Several processes").

The workload: finetune.py's models (default llama1b, TinyLlama 1.1B shape) built from their
configs with random weights in bf16, LoRA r16 (peft) with gradient checkpointing (finetune.py's
"LR"), batch --batch, sequence lengths drawn from 64..1024, AdamW on the adapters. Workload k uses
seed 1234 + k for its weights, lengths and tokens.

Phases, each workload a process of its own:

  solo       each workload alone (glake as PyTorch's allocator, no scheduler), one after the other:
             the serial baseline, and each one's peak device memory: the allocator's peak
             reserved bytes plus the most in use outside it (cudaMemGetInfo less the allocator's
             reserved, sampled after the forward pass, the backward pass and the optimizer step
             of every step), less what the device held before it started
  together   all started at once, the device cut to --fraction of the summed solo peaks by an
             allocation of this driver's (the filler); each runs glake_torch.Scheduler over its
             frozen weights (socket = the coordinator's, moves = --moves)
  staggered  the same, workload k started --stagger seconds after workload k-1
  default    all started at once on the same cut device with PyTorch's default allocator and no
             scheduler: out of memory expected
  unlimited  all started at once on the whole device (before the cut), glake as the allocator and no
             scheduler: what running together gains with no memory limit (the ceiling)
  partitioned  all started at once on the cut device, each with a scheduler of its own and a local
             budget of budget / workloads (no coordinator): a static split of the same budget

The coordinator's budget covers what the schedulers manage (the frozen weights of >= 2 MiB); the
rest of each process (CUDA context, activations, adapters, optimizer) is outside it. So it is the
cut device less each workload's solo peak of the rest, less --margin:

  budget = fraction x sum(peak_k) - sum(peak_k - managed_k) - margin

Reported: per phase, each workload's status, step times (median, p10-p90), losses (equal to its
solo run's, step by step), its scheduler's counters; combined throughput (all steps over the time
from the first step's start to the last step's end; serial: over the sum of the solo runs' times)
and its ratio to serial; per-step stall (a step's time over the same workload's solo median).
Rounds (--rounds) alternate the order of the solo runs and of the shared phases. A phase named
with "+b" (e.g. together+b) runs as the phase without it, its processes' GLAKE_ALLOC_CONF
extended by --conf-b: an A/B of an allocator setting against the same solo baseline.

    python3 bench/torch/share_budget.py --library build/torch/libglake_torch.so \\
        --budget-tool build/release/tools/glake-budget --workloads 2 --fraction 0.75 --steps 30
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "integrations", "torch"))
sys.path.insert(0, HERE)
GiB = 1 << 30
MiB = 1 << 20
SEED = 1234
MIN_LEN, MAX_LEN = 64, 1024


def child(args):
    if args.deterministic:  # cuBLAS's reproducible workspaces: equal inputs give equal losses
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    glake_torch = None
    if args.allocator == "glake":
        import glake_torch

        glake_torch.enable(library=args.library)
    import random

    import torch
    import transformers
    import peft
    from finetune import CONFIG_CLASSES, MODELS

    import warnings

    caught = warnings.catch_warnings(record=True)
    seen_warnings = caught.__enter__()
    warnings.simplefilter("always")
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    result = {"workload": args.workload, "phase": args.phase, "allocator": args.allocator, "status": "ok"}
    seed = SEED + args.workload
    samples = []

    outside = []  # device memory in use that the allocator does not hold (context, modules, ...)

    def sample():
        free, total = torch.cuda.mem_get_info()
        samples.append(total - free)
        if glake_torch is not None:
            outside.append(total - free - glake_torch.stats()["reserved_bytes"])

    try:
        spec = dict(MODELS[args.model])
        config = getattr(transformers, CONFIG_CLASSES[spec.pop("kind")])(**spec)
        config.use_cache = False
        # Built on the CPU (the same weights in every phase), then brought to the device: whole,
        # or under a scheduler one parameter at a time within the budget.
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.bfloat16)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=args.attention)
        torch.set_default_dtype(torch.float32)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                           task_type="CAUSAL_LM"))
        model.train()
        result["managed_bytes"] = sum(p.untyped_storage().nbytes() for p in model.parameters()
                                      if p.untyped_storage().nbytes() >= 2 * MiB)
        scheduler = None
        scheduling_s = [0.0]  # host time in the scheduler's hooks
        if args.socket or args.local:
            scheduler = glake_torch.Scheduler(args.budget, socket=args.socket or None,
                                              name=f"finetune-{args.workload}", moves=args.moves)
            will_use = scheduler.will_use

            def timed_will_use(tensors):
                t0 = time.perf_counter()
                will_use(tensors)
                scheduling_s[0] += time.perf_counter() - t0

            scheduler.will_use = timed_will_use
            # The recomputation of each checkpointed layer runs its forward pre-hooks right
            # before its backward; "outputs" declares the backward's own uses too (needed with
            # far_unmapped, where memory away is not mapped).
            result["managed_tensors"] = scheduler.attach(model, backward=args.backward,
                                                         read_only=None if args.read_only == "none" else args.read_only)
        model.to("cuda")
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        rng = random.Random(seed)
        lengths = [rng.randint(MIN_LEN, MAX_LEN) for _ in range(args.steps)]
        generator = torch.Generator(device="cuda")
        generator.manual_seed(seed)
        sample()
        starts, ends, losses, hook_s = [], [], [], []
        driver0 = glake_torch.stats() if glake_torch is not None else {}
        for length in lengths:
            torch.cuda.synchronize()
            starts.append(time.time())
            ids = torch.randint(0, config.vocab_size, (args.batch, length), device="cuda", generator=generator)
            loss = model(input_ids=ids, labels=ids).loss
            sample()
            loss.backward()
            sample()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            sample()
            torch.cuda.synchronize()
            ends.append(time.time())
            hook_s.append(scheduling_s[0])
        result.update(starts=starts, ends=ends, losses=losses,
                      scheduling_ms=[(b - a) * 1e3 for a, b in zip([0.0] + hook_s, hook_s)])
        if glake_torch is not None:  # the allocator's host time in driver calls over the steps
            driver1 = glake_torch.stats()
            result["driver_ms"] = {(k[len("driver_"):-3] or "all"): (driver1[k] - driver0.get(k, 0)) / 1e6
                                   for k in driver1 if k.startswith("driver_") and k.endswith("_ns")}
            result["recycled_handles"] = driver1.get("recycled_handles", 0) - driver0.get("recycled_handles", 0)
            result["driver_creates"] = driver1.get("driver_create", 0) - driver0.get("driver_create", 0)
            result["moves"] = {k: driver1[k] - driver0.get(k, 0) for k in driver1
                               if k.startswith(("offload_", "prefetch_"))}
        if scheduler is not None:
            result["scheduler"] = scheduler.stats()
            result["far_copy_bytes"] = glake_torch.far_copy_bytes()
            scheduler.close()
        if glake_torch is not None:
            s = glake_torch.stats()
            result["peak_reserved_bytes"] = s["peak_reserved_bytes"]
            result["peak_active_bytes"] = s["peak_active_bytes"]
    except torch.OutOfMemoryError as e:
        result.update(status="oom", error=str(e)[:400])
    except RuntimeError as e:
        text = str(e)
        result.update(status="oom" if "out of memory" in text.lower() else "error",
                      error=text if len(text) <= 800 else text[:400] + " ... " + text[-400:])
    if glake_torch is not None:  # where the memory was at the end (or at the failure)
        s = glake_torch.stats()
        result["glake_gib"] = {k: s[k] / GiB for k in ("reserved_bytes", "active_bytes", "offloaded_bytes",
                                                       "peak_reserved_bytes") if k in s}
    result["warnings"] = sorted({str(w.message)[:300] for w in seen_warnings})
    result["peak_used_bytes"] = max(samples) if samples else None
    result["peak_outside_bytes"] = max(outside) if outside else None
    with open(args.result_file, "w") as f:
        json.dump(result, f)


def launch(args, k, phase, allocator, result_file, socket=None, budget=0):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--workload", str(k), "--phase", phase,
           "--allocator", allocator, "--result-file", result_file, "--library", args.library,
           "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps), "--moves", args.moves,
           "--backward", args.backward, "--attention", args.attention, "--read-only", args.read_only]
    cmd += ["--deterministic"] if args.deterministic else []
    if socket:
        cmd += ["--socket", socket, "--budget", str(budget)]
    elif budget:
        cmd += ["--local", "--budget", str(budget)]
    env = dict(os.environ)
    if phase.endswith("+b") and args.conf_b:
        env["GLAKE_ALLOC_CONF"] = ",".join(x for x in (env.get("GLAKE_ALLOC_CONF", ""), args.conf_b) if x)
    if allocator == "default":
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    log = open(result_file + ".log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log


def collect(process, log, result_file, k, phase, timeout):
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log.close()
    try:
        with open(result_file) as f:
            result = json.load(f)
    except (OSError, ValueError):
        with open(result_file + ".log") as f:
            tail = f.read()[-1500:]
        result = {"workload": k, "phase": phase, "status": f"exit {process.returncode}", "error": tail}
    # Progress as each process ends, so that a run stopped by a time limit still says how far it got.
    print(f"share_budget: {phase} workload {k}: {result.get('status')}", file=sys.stderr, flush=True)
    return result


def run_phase(args, phase, allocator, work, socket=None, budget=0, stagger=0.0):
    running = []
    for k in range(args.workloads):
        if k and stagger:
            time.sleep(stagger)
        result_file = os.path.join(work, f"{phase}-{k}-{time.monotonic_ns()}.json")
        running.append((k, result_file) + launch(args, k, phase, allocator, result_file, socket, budget))
    return [collect(p, log, f, k, phase, args.timeout) for k, f, p, log in running]


WARMUP = 2  # steps left out of step-time medians (the first allocations, cuBLAS set-up)


def steps_ms(r):
    return [(e - s) * 1e3 for s, e in zip(r["starts"], r["ends"])][WARMUP:]


def summary(runs, solo_median):
    """Combined steps per second, per-workload medians, stall and loss checks of one shared phase."""
    ok = [r for r in runs if r["status"] == "ok"]
    out = {"status": [r["status"] for r in runs], "glake_gib": [r.get("glake_gib") for r in runs]}
    if len(ok) != len(runs):
        out["errors"] = [r.get("error", "")[:600] for r in runs if r["status"] != "ok"]
        return out
    first = min(r["starts"][0] for r in ok)
    last = max(r["ends"][-1] for r in ok)
    steps = sum(len(r["starts"]) for r in ok)
    out["steps_per_s"] = steps / (last - first)
    out["wall_s"] = last - first
    out["median_step_ms"] = [statistics.median(steps_ms(r)) for r in ok]
    stall = []
    for r in ok:
        stall += [t - solo_median[r["workload"]] for t in steps_ms(r)]
    stall.sort()
    out["stall_ms"] = {"median": statistics.median(stall), "p90": stall[len(stall) * 9 // 10]}
    out["scheduler"] = [r.get("scheduler") for r in ok]
    return out


def shared_summary(runs, solo_median, rnd, solo_losses):
    """summary() of a phase under a budget, with the losses against the solo runs', the memory and
    the host time in the scheduler's hooks and in driver calls per timed step."""
    s = summary(runs, solo_median)
    if "steps_per_s" not in s:
        return s
    s["vs_serial"] = s["steps_per_s"] / rnd["serial_steps_per_s"]
    s["losses_equal_solo"] = [x["losses"] == solo_losses[x["workload"]] for x in runs]
    s["losses"] = [x["losses"] for x in runs]
    s["warnings"] = sorted({w for x in runs for w in x.get("warnings", [])})
    s["max_loss_diff"] = max(abs(a - b) for x in runs for a, b in zip(x["losses"], solo_losses[x["workload"]]))
    s["peak_reserved_gib"] = [x.get("peak_reserved_bytes", 0) / GiB for x in runs]
    s["reliefs"] = [x["scheduler"].get("reliefs") for x in runs]
    # The whole device at its fullest, seen from each process (the filler included).
    s["device_used_peak_gib"] = [x["peak_used_bytes"] / GiB for x in runs]
    s["scheduling_ms_median"] = [statistics.median(x["scheduling_ms"][WARMUP:]) for x in runs]
    steps = len(runs[0]["starts"])
    s["recycled_per_step"] = [round(x.get("recycled_handles", 0) / steps, 1) for x in runs]
    s["creates_per_step"] = [round(x.get("driver_creates", 0) / steps, 1) for x in runs]
    # Per move kind: moves, driver calls, handles made / reused / handed over, host ms.
    s["moves_per_step"] = [{k.replace("_host_ns", "_host_ms"): round(v / steps / (1e6 if k.endswith("_ns") else 1), 1)
                            for k, v in x.get("moves", {}).items()} for x in runs]
    s["driver_ms_per_step"] = [{k: round(v / steps, 1) for k, v in x.get("driver_ms", {}).items() if v / steps >= 1}
                               for x in runs]
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--library", required=True)
    ap.add_argument("--budget-tool", help="glake-budget (needed unless --child)")
    ap.add_argument("--model", default="llama1b")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workloads", type=int, default=2)
    ap.add_argument("--fraction", type=float, default=0.75)
    ap.add_argument("--margin", type=float, default=0.5, help="GiB kept out of the budget (default 0.5)")
    ap.add_argument("--stagger", type=float, default=10.0, help="seconds between starts in the staggered phase")
    ap.add_argument("--moves", default="overlapped", choices=("wait", "deferred", "overlapped"))
    ap.add_argument("--backward", default="outputs", type=lambda v: {"true": True, "false": False}.get(v.lower(), v),
                    help="Scheduler.attach's backward: outputs (default), true or false")
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic kernels (torch.use_deterministic_algorithms, cuBLAS workspaces), so that "
                         "losses equal the solo runs' bit for bit unless memory was corrupted")
    ap.add_argument("--attention", default="sdpa", choices=("sdpa", "eager"),
                    help="the models' attention; SDPA's backward kernels are not deterministic, eager's are")
    ap.add_argument("--read-only", default="none", choices=("none", "frozen"),
                    help="frozen: the scheduler manages frozen weights read-only (their offloads copy nothing)")
    ap.add_argument("--phases", default="together,staggered,default")
    ap.add_argument("--conf-b", default="", help="GLAKE_ALLOC_CONF settings added in the phases named <phase>+b")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--allocator", default="glake", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--local", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if not args.budget_tool:
        ap.error("--budget-tool is required")

    import torch

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    used0 = total - free
    work = tempfile.mkdtemp(prefix="share_budget-")
    phases = args.phases.split(",")
    report = {"gpu": torch.cuda.get_device_name(), "model": args.model, "batch": args.batch, "steps": args.steps,
              "workloads": args.workloads, "fraction": args.fraction, "moves": args.moves, "backward": args.backward,
              "read_only": args.read_only,              "deterministic": args.deterministic, "attention": args.attention,
              "alloc_conf": os.environ.get("GLAKE_ALLOC_CONF"), "conf_b": args.conf_b, "rounds": []}
    solo_losses = {}
    for r in range(args.rounds):
        rnd = {"round": r}
        # Solo: the serial baseline and the peaks.
        solo = {}
        order = list(range(args.workloads)) if r % 2 == 0 else list(reversed(range(args.workloads)))
        for k in order:
            result_file = os.path.join(work, f"solo-{k}-{r}.json")
            p, log = launch(args, k, "solo", "glake", result_file)
            solo[k] = collect(p, log, result_file, k, "solo", args.timeout)
        if any(s["status"] != "ok" for s in solo.values()):
            rnd["solo"] = solo
            report["rounds"].append(rnd)
            print(json.dumps(rnd), flush=True)
            break
        # A workload's peak: what the allocator held at its fullest (the sampled use misses the
        # peaks inside a pass) plus the most it ever used outside the allocator, less what was in
        # use before it started; the sampled peak where that is larger.
        peaks = {k: max(s["peak_used_bytes"], s["peak_reserved_bytes"] + s["peak_outside_bytes"]) - used0
                 for k, s in solo.items()}
        rnd["sampled_peak_gib"] = {k: (s["peak_used_bytes"] - used0) / GiB for k, s in solo.items()}
        solo_median = {k: statistics.median(steps_ms(s)) for k, s in solo.items()}
        serial_s = sum(s["ends"][-1] - s["starts"][0] for s in solo.values())
        serial_steps = sum(len(s["starts"]) for s in solo.values())
        for k, s in solo.items():
            solo_losses.setdefault(k, s["losses"])
        cap = int(args.fraction * sum(peaks.values()))
        budget = cap - sum(peaks[k] - solo[k]["managed_bytes"] for k in solo) - int(args.margin * GiB)
        rnd.update(peak_gib={k: v / GiB for k, v in peaks.items()},
                   managed_gib={k: s["managed_bytes"] / GiB for k, s in solo.items()},
                   solo_median_ms=solo_median, serial_steps_per_s=serial_steps / serial_s,
                   solo_glake_gib={k: s.get("glake_gib") for k, s in solo.items()},
                   solo_losses={k: s["losses"] for k, s in solo.items()},
                   solo_warnings=sorted({w for s in solo.values() for w in s.get("warnings", [])}),
                   device_cap_gib=cap / GiB, budget_gib=budget / GiB,
                   # Solo losses against the first round's (the kernels' run-to-run variation);
                   # nothing to compare in the first round.
                   solo_losses_repeat=None if r == 0 else all(s["losses"] == solo_losses[k] for k, s in solo.items()))
        if budget <= 0:
            rnd["error"] = "no budget left for the managed weights"
            report["rounds"].append(rnd)
            print(json.dumps(rnd), flush=True)
            break
        if "unlimited" in phases:  # the whole device: the ceiling of running together
            s = summary(run_phase(args, "unlimited", "glake", work), solo_median)
            if "steps_per_s" in s:
                s["vs_serial"] = s["steps_per_s"] / rnd["serial_steps_per_s"]
            rnd["unlimited"] = s
        # The filler cuts the device to `cap` free bytes.
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        filler = torch.empty(max(free - cap, 0), dtype=torch.uint8, device="cuda")
        rnd["free_after_filler_gib"] = torch.cuda.mem_get_info()[0] / GiB
        for phase in (phases if r % 2 == 0 else list(reversed(phases))):
            kind = phase.removesuffix("+b")  # "+b": the same phase with --conf-b
            if kind == "unlimited":
                continue
            if kind == "default":
                runs = run_phase(args, phase, "default", work)
                rnd[phase] = {"status": [x["status"] for x in runs], "glake_gib": [x.get("glake_gib") for x in runs],
                              "errors": [x.get("error", "")[-200:] for x in runs if x["status"] != "ok"]}
                continue
            if kind == "partitioned":  # a static split: a local budget each, no coordinator
                runs = run_phase(args, phase, "glake", work, None, budget // args.workloads)
                rnd[phase] = shared_summary(runs, solo_median, rnd, solo_losses)
                continue
            socket = os.path.join(work, f"budget-{r}-{phase}.sock")
            coordinator = subprocess.Popen([args.budget_tool, "--socket", socket, "--budget", str(budget), "--quiet"])
            for _ in range(100):
                if os.path.exists(socket):
                    break
                time.sleep(0.05)
            try:
                runs = run_phase(args, phase, "glake", work, socket, budget,
                                 stagger=args.stagger if kind == "staggered" else 0.0)
            finally:
                coordinator.terminate()
                coordinator.wait()
            rnd[phase] = shared_summary(runs, solo_median, rnd, solo_losses)
        del filler
        torch.cuda.empty_cache()
        report["rounds"].append(rnd)
        print(json.dumps(rnd), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

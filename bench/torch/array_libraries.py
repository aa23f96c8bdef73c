"""CuPy, Numba and RMM on the GPU, each once with its own allocator and once through glake
(glake_torch.use_with_cupy, use_with_numba, use_with_rmm), every run in a process of its own:
peak memory (the library's own count, what its pool or glake held, and the device's used memory
from cudaMemGetInfo) and time, with a checksum of the results that must agree between the two.

    python3 bench/torch/array_libraries.py --out DIR      # writes DIR/array_libraries.json and .md

Workloads (sizes drawn from a seeded generator, so both runs of a library do the same work):
  cupy   steps of: an n x n float32 matrix (n from 1024 to 8192), its product with its transpose,
         rfft2 of that, a filter and irfft2, and a 1-D complex FFT of varying length; the last
         results stay alive in a window of 4, one of which is dropped at random each step.
         Own: CuPy's default MemoryPool.
  numba  steps of: three device arrays of 1-64 Mi float32 elements, two fill kernels and a saxpy
         kernel; outputs stay alive in a window of 6. Own: Numba's memory manager (cuMemAlloc,
         deferred frees).
  rmm    the cupy workload with CuPy allocating through RMM (rmm.allocators.cupy); own:
         rmm.mr.PoolMemoryResource over CudaMemoryResource (initial size --rmm-initial-pool),
         RAPIDS' usual setting; both under StatisticsResourceAdaptor for RMM's count. Skipped
         where RMM's Python package does not import.

Numbers: "in use" is the peak of live bytes (CuPy: the pool's used bytes, glake: its
active_bytes, both sampled at each step's end with the step's arrays alive; Numba keeps no count;
RMM: the statistics adaptor's exact peak, for both); "held" is what the pool held at its peak
(CuPy's total_bytes, RMM's pool_size, glake's exact peak_reserved_bytes; the JSON also has
glake's exact peak_active_bytes);
"device" is the device's used memory at its sampled peak minus what was used before the
workload's first step (cudaMemGetInfo; this includes cuFFT plans, cuBLAS workspaces and module
code the same way in both runs). Time is the measured steps' wall time after a warm-up step
(JIT and plan creation), synchronized.

The plug-in is glake_torch.load()'s: build/torch/libglake_torch.so (bench/torch/build_plugin.sh)
or --library / $GLAKE_TORCH_LIBRARY; settings from GLAKE_ALLOC_CONF as always. Exit status: 0
when every run that could run succeeded and checksums agree, 1 otherwise.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "integrations", "torch"))

LIBRARIES = ("cupy", "numba", "rmm")
ALLOCATORS = ("own", "glake")
MiB = 1 << 20


# --- in the child ---------------------------------------------------------------------------------


class Sampler:
    """The device's used memory (cudaMemGetInfo through `mem_info`) and the library's own
    counters, sampled at each step's end; peaks kept."""

    def __init__(self, mem_info, counters):
        self.mem_info, self.counters = mem_info, counters
        free, total = mem_info()
        self.start_used, self.total = total - free, total
        self.peak_used = self.start_used
        self.peaks = {}

    def sample(self):
        free, total = self.mem_info()
        self.peak_used = max(self.peak_used, total - free)
        for name, value in self.counters().items():
            if value is not None:
                self.peaks[name] = max(self.peaks.get(name, 0), value)


def cupy_steps(cp, steps, seed, sampler=None):
    """The cupy workload; returns its checksum."""
    rng = random.Random(seed)
    gen = cp.random.default_rng(seed)
    sizes = (1024, 1536, 2048, 3072, 4096, 5120, 6144, 8192)
    window, checksum = [], 0.0
    for _ in range(steps):
        n = rng.choice(sizes)
        a = gen.standard_normal((n, n), dtype=cp.float32)
        b = (a @ a.T) / n
        f = cp.fft.rfft2(b)
        g = cp.fft.irfft2(f / (1.0 + cp.abs(f)), s=b.shape)
        v = cp.fft.fft(gen.standard_normal(rng.choice((1, 3, 5, 8, 12, 16)) * MiB // 4, dtype=cp.float32))
        window.append(g)
        checksum += float(g[0, :16].sum()) + float(cp.abs(v[:16]).sum())  # synchronizes
        if sampler is not None:
            sampler.sample()
        del a, b, f, v
        if len(window) > 4:
            window.pop(rng.randrange(len(window)))
    cp.cuda.Device().synchronize()
    return checksum


def run_cupy(allocator, steps, seed, library, through_rmm=False, rmm_initial_pool=0):
    import cupy as cp

    result = {}
    stats_mr = None
    if through_rmm:
        import rmm
        from rmm.allocators.cupy import rmm_cupy_allocator

        if allocator == "glake":
            import glake_torch

            upstream = glake_torch.rmm_resource(device=0, library=library)
        else:
            upstream = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=rmm_initial_pool)
        stats_mr = rmm.mr.StatisticsResourceAdaptor(upstream)
        rmm.mr.set_current_device_resource(stats_mr)
        cp.cuda.set_allocator(rmm_cupy_allocator)
        result["rmm_version"] = getattr(rmm, "__version__", "?")
    elif allocator == "glake":
        import glake_torch

        glake_torch.use_with_cupy(library=library)
    cp.cuda.Device(0).use()
    result["device_name"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    result["cupy_version"] = cp.__version__
    pool = cp.get_default_memory_pool()

    def counters():
        if stats_mr is not None:
            counts = stats_mr.allocation_counts
            peak = counts["peak_bytes"] if isinstance(counts, dict) else counts.peak_bytes
            return {"in_use": peak, "held": upstream.pool_size() if allocator == "own" else None}
        if allocator == "own":
            return {"in_use": pool.used_bytes(), "held": pool.total_bytes()}
        return glake_counters()

    cupy_steps(cp, 1, seed + 1)  # warm-up: kernels, cuBLAS, cuFFT plans of one size
    if allocator == "glake":
        import glake_torch

        glake_torch.reset_peak_stats(0)
    sampler = Sampler(cp.cuda.runtime.memGetInfo, counters)
    start = time.perf_counter()
    result["checksum"] = cupy_steps(cp, steps, seed, sampler)
    result["time_s"] = time.perf_counter() - start
    return finish(result, sampler, allocator)


def numba_mem_info(cuda):
    """(free, total) of the current device from the driver (not the context's memory manager,
    which glake's answers with its cache counted as free)."""
    driver = cuda.cudadrv.driver
    if getattr(driver, "USE_NV_BINDING", True):
        free, total = driver.driver.cuMemGetInfo()
        return int(free), int(total)
    import ctypes

    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    driver.driver.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def run_numba(allocator, steps, seed, library):
    if allocator == "glake":
        import glake_torch

        glake_torch.use_with_numba(library=library)  # before Numba makes its context
    import numpy as np

    if not hasattr(np, "row_stack"):
        # numba-cuda registers an overload for np.row_stack, which NumPy 2.4 removed (an alias of
        # vstack); without it `import numba.cuda`'s kernel compilation fails with either allocator.
        np.row_stack = np.vstack
    from numba import cuda

    @cuda.jit
    def fill(x, salt):
        i = cuda.grid(1)
        if i < x.size:
            x[i] = ((i * 2654435761 + salt) % 1000) * 0.001

    @cuda.jit
    def saxpy(out, a, x, y):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = a * x[i] + y[i]

    def steps_of(count, rng, sampler=None):
        window, checksum = [], 0.0
        for step in range(count):
            n = rng.choice((1, 2, 3, 5, 8, 12, 16, 24, 32, 48, 64)) * MiB
            blocks = (n + 255) // 256
            x, y, out = cuda.device_array(n, np.float32), cuda.device_array(n, np.float32), cuda.device_array(n, np.float32)
            fill[blocks, 256](x, step)
            fill[blocks, 256](y, 7 * step + 1)
            saxpy[blocks, 256](out, np.float32(0.5), x, y)
            window.append(out)
            checksum += float(out[:16].copy_to_host().sum())  # synchronizes
            if sampler is not None:
                sampler.sample()
            del x, y
            if len(window) > 6:
                window.pop(rng.randrange(len(window)))
        cuda.synchronize()
        return checksum

    device = cuda.get_current_device()
    name = device.name
    result = {"device_name": name.decode() if isinstance(name, bytes) else str(name)}
    import numba

    result["numba_version"] = numba.__version__
    steps_of(1, random.Random(seed + 1))  # warm-up: JIT
    if allocator == "glake":
        import glake_torch

        glake_torch.reset_peak_stats(0)
    sampler = Sampler(lambda: numba_mem_info(cuda), glake_counters if allocator == "glake" else dict)
    start = time.perf_counter()
    result["checksum"] = steps_of(steps, random.Random(seed), sampler)
    result["time_s"] = time.perf_counter() - start
    return finish(result, sampler, allocator)


def glake_counters():
    """glake's bytes in use now (sampled as the library's own count is)."""
    import glake_torch

    return {"in_use": glake_torch.stats(0)["active_bytes"]}


def finish(result, sampler, allocator):
    result["steps_ms"] = None
    result["device_start_bytes"] = sampler.start_used
    result["device_peak_bytes"] = sampler.peak_used - sampler.start_used
    result["device_total_bytes"] = sampler.total
    result["in_use_peak_bytes"] = sampler.peaks.get("in_use")
    result["held_peak_bytes"] = sampler.peaks.get("held")
    if allocator == "glake":
        import glake_torch

        s = glake_torch.stats(0)
        result["glake"] = {k: s[k] for k in ("peak_active_bytes", "peak_reserved_bytes", "active_bytes",
                                             "reserved_bytes", "allocations", "stitches", "driver_calls",
                                             "failed_allocations", "errors")}
        result["glake_library"] = glake_torch.library_path() if not os.environ.get("GLAKE_TORCH_LIBRARY") else \
            os.environ["GLAKE_TORCH_LIBRARY"]
        result["held_peak_bytes"] = s["peak_reserved_bytes"]
    return result


def child(args):
    if args.library:
        os.environ["GLAKE_TORCH_LIBRARY"] = os.path.abspath(args.library)
    library = os.environ.get("GLAKE_TORCH_LIBRARY")
    if args.child == "cupy":
        result = run_cupy(args.allocator, args.steps, args.seed, library)
    elif args.child == "numba":
        result = run_numba(args.allocator, args.steps, args.seed, library)
    else:
        result = run_cupy(args.allocator, args.steps, args.seed, library, through_rmm=True,
                          rmm_initial_pool=args.rmm_initial_pool)
    print("RESULT " + json.dumps(result), flush=True)


# --- the driver ----------------------------------------------------------------------------------


def importable(name):
    code = f"import {name}"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]


def run_one(library, allocator, args):
    command = [sys.executable, os.path.abspath(__file__), "--child", library, "--allocator", allocator,
               "--steps", str(args.steps), "--seed", str(args.seed), "--rmm-initial-pool", str(args.rmm_initial_pool)]
    if args.library:
        command += ["--library", args.library]
    print("==>", library, allocator, flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"library": library, "allocator": allocator, "ok": False, "error": f"timed out after {args.timeout} s"}
    wall = time.perf_counter() - start
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"library": library, "allocator": allocator, "ok": False,
                "error": f"exit {done.returncode}: {tail}"}
    result = json.loads(lines[-1][len("RESULT "):])
    result.update(library=library, allocator=allocator, ok=True, process_s=wall)
    result["steps_ms"] = 1000.0 * result["time_s"] / args.steps
    return result


def mib(value):
    return "-" if value is None else f"{value / MiB:,.0f}"


WORKLOAD = {"cupy": "matmul + FFT loop", "numba": "fill + saxpy kernels", "rmm": "CuPy loop over RMM"}
OWN = {"cupy": "CuPy MemoryPool", "numba": "Numba (cuMemAlloc)", "rmm": "RMM PoolMemoryResource"}


def markdown(report):
    lines = [
        "# CuPy, Numba and RMM: own allocator against glake",
        "",
        f"Device: {report.get('device_name', '?')}; {report['steps']} steps per run, seed {report['seed']}; "
        f"`{report['command']}`.",
        "",
        "| library | workload | round | allocator | in use, peak (MiB) | held, peak (MiB) | device used, peak (MiB) | step (ms) | checksum |",
        "|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in report["runs"]:
        name = OWN.get(r["library"], "own") if r["allocator"] == "own" else "glake"
        if not r.get("ok"):
            lines.append(f"| {r['library']} | {WORKLOAD.get(r['library'], '')} | {r.get('round', 0)} | {name} | "
                         f"{r.get('error') or r.get('skipped')} | | | | |")
            continue
        lines.append(f"| {r['library']} | {WORKLOAD[r['library']]} | {r.get('round', 0)} | {name} | "
                     f"{mib(r.get('in_use_peak_bytes'))} | "
                     f"{mib(r.get('held_peak_bytes'))} | {mib(r.get('device_peak_bytes'))} | {r['steps_ms']:.2f} | "
                     f"{r['checksum']:.6g} |")
    lines += ["", "In use: the peak of live bytes (CuPy's pool and glake sampled at each step's end; RMM's "
              "statistics adaptor exact, for both; Numba keeps no count). Held: what the pool (or glake, "
              "exactly: peak_reserved_bytes) held at its peak. "
              "Device used: cudaMemGetInfo's used memory at its sampled peak over the start of the measured "
              "steps. Step: mean wall time of a measured step."]
    for problem in report["problems"]:
        lines.append(f"\n**{problem}**")
    return "\n".join(lines) + "\n"


def compare(runs):
    """Problems: failed runs, checksums that differ between the two runs of a library."""
    problems = []
    for r in runs:
        if not r.get("ok") and not r.get("skipped"):
            problems.append(f"{r['library']} with {r['allocator']} failed: {r['error']}")
    for library in dict.fromkeys(r["library"] for r in runs):
        ok = [r for r in runs if r["library"] == library and r.get("ok")]
        for r in ok[1:]:
            a, b = ok[0]["checksum"], r["checksum"]
            if abs(a - b) > 1e-4 * max(1.0, abs(a)):
                problems.append(f"{library}: checksums differ ({a!r} {ok[0]['allocator']}, {b!r} {r['allocator']} "
                                f"in round {r.get('round', 0)})")
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for array_libraries.json and array_libraries.md")
    parser.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated, of cupy,numba,rmm")
    parser.add_argument("--steps", type=int, default=60, help="measured steps per run (default 60)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--library", help="libglake_torch.so (default: glake_torch.load's search)")
    parser.add_argument("--rmm-initial-pool", type=int, default=0,
                        help="bytes RMM's own pool starts with (default 0: it grows as asked)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of each library's pair, the order alternating (default 2)")
    parser.add_argument("--child", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--allocator", choices=ALLOCATORS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if not args.out:
        parser.error("--out is required")
    libraries = [name for name in args.libraries.split(",") if name]
    unknown = [name for name in libraries if name not in LIBRARIES]
    if unknown:
        parser.error(f"unknown libraries {unknown}: choose from {', '.join(LIBRARIES)}")
    runs = []
    for library in libraries:
        needs = {"cupy": "cupy", "numba": "numba.cuda", "rmm": "rmm"}[library]
        missing = importable(needs) or (importable("cupy") if library == "rmm" else None)
        if missing:
            print(f"==> {library}: skipped ({missing})", flush=True)
            for allocator in ALLOCATORS:
                runs.append({"library": library, "allocator": allocator, "ok": False, "skipped": f"not importable: {missing}"})
            continue
        for r in range(args.rounds):  # the order alternates between rounds (caches warmed by the first)
            for allocator in (ALLOCATORS if r % 2 == 0 else tuple(reversed(ALLOCATORS))):
                run = run_one(library, allocator, args)
                run["round"] = r
                runs.append(run)
    report = {"command": " ".join(["python3", "bench/torch/array_libraries.py"] + (argv or sys.argv[1:])),
              "steps": args.steps, "seed": args.seed, "runs": runs, "problems": compare(runs),
              "device_name": next((r["device_name"] for r in runs if r.get("device_name")), None)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "array_libraries.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(os.path.join(args.out, "array_libraries.md"), "w") as f:
        f.write(text)
    print(text)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())

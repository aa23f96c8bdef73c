"""The plug-in inside PyTorch on a real GPU: out of memory as torch.cuda.OutOfMemoryError and
training going on after it, torch.cuda.set_per_process_memory_fraction, and torch.cuda's own
statistics functions answering from glake after use_in_torch_cuda(). Each check runs in a process
of its own (enable() must come before CUDA is touched).

    python3 integrations/torch/tests/torch_gpu_checks.py [LIBRARY]

LIBRARY defaults to what glake_torch finds (bench/torch/build_plugin.sh builds it, against torch's
libc10 where torch imports: then out of memory is torch.cuda.OutOfMemoryError; a plug-in built
without torch raises RuntimeError, and that check says so). Exit 77 (skipped) without torch or a
GPU; 1 if a check fails.
"""

import json
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIR = os.path.dirname(HERE)

PRELUDE = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {package!r})
    import glake_torch
    glake_torch.enable(library={library!r}, pluggable=True)  # the pluggable door (test_native.py: the native one)
    import torch
    """
)

CHECKS = {
    "out of memory is torch.cuda.OutOfMemoryError, and training goes on": """
        model = torch.nn.Linear(1024, 1024, device="cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        def step():
            loss = model(torch.randn(256, 1024, device="cuda")).square().mean()
            loss.backward(); opt.step(); opt.zero_grad()
            return loss.item()
        step()
        hog, caught = [], None
        try:
            while True:
                hog.append(torch.empty(8 << 30, dtype=torch.uint8, device="cuda"))
        except Exception as e:
            caught = e
        del hog
        loss = step()
        assert isinstance(caught, torch.cuda.OutOfMemoryError), f"{type(caught).__name__}: {caught}"
        assert "out of memory" in str(caught) and "reserved" in str(caught), str(caught)
        assert glake_torch.memory_stats()["num_ooms"] == 1
        print(json.dumps({"message": str(caught)[:200], "loss_after": loss}))
    """,
    "set_per_process_memory_fraction limits glake and is lifted again": """
        assert glake_torch.hooks().get("memory_fraction") == "set_memory_fraction_fn", glake_torch.hooks()
        # 4 GiB of whatever the device has: 3 GiB fit, 2 more do not.
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction((4 << 30) / total)
        a = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
        try:
            torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
            raise AssertionError("a tensor past the fraction was allocated")
        except RuntimeError as e:
            assert "memory limit" in str(e), str(e)
        torch.cuda.set_per_process_memory_fraction(1.0)
        c = torch.empty(10 << 30, dtype=torch.uint8, device="cuda")
        del a, c
        torch.cuda.set_per_process_memory_fraction(0.01)
        assert glake_torch.stats()["reserved_bytes"] < 0.01 * torch.cuda.get_device_properties(0).total_memory
        print(json.dumps({"ok": True}))
    """,
    "torch.cuda's statistics answer from glake after use_in_torch_cuda()": """
        x = torch.empty(10 << 20, dtype=torch.uint8, device="cuda")
        try:
            torch.cuda.max_memory_allocated()
            raise AssertionError("PyTorch answered by itself; the check would prove nothing")
        except RuntimeError:
            pass
        glake_torch.use_in_torch_cuda()
        y = torch.empty(1000, dtype=torch.uint8, device="cuda")
        peak = torch.cuda.max_memory_allocated()
        assert peak == torch.cuda.memory_allocated() >= (10 << 20) + 1000
        del x
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() == glake_torch.stats()["allocated_bytes"]
        assert torch.cuda.memory_reserved() == glake_torch.stats()["reserved_bytes"] > 0
        assert torch.cuda.memory_stats()["allocation.all.current"] == 1
        print(json.dumps({"peak": peak}))
    """,
}


def main():
    library = sys.argv[1] if len(sys.argv) > 1 else None
    probe = subprocess.run([sys.executable, "-c", "import torch; print(int(torch.cuda.is_available()))"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        print("torch GPU checks skipped: no torch or no GPU here")
        return 77
    failed = 0
    for name, body in CHECKS.items():
        code = PRELUDE.format(package=PACKAGE_DIR, library=library) + textwrap.dedent(body)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        ok = run.returncode == 0
        failed += not ok
        last = (run.stdout.strip().splitlines() or [""])[-1]
        print(f"{'PASS' if ok else 'FAIL'}: {name} {last}")
        if not ok:
            print("\n".join(l for l in run.stderr.splitlines() if not l.startswith("glake: allocating"))[-3000:])
    print(f"torch GPU checks: {len(CHECKS) - failed} of {len(CHECKS)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

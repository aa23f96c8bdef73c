"""glake as PyTorch's CUDA allocator: enable it, train a small model a few steps, print glake's
statistics.

    pip install torch
    pip install <glake>/integrations/torch     # compiles the plug-in against that torch
    python examples/torch_quickstart.py

Where torch, the plug-in, the NVIDIA driver or a GPU is missing it says which and exits with 77
(skipped, as CTest counts it)."""

import sys

SKIPPED = 77


def skip(why):
    print(f"torch_quickstart skipped: {why}")
    sys.exit(SKIPPED)


def main():
    try:
        import torch
    except ImportError:
        skip("torch is not installed (pip install torch)")
    try:
        import glake_torch
    except ImportError:
        skip("glake_torch is not installed (pip install <glake>/integrations/torch)")

    # First thing, before any tensor is put on the GPU: PyTorch switches allocators only before
    # its own was used.
    try:
        glake_torch.enable()
    except glake_torch.DriverNotFoundError as error:
        skip(str(error))
    except FileNotFoundError as error:  # no libglake_torch.so: glake_torch imported from a checkout
        skip(str(error))
    if not torch.cuda.is_available():
        skip("torch sees no CUDA GPU")
    print(f"glake_torch {glake_torch.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"settings: {glake_torch.settings()}")

    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = torch.randn(64, 1024, device="cuda")
    for step in range(20):
        # Batches of changing size, as sequences of changing length give: the sizes a caching
        # allocator fragments on.
        batch = torch.randn(64 * (1 + step % 4), 1024, device="cuda")
        loss = (model(batch)[:64] - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step in (0, 19):
            print(f"step {step:2d}: loss {loss.item():.4f}")

    stats = glake_torch.stats()
    print(f"peak active {stats['peak_active_bytes'] / 2**20:.1f} MiB, "
          f"peak reserved {stats['peak_reserved_bytes'] / 2**20:.1f} MiB, "
          f"utilization {stats['utilization']:.3f}, stitches {stats['stitches']}, "
          f"driver calls {stats['driver_calls']}")
    torch.cuda.empty_cache()  # gives glake's cached memory back to the driver
    print(f"reserved after empty_cache: {glake_torch.stats()['reserved_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

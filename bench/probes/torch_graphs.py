"""CUDA graphs with glake as PyTorch's allocator: a plain torch.cuda.graph capture and replay, and
torch.compile(mode="reduce-overhead") training steps; prints what each did (integrations/torch/README.md,
"CUDA graphs", records the result on an H100 with torch 2.11). Run from the repository root on a GPU
machine after bench/torch/build_plugin.sh:  python3 bench/probes/torch_graphs.py
"""
import sys, json, traceback
sys.path.insert(0, "integrations/torch")
import glake_torch
glake_torch.enable()
import torch
out = {"torch": torch.__version__}
# 1. torch.cuda.graph capture and replay
try:
    x = torch.randn(1024, 1024, device="cuda")
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x @ x
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x @ x + 1
    g.replay(); torch.cuda.synchronize()
    out["cuda_graph"] = f"ok: replay gives {float(y.sum()):.3g}"
except Exception as e:
    out["cuda_graph"] = f"{type(e).__name__}: {str(e)[:400]}"
    out["cuda_graph_where"] = traceback.format_exc().splitlines()[-4:]
# 2. torch.compile reduce-overhead
try:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cm = torch.compile(model, mode="reduce-overhead")
    for i in range(5):
        loss = cm(torch.randn(64, 256, device="cuda")).square().mean()
        loss.backward(); opt.step(); opt.zero_grad()
    torch.cuda.synchronize()
    out["compile_reduce_overhead"] = f"ok: loss {loss.item():.3g}"
except Exception as e:
    out["compile_reduce_overhead"] = f"{type(e).__name__}: {str(e)[:400]}"
out["raw_allocator_methods"] = [m for m in dir(torch._C._cuda_CUDAAllocator) if not m.startswith("__")] if hasattr(torch._C, "_cuda_CUDAAllocator") else "n/a"
print(json.dumps(out, indent=1))

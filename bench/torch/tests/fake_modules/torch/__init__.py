"""A stand-in for torch with just what bench/torch/finetune.py's child touches, so that its code
path runs without torch or a GPU (tests/test_finetune.py). $FAKE_TORCH_OOM_AT=N makes the
forward pass of step N raise torch.cuda.OutOfMemoryError."""

import contextlib
import ctypes
import os
import types

__version__ = "0.0-fake"
bfloat16, float32 = "bfloat16", "float32"
_default_dtype = [float32]
_steps = [0]


def get_default_dtype():
    return _default_dtype[0]


def set_default_dtype(dtype):
    _default_dtype[0] = dtype


def manual_seed(seed):
    return seed


class device:
    def __init__(self, kind, index=None):
        self.type, self.index = kind, index

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Generator:
    def __init__(self, device=None):
        self.device = device

    def manual_seed(self, seed):
        return self


class Tensor:
    def __init__(self, value=0.0, dtype=bfloat16, numel=1, requires_grad=True):
        self.value, self.dtype, self._numel, self.requires_grad = value, dtype, numel, requires_grad

    def numel(self):
        return self._numel

    def backward(self):
        pass

    def detach(self):
        return self

    def view(self, *shape):
        return Tensor(self.value, self.dtype, self._numel, self.requires_grad)

    def copy_(self, other):
        self.value = other.value
        return self

    def __float__(self):
        return float(self.value)

    def __setitem__(self, index, value):
        pass


class _Matrix(Tensor):
    """A 2-D tensor for the inference path: its shape and row slices (writes ignored)."""

    def __init__(self, rows, columns, dtype=float32):
        super().__init__(0.0, dtype, rows * columns, False)
        self.shape = (rows, columns)


long = "int64"


def ones(n, dtype=float32, device=None):
    if isinstance(n, tuple):
        return _Matrix(*n, dtype=dtype)
    return Tensor(1.0, dtype, n, False)


def zeros(n, dtype=float32, device=None, requires_grad=False):
    return Tensor(0.0, dtype, n, requires_grad)


@contextlib.contextmanager
def inference_mode():
    yield


def empty_like(t):
    return Tensor(0.0, t.dtype, t._numel, False)


def randint(low, high, size, device=None, generator=None):
    return _Matrix(size[0], size[1], dtype="int64")


class OutOfMemoryError(RuntimeError):
    pass


def _forward_step():
    _steps[0] += 1
    if str(_steps[0]) == os.environ.get("FAKE_TORCH_OOM_AT"):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fake)")


class _Plugged:
    def __init__(self, path, alloc_fn_name, free_fn_name):
        lib = ctypes.CDLL(path)
        for name in (alloc_fn_name, free_fn_name):
            if ctypes.cast(getattr(lib, name), ctypes.c_void_p).value is None:
                raise AssertionError(name)
        raw = types.SimpleNamespace(set_reset_fn=lambda ptr: None, set_record_stream_fn=lambda ptr: None)
        self.allocator = lambda: raw


_state = {"initialized": False, "allocator": "native"}


def _change_current_allocator(allocator):
    if _state["initialized"]:
        raise RuntimeError("Can't swap an already initialized allocator")
    _state["allocator"] = allocator


def _init():
    _state["initialized"] = True


GB = 10**9
cuda = types.SimpleNamespace(
    OutOfMemoryError=OutOfMemoryError,
    is_initialized=lambda: _state["initialized"],
    init=_init,
    set_device=lambda d: _init(),
    current_device=lambda: 0,
    synchronize=lambda d=None: None,
    _sleep=lambda cycles: None,
    mem_get_info=lambda d=None: (70 * GB, 80 * GB),
    get_device_name=lambda d=None: "Fake GPU",
    max_memory_allocated=lambda d=None: 3 * GB,
    max_memory_reserved=lambda d=None: 4 * GB,
    memory_stats=lambda d=None: {"requested_bytes.all.peak": 3 * GB - 1, "num_alloc_retries": 0},
    empty_cache=lambda: None,
    memory=types.SimpleNamespace(CUDAPluggableAllocator=_Plugged, change_current_allocator=_change_current_allocator),
)


class _AdamW:
    def __init__(self, params, lr):
        self.params = list(params)

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass


optim = types.SimpleNamespace(AdamW=_AdamW)


@contextlib.contextmanager
def _save_on_cpu(pin_memory=False):
    yield


from . import autograd  # noqa: E402

autograd.graph = types.SimpleNamespace(save_on_cpu=_save_on_cpu)

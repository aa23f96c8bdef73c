"""cupy.fft for the stand-in CuPy: outputs of the right shape and type."""


def rfft2(a):
    import cupy

    return cupy.ndarray((a.shape[0], a.shape[1] // 2 + 1), cupy.complex64)


def irfft2(a, s):
    import cupy

    return cupy.ndarray(s, cupy.float32)


def fft(a):
    import cupy

    return cupy.ndarray(a.shape, cupy.complex64)

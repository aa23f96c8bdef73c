"""cupy.random.default_rng for the stand-in CuPy."""


class _Generator:
    def standard_normal(self, shape, dtype="float32"):
        import cupy

        return cupy.ndarray(shape, dtype)


def default_rng(seed=None):
    return _Generator()

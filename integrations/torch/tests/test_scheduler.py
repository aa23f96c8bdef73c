"""Swap scheduling of the allocator's own blocks through the plug-in's C interface and
glake_torch.Scheduler, without torch or a GPU: libglake_torch_sim.so ($GLAKE_TORCH_SIM_LIBRARY),
whose allocations live on a simulated device with a host tier. Tensors are stood for by
(pointer, bytes) pairs from glake_malloc; attach() is exercised over minimal module objects that
record their hooks.

Run: ctest -R torch_plugin.python (with the other Python tests)."""

import os
import sys
import unittest
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import glake_torch  # noqa: E402

SIM = os.environ.get("GLAKE_TORCH_SIM_LIBRARY")
MiB = 1 << 20


@unittest.skipUnless(SIM and os.path.isfile(SIM), "GLAKE_TORCH_SIM_LIBRARY is not set (run through ctest)")
class SchedulerTest(unittest.TestCase):
    def setUp(self):
        self.lib = glake_torch.load(SIM)
        self.blocks = []

    def tearDown(self):
        for ptr, nbytes in self.blocks:
            if glake_torch.residence(ptr) == "host":
                glake_torch.prefetch(ptr)
            self.lib.glake_free(ptr, nbytes, 0, None)

    def block(self, nbytes):
        ptr = self.lib.glake_malloc(nbytes, 0, None)
        self.assertTrue(ptr)
        self.blocks.append((ptr, nbytes))
        return (ptr, nbytes)

    def on_device(self, blocks):
        return sum(n for p, n in blocks if glake_torch.residence(p) == "device")

    def sweep(self, s, blocks, iterations, stride, budget):
        """Iterations of operations each using block k and block k + stride: every use finds its
        blocks on the device, and the device never holds more of them than the budget."""
        for _ in range(iterations):
            s.iteration_begin()
            for k in range(len(blocks)):
                use = [blocks[k], blocks[(k + stride) % len(blocks)]]
                s.will_use(use)
                for p, _ in use:
                    self.assertEqual(glake_torch.residence(p), "device")
                self.assertLessEqual(self.on_device(blocks), budget)

    def test_blocks_stay_within_the_budget_and_each_use_finds_its_blocks_on_the_device(self):
        blocks = [self.block(8 * MiB) for _ in range(6)]  # 48 MiB under a 24 MiB budget
        s = glake_torch.Scheduler(24 * MiB, device=0, name="sweep")
        for b in blocks:
            self.assertTrue(s.manage(b))
        self.assertLessEqual(self.on_device(blocks), 24 * MiB)
        self.sweep(s, blocks, iterations=4, stride=1, budget=24 * MiB)
        stats = s.stats()
        self.assertEqual(stats["operations"], 24)
        self.assertEqual(stats["managed_bytes"], 48 * MiB)
        self.assertLessEqual(stats["peak_device_bytes"], 24 * MiB)
        self.assertGreater(stats["offloads"], 0)
        self.assertEqual(stats["iterations"], 4)
        s.close()
        for p, _ in blocks:  # close brings them back where there is room
            self.assertEqual(glake_torch.residence(p), "device")

    def test_deferred_moves_keep_the_budget_and_every_use_finds_its_blocks(self):
        # The simulated backend has no events, so a deferred move completes on return here; this
        # checks the option's path through the C interface and the scheduler's settling.
        # "overlapped" makes the scheduler's own copy streams too (numbers here).
        blocks = [self.block(8 * MiB) for _ in range(6)]
        for moves in ("deferred", "overlapped"):
            s = glake_torch.Scheduler(24 * MiB, device=0, name=moves, moves=moves)
            self.assertEqual(s.moves, moves)
            for b in blocks:
                s.manage(b)
            self.sweep(s, blocks, iterations=3, stride=2, budget=24 * MiB)
            self.assertGreater(s.stats()["offloads"], 0)
            s.settle()  # nothing pending is left (here: nothing ever is)
            s.close()
        with self.assertRaisesRegex(ValueError, "moves must be one of"):
            glake_torch.Scheduler(24 * MiB, device=0, moves="later")

    def test_small_and_repeated_tensors_are_left_alone(self):
        s = glake_torch.Scheduler(16 * MiB, device=0)
        small = self.block(MiB)
        big = self.block(4 * MiB)
        self.assertFalse(s.manage(small))  # under one 2 MiB handle
        self.assertTrue(s.manage(big))
        self.assertFalse(s.manage(big))  # managed already
        self.assertTrue(s.managed(big))
        s.will_use([small, big])  # the unmanaged one is ignored
        s.unmanage(big)
        self.assertFalse(s.managed(big))
        with self.assertRaises(ValueError):
            s.unmanage(big)
        s.close()

    def test_read_only_tensors_keep_their_host_copy_and_later_offloads_copy_nothing(self):
        class Weight(tuple):  # a (pointer, bytes) pair that says whether it requires grad
            requires_grad = True

        frozen = [Weight(self.block(8 * MiB)) for _ in range(4)]
        for w in frozen:
            w.requires_grad = False
        trained = Weight(self.block(8 * MiB))
        self.assertEqual(glake_torch.far_copy_bytes(), 0)
        s = glake_torch.Scheduler(24 * MiB, device=0, name="frozen")
        model = types.SimpleNamespace(
            parameters=lambda recurse=True: frozen + [trained], modules=lambda: [],
            register_forward_pre_hook=lambda fn: types.SimpleNamespace(remove=lambda: None))
        with self.assertRaises(ValueError):
            s.attach(model, read_only="everything")
        saved = os.environ.get("GLAKE_ALLOC_CONF")
        os.environ["GLAKE_ALLOC_CONF"] = "far_unmapped:true"
        try:
            with self.assertRaises(ValueError) as caught:  # its backward pass would fault
                s.attach(model, backward=False)
            self.assertIn("far_unmapped", str(caught.exception))
        finally:
            if saved is None:
                del os.environ["GLAKE_ALLOC_CONF"]
            else:
                os.environ["GLAKE_ALLOC_CONF"] = saved
        self.assertEqual(s.attach(model, read_only="frozen"), 5)
        blocks = frozen + [trained]
        self.sweep(s, blocks, iterations=3, stride=1, budget=24 * MiB)
        # The frozen ones on the device hold a host copy each (once they have been away); the
        # trained one never does.
        on_device = [w for w in frozen if glake_torch.residence(w[0]) == "device"]
        self.assertGreater(len(on_device), 0)
        self.assertEqual(glake_torch.far_copy_bytes(), 8 * MiB * len(on_device))
        first_on_device = glake_torch.residence(frozen[0][0]) == "device"
        s.unmanage(frozen[0])  # unmarked: its copy goes
        self.assertEqual(glake_torch.far_copy_bytes(), 8 * MiB * (len(on_device) - first_on_device))
        s.close()
        self.assertEqual(glake_torch.far_copy_bytes(), 0)
        self.assertEqual(self.lib.glake_keep_far_copy(12345 << 21, 1), -1)  # not glake's
        self.assertIn("not a live allocation", glake_torch._last_error(self.lib))

    def test_misuse_is_refused_with_clear_errors(self):
        lib = self.lib
        s = glake_torch.Scheduler(16 * MiB, device=0, name="careful")
        values = (glake_torch.ctypes.c_uint64 * 14)()
        self.assertEqual(lib.glake_scheduler_manage(s._handle, 12345 << 21, 4 * MiB), -1)  # not glake's
        self.assertIn("live allocation", glake_torch._last_error(lib))
        small = self.block(MiB)  # the small pool's: it never moves, refused now rather than at its first eviction
        self.assertEqual(lib.glake_scheduler_manage(s._handle, small[0], MiB), -1)
        self.assertIn("cannot move", glake_torch._last_error(lib))
        b = self.block(4 * MiB)
        self.assertEqual(lib.glake_scheduler_manage(s._handle, b[0], 0), -1)  # empty
        self.assertEqual(lib.glake_scheduler_manage(s._handle, b[0], 4 * MiB), 0)
        self.assertEqual(lib.glake_scheduler_manage(s._handle, b[0], 4 * MiB), -1)  # twice
        self.assertIn("managed already", glake_torch._last_error(lib))
        outside = (glake_torch.ctypes.c_void_p * 1)(b[0] + 64 * MiB)
        self.assertEqual(lib.glake_scheduler_will_use(s._handle, outside, 1), -1)
        self.assertIn("no allocation it manages", glake_torch._last_error(lib))
        bogus = 0x1000
        self.assertEqual(lib.glake_scheduler_will_use(bogus, outside, 1), -1)
        self.assertIn("not a scheduler", glake_torch._last_error(lib))
        self.assertEqual(lib.glake_scheduler_stats(bogus, values, 14), 0)
        self.assertEqual(lib.glake_scheduler_destroy(bogus), -1)
        self.assertIsNone(lib.glake_scheduler_create(0, 0, None, None, None))
        with self.assertRaises(ValueError):
            glake_torch.Scheduler(0)
        s.close()
        s.close()  # twice: nothing left to do

    def test_an_operation_larger_than_the_budget_fails_naming_the_workload(self):
        blocks = [self.block(8 * MiB) for _ in range(3)]
        s = glake_torch.Scheduler(16 * MiB, device=0, name="too-big")
        for b in blocks:
            s.manage(b)
        with self.assertRaises(MemoryError) as caught:
            s.will_use(blocks)  # 24 MiB at once
        self.assertIn("too-big", str(caught.exception))
        s.will_use(blocks[:2])  # still usable
        s.close()

    def test_without_a_coordinator_it_runs_alone_with_its_local_budget(self):
        blocks = [self.block(8 * MiB) for _ in range(3)]
        s = glake_torch.Scheduler(16 * MiB, device=0, socket="/nonexistent/glake-budget.sock", name="alone")
        for b in blocks:
            s.manage(b)
        s.will_use(blocks[:2])
        self.assertLessEqual(self.on_device(blocks), 16 * MiB)
        s.will_use(blocks[2:])
        self.assertEqual(glake_torch.residence(blocks[2][0]), "device")
        s.close()

    def test_attach_hooks_modules_so_each_brings_its_own_parameters_in(self):
        class Hook:
            def __init__(self, hooks, fn):
                self.hooks, self.fn = hooks, fn

            def remove(self):
                self.hooks.remove(self.fn)

        class Module:
            def __init__(self, params, children=()):
                self.params, self.children = params, list(children)
                self.forward_pre, self.backward_pre = [], []

            def parameters(self, recurse=True):
                out = list(self.params)
                if recurse:
                    for c in self.children:
                        out += c.parameters()
                return out

            def modules(self):
                out = [self]
                for c in self.children:
                    out += c.modules()
                return out

            def register_forward_pre_hook(self, fn):
                self.forward_pre.append(fn)
                return Hook(self.forward_pre, fn)

            def register_full_backward_pre_hook(self, fn):
                self.backward_pre.append(fn)
                return Hook(self.backward_pre, fn)

            def forward(self):
                for fn in list(self.forward_pre):
                    fn(self, ())
                for c in self.children:
                    c.forward()

            def backward(self):
                for c in reversed(self.children):
                    c.backward()
                for fn in list(self.backward_pre):
                    fn(self, ())

        layers = [Module([self.block(8 * MiB), self.block(MiB)]) for _ in range(4)]
        model = Module([], layers)
        s = glake_torch.Scheduler(20 * MiB, device=0, name="model")
        self.assertEqual(s.attach(model), 4)  # the 1 MiB ones are left alone
        seen = []
        for layer in layers:
            layer.forward_pre.append(lambda m, args: seen.append(glake_torch.residence(m.params[0][0])))
            layer.backward_pre.append(lambda m, g: seen.append(glake_torch.residence(m.params[0][0])))
        for _ in range(3):
            model.forward()
            model.backward()
        self.assertEqual(seen, ["device"] * 24)  # each layer's weight in place when it ran
        self.assertEqual(s.stats()["iterations"], 3)
        self.assertGreater(s.stats()["offloads"], 0)
        s.close()
        self.assertEqual(model.forward_pre, [])
        self.assertTrue(all(len(layer.forward_pre) == 1 for layer in layers))  # only the test's own
        self.assertTrue(all(len(layer.backward_pre) == 1 for layer in layers))

        s = glake_torch.Scheduler(20 * MiB, device=0, name="forward-only")
        self.assertEqual(s.attach(model, backward=False), 4)
        self.assertTrue(all(len(layer.backward_pre) == 1 for layer in layers))  # no scheduler hook
        self.assertTrue(all(len(layer.forward_pre) == 2 for layer in layers))
        s.close()

        # backward="outputs": each layer's output gets a gradient hook as the layer runs forward;
        # the gradient's arrival (the backward pass) brings the layer's weight in.
        class Output:
            def __init__(self):
                self.requires_grad, self.hooks = True, []

            def register_hook(self, fn):
                self.hooks.append(fn)

        class Plain:  # no gradient: not hooked
            requires_grad = False

        for layer in layers:
            layer.forward_post = []
            layer.register_forward_hook = lambda fn, layer=layer: (
                layer.forward_post.append(fn), Hook(layer.forward_post, fn))[1]
            layer.backward_pre = []
        s = glake_torch.Scheduler(20 * MiB, device=0, name="outputs")
        self.assertEqual(s.attach(model, backward="outputs"), 4)
        self.assertTrue(all(layer.backward_pre == [] for layer in layers))  # no full backward hooks
        for _ in range(3):
            outputs = []
            model.forward()
            for layer in layers:
                out = (Plain(), Output())
                for fn in layer.forward_post:
                    fn(layer, (), out)
                self.assertEqual(len(out[1].hooks), 1)
                outputs.append((layer, out[1]))
            for layer, out in reversed(outputs):
                for fn in out.hooks:
                    fn(None)
                self.assertEqual(glake_torch.residence(layer.params[0][0]), "device")
        self.assertEqual(s.stats()["uses"], 3 * 8)  # four forward and four backward uses a step
        s.close()
        self.assertTrue(all(layer.forward_post == [] for layer in layers))

    def test_attach_brings_host_parameters_in_one_at_a_time_within_the_budget(self):
        test = self

        class HostData:  # a tensor in host memory: to() makes its device copy (glake memory)
            def __init__(self, nbytes):
                self.nbytes = nbytes

            def to(self, device):
                test.assertEqual(device, "cuda:0")
                return test.block(self.nbytes)

        class Storage:
            def __init__(self, block):
                self.block = block

            def data_ptr(self):
                return self.block[0]

            def nbytes(self):
                return self.block[1]

        class Param:
            def __init__(self, nbytes):
                self.data = HostData(nbytes)

            @property
            def is_cuda(self):
                return not isinstance(self.data, HostData)

            def untyped_storage(self):
                return Storage(self.data)

        class Model:
            def __init__(self, params):
                self.params = params

            def parameters(self):
                return list(self.params)

            def modules(self):
                return []

            def register_forward_pre_hook(self, fn):
                return types.SimpleNamespace(remove=lambda: None)

        params = [Param(8 * MiB) for _ in range(6)]  # 48 MiB of weights, a 20 MiB budget
        model = Model(params)
        glake_torch.empty_cache(0)
        glake_torch.reset_peak_stats(0)
        s = glake_torch.Scheduler(20 * MiB, device=0, name="loading")
        self.assertEqual(s.attach(model), 6)
        self.assertTrue(all(p.is_cuda and s.managed(p) for p in params))
        # The device never held more than the budget and the one parameter arriving.
        self.assertLessEqual(glake_torch.stats(0)["peak_reserved_bytes"], 28 * MiB)
        self.assertLessEqual(s.stats()["peak_device_bytes"], 20 * MiB)
        self.assertEqual(s.stats()["managed_bytes"], 48 * MiB)
        s.close()

    def test_an_allocation_the_device_refuses_moves_managed_memory_out_and_succeeds(self):
        device = 3  # a simulated device of its own, limited to 40 MiB
        glake_torch.set_memory_fraction(40 * MiB / (80 << 30), device)
        try:
            blocks = []
            for _ in range(3):
                ptr = self.lib.glake_malloc(8 * MiB, device, None)
                self.assertTrue(ptr)
                blocks.append((ptr, 8 * MiB))
            s = glake_torch.Scheduler(64 * MiB, device=device, name="relieved")  # the budget has room
            for b in blocks:
                s.manage(b)
            s.will_use(blocks[:1])  # pinned: it stays
            # 24 MiB managed on the device and 24 more asked for: only moving managed memory out
            # makes room.
            outside = self.lib.glake_malloc(24 * MiB, device, None)
            self.assertTrue(outside)
            self.assertEqual(glake_torch.residence(blocks[0][0]), "device")
            self.assertEqual(sum(glake_torch.residence(b[0]) == "host" for b in blocks[1:]), 2)
            self.assertEqual(s.stats()["reliefs"], 2)
            # Nothing left to move: the device says no, and nothing is lost.
            self.assertFalse(self.lib.glake_malloc(24 * MiB, device, None))
            self.assertEqual(glake_torch.residence(blocks[0][0]), "device")
            self.lib.glake_free(outside, 24 * MiB, device, None)
            s.close()
            for ptr, nbytes in blocks:
                if glake_torch.residence(ptr) == "host":
                    glake_torch.prefetch(ptr)
                self.lib.glake_free(ptr, nbytes, device, None)
        finally:
            glake_torch.set_memory_fraction(1.0, device)


if __name__ == "__main__":
    unittest.main()

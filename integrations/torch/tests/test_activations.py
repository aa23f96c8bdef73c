"""glake_torch.offload_activations: the policies (no torch needed), the hooks' logic on the CPU
through the module's test transport (_HostCopies: synchronous copies, a log of offloads,
prefetches and waits), and on a GPU the real streams (skipped without torch or CUDA).

Run: ctest -R torch_plugin.python (with the other Python tests), or
python3 -m unittest discover -s integrations/torch/tests -p test_activations.py"""

import contextlib
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import glake_torch  # noqa: E402
from glake_torch import _activations  # noqa: E402

try:
    import torch
except Exception:  # no torch, or a broken one
    torch = None

MiB = 1 << 20
CUDA = torch is not None and torch.cuda.is_available()


class PolicyTest(unittest.TestCase):
    def test_fraction_takes_the_earliest_units_nearest_the_target(self):
        units = [0, 10, 0, 10, 0, 10, 0, 10, 5]
        self.assertEqual(list(_activations.Fraction(0.5).select(units)), [0, 1, 2, 3, 4])
        self.assertEqual(list(_activations.Fraction(0.0).select(units)), [])
        self.assertEqual(list(_activations.Fraction(1.0).select(units)), list(range(9)))
        # 0.3 of 45 is 13.5: the second unit of 10 would be half under it (15 > 13.5), so it stays.
        self.assertEqual(list(_activations.Fraction(0.3).select(units)), [0, 1, 2])
        with self.assertRaises(ValueError):
            _activations.Fraction(1.5)

    def test_device_bytes_keeps_at_most_that_much(self):
        units = [10, 10, 10, 10]
        self.assertEqual(list(_activations.DeviceBytes(25).select(units)), [0, 1])
        self.assertEqual(list(_activations.DeviceBytes(40).select(units)), [])
        self.assertEqual(list(_activations.DeviceBytes(0).select(units)), [0, 1, 2, 3])

    def test_budget_takes_what_else_is_in_use_and_a_schedulers_budget(self):
        in_use = {"bytes": 60}
        policy = _activations.Budget(100, lambda: in_use["bytes"])
        self.assertEqual(list(policy.select([10, 10, 10, 10, 10])), [0])  # 40 may stay
        self.assertEqual(policy.last_allowance, 40)

        class FakeScheduler:  # holds 20 of its 50 now: counts at 50
            budget = 50

            def stats(self):
                return {"device_bytes": 20}

        policy = _activations.Budget(100, lambda: in_use["bytes"], FakeScheduler())
        self.assertEqual(policy.allowance(), 10)
        self.assertEqual(list(policy.select([10, 10, 10, 10, 10])), [0, 1, 2, 3])

    def test_exported(self):
        self.assertIn("offload_activations", glake_torch.__all__)
        self.assertIs(glake_torch.offload_activations.Fraction, _activations.Fraction)
        with self.assertRaises(ValueError):
            glake_torch.offload_activations(fraction=0.5, max_device_bytes=1)
        with self.assertRaises(ValueError):
            glake_torch.offload_activations(scheduler=object())


def _blocks(n=6, width=256, seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                                                   torch.nn.Linear(width, width)) for _ in range(n))


def _step(blocks, x, context):
    for p in blocks.parameters():
        p.grad = None
    with context:
        h = x
        for b in blocks:
            h = b(h) + h
        loss = h.float().pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in blocks.parameters()]


@unittest.skipUnless(torch is not None, "torch does not import")
class HooksOnTheCpuTest(unittest.TestCase):
    """The 'device' is the CPU (_HostCopies); each block saves three 2 MiB tensors (its input,
    GELU's input, the second Linear's input)."""

    def setUp(self):
        self.blocks = _blocks()
        self.x = torch.randn(2048, 256)
        self.base = _step(self.blocks, self.x, contextlib.nullcontext())

    def context(self, blocks=True, **kwargs):
        self.transport = _activations._HostCopies(torch, complete=kwargs.pop("complete", True))
        kwargs.setdefault("min_bytes", 64 << 10)
        return glake_torch.offload_activations(self.blocks if blocks else None, _transport=self.transport, **kwargs)

    def assert_same(self, result):
        loss, grads = result
        self.assertTrue(torch.equal(loss, self.base[0]))
        for a, b in zip(grads, self.base[1]):
            self.assertTrue(torch.equal(a, b))

    def test_gradients_are_bit_identical_and_the_plan_takes_the_first_blocks(self):
        context = self.context(fraction=0.5)
        self.assert_same(_step(self.blocks, self.x, context))  # first pass: the first half of the blocks
        first = context.stats()
        self.assertEqual(first["offloaded_tensors"], 3 * 3)
        self.assertEqual(first["kept_bytes"], (3 * 3 + 1) * 2 * MiB)  # + the loss's input (h after the last block)
        self.assertEqual(first["units"][1], 3 * 2 * MiB)  # unit 1: block 0
        for _ in range(2):
            self.assert_same(_step(self.blocks, self.x, context))
        stats = context.stats()
        self.assertEqual(stats["plan"], [0, 1, 2, 3, 4, 5, 6])  # up to block 2: 18 of 38 MiB
        self.assertEqual(stats["offloaded_tensors"], first["offloaded_tensors"] + 2 * 9)
        self.assertEqual(stats["kept_bytes"], 3 * (38 - 18) * MiB)
        self.assertEqual(stats["prefetched_bytes"], stats["offloaded_bytes"])
        self.assertEqual(stats["pinned_bytes"], first["pinned_bytes"])  # later passes reuse the pool

    def test_closed_and_used_again_it_installs_its_block_hooks_again(self):
        context = self.context(fraction=0.5)
        for _ in range(2):
            self.assert_same(_step(self.blocks, self.x, context))
        units = context.stats()["units"]
        context.close()
        self.assert_same(_step(self.blocks, self.x, context))
        # Without the hooks every saved tensor would fall into one unit.
        self.assertEqual(context.stats()["units"], units)

    def test_a_pass_without_gradients_leaves_the_plan(self):
        context = self.context(fraction=0.5)
        for _ in range(2):
            _step(self.blocks, self.x, context)
        plan = context.stats()["plan"]
        with torch.no_grad(), context:
            for b in self.blocks:
                b(self.x)
        self.assert_same(_step(self.blocks, self.x, context))
        self.assertEqual(context.stats()["plan"], plan)
        self.assertEqual(context.stats()["units"][1], 6 * MiB)

    def test_without_blocks_every_saved_tensor_is_a_unit(self):
        context = self.context(blocks=False, max_device_bytes=20 * MiB)
        for _ in range(3):
            self.assert_same(_step(self.blocks, self.x, context))
        stats = context.stats()
        self.assertEqual(len([n for n in stats["units"] if n]), 19)
        self.assertEqual(stats["plan"], list(range(9)))  # 38 MiB - 9 x 2 = 20 stay
        self.assertEqual(stats["kept_bytes"], 2 * 20 * MiB)

    def test_prefetches_run_down_the_pack_order_ahead_of_their_use(self):
        context = self.context(fraction=0.5, prefetch_bytes=4 * MiB)
        _step(self.blocks, self.x, context)
        self.transport.log.clear()
        self.assert_same(_step(self.blocks, self.x, context))
        log = self.transport.log
        self.assertEqual([k for k, _ in log[:9]], ["offload"] * 9)
        backward = [k for k, _ in log[9:]]
        self.assertEqual(backward.count("prefetch"), 9)
        self.assertEqual(backward.count("wait"), 9)
        # Each wait finds its tensor prefetched, and at least one more has been asked for below
        # it whenever there is one (the lookahead), the first two before any wait.
        prefetched = 0
        for i, kind in enumerate(backward):
            if kind == "prefetch":
                prefetched += 1
            else:
                waits = backward[:i + 1].count("wait")
                self.assertGreaterEqual(prefetched, min(9, waits + 1))
        self.assertEqual(backward[:2], ["prefetch", "prefetch"])

    def test_a_storage_saved_twice_moves_once_and_parameters_stay(self):
        torch.manual_seed(1)
        weight = torch.nn.Parameter(torch.randn(512, 512))
        other = torch.nn.Parameter(torch.randn(512, 512))
        frozen = torch.nn.Parameter(torch.randn(512, 512), requires_grad=False)
        x = torch.randn(1024, 512, requires_grad=True)

        def run(context):
            for p in (weight, other, x):
                p.grad = None
            with context:
                a = x * 2  # saved by the three products (a slice of it by the third): one storage
                y = (a @ weight).sum() + (a @ weight.t()).sum() + (a[:512] @ other).sum() + (a @ frozen).sum()
            y.backward()
            return [weight.grad.clone(), other.grad.clone(), x.grad.clone()]

        expected = run(contextlib.nullcontext())
        context = self.context(blocks=False, fraction=1.0)
        got = run(context)
        stats = context.stats()
        self.assertEqual(stats["offloaded_tensors"], 1)  # a, once; the weights (views too) stay
        self.assertEqual(stats["offloaded_bytes"], 1024 * 512 * 4)
        self.assertEqual(stats["deduplicated"], 2)
        for e, g in zip(expected, got):
            self.assertTrue(torch.equal(e, g))

    def test_the_launching_thread_waits_only_past_max_inflight_bytes(self):
        context = self.context(fraction=1.0, max_inflight_bytes=4 * MiB, complete=False)
        self.assert_same(_step(self.blocks, self.x, context))
        waits = [n for k, n in self.transport.log if k == "synchronize"]
        # 18 copies of 2 MiB (the first pass sends the blocks' tensors; the loss's input, outside
        # them, stays), at most 4 MiB pending: each copy from the third on waits for one.
        self.assertEqual(context.stats()["offloaded_tensors"], 18)
        self.assertEqual(len(waits), 18 - 2)
        self.assertEqual(context.stats()["throttle_waits"], 16)

    def test_pending_copies_may_hold_what_the_kept_blocks_will_add(self):
        # Plan: blocks 0-2 go (9 copies of 2 MiB), 20 MiB kept after them. Copies never complete
        # by themselves here: 2 MiB + the 20 MiB to come fit 11 copies, so none of the 9 waits;
        # as the kept blocks pack, the allowance shrinks and the thread waits for the oldest.
        context = self.context(fraction=0.5, max_inflight_bytes=2 * MiB, complete=False)
        _step(self.blocks, self.x, context)
        self.transport.log.clear()
        for event, _ in list(context._inflight):
            event.complete = True
        before = context.stats()["throttle_waits"]
        self.assert_same(_step(self.blocks, self.x, context))
        log = [k for k, _ in self.transport.log]
        self.assertEqual(log[:9], ["offload"] * 9)  # no wait among the offloads
        forward = log[:log.index("prefetch")]
        # At the end of the forward pass at most 2 MiB (one copy) is pending: 8 waits, all after
        # the last offload, while the kept blocks packed.
        self.assertEqual(forward.count("synchronize"), 8)
        self.assertEqual(context.stats()["throttle_waits"] - before, 8)

    def test_a_prefetched_tensor_dropped_without_its_unpack_is_discarded(self):
        context = self.context(fraction=1.0, prefetch_bytes=64 * MiB)
        with context:
            h = self.x
            for b in self.blocks:
                h = b(h) + h
            loss = h.float().pow(2).mean()
        # The gradient of the third block's output only: backward stops there, after the hooks
        # of the blocks above prefetched the tensors below it.
        torch.autograd.grad(loss, [self.blocks[3][0].weight])
        del loss, h
        log = [k for k, _ in self.transport.log]
        self.assertGreater(log.count("prefetch"), log.count("wait"))
        self.assertEqual(log.count("discard"), log.count("prefetch") - log.count("wait"))

    def test_a_second_backward_needs_retain_graph(self):
        for retain in (False, True):
            context = self.context(fraction=1.0, retain_graph=retain)
            with context:
                h = self.x
                for b in self.blocks:
                    h = b(h) + h
                loss = h.float().pow(2).mean()
            loss.backward(retain_graph=True)
            if retain:
                first = [p.grad.clone() for p in self.blocks.parameters()]
                for p in self.blocks.parameters():
                    p.grad = None
                loss.backward()
                for a, b in zip(first, self.blocks.parameters()):
                    self.assertTrue(torch.equal(a, b.grad))
            else:
                with self.assertRaisesRegex(RuntimeError, "retain_graph=True"):
                    loss.backward()
            for p in self.blocks.parameters():
                p.grad = None

    def test_wrap_finds_the_blocks_and_offloads_every_forward(self):
        class Model(torch.nn.Module):
            def __init__(self, blocks):
                super().__init__()
                self.embed = torch.nn.Linear(256, 256)
                self.layers = blocks

            def forward(self, x):
                h = x
                for b in self.layers:
                    h = b(h) + h
                return h

        model = Model(self.blocks)
        self.assertEqual(len(glake_torch.offload_activations.find_blocks(model)), 6)
        transport = _activations._HostCopies(torch)
        model = glake_torch.offload_activations.wrap(model, fraction=0.5, min_bytes=64 << 10, _transport=transport)
        for _ in range(2):
            self.assert_same(self._model_step(model))
        stats = model.glake_activations.stats()
        self.assertEqual(stats["forward_passes"], 2)
        self.assertEqual(stats["plan"], [0, 1, 2, 3, 4, 5])  # the loss is outside: 18 of 36 MiB
        model.glake_activations.close()

    def _model_step(self, model):
        for p in self.blocks.parameters():
            p.grad = None
        loss = model(self.x).float().pow(2).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in self.blocks.parameters()]


@unittest.skipUnless(CUDA, "no CUDA device")
class HooksOnTheGpuTest(unittest.TestCase):
    def test_gradients_are_bit_identical_and_the_peak_falls(self):
        device = torch.device("cuda", 0)
        blocks = _blocks(n=12, width=1024).to(device)
        x = torch.randn(16384, 1024, device=device)  # each block saves three 64 MiB tensors

        def step(context):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            result = _step(blocks, x, context)
            torch.cuda.synchronize()
            return result, torch.cuda.max_memory_allocated() - before, torch.cuda.max_memory_reserved()

        (loss, grads), base_allocated, base_reserved = step(contextlib.nullcontext())
        context = glake_torch.offload_activations(blocks, fraction=0.5)
        for _ in range(3):  # the first pass sends everything; the plan holds from the second
            (loss2, grads2), allocated, reserved = step(context)
            self.assertTrue(torch.equal(loss, loss2))
            for a, b in zip(grads, grads2):
                self.assertTrue(torch.equal(a, b))
        stats = context.stats()
        offloaded = sum(stats["units"][i] for i in stats["plan"])
        self.assertGreater(offloaded, 0.4 * sum(stats["units"]))
        # What went is freed once copied (at most one block's copies pending at the forward
        # pass's end), and the allocator reuses it: both peaks fall by most of it.
        self.assertLess(allocated, base_allocated - 0.5 * offloaded, (allocated, base_allocated, offloaded, stats))
        self.assertLess(reserved, base_reserved - 0.25 * offloaded, (reserved, base_reserved, offloaded, stats))
        self.assertEqual(stats["prefetched_bytes"], stats["offloaded_bytes"])
        context.close()


if __name__ == "__main__":
    unittest.main()

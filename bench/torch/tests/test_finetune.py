"""Tests for bench/torch/finetune.py's driver and report, without torch or a GPU: children are
replaced by a fake subprocess.run that writes the result files a child would.

Run: python3 -m unittest discover -s bench/torch/tests -v
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import finetune  # noqa: E402

GB = 10**9


def value_after(command, option):
    return command[command.index(option) + 1]


class FakeChildren:
    """Stands in for run_child: records each command and environment and writes the result
    files the child (each rank) would, with numbers from `numbers(model, strategy, allocator)`."""

    def __init__(self, numbers, missing=()):
        self.numbers, self.missing, self.calls = numbers, set(missing), []

    def __call__(self, command, env, log, timeout):
        self.calls.append((command, env))
        allocator = value_after(command, "--allocator")
        model, strategy = value_after(command, "--model"), value_after(command, "--strategy")
        log.write(f"child output of {model} {strategy} {allocator}\n")
        if (model, strategy, allocator) in self.missing:
            return 1
        ranks = int(next((c.split("=")[1] for c in command if c.startswith("--nproc_per_node=")), "1"))
        fake_world = int(value_after(command, "--fake-world")) if "--fake-world" in command else 0
        for rank in range(ranks):
            result = dict(model=model, strategy=strategy, allocator=allocator, rank=rank, fsdp=ranks > 1 or fake_world > 0,
                          status="ok", gpu="Fake H100", torch_version="2.11.0")
            if fake_world:
                result["fake_world"] = fake_world
            result.update(self.numbers(model, strategy, allocator))
            with open(value_after(command, "--result-file").replace("{rank}", str(rank)), "w") as f:
                f.write(json.dumps(result) + "\n")
        return 0


def numbers(model, strategy, allocator):
    reserved = {"default": 30 * GB, "expandable": 16 * GB, "glake": 14 * GB}[allocator]
    step = {"default": 0.300, "expandable": 0.290, "glake": 0.303}[allocator]
    return dict(peak_active_bytes=13.8 * GB, peak_reserved_bytes=reserved, utilization=13.8 * GB / reserved,
                median_step_s=step, device_used_peak_over_base_bytes=reserved + GB)


class Driver(unittest.TestCase):
    def run_driver(self, argv, children):
        with tempfile.TemporaryDirectory() as directory, mock.patch.object(finetune, "run_child", children), \
                contextlib.redirect_stderr(io.StringIO()) as progress:
            out = os.path.join(directory, "results.jsonl")
            args = finetune.parse(argv + ["--out", out, "--log-dir", os.path.join(directory, "logs"),
                                          "--trace-dir", os.path.join(directory, "traces")])
            results = finetune.drive(args, "python3 bench/torch/finetune.py ...")
            with open(out) as f:
                written = [json.loads(line) for line in f]
            logs = sorted(os.listdir(os.path.join(directory, "logs")))
            return results, written, logs, progress.getvalue(), directory

    def test_gc_outside_steps_reaches_the_children(self):
        children = FakeChildren(numbers)
        self.run_driver(["--models", "opt1.3b", "--strategies", "N", "--steps", "3", "--gc-outside-steps"], children)
        self.assertTrue(children.calls)
        for command, _ in children.calls:
            self.assertIn("--gc-outside-steps", command)

    def test_host_probe_and_allocator_timing_reach_every_child_only_when_asked(self):
        for flag in ("--host-probe", "--allocator-timing"):
            with self.subTest(flag=flag):
                children = FakeChildren(numbers)
                self.run_driver(["--models", "opt1.3b", "--strategies", "N", flag], children)
                self.assertEqual(len(children.calls), 3)  # default, expandable, glake
                self.assertTrue(all(flag in command for command, _ in children.calls))
                children = FakeChildren(numbers)
                self.run_driver(["--models", "opt1.3b", "--strategies", "N"], children)
                self.assertFalse(any(flag in command for command, _ in children.calls))

    def test_profile_steps_reach_the_children(self):
        children = FakeChildren(numbers)
        self.run_driver(["--models", "opt1.3b", "--strategies", "N", "--profile-steps", "9,12"], children)
        self.assertEqual(len(children.calls), 3)
        for command, _ in children.calls:
            self.assertNotIn("--cpus", command)
            self.assertEqual(value_after(command, "--profile-steps"), "9,12")
            self.assertTrue(value_after(command, "--profile-dir").endswith("logs"))
        children = FakeChildren(numbers)
        self.run_driver(["--models", "opt1.3b", "--strategies", "N", "--profile-steps", "9", "--repeat", "2",
                         "--cpus", "1,3"], children)
        self.assertTrue(all(value_after(command, "--cpus") == "1,3" for command, _ in children.calls))
        dirs = [value_after(command, "--profile-dir") for command, _ in children.calls]
        self.assertEqual([os.path.basename(d) for d in dirs], ["round0"] * 3 + ["round1"] * 3)  # none overwritten

    def test_one_process_per_run_with_the_allocator_chosen_by_environment(self):
        children = FakeChildren(numbers, missing={("llama1b", "R", "glake")})
        results, written, logs, progress, directory = self.run_driver(
            ["--models", "opt1.3b,llama1b", "--strategies", "R", "--steps", "3", "--glake-conf", "reuse_limit:3"], children)
        self.assertEqual([(value_after(c, "--model"), value_after(c, "--allocator")) for c, _ in children.calls],
                         [(m, a) for m in ("opt1.3b", "llama1b") for a in ("default", "expandable", "glake")])
        for command, env in children.calls:
            allocator = value_after(command, "--allocator")
            self.assertEqual(command[0], sys.executable)
            self.assertIn("--child", command)
            self.assertEqual(value_after(command, "--steps"), "3")
            self.assertEqual(value_after(command, "--glake-conf"), "reuse_limit:3")
            self.assertEqual(env.get("PYTORCH_CUDA_ALLOC_CONF"), "expandable_segments:True" if allocator == "expandable" else None)
            self.assertNotIn("PYTORCH_ALLOC_CONF", env)
            if allocator == "glake":
                self.assertEqual(env["GLAKE_TRACE"], os.path.join(directory, "traces", f"{value_after(command, '--model')}-R.trace"))
            else:
                self.assertNotIn("GLAKE_TRACE", env)
        self.assertEqual(len(results), 6)
        self.assertEqual(written, results)
        failed = [r for r in results if r["status"] == "error"]
        self.assertEqual([(r["model"], r["allocator"]) for r in failed], [("llama1b", "glake")])
        self.assertIn("no result (exit 1)", failed[0]["error"])
        self.assertIn("child output of llama1b R glake", progress)  # the log's tail is shown
        self.assertEqual(len(logs), 6)
        self.assertTrue(all(r["driver_command"].startswith("python3 bench/torch/finetune.py") for r in results))

    def test_fsdp_runs_under_torchrun_and_reports_every_rank(self):
        children = FakeChildren(numbers)
        with mock.patch.dict(os.environ, {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}):
            results, _, _, _, directory = self.run_driver(
                ["--fsdp", "2", "--models", "pythia2.8b", "--strategies", "LR", "--allocators", "default,glake"], children)
        commands = [c for c, _ in children.calls]
        self.assertEqual(len(commands), 2)
        for command, env in children.calls:
            self.assertEqual(command[1:5], ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])
            self.assertIn("--fsdp", command)
            self.assertEqual(command[command.index("--fsdp") + 1], "2")  # the child needs N too
            self.assertNotEqual(env.get("PYTORCH_CUDA_ALLOC_CONF"), "garbage_collection_threshold:0.6")
        glake_env = children.calls[1][1]
        self.assertEqual(glake_env["GLAKE_TRACE"], os.path.join(directory, "traces", "pythia2.8b-LR-fsdp2-dev%d.trace"))
        self.assertEqual(sorted((r["allocator"], r["rank"]) for r in results),
                         [("default", 0), ("default", 1), ("glake", 0), ("glake", 1)])

    def test_fake_world_runs_one_process_per_run_and_is_told_apart_from_fsdp(self):
        children = FakeChildren(numbers)
        results, _, _, _, directory = self.run_driver(
            ["--fake-world", "2", "--models", "opt1.3b", "--strategies", "N", "--allocators", "default,glake"], children)
        self.assertEqual(len(children.calls), 2)
        for command, _ in children.calls:
            self.assertNotIn("torch.distributed.run", command)  # no torchrun: one process, one GPU
            self.assertNotIn("--fsdp", command)
            self.assertEqual(value_after(command, "--fake-world"), "2")
        self.assertEqual(children.calls[1][1]["GLAKE_TRACE"], os.path.join(directory, "traces", "opt1.3b-N-fake2.trace"))
        self.assertEqual([(r["allocator"], r["rank"], r["fake_world"]) for r in results], [("default", 0, 2), ("glake", 0, 2)])
        self.assertEqual(finetune.fsdp_label(results[0]), "FSDP, fake world 2")
        self.assertEqual(finetune.fsdp_label(dict(results[0], fake_world=None)), "FSDP")
        self.assertIn("| opt1.3b N FSDP, fake world 2 rank 0 |", finetune.markdown(results, "cmd"))
        for bad in (["--fake-world", "1"], ["--fake-world", "2", "--fsdp", "2"]):
            with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
                finetune.parse(bad)

    def test_repeat_reverses_the_allocators_in_every_other_round(self):
        children = FakeChildren(numbers)
        results, written, logs, _, directory = self.run_driver(
            ["--models", "opt1.3b", "--strategies", "N,R", "--allocators", "default,glake", "--repeat", "3"], children)
        order = [(value_after(c, "--strategy"), value_after(c, "--allocator")) for c, _ in children.calls]
        self.assertEqual(order, [("N", "default"), ("N", "glake"), ("R", "default"), ("R", "glake"),
                                 ("N", "glake"), ("N", "default"), ("R", "glake"), ("R", "default"),
                                 ("N", "default"), ("N", "glake"), ("R", "default"), ("R", "glake")])
        self.assertEqual([r["round"] for r in results], [0] * 4 + [1] * 4 + [2] * 4)
        self.assertEqual(len(set(logs)), 12)  # no run's log overwrites another's
        self.assertTrue(all("GLAKE_HOST_TIMING" not in env for _, env in children.calls))
        traces = [env["GLAKE_TRACE"] for c, env in children.calls if value_after(c, "--allocator") == "glake"]
        self.assertEqual(len(set(traces)), 6)
        self.assertTrue(traces[0].endswith("opt1.3b-N-round0.trace"), traces[0])
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            finetune.parse(["--repeat", "0"])

    def test_host_timing_is_asked_of_glake_runs_only(self):
        children = FakeChildren(numbers)
        self.run_driver(["--models", "opt1.3b", "--strategies", "N", "--allocators", "default,glake",
                         "--glake-host-timing"], children)
        timing = {value_after(c, "--allocator"): env.get("GLAKE_HOST_TIMING") for c, env in children.calls}
        self.assertEqual(timing, {"default": None, "glake": "1"})

    def test_a_timeout_kills_the_child_and_its_workers(self):
        def alive(pid):
            try:
                with open(f"/proc/{pid}/status") as f:
                    return "\nState:\tZ" not in f.read()  # a zombie is dead
            except FileNotFoundError:
                return False

        with tempfile.TemporaryDirectory() as directory:
            pid_file = os.path.join(directory, "worker.pid")
            launcher = ("import subprocess, sys, time\n"
                        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                        f"open({pid_file!r}, 'w').write(str(worker.pid))\n"
                        "time.sleep(120)\n")
            with open(os.path.join(directory, "log"), "w") as log:
                started = finetune.time.time()
                self.assertEqual(finetune.run_child([sys.executable, "-c", launcher], dict(os.environ), log, 2), "timeout")
                self.assertLess(finetune.time.time() - started, 60)
                self.assertEqual(finetune.run_child([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), log, 60), 3)
            with open(pid_file) as f:
                worker = int(f.read())
            for _ in range(50):
                if not alive(worker):
                    break
                finetune.time.sleep(0.1)
            self.assertFalse(alive(worker))

    def test_budget_stops_starting_runs(self):
        children = FakeChildren(numbers)
        clock = iter(range(0, 10000, 100))
        with mock.patch.object(finetune.time, "time", lambda: next(clock)):
            results, _, _, progress, _ = self.run_driver(["--models", "opt1.3b", "--strategies", "N,R", "--budget", "250"], children)
        self.assertLess(len(children.calls), 6)
        self.assertGreater(len(children.calls), 0)
        self.assertIn("skipped, --budget 250 s used up", progress)
        self.assertEqual(len(results), len(children.calls))


FAKES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_modules")
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "finetune.py")
SIM = os.environ.get("GLAKE_TORCH_SIM_LIBRARY")


class Child(unittest.TestCase):
    """The child's code path over fake torch, transformers and peft (tests/fake_modules)."""

    def run_child(self, allocator, strategy="LR", steps=4, extra=(), model="opt1.3b", **env):
        with tempfile.TemporaryDirectory() as directory:
            out = os.path.join(directory, "rank{rank}.json")
            environment = {k: v for k, v in os.environ.items() if k not in finetune.ALLOC_CONF_VARIABLES}
            environment.update(PYTHONPATH=FAKES, **env)
            run = subprocess.run([sys.executable, SCRIPT, "--child", "--model", model, "--strategy", strategy,
                                  "--allocator", allocator, "--steps", str(steps), "--result-file", out, *extra],
                                 capture_output=True, text=True, env=environment)
            with open(out.replace("{rank}", "0")) as f:
                result = json.load(f)
        self.assertIn("RESULT " + json.dumps(result), run.stdout)
        return run.returncode, result

    def test_default_allocator_run(self):
        code, r = self.run_child("default")
        self.assertEqual((code, r["status"]), (0, "ok"), r.get("error"))
        self.assertEqual(len(r["step_times_s"]), 4)
        self.assertEqual(r["seq_lengths"], finetune.sequence_lengths(4))
        self.assertEqual((r["peak_active_bytes"], r["peak_reserved_bytes"]), (3 * GB, 4 * GB))
        self.assertEqual(r["peak_requested_bytes"], 3 * GB - 1)
        self.assertAlmostEqual(r["utilization"], 0.75)
        self.assertEqual(r["device_used_base_bytes"], 10 * GB)
        self.assertEqual(r["device_used_peak_over_base_bytes"], 0)
        self.assertEqual(r["trainable_params"], 16 * 2 * 2048)  # LoRA's only
        self.assertEqual(r["params"], 2048 * 50272)

    def test_inference_runs_one_generate_call_per_step_without_an_optimizer(self):
        code, r = self.run_child("default", strategy="GV", steps=5, model="qwen2-0.5b")
        self.assertEqual((code, r["status"]), (0, "ok"), r.get("error"))
        self.assertEqual(len(r["step_times_s"]), 5)
        expected = finetune.inference_module().calls("GV", 5, finetune.SEED)
        self.assertEqual([c["batch"] for c in r["calls"]], [len(c["prompts"]) for c in expected])
        self.assertEqual([c["new_tokens"] for c in r["calls"]], [c["new_tokens"] for c in expected])
        self.assertNotIn("trainable_params", r)
        self.assertNotIn("loss_first", r)
        self.assertEqual(r["params"], 896 * 151936)

    def test_inference_out_of_memory_is_a_result(self):
        code, r = self.run_child("default", strategy="GD", model="llama3.2-1b", FAKE_TORCH_OOM_AT="3")
        self.assertEqual((code, r["status"], r["oom_step"]), (0, "oom", 3))

    def test_out_of_memory_is_a_result_not_a_crash(self):
        code, r = self.run_child("default", strategy="LO", FAKE_TORCH_OOM_AT="2")
        self.assertEqual((code, r["status"], r["oom_step"]), (0, "oom", 2))
        self.assertIn("out of memory", r["error"])
        self.assertEqual(len(r["step_times_s"]), 1)
        self.assertEqual(r["peak_reserved_bytes"], 4 * GB)  # peaks still reported

    def test_garbage_collection_is_timed_per_step_and_can_run_between_steps(self):
        code, r = self.run_child("default", strategy="N")
        self.assertEqual((code, r["status"]), (0, "ok"), r.get("error"))
        self.assertFalse(r["gc_outside_steps"])
        self.assertEqual(len(r["step_gc_ms"]), len(r["step_times_s"]))
        self.assertTrue(all(ms >= 0 for ms in r["step_gc_ms"]))
        code, r = self.run_child("default", strategy="N", extra=["--gc-outside-steps"])
        self.assertEqual((code, r["status"]), (0, "ok"), r.get("error"))
        self.assertTrue(r["gc_outside_steps"])
        self.assertEqual(r["step_gc_ms"], [0.0] * len(r["step_times_s"]))  # none inside a step's clock

    def test_host_probe_times_four_kinds_of_work_after_every_step(self):
        code, r = self.run_child("default", strategy="R", steps=4, extra=["--host-probe"])
        self.assertEqual((code, r["status"]), (0, "ok"), r.get("error"))
        self.assertEqual(sorted(r["step_probe_s"]), ["cpu", "dispatch", "launch", "memcpy", "python"])
        cpus = r["step_probe_s"].pop("cpu")
        self.assertEqual(len(cpus), 4)
        self.assertTrue(set(cpus) <= set(os.sched_getaffinity(0)), cpus)
        for kind, seconds in r["step_probe_s"].items():
            self.assertEqual(len(seconds), 4, kind)
            self.assertTrue(all(s >= 0 for s in seconds), kind)
        self.assertGreater(min(r["step_probe_s"]["python"]), 0)  # the interpreter loop always takes time
        code, r = self.run_child("default", strategy="N", steps=2)
        self.assertNotIn("step_probe_s", r)  # off unless asked for

    def test_host_probe_views_a_leaf_of_its_own_in_place_of_a_distributed_parameter(self):
        # A DTensor's local shard is a view that FSDP and the optimizer update in place; viewing it
        # again after a step fails in autograd, so the probe must never touch it.
        class Distributed:  # a DTensor's face: to_local, a dtype, and no view of its own
            dtype = "float32"
            requires_grad = True

            def to_local(self):
                raise AssertionError("the probe touched the distributed parameter's shard")

            def view(self, *shape):
                raise AssertionError("the probe viewed the distributed parameter")

        before = set(sys.modules)
        self.addCleanup(lambda: [sys.modules.pop(m) for m in set(sys.modules) - before])
        sys.path.insert(0, FAKES)
        try:
            import torch as fake_torch
        finally:
            sys.path.remove(FAKES)
        if getattr(fake_torch, "__version__", "") != "0.0-fake":
            self.skipTest("a real torch is importable here")
        made = []
        real_zeros = fake_torch.zeros

        def zeros(*args, **kwargs):
            made.append(kwargs)
            return real_zeros(*args, **kwargs)

        fake_torch.zeros = zeros
        self.addCleanup(setattr, fake_torch, "zeros", real_zeros)
        probe = finetune.host_probe(fake_torch, 0, Distributed())
        times = [probe(), probe()]
        self.assertEqual(len(made), 1)  # one stand-in, made once, not per probe
        self.assertEqual((made[0]["dtype"], made[0]["device"], made[0]["requires_grad"]), ("float32", 0, True))
        for t in times:
            self.assertEqual(sorted(t), ["cpu", "dispatch", "launch", "memcpy", "python"])

    def test_profiled_steps_come_after_the_measured_ones_and_leave_traces(self):
        with tempfile.TemporaryDirectory() as directory:
            code, r = self.run_child("default", strategy="N", steps=5,
                                     extra=["--profile-steps", "2,4,9", "--profile-dir", directory])
            self.assertEqual((code, r["status"]), (0, "ok"), r.get("error"))
            self.assertEqual(len(r["step_times_s"]), 5)  # the profiled steps are extra ones
            self.assertEqual(len(r["step_queued_s"]), 5)
            self.assertEqual(len(r["step_cpu_s"]), 5)
            self.assertTrue(all(c >= 0 for c in r["step_cpu_s"]))
            self.assertEqual(len(r["step_steal_jiffies"]), 5)
            lengths = finetune.sequence_lengths(5)
            self.assertEqual([p["length"] for p in r["profiled"]], [lengths[1], lengths[3]])  # no step 9
            for p in r["profiled"]:
                self.assertTrue(os.path.isfile(p["trace"]), p["trace"])
                self.assertTrue(p["trace"].startswith(directory))
                self.assertLessEqual(p["queued_s"], p["step_s"])
            self.assertEqual(len(os.listdir(directory)), 2)  # the warm-up step leaves no trace

    def test_steal_is_read_from_the_cpu_line(self):
        with tempfile.TemporaryDirectory() as directory:
            stat = os.path.join(directory, "stat")
            with open(stat, "w") as f:
                f.write("cpu  10 20 30 40 50 60 70 1234 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
            self.assertEqual(finetune.steal_jiffies(stat), 1234)
            with open(stat, "w") as f:
                f.write("intr 5\n")
            self.assertIsNone(finetune.steal_jiffies(stat))
            self.assertIsNone(finetune.steal_jiffies(os.path.join(directory, "missing")))

    def test_cpus_are_parsed_passed_on_and_applied(self):
        self.assertEqual(finetune.parse(["--cpus", "0,2,4-6"]).cpus, [0, 2, 4, 5, 6])
        with contextlib.redirect_stderr(io.StringIO()):
            for bad in ("", "a", "3-x", "-1"):
                with self.assertRaises(SystemExit):
                    finetune.parse(["--cpus", bad])
        mine = sorted(os.sched_getaffinity(0))
        code, r = self.run_child("default", strategy="N", extra=["--cpus", str(mine[0])])
        self.assertEqual((code, r["status"]), (0, "ok"), r.get("error"))
        self.assertEqual(r["cpus"], [mine[0]])
        code, r = self.run_child("default", strategy="N")
        self.assertEqual(r["cpus"], mine)

    def test_profile_steps_need_a_directory_and_step_numbers(self):
        with contextlib.redirect_stderr(io.StringIO()):
            with self.assertRaises(SystemExit):
                finetune.parse(["--profile-steps", "3"])
            with self.assertRaises(SystemExit):
                finetune.parse(["--profile-steps", "0,2", "--log-dir", "x"])
            with self.assertRaises(SystemExit):
                finetune.parse(["--profile-steps", "a", "--log-dir", "x"])
        args = finetune.parse(["--profile-steps", "3,7", "--log-dir", "logs"])
        self.assertEqual((args.profile_steps, args.profile_dir), ([3, 7], os.path.abspath("logs")))

    @unittest.skipUnless(shutil.which("cc"), "needs a C compiler for the fake timing library")
    def test_allocator_timing_reports_each_steps_time_and_calls(self):
        # A stand-in for allocator_timing.cpp whose totals grow by 1 ms + 0.5 ms over 10 + 10 calls
        # at every read: the child reads once before the steps and once after each.
        with tempfile.TemporaryDirectory() as directory:
            source, library = os.path.join(directory, "timing.c"), os.path.join(directory, "libtiming.so")
            with open(source, "w") as f:
                f.write("#include <stdint.h>\n"
                        "int glake_timing_install(void) { return 0; }\n"
                        "void glake_timing_read(uint64_t* out) {\n"
                        "  static uint64_t n = 0; ++n;\n"
                        "  out[0] = n * 1000000; out[1] = n * 10; out[2] = n * 500000; out[3] = n * 10; out[4] = 7;\n"
                        "}\n")
            subprocess.run(["cc", "-shared", "-fPIC", source, "-o", library], check=True)
            code, r = self.run_child("default", strategy="N", steps=3, extra=["--allocator-timing"],
                                     GLAKE_ALLOCATOR_TIMING_LIBRARY=library)
        self.assertEqual((code, r["status"]), (0, "ok"), r.get("error"))
        self.assertEqual(r["step_allocator_ms"], [1.5, 1.5, 1.5])
        self.assertEqual(r["step_allocator_calls"], [20, 20, 20])
        self.assertEqual(r["allocator_timing_untimed"], 7)
        self.assertEqual(r["allocator_timing_library"], library)
        code, r = self.run_child("default", strategy="N", steps=2)
        self.assertNotIn("step_allocator_ms", r)  # off unless asked for
        code, r = self.run_child("default", strategy="N", steps=2, extra=["--allocator-timing"],
                                 GLAKE_ALLOCATOR_TIMING_LIBRARY="/nonexistent/libtiming.so")
        self.assertEqual((code, r["status"]), (1, "error"))  # a missing instrument stops the run
        self.assertIn("libtiming.so", r["error"])

    def test_size_cache_control_is_chosen_by_name_only(self):
        self.assertNotIn("sizecache", finetune.parse([]).allocators)
        self.assertEqual(finetune.parse(["--allocators", "default,sizecache"]).allocators, ["default", "sizecache"])
        code, r = self.run_child("sizecache", strategy="N", GLAKE_SIZE_CACHE_LIBRARY="/nonexistent/libsize_cache.so")
        self.assertEqual((code, r["status"]), (1, "error"))
        self.assertIn("libsize_cache.so", r["error"])

    def test_expandable_needs_its_variable(self):
        code, r = self.run_child("expandable", strategy="N")
        self.assertEqual((code, r["status"]), (1, "error"))
        self.assertIn("PYTORCH_CUDA_ALLOC_CONF", r["error"])
        code, r = self.run_child("expandable", strategy="N", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        self.assertEqual((code, r["status"]), (0, "ok"), r.get("error"))
        self.assertEqual(r["alloc_conf"], {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})

    @unittest.skipUnless(SIM, "GLAKE_TORCH_SIM_LIBRARY is not set (run through ctest)")
    def test_glake_run_enables_the_plugin_first(self):
        code, r = self.run_child("glake", strategy="R", GLAKE_TORCH_LIBRARY=SIM)
        self.assertEqual((code, r["status"]), (0, "ok"), r.get("error"))
        hooks = dict(r["glake_hooks"])
        self.assertIn("not installed", hooks.pop("graph_pools"))  # the fake torch has no pool hooks
        self.assertEqual(hooks, {"empty_cache": "set_reset_fn", "record_stream": "set_record_stream_fn"})
        self.assertIn("frag_limit:2MiB", r["glake_settings"])
        self.assertEqual(os.path.realpath(r["glake_library"]), os.path.realpath(SIM))
        self.assertEqual(r["glake_stats"]["allocations"], 0)  # the fake model allocates nothing through it
        self.assertEqual(r["peak_reserved_bytes"], 0)
        # one count per step, of driver calls, stitches and repairs made during it (none here)
        self.assertEqual(r["step_driver_calls"], [0] * len(r["step_times_s"]))
        self.assertEqual(r["step_stitches"], [0] * len(r["step_times_s"]))
        self.assertEqual(r["step_stitch_repairs"], [0] * len(r["step_times_s"]))
        self.assertEqual(r["step_stitch_grows"], [0] * len(r["step_times_s"]))
        self.assertGreater(len(r["step_times_s"]), 0)
        self.assertNotIn("step_allocator_host_ms", r)  # only with GLAKE_HOST_TIMING
        code, r = self.run_child("glake", strategy="R", GLAKE_TORCH_LIBRARY=SIM, GLAKE_HOST_TIMING="1")
        self.assertEqual((code, r["status"]), (0, "ok"), r.get("error"))
        self.assertEqual(len(r["step_allocator_host_ms"]), len(r["step_times_s"]))
        self.assertTrue(all(ms >= 0 for ms in r["step_allocator_host_ms"]))


REPLAY = os.environ.get("GLAKE_REPLAY")


class Rows:
    """A stand-in tensor: flat values seen as rows, enough of view, reshape, expand, copy_ and [0].
    A view shares its values, as a tensor's view shares its storage."""

    def __init__(self, values, rows=1):
        self.values, self.rows = values, rows

    def view(self, rows, _=-1):
        return Rows(self.values, 1 if rows == -1 else rows)

    reshape = view

    def expand(self, rows, _=-1):
        return Rows(self.values * rows, rows)

    def __getitem__(self, index):
        width = len(self.values) // self.rows
        return Rows(self.values[index * width:(index + 1) * width])

    def copy_(self, other):
        assert len(other.values) == len(self.values), (other.values, self.values)
        self.values[:] = other.values
        return self


class FakeCollectives(unittest.TestCase):
    def test_the_fake_process_groups_collectives_write_their_outputs_before_they_run(self):
        seen = []

        class Dist:  # the fake process group: returns without writing anything
            @staticmethod
            def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
                seen.append(("all_gather", list(output_tensor.values), group, async_op))

            @staticmethod
            def reduce_scatter_tensor(output, input, group=None, op=None, async_op=False):
                seen.append(("reduce_scatter", list(output.values), group, op, async_op))

        dist = Dist()
        finetune.write_fake_collectives(dist, 3)
        gathered = Rows([float("nan")] * 6)
        dist.all_gather_into_tensor(gathered, Rows([1.0, 2.0]), group="g", async_op=True)
        self.assertEqual(seen[-1], ("all_gather", [1.0, 2.0] * 3, "g", True))  # every rank's slot, before it ran
        reduced = Rows([float("nan")] * 2)
        dist.reduce_scatter_tensor(output=reduced, input=Rows([5.0, 6.0, 7.0, 8.0, 9.0, 10.0]), group="g", op="avg")
        self.assertEqual(seen[-1], ("reduce_scatter", [5.0, 6.0], "g", "avg", False))


class Replay(unittest.TestCase):
    def test_trace_lookup(self):
        with tempfile.TemporaryDirectory() as directory:
            fetched = os.path.join(directory, "fetched")
            os.makedirs(fetched)
            for name in ("m-R.trace", "m-LR-fsdp2-dev1.trace.gz"):
                open(os.path.join(fetched, name), "w").close()
            gone = "/elsewhere/traces/"
            self.assertEqual(finetune.trace_of({"trace": gone + "m-R.trace"}, fetched), os.path.join(fetched, "m-R.trace"))
            self.assertEqual(finetune.trace_of({"trace": gone + "m-LR-fsdp2-dev%d.trace", "device": 1}, fetched),
                             os.path.join(fetched, "m-LR-fsdp2-dev1.trace.gz"))
            self.assertIsNone(finetune.trace_of({"trace": gone + "m-LR-fsdp2-dev%d.trace", "device": 0}, fetched))
            self.assertIsNone(finetune.trace_of({"trace": gone + "m-R.trace"}))
            self.assertIsNone(finetune.trace_of({}))

    @unittest.skipUnless(REPLAY, "GLAKE_REPLAY is not set (run through ctest)")
    def test_replayed_peak_against_the_measured_one(self):
        MiB = 1 << 20
        with tempfile.TemporaryDirectory() as directory:
            trace = os.path.join(directory, "opt1.3b-R.trace")
            with open(trace, "w") as f:  # 10 MiB and 6 MiB live together, then 4 MiB in 10 MiB's place
                f.write("# glake trace\nS,10485760\na,0,10485760,0\nS,6291456\na,1,6291456,0\nf,0\na,2,4194304,0\nf,1\nf,2\n")
            results = [
                dict(model="opt1.3b", strategy="R", allocator="glake", status="ok", trace=trace, device=0,
                     peak_active_bytes=16 * MiB, peak_reserved_bytes=16 * MiB, utilization=1.0, median_step_s=0.3,
                     glake_settings="stitching:true,frag_limit:2MiB,reuse_limit:2,defrag_level:0,auto_gc:8GiB,grow_stitch:true"),
                dict(model="opt1.3b", strategy="R", allocator="default", status="ok", peak_active_bytes=16 * MiB,
                     peak_reserved_bytes=20 * MiB, utilization=0.8, median_step_s=0.3),
                dict(model="llama1b", strategy="R", allocator="glake", status="ok", trace=os.path.join(directory, "none.trace"),
                     peak_active_bytes=16 * MiB, peak_reserved_bytes=17 * MiB, utilization=0.94, median_step_s=0.3),
            ]
            finetune.attach_replays(results, REPLAY)
        self.assertEqual(results[0]["replay_peak_reserved_bytes"], 16 * MiB)
        self.assertEqual(results[0]["replay_recorded_peak_reserved_bytes"], 16 * MiB)
        self.assertEqual(results[0]["replay_ratio"], 1.0)
        self.assertNotIn("replay_ratio", results[1])  # not a glake run
        self.assertNotIn("replay_ratio", results[2])  # no trace
        rows = [line for line in finetune.markdown(results, "cmd").splitlines() if line.startswith("| ")]
        self.assertTrue(rows[0].endswith("| glake replayed GB | replay within 2% |"))
        self.assertTrue(next(r for r in rows if r.startswith("| opt1.3b R")).endswith("| 0.02 | yes (1.000) |"))
        self.assertTrue(next(r for r in rows if r.startswith("| llama1b R")).endswith("| - | - |"))


class Report(unittest.TestCase):
    def test_markdown_rows_columns_and_targets(self):
        results = []
        for allocator in finetune.ALLOCATORS:
            results.append(dict(model="opt1.3b", strategy="R", allocator=allocator, status="ok", gpu="Fake H100",
                                **numbers("opt1.3b", "R", allocator)))
        # a second workload where glake misses every target, and one where glake ran out of memory
        for allocator, reserved, step, active in (("default", 10, 0.2, 9), ("expandable", 10, 0.2, 9), ("glake", 11, 0.3, 9)):
            results.append(dict(model="llama1b", strategy="LR", allocator=allocator, status="ok", peak_active_bytes=active * GB,
                                peak_reserved_bytes=reserved * GB, utilization=active / reserved, median_step_s=step))
        results.append(dict(model="pythia2.8b", strategy="N", allocator="glake", status="oom", peak_active_bytes=70 * GB,
                            peak_reserved_bytes=79 * GB, utilization=70 / 79, median_step_s=None))
        table = finetune.markdown(results, "python3 bench/torch/finetune.py --steps 14")
        lines = table.splitlines()
        self.assertIn("    python3 bench/torch/finetune.py --steps 14", lines)
        header = next(line for line in lines if line.startswith("| workload"))
        self.assertIn("| default: reserved GB |", header)
        self.assertTrue(header.endswith("| reserved ≤ expandable | util ≥ 0.97 | step ≤ 1.02× default |"))
        rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| ") and not line.startswith("| workload")}
        self.assertEqual(set(rows), {"opt1.3b R", "llama1b LR", "pythia2.8b N"})
        self.assertIn("| 30.00 |", rows["opt1.3b R"])
        self.assertTrue(rows["opt1.3b R"].endswith("| yes (0.875) | yes (0.986) | yes (1.010) |"))
        self.assertTrue(rows["llama1b LR"].endswith("| NO (1.100) | NO (0.818) | NO (1.500) |"))
        self.assertIn("79.00 (OOM)", rows["pythia2.8b N"])
        self.assertTrue(rows["pythia2.8b N"].endswith("| - | - | - |"))
        for line in lines:
            if line.startswith("|"):
                self.assertEqual(line.count("|"), header.count("|"), line)

    def test_repeated_runs_show_the_largest_peak_and_the_pairs_verdict(self):
        results = []
        for (model, g_steps, d_steps) in (("opt1.3b", (0.30, 0.31), (0.30, 0.30)), ("llama1b", (0.200, 0.201), (0.25, 0.25))):
            for round_ in range(2):
                for allocator, reserved, step in (("default", 12, d_steps[round_]), ("expandable", 12, 0.3),
                                                  ("glake", 10 + round_, g_steps[round_])):
                    results.append(dict(model=model, strategy="R", allocator=allocator, status="ok", round=round_,
                                        peak_active_bytes=9.5 * GB, peak_reserved_bytes=reserved * GB,
                                        utilization=9.5 / reserved, median_step_s=step))
        results.append(dict(model="llama1b", strategy="R", allocator="glake", status="oom", peak_reserved_bytes=70 * GB))
        lines = finetune.markdown(results, "cmd").splitlines()
        rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| ") and not line.startswith("| workload")}
        cells = rows["opt1.3b R"].strip("| ").split(" | ")
        header = next(line for line in lines if line.startswith("| workload")).strip("| ").split(" | ")
        cell = dict(zip(header, cells))
        self.assertEqual(cell["glake: reserved GB"], "11.00")  # the larger of 10 and 11, not the last
        self.assertEqual(cell["glake: util"], f"{9.5 / 11:.3f}")  # of that run
        self.assertEqual(cell["glake: step s"], "0.305 (2 runs)")
        self.assertEqual(cell["default: step s"], "0.300 (2 runs)")
        self.assertEqual(cell["reserved ≤ expandable"], f"yes ({11 / 12:.3f})")
        self.assertTrue(cell["step ≤ 1.02× default"].startswith("open (1.017, 95% "), cell["step ≤ 1.02× default"])
        self.assertTrue(cell["step ≤ 1.02× default"].endswith(", 2 pairs)"))
        cell = dict(zip(header, rows["llama1b R"].strip("| ").split(" | ")))
        self.assertEqual(cell["glake: reserved GB"], "11.00")  # the OOM run's 70 GB is not shown
        self.assertTrue(cell["step ≤ 1.02× default"].startswith("met (0.802, 95% "), cell["step ≤ 1.02× default"])

    def test_inference_calls_are_the_same_for_every_allocator_and_differ_by_workload(self):
        inference = finetune.inference_module()
        gd, gs = inference.calls("GD", 50, 1234), inference.calls("GS", 50, 1234)
        self.assertEqual([c["prompts"] for c in gd], [c["prompts"] for c in gs])  # only the cache differs
        self.assertEqual((gd[0]["static"], gs[0]["static"]), (False, True))
        self.assertEqual(gd, inference.calls("GD", 50, 1234))
        self.assertNotEqual(gd, inference.calls("GD", 50, 1235))
        self.assertEqual({len(c["prompts"]) for c in gd}, set(inference.BATCHES))
        self.assertTrue(all(32 <= n <= 768 for c in gd for n in c["prompts"]))
        self.assertTrue(all(c["new_tokens"] == 512 and len(c["prompts"]) <= 8 for c in inference.calls("GL", 20, 1)))
        serving = inference.calls("GV", 200, 1234)
        self.assertTrue(all(1 <= len(c["prompts"]) <= 24 and 16 <= c["new_tokens"] <= 192 for c in serving))
        self.assertTrue(all(16 <= n <= 1536 for c in serving for n in c["prompts"]))
        self.assertGreater(len({len(c["prompts"]) for c in serving}), 8)  # batches vary with arrivals
        with self.assertRaisesRegex(ValueError, "not an inference workload"):
            inference.calls("LR", 1, 1)

    def test_sequence_lengths_and_median(self):
        lengths = finetune.sequence_lengths(14)
        self.assertEqual(lengths, finetune.sequence_lengths(14))  # every allocator sees the same
        self.assertEqual(lengths[:3], finetune.sequence_lengths(3))  # a smoke run sees a prefix
        self.assertTrue(all(finetune.MIN_LEN <= n <= finetune.MAX_LEN for n in lengths))
        self.assertGreater(len(set(lengths)), 10)
        self.assertEqual(finetune.median_step([9.0, 8.0, 1.0, 2.0, 3.0]), 2.0)  # steps 1 and 2 ignored
        self.assertEqual(finetune.median_step([5.0, 1.0]), 3.0)

    def test_oom_recognised_in_torch_and_glake_errors(self):
        class OutOfMemoryError(RuntimeError):
            pass

        self.assertTrue(finetune.is_oom(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")))
        self.assertTrue(finetune.is_oom(RuntimeError("glake::stitching_allocator: out of memory allocating 2.00 GiB")))
        self.assertFalse(finetune.is_oom(RuntimeError("CUDA error: an illegal memory access was encountered")))

    def test_help_and_bad_lists_need_no_torch(self):
        script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "finetune.py")
        env = dict(os.environ, PYTHONPATH="")
        shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, env=env)
        self.assertEqual(shown.returncode, 0)
        self.assertIn("--fsdp N", shown.stdout)
        refused = subprocess.run([sys.executable, script, "--strategies", "R,X"], capture_output=True, text=True, env=env)
        self.assertEqual(refused.returncode, 2)
        self.assertIn("X: choose from N,R,LR,LO", refused.stderr)


class DriverKindDeltas(unittest.TestCase):
    def test_each_kind_gets_its_calls_and_milliseconds_and_the_totals_are_no_kind(self):
        last = {"driver_map": 10, "driver_map_ns": 5_000_000, "driver_set_access": 1, "driver_set_access_ns": 1_000_000,
                "driver_calls": 11, "driver_ns": 6_000_000, "stitches": 3}
        now = {"driver_map": 14, "driver_map_ns": 7_500_000, "driver_set_access": 3, "driver_set_access_ns": 9_000_000,
               "driver_calls": 17, "driver_ns": 16_500_000, "stitches": 4}
        self.assertEqual(finetune.driver_kind_deltas(now, last), {"map": (4, 2.5), "set_access": (2, 8.0)})


if __name__ == "__main__":
    unittest.main()

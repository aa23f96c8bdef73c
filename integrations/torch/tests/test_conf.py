"""PYTORCH_CUDA_ALLOC_CONF read for glake (glake_torch/_conf.py), the package's names and version,
and the error without the NVIDIA driver; without torch or a GPU. With $GLAKE_TORCH_SIM_LIBRARY
(set by CTest), also the settings the plug-in library then uses.

Run: ctest -R torch_plugin.python, or python3 -m unittest discover -s integrations/torch/tests -p test_conf.py
"""

import ctypes
import os
import subprocess
import sys
import unittest
import warnings
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import glake_torch  # noqa: E402
from glake_torch import _conf  # noqa: E402

SIM = os.environ.get("GLAKE_TORCH_SIM_LIBRARY")


class TranslateTest(unittest.TestCase):
    def test_expandable_segments_maps_to_stitching_that_grows(self):
        self.assertEqual(_conf.translate("expandable_segments:True"), ("stitching:true,grow_stitch:true", []))

    def test_keys_without_an_equivalent_are_named_with_a_reason(self):
        glake, ignored = _conf.translate("max_split_size_mb:128, garbage_collection_threshold:0.6")
        self.assertEqual(glake, "")
        self.assertEqual([key for key, _ in ignored], ["max_split_size_mb", "garbage_collection_threshold"])
        self.assertTrue(all(reason for _, reason in ignored))

    def test_bracketed_values_keep_their_commas(self):
        glake, ignored = _conf.translate("roundup_power2_divisions:[256:1,512:2,>:8],expandable_segments:True")
        self.assertEqual(glake, "stitching:true,grow_stitch:true")
        self.assertEqual([key for key, _ in ignored], ["roundup_power2_divisions"])

    def test_pinned_host_keys_stay_pytorchs_without_a_warning(self):
        self.assertEqual(_conf.translate("pinned_use_cuda_host_register:True,pinned_num_register_threads:8"), ("", []))

    def test_expandable_segments_false_and_bad_values_and_unknown_keys_are_ignored(self):
        glake, ignored = _conf.translate("expandable_segments:False,expandable_segments:maybe,colour:blue,lonely")
        self.assertEqual(glake, "")
        keys = [key for key, _ in ignored]
        self.assertEqual(keys, ["expandable_segments", "expandable_segments", "colour", "lonely"])
        self.assertIn("'maybe' is not True or False", ignored[1][1])
        self.assertIn("not a key", ignored[2][1])

    def test_empty_text_means_nothing(self):
        self.assertEqual(_conf.translate(""), ("", []))
        self.assertEqual(_conf.translate(" , ,"), ("", []))


class FoldTest(unittest.TestCase):
    def setUp(self):
        _conf._warned.clear()

    def fold(self, environ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            glake = _conf.fold_pytorch_conf(environ)
        return glake, [str(w.message) for w in caught]

    def test_glake_alloc_conf_wins_over_the_mapped_keys(self):
        environ = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "GLAKE_ALLOC_CONF": "grow_stitch:false"}
        self.assertEqual(self.fold(environ), ("stitching:true,grow_stitch:true", []))
        self.assertEqual(environ["GLAKE_ALLOC_CONF"], "stitching:true,grow_stitch:true,grow_stitch:false")

    def test_folding_twice_or_in_a_child_prepends_once(self):
        environ = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        self.fold(environ)
        child = dict(environ)
        self.fold(environ)
        self.fold(child)
        self.assertEqual(environ["GLAKE_ALLOC_CONF"], "stitching:true,grow_stitch:true")
        self.assertEqual(child["GLAKE_ALLOC_CONF"], "stitching:true,grow_stitch:true")

    def test_one_warning_line_names_each_ignored_key_once_per_process(self):
        environ = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True,backend:native"}
        _, messages = self.fold(environ)
        self.assertEqual(len(messages), 1)
        self.assertNotIn("\n", messages[0])
        self.assertIn("PYTORCH_CUDA_ALLOC_CONF", messages[0])
        self.assertIn("max_split_size_mb (", messages[0])
        self.assertIn("backend (", messages[0])
        self.assertNotIn("expandable_segments (", messages[0])
        self.assertEqual(self.fold(environ)[1], [])

    def test_pytorch_cuda_alloc_conf_comes_before_pytorch_alloc_conf(self):
        environ = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        self.assertEqual(_conf.pytorch_conf(environ), ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
        del environ["PYTORCH_CUDA_ALLOC_CONF"]
        self.assertEqual(_conf.pytorch_conf(environ), ("PYTORCH_ALLOC_CONF", "max_split_size_mb:1"))

    def test_without_pytorchs_variables_nothing_changes(self):
        environ = {"GLAKE_ALLOC_CONF": "reuse_limit:3"}
        self.assertEqual(self.fold(environ), ("", []))
        self.assertEqual(environ, {"GLAKE_ALLOC_CONF": "reuse_limit:3"})


@unittest.skipUnless(SIM and os.path.isfile(SIM), "GLAKE_TORCH_SIM_LIBRARY is not set (run through ctest)")
class LibrarySettingsTest(unittest.TestCase):
    """The settings libglake_torch reads, in a fresh process (the library reads them once)."""

    def settings(self, **environ):
        env = {k: v for k, v in os.environ.items() if k not in ("GLAKE_ALLOC_CONF", "reAlloc", *_conf.VARIABLES)}
        env.update(environ)
        code = "import glake_torch, sys; print(glake_torch.settings(), file=sys.stdout)"
        run = subprocess.run([sys.executable, "-c", code], env=dict(env, GLAKE_TORCH_LIBRARY=SIM,
                             PYTHONPATH=os.path.dirname(HERE)), capture_output=True, text=True, timeout=60)
        self.assertEqual(run.returncode, 0, run.stderr)
        return run.stdout.strip(), run.stderr

    def test_expandable_segments_wins_over_gmlake_and_loses_to_glake_alloc_conf(self):
        settings, _ = self.settings(reAlloc="0")
        self.assertIn("grow_stitch:false", settings)
        settings, stderr = self.settings(reAlloc="0", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True,max_split_size_mb:64")
        self.assertIn("grow_stitch:true", settings)
        self.assertIn("max_split_size_mb", stderr)
        settings, _ = self.settings(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", GLAKE_ALLOC_CONF="grow_stitch:false")
        self.assertIn("grow_stitch:false", settings)


class PackageTest(unittest.TestCase):
    def test_version_and_every_public_name_exported(self):
        self.assertRegex(glake_torch.__version__, r"^\d+\.\d+\.\d+")
        for name in ("Scheduler", "share_weights", "load_safetensors", "enable", "stats", "DriverNotFoundError"):
            self.assertIn(name, glake_torch.__all__)
        public = {name for name, value in vars(glake_torch).items()
                  if not name.startswith("_") and getattr(value, "__module__", None) == "glake_torch"}
        self.assertEqual(public - set(glake_torch.__all__), set())
        self.assertEqual([name for name in glake_torch.__all__ if not hasattr(glake_torch, name)], [])

    def test_a_missing_driver_is_named_not_a_loader_message(self):
        def no_driver(path):
            raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")

        with mock.patch.object(ctypes, "CDLL", no_driver):
            with self.assertRaises(glake_torch.DriverNotFoundError) as raised:
                glake_torch._open_library("/x/libglake_torch.so")
        self.assertIn("NVIDIA driver", str(raised.exception))
        self.assertIsInstance(raised.exception, OSError)


if __name__ == "__main__":
    unittest.main()

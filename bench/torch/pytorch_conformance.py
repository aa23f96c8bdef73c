#!/usr/bin/env python3
"""PyTorch's own allocator tests as glake's conformance suite.

Runs the allocator-related tests of PyTorch's test/test_cuda.py and the whole of
test/inductor/test_cudagraph_trees.py twice under pytest: once with PyTorch's native caching
allocator (the baseline), once with glake enabled before CUDA initialises (a sitecustomize.py
bootstrap on PYTHONPATH calls glake_torch.enable() when GLAKE_CONFORMANCE=1). A test that fails
natively on the machine is not counted against glake.

Selection rule (stated in the report): every test collected from test_cudagraph_trees.py, and
every test of test_cuda.py whose node id (class and name, case-insensitive) matches SELECT_PATTERN.

The test files must be those of the installed torch's tag; they are passed with --tests-dir
(a folder holding test/test_cuda.py, test/inductor/test_cudagraph_trees.py and what they import
from the test tree) and are not part of this repository.

  python3 bench/torch/pytorch_conformance.py --tests-dir .pytorch-tests \
      --out $OUT/conformance.jsonl --markdown $OUT/conformance.md --max-seconds 480
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

SELECT_PATTERN = re.compile(
    r"memory|alloc|cach|graph|snapshot|oom|out_of_memory|pool|stats|empty_cache|record_stream|"
    r"fraction|ipc|expandable|segment|trace|peak|reserved|free|checkpoint", re.IGNORECASE)
WHOLE_FILES = ("test/inductor/test_cudagraph_trees.py",)
FILTERED_FILES = ("test/test_cuda.py",)

BOOTSTRAP = '''\
import os
if os.environ.get("GLAKE_CONFORMANCE") == "1":
    _out = os.environ.get("GLAKE_CONFORMANCE_BACKEND_FILE")
    try:
        import glake_torch
        _lib = os.environ.get("GLAKE_CONFORMANCE_LIBRARY")
        glake_torch.enable(library=_lib) if _lib else glake_torch.enable()
        _b = getattr(glake_torch, "backend", None)
        _said = str(_b()) if callable(_b) else "unknown (glake_torch.backend() absent)"
    except BaseException as e:  # Python would print it and go on with the native allocator
        _said = "enable failed: %r" % (e,)
        if _out:
            with open(_out, "w") as f:
                f.write(_said)
        os._exit(3)
    if _out:
        with open(_out, "w") as f:
            f.write(_said)
'''


def select(node_ids):
    """Keeps the node ids the rule selects; node ids are 'path::Class::name' as pytest prints."""
    kept = []
    for nid in node_ids:
        path = nid.split("::", 1)[0]
        if any(path.endswith(w) for w in WHOLE_FILES):
            kept.append(nid)
        elif any(path.endswith(f) for f in FILTERED_FILES):
            if SELECT_PATTERN.search(nid.split("::", 1)[1] if "::" in nid else ""):
                kept.append(nid)
    return kept


def parse_collect(text):
    """Node ids from `pytest --collect-only -q` output (lines holding '::')."""
    return [ln.strip() for ln in text.splitlines() if "::" in ln and not ln.startswith(("=", " "))]


def parse_junit(path):
    """{test id: (outcome, first line of message)}; outcome passed|failed|error|skipped."""
    results = {}
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        tid = "%s::%s" % (case.get("classname", ""), case.get("name", ""))
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                text = el.get("message") or (el.text or "")
                msg = text.strip().splitlines()[0] if text.strip() else ""
                break
        results[tid] = (outcome, msg[:300])
    return results


def counts(results):
    c = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for outcome, _ in results.values():
        c[outcome] = c.get(outcome, 0) + 1
    return c


def regressions(native, glake):
    """Tests that fail or error under glake but pass (or skip) natively, with glake's message."""
    bad = ("failed", "error")
    return sorted((tid, glake[tid][1]) for tid in glake
                  if glake[tid][0] in bad and native.get(tid, ("missing", ""))[0] not in bad)


def write_markdown(path, meta, native, glake):
    reg = regressions(native, glake)
    cn, cg = counts(native), counts(glake)
    lines = ["# PyTorch's allocator tests under glake", "",
             "- torch: %s; tests from: %s" % (meta.get("torch"), meta.get("tests_source")),
             "- glake backend: %s" % meta.get("backend"),
             "- rule: every test of %s; tests of %s whose id matches `%s` (case-insensitive)"
             % (", ".join(WHOLE_FILES), ", ".join(FILTERED_FILES), SELECT_PATTERN.pattern),
             "- selected: %s tests; command: `%s`" % (meta.get("selected"), meta.get("command")), "",
             "| allocator | passed | failed | error | skipped | run (no result) |", "|---|---|---|---|---|---|"]
    for name, r, c in (("native", native, cn), ("glake", glake, cg)):
        lines.append("| %s | %d | %d | %d | %d | %d |" % (name, c["passed"], c["failed"], c["error"],
                                                         c["skipped"], meta.get("selected", 0) - len(r)))
    lines += ["", "## Failing under glake, not natively (%d)" % len(reg), "",
              "| test | first line of the error | fix or reason |", "|---|---|---|"]
    for tid, msg in reg:
        lines.append("| `%s` | %s | |" % (tid, msg.replace("|", "\\|")))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def run_pytest(python, node_ids, junit, env, per_test, seconds, cwd):
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--junitxml=" + junit,
           "-o", "junit_family=xunit1"]
    if per_test and subprocess.run([python, "-c", "import pytest_timeout"], capture_output=True).returncode == 0:
        cmd += ["--timeout=%d" % per_test]  # pytest-timeout, loaded by its entry point
    cmd += node_ids
    try:
        p = subprocess.run(cmd, env=env, cwd=cwd, timeout=seconds, capture_output=True, text=True)
        return p.returncode, p.stdout[-4000:] + p.stderr[-4000:]
    except subprocess.TimeoutExpired as e:
        return 124, "timed out after %ds" % seconds


def local_imports(source, names):
    """Modules of the test tree `source` imports: `import x` / `from x[.y] import` whose first
    name is one of `names` (the test tree's top-level modules and packages)."""
    found = set()
    for m in re.finditer(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", source, re.MULTILINE):
        mod = m.group(1) or m.group(2)
        if mod.split(".")[0] in names:
            found.add(mod)
    return sorted(found)


def extract(git_dir, ref, dest):
    """Writes the selected files of PyTorch's test tree at `ref` (and the test-tree modules they
    import, transitively) from a git directory into dest; records the commit in dest/SOURCE."""
    def git(*args):
        return subprocess.run(["git", "--git-dir", git_dir] + list(args), check=True,
                              capture_output=True, text=True).stdout
    commit = git("rev-parse", ref + "^{commit}").strip()
    tree = set(git("ls-tree", "-r", "--name-only", commit, "test/").split())
    roots = {p.split("/")[1].rsplit(".py", 1)[0] for p in tree}
    todo, done = list(WHOLE_FILES + FILTERED_FILES), set()
    while todo:
        path = todo.pop()
        if path in done or path not in tree:
            continue
        done.add(path)
        text = git("show", "%s:%s" % (commit, path))
        target = os.path.join(dest, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(text)
        for mod in local_imports(text, roots):
            parts = mod.split(".")
            for n in range(len(parts), 0, -1):
                base = "test/" + "/".join(parts[:n])
                todo += [base + ".py", base + "/__init__.py"]
    with open(os.path.join(dest, "SOURCE"), "w") as f:
        f.write("pytorch %s (%s)\n" % (ref, commit))
    return sorted(done)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests-dir", required=True, help="folder holding test/test_cuda.py etc.")
    ap.add_argument("--library", help="glake_torch's shared library (optional)")
    ap.add_argument("--out", required=True, help="JSON lines: one line per test and allocator")
    ap.add_argument("--markdown", required=True)
    ap.add_argument("--max-seconds", type=int, default=480, help="the whole run, both allocators")
    ap.add_argument("--per-test-seconds", type=int, default=60)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--extract-from", metavar="GIT_DIR",
                    help="first write the test files into --tests-dir from PyTorch's git directory")
    ap.add_argument("--ref", default="v2.11.0", help="tag or commit for --extract-from")
    ap.add_argument("--collect-only", action="store_true", help="print the selection and stop")
    a = ap.parse_args()
    start = time.time()
    tests_dir = os.path.abspath(a.tests_dir)
    if a.extract_from:
        for p in extract(a.extract_from, a.ref, tests_dir):
            print("extracted", p, file=sys.stderr)
    files = [f for f in WHOLE_FILES + FILTERED_FILES if os.path.isfile(os.path.join(tests_dir, f))]
    if not files:
        sys.exit("pytorch_conformance: no %s under %s" % (" or ".join(WHOLE_FILES + FILTERED_FILES), tests_dir))
    base_env = dict(os.environ)
    base_env.pop("GLAKE_CONFORMANCE", None)
    # PyTorch's tests import each other as top-level modules of test/ (e.g. `from inductor...`).
    base_env["PYTHONPATH"] = os.pathsep.join([os.path.join(tests_dir, "test")] + (
        [base_env["PYTHONPATH"]] if base_env.get("PYTHONPATH") else []))
    col = subprocess.run([a.python, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q"] + files,
                         cwd=tests_dir, env=base_env, capture_output=True, text=True, timeout=300)
    selected = select(parse_collect(col.stdout))
    if not selected:
        sys.exit("pytorch_conformance: nothing selected; collection said:\n" + col.stdout[-3000:] + col.stderr[-3000:])
    if a.collect_only:
        print("\n".join(selected))
        print("%d selected" % len(selected), file=sys.stderr)
        return
    work = tempfile.mkdtemp(prefix="glake-conformance-")
    with open(os.path.join(work, "sitecustomize.py"), "w") as f:
        f.write(BOOTSTRAP)
    here = os.path.dirname(os.path.abspath(__file__))
    pkg = os.path.join(here, "..", "..", "integrations", "torch")
    results, logs = {}, {}
    for i, mode in enumerate(("native", "glake")):
        env = dict(base_env)
        if mode == "glake":
            env["GLAKE_CONFORMANCE"] = "1"
            env["GLAKE_CONFORMANCE_BACKEND_FILE"] = os.path.join(work, "backend.txt")
            env["PYTHONPATH"] = os.pathsep.join([work, pkg] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
            if a.library:
                env["GLAKE_CONFORMANCE_LIBRARY"] = os.path.abspath(a.library)
        left = a.max_seconds - (time.time() - start)
        junit = os.path.join(work, mode + ".xml")
        rc, logs[mode] = run_pytest(a.python, selected, junit, env, a.per_test_seconds,
                                    max(30, left / (2 - i)), tests_dir)
        results[mode] = parse_junit(junit) if os.path.exists(junit) else {}
        print("%s: rc %d, %s" % (mode, rc, counts(results[mode])), file=sys.stderr)
    backend = "not reported (the glake run did not start)"
    if os.path.exists(os.path.join(work, "backend.txt")):
        backend = open(os.path.join(work, "backend.txt")).read().strip()
    if backend.startswith("enable failed"):
        print("pytorch_conformance: glake_torch.enable() failed: " + backend, file=sys.stderr)
    torch_version = subprocess.run([a.python, "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True).stdout.strip()
    src = os.path.join(tests_dir, "SOURCE")
    meta = {"torch": torch_version, "backend": backend, "selected": len(selected),
            "tests_source": open(src).read().strip() if os.path.exists(src) else tests_dir,
            "command": " ".join(sys.argv)}
    with open(a.out, "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for mode in results:
            for tid, (outcome, msg) in sorted(results[mode].items()):
                f.write(json.dumps({"allocator": mode, "test": tid, "outcome": outcome, "message": msg}) + "\n")
        for mode in logs:
            f.write(json.dumps({"allocator": mode, "log_tail": logs[mode]}) + "\n")
    write_markdown(a.markdown, meta, results.get("native", {}), results.get("glake", {}))
    if backend.startswith("enable failed") or not results.get("glake"):
        sys.exit(2)


if __name__ == "__main__":
    main()

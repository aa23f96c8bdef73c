#!/usr/bin/env python3
"""Fails when an include in include/glake runs back up a layer (docs/architecture.md).

Every header belongs to one layer, found from its path by LAYERS (first match wins). A header
may include headers of its own layer and of the layers it builds on (BUILDS_ON, transitively);
any other include is a violation, unless it is listed in EXCEPTIONS. An exception that no longer
occurs is reported too, so that the list only shrinks.

  tools/check_layers.py [ROOT]      check ROOT/include/glake (ROOT: the repository, by default)
  tools/check_layers.py --self-test check that a made-up upward include is caught
Exit status: 0 clean, 1 violations or stale exceptions, 2 a header no layer claims.
"""
import fnmatch
import pathlib
import re
import sys
import tempfile

# (path glob under include/glake, layer). First match wins.
LAYERS = [
    ("glake.hpp", "umbrella"),
    ("presets.hpp", "presets"),
    ("cuda_presets.hpp", "presets"),
    # A freestanding container (it includes nothing of glake) that the host backend keeps its
    # file ranges in: below the backends, beside the vocabulary.
    ("detail/node_pool.hpp", "core"),
    ("*.hpp", "core"),  # top-level: errors, stream, statistics, memory_state, config, ...
    ("backends/*", "backends"),
    # Shared infrastructure: accounting, driver meter, worker pool, and the archetypes of the
    # concepts (a provider, a copy backend, an allocator) that static_asserts check.
    ("detail/*", "detail"),
    ("policies/*", "policies"),
    ("ipc/*", "ipc"),
    ("movers/*", "movers"),
    ("allocators/*", "allocators"),
    ("adaptors/*", "adaptors"),
    ("sharing/*", "sharing"),
    ("scheduling/*", "scheduling"),
]

# layer -> the layers it may include directly (besides itself); closed transitively below.
BUILDS_ON = {
    "core": [],
    "backends": ["core"],
    "detail": ["backends"],
    "policies": ["detail"],
    "ipc": ["detail"],
    "movers": ["policies"],
    "allocators": ["movers"],
    "adaptors": ["allocators"],
    "sharing": ["ipc", "allocators"],
    "scheduling": ["ipc", "allocators"],
    "presets": ["allocators"],
    "umbrella": ["adaptors", "sharing", "scheduling", "presets"],
}

# Known upward includes, (from, to) as paths under include/glake: none. Add nothing here; move the
# header to the layer it belongs to instead.
EXCEPTIONS = set()

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](glake/[^>"]+)[>"]', re.M)


def layer_of(rel):
    for pattern, layer in LAYERS:
        if fnmatch.fnmatchcase(rel, pattern) and ("/" in pattern or "/" not in rel):
            return layer
    return None


def allowed(layer):
    seen, todo = {layer}, [layer]
    while todo:
        for lower in BUILDS_ON[todo.pop()]:
            if lower not in seen:
                seen.add(lower)
                todo.append(lower)
    return seen


def check(root, exceptions=EXCEPTIONS, out=sys.stdout):
    base = pathlib.Path(root) / "include" / "glake"
    headers = sorted(p for p in base.rglob("*") if p.suffix in (".hpp", ".h", ".cuh"))
    if not headers:
        print(f"check_layers: no headers under {base}", file=out)
        return 2
    status, met = 0, set()
    for path in headers:
        rel = path.relative_to(base).as_posix()
        layer = layer_of(rel)
        if layer is None:
            print(f"{rel}: no layer claims this header (add it to LAYERS in {__file__})", file=out)
            status = 2
            continue
        for target in INCLUDE.findall(path.read_text(encoding="utf-8")):
            target = target[len("glake/"):]
            target_layer = layer_of(target)
            if target_layer is None or target_layer in allowed(layer):
                continue
            if (rel, target) in exceptions:
                met.add((rel, target))
                continue
            print(f"{rel} ({layer}) includes {target} ({target_layer}): runs back up a layer", file=out)
            status = max(status, 1)
    for rel, target in sorted(set(exceptions) - met):
        print(f"stale exception: {rel} no longer includes {target} across layers; remove it "
              f"from EXCEPTIONS", file=out)
        status = max(status, 1)
    if status == 0:
        print(f"check_layers: {len(headers)} headers, no include runs back up a layer "
              f"({len(met)} known exceptions)", file=out)
    return status


def self_test():
    """A backend that includes an allocator must be caught; the same tree without it passes."""
    import io
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp) / "include" / "glake"
        (base / "backends").mkdir(parents=True)
        (base / "allocators").mkdir()
        (base / "errors.hpp").write_text("#pragma once\n")
        (base / "allocators" / "a.hpp").write_text('#include "glake/backends/b.hpp"\n')
        (base / "backends" / "b.hpp").write_text('#include "glake/errors.hpp"\n')
        clean = check(tmp, exceptions=set(), out=io.StringIO())
        (base / "backends" / "b.hpp").write_text('#include "glake/allocators/a.hpp"\n')
        report = io.StringIO()
        caught = check(tmp, exceptions=set(), out=report)
        stale = check(tmp, exceptions={("backends/b.hpp", "allocators/a.hpp"),
                                       ("allocators/a.hpp", "errors.hpp")}, out=io.StringIO())
    ok = clean == 0 and caught == 1 and "runs back up" in report.getvalue() and stale == 1
    print("check_layers self-test:", "passed" if ok else
          f"FAILED (clean tree {clean}, upward include {caught}, stale exception {stale})")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    root = sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent
    sys.exit(check(root))

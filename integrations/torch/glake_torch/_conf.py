"""PyTorch's allocator settings read for glake: PYTORCH_CUDA_ALLOC_CONF (else PYTORCH_ALLOC_CONF, in
PyTorch's order), "key:value,...", as PyTorch 2.11 spells them.

Each of PyTorch's keys has one fate, from the table KEYS below:
  mapped     glake has the same behaviour under its own name: the glake setting is written into
             GLAKE_ALLOC_CONF ahead of the text already there, so GLAKE_ALLOC_CONF wins, and both
             win over GMLake's variables
  PyTorch's  the key sets PyTorch's pinned host allocator, which stays PyTorch's under glake
  ignored    glake has no equivalent; one warning names every such key with the reason

The plug-in library reads only GLAKE_ALLOC_CONF (and GMLake's variables), so the mapping lives
here and reaches it through the process environment, which child processes inherit: folding
again there changes nothing (the mapped text is not prepended twice)."""

import os
import sys
import warnings

# PyTorch's variables, in the order its CUDA allocator reads them: the first one set is used.
VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _expandable_segments(value):
    """PyTorch grows one virtual range per stream by mapping physical memory at its end; glake's
    stitching maps free physical memory into one virtual range on demand, and grow_stitch creates
    only the missing bytes (the plug-in's default)."""
    if value.lower() in _TRUE:
        return "stitching:true,grow_stitch:true"
    if value.lower() in _FALSE:
        return None  # glake's stitching stays on: it is what glake is for
    raise ValueError(f"{value!r} is not True or False")


PYTORCH = "PyTorch's"

# key -> a function of the value returning glake's "key:value" text, PYTORCH (the key stays
# PyTorch's), or the reason it is ignored. A mapping function returns None (ignored, with the
# reason in its own text) or raises ValueError for a value PyTorch would reject.
KEYS = {
    "expandable_segments": _expandable_segments,
    "max_split_size_mb": "glake stitches free blocks into one range instead of keeping large blocks whole",
    "max_non_split_rounding_mb": "glake splits the blocks it reuses at large_round_to",
    "roundup_power2_divisions": "glake rounds requests up to round_to and large_round_to",
    "garbage_collection_threshold": "glake releases cached memory only before refusing a request",
    "large_segment_size_mb": "glake takes new memory in handles of up to max_handle",
    "per_process_memory_fraction": "call torch.cuda.set_per_process_memory_fraction, which glake honours",
    "backend": "glake replaces PyTorch's CUDA allocator",
    "release_lock_on_cudamalloc": "glake's locking is its own",
    "graph_capture_record_stream_reuse": "glake's graph pools follow their own rules",
    "pinned_use_cuda_host_register": PYTORCH,
    "pinned_num_register_threads": PYTORCH,
    "pinned_use_background_threads": PYTORCH,
    "pinned_reserve_segment_size_mb": PYTORCH,
}


def _entries(text):
    """(key, value) pairs of "key:value,key:[v,v],..." as PyTorch tokenizes it (whitespace
    dropped, commas inside brackets belong to the value); a token without ':' has value None."""
    entries, depth, token = [], 0, ""
    for ch in text + ",":
        if ch == "," and depth == 0:
            key, colon, value = token.partition(":")
            if key:
                entries.append((key, value if colon else None))
            token = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if not ch.isspace():
            token += ch
    return entries


def translate(text):
    """(glake_text, ignored): glake's "key:value,..." for PyTorch's `text`, and [(key, reason)]
    for each key with no meaning for glake, in the order given."""
    mapped, ignored = [], []
    for key, value in _entries(text or ""):
        fate = KEYS.get(key)
        if fate is None:
            ignored.append((key, "not a key of PyTorch 2.11's CUDA allocator"))
        elif fate is PYTORCH:
            continue
        elif isinstance(fate, str):
            ignored.append((key, fate))
        elif value is None:
            ignored.append((key, "no value"))
        else:
            try:
                setting = fate(value)
            except ValueError as error:
                ignored.append((key, str(error)))
                continue
            if setting is None:
                ignored.append((key, f"{key}:{value} has no glake equivalent; glake's stitching stays on "
                                     "(stitching:false in GLAKE_ALLOC_CONF turns it off)"))
            else:
                mapped.append(setting)
    return ",".join(mapped), ignored


def pytorch_conf(environ=None):
    """(variable, text) of the PyTorch setting in effect, or (None, None)."""
    environ = os.environ if environ is None else environ
    for name in VARIABLES:
        if environ.get(name):
            return name, environ[name]
    return None, None


_warned = set()


def _caller_level():
    """warnings.warn's stacklevel, from fold_pytorch_conf, of the first frame outside this package."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == os.path.dirname(__file__):
        frame, level = frame.f_back, level + 1
    return level


def fold_pytorch_conf(environ=None):
    """Writes what PyTorch's setting means for glake into GLAKE_ALLOC_CONF, ahead of that
    variable's own text (which therefore wins), and warns once per process, in one line, naming
    each ignored key. Returns glake's text for PyTorch's setting ("" when nothing maps)."""
    environ = os.environ if environ is None else environ
    name, text = pytorch_conf(environ)
    if name is None:
        return ""
    glake, ignored = translate(text)
    if ignored and (name, text) not in _warned:
        _warned.add((name, text))
        reasons = "; ".join(f"{key} ({why})" for key, why in ignored)
        warnings.warn(f"glake_torch: {name} keys ignored under glake: {reasons}. glake's settings are "
                      "GLAKE_ALLOC_CONF (integrations/torch/README.md)", stacklevel=_caller_level())
    current = environ.get("GLAKE_ALLOC_CONF", "")
    if glake and not current.startswith(glake):
        environ["GLAKE_ALLOC_CONF"] = f"{glake},{current}" if current else glake
    return glake

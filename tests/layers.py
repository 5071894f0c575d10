#!/usr/bin/env python3
"""Check that layers call only down: every quoted #include of a file under src/, tools/ and
python/ names a header of the file's own layer or of a layer below it. And that each of those
files can be held in one's head: at most MAX_LINES lines (split a longer one along its seams).

The layers are read from docs/DESIGN.md, section "Layers": the first code block there, one
layer a line, top to bottom; the path or paths that open a line (up to the first run of two
spaces) name the layer, and a line that opens with a space continues the one above. A file
belongs to the layer of the longest path that is a prefix of its own.

Usage: layers.py SOURCE_ROOT [--list]   (--list prints each file's layer)
       layers.py --selftest              (the checker on a small tree of its own)
Exit 0 when every include goes down or sideways, 1 with one line for each that goes up,
2 when the list cannot be read or a header cannot be found.
"""
import io
import os
import re
import sys
import tempfile
from contextlib import redirect_stdout

SCANNED = ("src", "tools", "python")
MAX_LINES = 900
INCLUDE_DIRS = ("include", "src", ".")  # as meson.build's `inc`, after the file's own folder
# Headers the build writes: they belong to the layer of the folder that writes them.
GENERATED = {"zinf_build.h": "src/", "cmd_pages.h": "tools/"}


def read_layers(root):
    path = os.path.join(root, "docs", "DESIGN.md")
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        sys.exit(f"layers: cannot read {path}: {e.strerror}")
    m = re.search(r"^## Layers\b.*?^```\n(.*?)^```", text, re.S | re.M)
    if not m:
        sys.exit(f"layers: {path}: no code block under a '## Layers' heading")
    layers = []
    for line in m.group(1).splitlines():
        if not line.strip() or line[0].isspace():
            continue
        head = re.split(r" {2,}", line, maxsplit=1)[0]
        layers.append(head.split(" "))
    if len(layers) < 2:
        sys.exit(f"layers: {path}: the Layers block names {len(layers)} layer(s)")
    for i, paths in enumerate(layers):
        for p in paths:
            if not os.path.exists(os.path.join(root, p)):
                sys.exit(f"layers: {path}: layer {i + 1} names '{p}', which does not exist")
    return layers


def layer_of(rel, layers):
    best, best_len = None, -1
    for i, paths in enumerate(layers):
        for p in paths:
            if (rel == p or rel.startswith(p if p.endswith("/") else p + "/")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def resolve(root, src_rel, name):
    for d in (os.path.dirname(src_rel),) + INCLUDE_DIRS:
        cand = os.path.normpath(os.path.join(d, name))
        if os.path.isfile(os.path.join(root, cand)):
            return cand
    return GENERATED.get(os.path.basename(name))


def check(root, listing=False):
    layers = read_layers(root)
    names = [" ".join(p) for p in layers]
    bad, files = [], 0
    for top in SCANNED:
        for d, _, fs in os.walk(os.path.join(root, top)):
            for f in sorted(fs):
                if not f.endswith((".c", ".h", ".cu", ".cuh")):
                    continue
                rel = os.path.relpath(os.path.join(d, f), root)
                mine = layer_of(rel, layers)
                if mine is None:
                    print(f"layers: {rel} is in no layer of docs/DESIGN.md")
                    return 2
                files += 1
                if listing:
                    print(f"{rel}: {names[mine]}")
                with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
                    lines = fh.readlines()
                if len(lines) > MAX_LINES:
                    bad.append(f"{rel}: {len(lines)} lines, over {MAX_LINES}: split it by concern")
                for n, line in enumerate(lines, 1):
                    m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                    if not m:
                        continue
                    hdr = resolve(root, rel, m.group(1))
                    if hdr is None:
                        print(f"layers: {rel}:{n}: \"{m.group(1)}\" is no header of the tree")
                        return 2
                    theirs = layer_of(hdr, layers)
                    if theirs is None:
                        print(f"layers: {rel}:{n}: {hdr} is in no layer of docs/DESIGN.md")
                        return 2
                    if theirs < mine:
                        bad.append(f"{rel}:{n}: includes {hdr}, of the layer "
                                   f"'{names[theirs]}', above its own '{names[mine]}'")
    for b in bad:
        print(b)
    if bad:
        print(f"layers: {len(bad)} problem(s); docs/DESIGN.md, section Layers, gives the order")
        return 1
    print(f"layers: {files} files in {len(layers)} layers, every include goes down or sideways, "
          f"none over {MAX_LINES} lines")
    return 0


def selftest():
    """The checker must fail an include that goes up, name it, and pass the same tree
    without it; a header it cannot find and a file in no layer are errors of their own."""
    design = ("# d\n\n## Layers (top to bottom)\n```\nsrc/top/   upper\n"
              "           more words/with a slash\nsrc/ include/  the base\n```\n")
    files = {"docs/DESIGN.md": design, "include/pub.h": "", "src/base.h": "",
             "src/top/t.h": "", "src/top/t.c": '#include "top/t.h"\n#include "base.h"\n'
             '#include "pub.h"\n', "src/b.c": '#include "base.h"\n'}
    cases = [({}, 0, "every include goes down"),
             ({"src/b.c": '#include "base.h"\n #  include "top/t.h"\n'}, 1,
              "src/b.c:2: includes src/top/t.h, of the layer 'src/top/', above its own 'src/ include/'"),
             ({"src/b.c": '#include "nowhere.h"\n'}, 2, '"nowhere.h" is no header of the tree'),
             ({"src/b.c": "\n" * (MAX_LINES + 1)}, 1, f"src/b.c: {MAX_LINES + 1} lines, over"),
             ({"tools/x.c": ""}, 2, "tools/x.c is in no layer")]  # scanned, in no layer
    for change, want_rc, want_text in cases:
        with tempfile.TemporaryDirectory() as d:
            for rel, text in {**files, **change}.items():
                os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
                with open(os.path.join(d, rel), "w") as fh:
                    fh.write(text)
            out = io.StringIO()
            with redirect_stdout(out):
                rc = check(d)
            if rc != want_rc or want_text not in out.getvalue():
                print(f"layers selftest: case {change}: exit {rc}, printed {out.getvalue()!r}; "
                      f"expected exit {want_rc} and {want_text!r}")
                return 1
    print(f"layers selftest: {len(cases)} cases as expected")
    return 0


def main():
    if sys.argv[1:2] == ["--selftest"]:
        return selftest()
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    return check(sys.argv[1], "--list" in sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())

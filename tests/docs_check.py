#!/usr/bin/env python3
"""Check the documentation's shape: the README stays short, every relative link of the README
and of docs/ leads to a file, docs/README.md (the index) has a line for each page of docs/,
and docs/COMMANDS.md one for each page of docs/commands/.

Usage: docs_check.py SOURCE_ROOT
       docs_check.py --selftest   (the checks on a small tree of their own)
Exit 0 when all holds, 1 with a line for each thing that does not.
"""
import io
import os
import re
import sys
import tempfile
from contextlib import redirect_stdout

README_WORDS = 1200  # what a newcomer reads in five minutes


def links(path):
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # code is not prose
    return [m.group(1) for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
            if not re.match(r"[a-z]+:", m.group(1))]


def check(root):
    bad = []
    readme = os.path.join(root, "README.md")
    words = len(open(readme, encoding="utf-8").read().split())
    if words > README_WORDS:
        bad.append(f"README.md has {words} words, over {README_WORDS}: move the detail into docs/")
    docs = os.path.join(root, "docs")
    pages = [readme] + [os.path.join(d, f) for d, _, fs in os.walk(docs) for f in fs
                        if f.endswith(".md")]
    for p in pages:
        for target in links(p):
            if not os.path.exists(os.path.join(os.path.dirname(p), target)):
                bad.append(f"{os.path.relpath(p, root)}: the link to {target} leads nowhere")
    for index, folder in (("README.md", docs), ("COMMANDS.md", os.path.join(docs, "commands"))):
        listed = {os.path.normpath(os.path.join(docs, t)) for t in links(os.path.join(docs, index))}
        for f in sorted(os.listdir(folder)):
            page = os.path.normpath(os.path.join(folder, f))
            if f.endswith(".md") and f != "README.md" and page not in listed:
                bad.append(f"docs/{index} has no line for {os.path.relpath(page, root)}")
    for b in bad:
        print(b)
    if not bad:
        print(f"docs_check: README.md {words} words; {len(pages)} pages, every link leads to a file, "
              "each page indexed")
    return 1 if bad else 0


def selftest():
    """Each check must fail where it should, naming the problem, and pass the tree without it."""
    good = {"README.md": "zinf. [docs](docs/README.md)\n",
            "docs/README.md": "[a](a.md) [c](COMMANDS.md)\n", "docs/a.md": "```\n[x](gone.md)\n```\n",
            "docs/COMMANDS.md": "[t](commands/t.md)\n", "docs/commands/t.md": "[up](../a.md)\n"}
    cases = [({}, 0, "every link leads to a file"),
             ({"README.md": "word " * (README_WORDS + 1)}, 1, f"{README_WORDS + 1} words, over"),
             ({"docs/a.md": "[x](gone.md)\n"}, 1, "docs/a.md: the link to gone.md leads nowhere"),
             ({"docs/b.md": ""}, 1, "docs/README.md has no line for docs/b.md"),
             ({"docs/commands/u.md": ""}, 1, "docs/COMMANDS.md has no line for docs/commands/u.md")]
    for change, want_rc, want_text in cases:
        with tempfile.TemporaryDirectory() as d:
            for rel, text in {**good, **change}.items():
                os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
                with open(os.path.join(d, rel), "w") as fh:
                    fh.write(text)
            out = io.StringIO()
            with redirect_stdout(out):
                rc = check(d)
            if rc != want_rc or want_text not in out.getvalue():
                print(f"docs_check selftest: case {sorted(change)}: exit {rc}, printed "
                      f"{out.getvalue()!r}; expected exit {want_rc} and {want_text!r}")
                return 1
    print(f"docs_check selftest: {len(cases)} cases as expected")
    return 0


def main():
    if sys.argv[1:2] == ["--selftest"]:
        return selftest()
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    return check(sys.argv[1])


if __name__ == "__main__":
    sys.exit(main())

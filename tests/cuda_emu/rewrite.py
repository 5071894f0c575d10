#!/usr/bin/env python3
"""rewrite.py - turns a CUDA kernel file (kernels/*.cu) into C++ for the CPU emulation.

Usage: rewrite.py IN.cu > OUT.cpp

Each launch `kernel<<<grid, block[, shmem[, stream]]>>>(args)` becomes
`emu_launch(dim3(grid), dim3(block), shmem, stream, [=] { kernel(args); })`: the lambda
captures the arguments by value because the launch runs later, on the stream's worker
thread, after the launcher has returned. Everything else is left as it is; emu.h (which
run.sh force-includes) gives the CUDA qualifiers and built-ins a C++ meaning. A #line
directive and padding with newlines keep every line where it was in IN.cu, so compiler
messages and sanitizer reports name the original file and line.

Not a CUDA parser: it finds `<<<` and `>>>` as text (so a launch inside a comment or a
string is rewritten too) and assumes the kernel name is a plain identifier, optionally
qualified or a template instance, before `<<<` (white space and line breaks may stand
between them).
"""
import sys


def split_top_level(text):
    """Splits text at the commas that are not inside parentheses or brackets."""
    parts, depth, cur = [], 0, ''
    for ch in text:
        if ch in '([':
            depth += 1
        elif ch in ')]':
            depth -= 1
        if ch == ',' and depth == 0:
            parts.append(cur)
            cur = ''
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts]


def matching_paren(src, start):
    """The index of the ')' that closes the '(' at src[start]."""
    depth = 0
    for i in range(start, len(src)):
        if src[i] == '(':
            depth += 1
        elif src[i] == ')':
            depth -= 1
            if depth == 0:
                return i
    raise SystemExit('rewrite.py: unbalanced parentheses after a launch')


def callee_start(src, p):
    """Where the kernel name before the `<<<` at src[p] starts: an identifier, optionally
    qualified, and its template arguments (which may hold spaces and commas); white space
    may stand between it and the `<<<`."""
    q = p
    while q > 0 and src[q - 1].isspace():
        q -= 1
    if q > 0 and src[q - 1] == '>':
        depth = 0
        while q > 0:
            q -= 1
            if src[q] == '>':
                depth += 1
            elif src[q] == '<':
                depth -= 1
                if depth == 0:
                    break
    while q > 0 and (src[q - 1].isalnum() or src[q - 1] in '_:'):
        q -= 1
    return q


def rewrite(src, where):
    out = ['#line 1 "%s"\n' % where.replace('\\', '\\\\').replace('"', '\\"')]
    i = 0
    while True:
        p = src.find('<<<', i)
        if p < 0:
            out.append(src[i:])
            break
        q = callee_start(src, p)
        callee = src[q:p].strip()
        e = src.find('>>>', p)
        if not callee or e < 0:
            raise SystemExit('rewrite.py: %s: a launch without a kernel name or >>>' % where)
        cfg = split_top_level(src[p + 3:e])
        if not 2 <= len(cfg) <= 4:
            raise SystemExit('rewrite.py: %s: launch configuration <<<%s>>>' %
                             (where, src[p + 3:e]))
        a = e + 3
        while src[a].isspace():
            a += 1
        if src[a] != '(':
            raise SystemExit('rewrite.py: %s: no arguments after >>>' % where)
        b = matching_paren(src, a)
        shmem = cfg[2] if len(cfg) > 2 else '0'
        stream = cfg[3] if len(cfg) > 3 else '0'
        launch = 'emu_launch(dim3(%s), dim3(%s), %s, %s, [=] { %s%s; })' % (
            cfg[0], cfg[1], shmem, stream, callee, src[a:b + 1])
        # The launch configuration may have spanned lines: put them back after the call.
        launch += '\n' * (src[q:b + 1].count('\n') - launch.count('\n'))
        out.append(src[i:q])
        out.append(launch)
        i = b + 1
    return ''.join(out)


def main():
    if len(sys.argv) != 2:
        raise SystemExit('usage: rewrite.py IN.cu > OUT.cpp')
    with open(sys.argv[1]) as f:
        sys.stdout.write(rewrite(f.read(), sys.argv[1]))


if __name__ == '__main__':
    main()

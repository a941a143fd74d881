#!/usr/bin/env python3
"""Run the README's code blocks as they are written; fail if one fails.

Every ```sh and ```python block of README.md runs, in order, in a scratch folder that looks like
the repository's root (a symbolic link to each of its top-level entries, so `cargo ...`,
`pip install ./bindings/python` and `bash benches/...` work as written, while what the blocks
create, such as ./teraio-data, stays in the scratch folder, removed at the end):

- a sh block runs with `bash -euo pipefail`; the `teraio` binary is the one `cargo run --release`
  builds (the README puts target/release on PATH);
- a python block runs with the `python` of the virtual environment given (--venv), else of a
  fresh one made in the scratch folder (where the README's `pip install` installs the package);
  a block that imports torch runs when torch is importable there and is reported as skipped,
  with the reason, when it is not.

A block preceded by an HTML comment `<!-- needs: WHAT -->` (gpu, nvme or long) runs only with
the option --WHAT (or --all): a GPU, NVMe drives one may overwrite, or a long run (the test
suite, the peer benchmarks) that CI runs elsewhere or not at all. `<!-- skip: REASON -->` skips
a block, saying why. Blocks are numbered from 1 in the order they appear.

Usage: python3 scripts/readme-blocks.py [--gpu] [--nvme] [--long] [--all] [--venv DIR]
                                        [--only N[,N...]] [--list] [--keep] [README]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDS = ("gpu", "nvme", "long")
FENCE = re.compile(r"^```(\w*)\s*$")
NEEDS_TAG = re.compile(r"^<!--\s*needs:\s*([\w, -]+?)\s*-->\s*$")
SKIP_TAG = re.compile(r"^<!--\s*skip:\s*(.+?)\s*-->\s*$")


class Block:
    def __init__(self, number, lang, line, code, needs, skip):
        self.number, self.lang, self.line, self.code = number, lang, line, code
        self.needs, self.skip = needs, skip

    def title(self):
        first = next((l for l in self.code.splitlines() if l.strip()), "")
        return f"block {self.number} ({self.lang}, README line {self.line}): {first.strip()[:70]}"


def blocks(text):
    """The README's sh and python blocks, with the tags of the comment above each."""
    out, lines, i, tags = [], text.splitlines(), 0, []
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                tags = [lines[i]] if lines[i].lstrip().startswith("<!--") else []
            i += 1
            continue
        lang, start = m.group(1), i + 1
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if lang in ("sh", "bash", "python"):
            needs, skip = [], None
            for t in tags:
                if (n := NEEDS_TAG.match(t.strip())) is not None:
                    needs = [w.strip() for w in n.group(1).split(",") if w.strip()]
                    unknown = [w for w in needs if w not in NEEDS]
                    if unknown:
                        sys.exit(f"README line {start}: unknown needs {unknown} (known: {NEEDS})")
                elif (s := SKIP_TAG.match(t.strip())) is not None:
                    skip = s.group(1)
            lang = "python" if lang == "python" else "sh"
            out.append(Block(len(out) + 1, lang, start, "\n".join(body) + "\n", needs, skip))
        tags = []
    return out


def scratch_root(target):
    """A folder with a link to every top-level entry of the repository (not .git), and `target`
    a link to the cargo target folder (so `$PWD/target/release` is what cargo built)."""
    d = tempfile.mkdtemp(prefix="teraio-readme-")
    for name in os.listdir(ROOT):
        if name in (".git", "target", ".wheels", ".pysite"):
            continue
        os.symlink(os.path.join(ROOT, name), os.path.join(d, name))
    os.makedirs(target, exist_ok=True)
    os.symlink(target, os.path.join(d, "target"))
    return d


def venv_for(args, scratch, env):
    """The virtual environment the python blocks (and the README's pip) use."""
    if args.venv:
        return os.path.abspath(args.venv)
    v = os.path.join(scratch, ".venv")
    print(f"=== a fresh virtual environment for the python blocks: {v}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", v], check=True, env=env)
    return v


def torch_importable(python, env):
    r = subprocess.run([python, "-c", "import torch"], env=env, capture_output=True)
    return r.returncode == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for w in NEEDS:
        ap.add_argument(f"--{w}", action="store_true", help=f"also run blocks that need {w}")
    ap.add_argument("--all", action="store_true", help="run every block (gpu, nvme, long)")
    ap.add_argument("--venv", help="virtual environment of the python blocks (default: a fresh one)")
    ap.add_argument("--only", help="run only these block numbers (comma-separated)")
    ap.add_argument("--list", action="store_true", help="list the blocks and their tags")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("readme", nargs="?", default=os.path.join(ROOT, "README.md"))
    args = ap.parse_args()
    with open(args.readme, encoding="utf-8") as f:
        found = blocks(f.read())
    if not found:
        sys.exit(f"{args.readme}: no sh or python blocks")
    if args.list:
        for b in found:
            tag = f" [needs: {', '.join(b.needs)}]" if b.needs else ""
            tag += f" [skip: {b.skip}]" if b.skip else ""
            print(f"{b.title()}{tag}")
        return 0
    only = {int(n) for n in args.only.split(",")} if args.only else None
    wanted = {w for w in NEEDS if getattr(args, w) or args.all}

    env = dict(os.environ)
    target = os.path.abspath(os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target"))
    scratch = scratch_root(target)
    env["CARGO_TARGET_DIR"] = target  # builds land in the repository's target, not the scratch
    env.pop("VIRTUAL_ENV", None)
    venv = None
    results = []
    try:
        for b in found:
            if only is not None and b.number not in only:
                continue
            missing = [w for w in b.needs if w not in wanted]
            if b.skip:
                results.append((b, "skipped", b.skip))
                continue
            if missing:
                results.append((b, "skipped", f"needs {', '.join(missing)} (--{missing[0]})"))
                continue
            if venv is None:
                venv = venv_for(args, scratch, env)
                env["PATH"] = os.pathsep.join(
                    [os.path.join(venv, "bin"), os.path.join(target, "release"), env["PATH"]]
                )
                env["VIRTUAL_ENV"] = venv
            if b.lang == "python" and re.search(r"^\s*(import|from)\s+(torch|teraio\.torch)\b",
                                                b.code, re.M):
                if not torch_importable(os.path.join(venv, "bin", "python"), env):
                    results.append((b, "skipped", f"torch is not importable in {venv}"))
                    print(f"=== {b.title()}: SKIPPED (torch is not importable in {venv})",
                          flush=True)
                    continue
            print(f"=== {b.title()}", flush=True)
            start = time.time()
            if b.lang == "sh":
                cmd = ["bash", "-euo", "pipefail", "-c", b.code]
            else:
                cmd = [os.path.join(venv, "bin", "python"), "-c", b.code]
            rc = subprocess.run(cmd, cwd=scratch, env=env).returncode
            secs = time.time() - start
            results.append((b, "ok" if rc == 0 else f"FAILED (exit {rc})", f"{secs:.0f} s"))
            print(f"=== block {b.number}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} "
                  f"in {secs:.0f} s", flush=True)
            if rc != 0:
                break
    finally:
        if args.keep:
            print(f"scratch folder kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print("\nREADME blocks:")
    for b, status, why in results:
        print(f"  {status:>18}  {b.title()}  ({why})")
    failed = [b for b, s, _ in results if s.startswith("FAILED")]
    if failed:
        print(f"\n{len(failed)} block(s) failed: the README needs an edit (or the code a fix)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

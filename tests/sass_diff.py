"""``python -m tests.sass_diff A B [--show N] [--rename B_PART=A_PART ...]``: which kernels of two
builds of an extension differ in their SASS, and how (instruction counts, registers, stack).

A and B: the extensions' shared libraries, or build directories holding one (DLM_OPS_BUILD_DIR's
``dlm_diffusion_sm90-...-<hash>``). Each kernel's SASS is compared as instruction text (addresses
and encodings dropped) and classed as identical; renamed (the same sequence with its registers
renamed one-to-one: the same code); same-ops (the same instructions up to register numbers and
branch targets, in another order: what the scheduler makes of a refactor that computes the same
values, but not a proof of it: read the --show diff); or different.
Why: a change meant to touch one kernel can be checked on the workstation to leave every other
kernel byte-for-byte as tested and measured, so a device call need not re-test or re-time those
(sessions 26 and 27 did this by hand: csrc/NOTES.md). ``--show N`` prints a unified diff of the
N-th differing kernel. Needs cuobjdump (CUDA_HOME/bin, PATH, or the copy inside Triton's wheel);
no GPU. Exit status 0 when every kernel is identical or renamed, 1 when any is same-ops or
different or the kernel sets differ, 2 when nothing could be read. A and B may also be cubins
(``nvcc -cubin`` of one translation unit). ``--rename B_PART=A_PART`` (repeatable) replaces
B_PART by A_PART in B's mangled kernel names before they are matched: where a config template
gained a defaulted argument, its kernels' names change but their code should not (session 31:
DkDvConfig's NARROW_, ``--rename Li2ELb0EEEEEv=Li2EEEEEv``).
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_REGISTER = re.compile(r"\b(U?R|U?P)(\d+)\b")  # RZ, PT, URZ, UPT are constants: kept
_BRANCH_TARGET = re.compile(r"\b0x[0-9a-f]+\b")


@dataclass
class Kernel:
    instructions: list[str]
    registers: int | None = None
    stack: int | None = None

    def blanked(self) -> list[str]:
        """The instructions with register numbers and branch targets blanked."""
        out = []
        for ins in self.instructions:
            ins = _REGISTER.sub(lambda m: m.group(1), ins)
            if re.search(r"\b(BRA|BRX|CALL|JMP|BSSY|SSY|PBK)\b", ins):
                ins = _BRANCH_TARGET.sub("ADDR", ins)
            out.append(ins)
        return out


def is_renaming(a: list[str], b: list[str]) -> bool:
    """Whether b is a with its registers renamed one-to-one (the same dataflow, other numbers)."""
    if len(a) != len(b):
        return False
    forward: dict[str, str] = {}
    backward: dict[str, str] = {}
    for x, y in zip(a, b):
        if _REGISTER.sub("#", x) != _REGISTER.sub("#", y):
            return False
        for rx, ry in zip(_REGISTER.finditer(x), _REGISTER.finditer(y)):
            u, v = rx.group(0), ry.group(0)
            if rx.group(1) != ry.group(1) or forward.setdefault(u, v) != v or backward.setdefault(v, u) != u:
                return False
    return True


def cuobjdump() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for candidate in (Path(home) / "bin" / "cuobjdump", shutil.which("cuobjdump")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    try:  # Triton's wheel carries one (how session 26 found it)
        import triton
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(bundled) if bundled.is_file() else None
    except ImportError:
        return None


def parse_sass_lines(text: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass output -> {mangled kernel name: [(address, instruction text)] in order}."""
    kernels: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in text.splitlines():
        header = re.match(r"\s*Function : (\S+)", line)
        if header:
            current = kernels.setdefault(header.group(1), [])
            continue
        address = _ADDRESS.search(line)
        if current is not None and address:
            ins = _ADDRESS.sub("", line).split(";")[0].strip()
            if ins:
                current.append((int(address.group(0)[2:-2], 16), ins))
    return kernels


def parse_sass(text: str) -> dict[str, list[str]]:
    """cuobjdump -sass output -> {mangled kernel name: instruction texts in order}."""
    return {name: [ins for _, ins in lines] for name, lines in parse_sass_lines(text).items()}


def run_cuobjdump(tool: str, flag: str, path: Path) -> str:
    out = subprocess.run([tool, flag, str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{path}: cuobjdump {flag} failed: {out.stderr.strip()[-500:]}")
    return out.stdout


def parse_resources(text: str) -> dict[str, tuple[int, int]]:
    """cuobjdump -res-usage output -> {mangled kernel name: (registers, stack bytes)}."""
    found = {}
    for name, regs, stack in re.findall(r"Function (\S+?):\s*\n\s*REG:(\d+) STACK:(\d+)", text):
        found[name] = (int(regs), int(stack))
    return found


def library(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        libs = sorted(p.glob("*.so"))
        if len(libs) != 1:
            raise SystemExit(f"{p}: expected one shared library, found {len(libs)}")
        return libs[0]
    if not p.is_file():
        raise SystemExit(f"{p}: no such file or directory")
    return p


def kernels_of(path: Path, tool: str) -> dict[str, Kernel]:
    res = parse_resources(run_cuobjdump(tool, "-res-usage", path))
    sass = parse_sass(run_cuobjdump(tool, "-sass", path))
    return {name: Kernel(ins, *res.get(name, (None, None))) for name, ins in sass.items()}


CLASSES = ("identical", "renamed", "same-ops", "differs")


def classify(a: Kernel, b: Kernel) -> str:
    if a.instructions == b.instructions:
        return "identical"
    if is_renaming(a.instructions, b.instructions):
        return "renamed"
    return "same-ops" if sorted(a.blanked()) == sorted(b.blanked()) else "differs"


def demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if not tool or not names:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def compare(a: dict[str, Kernel], b: dict[str, Kernel]) -> tuple[dict[str, str], list[str], list[str]]:
    """({kernel in both: class}, kernels only in a, kernels only in b)."""
    classes = {name: classify(a[name], b[name]) for name in a if name in b}
    return classes, sorted(set(a) - set(b)), sorted(set(b) - set(a))


USAGE = "usage: python -m tests.sass_diff A B [--show N] [--rename B_PART=A_PART ...]"


def renamed(kernels: dict[str, Kernel], renames: list[tuple[str, str]]) -> dict[str, Kernel]:
    """``kernels`` with every (part, replacement) of ``renames`` applied to their names, in order."""
    out = {}
    for name, kernel in kernels.items():
        for part, replacement in renames:
            name = name.replace(part, replacement)
        out[name] = kernel
    return out


def main(argv: list[str]) -> int:
    argv, show, renames = list(argv), None, []
    for flag in ("--show", "--rename"):
        while flag in argv:
            i = argv.index(flag)
            value = argv[i + 1] if i + 1 < len(argv) else ""
            if flag == "--show" and value.isdigit():
                show = int(value)
            elif flag == "--rename" and value.count("=") == 1 and value.split("=")[0]:
                renames.append(tuple(value.split("=")))
            else:
                raise SystemExit(USAGE)
            del argv[i:i + 2]
    args = [x for x in argv if not x.startswith("--")]
    if len(args) != 2 or len(args) != len(argv):
        raise SystemExit(USAGE)
    tool = cuobjdump()
    if tool is None:
        print("cuobjdump not found: set CUDA_HOME, or install triton (its wheel carries one)")
        return 2
    a, b = (kernels_of(library(x), tool) for x in args)
    b = renamed(b, renames)
    if not a or not b:
        print("no kernels found in", args[0] if not a else args[1])
        return 2
    classes, only_a, only_b = compare(a, b)
    counts = {c: sum(v == c for v in classes.values()) for c in CLASSES}
    print(f"{len(a)} / {len(b)} kernels: " + ", ".join(f"{counts[c]} {c}" for c in CLASSES) +
          f"; {len(only_a)} only in A, {len(only_b)} only in B")
    changed = [n for n, c in classes.items() if c != "identical"]
    for i, (name, pretty) in enumerate(zip(changed, demangle(changed))):
        ka, kb = a[name], b[name]
        print(f"[{i}] {classes[name]:9s} {len(ka.instructions):6d} -> {len(kb.instructions):6d} instructions, "
              f"REG {ka.registers} -> {kb.registers}, STACK {ka.stack} -> {kb.stack}  {pretty[:200]}")
    for label, names in (("only in A", only_a), ("only in B", only_b)):
        for pretty in demangle(names):
            print(f"{label}: {pretty[:200]}")
    if show is not None:
        if show >= len(changed):
            raise SystemExit(f"--show {show}: only {len(changed)} kernels changed")
        name = changed[show]
        sys.stdout.writelines(l + "\n" for l in difflib.unified_diff(
            a[name].instructions, b[name].instructions, "A", "B", lineterm="", n=1))
    same = counts["identical"] + counts["renamed"] == len(classes)
    return 0 if same and not only_a and not only_b else 1


if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly
    raise SystemExit(main(sys.argv[1:]))

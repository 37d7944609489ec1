"""Does a C++ exception raised in a JIT-built torch extension end the process on this machine?
``python tests/probe_cpp_exceptions.py`` (CPU only; a C++ compiler; CXX picks another one).

Session 23 (csrc/NOTES.md "Session 23"): on the device machine (Ubuntu 24.04, g++ 13.3, torch 2.11)
an extension built there died with SIGSEGV when a TORCH_CHECK failed, also when the function caught
the c10::Error and rethrew a std::runtime_error, and not on a plain std::runtime_error; the crash is
in c10::Error's construction (its backtrace capture; pytorch/pytorch#117645), not in dlm_ops. It did
not reproduce on every fresh machine. This builds a four-function extension (a failing
TORCH_CHECK, a std::runtime_error, the check caught and rethrown, a failing DLM_CHECK) and calls each in a subprocess,
so a crash is reported as its signal instead of ending the probe. Prints one line per function:
``rc 0 raised ...`` is the healthy answer, ``rc -11`` the crash.

Since session 30 the bindings check with DLM_CHECK (csrc/bindings/check.h: a std::runtime_error,
no c10::Error), and the probe calls it too (``fail_dlm_check``): the exit status is 0 when
DLM_CHECK raises as it should, the machine's TORCH_CHECK crash or not (printed, for the record).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

SOURCE = textwrap.dedent("""
    #include <torch/extension.h>
    #include <stdexcept>
    #include "bindings/check.h"
    void fail_check(int64_t x) { TORCH_CHECK(x < 0, "x must be negative, got ", x); }
    void fail_std(int64_t x) { if (x >= 0) throw std::runtime_error("plain std error"); }
    void fail_rethrown(int64_t x) {
      try { TORCH_CHECK(x < 0, "x must be negative, got ", x); }
      catch (const c10::Error& e) { throw std::runtime_error(e.what_without_backtrace()); }
    }
    void fail_dlm_check(int64_t x) { DLM_CHECK(x < 0, "x must be negative, got ", x); }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
      m.def("fail_check", &fail_check);
      m.def("fail_std", &fail_std);
      m.def("fail_rethrown", &fail_rethrown);
      m.def("fail_dlm_check", &fail_dlm_check);
    }
    """)
FUNCTIONS = ("fail_check", "fail_std", "fail_rethrown", "fail_dlm_check")
CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


def call_in_subprocess(directory: str, function: str) -> str:
    """Load the built module and call one function in a fresh interpreter: its outcome in words."""
    code = textwrap.dedent(f"""
        import torch.utils.cpp_extension as ce
        m = ce.load(name="dlm_probe_exceptions", sources=[{os.path.join(directory, 'probe.cpp')!r}],
                    build_directory={directory!r}, extra_cflags=["-O3"],
                    extra_include_paths=[{CSRC!r}])
        try:
            m.{function}(1)
            print("returned without raising")
        except RuntimeError as e:
            print("raised", str(e).splitlines()[0])
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return f"{function}: rc {r.returncode} {(r.stdout.strip() or r.stderr.strip()[-200:])}"


def main() -> int:
    import torch.utils.cpp_extension as ce

    compiler = os.environ.get("CXX", "c++")
    print("compiler", compiler, ce.get_compiler_abi_compatibility_and_version(compiler), flush=True)
    with tempfile.TemporaryDirectory(prefix="dlm_probe_") as directory:
        with open(os.path.join(directory, "probe.cpp"), "w") as f:
            f.write(SOURCE)
        ce.load(name="dlm_probe_exceptions", sources=[os.path.join(directory, "probe.cpp")],
                build_directory=directory, extra_cflags=["-O3"], extra_include_paths=[CSRC])
        results = [call_in_subprocess(directory, fn) for fn in FUNCTIONS]
    for line in results:
        print(line, flush=True)
    return 0 if " rc 0 raised x must be negative" in results[-1] else 1


if __name__ == "__main__":
    raise SystemExit(main())

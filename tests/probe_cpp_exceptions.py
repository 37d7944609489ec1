"""Does a C++ exception raised in a JIT-built torch extension end the process on this machine?
``python tests/probe_cpp_exceptions.py`` (CPU only; a C++ compiler; CXX picks another one).

Session 23 (csrc/NOTES.md "Session 23"): on the device machine (Ubuntu 24.04, g++ 13.3, torch 2.11)
an extension built there died with SIGSEGV when a TORCH_CHECK failed, also when the function caught
the c10::Error and rethrew a std::runtime_error, and not on a plain std::runtime_error; the crash is
in c10::Error's construction (its backtrace capture; pytorch/pytorch#117645), not in dlm_ops. It did
not reproduce on every fresh machine. This builds a small extension whose functions throw in
different ways and calls each in a subprocess, so a crash is reported as its signal instead of
ending the probe. Prints one line per function: ``rc 0 raised ...`` is the healthy answer, ``rc
-11`` the crash; exit status 0 when nothing crashed.

Session 30 (csrc/NOTES.md "Session 30") on such an image (kernel 6.18.44-fc, /opt/gcc/bin/g++
13.3): fail_check and fail_rethrown crashed, fail_std raised, and so did a check that throws a
std::runtime_error from a [[noreturn]] variadic-template helper after an ostringstream built its
message (a DLM_CHECK tried for the bindings, not kept; fail_helper is it without the template).
So it is not c10::Error's construction. The other functions tell the suspects apart: a throw
from a nested frame (fail_std_nested), an ostringstream before a direct throw (fail_std_stream),
an ostringstream alone (stream_only); loaded_libstdcxx names the libstdc++ and libgcc_s the
process mapped (a libstdc++ older than the compiler's headers is one suspect).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

SOURCE = textwrap.dedent("""
    #include <torch/extension.h>
    #include <fstream>
    #include <sstream>
    #include <stdexcept>
    #include <string>
    void fail_check(int64_t x) { TORCH_CHECK(x < 0, "x must be negative, got ", x); }
    void fail_std(int64_t x) { if (x >= 0) throw std::runtime_error("plain std error"); }
    void fail_rethrown(int64_t x) {
      try { TORCH_CHECK(x < 0, "x must be negative, got ", x); }
      catch (const c10::Error& e) { throw std::runtime_error(e.what_without_backtrace()); }
    }
    [[noreturn]] __attribute__((noinline)) void helper_failed(int64_t x) {
      std::ostringstream s; s << "x must be negative, got " << x; throw std::runtime_error(s.str());
    }
    void fail_helper(int64_t x) { if (x >= 0) helper_failed(x); }
    __attribute__((noinline)) void throw_literal() { throw std::runtime_error("nested std error"); }
    void fail_std_nested(int64_t x) { if (x >= 0) throw_literal(); }
    void fail_std_stream(int64_t x) {
      std::ostringstream s; s << "streamed " << x;
      if (x >= 0) throw std::runtime_error(s.str());
    }
    std::string stream_only(int64_t x) { std::ostringstream s; s << "streamed " << x; return s.str(); }
    std::string loaded_libstdcxx() {
      std::ifstream maps("/proc/self/maps"); std::string line, found;
      while (std::getline(maps, line))
        if (line.find("libstdc++") != std::string::npos || line.find("libgcc_s") != std::string::npos)
          if (found.find(line.substr(line.find('/'))) == std::string::npos) found += line.substr(line.find('/')) + ";";
      return found;
    }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
      m.def("fail_check", &fail_check);
      m.def("fail_std", &fail_std);
      m.def("fail_rethrown", &fail_rethrown);
      m.def("fail_helper", &fail_helper);
      m.def("fail_std_nested", &fail_std_nested);
      m.def("fail_std_stream", &fail_std_stream);
      m.def("stream_only", &stream_only);
      m.def("loaded_libstdcxx", &loaded_libstdcxx);
    }
    """)
FUNCTIONS = ("fail_check", "fail_std", "fail_rethrown", "fail_helper", "fail_std_nested",
             "fail_std_stream", "stream_only", "loaded_libstdcxx")


def call_in_subprocess(directory: str, function: str) -> str:
    """Load the built module and call one function in a fresh interpreter: its outcome in words."""
    code = textwrap.dedent(f"""
        import torch.utils.cpp_extension as ce
        m = ce.load(name="dlm_probe_exceptions", sources=[{os.path.join(directory, 'probe.cpp')!r}],
                    build_directory={directory!r}, extra_cflags=["-O3"])
        try:
            r = m.{function}(1) if {function!r} != "loaded_libstdcxx" else m.loaded_libstdcxx()
            print("returned", r)
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
                build_directory=directory, extra_cflags=["-O3"])
        results = [call_in_subprocess(directory, fn) for fn in FUNCTIONS]
    for line in results:
        print(line, flush=True)
    return 0 if all(" rc 0 " in line for line in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

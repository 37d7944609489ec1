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

Session 31, from the device-built libraries carried back in session 30 (readelf -d, nm -D): they
have no libstdc++.so.6 among their NEEDED entries, i.e. /opt/gcc's g++ links libstdc++
statically, and they export ~4,500 of its std:: / __cxa symbols, so in a process where torch has
loaded the shared libstdc++ some of an extension's libstdc++ calls bind to torch's copy and the
rest stay in its own: the prime suspect. So the probe now builds its module three ways (VARIANTS:
the driver's default; linked against this process's libstdc++ by path, what the dlm_ops builds do
since then, dlm_ops.backends.cutlass.link_flags; the static archives' symbols hidden), prints
each library's NEEDED entries and exported libstdc++ symbols, and the outcome of every function
for each. Exit status 0 when the process-libstdcxx variant did not crash.

Session 32 on the device (csrc/NOTES.md "Session 32"): the default variant exported 3,661
libstdc++ symbols and crashed in every function that builds a message in an ostringstream (even
without a throw), the literal throws raised; the process-libstdcxx and exclude-libs variants were
healthy throughout. The dlm_ops builds keep the process-libstdcxx link.
"""

from __future__ import annotations

import os
import re
import shutil
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


# How the probe module is linked: the driver's default; the libstdc++ of this process named on the
# link line (dlm_ops.backends.cutlass.link_flags: what the extensions do since session 31); the
# static archives' symbols hidden (the other cure, should the first fail).
VARIANTS = {
    "default": lambda: [],
    "process-libstdcxx": lambda: [p for p in [process_libstdcxx()] if p],
    "exclude-libs": lambda: ["-Wl,--exclude-libs,ALL"],
}


def process_libstdcxx() -> str | None:
    from dlm_ops.backends import cutlass

    return cutlass.process_libstdcxx()


def call_in_subprocess(directory: str, name: str, ldflags: list[str], function: str) -> str:
    """Load the built module and call one function in a fresh interpreter: its outcome in words."""
    code = textwrap.dedent(f"""
        import torch.utils.cpp_extension as ce  # the build is done: this loads it
        m = ce.load(name={name!r}, sources=[{os.path.join(directory, 'probe.cpp')!r}],
                    build_directory={directory!r}, extra_cflags=["-O3"], extra_ldflags={ldflags!r})
        try:
            r = m.{function}(1) if {function!r} != "loaded_libstdcxx" else m.loaded_libstdcxx()
            print("returned", r)
        except RuntimeError as e:
            print("raised", str(e).splitlines()[0])
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return f"{function}: rc {r.returncode} {(r.stdout.strip() or r.stderr.strip()[-200:])}"


def dynamic_facts(library: str) -> str:
    """The library's NEEDED entries and how many std:: / __cxa symbols it exports (readelf, nm)."""
    readelf, nm = shutil.which("readelf"), shutil.which("nm")
    facts = []
    if readelf:
        out = subprocess.run([readelf, "-d", library], capture_output=True, text=True).stdout
        facts.append("NEEDED " + ", ".join(re.findall(r"\(NEEDED\).*\[(.*)\]", out)))
    if nm:
        out = subprocess.run([nm, "-D", "--defined-only", library], capture_output=True, text=True).stdout
        exported = [line for line in out.splitlines() if re.search(r"_ZNS|_ZNKS|_ZSt|__cxa_|__gxx_", line)]
        facts.append(f"exports {len(exported)} libstdc++ symbols")
    return "; ".join(facts) or "readelf / nm not found"


def main() -> int:
    import torch.utils.cpp_extension as ce

    compiler = os.environ.get("CXX", "c++")
    print("compiler", compiler, ce.get_compiler_abi_compatibility_and_version(compiler), flush=True)
    for lib in ("libstdc++.so", "libstdc++.a"):
        found = subprocess.run([compiler, f"-print-file-name={lib}"], capture_output=True, text=True)
        print(f"{compiler} -print-file-name={lib}:", found.stdout.strip(), flush=True)
    print("this process's libstdc++:", process_libstdcxx(), flush=True)
    healthy = True
    for variant, flags in VARIANTS.items():
        ldflags, name = flags(), "dlm_probe_exceptions_" + variant.replace("-", "_")
        with tempfile.TemporaryDirectory(prefix="dlm_probe_") as directory:
            with open(os.path.join(directory, "probe.cpp"), "w") as f:
                f.write(SOURCE)
            # A copy: load appends torch's own flags to the list it is given.
            ce.load(name=name, sources=[os.path.join(directory, "probe.cpp")],
                    build_directory=directory, extra_cflags=["-O3"], extra_ldflags=list(ldflags))
            library = os.path.join(directory, name + ".so")
            print(f"== {variant} (extra_ldflags {ldflags}): {dynamic_facts(library)}", flush=True)
            results = [call_in_subprocess(directory, name, ldflags, fn) for fn in FUNCTIONS]
        for line in results:
            print("  " + line, flush=True)
        ok = all(" rc 0 " in line for line in results)
        print(f"  {variant}: {'no crash' if ok else 'CRASHED'}", flush=True)
        healthy &= ok or variant != "process-libstdcxx"
    return 0 if healthy else 1


if __name__ == "__main__":
    raise SystemExit(main())

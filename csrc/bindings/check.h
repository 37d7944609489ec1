// The bindings' argument and CUDA checks: DLM_CHECK(cond, message parts...) and DLM_CUDA_CHECK(err)
// throw a std::runtime_error (Python's RuntimeError, as TORCH_CHECK's c10::Error gives) built from
// the parts, never a c10::Error. Why: on some machines (the device image of sessions 23 and 30,
// Ubuntu 24.04, g++ 13.3, torch 2.11) an extension JIT-built there ends the whole process with
// SIGSEGV as soon as a c10::Error is constructed (its backtrace capture), also when the error is
// caught and rethrown at once, while a plain std::runtime_error raises as it should
// (tests/probe_cpp_exceptions.py tells which a machine does; csrc/NOTES.md "Session 23"). A failed
// check, or a launch error such as a shared-memory size the device refuses, must reach the caller
// as an exception, not as a dead training job.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#if __has_include(<cuda_runtime_api.h>)  // tests/probe_cpp_exceptions.py builds DLM_CHECK without CUDA
#include <cuda_runtime_api.h>
#define DLM_CHECK_WITH_CUDA 1
#endif

namespace dlm_bindings {

template <class... Parts>
[[noreturn]] void check_failed(const char* condition, const Parts&... parts) {
  std::ostringstream message;
  if constexpr (sizeof...(Parts) == 0) {
    message << "expected " << condition;
  } else {
    (message << ... << parts);
  }
  throw std::runtime_error(message.str());
}

#ifdef DLM_CHECK_WITH_CUDA
[[noreturn]] inline void cuda_failed(cudaError_t err, const char* call) {
  throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(err) + " (" +
                           cudaGetErrorName(err) + ", from " + call + ")");
}
#endif

}  // namespace dlm_bindings

#define DLM_CHECK(cond, ...)                                                   \
  do {                                                                         \
    if (!(cond)) ::dlm_bindings::check_failed(#cond, ##__VA_ARGS__);           \
  } while (0)

#define DLM_CUDA_CHECK(expr)                                                   \
  do {                                                                         \
    const cudaError_t dlm_cuda_err_ = (expr);                                  \
    if (dlm_cuda_err_ != cudaSuccess) ::dlm_bindings::cuda_failed(dlm_cuda_err_, #expr); \
  } while (0)

// kvflow._native: pybind11 bindings of the host (and, with the SDK, XPU) block copies.
// Python-facing documentation lives in kernels/native.py and docs/xpu.md; these bindings
// check array shapes and strides and release the GIL around every copy. The keyword-only
// src_stride / dst_stride (bytes between blocks of a cache tensor; None: run_bytes) apply to
// the cache sides only: a staging side always steps run_bytes.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "kvflow_native/copy_runs.h"
#include "kvflow_native/xpu_runtime.h"

namespace py = pybind11;
using kvflow::CopyRuns;
using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

namespace {

std::vector<std::string> compiled_backends() {
#ifdef KVFLOW_WITH_XPU
  return {"host", "xpu"};
#else
  return {"host"};
#endif
}

const int64_t* vec(const I64Array& a, const char* name, int64_t expect = -1) {
  if (a.ndim() != 1) throw std::invalid_argument(std::string(name) + " must be 1-D, got " + std::to_string(a.ndim()) + " dims");
  if (expect >= 0 && a.shape(0) != expect) {
    throw std::invalid_argument(std::string(name) + " has " + std::to_string(a.shape(0)) + " entries; expected " +
                                std::to_string(expect));
  }
  return a.data();
}

I64Array ids_array(const py::object& o, const char* name) {
  I64Array a = I64Array::ensure(o);
  if (!a) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + " must be None or an int64 array");
  }
  return a;
}

void positive(int64_t v, const char* name) {
  if (v <= 0) throw std::invalid_argument(std::string(name) + " must be positive, got " + std::to_string(v));
}

// A cache side's block stride (bytes from block k to k + 1 of one tensor): None means
// run_bytes (layer-major, staging); otherwise positive and >= run_bytes (runs must not overlap).
int64_t stride(const std::optional<int64_t>& v, int64_t run_bytes, const char* name) {
  if (!v) return run_bytes;
  positive(*v, name);
  if (*v < run_bytes) {
    throw std::invalid_argument(std::string(name) + " must be >= run_bytes (" + std::to_string(run_bytes) + "), got " +
                                std::to_string(*v));
  }
  return *v;
}

// Run a checked job on the host or (XPU build) the device, GIL released.
int64_t run_job(const CopyRuns& job, int num_threads, const std::string& device, uint64_t stream) {
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0, got " + std::to_string(num_threads));
  py::gil_scoped_release nogil;
  if (device == "host") return kvflow::copy_runs_host(job, num_threads);
#ifdef KVFLOW_WITH_XPU
  if (device == "xpu") return kvflow::xpu::copy_runs_device(job, stream);
#endif
  (void)stream;
  throw std::invalid_argument("device='" + device + "' was not compiled into kvflow._native (compiled: host" +
#ifdef KVFLOW_WITH_XPU
                              std::string(", xpu)"));
#else
                              std::string(")"));
#endif
}

// Arguments of a staging buffer: one base address per tensor, slots 0..n-1 (identity ids).
std::vector<int64_t> staging_ptrs(int64_t base, int64_t n_tensors, int64_t n, int64_t run_bytes) {
  std::vector<int64_t> p(static_cast<size_t>(n_tensors));
  for (int64_t t = 0; t < n_tensors; ++t) p[static_cast<size_t>(t)] = base + t * n * run_bytes;
  return p;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvflow native extension: host (and XPU) block copies";

  m.def("available_backends", &compiled_backends, "Backends compiled into this build: ['host'] or ['host', 'xpu'].");
  m.def("build_info", [] {
    py::dict d;
    d["backends"] = compiled_backends();
    d["cxx_standard"] = static_cast<long>(__cplusplus);
    d["compiler"] = std::string(__VERSION__);
    d["default_num_threads"] = kvflow::default_num_threads();
    return d;
  });
  m.def("default_num_threads", &kvflow::default_num_threads);

  // ---- block copies -------------------------------------------------------------------------
  m.def(
      "copy_runs",
      [](const I64Array& src_ptrs, const I64Array& dst_ptrs, const py::object& src_ids, const py::object& dst_ids,
         int64_t n, int64_t src_n, int64_t dst_n, int64_t run_bytes, int num_threads, const std::string& device,
         uint64_t stream, std::optional<int64_t> src_stride, std::optional<int64_t> dst_stride) {
        positive(run_bytes, "run_bytes");
        vec(src_ptrs, "src_ptrs");
        const int64_t T = src_ptrs.shape(0);
        I64Array s, d;
        CopyRuns job{src_ptrs.data(), vec(dst_ptrs, "dst_ptrs", T), T, nullptr, nullptr, n, src_n, dst_n, run_bytes,
                     stride(src_stride, run_bytes, "src_stride"), stride(dst_stride, run_bytes, "dst_stride")};
        if (!src_ids.is_none()) job.src_ids = vec(s = ids_array(src_ids, "src_ids"), "src_ids", n);
        if (!dst_ids.is_none()) job.dst_ids = vec(d = ids_array(dst_ids, "dst_ids"), "dst_ids", n);
        return run_job(job, num_threads, device, stream);
      },
      py::arg("src_ptrs"), py::arg("dst_ptrs"), py::arg("src_ids"), py::arg("dst_ids"), py::arg("n"),
      py::arg("src_n"), py::arg("dst_n"), py::arg("run_bytes"), py::arg("num_threads") = 0,
      py::arg("device") = "host", py::arg("stream") = 0, py::kw_only(), py::arg("src_stride") = py::none(),
      py::arg("dst_stride") = py::none());
  m.def(
      "gather_blocks",
      [](const I64Array& src_ptrs, const I64Array& ids, int64_t dst_base, int64_t src_n, int64_t run_bytes,
         int num_threads, const std::string& device, uint64_t stream, std::optional<int64_t> src_stride) {
        positive(run_bytes, "run_bytes");
        vec(src_ptrs, "src_ptrs"), vec(ids, "ids");
        const int64_t T = src_ptrs.shape(0), n = ids.shape(0);
        auto dst = staging_ptrs(dst_base, T, n, run_bytes);
        CopyRuns job{src_ptrs.data(), dst.data(), T, ids.data(), nullptr, n, src_n, n, run_bytes,
                     stride(src_stride, run_bytes, "src_stride"), run_bytes};
        return run_job(job, num_threads, device, stream);
      },
      py::arg("src_ptrs"), py::arg("ids"), py::arg("dst_base"), py::arg("src_n"), py::arg("run_bytes"),
      py::arg("num_threads") = 0, py::arg("device") = "host", py::arg("stream") = 0, py::kw_only(),
      py::arg("src_stride") = py::none());
  m.def(
      "scatter_blocks",
      [](int64_t src_base, const I64Array& dst_ptrs, const I64Array& ids, int64_t dst_n, int64_t run_bytes,
         int num_threads, const std::string& device, uint64_t stream, std::optional<int64_t> dst_stride) {
        positive(run_bytes, "run_bytes");
        vec(dst_ptrs, "dst_ptrs"), vec(ids, "ids");
        const int64_t T = dst_ptrs.shape(0), n = ids.shape(0);
        auto src = staging_ptrs(src_base, T, n, run_bytes);
        CopyRuns job{src.data(), dst_ptrs.data(), T, nullptr, ids.data(), n, n, dst_n, run_bytes, run_bytes,
                     stride(dst_stride, run_bytes, "dst_stride")};
        return run_job(job, num_threads, device, stream);
      },
      py::arg("src_base"), py::arg("dst_ptrs"), py::arg("ids"), py::arg("dst_n"), py::arg("run_bytes"),
      py::arg("num_threads") = 0, py::arg("device") = "host", py::arg("stream") = 0, py::kw_only(),
      py::arg("dst_stride") = py::none());
  m.def(
      "copy_blocks",
      [](const I64Array& src_ptrs, const I64Array& dst_ptrs, const I64Array& src_ids, const I64Array& dst_ids,
         int64_t src_n, int64_t dst_n, int64_t run_bytes, int num_threads, const std::string& device,
         uint64_t stream, std::optional<int64_t> src_stride, std::optional<int64_t> dst_stride) {
        positive(run_bytes, "run_bytes");
        vec(src_ptrs, "src_ptrs"), vec(src_ids, "src_ids");
        const int64_t T = src_ptrs.shape(0), n = src_ids.shape(0);
        CopyRuns job{src_ptrs.data(), vec(dst_ptrs, "dst_ptrs", T), T, src_ids.data(), vec(dst_ids, "dst_ids", n),
                     n, src_n, dst_n, run_bytes, stride(src_stride, run_bytes, "src_stride"),
                     stride(dst_stride, run_bytes, "dst_stride")};
        return run_job(job, num_threads, device, stream);
      },
      py::arg("src_ptrs"), py::arg("dst_ptrs"), py::arg("src_ids"), py::arg("dst_ids"), py::arg("src_n"),
      py::arg("dst_n"), py::arg("run_bytes"), py::arg("num_threads") = 0, py::arg("device") = "host",
      py::arg("stream") = 0, py::kw_only(), py::arg("src_stride") = py::none(), py::arg("dst_stride") = py::none());

  m.def(
      "get_peer_mem_addr",
      [](uint64_t ptr, uint64_t nbytes, const std::string& device) -> uint64_t {
        if (device == "host") return ptr;  // host memory registers under its own address
#ifdef KVFLOW_WITH_XPU
        if (device == "xpu") {
          py::gil_scoped_release nogil;
          return kvflow::xpu::peer_mem_addr(ptr, nbytes);
        }
#endif
        (void)nbytes;
        throw std::invalid_argument("device='" + device + "' was not compiled into kvflow._native");
      },
      py::arg("tensor_ptr"), py::arg("nbytes") = 0, py::arg("device") = "host");
}

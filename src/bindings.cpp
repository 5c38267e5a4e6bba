// The Python module functions._C_<capability> (see setup.py): the CPU kernels, registered as the
// CPU implementations of the torch.ops.syncbn operators (declared in syncbn.functions.operators.ops) when
// syncbn.functions.operators.backend asks (set_cpu_kernels; under the reference kernels the module still
// serves the replicas' native meeting), the default CUDA kernels
// (src/torch_cuda_ops.cpp) likewise, and the native synchronized call (src/sync_batch_norm.cpp).
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "built_with.h"

#include <memory>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu/batch_norm_cpu.h"
#include "torch_cuda_ops.h"

namespace syncbn {

// The CPU kernels as the CPU kernels of torch.ops.syncbn (on), or not (off: the reference serves).
void set_cpu_kernels(bool on) {
  static std::unique_ptr<torch::Library> library;
  switch_kernels(library, c10::DispatchKey::CPU, on, [](torch::Library& m) {
    SYNCBN_IMPL_KERNELS(m, syncbn::cpu)
    m.impl("masked_local_stats", TORCH_FN(syncbn::cpu::masked_local_stats));
    m.impl("masked_backward_elemt", TORCH_FN(syncbn::cpu::masked_backward_elemt));
  });
}

void bind_sync_batch_norm(pybind11::module_& m);  // src/sync_batch_norm.cpp

// This thread's intra-op threads: the OpenMP team of the parallel regions that torch's CPU kernels
// start from it (a per-thread setting in OpenMP), without touching torch.set_num_threads'
// process-wide value, which every new thread starts from. Returns at::get_num_threads() on this
// thread afterwards (unchanged where torch does not run on OpenMP).
int set_thread_intra_op_threads(int threads) {
  TORCH_CHECK(threads > 0, "set_thread_intra_op_threads: expected a positive number of threads, got ", threads);
  at::get_num_threads();  // torch's lazy per-thread initialization first, which would undo what follows
#ifdef _OPENMP
  omp_set_num_threads(threads);
#endif
  return at::get_num_threads();
}
}  // namespace syncbn

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CPU kernels of the synchronized batch norm, registered as torch.ops.syncbn.* for CPU tensors";
  m.attr("capability") = syncbn::cpu::capability();
  m.attr("built_with_torch") = SYNCBN_BUILT_WITH_TORCH;  // checked at import against the running torch
  syncbn::bind_sync_batch_norm(m);
  m.def("set_cpu_kernels", &syncbn::set_cpu_kernels,
        "Register (True) or unregister (False) the CPU kernels (src/cpu) as the CPU kernels of torch.ops.syncbn");
  m.def("set_torch_cuda_ops", &syncbn::torch_cuda::set_torch_cuda_ops,
        "Register (True) or unregister (False) torch's SyncBN CUDA ops and ATen (src/torch_cuda_ops.cpp) as the "
        "CUDA kernels of torch.ops.syncbn");
  namespace torch_cuda = syncbn::torch_cuda;
  auto route = m.def_submodule("torch_cuda_ops", "Those kernels as functions, for the tests (ATen: any device)");
  route.def("local_stats", &torch_cuda::local_stats);
  route.def("elemt_forward", &torch_cuda::elemt_forward);
  route.def("backward_reduce", &torch_cuda::backward_reduce);
  route.def("backward_elemt", &torch_cuda::backward_elemt);
  route.def("backward_affine_act", &torch_cuda::backward_affine_act);
  route.def("merge_stats", &torch_cuda::merge_stats);
  route.def("merge_gathered_stats", &torch_cuda::merge_gathered_stats);
  m.def("set_thread_intra_op_threads", &syncbn::set_thread_intra_op_threads, pybind11::arg("threads"),
        "This thread's intra-op threads (OpenMP), leaving torch.set_num_threads' process-wide value alone");
}

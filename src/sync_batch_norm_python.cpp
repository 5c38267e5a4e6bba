// The native synchronized calls' Python face, called by syncbn.functions.synchronization.synchronizer:
// the round, the calls run without the GIL with their errors raised as Python sees them, and the
// graph task's reading.
#include <torch/csrc/autograd/python_cpp_function.h>

#include "graph_task.h"
#include "meeting.h"
#include "ranks.h"

namespace syncbn {
namespace native {
namespace {

void throw_replica_sync_error(const std::string& reason) {
  PyErr_SetString(replica_sync_error, reason.c_str());
  throw pybind11::error_already_set();
}

// Without the GIL, as the wait and the master's work run there. `sync`: the process master's
// Synchronizer, or None; `given`: None, or a checkpoint's first run's (mean, invstd, count).
template <typename Work>
pybind11::tuple run_call(const std::shared_ptr<ReplicaRound>& round, int64_t index, int64_t call,
                         const pybind11::object& sync, const pybind11::object& given, const Work& work) {
  namespace py = pybind11;
  const Meeting meeting{round, index, call, std::make_shared<Ranks>(sync.is_none() ? nullptr : sync.ptr())};
  std::optional<Normalization> normalization;
  if (!given.is_none()) {
    const auto kept = given.cast<py::tuple>();
    const auto count = meeting.ranks->take_count(kept[2]);
    normalization.emplace(kept[0].cast<at::Tensor>(), kept[1].cast<at::Tensor>(), count, /*shared=*/false);
  }
  std::optional<std::string> broken;
  std::optional<python_error> raised;  // a Python exception, as it is (checkpoint's control flow too)
  CallResult result;
  {
    py::gil_scoped_release no_gil;
    try {
      result = work(meeting, normalization);
    } catch (const RoundBroken& error) {
      broken = error.what();
    } catch (python_error& error) {
      raised.emplace(std::move(error));
    }
  }
  if (raised) {
    raised->restore();
    throw py::error_already_set();
  }
  if (broken) throw_replica_sync_error(*broken);
  const auto& [y, mean, invstd, count] = result;
  return py::make_tuple(y, mean, invstd, meeting.ranks->count(count));
}

// A backward node held weakly (Python's node objects take no weak reference, and a strong one
// from a Synchronizer would make a cycle through the node's own Ranks): its Python object while it
// lives. Held as the installed torch holds nodes (shared_ptr or intrusive_ptr).
struct WeakNode {
  using Held = decltype(torch::autograd::Edge::function);
  using Weak = std::conditional_t<std::is_same_v<Held, std::shared_ptr<torch::autograd::Node>>,
                                  std::weak_ptr<torch::autograd::Node>, c10::weak_intrusive_ptr<torch::autograd::Node>>;
  Weak node;

  explicit WeakNode(const Held& held) : node(held) {}
  pybind11::object get() const {
    const Held alive = node.lock();
    if (!alive) return pybind11::none();
    return pybind11::reinterpret_steal<pybind11::object>(torch::autograd::functionToPyObject(alive));
  }
};

}  // namespace
}  // namespace native

void bind_sync_batch_norm(pybind11::module_& m) {
  using namespace native;
  namespace py = pybind11;
  py::class_<ReplicaRound, std::shared_ptr<ReplicaRound>> round(
      m, "ReplicaRound", "The meeting of a layer's replicas in one step (src/replica_round.h)");
  round
      .def(py::init<int64_t, double, std::string, int64_t, double, int64_t>(), py::arg("size"), py::arg("timeout"),
           py::arg("layer"), py::arg("number"), py::arg("spin_us"), py::arg("cores") = 0)
      .def_property_readonly("size", &ReplicaRound::size)
      .def_property_readonly("spin_us", &ReplicaRound::spin_us, "How long a waiter polls before it sleeps")
      .def_property_readonly("cores", &ReplicaRound::cores,
                             "The CPUs the replicas share (0: unknown); waiters poll long only on spare ones")
      .def("abort", &ReplicaRound::abort, py::arg("reason"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "set_row_layout",
      [](int64_t header, int64_t agreeing, int64_t failed, int64_t shape_dims, int64_t identities) {
        row_layout() = RowLayout{header, agreeing, failed, shape_dims, identities};
      },
      "The collectives' row layout (syncbn.functions.synchronization.distributed.row_layout), set once at import");
  py::class_<ReadyEvent>(m, "ReadyEvent", "The event after a deferred verdict's copies to host memory")
      .def("query", &ReadyEvent::query, "Whether the device has run the copies")
      .def("synchronize", &ReadyEvent::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Wait until the device has run the copies");
  m.def(
      "current_backward_pass",
      [] {
        const auto* task = current_graph_task();
        return task ? py::make_tuple(task->has_error_.load(), task->keep_graph_) : py::object(py::none());
      },
      "(failed, retain_graph) of the backward pass this thread runs, read from torch's graph task as the "
      "meetings read it (src/graph_task.h); None outside one");
  m.def("graph_task_reading_holds", &graph_task_reading_holds,
        "Inside a backward pass: whether the graph task read from torch's struct (src/graph_task.h) agrees with "
        "the exported accessors of its other members");
  m.def(
      "use_graph_task_reading", [](bool checked) { graph_task_reading_checked().store(checked); },
      "Whether backward waiters read their graph task's failure (set once the reading was checked)");
  py::class_<WeakNode>(m, "WeakNode", "A backward node held weakly: calling it gives the node, or None once freed")
      .def("__call__", &WeakNode::get);
  m.def(
      "weak_node", [](const at::Tensor& y) { return WeakNode(y.grad_fn()); },
      "The backward node that made y (its grad_fn), held weakly");
  m.def("set_replica_sync_error", [](py::object type) {
    replica_sync_error = type.release().ptr();  // kept for the life of the process
  });
  m.def(
      "sync_batch_norm",
      [](const std::shared_ptr<ReplicaRound>& round, int64_t index, int64_t call, const at::Tensor& input,
         const OptTensor& weight, const OptTensor& bias, const OptTensor& running_mean, const OptTensor& running_var,
         const OptTensor& num_batches_tracked, std::optional<double> momentum, double eps, const OptTensor& residual,
         std::optional<double> negative_slope, const std::string& layer, const py::object& sync,
         const py::object& given, const OptTensor& mask) {
        const MasterCall master{running_mean, running_var, num_batches_tracked, momentum, eps, layer};
        return run_call(round, index, call, sync, given, [&](const Meeting& meeting, const auto& normalization) {
          return sync_batch_norm(meeting, input, weight, bias, master, residual, negative_slope, normalization, mask);
        });
      },
      py::arg("round").none(true), py::arg("index"), py::arg("call"), py::arg("input"), py::arg("weight"),
      py::arg("bias"), py::arg("running_mean"), py::arg("running_var"), py::arg("num_batches_tracked"),
      py::arg("momentum"), py::arg("eps"), py::arg("residual"), py::arg("negative_slope"), py::arg("layer"),
      py::arg("sync"), py::arg("given"), py::arg("mask") = py::none(),
      "One replica's call of a synchronized layer: (y, mean, invstd, count) (see src/sync_batch_norm.cpp)");
  m.def(
      "inplace_abn",
      [](const std::shared_ptr<ReplicaRound>& round, int64_t index, int64_t call, const at::Tensor& x,
         const OptTensor& weight, const OptTensor& bias, const OptTensor& running_mean, const OptTensor& running_var,
         const OptTensor& num_batches_tracked, std::optional<double> momentum, double eps,
         const std::string& activation, double activation_param, const std::string& layer, const py::object& sync,
         const py::object& given) {
        const MasterCall master{running_mean, running_var, num_batches_tracked, momentum, eps, layer};
        return run_call(round, index, call, sync, given, [&](const Meeting& meeting, const auto& normalization) {
          return inplace_abn(meeting, x, weight, bias, master, activation, activation_param, normalization);
        });
      },
      py::arg("round").none(true), py::arg("index"), py::arg("call"), py::arg("x"), py::arg("weight"), py::arg("bias"),
      py::arg("running_mean"), py::arg("running_var"), py::arg("num_batches_tracked"), py::arg("momentum"),
      py::arg("eps"), py::arg("activation"), py::arg("activation_param"), py::arg("layer"), py::arg("sync"),
      py::arg("given"),
      "One replica's call of a synchronized in-place activated layer: (x written over, mean, invstd, count)");
}

}  // namespace syncbn

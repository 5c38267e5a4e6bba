// Whether the backward pass this thread runs failed on another device's thread, so that a replica
// waiting at a meeting need not wait for its timeout. torch exports no accessor for
// GraphTask::has_error_: the task is found from nodes_in_graph_'s address less its offset in these
// headers, a reading used only where syncbn.functions.torch_internals checked it at import.
#pragma once

#include <torch/csrc/autograd/graph_task.h>

#include <atomic>
#include <cstddef>

namespace syncbn {

// The graph task that this thread runs now, or null outside a backward pass.
inline const torch::autograd::GraphTask* current_graph_task() {
  using torch::autograd::GraphTask;
  if (torch::autograd::get_current_graph_task_id() == -1) return nullptr;
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"  // GraphTask is not standard-layout; no virtual base
  constexpr std::size_t offset = offsetof(GraphTask, nodes_in_graph_);
#pragma GCC diagnostic pop
  return reinterpret_cast<const GraphTask*>(reinterpret_cast<const char*>(nodes) - offset);
}

// Whether the task found by current_graph_task() was checked to be the one torch runs.
inline std::atomic<bool>& graph_task_reading_checked() {
  static std::atomic<bool> checked{false};
  return checked;
}

// Inside a backward pass: whether the task found has the members that torch's other accessors
// return, at these headers' offsets, and no error yet.
inline bool graph_task_reading_holds() {
  const auto* task = current_graph_task();
  return task && &task->exec_info_ == torch::autograd::get_current_graph_task_exec_info() &&
         task->keep_graph_ == torch::autograd::get_current_graph_task_keep_graph() &&
         static_cast<int64_t>(task->id_) == torch::autograd::get_current_graph_task_id() &&
         !task->has_error_.load(std::memory_order_relaxed);
}

// Whether the backward pass that this thread runs has failed (false outside one, and where the
// reading was not checked).
inline bool current_graph_task_failed() {
  if (!graph_task_reading_checked().load(std::memory_order_relaxed)) return false;
  const auto* task = current_graph_task();
  return task && task->has_error_.load(std::memory_order_relaxed);
}

}  // namespace syncbn

// The backward pass that this thread runs, and whether it has failed elsewhere. Under stock
// nn.DataParallel on GPUs one backward pass (one autograd graph task) runs on a thread per device:
// when a node fails on one device, the engine marks the task failed and its caller raises at
// once, but a replica waiting at a meeting on another device's thread would wait for the failed
// replica until its timeout. torch keeps that mark in GraphTask::has_error_ and exports no
// accessor for it, only accessors of the current task's members; the task is found from one of
// them (its address, less the member's offset in the struct of the headers built against;
// tests/test_torch_internals.py checks the result against another exported accessor).
#pragma once

#include <torch/csrc/autograd/graph_task.h>

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

// Whether the backward pass that this thread runs has failed (false outside one).
inline bool current_graph_task_failed() {
  const auto* task = current_graph_task();
  return task && task->has_error_.load(std::memory_order_relaxed);
}

}  // namespace syncbn

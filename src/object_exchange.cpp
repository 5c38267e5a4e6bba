// The native round (src/replica_round.h) for exchanges of Python objects: the one meeting of the
// replicas, also where the synchronized call runs through an autograd Function in Python (the
// in-place activated layers, torch.func transforms, the reference kernels' debugging). A replica
// posts its payload and waits without the GIL; the replica that arrives last runs the master's
// Python `combine` over every payload, in replica order, with the GIL, and each replica returns
// its item of the list it gave. Keys, timeouts, errors and aborts are the round's own.
#include <torch/csrc/utils/pybind.h>

#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "graph_task.h"
#include "replica_round.h"

namespace syncbn {

namespace {

namespace py = pybind11;

// A Python object inside the round: moved between threads, never copied, released with the GIL
// (the round may drop one on a thread that does not hold it). One type per direction, so that
// the round keeps the forward's and the backward's exchanges apart.
template <int Direction>
struct Payload {
  py::object object;

  Payload() = default;
  explicit Payload(py::object o) : object(std::move(o)) {}
  Payload(Payload&& other) noexcept = default;
  Payload& operator=(Payload&& other) noexcept {
    release();
    object = std::move(other.object);
    return *this;
  }
  Payload(const Payload&) = delete;
  Payload& operator=(const Payload&) = delete;
  ~Payload() { release(); }

  void release() {
    if (object && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      object = py::object();
    }
  }
};

template <int Direction>
py::object exchange(ReplicaRound& round, const char* direction, int64_t call, int64_t index, py::object payload,
                    const py::object& combine) {
  using Part = Payload<Direction>;
  const std::function<std::vector<Part>(std::vector<Part>&)> combine_parts = [&combine](std::vector<Part>& parts) {
    py::gil_scoped_acquire gil;
    py::list objects;
    for (auto& part : parts) objects.append(std::move(part.object));
    std::vector<Part> results;
    for (auto item : combine(objects)) results.emplace_back(py::reinterpret_borrow<py::object>(item));
    if (results.size() != parts.size()) {
      throw std::length_error("ReplicaRound.exchange: combine returned " + std::to_string(results.size()) +
                              " results for " + std::to_string(parts.size()) + " replicas");
    }
    return results;
  };
  Part result;
  std::optional<std::string> broken;
  {
    py::gil_scoped_release no_gil;
    try {
      // a backward wait ends where its backward pass failed on another device's thread
      result = round.exchange<Part, Part>(direction, call, index, Part(std::move(payload)), combine_parts,
                                          Direction == 1 ? current_graph_task_failed : nullptr);
    } catch (const RoundBroken& error) {
      broken = error.what();
    }
  }
  if (broken) throw_replica_sync_error(*broken);
  return std::move(result.object);
}

}  // namespace

void bind_object_exchange(py::class_<ReplicaRound, std::shared_ptr<ReplicaRound>>& round) {
  round.def(
      "exchange",
      [](ReplicaRound& self, const std::string& direction, int64_t call, int64_t index, py::object payload,
         const py::object& combine) {
        if (direction == "forward") return exchange<0>(self, "forward", call, index, std::move(payload), combine);
        if (direction == "backward") return exchange<1>(self, "backward", call, index, std::move(payload), combine);
        throw std::invalid_argument("ReplicaRound.exchange: direction must be 'forward' or 'backward'");
      },
      py::arg("direction"), py::arg("call"), py::arg("index"), py::arg("payload"), py::arg("combine"),
      "Post `payload` under (direction, call) and wait without the GIL; the master's (index 0) "
      "`combine`, run once over every payload in replica order, returns one result per replica: "
      "this replica's is returned. Raises ReplicaSyncError where the round breaks or times out; "
      "an error of `combine` reaches the master as it is.");
}

}  // namespace syncbn

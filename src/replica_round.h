// Where the replicas of one layer meet inside one process (who belongs to a round:
// syncbn.functions.synchronization.replicas). Each replica posts its part and waits without the
// GIL; the last to arrive runs the master's (index 0) combine and publishes one result per part.
// A failure, a timeout or an abort from Python breaks the round and wakes every waiter at once.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace syncbn {

// The round was broken (a failure, a timeout, an abort): what a waiting replica raises, as
// syncbn.functions.ReplicaSyncError in Python.
struct RoundBroken : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// "replica 1 failed: ValueError: ...": replica `index`'s failure as its waiters report it; defined
// in meeting.cpp, which knows the Python exception each C++ one becomes.
std::string failure_reason(int64_t index, const std::exception_ptr& error);

class ReplicaRound {
 public:
  // `cores`: the CPUs the replicas share (0: unknown, every waiter may poll for spin_us).
  ReplicaRound(int64_t size, double timeout_s, std::string layer, int64_t number, double spin_us, int64_t cores)
      : size_(size), timeout_s_(timeout_s), spin_(std::chrono::duration<double, std::micro>(spin_us)),
        cores_(cores), layer_(std::move(layer)), number_(number) {
    if (!(timeout_s > 0 && timeout_s <= kMaxTimeout) || size < 1) {
      throw std::invalid_argument("ReplicaRound: needs size >= 1 and 0 < timeout <= 1e9 s");
    }
    if (!(spin_us >= 0 && spin_us <= kMaxSpin)) {
      throw std::invalid_argument("ReplicaRound: needs 0 <= spin_us <= 1e6 microseconds");
    }
    if (cores < 0) throw std::invalid_argument("ReplicaRound: needs cores >= 0 (0: unknown)");
  }

  static constexpr double kMaxTimeout = 1e9;  // seconds: a deadline in nanoseconds stays in int64
  static constexpr double kMaxSpin = 1e6;     // microseconds: a second of polling is already no sleep
  // How long a waiter polls on a core that a replica still working needs (at most spin_us).
  static constexpr std::chrono::duration<double, std::micro> kSharedSpin{50.0};
  // How often a sleeping waiter asks whether its wait was abandoned (see exchange).
  static constexpr std::chrono::milliseconds kAbandonedPoll{100};

  int64_t size() const { return size_; }
  double spin_us() const { return spin_.count(); }
  int64_t cores() const { return cores_; }

  // Break the round with `reason` ("replica 1 failed: ValueError: ..."), unless it is broken already.
  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    break_round(reason);
  }

  // The master's `combine` runs outside the lock on the last arrival's thread, which is awake
  // already (the master's closure lives on: the master waits). Throws RoundBroken where the round
  // breaks or the wait times out, but the master rethrows its combine's own exception as it is.
  // `abandoned`, polled while waiting, breaks the round once this wait's backward pass failed elsewhere.
  template <typename Part, typename Result>
  Result exchange(const char* direction, int64_t call, int64_t index, Part part,
                  const std::function<std::vector<Result>(std::vector<Part>&)>& combine,
                  bool (*abandoned)() = nullptr) {
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    std::unique_lock<std::mutex> lock(mutex_);
    if (index < 0 || index >= size_) throw std::out_of_range("ReplicaRound: no replica " + std::to_string(index));
    auto& slots = slots_of<Part, Result>();
    auto& slot = slots[call];
    if (slot.parts.empty()) slot.parts.resize(size_);
    if (failure_) throw RoundBroken(where(direction, call, slot.arrived_at) + "; " + *failure_);
    slot.parts[index] = std::move(part);
    slot.arrived_at.push_back(index);
    if (index == 0) slot.combine = &combine;
    if (int64_t(slot.arrived_at.size()) == size_) {
      combine_all(lock, direction, call, index, slot);
    } else {
      try {
        wait(lock, direction, call, slot, deadline, [&] { return !slot.results.empty(); }, abandoned);
      } catch (const RoundBroken&) {
        if (index == 0) {
          // the combine may be running on another thread with this frame's closure: never leave
          // before it ends (it is bounded: local work, or collectives with their own timeouts)
          changed_.wait(lock, [&] { return !slot.combining; });
          if (slot.combine_error) std::rethrow_exception(slot.combine_error);
        }
        throw;
      }
    }
    Result result = std::move(slot.results[index]);
    if (++slot.taken == size_) slots.erase(call);
    return result;
  }

 private:
  template <typename Part, typename Result>
  struct Slot {
    std::vector<std::optional<Part>> parts;
    std::vector<int64_t> arrived_at;  // indices, in arrival order
    std::vector<Result> results;      // non-empty once published
    int64_t taken = 0;
    const std::function<std::vector<Result>(std::vector<Part>&)>* combine = nullptr;  // the master's
    std::exception_ptr combine_error;  // what the master's combine raised, for the master to raise
    bool combining = false;            // the combine runs (outside the lock): the master must not leave
    int64_t pollers = 0;               // waiters polling long now, on spare cores (see spare_core)
  };

  // The waiters are woken before the combine so that their wake-up overlaps it (they spin until
  // the results are out).
  template <typename Part, typename Result>
  void combine_all(std::unique_lock<std::mutex>& lock, const char* direction, int64_t call, int64_t index,
                   Slot<Part, Result>& slot) {
    std::vector<Part> parts;
    for (auto& p : slot.parts) parts.push_back(std::move(*p));
    const auto& combine = *slot.combine;
    slot.combining = true;
    signal();
    lock.unlock();
    std::vector<Result> results;
    std::exception_ptr error;
    try {
      results = combine(parts);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    slot.combining = false;
    if (error) {
      slot.combine_error = error;
      break_round(failure_reason(0, error));  // wakes the master too
      if (index == 0) std::rethrow_exception(error);
      throw RoundBroken(where(direction, call, slot.arrived_at) + "; " + *failure_);
    }
    if (failure_) {
      signal();  // a master waiting for the combine to end
      throw RoundBroken(where(direction, call, slot.arrived_at) + "; " + *failure_);
    }
    slot.results = std::move(results);
    signal();
  }
  template <typename Part, typename Result>
  using Slots = std::map<int64_t, Slot<Part, Result>>;

  // One map of slots per (Part, Result) type: the forward's and the backward's exchanges.
  template <typename Part, typename Result>
  Slots<Part, Result>& slots_of() {
    static const char key = 0;  // one per instantiation
    auto& holder = typed_slots_[&key];
    if (!holder) holder = std::shared_ptr<void>(new Slots<Part, Result>(), [](void* p) { delete static_cast<Slots<Part, Result>*>(p); });
    return *static_cast<Slots<Part, Result>*>(holder.get());
  }

  std::chrono::steady_clock::duration timeout() const {
    return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s_));
  }

  void signal() {
    events_.fetch_add(1, std::memory_order_release);
    changed_.notify_all();
  }

  void break_round(const std::string& reason) {
    if (!failure_) failure_ = reason;
    signal();
  }

  // Spins before sleeping: waking a thread whose vCPU went idle costs more than a short poll. Once
  // all have arrived the deadline is extended once: never give up on a result about to be published.
  template <typename Part, typename Result, typename Ready>
  void wait(std::unique_lock<std::mutex>& lock, const char* direction, int64_t call, Slot<Part, Result>& slot,
            std::chrono::steady_clock::time_point deadline, Ready ready, bool (*abandoned)()) {
    if (!ready() && !failure_) spin(lock, slot);
    bool extended = false, spun_while_combining = false;
    while (!ready()) {
      if (failure_) throw RoundBroken(where(direction, call, slot.arrived_at) + "; " + *failure_);
      if (abandoned && abandoned()) {
        break_round("the " + std::string(direction) +
                    " pass it belongs to failed elsewhere (that error reaches its caller)");
        throw RoundBroken(where(direction, call, slot.arrived_at) + "; " + *failure_);
      }
      const bool all_arrived = int64_t(slot.arrived_at.size()) == size_;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline && !extended && all_arrived) {
        deadline += timeout();
        extended = true;
        continue;
      }
      if (now >= deadline) {
        const auto message = timeout_message(direction, call, slot.arrived_at);
        break_round("the round was broken: " + message);
        throw RoundBroken(message);
      }
      if (all_arrived && !spun_while_combining) {
        spun_while_combining = true;
        spin(lock, slot);
        continue;
      }
      changed_.wait_until(lock, abandoned ? std::min(deadline, now + kAbandonedPoll) : deadline);
    }
  }

  // A long poll must not take a core from a replica still working (or combining): where replicas
  // outnumber cores, only the last waiter polls long, on the core its own arrival freed.
  template <typename Part, typename Result>
  bool spare_core(const Slot<Part, Result>& slot) const {
    if (cores_ == 0) return true;
    const int64_t arrived = int64_t(slot.arrived_at.size());
    const int64_t working = arrived == size_ ? 1 : size_ - arrived;
    return slot.pollers + working < cores_;
  }

  // Only kSharedSpin without a spare core: short enough to leave it to the replicas working there.
  template <typename Part, typename Result>
  void spin(std::unique_lock<std::mutex>& lock, Slot<Part, Result>& slot) {
    const bool spare = spare_core(slot);
    const auto length = spare ? spin_ : std::min(spin_, kSharedSpin);
    if (length.count() <= 0) return;
    const auto seen = events_.load(std::memory_order_acquire);
    if (spare) ++slot.pollers;
    lock.unlock();
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(length);
    while (events_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) {
      std::this_thread::yield();
    }
    lock.lock();
    if (spare) --slot.pollers;
  }

  std::string where(const char* direction, int64_t call, const std::vector<int64_t>& arrived_at) const {
    std::vector<bool> arrived(size_, false);
    for (auto i : arrived_at) arrived[i] = true;
    std::ostringstream text;
    text << layer_ << ", " << direction << " call " << call << " of replica round " << number_ << ": replicas "
         << indices(arrived, true) << " of " << size_ << " arrived, " << indices(arrived, false) << " missing";
    return text.str();
  }

  std::string timeout_message(const char* direction, int64_t call, const std::vector<int64_t>& arrived_at) const {
    std::ostringstream text;
    text << where(direction, call, arrived_at) << " after waiting " << timeout_s_
         << "s. A replica raised before reaching this layer, skipped it in a data-dependent branch, or called it "
            "a different number of times. The wait is set by timeout= or $SYNCBN_TIMEOUT.";
    return text.str();
  }

  static std::string indices(const std::vector<bool>& arrived, bool which) {  // as Python prints a list
    std::ostringstream text;
    text << "[";
    const char* separator = "";
    for (size_t i = 0; i < arrived.size(); ++i) {
      if (arrived[i] == which) {
        text << separator << i;
        separator = ", ";
      }
    }
    text << "]";
    return text.str();
  }

  const int64_t size_;
  const double timeout_s_;
  const std::chrono::duration<double, std::micro> spin_;
  const int64_t cores_;
  const std::string layer_;
  const int64_t number_;
  std::mutex mutex_;
  std::condition_variable changed_;  // the waiters' wake-up: a set complete, results out, a break
  std::atomic<uint64_t> events_{0};  // the same events, counted for the spinners
  std::optional<std::string> failure_;
  std::map<const void*, std::shared_ptr<void>> typed_slots_;
};

}  // namespace syncbn

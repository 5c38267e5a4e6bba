"""What a barrier alone costs on this machine: the floor under the price of a meeting.

Replicas that meet at every synchronized layer wait, at each meeting, for the slowest of them.
Where replicas of equal work run on cores whose speed varies (a VM's vCPUs share the host's cores
with other guests), that wait costs time even when the meeting itself costs nothing. This
benchmark measures that floor twice, each time against our meeting:

- in the small ResNet of ``resnet_step.py`` (17 batch norms: 34 meetings a step), one
  training step under R thread replicas (``ThreadedDataParallel``), five contenders alternating
  step by step: converted (our meeting), converted with each layer's replicas waiting at a
  minimal barrier where they would meet (:class:`MeetingAtABarrier`, whose waiters poll, and
  :class:`MeetingAtASleepingBarrier`: before the statistics in the forward, after the layer's
  backward; nothing exchanged, each replica normalizing its own chunk), converted with layers
  that meet no one, and unsynced. Against meeting no one, the cheaper of the two barriers gives
  the floor for this net and our meetings their price;
- R native threads (no GIL), each doing the same fixed torch work a round (``at::mm`` of two
  n x n float32 matrices, one intra-op thread), n chosen so that a round takes the CPU time a
  ResNet replica spends between two meetings (the step meeting no one, times the cores the
  replicas share, over R, over 34). The rounds run in blocks, four ways taken in turn block by
  block: independent (no meeting), the minimal barrier polling, sleeping, and our ``ReplicaRound``
  (src/replica_round.h: our layer's native meeting, its polls, sleeps and wake-ups, with a
  combine that does nothing); a block's time is its slowest thread's.

The minimal barrier is an atomic count and nothing else: its waiters poll, yielding their core,
and never sleep (no wake-up to pay, but where replicas outnumber cores a poll takes turns with a
replica still working), or sleep at once (the core left to the others, a wake-up to pay).

Writes the result ``barrier_floor`` (``benchmarks/results/barrier_floor.json``, see
``benchmarks/results.py``; ``report.py`` puts it into RESULTS.md): a row per number of replicas
and run, the ResNet's steps as ratios to the step meeting no one, the mm blocks as ratios to the
independent blocks, and the share of the CPU the hypervisor stole meanwhile (a run is measured once
more where it exceeded 5%, the less stolen kept); each row keeps its raw figures beside
(``*_ms``, ``mm_n``, ``round_us``).

    python benchmarks/bench_barrier_floor.py                       # R = 2 and 4, 3 runs each
    python benchmarks/bench_barrier_floor.py --quick --no-write    # fewer steps and blocks; prints only
    python benchmarks/bench_barrier_floor.py --repeats 1 --steps 20 --cycles 4 --results-dir /tmp/results

The native part is built with ``torch.utils.cpp_extension.load_inline`` on the first run (about
a minute; cached afterwards).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from statistics import median

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import results  # noqa: E402
from timing import least_stolen  # noqa: E402
from resnet_step import MeetingNoOne, resnet_row  # noqa: E402
from results import Column  # noqa: E402
from syncbn.functions.synchronization.replicas import ReplicaRound, usable_cores  # noqa: E402

SRC = os.path.join(ROOT, "src")
MEETINGS = 34  # the small ResNet's meetings a step: 17 layers, forward and backward
WAYS = ("independent", "polling", "sleeping", "ReplicaRound")

NATIVE = r"""
#include <torch/extension.h>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include "replica_round.h"

namespace syncbn {
std::string failure_reason(int64_t index, const std::exception_ptr&) {
  return "replica " + std::to_string(index) + " failed";
}
}  // namespace syncbn

namespace {

using Clock = std::chrono::steady_clock;

// Every thread waits here until all have arrived, and nothing is exchanged: the least a meeting
// can cost. Its waiters poll, yielding their core (no wake-up, but a poll takes turns with a
// thread still working on that core), or sleep at once (a core left to the others, but a wake-up
// to pay). A wait longer than a minute raises: a benchmark's failed replica must not hang the rest.
class MinimalBarrier {
 public:
  MinimalBarrier(int64_t size, bool sleeps) : size_(size), sleeps_(sleeps) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    if (sleeps_) lock.lock();
    const int64_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_acq_rel);
      if (sleeps_) changed_.notify_all();
      return;
    }
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    const auto passed = [&] { return generation_.load(std::memory_order_acquire) != generation; };
    if (sleeps_) {
      TORCH_CHECK(changed_.wait_until(lock, deadline, passed), "MinimalBarrier: a thread did not arrive within a minute");
      return;
    }
    while (!passed()) {
      TORCH_CHECK(Clock::now() < deadline, "MinimalBarrier: a thread did not arrive within a minute");
      std::this_thread::yield();
    }
  }

 private:
  const int64_t size_;
  const bool sleeps_;
  std::atomic<int64_t> arrived_{0}, generation_{0};
  std::mutex mutex_;
  std::condition_variable changed_;
};

std::unique_ptr<MinimalBarrier> layer_barriers[2];  // what at_the_barrier waits at: polling, sleeping

// The identity, waiting at a layer barrier in the forward and in the backward: where a replica of
// a synchronized layer meets the others, the meeting without any exchange or merge.
struct AtTheBarrier : torch::autograd::Function<AtTheBarrier> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, bool sleeps) {
    ctx->saved_data["sleeps"] = sleeps;
    layer_barriers[sleeps]->wait();
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    layer_barriers[ctx->saved_data["sleeps"].toBool()]->wait();
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

void set_layer_barriers(int64_t size) {
  layer_barriers[0] = std::make_unique<MinimalBarrier>(size, false);
  layer_barriers[1] = std::make_unique<MinimalBarrier>(size, true);
}

at::Tensor at_the_barrier(const at::Tensor& x, bool sleeps) {
  pybind11::gil_scoped_release no_gil;
  return AtTheBarrier::apply(x, sleeps);
}

// Seconds per round of `threads` threads doing one n x n mm a round, for each way (independent,
// the minimal barrier polling, sleeping, our ReplicaRound): per cycle and way, a block of
// `rounds` rounds, the slowest thread's time counting; summed over the cycles.
std::vector<double> barrier_floor(int64_t threads, int64_t n, int64_t rounds, int64_t cycles, int64_t cores,
                                  double spin_us) {
  pybind11::gil_scoped_release no_gil;
  MinimalBarrier start(threads, false), polling(threads, false), sleeping(threads, true);
  syncbn::ReplicaRound round(threads, 600.0, "barrier_floor", 0, spin_us, cores);
  const std::function<std::vector<int64_t>(std::vector<int64_t>&)> combine = [](std::vector<int64_t>& parts) {
    return parts;
  };
  std::vector<std::vector<double>> seconds(4, std::vector<double>(threads * cycles, 0.0));
  auto work = [&](int64_t index) {
    at::set_num_threads(1);
    const auto a = at::randn({n, n}), b = at::randn({n, n});
    auto c = at::empty({n, n});
    int64_t call = 0;
    for (int64_t cycle = 0; cycle < cycles; ++cycle) {
      for (int way = 0; way < 4; ++way) {
        start.wait();
        const auto begin = Clock::now();
        for (int64_t r = 0; r < rounds; ++r) {
          at::mm_out(c, a, b);
          if (way == 1) polling.wait();
          if (way == 2) sleeping.wait();
          if (way == 3) round.exchange<int64_t, int64_t>("forward", call++, index, index, combine);
        }
        seconds[way][cycle * threads + index] = std::chrono::duration<double>(Clock::now() - begin).count();
      }
    }
  };
  std::vector<std::thread> pool;
  for (int64_t i = 0; i < threads; ++i) pool.emplace_back(work, i);
  for (auto& t : pool) t.join();
  std::vector<double> per_round(4, 0.0);
  for (int way = 0; way < 4; ++way) {
    for (int64_t cycle = 0; cycle < cycles; ++cycle) {
      double slowest = 0;
      for (int64_t i = 0; i < threads; ++i) slowest = std::max(slowest, seconds[way][cycle * threads + i]);
      per_round[way] += slowest / double(rounds * cycles);
    }
  }
  return per_round;
}
"""


@functools.cache
def native():
    """The compiled module (built once, then cached by torch.utils.cpp_extension)."""
    return cpp_extension.load_inline(
        "syncbn_barrier_floor", NATIVE, functions=["barrier_floor", "set_layer_barriers", "at_the_barrier"],
        extra_include_paths=[SRC], extra_cflags=["-O2"], verbose=False,
    )


class MeetingAtABarrier(MeetingNoOne):
    """Our layer whose replicas wait for each other at a minimal barrier where they would meet
    (before the statistics in the forward, after the layer's backward) and exchange nothing,
    each normalizing its own chunk: a meeting that costs only the wait. Its waiters poll."""

    sleeps = False

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(native().at_the_barrier(input, self.sleeps), z)


class MeetingAtASleepingBarrier(MeetingAtABarrier):
    """The same, its waiters sleeping at once."""

    sleeps = True


def mm_size_for(seconds: float) -> int:
    """The n whose n x n float32 mm takes about ``seconds`` on one thread here."""
    def mm_time(n: int) -> float:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        start = time.perf_counter()
        for _ in range(20):
            torch.mm(a, b)
        return (time.perf_counter() - start) / 20

    n = 128
    for _ in range(3):  # the time grows as n cubed: two corrections land close
        n = max(16, round(n * (seconds / mm_time(n)) ** (1 / 3)))
    return n


def floor_row(replicas: int, segment: float, rounds: int, cycles: int) -> dict[str, float]:
    """Seconds per round for each way, R threads, one mm of about ``segment`` seconds a round;
    the ReplicaRound polling and counting cores as our layer's rounds do."""
    spin_us = ReplicaRound("barrier_floor", 1, 60.0).spin_us  # as a layer's round reads it
    n = mm_size_for(segment)
    per_round = native().barrier_floor(replicas, n, rounds, cycles, usable_cores(), spin_us)
    return {"n": n, **dict(zip(WAYS, per_round))}


COLUMNS = [
    Column("replicas", "R"),
    Column("ours", "ResNet: our meetings / meeting no one", "{:.3f}x"),
    Column("polling", "ResNet: barriers polling / meeting no one", "{:.3f}x"),
    Column("sleeping", "ResNet: barriers sleeping / meeting no one", "{:.3f}x"),
    Column("mm_polling", "mm: barrier polling / independent", "{:.3f}x"),
    Column("mm_sleeping", "mm: barrier sleeping / independent", "{:.3f}x"),
    Column("mm_round", "mm: our ReplicaRound / independent", "{:.3f}x"),
    Column("stolen", "CPU stolen", "{:.0%}"),
]


def measured_row(replicas: int, run: int, args: argparse.Namespace) -> dict:
    """One run with R replicas: the ResNet's steps and the mm blocks, as ratios, raw figures beside."""
    cores = usable_cores()  # as the layers' rounds count them
    variants = {"polling": MeetingAtABarrier, "sleeping": MeetingAtASleepingBarrier}

    def measure() -> tuple[dict, dict]:
        native().set_layer_barriers(replicas)
        step = {key: median(blocks) for key, blocks in resnet_row(replicas, args.steps, variants=variants).items()}
        segment = step["alone"] * min(cores, replicas) / replicas / MEETINGS
        return step, floor_row(replicas, segment, args.rounds, args.cycles)

    (step, floor), stolen = least_stolen(measure)
    out = {"replicas": replicas, "run": run, **{key: step[key] / step["alone"] for key in ("ours", "polling", "sleeping")}}
    out.update({f"mm_{way}": floor[way] / floor["independent"] for way in ("polling", "sleeping")})
    out.update(mm_round=floor["ReplicaRound"] / floor["independent"], stolen=stolen, converted_over_unsynced=step["ours"] / step["torch"],
               mm_n=floor["n"], round_us=floor["independent"] * 1e6, **{f"{key}_ms": t * 1e3 for key, t in step.items()})
    print(" | ".join(results.cell(out.get(c.key), c.format) for c in COLUMNS), flush=True)
    return out


def span(values: list[float]) -> str:
    """Ratios over runs: "1.051x", or "1.041-1.070x"."""
    low, high = min(values), max(values)
    return f"{low:.3f}x" if f"{low:.3f}" == f"{high:.3f}" else f"{low:.3f}-{high:.3f}x"


def summary(rows: list[dict]) -> str:
    """What the table says, from its figures: our meetings against the floor, in the net and in the mm rounds."""
    counts = sorted({r["replicas"] for r in rows})

    def each(figure) -> str:  # the figure's span over the runs, for each number of replicas
        return " and ".join(f"{span([figure(r) for r in rows if r['replicas'] == n])} with {n}" for n in counts)

    return (
        f"Against the small ResNet's step whose layers meet no one, our {MEETINGS} meetings a step take "
        f"{each(lambda r: r['ours'])} replicas, and layers that only wait at a barrier exchanging nothing "
        f"{each(lambda r: min(r['polling'], r['sleeping']))} (the cheaper waiting of each run): the floor that waiting "
        f"for the slowest replica sets on this machine. In rounds of equal native work, our ReplicaRound takes "
        f"{each(lambda r: r['mm_round'])} threads of the independent rounds' time, the cheaper minimal barrier "
        f"{each(lambda r: min(r['mm_polling'], r['mm_sleeping']))}."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 ResNet steps and 20 mm blocks (default: off, 200 and 60)")
    parser.add_argument("--repeats", type=int, default=3, choices=range(1, 11), metavar="1..10",
                        help="runs for each number of replicas (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=20, help="mm rounds a block (default: %(default)s)")
    parser.add_argument("--steps", type=int, help="ResNet steps of each contender (default: 200, 60 with --quick)")
    parser.add_argument("--cycles", type=int, help="mm blocks of each way (default: 60, 20 with --quick)")
    results.add_output_options(parser)
    args = parser.parse_args()
    args.steps = args.steps or (60 if args.quick else 200)
    args.cycles = args.cycles or (20 if args.quick else 60)
    torch.set_num_threads(1)
    native()  # built before anything is timed
    rows = [measured_row(replicas, run + 1, args) for replicas in (2, 4) for run in range(args.repeats)]
    result = dict(
        title="What a barrier alone costs",
        method=f"The small ResNet of bench_sync_overhead.py under R thread replicas, one intra-op thread, {args.steps} "
               f"steps of each contender alternating, medians; then R native threads doing one n x n float32 mm a round "
               f"(the CPU time a replica spends between two meetings), in blocks of {args.rounds} rounds that take each way "
               f"of meeting in turn, {args.cycles} blocks each, a block's time its slowest thread's.",
        columns=COLUMNS, rows=rows, summary=summary(rows), meetings=MEETINGS, cores=usable_cores(),
    )
    results.output(args, "barrier_floor", **result)


if __name__ == "__main__":
    main()

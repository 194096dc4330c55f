// The GPU kernels run on the host: a launch runs its blocks one after another, and the threads
// of a block as fibers that switch only where the GPU would make them wait (a block or warp
// barrier, a warp shuffle or ballot). Barriers and warp collectives meet as on the GPU; one
// that some thread never reaches, or that the lanes of a warp reach as different collectives,
// fails the launch with a message instead of hanging. The order in which a block's fibers run
// between two meeting points is a setting (forward, backward, shuffled), so a read of shared
// memory that is missing its barrier reads stale data in at least one of the orders.
//
// Host-only test code (tests/test_gpu_emulation.py): no GPU, no torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

namespace moeext_emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

enum class Order : int { kForward = 0, kBackward = 1, kShuffled = 2 };

#if !defined(MOEEXT_EMU_WARP_SIZE)
#define MOEEXT_EMU_WARP_SIZE 32
#endif

struct Settings {
  int warp_size = MOEEXT_EMU_WARP_SIZE;  // a build's: the kernels compile for one width
  Order order = Order::kForward;
  uint64_t seed = 1;  // for kShuffled
};
Settings& settings();

// Runs body once per thread of every block. Returns an empty string, or why the launch failed.
std::string launch(Dim3 grid, Dim3 block, size_t dynamic_shared_bytes,
                   const std::function<void()>& body);

// The launch error the runtime last recorded (taken: the next call returns "" until another).
std::string take_error();
void record_error(const std::string& message);

void* dynamic_shared();

void sync_block();
void sync_warp();
// Every lane of the warp gives `value`; returns what lane `source` gave (the warp's own lane
// index is the linear thread index modulo the warp size).
uint64_t warp_exchange(uint64_t value, int source);
uint64_t warp_ballot(bool predicate);
// Every lane of the warp gives `value`; out[i] gets lane i's (one meeting for all of them).
void warp_all(uint64_t value, uint64_t* out);

// How many of each meeting the launches since the last reset_counts() made: a block's
// barriers, and a warp's syncs, shuffles, ballots and whole-warp gathers (a redux.sync
// reduction is one). A warp's collective counts once, not once per lane.
struct Counts {
  uint64_t block_barriers = 0;
  uint64_t warp_syncs = 0;
  uint64_t shuffles = 0;
  uint64_t ballots = 0;
  uint64_t gathers = 0;
};
const Counts& counts();
void reset_counts();

}  // namespace moeext_emu

// CUDA's built-in variables: the running thread's indices and its launch's shape, set by the
// runtime each time it switches to a thread (all ones outside a launch).
extern moeext_emu::Dim3 threadIdx, blockIdx, blockDim, gridDim;

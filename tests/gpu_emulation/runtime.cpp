// The fibers and their meeting points (runtime.h). x86-64 System V only: a fiber switch saves
// the callee-saved registers and the FP control words on the fiber's stack and swaps stacks.
#include "runtime.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#if defined(MOEEXT_EMU_RACES)
#include <sanitizer/tsan_interface.h>
#endif

#if !defined(__x86_64__)
#error "the GPU emulation's fiber switch is written for x86-64"
#endif

extern "C" void moeext_emu_switch(void** save_sp, void* load_sp);

asm(R"(
.text
.globl moeext_emu_switch
.type moeext_emu_switch,@function
moeext_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size moeext_emu_switch, .-moeext_emu_switch
)");

namespace moeext_emu {
namespace {

constexpr size_t kStackBytes = size_t(256) << 10;

// A fiber's stack, with an inaccessible page below it: an overflow faults instead of writing
// over the next fiber's.
class Stack {
 public:
  Stack() {
    guard_ = size_t(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, guard_ + kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("GPU emulation: no memory for a fiber stack");
    base_ = static_cast<char*>(p);
    mprotect(base_, guard_, PROT_NONE);
  }
  ~Stack() { munmap(base_, guard_ + kStackBytes); }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  char* bottom() const { return base_ + guard_; }

 private:
  char* base_ = nullptr;
  size_t guard_ = 0;
};

// Race builds (MOEEXT_EMU_RACES; this file itself is not instrumented, tests/gpu_emulation/
// races.py): ThreadSanitizer sees each thread slot as a fiber of its own, and learns from the
// runtime only the orderings a GPU guarantees within a block: a block barrier orders the
// block's threads, and a warp sync the warp's lanes. Shuffles, ballots and reductions order
// nothing (CUDA: "they do not guarantee any memory ordering"), so shared data that a warp hands
// around by memory needs its sync. Blocks are ordered one after another and after the host's
// work before them (the scheduler hands each block its start and takes its end): races between
// blocks are not looked for.
#if defined(MOEEXT_EMU_RACES)
void* new_race_fiber() { return __tsan_create_fiber(0); }
void drop_race_fiber(void* fiber) { __tsan_destroy_fiber(fiber); }
void* current_race_fiber() { return __tsan_get_current_fiber(); }
void race_switch(void* fiber) { __tsan_switch_to_fiber(fiber, __tsan_switch_to_fiber_no_sync); }
void race_release(void* sync) { __tsan_release(sync); }
void race_acquire(void* sync) { __tsan_acquire(sync); }
#else
void* new_race_fiber() { return nullptr; }
void drop_race_fiber(void*) {}
void* current_race_fiber() { return nullptr; }
void race_switch(void*) {}
void race_release(void*) {}
void race_acquire(void*) {}
#endif

// What ThreadSanitizer keys the orderings by: their addresses. A barrier's is chosen by the
// parity of its generation: a thread still leaving one generation cannot meet a thread already
// arriving at the generation after the next.
struct RaceSyncs {
  char block_start, block_end;
  char block[2];
  char warp[32][2];  // by the warp's index in its block
} g_syncs;

// A thread slot's stack and, in race builds, its ThreadSanitizer fiber, kept across launches.
struct Slot {
  Stack stack;
  void* race_fiber = new_race_fiber();
  ~Slot() { drop_race_fiber(race_fiber); }
};

// Why a fiber is not running: it has not started, it waits at a meeting point, or it is done.
enum class State { kReady, kWaiting, kDone };

// Which meeting point a lane waits at: the lanes of a warp must all be at the same kind.
enum class Meet { kNone, kWarpSync, kExchange, kBallot, kAll };

struct Fiber {
  void* sp = nullptr;
  Slot* slot = nullptr;
  State state = State::kReady;
  Dim3 thread;
  int linear = 0;
  uint64_t waits_for = 0;  // the generation of the barrier it waits at
  bool at_block_barrier = false;
};

struct Warp {
  int live = 0;
  int arrived = 0;
  uint64_t generation = 0;
  Meet meet = Meet::kNone;
  uint64_t slots[64] = {};
};

struct Block {
  Dim3 index;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int live = 0;
  int arrived = 0;
  uint64_t generation = 0;
  std::string error;
};

struct Launch {
  const std::function<void()>* body = nullptr;
  std::vector<unsigned char> shared;
  Block current;
  void* scheduler_sp = nullptr;
  void* scheduler_race_fiber = nullptr;
  Fiber* running = nullptr;
};

// Kept from launch to launch (one per thread of the largest block so far).
std::vector<std::unique_ptr<Slot>>& slots() {
  static std::vector<std::unique_ptr<Slot>> kept;
  return kept;
}

Launch* g_launch = nullptr;
std::string g_error;
Counts g_counts;

Block& block() { return g_launch->current; }
Fiber& me() { return *g_launch->running; }

void yield() {
  race_switch(g_launch->scheduler_race_fiber);
  moeext_emu_switch(&me().sp, g_launch->scheduler_sp);
}

[[noreturn]] void fiber_entry() {
  Launch& l = *g_launch;
  Fiber& f = *l.running;
  race_acquire(&g_syncs.block_start);
  (*l.body)();
  race_release(&g_syncs.block_end);
  Block& b = block();
  f.state = State::kDone;
  --b.live;
  Warp& w = b.warps[size_t(f.linear / settings().warp_size)];
  --w.live;
  // A barrier the others wait at counts only the threads still running, as on the GPU.
  if (b.live > 0 && b.arrived > 0 && b.arrived == b.live) {
    b.arrived = 0;
    ++b.generation;
  }
  if (w.live > 0 && w.arrived > 0) {
    b.error = "a lane of a warp exited while the others met at a warp collective";
  }
  race_switch(l.scheduler_race_fiber);
  moeext_emu_switch(&f.sp, l.scheduler_sp);
  __builtin_unreachable();
}

// A fresh fiber's stack, laid out as moeext_emu_switch leaves a suspended one: the control
// words, six callee-saved registers, and fiber_entry as the return address, placed so that
// fiber_entry starts with the stack aligned as after a call.
void* fresh_stack(char* base) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(base) + kStackBytes) & ~uintptr_t(15);
  auto* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;  // where fiber_entry's caller's return address would be
  *--sp = reinterpret_cast<uint64_t>(&fiber_entry);
  for (int i = 0; i < 6; ++i) *--sp = 0;
  uint32_t mxcsr = 0;
  uint16_t fpcw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  *--sp = uint64_t(mxcsr) | (uint64_t(fpcw) << 32);
  return sp;
}

// Runs the fibers of the current block in the settings' order until all are done, or until
// none can move (a barrier some thread never reaches) or one reports an error.
void run_block(std::mt19937_64& rng) {
  Block& b = block();
  std::vector<int> order(b.fibers.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
  const Order how = settings().order;
  if (how == Order::kBackward) std::reverse(order.begin(), order.end());
  for (;;) {
    if (how == Order::kShuffled) std::shuffle(order.begin(), order.end(), rng);
    bool moved = false;
    bool all_done = true;
    for (int i : order) {
      Fiber& f = b.fibers[size_t(i)];
      if (f.state == State::kDone) continue;
      all_done = false;
      if (f.state == State::kWaiting) {
        const uint64_t now = f.at_block_barrier
                                 ? b.generation
                                 : b.warps[size_t(f.linear / settings().warp_size)].generation;
        if (now == f.waits_for) continue;
        f.state = State::kReady;
      }
      moved = true;
      g_launch->running = &f;
      threadIdx = f.thread;
      race_switch(f.slot->race_fiber);
      moeext_emu_switch(&g_launch->scheduler_sp, f.sp);
      g_launch->running = nullptr;
      if (!b.error.empty()) return;
    }
    if (all_done) return;
    if (!moved) {
      b.error = "deadlock: the block's threads wait at barriers or warp collectives that the "
                "others never reach";
      return;
    }
  }
}

// A collective's second meeting (its lanes done reading the slots) is not counted.
void wait_warp(Meet meet, bool counted = true) {
  Block& b = block();
  Fiber& f = me();
  Warp& w = b.warps[size_t(f.linear / settings().warp_size)];
  if (w.arrived == 0) {
    w.meet = meet;
  } else if (w.meet != meet) {
    b.error = "the lanes of a warp reached different warp collectives";
    yield();
  }
  const uint64_t generation = w.generation;
  void* const sync = meet == Meet::kWarpSync
                         ? &g_syncs.warp[size_t(f.linear / settings().warp_size)][generation & 1]
                         : nullptr;
  if (sync != nullptr) race_release(sync);
  if (++w.arrived == w.live) {
    w.arrived = 0;
    ++w.generation;
    if (sync != nullptr) race_acquire(sync);
    if (counted) {
      switch (meet) {
        case Meet::kWarpSync: ++g_counts.warp_syncs; break;
        case Meet::kExchange: ++g_counts.shuffles; break;
        case Meet::kBallot: ++g_counts.ballots; break;
        case Meet::kAll: ++g_counts.gathers; break;
        case Meet::kNone: break;
      }
    }
    return;
  }
  f.state = State::kWaiting;
  f.at_block_barrier = false;
  f.waits_for = generation;
  yield();
  if (sync != nullptr) race_acquire(sync);
}

int lane() { return me().linear % settings().warp_size; }

Warp& my_warp() { return block().warps[size_t(me().linear / settings().warp_size)]; }

}  // namespace

Settings& settings() {
  static Settings s;
  return s;
}

std::string take_error() {
  std::string e;
  e.swap(g_error);
  return e;
}

const Counts& counts() { return g_counts; }
void reset_counts() { g_counts = Counts{}; }

void record_error(const std::string& message) {
  if (g_error.empty()) g_error = message;
}

std::string launch(Dim3 grid, Dim3 block_dim, size_t dynamic_shared_bytes,
                   const std::function<void()>& body) {
  if (g_launch != nullptr) return "a launch from inside a kernel";
  const int warp = settings().warp_size;
  const size_t threads = size_t(block_dim.x) * block_dim.y * block_dim.z;
  if (threads == 0 || threads > 1024) return "invalid block size";
  if (size_t(grid.x) * grid.y * grid.z == 0) return "invalid grid size";
  if (grid.y > 65535 || grid.z > 65535) return "grid too large";

  Launch l;
  l.body = &body;
  l.shared.resize(std::max<size_t>(dynamic_shared_bytes, 16));
  l.scheduler_race_fiber = current_race_fiber();
  while (slots().size() < threads) slots().push_back(std::make_unique<Slot>());
  g_launch = &l;
  blockDim = block_dim;
  gridDim = grid;
  std::mt19937_64 rng(settings().seed);
  std::string error;
  for (unsigned bz = 0; bz < grid.z && error.empty(); ++bz) {
    for (unsigned by = 0; by < grid.y && error.empty(); ++by) {
      for (unsigned bx = 0; bx < grid.x && error.empty(); ++bx) {
        // Uninitialised on the GPU: a pattern no block should read before writing.
        std::fill(l.shared.begin(), l.shared.end(), static_cast<unsigned char>(0xcd));
        Block& b = l.current;
        b = Block{};
        b.index = Dim3{bx, by, bz};
        b.fibers.resize(threads);
        b.warps.resize((threads + size_t(warp) - 1) / size_t(warp));
        b.live = int(threads);
        for (size_t i = 0; i < threads; ++i) {
          Fiber& f = b.fibers[i];
          f.linear = int(i);
          f.thread = Dim3{unsigned(i % block_dim.x), unsigned(i / block_dim.x % block_dim.y),
                          unsigned(i / (size_t(block_dim.x) * block_dim.y))};
          f.slot = slots()[i].get();
          f.sp = fresh_stack(f.slot->stack.bottom());
          ++b.warps[i / size_t(warp)].live;
        }
        blockIdx = b.index;
        race_release(&g_syncs.block_start);
        run_block(rng);
        race_acquire(&g_syncs.block_end);
        error = b.error;
        // A fiber left inside its kernel (the block failed) starts afresh in the next launch.
        for (Fiber& f : b.fibers) {
          if (f.state == State::kDone) continue;
          drop_race_fiber(f.slot->race_fiber);
          f.slot->race_fiber = new_race_fiber();
        }
      }
    }
  }
  g_launch = nullptr;
  threadIdx = blockIdx = blockDim = gridDim = Dim3{};
  return error;
}

void* dynamic_shared() { return g_launch ? g_launch->shared.data() : nullptr; }

void sync_block() {
  Block& b = block();
  Fiber& f = me();
  const uint64_t generation = b.generation;
  void* const sync = &g_syncs.block[generation & 1];
  race_release(sync);
  if (++b.arrived == b.live) {
    b.arrived = 0;
    ++b.generation;
    ++g_counts.block_barriers;
    race_acquire(sync);
    return;
  }
  f.state = State::kWaiting;
  f.at_block_barrier = true;
  f.waits_for = generation;
  yield();
  race_acquire(sync);
}

void sync_warp() { wait_warp(Meet::kWarpSync); }

uint64_t warp_exchange(uint64_t value, int source) {
  my_warp().slots[lane()] = value;
  wait_warp(Meet::kExchange);
  const int width = settings().warp_size;
  const uint64_t result = my_warp().slots[((source % width) + width) % width];
  wait_warp(Meet::kExchange, false);
  return result;
}

uint64_t warp_ballot(bool predicate) {
  my_warp().slots[lane()] = predicate ? 1 : 0;
  wait_warp(Meet::kBallot);
  uint64_t bits = 0;
  const Warp& w = my_warp();
  for (int i = 0; i < settings().warp_size; ++i) bits |= w.slots[i] << i;
  wait_warp(Meet::kBallot, false);
  return bits;
}

void warp_all(uint64_t value, uint64_t* out) {
  my_warp().slots[lane()] = value;
  wait_warp(Meet::kAll);
  // A loop, not a copy: a race build's memmove would be checked as the fiber's own access.
  const Warp& w = my_warp();
  for (int i = 0; i < settings().warp_size; ++i) out[i] = w.slots[i];
  wait_warp(Meet::kAll, false);
}

}  // namespace moeext_emu

moeext_emu::Dim3 threadIdx, blockIdx, blockDim, gridDim;

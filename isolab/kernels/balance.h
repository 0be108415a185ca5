// How a parallel region shares out independent tasks so that a thread the OS takes away for a
// moment (the server's event loop, an HTTP client, the hypervisor) does not hold up the rest:
// each thread owns the run of tasks a static schedule would give it and takes them in order (so a
// GEMM's panels stay in that core's cache from one row chunk to the next), and a thread whose run
// is done takes the others' remaining tasks from the front of their runs.
//
// Which thread runs a task never changes what the task computes (tasks write disjoint outputs,
// each with its own fixed arithmetic), so no bit depends on the schedule: batch invariance holds.
#pragma once

#include <atomic>
#include <chrono>
#include <thread>

#include <omp.h>

namespace isolab {

constexpr int kMaxRuns = 64;  // threads a region shares tasks among; beyond it, static shares

// One thread's run of tasks: `next` is the first one nobody has taken. Padded to a cache line so
// owners taking their own tasks never share a line. Left uninitialized (C++17: a trivial default
// constructor): `balanced` sets each thread's own before anyone reads it.
struct alignas(64) Run {
    std::atomic<long> next;
    long end;
};

// 1 (default): share tasks out as above; 0: each thread runs only its own run (a static schedule),
// for the bench's A/B; 2: share, and thread 0 starts 2 ms late, so the others take its run (the
// test that every task lands where it belongs when another thread runs it). Read once a region
// (relaxed): a setting, not a synchronization.
inline std::atomic<int>& balance_mode() {
    static std::atomic<int> mode{1};
    return mode;
}

// Called by every thread of the region, with `runs` shared (kMaxRuns of them, declared before the
// region). owned(t) is how many tasks thread t owns; body(t, i) runs thread t's i-th task. The
// barrier inside lets every run be set before anyone takes from another's. Ends without a barrier:
// the region's own (or the caller's) follows.
template <typename Owned, typename Body>
inline void balanced(Run* runs, Owned&& owned, Body&& body) {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    if (nt > kMaxRuns) {
        for (long i = 0, n = owned(t); i < n; i++) body(t, i);
        return;
    }
    runs[t].next.store(0, std::memory_order_relaxed);
    runs[t].end = owned(t);
#pragma omp barrier
    const int mode = balance_mode().load(std::memory_order_relaxed);
    const bool steal = mode != 0;
    if (mode == 2 && t == 0 && nt > 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    for (int k = 0; k < (steal ? nt : 1); k++) {
        const int v = (t + k) % nt;
        for (long i; (i = runs[v].next.fetch_add(1, std::memory_order_relaxed)) < runs[v].end;) body(v, i);
    }
}

// The static share of n tasks that thread t of nt owns: [first, first + count).
inline long share_first(long n, int nt, int t) { return n / nt * t + (t < n % nt ? t : n % nt); }
inline long share_count(long n, int nt, int t) { return n / nt + (t < n % nt ? 1 : 0); }

}  // namespace isolab

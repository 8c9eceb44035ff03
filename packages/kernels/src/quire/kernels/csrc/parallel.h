// A parallel loop whose threads take chunks of the range as they go, for Quire's CPU kernels.
//
// at::parallel_for gives each OpenMP thread one fixed share of the range. When the engine shares its cores
// with other processes (the HTTP front end, a benchmark client), the OS now and then runs one of those on a
// core for a millisecond or two; the thread it displaced holds up its whole share, and the other threads
// finish theirs and wait. Measured on 2 cores: a process busy 2 ms in every 16 (1/16 of the machine) cut the
// tiny model's offline throughput by a quarter. Here threads claim small chunks from a shared counter, so the
// threads that keep running take over the rest of the range and only the chunk in hand waits for the
// displaced thread (benchmarks/interference.py measures what is left of the effect).
//
// Each index is still computed by the same code whichever thread takes it, so results do not change.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace quire {

// Run f(chunk_begin, chunk_end) over [begin, end) in chunks of `chunk` indices (the last may be shorter),
// on up to at::get_num_threads() threads; inline when there is a single chunk, a single thread, or when
// called from inside a parallel region. The first exception a chunk throws is rethrown once all stop.
template <typename F>
void parallel_chunks(int64_t begin, int64_t end, int64_t chunk, const F& f) {
  if (end <= begin) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (end - begin + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
#ifdef _OPENMP
  if (threads > 1 && !omp_in_parallel()) {
    std::atomic<int64_t> next{0};
    std::atomic<bool> failed{false};
    std::exception_ptr error;
    std::mutex error_lock;
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
      for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks && !failed.load();
           c = next.fetch_add(1, std::memory_order_relaxed)) {
        const int64_t first = begin + c * chunk;
        try {
          f(first, std::min(end, first + chunk));
        } catch (...) {
          std::lock_guard<std::mutex> guard(error_lock);
          if (!error) error = std::current_exception();
          failed = true;
        }
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  f(begin, end);
}

// `count` indices split into `parts` runs of nearly equal length (the longer ones first): where run i starts, and
// its length.
inline std::pair<int64_t, int64_t> row_run(int64_t count, int64_t parts, int64_t i) {
  const int64_t base = count / parts, extra = count % parts;
  return {i * base + std::min(i, extra), base + (i < extra ? 1 : 0)};
}

// A chunk size that splits `count` indices into about `per_thread` chunks for each thread, and none
// smaller than `grain` (below which waking a thread costs more than the work).
inline int64_t chunk_size(int64_t count, int64_t grain, int64_t per_thread = 8) {
  const int64_t pieces = std::max<int64_t>(1, at::get_num_threads() * per_thread);
  return std::max<int64_t>(std::max<int64_t>(1, grain), (count + pieces - 1) / pieces);
}

}  // namespace quire

// CollectiveQueue: runs a group's multi-step ("composed") collectives on one worker thread, in
// issue order.
//
// Why: a composed collective (e.g. the deterministic all_reduce = all_to_all, local tree sum,
// all_gather) issues its later steps only after earlier ones finish. If those later steps were
// issued from whichever thread happened to wait first, two ranks could issue native collectives in
// different orders and mismatch. Here every rank issues in program order: composed collectives run
// FIFO on the worker; when the queue is idle, a single-step native collective is issued directly by
// the caller, and a blocking composed one runs in the caller (the fast paths, no thread hop).
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

namespace hp::comm::detail {

class CollectiveQueue {
 public:
  CollectiveQueue() = default;
  ~CollectiveQueue();
  CollectiveQueue(const CollectiveQueue&) = delete;
  CollectiveQueue& operator=(const CollectiveQueue&) = delete;

  // Calls `issue` in the caller's thread if nothing is queued or running and returns true;
  // otherwise returns false and the caller must enqueue instead.
  bool issue_if_idle(const std::function<void()>& issue);

  // Runs `task` in the caller's thread if nothing is queued or running (the blocking fast path: no
  // thread hop) and returns its result; returns nullopt, running nothing, otherwise.
  std::optional<at::Tensor> run_if_idle(const std::function<at::Tensor()>& task);

  // Runs `task` on the worker after everything queued before it; what it allocates is charged to
  // the caller's MemoryTrackers.
  std::shared_future<at::Tensor> enqueue(std::function<at::Tensor()> task);

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<at::Tensor()>> tasks_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread worker_;  // started on first enqueue
};

}  // namespace hp::comm::detail

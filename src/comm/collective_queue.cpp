#include "comm/collective_queue.h"

#include "hp/core/memory_timeline.h"
#include "hp/core/memory_tracker.h"

namespace hp::comm::detail {

CollectiveQueue::~CollectiveQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

bool CollectiveQueue::issue_if_idle(const std::function<void()>& issue) {
  std::lock_guard<std::mutex> lock(mu_);
  if (busy_ || !tasks_.empty()) return false;
  issue();  // under the lock, so the worker cannot start a queued task in between
  return true;
}

std::optional<at::Tensor> CollectiveQueue::run_if_idle(const std::function<at::Tensor()>& task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (busy_ || !tasks_.empty()) return std::nullopt;
    busy_ = true;  // anything enqueued meanwhile waits for us
  }
  struct Release {
    CollectiveQueue* queue;
    ~Release() {
      std::lock_guard<std::mutex> lock(queue->mu_);
      queue->busy_ = false;
      queue->cv_.notify_all();
    }
  } release{this};
  return task();
}

std::shared_future<at::Tensor> CollectiveQueue::enqueue(std::function<at::Tensor()> task) {
  // What the worker allocates for the caller (received pieces, results) counts as the caller's.
  std::packaged_task<at::Tensor()> packaged(
      [owners = MemoryTracker::owners_of_this_thread(), task = std::move(task)]() mutable {
        const MemoryTracker::ChargeTo charge(owners);
        const MemoryLabel communication(MemoryLabel::kCommunication);
        std::function<at::Tensor()> run = std::move(task);
        at::Tensor result = run();
        // What the task holds (the collective's buffers) goes before its caller sees the result,
        // so that caller's memory is settled when its wait returns.
        run = nullptr;
        return result;
      });
  std::shared_future<at::Tensor> result = packaged.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(packaged));
    if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
  }
  cv_.notify_one();
  return result;
}

void CollectiveQueue::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || (!tasks_.empty() && !busy_); });
    if (tasks_.empty()) return;  // stop_ and nothing left to run
    if (busy_) continue;         // a caller is running a task inline
    std::packaged_task<at::Tensor()> task = std::move(tasks_.front());
    tasks_.pop_front();
    busy_ = true;
    lock.unlock();
    task();  // exceptions land in the task's future
    lock.lock();
    busy_ = false;
  }
}

}  // namespace hp::comm::detail

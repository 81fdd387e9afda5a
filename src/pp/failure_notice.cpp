#include "pp/failure_notice.h"

#include <chrono>

namespace hp::pp {
namespace {
// How often a rank looks for another rank's failure: one store round trip per period, and the
// longest a healthy rank waits after a peer fails.
constexpr auto kPollPeriod = std::chrono::milliseconds(20);
}  // namespace

FailureNotice::FailureNotice(const comm::ProcessGroup& group, std::string key)
    : group_(group), key_(std::move(key)), poller_([this] { poll(); }) {}

FailureNotice::~FailureNotice() { stop(); }

void FailureNotice::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (poller_.joinable()) poller_.join();
}

void FailureNotice::poll() {
  const comm::GroupStore store = group_.store();
  comm::StorePollOptions options;
  options.period = kPollPeriod;
  options.deadline = std::chrono::steady_clock::time_point::max();  // until stopped
  // The lock is held while looking (waiting_ may be aborted) and released while pausing.
  std::unique_lock<std::mutex> lock(mutex_);
  options.pause = [&](std::chrono::milliseconds period) {
    return wake_.wait_for(lock, period, [&] { return stopping_; });
  };
  bool published = false;
  try {
    published = store.wait_for({key_}, options).empty();
  } catch (const std::exception&) {
    return;  // the store is gone (its host died); the transport reports that failure itself
  }
  if (published) {
    failed_ = true;
    if (waiting_ != nullptr) waiting_->abort();
  }
}

at::Tensor FailureNotice::wait(comm::Work work) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_) work.abort();
    waiting_ = &work;
  }
  struct Clear {
    FailureNotice* self;
    ~Clear() {
      std::lock_guard<std::mutex> lock(self->mutex_);
      self->waiting_ = nullptr;
    }
  } clear{this};
  return work.wait();
}

void FailureNotice::publish(const std::string& message) { group_.store().set(key_, message); }

std::string FailureNotice::message() const { return group_.store().get(key_); }

}  // namespace hp::pp

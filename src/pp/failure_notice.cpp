#include "pp/failure_notice.h"

#include "comm/group_impl.h"

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
  auto& store = *group_.impl().store;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, kPollPeriod, [&] { return stopping_; })) {
    bool published = false;
    try {
      published = store.check({key_});
    } catch (const std::exception&) {
      return;  // the store is gone (its host died); the transport reports that failure itself
    }
    if (published) {
      failed_ = true;
      if (waiting_ != nullptr) waiting_->abort();
      return;
    }
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

void FailureNotice::publish(const std::string& message) {
  group_.impl().store->set(key_, std::vector<uint8_t>(message.begin(), message.end()));
}

std::string FailureNotice::message() const {
  const std::vector<uint8_t> bytes = group_.impl().store->get(key_);
  return std::string(bytes.begin(), bytes.end());
}

}  // namespace hp::pp

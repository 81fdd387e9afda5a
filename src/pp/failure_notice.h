// Tells the ranks of a pipeline that one of them failed, so none of them waits forever for a
// message the failed rank will never send.
//
// The failing rank publishes its error under a key of the group's store; every other rank polls
// for that key while it runs its part of the pass and aborts the send or receive it is waiting on.
// The pass then ends on every rank, and the ranks agree on the outcome with one collective.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "hp/comm/process_group.h"

namespace hp::pp {

class FailureNotice {
 public:
  // Starts polling `key` in the group's store.
  FailureNotice(const comm::ProcessGroup& group, std::string key);
  ~FailureNotice();
  FailureNotice(const FailureNotice&) = delete;
  FailureNotice& operator=(const FailureNotice&) = delete;

  // work.wait(), unless another rank's failure is (or becomes) known first: then the work is
  // aborted and this throws.
  at::Tensor wait(comm::Work work);
  bool failed() const { return failed_; }  // another rank published a failure

  void publish(const std::string& message);  // this rank failed
  std::string message() const;               // the published failure (waits for it)
  void stop();                               // stops polling; idempotent

 private:
  void poll();
  comm::ProcessGroup group_;
  std::string key_;
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  comm::Work* waiting_ = nullptr;
  std::thread poller_;
};

}  // namespace hp::pp

#include "comm/fake_exchange.h"

#include "hp/core/error.h"

namespace hp::comm {

FakeExchange::FakeExchange() : state_(std::make_unique<State>()) {}
FakeExchange::~FakeExchange() = default;

void FakeExchange::abort(const std::string& why) { state_->abort(why); }

void FakeExchange::State::post(Key key, at::Tensor message) {
  {
    const std::lock_guard<std::mutex> lock(mu_);
    messages_[std::move(key)].push_back(std::move(message));
  }
  arrived_.notify_all();
}

at::Tensor FakeExchange::State::take(const Key& key, std::chrono::milliseconds timeout, const std::string& what) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto ready = [&] {
    const auto it = messages_.find(key);
    return aborted_.has_value() || (it != messages_.end() && !it->second.empty());
  };
  if (!arrived_.wait_for(lock, timeout, ready))
    throw hp::TimeoutError(what + ": no fake world sharing this exchange sent it within " +
                           std::to_string(timeout.count()) + " ms (is the peer simulated alongside?)");
  HP_CHECK(!aborted_, what, ": ", *aborted_);
  auto it = messages_.find(key);
  at::Tensor message = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) messages_.erase(it);
  return message;
}

void FakeExchange::State::abort(const std::string& why) {
  {
    const std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_) aborted_ = why;
  }
  arrived_.notify_all();
}

}  // namespace hp::comm

// The messages a FakeExchange (hp/comm/init.h) holds between the fake worlds that share it.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "hp/comm/init.h"

namespace hp::comm {

struct FakeExchange::State {
  // (the group's world ranks, sender's world rank, receiver's world rank, tag)
  using Key = std::tuple<std::vector<int>, int, int, int>;

  // Keeps `message` (the caller's copy) for the matching receive; messages of one key keep their order.
  void post(Key key, at::Tensor message);
  // The oldest message of `key`, waiting up to `timeout` for it; `what` names the receive in the error.
  at::Tensor take(const Key& key, std::chrono::milliseconds timeout, const std::string& what);
  void abort(const std::string& why);

 private:
  std::mutex mu_;
  std::condition_variable arrived_;
  std::map<Key, std::deque<at::Tensor>> messages_;
  std::optional<std::string> aborted_;
};

}  // namespace hp::comm

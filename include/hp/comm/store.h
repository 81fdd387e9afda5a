// A process group's share of the rendezvous key-value store, for the few protocols that agree on
// small values outside the collective sequence: which ranks reached a failed collective, a
// pipeline's failure notice, a checkpoint's commit. Keys are the caller's; values are strings.
//
//   const hp::comm::GroupStore store = group.store();
//   store.set("my_protocol/done/" + std::to_string(group.rank()), "");
//   auto missing = store.wait_for({"my_protocol/done/0", "my_protocol/done/1"}, {});  // polls
//
// Every call may throw hp::Error when the store is unreachable (its host, world rank 0, died).
// Thread-safe; not a collective.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace hp::comm {

namespace detail {
struct GroupImpl;
}

struct StorePollOptions {
  // Time between two looks at the store.
  std::chrono::milliseconds period{20};
  // Give up at this time (default: the group's timeout from the call).
  std::optional<std::chrono::steady_clock::time_point> deadline;
  // How to wait between looks: waits up to `period` and returns true to give up (e.g. a condition
  // variable that a stop request wakes). Default: sleeps for `period`.
  std::function<bool(std::chrono::milliseconds period)> pause;
};

class GroupStore {
 public:
  explicit GroupStore(std::shared_ptr<detail::GroupImpl> group);

  void set(const std::string& key, const std::string& value) const;
  // Waits for the key up to the group's timeout.
  std::string get(const std::string& key) const;
  int64_t add(const std::string& key, int64_t amount) const;  // returns the new value
  bool check(const std::string& key) const;                   // whether the key is there now
  // Looks every `period` until every key is there, the deadline passes, or `pause` gives up;
  // returns the keys still missing (empty: all there).
  std::vector<std::string> wait_for(const std::vector<std::string>& keys, const StorePollOptions& options) const;

 private:
  std::shared_ptr<detail::GroupImpl> group_;
};

}  // namespace hp::comm

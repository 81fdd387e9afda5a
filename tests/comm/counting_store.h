// An in-process store that counts the requests a TCPStore client would send to its server, for
// tests of what the library's store protocols cost the job's store (tests/comm/reach_report_test,
// tests/pp/failure_notice_test). Polls of a counter (an add of 0) are counted apart too: their
// number depends on how long a member waits, not on the group's size.
#pragma once

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace hp::test {

class CountingStore : public c10d::HashStore {
 public:
  std::atomic<int64_t> requests{0}, polls{0};
  void set(const std::string& key, const std::vector<uint8_t>& data) override {
    ++requests;
    HashStore::set(key, data);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    ++requests;
    return HashStore::get(key);
  }
  int64_t add(const std::string& key, int64_t value) override {
    ++requests;
    if (value == 0) ++polls;
    return HashStore::add(key, value);
  }
  bool check(const std::vector<std::string>& keys) override {
    ++requests;
    return HashStore::check(keys);
  }
};

}  // namespace hp::test

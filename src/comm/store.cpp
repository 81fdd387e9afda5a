#include "hp/comm/store.h"

#include <thread>

#include "comm/group_impl.h"
#include "hp/core/error.h"

namespace hp::comm {
namespace {

std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// The store's own exceptions (c10::Error from a lost connection, ...) as hp::Error naming the key.
template <typename Fn>
auto guarded(const char* what, const std::string& key, const Fn& fn) {
  try {
    return fn();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string message = e.what();
    HP_FAIL("store ", what, " '", key, "' failed: ", message.substr(0, message.find('\n')));
  }
}

}  // namespace

GroupStore::GroupStore(std::shared_ptr<detail::GroupImpl> group) : group_(std::move(group)) {
  HP_CHECK(group_ != nullptr, "GroupStore: no group");
}

void GroupStore::set(const std::string& key, const std::string& value) const {
  guarded("set", key, [&] {
    group_->store->set(key, bytes_of(value));
    return 0;
  });
}

std::string GroupStore::get(const std::string& key) const {
  return guarded("get", key, [&] {
    const std::vector<uint8_t> bytes = group_->store->get(key);
    return std::string(bytes.begin(), bytes.end());
  });
}

int64_t GroupStore::add(const std::string& key, int64_t amount) const {
  return guarded("add", key, [&] { return group_->store->add(key, amount); });
}

bool GroupStore::check(const std::string& key) const {
  return guarded("check", key, [&] { return group_->store->check({key}); });
}

std::vector<std::string> GroupStore::wait_for(const std::vector<std::string>& keys,
                                              const StorePollOptions& options) const {
  const auto deadline = options.deadline.value_or(std::chrono::steady_clock::now() + group_->options.timeout);
  std::vector<std::string> missing = keys;
  for (;;) {
    std::vector<std::string> still;
    for (const std::string& key : missing)
      if (!check(key)) still.push_back(key);
    missing = std::move(still);
    if (missing.empty() || std::chrono::steady_clock::now() >= deadline) return missing;
    if (options.pause) {
      if (options.pause(options.period)) return missing;
    } else {
      std::this_thread::sleep_for(options.period);
    }
  }
}

}  // namespace hp::comm

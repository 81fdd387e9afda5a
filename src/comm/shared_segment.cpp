#include "comm/shared_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

#include "comm/c10d_shim.h"
#include "comm/group_impl.h"
#include "hp/core/error.h"
#include "hp/core/job.h"

namespace hp::comm::detail {
namespace {

std::string system_error(const char* what, int error) { return std::string(what) + ": " + std::strerror(error); }

// Memory that could not be reserved: what create() reports as Outcome::no_room.
struct NoRoom : Error {
  using Error::Error;
};
bool says_no_room(int error) { return error == ENOSPC || error == EDQUOT || error == EFBIG || error == ENOMEM; }
// Marks a member's error as NoRoom in what the members exchange.
constexpr char kNoRoomMark = '\x1f';

// 128 bits from the kernel's random source: a name nobody outside the job can guess. (A name, not
// a value any computation sees: determinism does not reach here.)
std::string random_name() {
  unsigned char bits[16];
  size_t got = 0;
  while (got < sizeof(bits)) {
    const ssize_t n = getrandom(bits + got, sizeof(bits) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    HP_CHECK(n > 0, system_error("getrandom", errno));
    got += static_cast<size_t>(n);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string name = "/" + job::shm_prefix();
  for (unsigned char b : bits) {
    name += kHex[b >> 4];
    name += kHex[b & 15];
  }
  return name;
}

std::shared_ptr<void> map_shared(int fd, int64_t bytes) {
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);
  if (p == MAP_FAILED) {
    if (says_no_room(error)) throw NoRoom(system_error("mmap", error));
    HP_FAIL(system_error("mmap", error));
  }
  return std::shared_ptr<void>(p, [bytes](void* q) { munmap(q, static_cast<size_t>(bytes)); });
}

std::shared_ptr<void> create_host_segment(const std::string& name, int64_t bytes) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  HP_CHECK(fd >= 0, system_error(("shm_open(" + name + ")").c_str(), errno));
  // Reserving the pages now turns a full /dev/shm into this error rather than a SIGBUS on first touch.
  int error = ftruncate(fd, bytes) == 0 ? 0 : errno;
  if (error == 0) {
    error = posix_fallocate(fd, 0, bytes);
    while (error == EINTR) error = posix_fallocate(fd, 0, bytes);  // a signal interrupted a large one
  }
  if (error != 0) {
    close(fd);
    shm_unlink(name.c_str());
    const std::string why =
        ::hp::detail::str_cat("could not reserve ", bytes >> 20, " MiB in /dev/shm (", std::strerror(error), ")");
    if (says_no_room(error)) throw NoRoom(why);
    HP_FAIL(why);
  }
  try {
    return map_shared(fd, bytes);
  } catch (...) {
    shm_unlink(name.c_str());  // nothing else would take the reserved pages away
    throw;
  }
}

std::shared_ptr<void> open_host_segment(const std::string& name, int64_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  HP_CHECK(fd >= 0, system_error(("shm_open(" + name + ")").c_str(), errno),
           " (is this rank on rank 0's host, and is /dev/shm shared with it?)");
  struct stat info {};
  const bool sized = fstat(fd, &info) == 0 && info.st_size == bytes;
  if (!sized) close(fd);
  HP_CHECK(sized, "the segment ", name, " does not have the expected ", bytes, " bytes");
  return map_shared(fd, bytes);
}

// Anonymous memory handed between the thread-ranks of this process.
struct ProcessTable {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<void>> segments;
  static ProcessTable& get() {
    static ProcessTable table;
    return table;
  }
};

std::shared_ptr<void> create_process_segment(const std::string& name, int64_t bytes) {
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int error = errno;
    if (says_no_room(error)) throw NoRoom(system_error("mmap", error));
    HP_FAIL(system_error("mmap", error));
  }
  std::shared_ptr<void> memory(p, [bytes](void* q) { munmap(q, static_cast<size_t>(bytes)); });
  ProcessTable& table = ProcessTable::get();
  std::lock_guard<std::mutex> lock(table.mu);
  table.segments[name] = memory;
  return memory;
}

std::shared_ptr<void> open_process_segment(const std::string& name) {
  ProcessTable& table = ProcessTable::get();
  std::lock_guard<std::mutex> lock(table.mu);
  auto it = table.segments.find(name);
  HP_CHECK(it != table.segments.end(), "no segment ", name,
           " in this process (are all members threads of one process?)");
  return it->second;
}

// Takes the name away once every member has mapped the segment (or given up), whatever happens.
struct Unpublish {
  std::string name;
  SegmentScope scope;
  ~Unpublish() {
    if (name.empty()) return;
    if (scope == SegmentScope::kHost) {
      shm_unlink(name.c_str());
    } else {
      ProcessTable& table = ProcessTable::get();
      std::lock_guard<std::mutex> lock(table.mu);
      table.segments.erase(name);
    }
  }
};

// Waits for the key up to the group's timeout (the store's own may be longer).
std::string get_string(GroupImpl& group, const std::string& key) {
  group.store->wait({key}, group.options.timeout);
  const std::vector<uint8_t> value = group.store->get(key);
  return std::string(value.begin(), value.end());
}

void set_string(GroupImpl& group, const std::string& key, const std::string& value) {
  group.store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

}  // namespace

std::string await_string(GroupImpl& group, const std::string& key, int owner, const char* what) {
  try {
    return get_string(group, key);
  } catch (const std::exception& e) {
    const std::string first = shim::first_line(e);
    const std::string msg =
        std::string(what) + " on " + group.describe() + ", world rank " + std::to_string(group.ranks[group.rank]) +
        ": world rank " + std::to_string(group.ranks[owner]) + " did not arrive within " +
        std::to_string(group.options.timeout.count()) + " ms (every member must take part): " + first;
    if (shim::says_timed_out(first)) throw hp::TimeoutError(msg);
    throw hp::Error(msg);
  }
}

std::vector<std::string> exchange_strings(GroupImpl& group, const std::string& keys, const std::string& mine,
                                          const char* what) {
  set_string(group, keys + std::to_string(group.rank), mine);
  std::vector<std::string> all;
  for (int r = 0; r < group.size(); ++r) all.push_back(await_string(group, keys + std::to_string(r), r, what));
  return all;
}

SharedSegment::Outcome SharedSegment::create(GroupImpl& group, int64_t bytes, SegmentScope scope,
                                             const std::string& keys) {
  const std::string name_key = keys + "name";
  std::shared_ptr<void> memory;
  std::string error;
  Unpublish unpublish{"", scope};
  if (group.rank == 0) {
    try {
      const std::string name = random_name();
      memory = scope == SegmentScope::kHost ? create_host_segment(name, bytes) : create_process_segment(name, bytes);
      unpublish.name = name;
    } catch (const NoRoom& e) {
      error = kNoRoomMark + std::string(e.what());
    } catch (const std::exception& e) {
      error = e.what();
    }
    set_string(group, name_key, error.empty() ? unpublish.name : "!" + error);
  } else {
    const std::string name = await_string(group, name_key, 0, "mapping shared memory");
    if (!name.empty() && name[0] == '!') {
      const bool no_room = name.size() > 1 && name[1] == kNoRoomMark;
      error = (no_room ? std::string(1, kNoRoomMark) : std::string()) + "world rank " + std::to_string(group.ranks[0]) +
              ": " + name.substr(no_room ? 2 : 1);
    } else {
      try {
        memory = scope == SegmentScope::kHost ? open_host_segment(name, bytes) : open_process_segment(name);
      } catch (const NoRoom& e) {
        error = kNoRoomMark + std::string(e.what());
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
  }
  // Every member says whether it mapped the segment; only then may rank 0 take the name away.
  const std::vector<std::string> outcomes = exchange_strings(group, keys + "mapped/", error, "mapping shared memory");
  std::string first_error;
  bool no_room = false;
  for (int r = 0; r < group.size() && first_error.empty(); ++r) {
    std::string theirs = outcomes[r];
    if (theirs.empty()) continue;
    no_room = theirs[0] == kNoRoomMark;
    if (no_room) theirs.erase(0, 1);
    first_error =
        theirs.rfind("world rank ", 0) == 0 ? theirs : "world rank " + std::to_string(group.ranks[r]) + ": " + theirs;
  }
  if (!first_error.empty()) return {nullptr, first_error, no_room};
  return {std::make_shared<SharedSegment>(std::move(memory), bytes), "", false};
}

}  // namespace hp::comm::detail

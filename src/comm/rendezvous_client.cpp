// The client of hprun's rendezvous store for jobs on several nodes (hp/core/store_wire.h): a c10d
// store that presents the job's secret when it connects. One connection, one request at a time.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

#include "comm/c10d_shim.h"
#include "hp/core/store_wire.h"

namespace hp::comm::shim {
namespace {

namespace wire = hp::store_wire;
using Clock = std::chrono::steady_clock;

constexpr auto kRetry = std::chrono::milliseconds(100);  // between attempts to reach the server
constexpr auto kPoll = std::chrono::milliseconds(10);    // a wait's look at its keys

std::string text(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }

class RendezvousClient : public c10d::Store {
 public:
  RendezvousClient(const std::string& host, int port, const std::string& secret, std::chrono::milliseconds timeout)
      : where_(host + ":" + std::to_string(port)) {
    timeout_ = timeout;
    const auto deadline = Clock::now() + timeout;
    for (;;) {  // hprun on node 0 may start after this node's ranks
      fd_ = connect_to(host, port, deadline);
      if (fd_ >= 0) break;
      if (Clock::now() > deadline)
        throw std::runtime_error("rendezvous: could not connect to " + where_ + ": timed out");
      std::this_thread::sleep_for(kRetry);
    }
    // Every request waits at most the store's timeout for its answer (a node 0 gone silent).
    timeval limit{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
    try {
      const wire::Parsed answer = request(wire::Op::kHello, {secret});
      if (answer.head != static_cast<uint8_t>(wire::Status::kOk))
        throw std::runtime_error("rendezvous: the server at " + where_ + " refused this rank's secret (" +
                                 wire::kSecretEnv + " is not the one hprun on node 0 was given)");
    } catch (...) {
      close(fd_);
      throw;
    }
  }
  ~RendezvousClient() override { close(fd_); }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    request(wire::Op::kSet, {key, text(value)});
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return bytes(request(wire::Op::kCompareSet, {key, text(expected), text(desired)}).fields.at(0));
  }
  std::vector<uint8_t> get(const std::string& key) override {
    wait({key});
    const wire::Parsed answer = request(wire::Op::kGet, {key});
    if (answer.head != static_cast<uint8_t>(wire::Status::kOk))
      throw std::runtime_error("rendezvous: key " + key + " vanished at " + where_);
    return bytes(answer.fields.at(0));
  }
  int64_t add(const std::string& key, int64_t value) override {
    return std::stoll(request(wire::Op::kAdd, {key, std::to_string(value)}).fields.at(0));
  }
  bool deleteKey(const std::string& key) override { return request(wire::Op::kDelete, {key}).fields.at(0) == "1"; }
  bool check(const std::vector<std::string>& keys) override {
    return request(wire::Op::kCheck, keys).fields.at(0) == "1";
  }
  int64_t getNumKeys() override { return std::stoll(request(wire::Op::kNumKeys, {}).fields.at(0)); }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const auto deadline = Clock::now() + timeout;
    while (!check(keys)) {
      if (Clock::now() > deadline) throw std::runtime_error("rendezvous: wait timeout for keys at " + where_);
      std::this_thread::sleep_for(kPoll);
    }
  }

 private:
  static std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

  // A connected socket, or -1; a connection that does not complete gives up at `deadline`.
  static int connect_to(const std::string& host, int port, Clock::time_point deadline) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return -1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    bool connected = fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0;
    if (fd >= 0 && !connected && errno == EINPROGRESS) {
      pollfd writable{fd, POLLOUT, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      int error = 0;
      socklen_t size = sizeof(error);
      connected = poll(&writable, 1, static_cast<int>(std::max<int64_t>(1, left))) == 1 &&
                  getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size) == 0 && error == 0;
    }
    freeaddrinfo(found);
    if (!connected) {
      if (fd >= 0) close(fd);
      return -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    const int on = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
    return fd;
  }

  wire::Parsed request(wire::Op op, const std::vector<std::string>& fields) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string out = wire::message(static_cast<uint8_t>(op), fields);
    std::optional<std::string> in;
    if (wire::write_all(fd_, out.data(), out.size())) in = wire::read_message(fd_);
    std::optional<wire::Parsed> answer = in ? wire::parse(*in) : std::nullopt;
    if (!answer)
      throw std::runtime_error("rendezvous: lost the connection to the store at " + where_ +
                               (errno == EAGAIN || errno == EWOULDBLOCK ? " (timed out waiting for it)" : ""));
    if (answer->head == static_cast<uint8_t>(wire::Status::kBad))
      throw std::runtime_error("rendezvous: the store at " + where_ + " did not understand a request");
    return *answer;
  }

  std::string where_;
  int fd_ = -1;
  std::mutex mu_;
};

}  // namespace

StorePtr make_rendezvous_client(const std::string& host, int port, const std::string& secret,
                                std::chrono::milliseconds timeout) {
  return c10::make_intrusive<RendezvousClient>(host, port, secret, timeout);
}

}  // namespace hp::comm::shim

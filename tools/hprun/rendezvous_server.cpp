#include "hprun/rendezvous_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "hp/core/store_wire.h"

namespace hp::hprun {
namespace {

namespace wire = hp::store_wire;

constexpr uint32_t kMaxHello = 4096;                  // bytes a client may send before the secret
constexpr auto kHelloWait = std::chrono::seconds(5);  // to present it
constexpr int kMaxStrangers = 64;                     // connections that have not presented it yet

std::string reply(wire::Status status, const std::vector<std::string>& fields = {}) {
  return wire::message(static_cast<uint8_t>(status), fields);
}

// A value as c10d's stores keep a counter: its decimal text.
int64_t number_of(const std::string& value) { return value.empty() ? 0 : std::stoll(value); }

}  // namespace

RendezvousServer::RendezvousServer(const std::string& address, int port, std::string secret)
    : secret_(std::move(secret)) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int error = getaddrinfo(address.c_str(), std::to_string(port).c_str(), &hints, &found); error != 0)
    throw std::runtime_error("the master address " + address + " does not resolve: " + gai_strerror(error));
  listener_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int on = 1;
  setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  const bool bound =
      listener_ >= 0 && bind(listener_, found->ai_addr, found->ai_addrlen) == 0 && listen(listener_, 128) == 0;
  const int error = errno;
  const auto* bound_to = reinterpret_cast<const sockaddr_in*>(found->ai_addr);
  const bool loopback = (ntohl(bound_to->sin_addr.s_addr) >> 24) == 127;
  freeaddrinfo(found);
  if (bound && loopback)
    std::fprintf(stderr,
                 "hprun: note: the master address %s is a loopback address here: ranks on other hosts cannot reach "
                 "the rendezvous (give node 0's address on the network the nodes share when the nodes are hosts)\n",
                 address.c_str());
  if (!bound) {
    if (listener_ >= 0) close(listener_);
    throw std::runtime_error("cannot serve the rendezvous at " + address + ":" + std::to_string(port) + ": " +
                             std::strerror(error));
  }
  if (pipe2(stop_pipe_, O_CLOEXEC) != 0) {
    close(listener_);
    throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  }
  thread_ = std::thread([this] { serve(); });
}

RendezvousServer::~RendezvousServer() {
  const char stop = 's';
  if (write(stop_pipe_[1], &stop, 1) < 0) std::perror("hprun: stopping the rendezvous server");
  thread_.join();
  for (const Client& c : clients_) close(c.fd);
  close(listener_);
  close(stop_pipe_[0]);
  close(stop_pipe_[1]);
}

void RendezvousServer::note_refusal(const std::string& peer, const std::string& why) {
  ++refusals_;
  if (refusals_ > 10 && refusals_ % 100 != 0) return;
  std::fprintf(
      stderr, "hprun: refused a rendezvous client from %s: %s%s\n", peer.c_str(), why.c_str(),
      refusals_ > 10 ? (" (" + std::to_string(refusals_) + " refused so far; not all are logged)").c_str() : "");
}

void RendezvousServer::accept_client() {
  sockaddr_in from{};
  socklen_t length = sizeof(from);
  const int fd = accept4(listener_, reinterpret_cast<sockaddr*>(&from), &length, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) {
    if (errno == EMFILE || errno == ENFILE) listen_again_ = Clock::now() + std::chrono::seconds(1);
    return;
  }
  char ip[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &from.sin_addr, ip, sizeof(ip));
  const std::string peer = std::string(ip) + ":" + std::to_string(ntohs(from.sin_port));
  int strangers = 0;
  for (const Client& c : clients_) strangers += c.presented_secret ? 0 : 1;
  if (strangers >= kMaxStrangers) {
    note_refusal(peer, "too many connections have not presented this job's secret yet");
    close(fd);
    return;
  }
  clients_.push_back({fd, peer, false, {}, Clock::now()});
}

void RendezvousServer::serve() {
  for (;;) {
    const bool listening = Clock::now() >= listen_again_;
    std::vector<pollfd> fds{{stop_pipe_[0], POLLIN, 0}, {listening ? listener_ : -1, POLLIN, 0}};
    for (const Client& c : clients_) fds.push_back({c.fd, POLLIN, 0});
    // Wakes at least once a second to cut off strangers that say nothing.
    if (poll(fds.data(), fds.size(), 1000) < 0) {
      if (errno == EINTR) continue;
      std::perror("hprun: the rendezvous server's poll");
      return;
    }
    if (fds[0].revents) return;
    std::vector<Client> kept;
    for (size_t i = 0; i + 2 < fds.size(); ++i) {
      Client& client = clients_[i];
      bool open = true;
      try {
        if (fds[i + 2].revents & (POLLIN | POLLHUP | POLLERR)) {
          char buffer[65536];
          const ssize_t n = recv(client.fd, buffer, sizeof(buffer), 0);
          open = n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR));
          if (n > 0) client.inbox.append(buffer, static_cast<size_t>(n));
          // Every whole message in the inbox, in order.
          while (open && client.inbox.size() >= 4) {
            uint32_t size = 0;
            std::memcpy(&size, client.inbox.data(), 4);
            if (size > (client.presented_secret ? wire::kMaxMessage : kMaxHello)) {
              if (!client.presented_secret) note_refusal(client.peer, "it sent a message too large for a hello");
              open = false;
            }
            if (!open || client.inbox.size() < 4 + size) break;
            const std::string body = client.inbox.substr(4, size);
            client.inbox.erase(0, 4 + size);
            open = handle(client, body);
          }
        }
        if (open && !client.presented_secret && Clock::now() - client.accepted > kHelloWait) {
          note_refusal(client.peer, "it did not present this job's secret within 5 s");
          open = false;
        }
      } catch (const std::exception&) {  // a malformed number, memory: the client is cut off, the job goes on
        open = false;
      }
      if (open)
        kept.push_back(std::move(client));
      else
        close(client.fd);
    }
    clients_ = std::move(kept);
    if (listening && (fds[1].revents & POLLIN)) accept_client();  // after: the clients polled are the ones above
  }
}

bool RendezvousServer::handle(Client& client, const std::string& body) {
  const auto send = [&](const std::string& bytes) {
    // Replies are small, and the client waits for each: a client that stops reading is cut off.
    int flags = fcntl(client.fd, F_GETFL);
    fcntl(client.fd, F_SETFL, flags & ~O_NONBLOCK);
    timeval limit{5, 0};
    setsockopt(client.fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
    const bool sent = wire::write_all(client.fd, bytes.data(), bytes.size());
    fcntl(client.fd, F_SETFL, flags);
    return sent;
  };
  const std::optional<wire::Parsed> request = wire::parse(body);
  if (!client.presented_secret) {
    if (request && request->head == static_cast<uint8_t>(wire::Op::kHello) && request->fields.size() == 1 &&
        wire::same_secret(request->fields[0], secret_)) {
      client.presented_secret = true;
      return send(reply(wire::Status::kOk));
    }
    note_refusal(client.peer, "it did not present this job's secret");
    send(reply(wire::Status::kRefused));
    return false;
  }
  if (!request) return send(reply(wire::Status::kBad)) && false;
  const std::vector<std::string>& f = request->fields;
  const auto has = [&](size_t n) { return f.size() == n; };
  switch (static_cast<wire::Op>(request->head)) {
    case wire::Op::kSet:
      if (!has(2)) break;
      data_[f[0]] = f[1];
      return send(reply(wire::Status::kOk));
    case wire::Op::kGet: {
      if (!has(1)) break;
      const auto it = data_.find(f[0]);
      return send(it == data_.end() ? reply(wire::Status::kMissing) : reply(wire::Status::kOk, {it->second}));
    }
    case wire::Op::kAdd: {
      if (!has(2)) break;
      std::string& value = data_[f[0]];
      int64_t sum = 0;
      if (__builtin_add_overflow(number_of(value), std::stoll(f[1]), &sum)) break;  // a bad request
      value = std::to_string(sum);
      return send(reply(wire::Status::kOk, {value}));
    }
    case wire::Op::kCheck: {
      bool all = true;
      for (const std::string& key : f) all = all && data_.count(key) > 0;
      return send(reply(wire::Status::kOk, {all ? "1" : "0"}));
    }
    case wire::Op::kDelete:
      if (!has(1)) break;
      return send(reply(wire::Status::kOk, {data_.erase(f[0]) > 0 ? "1" : "0"}));
    case wire::Op::kNumKeys:
      return send(reply(wire::Status::kOk, {std::to_string(data_.size())}));
    case wire::Op::kCompareSet: {
      // c10d's semantics: set when the value is `expected` (absent counts as empty); return the value after.
      if (!has(3)) break;
      const auto it = data_.find(f[0]);
      const std::string current = it == data_.end() ? std::string() : it->second;
      if ((it == data_.end() && f[1].empty()) || (it != data_.end() && current == f[1])) {
        data_[f[0]] = f[2];
        return send(reply(wire::Status::kOk, {f[2]}));
      }
      return send(reply(wire::Status::kOk, {it == data_.end() ? f[1] : current}));
    }
    default:
      break;
  }
  return send(reply(wire::Status::kBad)) && false;
}

}  // namespace hp::hprun

// hprun's rendezvous store for a job on several nodes (docs/resilience.md#who-can-join-a-job):
// node 0's hprun serves it on the master address's interface only, for clients that present the
// job's secret first (hp/core/store_wire.h); a client that does not is refused, logged and cut off,
// and the job goes on. Until it presents the secret a client may send only a short message, must
// send it within 5 s, and may be one of at most 64 such clients. Plain POSIX C++, one thread.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace hp::hprun {

class RendezvousServer {
 public:
  // Listens on `address` (a host name or an IPv4 address: the interface it resolves to) at `port`;
  // throws std::runtime_error saying why it cannot.
  RendezvousServer(const std::string& address, int port, std::string secret);
  ~RendezvousServer();  // stops serving
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

 private:
  using Clock = std::chrono::steady_clock;
  struct Client {
    int fd = -1;
    std::string peer;  // "address:port", for the log
    bool presented_secret = false;
    std::string inbox;  // bytes of a message not yet whole
    Clock::time_point accepted;
  };
  void serve();
  // Handles one whole message from `client`; false when the client is to be cut off.
  bool handle(Client& client, const std::string& body);
  void accept_client();
  // Logs a refusal: the first 10, then every 100th (a flood of strangers must not flood the log).
  void note_refusal(const std::string& peer, const std::string& why);

  std::string secret_;
  int listener_ = -1;
  int stop_pipe_[2] = {-1, -1};
  std::vector<Client> clients_;
  std::map<std::string, std::string> data_;
  int64_t refusals_ = 0;
  Clock::time_point listen_again_;  // out of file descriptors: accepting pauses until then
  std::thread thread_;
};

}  // namespace hp::hprun

// hprun's rendezvous store for a job on several nodes (docs/resilience.md#who-can-join-a-job):
// node 0's hprun serves it on the master address's interface only, for clients that present the
// job's secret first (hp/core/store_wire.h); a client that does not is refused, logged and cut off,
// and the job goes on. Plain POSIX C++, one thread.
#pragma once

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
  struct Client {
    int fd = -1;
    std::string peer;  // "address:port", for the log
    bool presented_secret = false;
    std::string inbox;  // bytes of a message not yet whole
  };
  void serve();
  // Handles one whole message from `client`; false when the client is to be cut off.
  bool handle(Client& client, const std::string& body);
  void accept_client();

  std::string secret_;
  int listener_ = -1;
  int stop_pipe_[2] = {-1, -1};
  std::vector<Client> clients_;
  std::map<std::string, std::string> data_;
  std::thread thread_;
};

}  // namespace hp::hprun

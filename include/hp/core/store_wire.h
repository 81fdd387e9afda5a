// The wire of hprun's rendezvous store for jobs on several nodes (docs/resilience.md#who-can-join-a-job):
// hprun on node 0 serves it on the master address's interface, and a client is served only once
// it presented the job's secret. Header-only and plain POSIX C++: hprun, which does not link
// LibTorch, serves it; the library's client (comm layer) speaks it.
//
// A message is a 4-byte length (host order: the job's hosts share one architecture) and that many
// bytes; a request is an op byte and fields, a response a status byte and fields; a field is a
// 4-byte length and its bytes.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace hp::store_wire {

// Set by hprun in each rank of a job on several nodes: what its rendezvous client presents.
inline constexpr char kSecretEnv[] = "HP_RENDEZVOUS_SECRET";

enum class Op : uint8_t { kHello = 1, kSet, kGet, kAdd, kCheck, kDelete, kNumKeys, kCompareSet };
enum class Status : uint8_t { kOk = 0, kMissing = 1, kRefused = 2, kBad = 3 };

// Larger messages are refused: a store holds addresses and counters, never bulk data.
inline constexpr uint32_t kMaxMessage = 64u << 20;

inline bool write_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n, size -= static_cast<size_t>(n);
  }
  return true;
}

inline bool read_all(int fd, void* data, size_t size) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = ::recv(fd, p, size, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n, size -= static_cast<size_t>(n);
  }
  return true;
}

inline void put_field(std::string& out, const std::string& field) {
  const auto size = static_cast<uint32_t>(field.size());
  out.append(reinterpret_cast<const char*>(&size), 4);
  out += field;
}

inline std::string message(uint8_t head, const std::vector<std::string>& fields) {
  std::string body(1, static_cast<char>(head));
  for (const std::string& f : fields) put_field(body, f);
  std::string out;
  put_field(out, body);
  return out;
}

// The op or status byte and the fields of a message's body; nullopt when it is malformed.
struct Parsed {
  uint8_t head = 0;
  std::vector<std::string> fields;
};
inline std::optional<Parsed> parse(const std::string& body) {
  if (body.empty()) return std::nullopt;
  Parsed parsed{static_cast<uint8_t>(body[0]), {}};
  for (size_t at = 1; at < body.size();) {
    uint32_t size = 0;
    if (body.size() - at < 4) return std::nullopt;
    std::memcpy(&size, body.data() + at, 4);
    at += 4;
    if (body.size() - at < size) return std::nullopt;
    parsed.fields.push_back(body.substr(at, size));
    at += size;
  }
  return parsed;
}

// Reads one whole message's body (blocking); nullopt when the connection ends or it is too large.
inline std::optional<std::string> read_message(int fd) {
  uint32_t size = 0;
  if (!read_all(fd, &size, 4) || size > kMaxMessage) return std::nullopt;
  std::string body(size, '\0');
  if (!read_all(fd, body.data(), size)) return std::nullopt;
  return body;
}

// Compares in time that does not depend on where they differ.
inline bool same_secret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i % (b.empty() ? 1 : b.size())]);
  return diff == 0 && !b.empty();
}

}  // namespace hp::store_wire

// hp::Error and the HP_CHECK macro: the one way the library reports bad input or a failed peer.
//
// Messages name the function, the offending value and what would be valid
// (e.g. "init_device_mesh: mesh shape (2, 3) has 6 ranks but the world has 4").
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace hp {

// Every error the library raises on purpose derives from this.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A collective or rendezvous did not complete within its timeout (a peer died or never came).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace hp

// HP_CHECK(cond, parts...) throws hp::Error(parts...) when cond is false.
#define HP_CHECK(cond, ...)                                             \
  do {                                                                  \
    if (!(cond)) throw ::hp::Error(::hp::detail::str_cat(__VA_ARGS__)); \
  } while (0)

// HP_FAIL(parts...) throws hp::Error(parts...).
#define HP_FAIL(...) throw ::hp::Error(::hp::detail::str_cat(__VA_ARGS__))

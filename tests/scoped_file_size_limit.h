// Caps the size of the files this process may write (RLIMIT_FSIZE) for a scope, so that reserving
// file space fails as on a full disk or /dev/shm (EFBIG instead of ENOSPC). SIGXFSZ is ignored
// meanwhile, as it would otherwise end the process. A write to a log file already past the cap
// fails meanwhile, so the standard streams are cleared afterwards.
#pragma once

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <csignal>
#include <iostream>
#include <stdexcept>

namespace hp::test {

class ScopedFileSizeLimit {
 public:
  explicit ScopedFileSizeLimit(rlim_t bytes) {
    if (getrlimit(RLIMIT_FSIZE, &old_) != 0) throw std::runtime_error("getrlimit(RLIMIT_FSIZE) failed");
    old_handler_ = signal(SIGXFSZ, SIG_IGN);
    rlimit capped = old_;
    capped.rlim_cur = std::min<rlim_t>(bytes, old_.rlim_max);
    if (setrlimit(RLIMIT_FSIZE, &capped) != 0) throw std::runtime_error("setrlimit(RLIMIT_FSIZE) failed");
  }
  ~ScopedFileSizeLimit() {
    const bool restored = setrlimit(RLIMIT_FSIZE, &old_) == 0;
    signal(SIGXFSZ, old_handler_);
    std::cout.clear();
    std::cerr.clear();
    EXPECT_TRUE(restored) << "setrlimit(RLIMIT_FSIZE) could not restore the limit";
  }
  ScopedFileSizeLimit(const ScopedFileSizeLimit&) = delete;
  ScopedFileSizeLimit& operator=(const ScopedFileSizeLimit&) = delete;

 private:
  rlimit old_{};
  sighandler_t old_handler_;
};

}  // namespace hp::test

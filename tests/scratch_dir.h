// Scratch directories for tests: fresh, and removed when the test process exits, so runs leave
// nothing behind in the temp directory.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

namespace hp::test {

// "<temp>/hp_<name>_<pid>", emptied if it exists. Safe to call from several threads at once, but
// each with a name of its own: one name is one directory, emptied by every call.
inline std::string scratch_dir(const std::string& name) {
  struct Cleanup {
    std::mutex mutex;
    std::vector<std::filesystem::path> dirs;
    ~Cleanup() {
      for (const auto& d : dirs) {
        std::error_code ignored;
        std::filesystem::remove_all(d, ignored);
      }
    }
  };
  static Cleanup cleanup;
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("hp_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::lock_guard<std::mutex> lock(cleanup.mutex);
  cleanup.dirs.push_back(dir);
  return dir.string();
}

}  // namespace hp::test

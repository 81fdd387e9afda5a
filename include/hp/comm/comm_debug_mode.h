// Counting the collectives a thread issues, for tests and for debugging where communication
// happens (the C++ counterpart of torch.distributed's CommDebugMode).
//
//   hp::comm::CommDebugMode comm;
//   at::Tensor y = at::mm(x, w);            // DTensor inputs
//   EXPECT_EQ(comm.count("all_reduce"), 0);  // no reduction was split across ranks
//
// Counts every collective issued through hp::comm::ProcessGroup by this thread while the mode is
// alive, including the ones DTensor redistributions and hp::nn plans issue. Collectives over a
// group of one rank move nothing and are not counted. Modes nest; each one counts.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace hp::comm {

class CommDebugMode {
 public:
  CommDebugMode();
  ~CommDebugMode();
  CommDebugMode(const CommDebugMode&) = delete;
  CommDebugMode& operator=(const CommDebugMode&) = delete;

  // Collectives by name ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
  // "send", "recv", "barrier").
  int64_t count(const std::string& op) const;
  int64_t total() const;
  const std::map<std::string, int64_t>& counts() const { return counts_; }
  std::string str() const;  // e.g. "all_gather x2, all_reduce x1"

 private:
  friend void note_collective(const char* op);
  std::map<std::string, int64_t> counts_;
  CommDebugMode* outer_;
};

// Called by the process group for every collective it issues.
void note_collective(const char* op);

}  // namespace hp::comm

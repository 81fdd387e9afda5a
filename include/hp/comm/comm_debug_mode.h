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
#include <functional>
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
  // Bytes this rank put into collectives named `op` (the input tensors' sizes).
  int64_t bytes(const std::string& op) const;
  // Of the collectives named `op`, those whose data travelled in a low-precision WireFormat.
  int64_t on_wire(const std::string& op) const;
  int64_t total_bytes() const;
  // e.g. "all_gather x2 (4096 B), all_reduce x1 (512 B, 1 on a low-precision wire)"
  std::string str() const;

  // Also tells `listener` of each collective as it is issued: its name, the bytes this rank puts
  // in, and the size of its group (a cost model's recorder sorts them by phase).
  using Listener = std::function<void(const char* op, int64_t bytes, int group_size)>;
  void set_listener(Listener listener) { listener_ = std::move(listener); }

 private:
  struct Tally {
    int64_t count = 0, bytes = 0, on_wire = 0;
  };
  friend void note_collective(const char* op, int64_t bytes, int group_size, bool on_wire);
  std::map<std::string, Tally> tallies_;
  Listener listener_;
  CommDebugMode* outer_;
};

// Called by the process group for every collective it issues, on a group of `group_size` ranks;
// `on_wire`: its data travels in a low-precision WireFormat.
void note_collective(const char* op, int64_t bytes, int group_size, bool on_wire = false);

}  // namespace hp::comm

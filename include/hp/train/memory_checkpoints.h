// In-memory checkpoints (resilience.in_memory_checkpoint_interval, docs/resilience.md#process-level-recovery):
// what a rank keeps in its host memory across train() runs of one process: its own state at the
// last in-memory checkpoints, and its buddy's copy of the last one.
#pragma once

#include <memory>

namespace hp::train {

// Give the same object to every train() of one process (TrainOptions::memory_checkpoints). Not
// copyable; its contents are train()'s.
class MemoryCheckpoints {
 public:
  MemoryCheckpoints();
  ~MemoryCheckpoints();
  MemoryCheckpoints(const MemoryCheckpoints&) = delete;
  MemoryCheckpoints& operator=(const MemoryCheckpoints&) = delete;

  struct Contents;  // src/train/memory_checkpointing.h
  Contents& contents() { return *contents_; }

 private:
  std::unique_ptr<Contents> contents_;
};

}  // namespace hp::train

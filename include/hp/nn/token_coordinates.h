// Where the tokens of a model call sit in a training step, so that random draws over activations
// (dropout masks) depend on (seed, step, global position) and never on the parallel layout.
//
// Under data parallelism a rank's model call sees some rows of the global batch; under context
// parallelism some positions of each row; with gradient accumulation or a pipeline, one
// micro-batch's rows at a time; with sequence parallelism a DTensor holds part of those positions.
// A dropout that draws element (row, position, feature...) of the *global* batch, by its global
// index, gives every rank exactly its part of the masks one device draws for the whole batch
// (hp::nn::Dropout, hp/nn/layers.h). hp-train sets the coordinates around each step's forward and
// backward; code that splits a call's rows (micro-batches) narrows them with MicroBatchRows.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>

namespace hp::nn {

struct TokenCoordinates {
  int64_t step = 0;         // the draws' stream: each optimizer step draws fresh masks
  int64_t first_row = 0;    // the call's rows are rows [first_row, first_row + rows) of the global batch
  int64_t global_rows = 0;  // rows of the global batch
  at::Tensor positions;     // int64 [tokens] on the host: each token's position in its row; undefined: 0, 1, ...
  int64_t global_seq = 0;   // tokens per row of the global batch
  // Which run of the step this is: a step that runs again (a rerun on an anomaly) counts each
  // module's draws from the first again, so it draws the same masks.
  int64_t run = 0;
};

// The coordinates in effect on this thread, or null.
const TokenCoordinates* token_coordinates();

// Puts `coordinates` in effect on this thread for the scope (nests: the previous ones come back).
class TokenCoordinatesScope {
 public:
  explicit TokenCoordinatesScope(TokenCoordinates coordinates);
  ~TokenCoordinatesScope();
  TokenCoordinatesScope(const TokenCoordinatesScope&) = delete;
  TokenCoordinatesScope& operator=(const TokenCoordinatesScope&) = delete;

 private:
  TokenCoordinates coordinates_;
  const TokenCoordinates* outer_;
};

// For code that runs a call's rows in parts (micro-batches along dim 0): while alive, the model
// calls see rows [offset, offset + rows) of the enclosing call. Does nothing where no coordinates
// are in effect.
class MicroBatchRows {
 public:
  explicit MicroBatchRows(int64_t offset);
  MicroBatchRows(const MicroBatchRows&) = delete;
  MicroBatchRows& operator=(const MicroBatchRows&) = delete;

 private:
  std::optional<TokenCoordinatesScope> scope_;
};

// The stream of each draw of a module that draws random masks (Dropout, attention dropout). With
// coordinates, the step's stream: calls of one module at the same rows of one step (a module used
// twice in a forward) get streams step * 2^16 + call, so the step must advance from one step to
// the next. Without, 2^63 + the count of the module's calls so far (masks over the tensor as given). A recomputation
// (activation checkpointing) gets the first pass's coordinates and stream back, wherever its caller is by then.
struct Draw {
  std::optional<TokenCoordinates> where;
  uint64_t stream = 0;
};

class DrawCounter {
 public:
  Draw next();
  void reset();

 private:
  uint64_t calls_ = 0;
  int64_t step_ = -1, run_ = 0;
  std::map<int64_t, int64_t> calls_at_rows_;  // this step's calls by first row
};

}  // namespace hp::nn

// The messages of running a schedule: each stage's output goes forward and its input gradient comes
// back, between the positions hosting neighbouring stages (StagePlacement says which ranks).
//
// - Shapes: an activation's dtype and shape cross each stage boundary once, on the first step; a
//   later step with another shape is refused. With dynamic shapes they travel with every message.
//   A gradient has the shape of the activation it answers, which the sender recorded.
// - Tags: one per (direction, stage, micro-batch), so messages match in whatever order the ranks
//   post them; shape messages have ranges of their own.
// - Receives may be posted ahead, in batches (batched P2P); each is waited where its action stands.
// - Sends complete in the background and are waited at the end of the pass: the "buffered sends"
//   the validator proves deadlock-free.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/pp/schedule.h"

namespace hp::pp {

class FailureNotice;
class StagePlacement;

// A tensor's dtype and shape as a fixed-size int64 message (on the host), and an empty tensor from
// one on `device`.
at::Tensor empty_description();
at::Tensor describe(const at::Tensor& t);
at::Tensor empty_like_described(const at::Tensor& description, c10::Device device);

// An action as a map key: (kind, stage, micro-batch).
using ActionKey = std::tuple<int, int, int>;
ActionKey action_key(const Action& action);

// When each send of position `position` is surely complete, so its buffer can go: once this
// position has received a message that the send's receiver posted after receiving it. Entry k lists
// the sends complete once programs[position][k] has run; a send nothing answers is left to the end
// of the pass. `programs` are the positions' actions of one pass, `stage_rank` each stage's position.
std::vector<std::vector<Action>> sends_complete_after(const std::vector<std::vector<Action>>& programs,
                                                      const std::vector<int>& stage_rank, int position);

class StageMessages {
 public:
  // Checks that the schedule's stages and micro-batches fit the message tags.
  StageMessages(comm::ProcessGroup group, std::shared_ptr<const StagePlacement> placement, int stages,
                int micro_batches, bool dynamic_shapes);

  // A training or evaluation pass: begin, send and receive as the program says, finish. Received
  // tensors go on `device`, the batch's (the meta device in a dry run).
  void begin_pass(c10::Device device);
  // The whole output of `stage` for `micro_batch`, to the ranks of the next stage's position.
  void send_forward(int stage, int micro_batch, const at::Tensor& output);
  // The whole input gradient of `stage` for `micro_batch`, to the ranks of the previous stage's position.
  void send_backward(int stage, int micro_batch, const at::Tensor& grad_input);
  // Batched P2P: posts, as one batch, the receives of the run of communication actions starting at
  // program[begin] whose shapes are known (an activation's, once it has crossed; a gradient's, once
  // its activation was sent) and that are not posted yet.
  void post_receives(const std::vector<Action>& program, size_t begin);
  // The whole tensor a RECV_F or RECV_B action receives: waited where post_receives posted it, or
  // received now.
  at::Tensor receive(FailureNotice& notice, const Action& action);
  // Lets the buffers of `send` (a SEND_F or SEND_B action of this pass) go: its message has
  // arrived (sends_complete_after), so the wait returns at once. Sends to several ranks of a
  // position (MPMD) are left to the end of the pass: one answer proves only one arrival.
  void release(FailureNotice& notice, const Action& send);
  void finish_pass(FailureNotice& notice);  // waits for this pass's other sends
  // After a failed pass: gives up on pending sends and posted receives, whose peers may never
  // answer (the group keeps their buffers).
  void abandon();
  int batched_receives() const { return batched_receives_; }  // of the current pass

  // Inference (PipelineExecutor::forward): the shape travels with every message, and sends are
  // waited at once.
  void send_inference(FailureNotice& notice, int stage, const at::Tensor& output);
  at::Tensor receive_inference(FailureNotice& notice, int stage, c10::Device device);  // the whole input of `stage`

 private:
  struct Receive {
    int from, tag;
    at::Tensor buffer;
  };
  std::optional<Receive> known_receive(const Action& action) const;
  void send(const Action& action, int to_stage, const at::Tensor& tensor, int tag);

  comm::ProcessGroup group_;
  std::shared_ptr<const StagePlacement> placement_;
  int micro_batches_;
  bool dynamic_shapes_;
  c10::Device device_ = c10::kCPU;                  // of this pass's received tensors
  std::map<int, at::Tensor> received_description_;  // per stage: dtype and shape of its input (static shapes)
  // Per stage: the dtype and shape of the whole output sent (static shapes).
  std::map<int, std::pair<std::vector<int64_t>, at::ScalarType>> sent_shape_;
  // This pass: the dtype and shape of each (stage, micro-batch) output sent, for its gradient.
  std::map<std::pair<int, int>, std::pair<std::vector<int64_t>, at::ScalarType>> sent_;
  struct Posted {
    at::Tensor buffer;
    comm::Work work;
  };
  std::map<ActionKey, Posted> posted_;
  std::vector<std::pair<std::optional<ActionKey>, comm::Work>> sends_;  // keyed by their action when releasable
  int batched_receives_ = 0;
};

}  // namespace hp::pp

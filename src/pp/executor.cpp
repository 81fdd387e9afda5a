#include "hp/pp/executor.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>

#include "hp/core/error.h"

namespace hp::pp {
namespace {

// Message tags: one per (direction, stage, micro-batch), so messages match whatever order the
// programs post them in; shape messages have their own range.
int tag(bool backward, int stage, int micro_batch, int micro_batches) {
  return ((backward ? 1 : 0) * 4096 + stage) * (micro_batches + 1) + micro_batch + 1;
}
int shape_tag(int stage) { return (1 << 28) + stage; }
int inference_tag(int stage, bool shape) { return (1 << 29) + 2 * stage + (shape ? 1 : 0); }
constexpr int kMaxDims = 8;

}  // namespace

// What a stage keeps of one micro-batch between its forward and its backward.
struct PipelineExecutor::Slot {
  at::Tensor input;        // stage > 0: a leaf that requires grad (its .grad is the gradient to send back)
  at::Tensor output;       // the stage's output, or the micro-batch's loss on the last stage
  at::Tensor grad_output;  // received gradient of the output (not on the last stage)
  at::Tensor grad_input;   // computed gradient of the input, to send back
};

PipelineExecutor::PipelineExecutor(Schedule schedule, std::vector<PipelineStage> stages, comm::ProcessGroup group,
                                   LossFn loss)
    : schedule_(std::move(schedule)), stages_(std::move(stages)), group_(std::move(group)), loss_(std::move(loss)) {
  validate(schedule_);
  HP_CHECK(group_.size() == schedule_.ranks, "PipelineExecutor: the schedule has ", schedule_.ranks,
           " ranks but the group has ", group_.size());
  for (int s = 0; s < schedule_.stages; ++s) {
    const bool here = schedule_.stage_rank[s] == group_.rank();
    int found = 0;
    for (const auto& st : stages_) found += st.index == s;
    HP_CHECK(found == (here ? 1 : 0), "PipelineExecutor: rank ", group_.rank(), here ? " hosts" : " does not host",
             " stage ", s, " in schedule '", schedule_.name, "' but was given ", found, " module(s) for it");
  }
}

const PipelineStage& PipelineExecutor::stage(int index) const {
  for (const auto& s : stages_)
    if (s.index == index) return s;
  HP_FAIL("PipelineExecutor: no stage ", index, " on this rank");
}

namespace {

// A tensor's dtype and shape as a fixed-size int64 message, and back.
at::Tensor empty_description() { return at::empty({kMaxDims + 1}, at::kLong); }

at::Tensor describe(const at::Tensor& t) {
  HP_CHECK(t.dim() <= kMaxDims, "pipeline: activations of more than ", kMaxDims, " dims");
  at::Tensor d = at::full({kMaxDims + 1}, -1, at::kLong);
  d[0] = static_cast<int64_t>(t.scalar_type());
  for (int64_t i = 0; i < t.dim(); ++i) d[i + 1] = t.size(i);
  return d;
}

at::Tensor empty_like_described(const at::Tensor& d) {
  std::vector<int64_t> sizes;
  for (int64_t i = 1; i < d.numel() && d[i].item<int64_t>() >= 0; ++i) sizes.push_back(d[i].item<int64_t>());
  return at::empty(sizes, at::TensorOptions().dtype(static_cast<at::ScalarType>(d[0].item<int64_t>())));
}

}  // namespace

at::Tensor PipelineExecutor::forward(const at::Tensor& inputs) {
  at::NoGradGuard no_grad;
  const int me = group_.rank(), last = schedule_.stages - 1;
  at::Tensor h;
  for (int s = 0; s <= last; ++s) {
    const int here = schedule_.stage_rank[s];
    const int before = s > 0 ? schedule_.stage_rank[s - 1] : here;
    if (here != me) continue;
    if (s == 0) {
      h = inputs;
    } else if (before != me) {  // the previous stage's output arrives with its shape
      const at::Tensor d = empty_description();
      group_.recv(d, before, inference_tag(s - 1, true));
      h = empty_like_described(d);
      group_.recv(h, before, inference_tag(s - 1, false));
    }
    h = (*stage(s).module)(h);
    if (s < last && schedule_.stage_rank[s + 1] != me) {
      const at::Tensor out = h.contiguous();
      group_.send(describe(out), schedule_.stage_rank[s + 1], inference_tag(s, true));
      group_.send(out, schedule_.stage_rank[s + 1], inference_tag(s, false));
    }
  }
  // Every rank gets the last stage's output.
  const int owner = schedule_.stage_rank[last];
  at::Tensor d = owner == me ? describe(h) : empty_description();
  group_.broadcast(d, owner);
  at::Tensor out = owner == me ? h.contiguous() : empty_like_described(d);
  group_.broadcast(out, owner);
  return out;
}

int PipelineExecutor::peak_live_micro_batches(int stage) const {
  const auto it = peak_live_.find(stage);
  return it == peak_live_.end() ? 0 : it->second;
}

double PipelineExecutor::step(const at::Tensor& inputs, const at::Tensor& targets) {
  return run(inputs, targets, /*backward=*/true);
}

double PipelineExecutor::evaluate(const at::Tensor& inputs, const at::Tensor& targets) {
  at::NoGradGuard no_grad;
  return run(inputs, targets, /*backward=*/false);
}

double PipelineExecutor::run(const at::Tensor& inputs, const at::Tensor& targets, bool backward) {
  const int m = schedule_.micro_batches, last = schedule_.stages - 1;
  HP_CHECK(inputs.size(0) % m == 0 && targets.size(0) == inputs.size(0), "PipelineExecutor: a batch of ",
           inputs.size(0), " rows does not split into ", m, " micro-batches (targets: ", targets.size(0), " rows)");
  const std::vector<at::Tensor> xs = inputs.chunk(m), ys = targets.chunk(m);
  std::map<std::pair<int, int>, Slot> slots;
  std::map<int, int> live;
  peak_live_.clear();
  std::vector<comm::Work> sends;
  double loss_sum = 0.0;
  timeline_.clear();
  const auto now = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  const auto rank_of = [&](int s) { return schedule_.stage_rank[s]; };

  for (const Action& a : schedule_.programs[group_.rank()]) {
    // Forward only: the forward actions in program order (a valid schedule's forward subsequence
    // is valid: backward actions never produce what a forward waits for).
    if (!backward && a.kind != ActionKind::kForward && a.kind != ActionKind::kSendForward &&
        a.kind != ActionKind::kRecvForward)
      continue;
    const int s = a.stage, mb = a.micro_batch;
    Slot& slot = slots[{s, mb}];
    const double started = record_ ? now() : 0.0;
    try {
      switch (a.kind) {
        case ActionKind::kForward: {
          at::Tensor in = s == 0 ? xs[mb] : slot.input;
          if (s > 0 && !in.defined()) {  // the previous stage is on this rank
            Slot& previous = slots.at({s - 1, mb});
            in = previous.output.detach().requires_grad_(backward);
            if (!backward) previous.output = at::Tensor();  // nothing keeps activations without backward
            slot.input = in;
          }
          at::Tensor out = (*stage(s).module)(in);
          if (s == last) {
            out = loss_(out, ys[mb]) / static_cast<double>(m);
            loss_sum += out.detach().item<double>();
          }
          slot.output = out;
          peak_live_[s] = std::max(peak_live_[s], ++live[s]);
          break;
        }
        case ActionKind::kBackward:
        case ActionKind::kBackwardInput: {
          at::Tensor grad = slot.grad_output;
          if (s < last && !grad.defined()) {  // the next stage is on this rank
            Slot& next = slots.at({s + 1, mb});
            grad = next.grad_input;
            next.grad_input = at::Tensor();
          }
          HP_CHECK(s == last || grad.defined(), "no gradient for the output");
          const std::vector<at::Tensor> outputs = {slot.output}, grads = s == last ? std::vector<at::Tensor>{}
                                                                                   : std::vector<at::Tensor>{grad};
          if (a.kind == ActionKind::kBackward) {
            torch::autograd::backward(outputs, grads);
            const at::Tensor grad_input = s > 0 ? slot.input.grad() : at::Tensor();
            slot = Slot{};
            slot.grad_input = grad_input;  // kept until sent (or read by the previous stage here)
            --live[s];
          } else {
            // dx now, keeping the graph for W; stage 0 has no input gradient, its W does it all.
            if (s > 0) slot.grad_input = torch::autograd::grad(outputs, {slot.input}, grads, /*retain_graph=*/true)[0];
            slot.grad_output = grad;
          }
          break;
        }
        case ActionKind::kBackwardWeight: {
          // dw: the parameters' gradients (this walks the stage's graph once more; a split that
          // reuses dx's intermediate gradients is future work).
          std::vector<at::Tensor> params = stage(s).module->parameters();
          const std::vector<at::Tensor> grads =
              s == last ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{slot.grad_output};
          torch::autograd::backward({slot.output}, grads, /*retain_graph=*/false, /*create_graph=*/false, params);
          const at::Tensor grad_input = slot.grad_input;
          slot = Slot{};
          slot.grad_input = grad_input;
          --live[s];
          break;
        }
        case ActionKind::kSendForward: {
          const at::Tensor out = slot.output.detach().contiguous();
          const auto [sent, first] = sent_shape_.emplace(s, out.sizes().vec());
          HP_CHECK(sent->second == out.sizes().vec(), "the output shape changed from ", c10::IntArrayRef(sent->second),
                   " to ", out.sizes(), " between steps; training steps need one micro-batch shape");
          if (first)  // the shape travels once per stage boundary
            sends.push_back(group_.send_async(describe(out), rank_of(s + 1), shape_tag(s)));
          sends.push_back(group_.send_async(out, rank_of(s + 1), tag(false, s, mb, m)));
          if (!backward) slot.output = at::Tensor();  // the send holds `out` until it completes
          break;
        }
        case ActionKind::kRecvForward: {
          at::Tensor& description = received_description_[s];
          if (!description.defined()) {
            description = empty_description();
            group_.recv(description, rank_of(s - 1), shape_tag(s - 1));
          }
          const at::Tensor in = empty_like_described(description);
          group_.recv(in, rank_of(s - 1), tag(false, s - 1, mb, m));
          slot.input = in.requires_grad_(backward);
          break;
        }
        case ActionKind::kSendBackward:
          sends.push_back(group_.send_async(slot.grad_input.contiguous(), rank_of(s - 1), tag(true, s, mb, m)));
          slot.grad_input = at::Tensor();  // the send holds it until it completes
          break;
        case ActionKind::kRecvBackward: {
          const at::Tensor grad = at::empty_like(slot.output, at::MemoryFormat::Contiguous);
          group_.recv(grad, rank_of(s + 1), tag(true, s + 1, mb, m));
          slot.grad_output = grad;
          break;
        }
      }
      if (record_) timeline_.push_back({a, group_.rank(), started, now()});
      // Completed sends release what they hold now, not at the end of the step.
      sends.erase(std::remove_if(sends.begin(), sends.end(), [](const comm::Work& w) { return w.is_completed(); }),
                  sends.end());
    } catch (const std::exception& e) {
      HP_FAIL("pipeline stage ", s, " (rank ", group_.rank(), ") failed at ", a.str(), " of schedule '", schedule_.name,
              "': ", e.what());
    }
  }
  for (auto& w : sends) w.wait();
  // The mean loss lives on the last stage's rank; every rank gets it.
  at::Tensor total = at::scalar_tensor(rank_of(last) == group_.rank() ? loss_sum : 0.0, at::kDouble).reshape({1});
  group_.all_reduce(total);
  return total.item<double>();
}

}  // namespace hp::pp

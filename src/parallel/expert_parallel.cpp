#include "hp/parallel/expert_parallel.h"

#include <ATen/ATen.h>

#include "hp/comm/functional.h"
#include "hp/core/error.h"
#include "hp/core/host_sync.h"
#include "hp/core/recompute.h"
#include "parallel/layout.h"

namespace hp {
namespace {

at::Tensor index_tensor(const std::vector<int64_t>& index, const at::Device& device) {
  return at::tensor(at::ArrayRef<int64_t>(index), at::TensorOptions().dtype(at::kLong)).to(device);
}

// The expert-parallel dispatch of one MoE layer over `group` (see the header).
class AllToAllDispatcher : public nn::TokenDispatcher {
 public:
  AllToAllDispatcher(comm::ProcessGroup group, int64_t experts) : group_(std::move(group)), experts_(experts) {}

  at::Tensor run(const at::Tensor& rows, const at::Tensor& counts, const Experts& experts,
                 const nn::CapacityOverflow& overflow, const std::function<void()>& while_dispatching) override {
    const int64_t ranks = group_.size(), local = experts_ / ranks;
    HP_CHECK(counts.dim() == 1 && counts.numel() == experts_ && counts.scalar_type() == at::kLong,
             "ExpertParallel: expert counts of shape ", counts.sizes(), " for a layer of ", experts_, " experts");
    // 1. Who sends how many rows to each of my experts: from[src * local + e]. Each message also
    //    carries the sender's capacity overflow, so that every rank learns of one at once. Built on
    //    the counts' device: nothing is read on the host before the exchange. A recomputation
    //    (activation checkpointing) replays the exchange's result instead: every rank recomputes
    //    the same layers in the same order, so none is left waiting in it.
    const std::vector<int64_t> host = replayed<std::vector<int64_t>>([&] {
      const at::Tensor flags =
          at::tensor({overflow.expert, overflow.rows, overflow.capacity}, counts.options()).expand({ranks, 3});
      const at::Tensor received = group_.all_to_all(at::cat({counts.view({ranks, local}), flags}, 1).reshape({-1}));
      // The layer's one host read: this rank's counts and the ones it received, together.
      return to_host_int64s(at::cat({counts, received}));
    });
    const int64_t* mine = host.data();
    const int64_t* in = host.data() + experts_;  // [ranks, local + 3]
    for (int64_t src = 0; src < ranks; ++src) {
      const int64_t* o = in + src * (local + 3) + local;
      HP_CHECK(o[0] < 0, "MoE: rank ", group_.ranks()[src], ": ", nn::CapacityOverflow{o[0], o[1], o[2]}.str());
    }
    std::vector<int64_t> from(ranks * local), send_splits(ranks), receive_splits(ranks), local_counts(local, 0);
    for (int64_t r = 0; r < ranks; ++r)
      for (int64_t e = 0; e < local; ++e) {
        from[r * local + e] = in[r * (local + 3) + e];
        send_splits[r] += mine[r * local + e];
        receive_splits[r] += from[r * local + e];
        local_counts[e] += from[r * local + e];
      }
    // 2. The rows to the ranks holding their experts, while this thread runs `while_dispatching`.
    comm::AllToAllOptions dispatch;
    dispatch.input_split_sizes = send_splits;
    dispatch.output_split_sizes = receive_splits;
    comm::functional::PendingCollective in_flight = comm::functional::all_to_all_async(rows, group_, dispatch);
    if (while_dispatching) while_dispatching();
    const at::Tensor by_source = in_flight.wait();
    // 3. Expert order, the experts, source order again.
    const std::vector<int64_t> order = expert_major_order(from, ranks, local);
    std::vector<int64_t> inverse(order.size());
    for (size_t i = 0; i < order.size(); ++i) inverse[order[i]] = static_cast<int64_t>(i);
    const at::Tensor out = experts(by_source.index_select(0, index_tensor(order, rows.device())), local_counts);
    // 4. The outputs back to the ranks the rows came from.
    comm::AllToAllOptions combine;
    combine.input_split_sizes = receive_splits;
    combine.output_split_sizes = send_splits;
    return comm::functional::all_to_all(out.index_select(0, index_tensor(inverse, rows.device())), group_, combine);
  }

 private:
  comm::ProcessGroup group_;
  int64_t experts_;
};

}  // namespace

std::vector<int64_t> expert_major_order(const std::vector<int64_t>& counts, int64_t ranks, int64_t local_experts) {
  HP_CHECK(ranks > 0 && local_experts > 0 && static_cast<int64_t>(counts.size()) == ranks * local_experts,
           "expert_major_order: ", counts.size(), " counts for ", ranks, " ranks x ", local_experts, " experts");
  std::vector<int64_t> start(counts.size(), 0);  // where segment (src, e) begins in the received rows
  for (size_t i = 1; i < counts.size(); ++i) start[i] = start[i - 1] + counts[i - 1];
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(start.empty() ? 0 : start.back() + counts.back()));
  for (int64_t e = 0; e < local_experts; ++e)
    for (int64_t src = 0; src < ranks; ++src) {
      const int64_t segment = src * local_experts + e;
      HP_CHECK(counts[segment] >= 0, "expert_major_order: negative count ", counts[segment]);
      for (int64_t i = 0; i < counts[segment]; ++i) order.push_back(start[segment] + i);
    }
  return order;
}

void ExpertParallel::check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  const auto* moe = dynamic_cast<nn::MoE*>(&module);
  HP_CHECK(moe != nullptr, "ExpertParallel applies to hp::nn::MoE modules; '", fqn, "' is not one");
  HP_CHECK(mesh.ndim() == 1, "ExpertParallel needs a 1-D mesh of the expert-parallel ranks, got ", mesh.str());
  HP_CHECK(moe->experts->experts % mesh.size(0) == 0, "ExpertParallel: '", fqn, "' has ", moe->experts->experts,
           " experts, which do not split evenly over ", mesh.size(0), " expert-parallel ranks");
}

void ExpertParallel::apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  auto& moe = dynamic_cast<nn::MoE&>(module);
  for (const char* w : {"w1", "w2", "w3"})
    parallel::distribute_parameter(*moe.experts, w, mesh, {Shard(0)}, fqn + ".experts");
  moe.set_dispatcher(expert_parallel_dispatcher(mesh.get_group(0), moe.experts->experts));
}

std::shared_ptr<nn::TokenDispatcher> expert_parallel_dispatcher(const comm::ProcessGroup& group, int64_t experts) {
  HP_CHECK(experts > 0 && experts % group.size() == 0, "ExpertParallel: ", experts,
           " experts do not split evenly over ", group.size(), " ranks");
  return std::make_shared<AllToAllDispatcher>(group, experts);
}

}  // namespace hp

#include "hp/parallel/expert_parallel.h"

#include <ATen/ATen.h>

#include <numeric>

#include "hp/comm/functional.h"
#include "hp/core/error.h"
#include "parallel/layout.h"

namespace hp {
namespace {

int64_t sum_range(const std::vector<int64_t>& v, int64_t begin, int64_t count) {
  return std::accumulate(v.begin() + begin, v.begin() + begin + count, int64_t{0});
}

at::Tensor index_tensor(const std::vector<int64_t>& index) {
  return at::tensor(at::ArrayRef<int64_t>(index), at::TensorOptions().dtype(at::kLong));
}

// The expert-parallel dispatch of one MoE layer over `group` (see the header).
class AllToAllDispatcher : public nn::TokenDispatcher {
 public:
  AllToAllDispatcher(comm::ProcessGroup group, int64_t experts) : group_(std::move(group)), experts_(experts) {}

  at::Tensor run(const at::Tensor& rows, const std::vector<int64_t>& counts, const Experts& experts,
                 const nn::CapacityOverflow& overflow) override {
    const int64_t ranks = group_.size(), local = experts_ / ranks;
    HP_CHECK(static_cast<int64_t>(counts.size()) == experts_, "ExpertParallel: ", counts.size(),
             " expert counts for a layer of ", experts_, " experts");
    // 1. Who sends how many rows to each of my experts: from[src * local + e]. Each message also
    //    carries the sender's capacity overflow, so that every rank learns of one at once.
    std::vector<int64_t> message;
    for (int64_t r = 0; r < ranks; ++r) {
      message.insert(message.end(), counts.begin() + r * local, counts.begin() + (r + 1) * local);
      message.insert(message.end(), {overflow.expert, overflow.rows, overflow.capacity});
    }
    const at::Tensor received = group_.all_to_all(index_tensor(message)).view({ranks, local + 3});
    for (int64_t src = 0; src < ranks; ++src) {
      const int64_t* o = received[src].data_ptr<int64_t>() + local;
      HP_CHECK(o[0] < 0, "MoE: rank ", group_.ranks()[src], ": ", nn::CapacityOverflow{o[0], o[1], o[2]}.str());
    }
    const at::Tensor received_counts = received.narrow(1, 0, local).contiguous();
    const std::vector<int64_t> from(received_counts.data_ptr<int64_t>(),
                                    received_counts.data_ptr<int64_t>() + received_counts.numel());
    std::vector<int64_t> send_splits(ranks), receive_splits(ranks), local_counts(local, 0);
    for (int64_t r = 0; r < ranks; ++r) {
      send_splits[r] = sum_range(counts, r * local, local);
      receive_splits[r] = sum_range(from, r * local, local);
      for (int64_t e = 0; e < local; ++e) local_counts[e] += from[r * local + e];
    }
    // 2. The rows to the ranks holding their experts.
    comm::AllToAllOptions dispatch;
    dispatch.input_split_sizes = send_splits;
    dispatch.output_split_sizes = receive_splits;
    const at::Tensor by_source = comm::functional::all_to_all(rows, group_, dispatch);
    // 3. Expert order, the experts, source order again.
    const std::vector<int64_t> order = expert_major_order(from, ranks, local);
    std::vector<int64_t> inverse(order.size());
    for (size_t i = 0; i < order.size(); ++i) inverse[order[i]] = static_cast<int64_t>(i);
    const at::Tensor out = experts(by_source.index_select(0, index_tensor(order)), local_counts);
    // 4. The outputs back to the ranks the rows came from.
    comm::AllToAllOptions combine;
    combine.input_split_sizes = receive_splits;
    combine.output_split_sizes = send_splits;
    return comm::functional::all_to_all(out.index_select(0, index_tensor(inverse)), group_, combine);
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

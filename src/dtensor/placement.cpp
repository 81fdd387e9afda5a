#include "hp/dtensor/placement.h"

#include "hp/core/error.h"

namespace hp {

int64_t Placement::dim() const {
  HP_CHECK(is_shard(), "Placement::dim: ", str(), " is not a Shard placement");
  return dim_;
}

comm::ReduceOp Placement::reduce_op() const {
  HP_CHECK(is_partial(), "Placement::reduce_op: ", str(), " is not a Partial placement");
  return op_;
}

std::string Placement::str() const {
  switch (kind_) {
    case Kind::kShard:
      return "S(" + std::to_string(dim_) + ")";
    case Kind::kReplicate:
      return "R";
    case Kind::kPartial:
      return "P(" + comm::to_string(op_) + ")";
  }
  return "?";
}

Placements partial_as_replicate(Placements placements) {
  for (Placement& p : placements)
    if (p.is_partial()) p = Replicate();
  return placements;
}

std::string to_string(const Placements& placements) {
  std::string out = "[";
  for (size_t i = 0; i < placements.size(); ++i) out += (i ? ", " : "") + placements[i].str();
  return out + "]";
}

}  // namespace hp

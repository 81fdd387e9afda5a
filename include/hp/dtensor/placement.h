// How a tensor is laid out along one mesh dim: Shard(dim), Replicate() or Partial(op).
//
// Placements are tiny immutable values (==, std::hash, str()). A DTensor has one per mesh dim:
//   Shard(d)     the tensor dim d is split across the mesh dim with torch.chunk semantics
//                (ceil-sized pieces; the last ones may be smaller or empty)
//   Replicate()  every rank of the mesh dim holds the same values
//   Partial(op)  every rank holds a partial value; the tensor is op() over the mesh dim
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/comm/types.h"

namespace hp {

class Placement {
 public:
  enum class Kind : uint8_t { kShard, kReplicate, kPartial };

  static Placement shard(int64_t dim) { return Placement(Kind::kShard, dim, comm::ReduceOp::kSum); }
  static Placement replicate() { return Placement(Kind::kReplicate, 0, comm::ReduceOp::kSum); }
  static Placement partial(comm::ReduceOp op = comm::ReduceOp::kSum) { return Placement(Kind::kPartial, 0, op); }

  Kind kind() const { return kind_; }
  bool is_shard() const { return kind_ == Kind::kShard; }
  bool is_shard(int64_t dim) const { return kind_ == Kind::kShard && dim_ == dim; }
  bool is_replicate() const { return kind_ == Kind::kReplicate; }
  bool is_partial() const { return kind_ == Kind::kPartial; }
  int64_t dim() const;               // Shard only
  comm::ReduceOp reduce_op() const;  // Partial only

  std::string str() const;  // "S(0)", "R", "P(sum)"
  bool operator==(const Placement& o) const { return kind_ == o.kind_ && dim_ == o.dim_ && op_ == o.op_; }
  bool operator!=(const Placement& o) const { return !(*this == o); }
  size_t hash() const {
    return (static_cast<size_t>(kind_) << 16) ^ (static_cast<size_t>(dim_) << 4) ^ static_cast<size_t>(op_);
  }

 private:
  Placement(Kind kind, int64_t dim, comm::ReduceOp op) : kind_(kind), dim_(dim), op_(op) {}
  Kind kind_;
  int64_t dim_;
  comm::ReduceOp op_;
};

// PyTorch's spelling: hp::Shard(0), hp::Replicate(), hp::Partial().
inline Placement Shard(int64_t dim) { return Placement::shard(dim); }
inline Placement Replicate() { return Placement::replicate(); }
inline Placement Partial(comm::ReduceOp op = comm::ReduceOp::kSum) { return Placement::partial(op); }

using Placements = std::vector<Placement>;
std::string to_string(const Placements& placements);  // "[S(0), R]"

// The placements with every Partial replaced by Replicate: a gradient's placements for an input
// placed `placements` (a partial value's gradient is the same on every rank), and the placements
// of a fresh tensor made "like" a Partial one.
Placements partial_as_replicate(Placements placements);

}  // namespace hp

template <>
struct std::hash<hp::Placement> {
  size_t operator()(const hp::Placement& p) const { return p.hash(); }
};

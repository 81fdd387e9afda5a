// Factory-likes (ones_like, zeros_like, empty_like, full_like) and reading a scalar (item()).
//
// A tensor made "like" a DTensor has its shards; made like a Partial tensor it is Replicate (ones
// on every rank are ones, not n).
#include "dtensor/rules/rules.h"

namespace hp::rules {

void register_like_rules(const Register& add) {
  for (const char* op : {"aten::ones_like", "aten::zeros_like", "aten::empty_like", "aten::full_like"}) {
    add(op, [](const OpCall& c) {
      OpSharding s;
      s.inputs = {c.inputs[0].placements()};
      Placements out = c.inputs[0].placements();
      for (Placement& p : out)
        if (p.is_partial()) p = Replicate();
      s.outputs = {out};
      return s;
    });
  }
  // item(): every rank reads the whole (one-element) value.
  add("aten::_local_scalar_dense", [](const OpCall& c) { return all_replicated(c, 0); });
}

}  // namespace hp::rules

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
      s.outputs = {partial_as_replicate(c.inputs[0].placements())};
      return s;
    });
  }
  // new_empty_strided(self, size, stride, ...): autograd's buffers. Shaped like self, it takes
  // self's shards (and this rank's local size and strides); otherwise it is replicated.
  add("aten::new_empty_strided", [](const OpCall& c) {
    OpSharding s;
    const bool like_self = c.output_shape(0) == c.inputs[0].shape();
    s.inputs = {c.inputs[0].placements()};
    s.outputs = {like_self ? partial_as_replicate(c.inputs[0].placements()) : replicated(c.mesh_ndim())};
    s.local_shape_arg = 1;
    s.local_stride_arg = 2;
    return s;
  });
  // new_zeros / new_ones / new_full(self, size, ...): a tensor of any shape, replicated (each rank
  // makes its full-size local copy).
  for (const char* op : {"aten::new_zeros", "aten::new_ones", "aten::new_full", "aten::new_empty"}) {
    add(op, [](const OpCall& c) {
      OpSharding s = all_replicated(c, 1);
      s.inputs = {c.inputs[0].placements()};  // self only gives dtype and device: never moved
      s.local_shape_arg = 1;
      return s;
    });
  }
  // item(): every rank reads the whole (one-element) value.
  add("aten::_local_scalar_dense", [](const OpCall& c) { return all_replicated(c, 0); });
}

}  // namespace hp::rules

// Matrix products: mm, addmm, bmm.
//
// Each op has a short list of strategies per mesh dim (input placements -> output placement), e.g.
// for mm(A [m, k], B [k, n]): (S(0), R) -> S(0), (R, S(1)) -> S(1), (S(1), S(0)) -> P(sum),
// (P, R) -> P, (R, P) -> P, (R, R) -> R. The rule keeps the current placements when they form a
// strategy and otherwise picks the strategy whose redistribution moves the fewest bytes.
#include <limits>

#include "dtensor/rules/rules.h"

namespace hp::rules {
namespace {

struct Strategy {
  Placements inputs;  // one per DTensor input on this mesh dim
  Placement output;
};

// Bytes moved (in units of the input's elements) to turn `from` into `to` on one mesh dim.
double transition_cost(const Placement& from, const Placement& to, double numel) {
  if (from == to || (from.is_replicate() && (to.is_shard() || to.is_partial()))) return 0;
  if (from.is_partial() && to.is_replicate()) return 2 * numel;
  return numel;  // all_gather, reduce_scatter, all_to_all
}

OpSharding choose(const OpCall& call, const std::vector<Strategy>& strategies) {
  OpSharding s;
  s.inputs.assign(call.inputs.size(), Placements(call.mesh_ndim(), Replicate()));
  s.outputs = {Placements(call.mesh_ndim(), Replicate())};
  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    double best = std::numeric_limits<double>::infinity();
    for (const Strategy& st : strategies) {
      double cost = 0;
      for (size_t k = 0; k < call.inputs.size(); ++k) {
        double numel = 1;
        for (int64_t d : call.inputs[k].shape()) numel *= static_cast<double>(d);
        cost += transition_cost(call.inputs[k].placements()[i], st.inputs[k], numel);
      }
      if (cost < best) {  // the first strategy wins ties: lists go from most to least preferred
        best = cost;
        for (size_t k = 0; k < call.inputs.size(); ++k) s.inputs[k][i] = st.inputs[k];
        s.outputs[0][i] = st.output;
      }
    }
  }
  return s;
}

const Placement R = Replicate();
const Placement P = Partial();

}  // namespace

void register_matmul_rules(const Register& add) {
  add("aten::mm", [](const OpCall& c) {
    return choose(c, {{{Shard(0), R}, Shard(0)},
                      {{R, Shard(1)}, Shard(1)},
                      {{Shard(1), Shard(0)}, P},
                      {{P, R}, P},
                      {{R, P}, P},
                      {{R, R}, R}});
  });
  // addmm(bias, A, B): the bias follows the output (a 1-D bias spans output dim 1).
  add("aten::addmm", [](const OpCall& c) {
    const bool row_bias = c.inputs[0].ndim() == 1;
    const Placement bias_cols = row_bias ? Shard(0) : Shard(1);
    const Placement bias_rows = row_bias ? R : Shard(0);
    return choose(c, {{{bias_rows, Shard(0), R}, Shard(0)},
                      {{bias_cols, R, Shard(1)}, Shard(1)},
                      {{P, Shard(1), Shard(0)}, P},
                      {{P, P, R}, P},
                      {{P, R, P}, P},
                      {{R, R, R}, R}});
  });
  // baddbmm(self [b, m, n], b1 [b, m, k], b2 [b, k, n]): self follows the output.
  add("aten::baddbmm", [](const OpCall& c) {
    return choose(c, {{{Shard(0), Shard(0), Shard(0)}, Shard(0)},
                      {{Shard(1), Shard(1), R}, Shard(1)},
                      {{Shard(2), R, Shard(2)}, Shard(2)},
                      {{P, Shard(2), Shard(1)}, P},
                      {{R, R, R}, R}});
  });
  add("aten::bmm", [](const OpCall& c) {
    return choose(c, {{{Shard(0), Shard(0)}, Shard(0)},
                      {{Shard(1), R}, Shard(1)},
                      {{R, Shard(2)}, Shard(2)},
                      {{Shard(2), Shard(1)}, P},
                      {{P, R}, P},
                      {{R, P}, P},
                      {{R, R}, R}});
  });
}

}  // namespace hp::rules

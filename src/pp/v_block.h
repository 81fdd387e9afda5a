// The paper's own V-Half / V-Min orders (src/pp/v_block.cpp), which v_half and v_min take as one
// candidate; here for the tests that hold them to the public generator's makespans.
#pragma once

#include "hp/pp/schedule.h"

namespace hp::pp {

// The order the paper's V-Half (`half`) or V-Min generator gives on `ranks` ranks: independent of
// costs (its moves are made in unit time).
Schedule paper_v_order(bool half, int ranks, int micro_batches);

}  // namespace hp::pp

// The optimizer kinds the registry starts with; each lives beside its optimizer's step.
#pragma once

#include <memory>

#include "hp/optim/optimizer_kind.h"

namespace hp::detail {

std::shared_ptr<const OptimizerKind> adamw_kind();  // adamw.cpp
std::shared_ptr<const OptimizerKind> adam_kind();   // adamw.cpp
std::shared_ptr<const OptimizerKind> muon_kind();   // muon.cpp

}  // namespace hp::detail

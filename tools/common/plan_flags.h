// The values of the planning flags hp-train --dry-run and hp-plan share (--memory-limit,
// --allocator-slack, --routing), checked alike: a bad value throws UsageError naming the flag.
#pragma once

#include <hp/core/error.h>
#include <hp/train/routing_model.h>

#include <cmath>
#include <string>

#include "common/flags.h"

namespace hp::tools {

// --memory-limit GIB: a positive number of GiB.
inline double memory_limit_gib(const std::string& v) {
  const double gib = parse_double("--memory-limit", v);
  if (!(gib > 0.0) || !std::isfinite(gib))
    throw UsageError("--memory-limit expects a positive number of GiB, got '" + v + "'");
  return gib;
}

// --allocator-slack FRACTION: a fraction >= 0.
inline double allocator_slack(const std::string& v) {
  const double slack = parse_double("--allocator-slack", v);
  if (!(slack >= 0.0) || !std::isfinite(slack))
    throw UsageError("--allocator-slack expects a fraction >= 0, got '" + v + "'");
  return slack;
}

// --routing SPEC: a spec RoutingModel::parse takes (a mistake is the command line's, found before
// any rank waits).
inline std::string routing_spec(const std::string& v) {
  try {
    train::RoutingModel::parse(v);
  } catch (const Error& e) {
    throw UsageError(std::string("--routing: ") + e.what());
  }
  return v;
}

}  // namespace hp::tools

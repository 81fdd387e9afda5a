// HyperParallel C++: the umbrella header.
#pragma once

#include "hp/comm/functional.h"
#include "hp/comm/init.h"
#include "hp/comm/process_group.h"
#include "hp/comm/tree_reduce.h"
#include "hp/comm/types.h"
#include "hp/core/chunking.h"
#include "hp/core/error.h"
#include "hp/core/log.h"
#include "hp/dtensor/custom.h"
#include "hp/dtensor/dtensor.h"
#include "hp/dtensor/placement.h"
#include "hp/dtensor/random.h"
#include "hp/dtensor/redistribute.h"
#include "hp/dtensor/sharding_rule.h"
#include "hp/dtensor/spec.h"
#include "hp/mesh/device_mesh.h"

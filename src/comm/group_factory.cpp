// Creating groups: the world group from a store, and cached sub-groups per rank set; which
// transport each group uses.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <sstream>
#include <utility>

#include "comm/group_impl.h"
#include "comm/shm_channel.h"
#include "comm/world.h"
#include "hp/core/error.h"
#include "hp/core/log.h"

namespace hp::comm {

std::string to_string(Transport transport) {
  switch (transport) {
    case Transport::kAuto:
      return "auto";
    case Transport::kGloo:
      return "gloo";
    case Transport::kShm:
      return "shm";
  }
  return "?";
}

namespace detail {
namespace {

constexpr char kTransportEnv[] = "HP_COMM_TRANSPORT";

// The option, or HP_COMM_TRANSPORT when the option is kAuto.
Transport transport_of_world(Transport option) {
  const char* raw = std::getenv(kTransportEnv);
  Transport chosen = option;
  if (option == Transport::kAuto && raw != nullptr && *raw != '\0') {
    bool known = false;
    for (Transport t : {Transport::kAuto, Transport::kGloo, Transport::kShm}) {
      if (to_string(t) != raw) continue;
      chosen = t;
      known = true;
    }
    HP_CHECK(known, kTransportEnv, "='", raw, "' is not a transport; use auto, gloo or shm");
  }
  return chosen;
}

// Sets up the group's shared memory (collective over its members, who all see the same outcome, so
// the group is on one transport on every member). A member that never arrives throws.
void set_up_shared_memory(GroupImpl& group, Transport transport) {
  std::string why;
  group.shm = ShmChannel::open(group, *group.shm_scope, &why);
  if (group.shm) return;
  if (transport == Transport::kShm) {
    group.shm_failure = why;  // its collectives fail, saying why
    return;
  }
  group.shm_scope.reset();
  if (group.rank == 0)
    hp::log::warn(group.describe(), " cannot use shared memory (", why, "); its collectives go through Gloo");
}

// What each rank decided from its own environment and launch (HP_COMM_TRANSPORT, the launcher's
// local world size). Ranks that decided differently would wait in the shared-memory set-up for
// members that never come, until the timeout; the world's first collective compares them instead.
// They must agree on the transport and, unless it is gloo (which shares no memory), on which ranks
// share each host: each rank's block of ranks per host must be the block of every rank in it (hosts
// may hold different numbers of ranks). Returns the same text on every rank, or "" when they agree.
std::string disagreement_on_layout(GroupImpl& world, const GroupRegistry& registry) {
  const at::Tensor mine = at::tensor(
      {static_cast<int64_t>(registry.transport), int64_t{registry.ranks_per_host}, int64_t{registry.one_process}},
      at::kLong);
  std::vector<at::Tensor> all;
  for (int r = 0; r < world.size(); ++r) all.push_back(at::empty_like(mine));
  shim::all_gather(*world.native, all, mine)->wait();
  const int n = world.size();
  const auto transport = [&](int r) { return static_cast<Transport>(all[r].data_ptr<int64_t>()[0]); };
  const auto per_host = [&](int r) { return all[r].data_ptr<int64_t>()[1]; };
  const auto threads = [&](int r) { return all[r].data_ptr<int64_t>()[2] != 0; };
  // The world ranks rank r counts as its host's, as [first, last].
  const auto host_of = [&](int r) {
    if (threads(r) || per_host(r) == 0) return std::pair<int64_t, int64_t>{0, n - 1};
    const int64_t first = r / per_host(r) * per_host(r);
    return std::pair<int64_t, int64_t>{first, std::min<int64_t>(first + per_host(r), n) - 1};
  };
  const auto describe = [&](int r) {
    const auto [first, last] = host_of(r);
    return "world rank " + std::to_string(r) + ": transport " + to_string(transport(r)) +
           (transport(r) == Transport::kGloo ? std::string()
                                             : ", host of ranks [" + std::to_string(first) + ".." +
                                                   std::to_string(last) + "]" + (threads(r) ? " (threads)" : ""));
  };
  for (int r = 1; r < n; ++r)
    if (transport(r) != transport(0))
      return "the ranks disagree on the transport (set HP_COMM_TRANSPORT alike for every rank): " + describe(0) + "; " +
             describe(r);
  if (transport(0) == Transport::kGloo) return "";
  for (int r = 0; r < n; ++r)
    for (int64_t m = host_of(r).first; m <= host_of(r).second; ++m)
      if (host_of(static_cast<int>(m)) != host_of(r) || threads(static_cast<int>(m)) != threads(r))
        return "the ranks disagree on which ranks share a host (launch every rank with its host's local world "
               "size, or set HP_COMM_TRANSPORT=gloo): " +
               describe(r) + "; " + describe(static_cast<int>(m));
  return "";
}

std::string join(const std::vector<int>& ranks) {
  std::ostringstream out;
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? "," : "") << ranks[i];
  return out.str();
}

}  // namespace

std::optional<SegmentScope> shared_scope(const GroupRegistry& registry, const std::vector<int>& ranks) {
  if (registry.one_process) return SegmentScope::kProcess;
  const int per_host = registry.ranks_per_host;
  if (per_host == 0) return SegmentScope::kHost;
  for (int r : ranks)
    if (r / per_host != registry.world_rank / per_host) return std::nullopt;
  return SegmentScope::kHost;
}

std::shared_ptr<GroupImpl> create_group(std::shared_ptr<GroupRegistry> registry, std::vector<int> ranks,
                                        std::string name, bool is_world) {
  auto group = std::make_shared<GroupImpl>();
  group->rank = static_cast<int>(std::find(ranks.begin(), ranks.end(), registry->world_rank) - ranks.begin());
  group->ranks = std::move(ranks);
  group->name = name.empty() ? "ranks[" + join(group->ranks) + "]" : std::move(name);
  group->options = registry->options;
  group->registry = registry;
  // Each rank set gets its own key space, so groups never read each other's rendezvous keys.
  group->store = shim::make_prefix_store("hp/pg/" + join(group->ranks), registry->root_store);
  if (registry->fake) {
    group->fake = true;
    group->exchange = registry->exchange;
    return group;
  }
  if (registry->transport != Transport::kGloo && group->size() > 1)
    group->shm_scope = shared_scope(*registry, group->ranks);
  std::string disagreement;
  try {
    group->native = shim::make_gloo_group(shim::make_prefix_store("gloo", group->store), group->rank, group->size(),
                                          registry->options.timeout, registry->device);
    if (is_world && group->size() > 1) disagreement = disagreement_on_layout(*group, *registry);
    if (group->shm_scope && disagreement.empty()) set_up_shared_memory(*group, registry->transport);
  } catch (const std::exception& e) {
    const std::string what = shim::first_line(e);
    const std::string msg = "creating " + group->describe() + " on world rank " + std::to_string(registry->world_rank) +
                            " failed (members must all create it, " + "within the timeout of " +
                            std::to_string(registry->options.timeout.count()) + " ms): " + what;
    if (shim::says_timed_out(what)) throw hp::TimeoutError(msg);
    throw hp::Error(msg);
  }
  HP_CHECK(disagreement.empty(), "creating ", group->describe(), ": ", disagreement);
  return group;
}

ShmChannel& GroupImpl::shm_channel(const CollectiveSite& site) {
  HP_CHECK(shm, site.op, " on ", describe(), ": transport shm, but the members cannot share memory: ", shm_failure);
  return *shm;
}

}  // namespace detail

namespace {

std::shared_ptr<detail::GroupRegistry> new_registry(const char* what, shim::StorePtr store, int rank, int world_size,
                                                    const ProcessGroupOptions& options) {
  HP_CHECK(world_size > 0, what, ": world size must be positive, got ", world_size);
  HP_CHECK(rank >= 0 && rank < world_size, what, ": rank ", rank, " is not in [0, ", world_size, ")");
  auto registry = std::make_shared<detail::GroupRegistry>();
  registry->root_store = std::move(store);
  registry->options = options;
  registry->world_rank = rank;
  registry->world_size = world_size;
  return registry;
}

ProcessGroup world_of(const std::shared_ptr<detail::GroupRegistry>& registry) {
  std::vector<int> all(registry->world_size);
  for (int r = 0; r < registry->world_size; ++r) all[r] = r;
  auto world = detail::create_group(registry, std::move(all), "world", /*is_world=*/true);
  world->owned_registry = registry;
  registry->world = world;
  return ProcessGroup(world);
}

}  // namespace

ProcessGroup create_world_group(shim::StorePtr store, int rank, int world_size, ProcessGroupOptions options,
                                WorldLayout layout) {
  auto registry = new_registry("init_process_group", std::move(store), rank, world_size, options);
  registry->one_process = layout.one_process;
  registry->ranks_per_host = layout.ranks_per_host;
  registry->transport = detail::transport_of_world(options.transport);
  registry->device = shim::make_gloo_device(options.gloo_hostname.empty() ? "127.0.0.1" : options.gloo_hostname);
  return world_of(registry);
}

ProcessGroup fake_world(int world_size, int rank, ProcessGroupOptions options, std::shared_ptr<FakeExchange> exchange) {
  auto registry = new_registry("fake_world", shim::make_hash_store(), rank, world_size, options);
  registry->fake = true;
  registry->exchange = std::move(exchange);
  registry->transport = Transport::kGloo;  // no shared memory to set up
  return world_of(registry);
}

ProcessGroup ProcessGroup::new_group(std::vector<int> world_ranks, const std::string& name) const {
  auto registry = impl().registry.lock();
  HP_CHECK(registry, "new_group: the world group this group came from no longer exists");
  HP_CHECK(!world_ranks.empty(), "new_group: needs at least one rank");
  std::set<int> unique(world_ranks.begin(), world_ranks.end());
  HP_CHECK(unique.size() == world_ranks.size(), "new_group: ranks [", detail::join(world_ranks),
           "] contain a duplicate");
  HP_CHECK(*unique.begin() >= 0 && *unique.rbegin() < registry->world_size, "new_group: ranks [",
           detail::join(world_ranks), "] must lie in [0, ", registry->world_size, ")");
  HP_CHECK(unique.count(registry->world_rank), "new_group: world rank ", registry->world_rank, " is not in [",
           detail::join(world_ranks), "]; only members create a group");

  std::lock_guard<std::mutex> lock(registry->mu);
  if (auto world = registry->world.lock(); world && world->ranks == world_ranks) return ProcessGroup(world);
  auto& cached = registry->groups[world_ranks];
  if (!cached) cached = detail::create_group(registry, world_ranks, name, /*is_world=*/false);
  return ProcessGroup(cached);
}

}  // namespace hp::comm

// Turning a failed collective into an error a user can act on.
//
// A bare transport error ("Timed out waiting 3000ms for recv") does not say who is missing. When a
// collective fails, each failing member records "I reached collective #seq" in the group's store and
// then looks, for a short window, for the same record from the other members (reach_report.h).
// Members that never record it either died or are stuck elsewhere: those are the ranks the error
// names.
#include <algorithm>
#include <sstream>

#include "comm/group_impl.h"
#include "comm/reach_report.h"
#include "hp/comm/failure_report.h"
#include "hp/core/error.h"

namespace hp::comm::detail {
namespace {

std::string message_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    return shim::first_line(e);
  } catch (...) {
    return "unknown exception";
  }
}

std::string format_ranks(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  out << "]";
  return out.str();
}

// Returns sentences naming the world ranks that did not reach collective `site.seq`, and those
// that issued a different collective as their number `seq` (a program-order bug).
std::string describe_missing_ranks(const CollectiveSite& site, const std::vector<int>& gone) {
  GroupImpl& group = *site.group;
  const std::string prefix = "hp_reached/" + std::to_string(site.seq) + "/";
  const auto window = std::min<std::chrono::milliseconds>(kFailureReportWindow, group.options.timeout);
  std::vector<int> missing;
  std::ostringstream other_ops;
  try {
    ReachOptions options;
    options.window = window;
    options.gone = gone;
    const ReachReport report = exchange_reach(*group.store, prefix, group.rank, group.size(), site.op, options);
    for (const int r : report.missing) missing.push_back(group.ranks[r]);
    for (const auto& [r, theirs] : report.other_ops)
      other_ops << " World rank " << group.ranks[r] << " issued " << theirs
                << " as this collective instead: every member must issue collectives in the same order.";
  } catch (const std::exception& e) {
    return "Could not ask the rendezvous store which ranks arrived (" + shim::first_line(e) +
           "); if world rank 0 hosts it (a TCPStore without hprun) or node 0's hprun does (several nodes), that "
           "rank or node may be gone.";
  }
  if (!missing.empty())
    return "World ranks that never reached it (dead, or stuck elsewhere): " + format_ranks(missing) + "." +
           other_ops.str();
  if (other_ops.tellp() > 0) return other_ops.str().substr(1);
  return "Every member reached this collective (one may have come only after the others gave up), so the failure is "
         "the transport's or a member's lateness, not a missing rank.";
}

}  // namespace

std::string GroupImpl::describe() const { return "group '" + name + "' (world ranks " + format_ranks(ranks) + ")"; }

void GroupImpl::note_failure() const {
  if (const auto world = registry.lock()) world->failures.fetch_add(1, std::memory_order_acq_rel);
}

void raise_collective_failure(const CollectiveSite& site, std::exception_ptr failure, const std::vector<int>& gone) {
  site.group->note_failure();
  try {
    std::rethrow_exception(failure);
  } catch (const hp::Error&) {
    throw;  // already explained (a step of a composed collective)
  } catch (...) {
  }
  const std::string cause = message_of(failure);
  const bool timed_out = shim::says_timed_out(cause);
  const GroupImpl& group = *site.group;
  std::ostringstream msg;
  msg << site.op << " on " << group.describe() << ", rank " << group.ranks[group.rank];
  if (site.peer >= 0)
    msg << (std::string(site.op) == "send" ? ", to" : ", from") << " world rank " << group.ranks[site.peer] << " (tag "
        << site.tag << ") failed";
  else
    msg << ", collective #" << site.seq << " failed";
  if (timed_out) msg << " after the group timeout of " << group.options.timeout.count() << " ms";
  msg << ": " << cause << ".";
  // Only collectives have a sequence the other members can be matched by.
  if (site.peer < 0) msg << " " << describe_missing_ranks(site, gone);
  if (timed_out) throw hp::TimeoutError(msg.str());
  throw hp::Error(msg.str());
}

void wait_native(const CollectiveSite& site, const shim::NativeWork& work) {
  if (!work) return;  // nothing was sent (e.g. an all_gather of empty tensors)
  try {
    // No timeout here: the backend enforces the group timeout itself (Gloo's context timeout is
    // set to it), and c10d's timed wait is measurably slower on multi-MB collectives.
    if (!work->wait()) {
      throw hp::Error(std::string(site.op) + " on " + site.group->describe() + ", rank " +
                      std::to_string(site.group->ranks[site.group->rank]) + ": aborted by this process");
    }
  } catch (...) {  // an hp::Error (the abort) passes through unchanged
    raise_collective_failure(site, std::current_exception());
  }
}

at::Tensor NativeWorkState::wait() {
  if (!result) {
    wait_native(site, work);
    result = finish();
  }
  return *result;
}

void NativeWorkState::abort(const std::shared_ptr<WorkState>& self) {
  std::lock_guard<std::mutex> aborting(abort_mutex);
  if (!work || !keep_alive) return;  // nothing issued, or aborted already
  work->abort();
  const std::shared_ptr<GroupImpl> group = std::move(keep_alive);  // the group keeps us, not the reverse
  std::lock_guard<std::mutex> lock(group->abandoned_mutex);
  group->abandoned.push_back(self);
}

bool NativeWorkState::is_completed() { return result.has_value() || !work || work->isCompleted(); }

}  // namespace hp::comm::detail

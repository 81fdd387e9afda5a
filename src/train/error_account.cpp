#include "train/error_account.h"

#include <ATen/ATen.h>

#include <thread>
#include <utility>

#include "hp/comm/failure_report.h"
#include "hp/comm/leave.h"
#include "hp/comm/store.h"
#include "hp/core/error.h"

namespace hp::train::detail {
namespace {

using Clock = std::chrono::steady_clock;

// Beyond the world's timeout: a rank waiting in a Gloo collective learns of the error only when that
// collective times out, and then spends up to kFailureReportWindow naming the ranks it missed.
constexpr auto kReportMargin = std::chrono::seconds(5);
// How long a rank whose collective failed looks for a published error.
constexpr auto kOriginGrace = comm::kFailureReportWindow + std::chrono::seconds(1);
constexpr auto kPoll = std::chrono::milliseconds(20);

std::string first_line(const char* text) {
  const std::string all(text);
  return all.substr(0, all.find('\n'));
}

std::string seconds(std::chrono::milliseconds t) {
  return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(t).count()) + " s";
}

}  // namespace

ErrorAccounting::ErrorAccounting(comm::ProcessGroup world)
    : world_(std::move(world)), failures_before_(comm::collective_failures(world_)) {
  // Rank 0 numbers the runs on this world and the others take its number: an earlier run may have
  // failed on some ranks before it got this far.
  const at::Tensor run = at::zeros({1}, at::kLong);
  if (world_.rank() == 0) run.fill_(world_.store().add("hp_train/runs", 1));
  world_.broadcast(run, 0);
  prefix_ = "hp_train/error/" + std::to_string(run.item<int64_t>()) + "/";
}

// Why the reports of every rank do not agree on one whole step; reads each rank's report once.
std::string ErrorAccounting::disagreement() const {
  const comm::GroupStore store = world_.store();
  std::string torn, steps;
  std::optional<std::string> first_step;
  bool differ = false;
  for (int r = 0; r < world_.size(); ++r) {
    const std::string held = store.get(key("held/" + std::to_string(r)));
    if (held.empty()) {
      torn += (torn.empty() ? "" : ", ") + std::to_string(r);
      continue;
    }
    steps += (steps.empty() ? "" : ", ") + ("world rank " + std::to_string(r) + ": step " + held);
    if (first_step && *first_step != held) differ = true;
    if (!first_step) first_step = held;
  }
  if (!torn.empty())
    return "world ranks [" + torn +
           "] were changing their parameters and optimizer state (an optimizer step), so no step is whole on every "
           "rank";
  return differ ? "the ranks hold different steps (" + steps + ")" : "the ranks' reports do not agree";
}

std::string ErrorAccounting::missing(std::chrono::milliseconds waited) const {
  const comm::GroupStore store = world_.store();
  std::string ranks;
  for (int r = 0; r < world_.size(); ++r)
    if (!store.check(key("held/" + std::to_string(r)))) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  return "world ranks [" + ranks + "] did not report what they hold within " + seconds(waited) +
         " (dead, or stuck elsewhere)";
}

ErrorAccount ErrorAccounting::account(const std::exception& error, const std::string& where, const HeldState& held,
                                      bool save, std::chrono::milliseconds slack,
                                      const std::function<bool()>& rank_lost) const {
  const comm::GroupStore store = world_.store();
  const int n = world_.size();
  const std::string me = std::to_string(world_.rank());
  ErrorAccount account;
  account.own_error = comm::collective_failures(world_) == failures_before_;
  // Published before this rank leaves its groups: a peer whose collective fails because it left
  // finds it at once. The first rank to publish also decides what is saved.
  const bool decides = account.own_error && store.add(key("origins"), 1) == 1;
  if (decides) store.set(key("origin"), "world rank " + me + ", " + where + ": " + first_line(error.what()));
  if (!account.own_error) {
    const auto give_up = Clock::now() + kOriginGrace;
    while (store.add(key("origins"), 0) == 0 && Clock::now() < give_up && !(rank_lost && rank_lost()))
      std::this_thread::sleep_for(kPoll);
    if (store.add(key("origins"), 0) == 0) return account;  // a rank died or hangs: nobody raised
  }
  account.origin = store.get(key("origin"));
  comm::leave_groups(world_);
  if (!save) return account;

  try {
    store.set(key("held/" + me), held.step ? std::to_string(*held.step) : "");
    if (held.step) store.add(key("step/" + std::to_string(*held.step)), 1);
    int64_t reported = store.add(key("reported"), 1);
    const std::chrono::milliseconds wait = world_.options().timeout + kReportMargin + slack;
    if (decides) {
      const auto deadline = Clock::now() + wait;
      while (reported < n && Clock::now() < deadline) {
        std::this_thread::sleep_for(kPoll);
        reported = store.add(key("reported"), 0);
      }
      store.set(key("decision"), reported < n ? missing(wait)
                                 : held.step && store.add(key("step/" + std::to_string(*held.step)), 0) == n
                                     ? std::to_string(*held.step)
                                     : disagreement());
    }
    // The decider waits `wait` at most, from before this rank's report (the ranks' slowest steps are
    // about the same: they wait for each other).
    comm::StorePollOptions poll;
    poll.period = kPoll;
    poll.deadline = Clock::now() + wait + kReportMargin;
    HP_CHECK(store.wait_for({key("decision")}, poll).empty(), account.origin.substr(0, account.origin.find(',')),
             " (where the error began) did not say within ", seconds(wait + kReportMargin),
             " which step every rank holds");
    const std::string decision = store.get(key("decision"));
    if (!decision.empty() && decision.find_first_not_of("0123456789") == std::string::npos)
      account.step = std::stoll(decision);
    else
      account.why_not = decision;
  } catch (const std::exception& e) {
    account.why_not = e.what();
  }
  return account;
}

}  // namespace hp::train::detail

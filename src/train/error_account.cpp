#include "train/error_account.h"

#include <chrono>
#include <thread>
#include <vector>

#include "hp/comm/leave.h"
#include "hp/comm/store.h"
#include "hp/core/error.h"

namespace hp::train::detail {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kPrefix[] = "hp_train/error/";
// Beyond the world's timeout: a rank waiting in a Gloo collective learns of the error only when that
// collective times out, and then spends up to 2 s naming the ranks it missed.
constexpr auto kReportMargin = std::chrono::seconds(5);

std::string key(const std::string& name) { return kPrefix + name; }

std::string first_line(const char* text) {
  const std::string all(text);
  return all.substr(0, all.find('\n'));
}

// Why the reports of every rank do not agree on one whole step; reads each rank's report once.
std::string disagreement(const comm::GroupStore& store, int world_size) {
  std::string torn, steps;
  std::optional<std::string> first_step;
  bool differ = false;
  for (int r = 0; r < world_size; ++r) {
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

std::string missing(const comm::GroupStore& store, int world_size, std::chrono::milliseconds waited) {
  std::string ranks;
  for (int r = 0; r < world_size; ++r)
    if (!store.check(key("held/" + std::to_string(r)))) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  return "world ranks [" + ranks + "] did not report what they hold within " +
         std::to_string(std::chrono::duration_cast<std::chrono::seconds>(waited).count()) +
         " s (dead, or stuck elsewhere)";
}

}  // namespace

ErrorAccount account_for_error(const comm::ProcessGroup& world, const std::exception& error, const std::string& where,
                               const HeldState& held, bool save) {
  const comm::GroupStore store = world.store();
  const int n = world.size();
  const std::string me = std::to_string(world.rank());
  ErrorAccount account;
  account.own_error = !comm::collective_failed(world);
  // Published before this rank leaves its groups: a peer whose collective fails because it left
  // finds it. The first rank to publish also decides what is saved.
  const bool decides = account.own_error && store.add(key("origins"), 1) == 1;
  if (decides) store.set(key("origin"), "world rank " + me + ", " + where + ": " + first_line(error.what()));
  if (store.add(key("origins"), 0) == 0) return account;  // a rank died or hangs: nobody raised
  account.origin = store.get(key("origin"));
  comm::leave_groups(world);
  if (!save) return account;

  store.set(key("held/" + me), held.step ? std::to_string(*held.step) : "");
  if (held.step) store.add(key("step/" + std::to_string(*held.step)), 1);
  int64_t reported = store.add(key("reported"), 1);
  const auto wait = world.options().timeout + kReportMargin;
  if (decides) {
    const auto deadline = Clock::now() + wait;
    while (reported < n && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      reported = store.add(key("reported"), 0);
    }
    store.set(key("decision"), reported < n ? missing(store, n, wait)
                               : held.step && store.add(key("step/" + std::to_string(*held.step)), 0) == n
                                   ? std::to_string(*held.step)
                                   : disagreement(store, n));
  }
  // The decider waits `wait` at most, from before this rank's report.
  comm::StorePollOptions poll;
  poll.deadline = Clock::now() + wait + kReportMargin;
  HP_CHECK(store.wait_for({key("decision")}, poll).empty(), account.origin.substr(0, account.origin.find(',')),
           " (where the error began) did not say within ",
           std::chrono::duration_cast<std::chrono::seconds>(wait).count(), " s which step every rank holds");
  const std::string decision = store.get(key("decision"));
  if (!decision.empty() && decision.find_first_not_of("0123456789") == std::string::npos)
    account.step = std::stoll(decision);
  else
    account.why_not = decision;
  return account;
}

}  // namespace hp::train::detail

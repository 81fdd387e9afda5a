#include "train/lead_first.h"

#include <algorithm>
#include <exception>
#include <thread>

#include "hp/comm/store.h"
#include "hp/core/error.h"
#include "hp/train/stop.h"
#include "train/stop_internal.h"

namespace hp::train::detail {

void lead_first(const comm::ProcessGroup& world, const std::string& what, const std::function<void()>& work) {
  const comm::GroupStore store = world.store();
  // Every rank counts its arrival: the count says which call this is (a rank cannot start the next
  // before everyone left this one's barrier), so each call has its own key.
  const std::string name = "hp/train/lead_first/" + what;
  const int64_t call = (store.add(name + "/arrivals", 1) - 1) / world.size();
  const std::string done = name + "/" + std::to_string(call);
  if (world.rank() == 0) {
    try {
      work();
    } catch (const std::exception& e) {
      const std::string message = e.what();
      store.set(done, "failed: " + message.substr(0, message.find('\n')));  // without a c10::Error's backtrace
      throw;
    }
    store.set(done, "ok");
  } else {
    comm::StorePollOptions poll;
    poll.period = std::chrono::milliseconds(50);
    const auto wait = std::max<std::chrono::milliseconds>(world.options().timeout, kLeadFirstWait);
    poll.deadline = std::chrono::steady_clock::now() + wait;
    // A stop request (hprun's SIGTERM after another rank failed) ends the wait: nothing to save yet.
    poll.pause = [](std::chrono::milliseconds period) {
      std::this_thread::sleep_for(period);
      return stop_requested() != 0;
    };
    const bool missing = !store.wait_for({done}, poll).empty();
    HP_CHECK(!missing || stop_requested() == 0, "rank ", world.rank(), ": stopped on ", signal_name(stop_requested()),
             " while rank 0 was ", what);
    if (missing)
      throw TimeoutError(hp::detail::str_cat("rank ", world.rank(), ": rank 0 was still ", what, " after ",
                                             std::chrono::duration_cast<std::chrono::seconds>(wait).count(),
                                             " s (or it died)"));
    const std::string outcome = store.get(done);
    HP_CHECK(outcome == "ok", "rank 0 failed ", what, ": ", outcome.substr(outcome.find(' ') + 1));
  }
  world.barrier();  // everyone is here: the next call's arrivals count from a whole generation
}

}  // namespace hp::train::detail

// The shared-memory transport: every collective equal to Gloo's (bitwise in deterministic mode),
// chosen for groups whose members share the host, and failures that name the member instead of
// hanging or corrupting the next collective.
#include <hp/comm/process_group.h>
#include <hp/core/error.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "as_processes.h"
#include "comm/group_impl.h"
#include "comm/shm_channel.h"
#include "comm/world.h"
#include "hp/comm/leave.h"
#include "hp/core/job.h"
#include "scoped_env.h"
#include "scoped_file_size_limit.h"
#include "test_util.h"

namespace hp::test {
namespace {

using comm::collective_failures;
using comm::leave_groups;
using comm::ProcessGroup;
using comm::ReduceOp;
using comm::Transport;
using Results = std::vector<std::vector<std::pair<std::string, at::Tensor>>>;  // per rank

// One rank's share of every collective, in every dtype, at sizes from empty to several rounds of
// a slot. Inputs depend on the rank only, so two runs see the same data.
std::vector<std::pair<std::string, at::Tensor>> run_every_collective(const ProcessGroup& g) {
  const int n = g.size();
  const int r = g.rank();
  std::vector<std::pair<std::string, at::Tensor>> out;
  auto keep = [&](const std::string& what, const at::Tensor& t) { out.emplace_back(what, t.clone()); };
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kDouble, at::kLong}) {
    const std::string d = "[" + dtype_name(dtype) + "] ";
    const bool floating = at::isFloatingType(dtype);
    keep(d + "all_reduce sum", g.all_reduce(rank_data(r, {1007}, dtype)));
    keep(d + "all_reduce max", g.all_reduce(rank_data(r, {33, 3}, dtype), {ReduceOp::kMax}));
    if (floating) keep(d + "all_reduce avg", g.all_reduce(rank_data(r, {5, 7}, dtype), {ReduceOp::kAvg}));
    keep(d + "all_reduce empty", g.all_reduce(at::zeros({0}, dtype)));
    keep(d + "reduce_scatter chunks", g.reduce_scatter(rank_data(r, {3 * n + 1, 5}, dtype, 1)));
    std::vector<int64_t> uneven(n);
    int64_t width = 0;
    for (int i = 0; i < n; ++i) width += uneven[i] = i % 3;  // rank 0 gets nothing
    keep(d + "reduce_scatter dim 1 uneven",
         g.reduce_scatter(rank_data(r, {4, width}, dtype, 2), {ReduceOp::kSum, 1, uneven}));
    keep(d + "all_gather", g.all_gather(rank_data(r, {3, 4}, dtype, 3)));
    std::vector<int64_t> rows(n);
    for (int i = 0; i < n; ++i) rows[i] = i;  // rank 0 sends nothing
    keep(d + "all_gather uneven dim 1", g.all_gather(rank_data(r, {2, r}, dtype, 4), {1, rows}));
    at::Tensor into = at::empty({n * 2, 3}, dtype);
    g.all_gather_into_tensor(into, rank_data(r, {2, 3}, dtype, 5));
    keep(d + "all_gather_into_tensor", into);
    std::vector<int64_t> in_splits(n), out_splits(n);
    for (int j = 0; j < n; ++j) {
      in_splits[j] = (r + j) % 3;
      out_splits[j] = (j + r) % 3;
    }
    int64_t total = 0;
    for (int64_t s : in_splits) total += s;
    keep(d + "all_to_all uneven", g.all_to_all(rank_data(r, {total, 6}, dtype, 6), {out_splits, in_splits}));
    at::Tensor b = rank_data(r, {9, 2}, dtype, 7);
    keep(d + "broadcast", g.broadcast(b.t(), n - 1));  // not contiguous: through a copy
  }
  keep("[Bool] all_gather", g.all_gather(rank_data(r, {64}, at::kFloat, 8) > 0));
  // Several rounds of a slot: 12 MB to reduce, 6 MB per rank to gather, 5 MB per pair to exchange.
  keep("all_reduce 12 MB", g.all_reduce(rank_data(r, {3 << 20}, at::kFloat, 9)));
  keep("all_gather 6 MB per rank", g.all_gather(rank_data(r, {3 << 19}, at::kFloat, 10)));
  keep("all_to_all 5 MB per pair", g.all_to_all(rank_data(r, {n * 5, 1 << 18}, at::kFloat, 11)));
  keep("broadcast 9 MB", g.broadcast(rank_data(r, {9 << 18}, at::kFloat, 12), 0));
  // Two in flight at once, waited in the other order.
  comm::Work gathered = g.all_gather_async(rank_data(r, {100}, at::kFloat, 13));
  at::Tensor summed = rank_data(r, {100}, at::kFloat, 14);
  comm::Work reduced = g.all_reduce_async(summed);
  keep("async all_reduce", reduced.wait());
  keep("async all_gather", gathered.wait());
  g.barrier();
  return out;
}

Results run_with(Transport transport, int n) {
  testing::RunRanksOptions options;
  options.group.set_deterministic(true).set_transport(transport);
  Results results(n);
  std::mutex mu;
  testing::run_ranks(
      n,
      [&](const ProcessGroup& world) {
        auto mine = run_every_collective(world);
        const bool on_shm = world.impl().shm != nullptr;
        if (on_shm != (transport != Transport::kGloo))
          throw std::runtime_error("the world group is on the wrong transport");
        std::lock_guard<std::mutex> lock(mu);
        results[world.rank()] = std::move(mine);
      },
      options);
  return results;
}

// Every collective through shared memory equals Gloo's, bitwise, in deterministic mode.
TEST(ShmTransport, EveryCollectiveEqualsGlooBitwise) {
  for (int n : {2, 4}) {
    const Results gloo = run_with(Transport::kGloo, n);
    const Results shm = run_with(Transport::kShm, n);
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(gloo[r].size(), shm[r].size());
      for (size_t i = 0; i < gloo[r].size(); ++i)
        check_close(shm[r][i].second, gloo[r][i].second,
                    "world " + std::to_string(n) + ", rank " + std::to_string(r) + ": " + gloo[r][i].first,
                    /*bitwise=*/true);
    }
  }
}

bool uses_shm(const ProcessGroup& g) { return g.impl().shm != nullptr; }

// Shared memory is used under transports auto and shm; HP_COMM_TRANSPORT replaces auto only.
TEST(ShmTransport, ChosenByOptionOrEnvironment) {
  auto run = [](Transport transport) {
    testing::RunRanksOptions options;
    options.group.set_transport(transport);
    std::vector<int> used(2, -1);
    testing::run_ranks(
        2, [&](const ProcessGroup& world) { used[world.rank()] = uses_shm(world) ? 1 : 0; }, options);
    return used;
  };
  {
    ScopedEnv unset("HP_COMM_TRANSPORT", "");
    EXPECT_EQ(run(Transport::kAuto), std::vector<int>({1, 1}));
    EXPECT_EQ(run(Transport::kGloo), std::vector<int>({0, 0}));
    EXPECT_EQ(run(Transport::kShm), std::vector<int>({1, 1}));
  }
  {
    ScopedEnv shm("HP_COMM_TRANSPORT", "shm");
    EXPECT_EQ(run(Transport::kAuto), std::vector<int>({1, 1}));
    EXPECT_EQ(run(Transport::kGloo), std::vector<int>({0, 0}));
  }
  {
    ScopedEnv gloo("HP_COMM_TRANSPORT", "gloo");
    EXPECT_EQ(run(Transport::kAuto), std::vector<int>({0, 0}));
    EXPECT_EQ(run(Transport::kShm), std::vector<int>({1, 1}));
  }
  ScopedEnv unknown("HP_COMM_TRANSPORT", "carrier-pigeon");
  try {
    run(Transport::kAuto);
    ADD_FAILURE() << "an unknown HP_COMM_TRANSPORT was accepted";
  } catch (const hp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("HP_COMM_TRANSPORT='carrier-pigeon' is not a transport"), std::string::npos)
        << e.what();
  }
}

// Ranks launched differently (another HP_COMM_TRANSPORT, another local world size) would wait in
// the shared-memory set-up for members that never come; the world's creation says so at once, the
// same words on every rank.
TEST(ShmTransport, RanksLaunchedDifferentlyFailAtOnceSayingHow) {
  ScopedEnv unset("HP_COMM_TRANSPORT", "");
  struct Case {
    std::function<Launch(int)> launch_of;
    std::string says;
  };
  const auto with = [](Transport transport, int ranks_per_host) {
    comm::ProcessGroupOptions options;
    options.set_timeout(std::chrono::seconds(30)).set_transport(transport);
    return Launch{options, comm::WorldLayout{false, ranks_per_host}};
  };
  const std::vector<Case> cases = {
      {[&](int rank) { return with(rank == 3 ? Transport::kGloo : Transport::kShm, 4); },
       "the ranks disagree on the transport (set HP_COMM_TRANSPORT alike for every rank): world rank 0: transport "
       "shm, host of ranks [0..3]; world rank 3: transport gloo"},
      {[&](int rank) { return with(Transport::kAuto, rank < 2 ? 2 : 4); },
       "the ranks disagree on which ranks share a host (launch every rank with its host's local world size, or set "
       "HP_COMM_TRANSPORT=gloo): world rank 2: transport auto, host of ranks [0..3]; world rank 0: transport auto, "
       "host of ranks [0..1]"}};
  for (const Case& c : cases) {
    const auto start = std::chrono::steady_clock::now();
    const std::vector<std::string> errors = run_as_processes(4, c.launch_of, [](const ProcessGroup&) {});
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10)) << "it waited for a timeout";
    for (int rank = 0; rank < 4; ++rank)
      EXPECT_NE(errors[rank].find(c.says), std::string::npos) << "rank " << rank << ": " << errors[rank];
  }
  // Hosts of different sizes whose blocks line up (2 + 1 ranks: each counts its own block), and any
  // layout under gloo, which shares no memory, are fine.
  for (const auto& launch_of :
       std::vector<std::function<Launch(int)>>{[&](int rank) { return with(Transport::kAuto, rank < 2 ? 2 : 1); },
                                               [&](int rank) { return with(Transport::kGloo, rank < 2 ? 2 : 4); }}) {
    const std::vector<std::string> errors = run_as_processes(3, launch_of, [](const ProcessGroup& world) {
      if (world.all_reduce(at::ones({1})).item<float>() != 3.0f) throw std::runtime_error("wrong sum");
    });
    for (int rank = 0; rank < 3; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
  }
}

// A world that spans two "hosts" of 2 ranks, under transport shm: the world group stays on Gloo,
// each host's group maps a POSIX segment (the path between processes, here between threads), which
// is unlinked once mapped; results equal the same sum on one rank.
TEST(ShmTransport, PosixSegmentsPerHostAndGlooAcrossHosts) {
  ScopedEnv job_dir(job::kDirEnv, "/tmp/hprun-shmtest" + std::to_string(getpid()));
  const std::string prefix = job::shm_prefix();
  comm::ProcessGroupOptions options;
  options.set_timeout(std::chrono::seconds(20)).set_deterministic(true).set_transport(Transport::kShm);
  const std::vector<std::string> errors = run_as_processes(4, options, 2, [&](const ProcessGroup& world) {
    const int rank = world.rank();
    ProcessGroup host = world.new_group(rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3});
    const at::Tensor x = rank_data(rank, {3 << 20}, at::kFloat);
    const at::Tensor over_host = host.all_reduce(x.clone());
    if (!uses_shm(host)) throw std::runtime_error("the host group is not on shm");
    if (uses_shm(world)) throw std::runtime_error("the world group spanning hosts is on shm");
    // Both host groups are set up once every rank is here: nothing of theirs is linked any more.
    world.barrier();
    if (!segments_named(prefix).empty()) throw std::runtime_error("a segment is still linked in /dev/shm");
    const at::Tensor partner = rank_data(rank ^ 1, {3 << 20}, at::kFloat);
    check_close(over_host, rank % 2 == 0 ? x + partner : partner + x, "host all_reduce", /*bitwise=*/true);
    world.barrier();
  });
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}

// Two "processes" of one host (threads here, mapping a POSIX segment as processes do) that cannot
// reserve their segment: under auto the group goes through Gloo, on both members, and its
// collectives are right; under shm its collectives fail, saying why.
TEST(ShmTransport, AutoFallsBackToGlooWhenTheMembersCannotShareMemory) {
  ScopedEnv unset("HP_COMM_TRANSPORT", "");
  ScopedFileSizeLimit one_mib(1 << 20);
  for (Transport transport : {Transport::kAuto, Transport::kShm}) {
    comm::ProcessGroupOptions options;
    options.set_timeout(std::chrono::seconds(20)).set_transport(transport);
    std::vector<std::string> outcome(2);
    const std::vector<std::string> errors = run_as_processes(2, options, 2, [&](const ProcessGroup& world) {
      const at::Tensor sum = world.all_reduce(at::full({1000}, world.rank() + 1.0));
      outcome[world.rank()] =
          std::string(uses_shm(world) ? "shm" : "gloo") + (at::equal(sum, at::full({1000}, 3.0)) ? " right" : " WRONG");
    });
    for (int rank = 0; rank < 2; ++rank) {
      if (!errors[rank].empty()) outcome[rank] = errors[rank];
      if (transport == Transport::kAuto) {
        EXPECT_EQ(outcome[rank], "gloo right") << "rank " << rank;
      } else {
        EXPECT_NE(outcome[rank].find("transport shm, but the members cannot share memory: world rank 0: could not "
                                     "reserve"),
                  std::string::npos)
            << "rank " << rank << ": " << outcome[rank];
      }
    }
  }
}

// A member that leaves (its rank threw, tearing down its groups) fails its peers promptly, naming
// it, long before their timeout. A peer that arrives only after another has failed the group (held
// back until the rank before it has given up and let its group go) names the same culprit, not
// just "an earlier collective failed" nor the peer that left before it, and counts as arrived in
// its own report; the ones that gave up before it came name it among the missing.
TEST(ShmTransport, AMemberThatLeavesFailsItsPeersPromptly) {
  struct Case {
    int ranks;
    bool late;  // ranks 1, 2, ... arrive one after the other, each once the one before has given up
  };
  for (const Case c : {Case{3, false}, Case{3, true}, Case{4, true}}) {
    const int leaver = c.ranks - 1;
    SCOPED_TRACE(std::to_string(c.ranks) + " ranks" + (c.late ? ", late" : ""));
    testing::RunRanksOptions options;
    options.group.set_timeout(std::chrono::seconds(60)).set_transport(Transport::kShm);
    options.barrier_at_exit = false;
    std::vector<std::string> seen(c.ranks);
    std::vector<double> seconds(c.ranks, -1);
    std::vector<std::atomic<bool>> done(c.ranks);
    try {
      testing::run_ranks(
          c.ranks,
          [&](const ProcessGroup& world) {
            const int rank = world.rank();
            struct Done {
              std::atomic<bool>& flag;
              ~Done() { flag = true; }
            } mark_done{done[rank]};
            world.barrier();
            if (rank == leaver) throw std::runtime_error("the last rank gives up");
            if (c.late && rank > 0) {
              const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
              while (!done[rank - 1] && std::chrono::steady_clock::now() < deadline)
                std::this_thread::sleep_for(std::chrono::milliseconds(5));
              if (rank > 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));  // its group goes
            }
            const auto start = std::chrono::steady_clock::now();
            try {
              world.all_reduce(at::ones({8}));
            } catch (const hp::Error& e) {
              seen[rank] = e.what();
            }
            seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          },
          options);
    } catch (const hp::Error&) {  // the leaving rank's own error
    }
    for (int r = 0; r < leaver; ++r) {
      const std::string left = "world rank " + std::to_string(leaver) + " left the group";
      EXPECT_NE(seen[r].find(left), std::string::npos) << seen[r];
      // A rank gives up waiting for the others' reports before the later ones come.
      std::string missing;
      for (int m = c.late ? r + 1 : leaver; m <= leaver; ++m)
        missing += (missing.empty() ? "" : ", ") + std::to_string(m);
      EXPECT_NE(seen[r].find("never reached it (dead, or stuck elsewhere): [" + missing + "]"), std::string::npos)
          << seen[r];
      EXPECT_LT(seconds[r], 10.0);
    }
  }
}

// A member that comes after the others gave up waiting for it (the group's timeout passed) is
// told so, as an hp::Error of its own (it did not wait: not a TimeoutError), while the member that
// waited gets the TimeoutError naming it.
TEST(ShmTransport, AMemberThatComesTooLateIsToldItWasWaitedFor) {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::seconds(1)).set_transport(Transport::kShm);
  options.barrier_at_exit = false;
  std::vector<std::string> seen(2);
  std::array<bool, 2> timed_out{false, false};
  std::atomic<bool> rank0_done{false};
  testing::run_ranks(
      2,
      [&](const ProcessGroup& world) {
        const int rank = world.rank();
        world.barrier();
        if (rank == 1) {
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          while (!rank0_done && std::chrono::steady_clock::now() < deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        try {
          world.all_reduce(at::ones({8}));
        } catch (const hp::TimeoutError& e) {
          seen[rank] = e.what();
          timed_out[rank] = true;
        } catch (const hp::Error& e) {
          seen[rank] = e.what();
        }
        if (rank == 0) rank0_done = true;
      },
      options);
  EXPECT_TRUE(timed_out[0]) << seen[0];
  EXPECT_NE(seen[0].find("never reached it (dead, or stuck elsewhere): [1]"), std::string::npos) << seen[0];
  EXPECT_FALSE(timed_out[1]) << seen[1];
  EXPECT_NE(seen[1].find("another member gave up waiting for this rank for the group's whole wait: it was held up "
                         "elsewhere"),
            std::string::npos)
      << seen[1];
  EXPECT_EQ(seen[1].find("timeout"), std::string::npos) << seen[1];
}

// A rank that gives up on its world (leave_groups, what hp-train does after an error) fails the
// peers waiting for it in a collective at once, on the world and on a sub-group alike, long before
// the timeout; their collectives count as failed (collective_failures), its own later ones fail.
TEST(ShmTransport, ARankThatLeavesItsGroupsFailsItsWaitingPeersAtOnce) {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::seconds(60)).set_transport(Transport::kShm);
  options.barrier_at_exit = false;
  std::vector<std::string> seen(3);
  std::vector<double> seconds(3, 0.0);
  std::vector<uint64_t> failures_before(3), failures_after(3);
  std::atomic<int> done{0};
  testing::run_ranks(
      3,
      [&](const ProcessGroup& world) {
        const int rank = world.rank();
        const ProcessGroup pair = rank == 0 ? ProcessGroup() : world.new_group({1, 2});
        world.barrier();
        failures_before[rank] = collective_failures(world);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          if (rank == 2) {
            std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the peers are waiting by now
            leave_groups(world);
            world.all_reduce(at::ones({8}));
          } else if (rank == 1) {
            pair.all_reduce(at::ones({8}));
          } else {
            world.all_reduce(at::ones({8}));
          }
        } catch (const hp::Error& e) {
          seen[rank] = e.what();
        }
        seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        failures_after[rank] = collective_failures(world);
        // Rank 1 keeps its world until rank 0 failed: leaving it (its thread ending) would be
        // another departure rank 0 could see first.
        ++done;
        for (int waited = 0; rank == 1 && done < 3 && waited < 30000; ++waited)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
      },
      options);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(failures_before[r], 0u) << r;
    EXPECT_EQ(failures_after[r], 1u) << r;
  }
  for (int r : {0, 1}) {
    EXPECT_NE(seen[r].find("world rank 2 left the group (it gave up on it after an error"), std::string::npos)
        << seen[r];
    EXPECT_LT(seconds[r], 20.0) << seen[r];  // the timeout is 60 s
  }
  EXPECT_NE(seen[2].find("this rank has left the group"), std::string::npos) << seen[2];
}

// Sizes that disagree between sender and receiver fail the receiver, naming the sender, and every
// later collective on the group fails instead of reading half-written slots.
TEST(ShmTransport, SizesThatDisagreeFailInsteadOfCorrupting) {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::seconds(20)).set_transport(Transport::kShm);
  options.barrier_at_exit = false;
  std::vector<std::string> first(2), second(2);
  testing::run_ranks(
      2,
      [&](const ProcessGroup& world) {
        const int r = world.rank();
        // Rank 0 sends 2 rows to rank 1, which expects 3.
        const std::vector<int64_t> in = {1, 2}, out = r == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{3, 1};
        try {
          world.all_to_all(at::ones({r == 0 ? 3 : 2, 4}), {out, r == 0 ? in : std::vector<int64_t>{1, 1}});
        } catch (const hp::Error& e) {
          first[r] = e.what();
        }
        try {
          world.all_reduce(at::ones({4}));
        } catch (const hp::Error& e) {
          second[r] = e.what();
        }
      },
      options);
  EXPECT_NE(first[1].find("world rank 0 sends 32 bytes to this rank, which expects 48"), std::string::npos) << first[1];
  for (int r : {0, 1}) EXPECT_NE(second[r], "") << "rank " << r << "'s next collective ran";
  // The sender, whose own all_to_all went through, learns why its next one fails, whether it
  // reaches it before or after rank 1 has failed the group.
  EXPECT_NE(second[0].find("found that world rank 0 (this one) called a collective its own does not match"),
            std::string::npos)
      << second[0];
}

// Members whose programs diverged, running different collectives whose sizes agree (a
// reduce_scatter against an all_to_all moves the same bytes, one summing, one copying; a barrier
// against an all_reduce), fail both, naming the collectives, instead of mixing their bytes.
TEST(ShmTransport, DifferentCollectivesOnTheMembersFailNamingThem) {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::seconds(20)).set_transport(Transport::kShm);
  options.barrier_at_exit = false;
  struct Case {
    std::function<void(const ProcessGroup&)> rank0, rank1;
    std::string rank0_says, rank1_says;
  };
  const std::vector<Case> cases = {
      {[](const ProcessGroup& g) {
         g.reduce_scatter(at::ones({2, 4}));
       },
       [](const ProcessGroup& g) {
         g.all_to_all(at::ones({2, 4}));
       },
       "world rank 1 runs all_to_all (collective #0) while this rank runs reduce_scatter (collective #0)",
       "world rank 0 runs reduce_scatter (collective #0) while this rank runs all_to_all (collective #0)"},
      {[](const ProcessGroup& g) { g.barrier(); }, [](const ProcessGroup& g) { g.all_reduce(at::ones({4})); },
       "world rank 1 runs all_reduce (collective #0) while this rank runs barrier (collective #0)",
       "world rank 0 runs barrier (collective #0) while this rank runs all_reduce (collective #0)"}};
  for (const Case& c : cases) {
    std::vector<std::string> errors(2);
    testing::run_ranks(
        2,
        [&](const ProcessGroup& world) {
          try {
            (world.rank() == 0 ? c.rank0 : c.rank1)(world);
          } catch (const hp::Error& e) {
            errors[world.rank()] = e.what();
          }
        },
        options);
    EXPECT_NE(errors[0].find(c.rank0_says), std::string::npos) << errors[0];
    EXPECT_NE(errors[1].find(c.rank1_says), std::string::npos) << errors[1];
  }
}

}  // namespace
}  // namespace hp::test

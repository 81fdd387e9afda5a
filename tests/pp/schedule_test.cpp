// Pipeline schedules as data: builders, the validator, CSV, and the simulator's bubble against
// theory.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>

#include "hp/pp/schedule.h"
#include "pp/messages.h"
#include "test_util.h"

namespace hp::pp {
namespace {

// The most micro-batches whose forward has run on a stage and whose backward has not, at any point
// of the stage's program.
int peak_in_flight(const Schedule& s, int stage) {
  int live = 0, peak = 0;
  for (const Action& a : s.programs[s.stage_rank[stage]]) {
    if (a.stage != stage) continue;
    if (a.kind == ActionKind::kForward) peak = std::max(peak, ++live);
    if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) --live;
  }
  return peak;
}

TEST(PipelineSchedule, BuildersAreValidForEveryShape) {
  for (int p : {2, 4})
    for (int m : {p, 2 * p, 5}) {
      validate(gpipe(p, m));
      validate(one_f_one_b(p, m));
      validate(interleaved_1f1b(p, 2, m));
      validate(zero_bubble_v(p, m));
    }
}

TEST(PipelineSchedule, ZeroBubbleVScalesToManyMicroBatches) {
  validate(zero_bubble_v(2, 400));
  validate(zero_bubble_v(4, 400));
}

// A send's buffer goes once a later message proves it arrived: under 1F1B an activation goes by the
// time its gradient comes back (earlier when the receiver took later activations before answering);
// every release comes after its send; large schedules are quick to plan.
TEST(PipelineSchedule, SendsCompleteWhenAnswered) {
  const Schedule s = one_f_one_b(4, 8);
  for (int r = 0; r < s.ranks; ++r) {
    const auto complete = sends_complete_after(s.programs, s.stage_rank, r);
    const auto& program = s.programs[r];
    for (size_t k = 0; k < program.size(); ++k)
      for (const Action& sent : complete[k]) {
        const auto at = std::find(program.begin(), program.end(), sent) - program.begin();
        EXPECT_LT(static_cast<size_t>(at), k) << sent.str() << " released before it was sent";
        if (sent.kind == ActionKind::kSendForward) {  // by the time its gradient is back, at the latest
          const Action gradient{ActionKind::kRecvBackward, sent.stage, sent.micro_batch};
          EXPECT_LE(k, static_cast<size_t>(std::find(program.begin(), program.end(), gradient) - program.begin()))
              << sent.str() << " released at " << program[k].str();
        }
      }
    int forward_sends = 0, released = 0;
    for (const Action& a : program) forward_sends += a.kind == ActionKind::kSendForward;
    for (const auto& at : complete)
      for (const Action& a : at) released += a.kind == ActionKind::kSendForward;
    EXPECT_EQ(released, forward_sends) << "rank " << r;
  }
  const Schedule big = zero_bubble_v(8, 64);
  for (int r = 0; r < big.ranks; ++r)
    EXPECT_EQ(sends_complete_after(big.programs, big.stage_rank, r).size(), big.programs[r].size());
}

TEST(PipelineSchedule, OneFOneBHoldsAtMostRanksMicroBatches) {
  for (int p : {2, 4})
    for (int m : {p, 2 * p, 5, 16}) {
      const Schedule s = one_f_one_b(p, m);
      for (int stage = 0; stage < p; ++stage) EXPECT_LE(peak_in_flight(s, stage), p) << "p " << p << " m " << m;
      EXPECT_EQ(peak_in_flight(s, 0), std::min(p, m));
      EXPECT_EQ(peak_in_flight(gpipe(p, m), 0), m);
    }
}

// ZBV scheduled with the real F / I / W costs (I dearer than W, as measured on these stages) is
// valid and idles less under those costs than the unit-cost order does.
TEST(PipelineSchedule, ZbvScheduledWithCostsIdlesLessUnderThem) {
  for (const ActionCosts& costs : {ActionCosts{1.0, 2.0, 0.5}, ActionCosts{1.0, 1.5, 0.3}})
    for (int p : {2, 4})
      for (int m : {4, 8, 16}) {
        const Schedule tuned = zero_bubble_v(p, m, costs);
        validate(tuned);
        const double with_costs = simulate(tuned, costs).bubble, unit = simulate(zero_bubble_v(p, m), costs).bubble;
        EXPECT_LE(with_costs, unit + 1e-9) << "p " << p << " m " << m << " I " << costs.backward_input;
        EXPECT_LT(with_costs, simulate(one_f_one_b(p, m), costs).bubble) << "p " << p << " m " << m;
      }
}

TEST(PipelineSchedule, BubbleMatchesTheory) {
  // F = 1, B = 2 (I + W); no communication cost: 1F1B's bubble is (p - 1) / (m + p - 1).
  for (int p : {2, 4})
    for (int m : {4, 8, 16}) {
      const Simulation one = simulate(one_f_one_b(p, m));
      EXPECT_NEAR(one.bubble, (p - 1.0) / (m + p - 1.0), 1e-9) << "1F1B p " << p << " m " << m;
      EXPECT_NEAR(simulate(gpipe(p, m)).bubble, (p - 1.0) / (m + p - 1.0), 1e-9) << "GPipe p " << p << " m " << m;
      EXPECT_LT(simulate(zero_bubble_v(p, m)).bubble, one.bubble) << "ZBV p " << p << " m " << m;
      if (m % p == 0) {
        EXPECT_LT(simulate(interleaved_1f1b(p, 2, m)).bubble, one.bubble) << "interleaved p " << p;
      }
      if (p == 4 && m == 8)
        std::cout << "simulated bubble, 4 ranks, 8 micro-batches: GPipe " << simulate(gpipe(p, m)).bubble << ", 1F1B "
                  << one.bubble << ", interleaved (2 per rank) " << simulate(interleaved_1f1b(p, 2, m)).bubble
                  << ", ZBV " << simulate(zero_bubble_v(p, m)).bubble << "\n";
    }
}

TEST(PipelineSchedule, ValidatorRejectsBrokenSchedules) {
  Schedule missing = one_f_one_b(2, 2);
  auto& program = missing.programs[1];
  program.erase(std::find(program.begin(), program.end(), Action{ActionKind::kBackward, 1, 1}));
  test::expect_error([&] { validate(missing); }, {"stage 1 micro-batch 1 has 0 full backward(s)"});

  // Each rank first waits for the other: rank 0 for a gradient rank 1 sends only after its own
  // receive, which waits for an activation rank 0 sends only after its receive.
  const std::string cycle =
      "rank,actions\n"
      "0,0F0 0RECV_B0 0SEND_F0 0B0\n"
      "1,1RECV_F0 1F0 1B0 1SEND_B0\n";
  test::expect_error([&] { from_csv(cycle, "cycle"); },
                     {"deadlocks", "rank 0 waits at 0RECV_B0", "rank 1 waits at 1RECV_F0"});
  test::expect_error([&] { from_csv("rank,actions\n0,0F0 0X0\n"); }, "unknown action kind");

  // Messages where none belong: a stray send after the last stage, and a second send.
  Schedule stray = one_f_one_b(2, 2);
  stray.programs[1].push_back(Action{ActionKind::kSendForward, 1, 0});
  test::expect_error([&] { validate(stray); }, {"stage 1 micro-batch 0 has 1 1SEND_F0 (needs none"});
  Schedule twice = one_f_one_b(2, 2);
  twice.programs[0].push_back(Action{ActionKind::kSendForward, 0, 1});
  test::expect_error([&] { validate(twice); }, {"has 2 0SEND_F1 (needs exactly one"});
}

TEST(PipelineSchedule, CsvRoundTrip) {
  const Schedule s = zero_bubble_v(2, 5);
  const Schedule back = from_csv(to_csv(s));
  EXPECT_EQ(back.programs, s.programs);
  EXPECT_EQ(back.stage_rank, s.stage_rank);
  // A user schedule of compute actions only, completed with the communication.
  Schedule mine = from_csv("rank,actions\n0,0F0 0F1 0B0 0B1\n", "one rank");
  EXPECT_EQ(mine.stages, 1);
  const std::string svg = to_svg(s, simulate(s));
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("bubble"), std::string::npos);
}

}  // namespace
}  // namespace hp::pp

// all_gather_matmul and matmul_reduce_scatter (hp/comm/fused_matmul.h) against the unfused
// collective and matmul: on thread-ranks and on ranks that map POSIX segments as processes do
// (the symmetric-memory path, counted by CommDebugMode), and on Gloo (the unfused path); for
// several shapes (empty pieces included), dtypes and dims, call after call on one group's
// workspace; and their failures.
#include <hp/comm/comm_debug_mode.h>
#include <hp/comm/fused_matmul.h>
#include <hp/comm/process_group.h>
#include <hp/core/error.h>
#include <hp/core/job.h>
#include <hp/core/log.h>

#include <functional>
#include <string>
#include <vector>

#include "as_processes.h"
#include "scoped_env.h"
#include "scoped_file_size_limit.h"
#include "test_util.h"

namespace hp::test {
namespace {

using comm::ProcessGroup;

// The same values on every rank for one seed; `rank` picks a rank's own.
at::Tensor values(std::vector<int64_t> shape, at::ScalarType dtype, uint64_t seed) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed)).to(dtype);
}

// fp32 matmuls of another blocking may round differently; bf16 ones by their last bit.
double rtol_of(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 1e-2 : 1e-6; }

// One call of each op with rows `rows` per rank, checked against the unfused ops, and counted as
// the fused op (expect_fused) or as the plain collective.
void check_once(const ProcessGroup& g, int64_t rows, int64_t dim, at::ScalarType dtype, uint64_t seed,
                bool expect_fused) {
  const int n = g.size(), me = g.rank();
  const std::string what = "rows " + std::to_string(rows) + ", dim " + std::to_string(dim) + ", " +
                           c10::toString(dtype) + ", rank " + std::to_string(me);
  // a: [batch 3, rows, K 8] (or [rows, 3, 8] for dim 0), gathered or scattered along `dim`.
  const auto shape = [&](int64_t r) {
    return dim == 0 ? std::vector<int64_t>{r, 3, 8} : std::vector<int64_t>{3, r, 8};
  };
  const at::Tensor whole_a = values(shape(n * rows), dtype, seed);
  const at::Tensor shard = whole_a.narrow(dim, me * rows, rows).contiguous();
  const at::Tensor b1 = values({8, 5}, dtype, seed + 1 + me);  // each rank's own factors
  const at::Tensor b2 = values({6, 8}, dtype, seed + 2 + me).t();

  comm::CommDebugMode comm;
  const comm::AllGatherMatmul fused = comm::all_gather_matmul(g, shard, {b1, b2}, dim);
  EXPECT_EQ(comm.count("all_gather_matmul"), expect_fused ? 1 : 0) << what;
  EXPECT_EQ(comm.count("all_gather"), expect_fused ? 0 : 1) << what;
  check_close(fused.gathered, whole_a, what + ": gathered", /*bitwise=*/true);
  check_relative(fused.outputs.at(0), at::matmul(whole_a, b1), what + ": output 0", rtol_of(dtype));
  check_relative(fused.outputs.at(1), at::matmul(whole_a, b2), what + ": output 1", rtol_of(dtype));
  const comm::AllGatherMatmul no_gathered = comm::all_gather_matmul(g, shard, {b1}, dim, /*return_gathered=*/false);
  EXPECT_FALSE(no_gathered.gathered.defined()) << what;
  check_close(no_gathered.outputs.at(0), fused.outputs.at(0), what + ": without the gathered input", true);

  // reduce_scatter(a @ b): every rank's own a and b; the sum of their products, this rank's rows.
  const at::Tensor a = values(shape(n * rows), dtype, seed + 10 + me);
  const at::Tensor b = values({8, 4}, dtype, seed + 20 + me);
  const at::Tensor piece = comm::matmul_reduce_scatter(g, a, b, dim);
  EXPECT_EQ(comm.count("matmul_reduce_scatter"), expect_fused ? 1 : 0) << what;
  EXPECT_EQ(comm.count("reduce_scatter"), expect_fused ? 0 : 1) << what;
  at::Tensor sum = at::zeros_like(at::matmul(a, b), at::kDouble);
  for (int r = 0; r < n; ++r)
    sum +=
        at::matmul(values(shape(n * rows), dtype, seed + 10 + r), values({8, 4}, dtype, seed + 20 + r)).to(at::kDouble);
  check_relative(piece.to(at::kDouble), sum.narrow(dim, me * rows, rows), what + ": reduce-scattered product",
                 rtol_of(dtype) * n);
}

// Shapes, dtypes and dims call after call (the workspace grows, and its "done" signals pair up).
void check_many(const ProcessGroup& g, bool expect_fused) {
  uint64_t seed = 7;
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kDouble})
    for (const int64_t dim : {0, 1})
      for (const int64_t rows : {2, 0, 1, 12000, 5}) check_once(g, rows, dim, dtype, seed += 100, expect_fused);
}

TEST(FusedMatmul, EqualsTheUnfusedOpsOnThreadRanks) {
  for (int world : {2, 4}) run(world, [](const ProcessGroup& g) { check_many(g, /*expect_fused=*/true); });
}

TEST(FusedMatmul, EqualsTheUnfusedOpsBetweenProcessSegments) {
  ScopedEnv job_dir(job::kDirEnv, "/tmp/hprun-fusedtest" + std::to_string(getpid()));
  const std::string prefix = job::shm_prefix();
  const std::vector<std::string> errors =
      run_as_processes(4, comm::ProcessGroupOptions(), 4, [&](const ProcessGroup& g) {
        check_many(g, /*expect_fused=*/true);
        if (!segments_named(prefix).empty()) throw std::runtime_error("a segment is still linked in /dev/shm");
      });
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}

// On Gloo (as across hosts) the ops are the unfused collective and matmul.
TEST(FusedMatmul, OnGlooTheyAreTheUnfusedOps) {
  testing::RunRanksOptions options;
  options.group.set_transport(comm::Transport::kGloo);
  run(
      2, [](const ProcessGroup& g) { check_many(g, /*expect_fused=*/false); }, options);
}

// Deterministic mode: the fused reduce-scatter adds in the order of the deterministic collective, so
// where the split matmuls round as the whole one does (as here) the results are equal bit for bit.
TEST(FusedMatmul, TheFusedSumAddsInTheDeterministicReduceScattersOrder) {
  testing::RunRanksOptions options;
  options.group.set_deterministic(true);
  run(
      4,
      [](const ProcessGroup& g) {
        const at::Tensor a = values({3, 8, 16}, at::kFloat, 40 + g.rank());
        const at::Tensor b = values({16, 8}, at::kFloat, 50 + g.rank());
        const at::Tensor product = at::matmul(a.movedim(1, 0), b).contiguous();
        const at::Tensor want = g.reduce_scatter_tensor(at::empty({2, 3, 8}), product).movedim(0, 1);
        comm::CommDebugMode comm;
        check_close(comm::matmul_reduce_scatter(g, a, b, 1), want, "rank " + std::to_string(g.rank()),
                    /*bitwise=*/true);
        EXPECT_EQ(comm.count("matmul_reduce_scatter"), 1) << comm.str();
      },
      options);
}

TEST(FusedMatmul, BadOperandsAreClearErrors) {
  run(2, [](const ProcessGroup& g) {
    const at::Tensor a = at::ones({4, 6});
    expect_error([&] { comm::all_gather_matmul(g, a, {at::ones({6, 2})}, 1); }, "other than its last");
    expect_error([&] { comm::all_gather_matmul(g, at::ones({6}), {}, 0); }, "at least 2 dims");
    expect_error([&] { comm::all_gather_matmul(g, a, {at::ones({5, 2})}, 0); }, "K = a's last dim (6)");
    expect_error([&] { comm::matmul_reduce_scatter(g, a, at::ones({6, 2}, at::kDouble), 0); }, "b is Double");
    expect_error(
        [&] {
          comm::matmul_reduce_scatter(g, at::ones({3, 6}), at::ones({6, 2}), 0);
        },
        "equal pieces over the group's 2 members");
    // Refused before anything moved: the group's fused ops still work.
    check_close(comm::matmul_reduce_scatter(g, a, at::ones({6, 2}), 0), at::full({2, 2}, 12.0f), "after the errors");
  });
}

// A member with other shapes fails every member naming it; the group's fused ops stay refused.
TEST(FusedMatmul, MembersWithOtherShapesFailNamingEachOther) {
  run(2, [](const ProcessGroup& g) {
    const at::Tensor shard = at::ones({g.rank() == 0 ? 2 : 3, 4});
    expect_error(
        [&] {
          comm::all_gather_matmul(g, shard, {at::ones({4, 4})}, 0);
        },
        {"all_gather_matmul", "world rank " + std::to_string(1 - g.rank()), "passed other operands"});
    expect_error(
        [&] {
          comm::matmul_reduce_scatter(g, at::ones({2, 4}), at::ones({4, 4}), 0);
        },
        "an earlier fused op on this group failed");
  });
}

// Shapes on either side of the workspace's size: the member that would need more room does not grow
// alone; every member fails naming the other before any data moves.
TEST(FusedMatmul, MembersWithShapesOnEitherSideOfTheWorkspaceSizeFailNamingEachOther) {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::seconds(5));
  run(
      2,
      [](const ProcessGroup& g) {
        comm::all_gather_matmul(g, at::ones({2, 4}), {at::ones({4, 4})}, 0);  // the workspace is set up
        const at::Tensor shard = at::ones({g.rank() == 0 ? 2 : 1 << 20, 4});  // 32 B against 16 MiB
        const auto start = std::chrono::steady_clock::now();
        expect_error(
            [&] {
              comm::all_gather_matmul(g, shard, {at::ones({4, 4})}, 0);
            },
            {"world rank " + std::to_string(1 - g.rank()), "passed other operands"});
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2)) << "not a timeout";
      },
      options);
}

// A member that refuses its own operands fails the others at once, naming it, not after the timeout;
// members that all refuse alike leave the group's fused ops usable (BadOperandsAreClearErrors).
TEST(FusedMatmul, AMemberThatRefusesItsOperandsFailsTheOthersAtOnce) {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::seconds(5));
  run(
      2,
      [](const ProcessGroup& g) {
        const auto start = std::chrono::steady_clock::now();
        const int64_t dim = g.rank() == 0 ? 1 : 0;  // rank 0 names the contracted dim
        if (g.rank() == 0) {
          expect_error(
              [&] {
                comm::all_gather_matmul(g, at::ones({2, 4}), {at::ones({4, 4})}, dim);
              },
              "other than its last");
        } else {
          expect_error(
              [&] {
                comm::all_gather_matmul(g, at::ones({2, 4}), {at::ones({4, 4})}, dim);
              },
              "world rank 0 refused its operands");
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2)) << "not a timeout";
      },
      options);
}

// Runs `grow(g)` on 2 ranks mapping POSIX segments as processes do, with file sizes capped at
// 40 MiB: room for the shared-memory transport's segment and a 1 MiB workspace, not for one of
// 32 MiB a member. Small ops run fused before it, unfused after it; `grow` makes the workspace grow
// and checks the op ran unfused with the unfused results. Each rank says why once; nothing fails
// or waits.
void expect_unfused_once_there_is_no_room(const std::string& op, const std::function<void(const ProcessGroup&)>& grow) {
  ScopedEnv job_dir(job::kDirEnv, "/tmp/hprun-fusedtest" + std::to_string(getpid()));
  const std::string prefix = job::shm_prefix();
  comm::ProcessGroupOptions options;
  options.set_timeout(std::chrono::seconds(20)).set_transport(comm::Transport::kShm);
  std::vector<std::string> errors;
  std::string said;
  {
    ScopedFileSizeLimit cap(40 << 20);
    ::testing::internal::CaptureStderr();
    errors = run_as_processes(2, options, 2, [&](const ProcessGroup& g) {
      log::LogRankGuard rank(g.rank());
      check_once(g, 2, 1, at::kFloat, 7, /*expect_fused=*/true);
      const auto start = std::chrono::steady_clock::now();
      grow(g);
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10)) << "not a timeout";
      for (const int64_t rows : {2, 5}) check_once(g, rows, 1, at::kFloat, 7, /*expect_fused=*/false);
      if (!segments_named(prefix).empty()) throw std::runtime_error("a segment is still linked in /dev/shm");
    });
    said = ::testing::internal::GetCapturedStderr();
  }
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
    const std::string warning = "rank " + std::to_string(rank) + "] " + op +
                                " on group 'world' (world ranks [0, 1]) runs as the unfused collective and matmul "
                                "from now on: there is no room for its workspace";
    const size_t first = said.find(warning);
    EXPECT_NE(first, std::string::npos) << said;
    EXPECT_EQ(said.find(warning, first + 1), std::string::npos) << "said twice: " << said;
  }
  EXPECT_NE(said.find("File too large"), std::string::npos) << said;
  EXPECT_NE(said.find("/dev/shm (a container's is often 64 MiB"), std::string::npos) << said;
}

const int64_t kRowsOf24MiB = (24 << 20) / (8 * 4);  // [rows, 8] floats

// all_gather_matmul of a 24 MiB shard.
TEST(FusedMatmul, WhereThereIsNoRoomForTheWorkspaceAllGatherMatmulRunsUnfused) {
  expect_unfused_once_there_is_no_room("all_gather_matmul", [](const ProcessGroup& g) {
    const at::Tensor whole = values({2 * kRowsOf24MiB, 8}, at::kFloat, 300);
    const at::Tensor b = values({8, 4}, at::kFloat, 301);
    comm::CommDebugMode comm;
    const comm::AllGatherMatmul r =
        comm::all_gather_matmul(g, whole.narrow(0, g.rank() * kRowsOf24MiB, kRowsOf24MiB), {b}, 0);
    EXPECT_EQ(comm.count("all_gather_matmul"), 0) << comm.str();
    EXPECT_EQ(comm.count("all_gather"), 1) << comm.str();
    check_close(r.gathered, whole, "gathered", /*bitwise=*/true);
    check_close(r.outputs.at(0), at::matmul(whole, b), "output", /*bitwise=*/true);
  });
}

// matmul_reduce_scatter of a 24 MiB product (its workspace holds a whole product).
TEST(FusedMatmul, WhereThereIsNoRoomForTheWorkspaceMatmulReduceScatterRunsUnfused) {
  expect_unfused_once_there_is_no_room("matmul_reduce_scatter", [](const ProcessGroup& g) {
    const at::Tensor a = values({kRowsOf24MiB / 2, 2, 8}, at::kFloat, 310 + g.rank());
    const at::Tensor b = values({8, 8}, at::kFloat, 320 + g.rank());
    const at::Tensor want = g.reduce_scatter_tensor(at::empty({kRowsOf24MiB / 4, 2, 8}), at::matmul(a, b));
    comm::CommDebugMode comm;
    const at::Tensor piece = comm::matmul_reduce_scatter(g, a, b, 0);
    EXPECT_EQ(comm.count("matmul_reduce_scatter"), 0) << comm.str();
    EXPECT_EQ(comm.count("reduce_scatter"), 1) << comm.str();
    check_close(piece, want, "reduce-scattered product", /*bitwise=*/true);
  });
}

// A member that never comes (its thread returned): the others fail, naming it.
TEST(FusedMatmul, AMemberThatNeverComesIsNamed) {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::milliseconds(500));
  options.barrier_at_exit = false;
  run(
      2,
      [](const ProcessGroup& g) {
        comm::all_gather_matmul(g, at::ones({2, 4}), {at::ones({4, 4})}, 0);  // sets the workspace up on both
        if (g.rank() == 1) return;
        expect_error([&] { comm::all_gather_matmul(g, at::ones({2, 4}), {at::ones({4, 4})}, 0); }, "world rank 1");
      },
      options);
}

}  // namespace
}  // namespace hp::test

// Real multi-process jobs through hprun: rendezvous in a private store file (one node) or over a
// real TCPStore (two nodes), fail-fast on a dead rank, restarts, and errors (not hangs) for
// collectives whose peer died or never came.
#include <gtest/gtest.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "e2e/e2e_util.h"
#include "hp/core/cpu_capabilities.h"
#include "hp/core/store_wire.h"
#include "scratch_dir.h"

namespace {

using hp::e2e::bin_dir;
using hp::e2e::Result;
using hp::e2e::run_command;
using hp::e2e::run_job;

std::string program(const std::string& scenario) { return bin_dir() + "/e2e_rank_program " + scenario; }

// 4 processes rendezvous and all_reduce correctly; every output line carries its rank.
TEST(Hprun, FourRanksAllReduce) {
  Result r = run_job("--nproc-per-node 4 " + program("allreduce"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_NE(r.output.find("[rank " + std::to_string(rank) + "] allreduce sum 40 ok"), std::string::npos) << r.output;
}

// Each rank's threads: cores / ranks of them for ATen's and OpenBLAS's pools; the user's own
// settings win.
TEST(Hprun, ThreadsPerRank) {
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  const std::string show = " sh -c 'echo threads=$OMP_NUM_THREADS,$OPENBLAS_NUM_THREADS.'";
  const std::string unset = "env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS " + bin_dir() + "/hprun --nproc-per-node ";
  const std::string all = std::to_string(cores);
  const Result one = run_command(unset + "1" + show);
  EXPECT_NE(one.output.find("threads=" + all + "," + all + "."), std::string::npos) << one.output;
  const Result each = run_command(unset + all + show);
  EXPECT_NE(each.output.find("threads=1,1."), std::string::npos) << each.output;
  const Result own = run_command("OMP_NUM_THREADS=3 " + bin_dir() + "/hprun --nproc-per-node 1" + show);
  EXPECT_NE(own.output.find("threads=3,"), std::string::npos) << own.output;
}

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// Two "nodes" (two hprun invocations with --nnodes 2) form one 4-rank job: global ranks follow
// node_rank * nproc + local rank, and the rendezvous spans both.
// The job's secret in a file only its owner can read (hprun --secret-file); returns its path.
std::string write_secret(const std::string& dir, const std::string& secret = "correct horse battery staple") {
  const std::string path = dir + "/job.secret";
  std::ofstream(path) << secret << "\n";
  chmod(path.c_str(), 0600);
  return path;
}

TEST(Hprun, TwoNodesFormOneJob) {
  const std::string secret = write_secret(hp::test::scratch_dir("hprun_two_nodes"));
  const std::string common =
      "--nnodes 2 --nproc-per-node 2 --master-port " + std::to_string(free_port()) + " --secret-file " + secret + " ";
  auto node1 =
      std::async(std::launch::async, [&] { return run_job(common + "--node-rank 1 " + program("allreduce")); });
  Result node0 = run_job(common + "--node-rank 0 " + program("allreduce"));
  Result other = node1.get();
  EXPECT_EQ(node0.exit_code, 0) << node0.output;
  EXPECT_EQ(other.exit_code, 0) << other.output;
  EXPECT_NE(node0.output.find("[rank 1] allreduce sum 40 ok"), std::string::npos) << node0.output;
  EXPECT_NE(other.output.find("[rank 3] allreduce sum 40 ok"), std::string::npos) << other.output;
}

// A job on several nodes meets in node 0's hprun, which serves only clients that present the job's
// secret: one that presents another is refused and logged, and the job goes on undisturbed. The
// secret is never printed.
TEST(Hprun, TwoNodesServeOnlyClientsWithTheJobsSecret) {
  const std::string secret = write_secret(hp::test::scratch_dir("hprun_secret"));
  const int port = free_port();
  const std::string common =
      "--nnodes 2 --nproc-per-node 2 --master-port " + std::to_string(port) + " --secret-file " + secret + " ";
  const std::string slow = "sh -c 'sleep 2; exec " + program("allreduce") + "'";  // time for the intruder
  auto node1 = std::async(std::launch::async, [&] { return run_job(common + "--node-rank 1 " + slow); });
  auto node0 = std::async(std::launch::async, [&] { return run_job(common + "--node-rank 0 " + slow); });
  namespace wire = hp::store_wire;
  std::optional<wire::Parsed> answer;
  for (int attempt = 0; attempt < 100 && !answer; ++attempt) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      const std::string hello = wire::message(static_cast<uint8_t>(wire::Op::kHello), {"not the job's secret"});
      const std::string set = wire::message(static_cast<uint8_t>(wire::Op::kSet), {"hp/pg/0,1,2,3/0", "forged"});
      if (wire::write_all(fd, hello.data(), hello.size()) && wire::write_all(fd, set.data(), set.size()))
        if (const auto body = wire::read_message(fd)) answer = wire::parse(*body);
    }
    close(fd);
    if (!answer) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(answer.has_value()) << "the intruder never got an answer";
  EXPECT_EQ(answer->head, static_cast<uint8_t>(wire::Status::kRefused));
  // One that announces a message too large for a hello is cut off before it is read.
  {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    const uint32_t huge = 32u << 20;
    ASSERT_TRUE(wire::write_all(fd, &huge, 4));
    EXPECT_FALSE(wire::read_message(fd).has_value()) << "the server waited for 32 MiB from a stranger";
    close(fd);
  }
  const Result zero = node0.get(), one = node1.get();
  EXPECT_EQ(zero.exit_code, 0) << zero.output;
  EXPECT_EQ(one.exit_code, 0) << one.output;
  EXPECT_NE(zero.output.find("[rank 1] allreduce sum 40 ok"), std::string::npos) << zero.output;
  EXPECT_NE(one.output.find("[rank 3] allreduce sum 40 ok"), std::string::npos) << one.output;
  EXPECT_NE(zero.output.find("hprun: refused a rendezvous client from 127.0.0.1:"), std::string::npos) << zero.output;
  EXPECT_NE(zero.output.find("it sent a message too large for a hello"), std::string::npos) << zero.output;
  for (const Result* r : {&zero, &one})
    EXPECT_EQ(r->output.find("correct horse battery staple"), std::string::npos) << r->output;
}

// A rank exiting with code 3 stops the job within 5 s; hprun names the rank and exits non-zero.
TEST(Hprun, FailingRankStopsTheJob) {
  Result r = run_job("--nproc-per-node 4 " + program("exit3"));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("hprun: rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 3"), std::string::npos) << r.output;
  // Measured by hprun from the failure to the last rank's exit (process start-up is not part of it).
  const size_t at = r.output.find("hprun: every rank stopped ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const double stop_seconds = std::stod(r.output.substr(at + std::string("hprun: every rank stopped ").size()));
  EXPECT_LT(stop_seconds, 5.0) << r.output;
}

// A collective whose peer process died fails with an error naming the collective and the dead rank.
TEST(Hprun, PeerDiedIsAnErrorNotAHang) {
  Result r = run_job("--nproc-per-node 2 " + program("peer_dies"));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0] "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("all_reduce on group 'world'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("never reached it (dead, or stuck elsewhere): [1]"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0) << r.output;
}

// A collective whose peer is alive but never arrives times out (3 s) with hp::TimeoutError.
TEST(Hprun, PeerNeverArrivesTimesOut) {
  Result r = run_job("--nproc-per-node 2 " + program("peer_hangs"));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0] TimeoutError: all_reduce on group 'world'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[1]"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0) << r.output;
}

// With HP_COMM_TRANSPORT=shm, and by default (auto), the collectives between processes of one host
// go through shared memory (a segment of the job is mapped) and equal the same computation on one
// rank bitwise, as they do over Gloo.
TEST(Hprun, CollectivesOverSharedMemoryBetweenProcesses) {
  for (const std::string transport : {"shm", "auto", "gloo"}) {
    Result r = run_job("--nproc-per-node 4 env HP_COMM_TRANSPORT=" + transport + " " + program("collectives"));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const std::string used = transport == "gloo" ? "gloo" : "shared memory";
    for (int rank = 0; rank < 4; ++rank)
      EXPECT_NE(r.output.find("[rank " + std::to_string(rank) + "] collectives ok over " + used), std::string::npos)
          << r.output;
  }
}

// Symmetric memory between processes: puts and signals around a ring are seen in order on every
// rank (each maps the job's segment), and a wait for a rank whose process exited fails at once,
// naming it, long before the 3 s timeout would.
TEST(Hprun, SymmetricMemoryBetweenProcesses) {
  Result r = run_job("--nproc-per-node 3 " + program("symmetric"));
  for (int rank = 0; rank < 3; ++rank)
    EXPECT_NE(r.output.find("[rank " + std::to_string(rank) + "] symmetric ring ok over a segment"), std::string::npos)
        << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(
      r.output.find("waiting for a signal from world rank 1 on channel 0, but the process of world rank 1 exited"),
      std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 10.0) << r.output;
}

// A rank SIGKILLed while a segment of the job is still linked leaves nothing in /dev/shm: hprun
// removes the job's segments when it ends.
TEST(Hprun, AKilledRankLeavesNoSharedMemory) {
  Result r = run_job("--nproc-per-node 2 env HP_COMM_TRANSPORT=shm " + program("shm_killed"));
  EXPECT_NE(r.exit_code, 0) << r.output;
  const size_t at = r.output.find("left /");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string name = r.output.substr(at + 5, r.output.find('\n', at) - at - 5);
  EXPECT_EQ(name.find("FAILED"), std::string::npos) << r.output;
  EXPECT_NE(access(("/dev/shm" + name).c_str(), F_OK), 0) << name << " is still there";
}

// HP_OPS_YAML_DIR adds the user's rule files to the library's own at start-up.
TEST(Hprun, UserRuleFilesFromTheEnvironment) {
  const std::string dir = "/tmp/hp_e2e_user_rules_" + std::to_string(getpid());
  ASSERT_EQ(
      std::system(("mkdir -p " + dir + " && printf 'pointwise:\\n  nonlinear: [aten::frac]\\n' > " + dir + "/user.yaml")
                      .c_str()),
      0);
  Result r = run_job("--nproc-per-node 2 env HP_OPS_YAML_DIR=" + dir + " " + program("user_yaml"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 1] frac through a user rule ok"), std::string::npos) << r.output;
  Result without = run_job("--nproc-per-node 2 " + program("user_yaml"));
  EXPECT_NE(without.exit_code, 0) << without.output;
  EXPECT_NE(without.output.find("no sharding rule for aten::frac"), std::string::npos) << without.output;
  std::system(("rm -rf " + dir).c_str());
}

// On one node the ranks meet in a store file in hprun's private job directory: nothing of the job
// listens outside loopback (read from the socket table), and the directory is gone afterwards. The
// same ranks rendezvousing over TCPStore (as without hprun's file) do listen on every interface:
// the check can see what it guards against.
TEST(Hprun, OneNodeJobListensOnLoopbackOnly) {
  const std::string tmp = "/tmp/hp_e2e_job_dirs_" + std::to_string(getpid());
  ASSERT_EQ(std::system(("mkdir -p " + tmp).c_str()), 0);
  const Result r = run_command("TMPDIR=" + tmp + " " + bin_dir() + "/hprun --nproc-per-node 4 " + program("listeners"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_NE(r.output.find("[rank " + std::to_string(rank) + "] listens on loopback only"), std::string::npos)
        << r.output;
  EXPECT_EQ(run_command("ls -A " + tmp).output, "") << "hprun leaves its job directory behind";
  std::system(("rm -rf " + tmp).c_str());

  const Result tcp = run_job("--nproc-per-node 2 env -u HP_RENDEZVOUS_FILE " + program("listeners"));
  EXPECT_NE(tcp.exit_code, 0) << tcp.output;
  EXPECT_NE(tcp.output.find("[rank 0] listening outside loopback: "), std::string::npos) << tcp.output;
}

// --max-restarts: a failed job starts again in a fresh rendezvous (the first attempt's store keys
// are gone) and finishes; without restarts left the failure stands, named.
TEST(Hprun, RestartsAFailedJobInAFreshRendezvous) {
  const Result r = run_job("--nproc-per-node 3 --max-restarts 2 " + program("restart"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("hprun: rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restarting every rank in 1 s (restart 1 of at most 2)"), std::string::npos) << r.output;
  for (int rank = 0; rank < 3; ++rank)
    EXPECT_NE(r.output.find("[rank " + std::to_string(rank) + "] restart 1 fresh rendezvous sum 12"), std::string::npos)
        << r.output;
  EXPECT_NE(r.output.find("hprun: restart summary (2 attempts)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("hprun:   attempt 2: finished"), std::string::npos) << r.output;

  const Result out_of_restarts = run_job("--nproc-per-node 2 --max-restarts 1 " + program("exit3"));
  EXPECT_EQ(out_of_restarts.exit_code, 3) << out_of_restarts.output;
  EXPECT_NE(out_of_restarts.output.find("no restarts left (--max-restarts 1)"), std::string::npos)
      << out_of_restarts.output;
  EXPECT_NE(out_of_restarts.output.find("hprun:   attempt 2: rank 1 (pid"), std::string::npos)
      << out_of_restarts.output;

  // Exit code 2 is a usage or config error: a restart would repeat it.
  const Result config_error = run_job("--nproc-per-node 2 --max-restarts 2 sh -c 'exit 2'");
  EXPECT_EQ(config_error.exit_code, 2) << config_error.output;
  EXPECT_EQ(config_error.output.find("restarting every rank"), std::string::npos) << config_error.output;
  EXPECT_NE(config_error.output.find("not restarting: exit code 2 is a usage or config error"), std::string::npos)
      << config_error.output;

  // A signal during the wait before a restart (1 s, then 2 s: the signal at 2 s falls in the
  // second) ends the job as an interrupted one.
  const Result interrupted = run_command("sh -c '" + bin_dir() +
                                         "/hprun --max-restarts 3 sh -c \"exit 3\" & sleep 2; kill -TERM $!; wait $!'");
  EXPECT_EQ(interrupted.exit_code, 130) << interrupted.output;
  EXPECT_EQ(interrupted.output.find("restart 3 of at most 3"), std::string::npos) << interrupted.output;
}

// --cpu-layout auto times the job under each candidate (threads per rank, ATEN_CPU_CAPABILITY) and
// runs it with the fastest, here a script whose throughput is known: one thread beats more, avx2
// beats avx512 beats default. The choice is remembered per command line and the contents of the
// files it names; a setting the environment fixes is the only one tried.
TEST(Hprun, CpuLayoutAutoRunsTheJobInTheFastestLayoutMeasured) {
  const std::string dir = hp::test::scratch_dir("hprun_cpu_layout");
  const std::string script = dir + "/job.sh", config = dir + "/config.txt";
  std::ofstream(script)
      << "case \"$ATEN_CPU_CAPABILITY\" in avx2) c=30;; avx512) c=20;; *) c=10;; esac\n"
         "if [ -n \"$HP_LAYOUT_PROBE\" ]; then\n"
         "  [ -n \"$HP_FAULT\" ] && exit 5\n"
         "  [ \"$LOCAL_RANK\" = 0 ] && echo $((c * 1000 / OMP_NUM_THREADS)) > \"$HP_LAYOUT_PROBE\"\n"
         "  exit 0\n"
         "fi\n"
         "echo \"ran with $OMP_NUM_THREADS threads, $ATEN_CPU_CAPABILITY, fault ${HP_FAULT:-none}.\"\n";
  std::ofstream(config) << "first\n";
  // HP_FAULT reaches the job but not the runs timing it.
  const auto hprun = [&](const std::string& settings = "") {
    return "env -u OMP_NUM_THREADS -u ATEN_CPU_CAPABILITY HOME=" + dir + " HP_FAULT=drill " + settings + " " +
           bin_dir() + "/hprun --cpu-layout auto ";
  };
  const std::string job = "sh " + script + " " + config;
  const std::vector<std::string> capabilities = hp::runnable_cpu_capabilities();
  const bool avx2 = std::find(capabilities.begin(), capabilities.end(), "avx2") != capabilities.end();
  const std::string fastest = std::string("1 thread per rank, ") + (avx2 ? "avx2" : "default");
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  size_t thread_counts = 1;  // cores, and every power of two below
  for (long t = 1; t < cores; t *= 2) ++thread_counts;

  const Result first = run_command(hprun() + job);
  EXPECT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("timing " + std::to_string(thread_counts * capabilities.size()) + " layouts of 1 ranks"),
            std::string::npos)
      << first.output;
  for (const std::string& capability : capabilities)
    EXPECT_NE(first.output.find("1 thread per rank, " + capability + ": "), std::string::npos) << first.output;
  EXPECT_NE(first.output.find(fastest + ", the fastest"), std::string::npos) << first.output;
  EXPECT_NE(first.output.find("ran with 1 threads, " + std::string(avx2 ? "avx2" : "default") + ", fault drill."),
            std::string::npos)
      << first.output;

  const Result second = run_command(hprun() + job);
  EXPECT_EQ(second.exit_code, 0) << second.output;
  EXPECT_EQ(second.output.find("timing"), std::string::npos) << second.output;
  EXPECT_NE(second.output.find(fastest + " (" + std::to_string((avx2 ? 30 : 10) * 1000) + "/s, measured"),
            std::string::npos)
      << second.output;
  EXPECT_NE(second.output.find("ran with 1 threads"), std::string::npos) << second.output;

  std::ofstream(config) << "second\n";  // another config: measured again
  const Result changed = run_command(hprun() + job);
  EXPECT_NE(changed.output.find("timing"), std::string::npos) << changed.output;
  const Result named = run_command(hprun() + job + " --config=" + config);  // a file as an option's value
  std::ofstream(config) << "third\n";
  const Result renamed = run_command(hprun() + job + " --config=" + config);
  EXPECT_NE(named.output.find("timing"), std::string::npos) << named.output;
  EXPECT_NE(renamed.output.find("timing"), std::string::npos) << renamed.output;

  const Result fixed = run_command(hprun("ATEN_CPU_CAPABILITY=default") + job);
  EXPECT_NE(fixed.output.find("timing " + std::to_string(thread_counts) + " layouts"), std::string::npos)
      << fixed.output;
  EXPECT_NE(fixed.output.find("ran with 1 threads, default,"), std::string::npos) << fixed.output;

  const Result silent = run_command(hprun() + "true");
  EXPECT_EQ(silent.exit_code, 2) << silent.output;
  EXPECT_NE(silent.output.find("true wrote no throughput to HP_LAYOUT_PROBE"), std::string::npos) << silent.output;
}

// Usage errors and --help.
TEST(Hprun, HelpAndUsageErrors) {
  Result help = run_job("--help");
  EXPECT_EQ(help.exit_code, 0);
  for (const char* flag : {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                           "--max-restarts", "--recover-processes", "--secret-file", "--cpu-layout"})
    EXPECT_NE(help.output.find(flag), std::string::npos) << help.output;
  Result bad = run_job("--nproc-per-node zero true");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("--nproc-per-node expects an integer"), std::string::npos) << bad.output;
  Result restarts_across_nodes = run_job("--nnodes 2 --max-restarts 1 true");
  EXPECT_EQ(restarts_across_nodes.exit_code, 2);
  EXPECT_NE(restarts_across_nodes.output.find("--max-restarts works on one node only"), std::string::npos)
      << restarts_across_nodes.output;
  Result recover_without_restarts = run_job("--recover-processes true");
  EXPECT_EQ(recover_without_restarts.exit_code, 2);
  EXPECT_NE(recover_without_restarts.output.find("--recover-processes needs --max-restarts N"), std::string::npos)
      << recover_without_restarts.output;
  Result no_secret = run_job("--nnodes 2 true");
  EXPECT_EQ(no_secret.exit_code, 2);
  EXPECT_NE(no_secret.output.find("a job on several nodes needs --secret-file FILE"), std::string::npos)
      << no_secret.output;
  const std::string dir = hp::test::scratch_dir("hprun_usage");
  const std::string readable = write_secret(dir);
  chmod(readable.c_str(), 0644);
  Result open_secret = run_job("--nnodes 2 --secret-file " + readable + " true");
  EXPECT_EQ(open_secret.exit_code, 2);
  EXPECT_NE(open_secret.output.find("can be read by others than its owner: chmod 600 it"), std::string::npos)
      << open_secret.output;
  const std::string binary = dir + "/binary.secret";
  std::ofstream(binary) << std::string("0123456789\0abcdefghij", 21);
  chmod(binary.c_str(), 0600);
  Result not_text = run_job("--nnodes 2 --secret-file " + binary + " true");
  EXPECT_EQ(not_text.exit_code, 2);
  EXPECT_NE(not_text.output.find("must hold printable text"), std::string::npos) << not_text.output;
  Result layout = run_job("--cpu-layout fast true");
  EXPECT_EQ(layout.exit_code, 2);
  EXPECT_NE(layout.output.find("--cpu-layout takes even or auto, got 'fast'"), std::string::npos) << layout.output;
  Result layout_across_nodes = run_job("--nnodes 2 --cpu-layout auto true");
  EXPECT_EQ(layout_across_nodes.exit_code, 2);
  EXPECT_NE(layout_across_nodes.output.find("--cpu-layout auto works on one node only"), std::string::npos)
      << layout_across_nodes.output;
  Result missing = run_job("--nproc-per-node 2 /nonexistent/program");
  EXPECT_EQ(missing.exit_code, 127) << missing.output;
  EXPECT_NE(missing.output.find("could not start '/nonexistent/program'"), std::string::npos) << missing.output;
}

}  // namespace

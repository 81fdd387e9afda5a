// read_launch_env understands hprun/torchrun, mpirun, PMI and srun variables and rejects bad ones.
#include <hp/comm/init.h>
#include <hp/core/error.h>

#include <map>

#include "test_util.h"

namespace hp::test {
namespace {

comm::LaunchEnv read(std::map<std::string, std::string> vars) {
  return comm::read_launch_env([vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

// hprun / torchrun variables, with the master address and port.
TEST(LaunchEnv, ReadsHprunVariables) {
  auto env = read({{"RANK", "5"},
                   {"WORLD_SIZE", "8"},
                   {"LOCAL_RANK", "1"},
                   {"LOCAL_WORLD_SIZE", "4"},
                   {"MASTER_ADDR", "node0"},
                   {"MASTER_PORT", "1234"}});
  EXPECT_EQ(env.source, "hprun");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "node0");
  EXPECT_EQ(env.master_port, 1234);
}

// Open MPI, MPICH/PMI and Slurm variables, each mapped to the same fields.
TEST(LaunchEnv, ReadsMpiPmiAndSlurm) {
  auto ompi = read({{"OMPI_COMM_WORLD_RANK", "3"},
                    {"OMPI_COMM_WORLD_SIZE", "4"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(ompi.source, "mpirun");
  EXPECT_EQ(ompi.rank, 3);
  EXPECT_EQ(ompi.master_addr, "127.0.0.1");  // one node: loopback is fine
  auto pmi = read({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"MPI_LOCALRANKID", "2"}});
  EXPECT_EQ(pmi.source, "pmi");
  EXPECT_EQ(pmi.local_rank, 2);
  auto slurm = read({{"SLURM_PROCID", "6"},
                     {"SLURM_NTASKS", "8"},
                     {"SLURM_LOCALID", "2"},
                     {"SLURM_NTASKS_PER_NODE", "4(x2)"},
                     {"MASTER_ADDR", "n1"}});
  EXPECT_EQ(slurm.source, "slurm");
  EXPECT_EQ(slurm.rank, 6);
  EXPECT_EQ(slurm.local_world_size, 4);
  EXPECT_EQ(read({}).world_size, 1);  // nothing set: a world of one
}

// Malformed and inconsistent values are errors naming the variable.
TEST(LaunchEnv, RejectsBadValues) {
  auto fails_with = [](std::map<std::string, std::string> vars, const std::string& needle) {
    try {
      read(vars);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "no error for a launch environment that should mention " << needle;
  };
  fails_with({{"RANK", "x"}, {"WORLD_SIZE", "2"}}, "RANK='x' is not an integer");
  fails_with({{"RANK", "0"}}, "WORLD_SIZE is not");
  fails_with({{"RANK", "4"}, {"WORLD_SIZE", "4"}}, "RANK=4 is not in [0, WORLD_SIZE=4)");
  fails_with({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT=70000");
  fails_with({{"RANK", "0"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}}, "needs MASTER_ADDR");
}

}  // namespace
}  // namespace hp::test

#include "train/fault_injector.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <sstream>
#include <thread>

#include "hp/core/error.h"
#include "hp/core/job.h"
#include "hp/core/log.h"
#include "hp/dcp/state_dict.h"
#include "hp/dtensor/local.h"
#include "hp/train/stop.h"

namespace hp::train::detail {
namespace {

constexpr char kSpecEnv[] = "HP_FAULT";

std::vector<std::string> split(const std::string& s, char separator) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, separator);) parts.push_back(part);
  return parts;
}

template <typename T>
T parse_number(const std::string& text, const std::string& fault, const std::string& source, const char* what) {
  std::istringstream in(text);
  T value{};
  in >> value;
  HP_CHECK(!text.empty() && in && in.peek() == EOF, source, ": '", fault, "': ", what, " '", text, "' is not a number");
  return value;
}

Fault parse_fault(const std::string& text, int index, const std::string& source) {
  const std::vector<std::string> parts = split(text, ':');
  static const char* kForm =
      " (KIND:RANK:STEP[:ARG...], KIND one of kill, throw, hang, delay, preempt, flip, flip_grad, flip_state, nan, "
      "spike, damage_copy)";
  HP_CHECK(parts.size() >= 3 && parts.size() <= 5, source, ": '", text, "' is not a fault", kForm);
  Fault fault;
  fault.index = index;
  fault.text = text;
  fault.source = source;
  static const std::vector<std::pair<std::string, FaultKind>> kKinds{{"kill", FaultKind::kKill},
                                                                     {"throw", FaultKind::kThrow},
                                                                     {"hang", FaultKind::kHang},
                                                                     {"delay", FaultKind::kDelay},
                                                                     {"preempt", FaultKind::kPreempt},
                                                                     {"flip", FaultKind::kFlip},
                                                                     {"flip_state", FaultKind::kFlipState},
                                                                     {"flip_grad", FaultKind::kFlipGrad},
                                                                     {"nan", FaultKind::kNan},
                                                                     {"spike", FaultKind::kSpike},
                                                                     {"damage_copy", FaultKind::kDamageCopy}};
  const auto kind = std::find_if(kKinds.begin(), kKinds.end(), [&](const auto& k) { return k.first == parts[0]; });
  HP_CHECK(kind != kKinds.end(), source, ": '", text, "': unknown kind '", parts[0], "'", kForm);
  fault.kind = kind->second;
  fault.rank = parse_number<int>(parts[1], text, source, "rank");
  fault.step = parse_number<int64_t>(parts[2], text, source, "step");
  HP_CHECK(fault.rank >= 0 && fault.step >= 1, source, ": '", text, "': the rank must be >= 0 and the step >= 1");
  const std::vector<std::string> args(parts.begin() + 3, parts.end());
  const auto always_at = [&](size_t i) { return args.size() == i + 1 && args[i] == "always"; };
  bool well_formed = args.empty();
  switch (fault.kind) {
    case FaultKind::kFlip:
    case FaultKind::kFlipGrad:
    case FaultKind::kFlipState:
      well_formed = args.size() <= 1;
      if (args.size() == 1) fault.parameter = args[0];
      break;
    case FaultKind::kDelay:
      well_formed = args.size() == 1;
      if (well_formed) fault.seconds = parse_number<double>(args[0], text, source, "seconds");
      HP_CHECK(fault.seconds >= 0, source, ": '", text, "': the delay must not be negative");
      break;
    case FaultKind::kThrow:
      well_formed = args.empty() || (args.size() == 1 && (args[0] == "backward" || args[0] == "optimizer"));
      if (args.size() == 1) fault.when = args[0];
      break;
    case FaultKind::kNan:
      fault.always = always_at(0);
      well_formed = args.empty() || fault.always;
      break;
    case FaultKind::kSpike:
      fault.always = always_at(1);
      well_formed = args.size() == 1 || fault.always;
      if (well_formed) fault.factor = parse_number<double>(args[0], text, source, "factor");
      HP_CHECK(std::isfinite(fault.factor) && fault.factor > 0, source, ": '", text,
               "': the factor must be finite and > 0");
      break;
    default:
      break;
  }
  HP_CHECK(well_formed, source, ": '", text,
           "': a delay takes SECONDS, a flip (flip_grad, flip_state) may take a parameter's FQN, a throw may take ",
           "'backward' or 'optimizer', a nan may take 'always', a spike takes FACTOR and may take 'always'; the other ",
           "kinds take nothing after the step");
  return fault;
}

// True the first time in this job (one process without hprun) that `fault` fires.
bool claim_once(const Fault& fault) {
  const std::optional<std::string> dir = job::dir();
  return !dir || job::claim(*dir + "/" + job::fault_fired_file(fault.index));
}

// Flips bit 22 of the first element of `t` (its first 4 bytes), through a host copy: `t` may live
// on a GPU. `what` names it for the log and the error.
void flip_bit_22(const at::Tensor& t, const std::string& what, int rank) {
  HP_CHECK(t.defined() && t.nbytes() >= 4, "injected fault: ", what, " has no element on rank ", rank);
  at::NoGradGuard no_grad;
  const at::Tensor bytes = t.detach().to(at::kCPU).contiguous();
  static_cast<uint8_t*>(bytes.data_ptr())[2] ^= 1u << 6;
  t.detach().copy_(bytes);
}

// Fires one fault at its step, once per job.
class FaultCallback : public Callback {
 public:
  // parameter: the one a flip or a nan changes, or whose gradient it changes (undefined for other
  // kinds); gradients: the parameters whose gradients a spike scales (the rank's); state: for
  // flip_state, the parameter's first optimizer state tensor and its name (it exists once the
  // optimizer has stepped).
  using StateOf = std::function<std::pair<std::string, at::Tensor>()>;
  FaultCallback(Fault fault, at::Tensor parameter, std::vector<at::Tensor> gradients, StateOf state)
      : fault_(std::move(fault)),
        parameter_(std::move(parameter)),
        gradients_(std::move(gradients)),
        state_(std::move(state)) {}

  void on_step_begin(int64_t step) override {
    if (!fires_at_begin() || step != fault_.step || !claim()) return;
    if (fault_.kind == FaultKind::kDelay) {
      log::warn("injected fault: sleeping ", fault_.seconds, " s at the start of step ", step);
      std::this_thread::sleep_for(std::chrono::duration<double>(fault_.seconds));
    } else if (fault_.kind == FaultKind::kHang) {
      log::warn("injected fault: hanging at the start of step ", step);
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    } else if (fault_.kind == FaultKind::kPreempt) {
      preempt(step);
    }
  }

  void on_step_end(const StepRecord& record) override {
    if (fault_.kind == FaultKind::kFlipGrad && record.step == fault_.step && record.skipped && !fired_)
      log::warn("injected fault: flip_grad at step ", record.step, " did not fire: the step was skipped (not finite), ",
                "so its gradients were never applied");
    if (!fires_at_end() || record.step != fault_.step || !claim()) return;
    if (fault_.kind == FaultKind::kKill) {
      log::warn("injected fault: SIGKILL after step ", record.step);
      ::kill(::getpid(), SIGKILL);
    } else if (fault_.kind == FaultKind::kThrow) {
      HP_FAIL("injected fault: rank ", fault_.rank, " failed after step ", record.step);
    } else if (fault_.kind == FaultKind::kFlip) {
      log::warn("injected fault: flipping bit 22 of ", fault_.parameter, " after step ", record.step);
      flip_bit_22(local_tensor(parameter_), fault_.parameter, fault_.rank);
    } else if (fault_.kind == FaultKind::kFlipState) {
      const auto [name, state] = state_();
      log::warn("injected fault: flipping bit 22 of ", name, " after step ", record.step);
      flip_bit_22(state.defined() ? local_tensor(state) : state, name, fault_.rank);
    }
  }

  void on_after_backward(int64_t step) override {
    if (fault_.kind == FaultKind::kThrow && fault_.when == "backward" && step == fault_.step && claim())
      HP_FAIL("injected fault: rank ", fault_.rank, " failed after step ", step, "'s backward");
    if ((fault_.kind != FaultKind::kNan && fault_.kind != FaultKind::kSpike) || step != fault_.step || !claim_run(step))
      return;
    at::NoGradGuard no_grad;
    if (fault_.kind == FaultKind::kNan) {
      log::warn("injected fault: NaN in ", fault_.parameter, "'s gradient after step ", step, "'s backward");
      // The rank's own piece: a shard of an uneven split may be empty.
      at::Tensor first = parameter_.grad().defined() ? local_tensor(parameter_.grad()) : at::Tensor();
      HP_CHECK(first.defined() && first.numel() > 0, "injected fault: ", fault_.parameter,
               " has no gradient element on rank ", fault_.rank);
      while (first.dim() > 0) first = first.select(0, 0);
      first.fill_(std::numeric_limits<double>::quiet_NaN());
      return;
    }
    log::warn("injected fault: rank ", fault_.rank, "'s gradients times ", fault_.factor, " after step ", step,
              "'s backward");
    for (const at::Tensor& parameter : gradients_)
      if (parameter.grad().defined()) local_tensor(parameter.grad()).mul_(fault_.factor);
  }

  void on_before_optimizer_step(int64_t step) override {
    if (fault_.kind == FaultKind::kThrow && fault_.when == "optimizer" && step == fault_.step && claim())
      HP_FAIL("injected fault: rank ", fault_.rank, " failed as step ", step, "'s optimizer step began");
    if (fault_.kind != FaultKind::kFlipGrad || step != fault_.step || !claim()) return;
    log::warn("injected fault: flipping bit 22 of ", fault_.parameter, "'s gradient before step ", step,
              "'s optimizer step");
    flip_bit_22(parameter_.grad().defined() ? local_tensor(parameter_.grad()) : at::Tensor(),
                fault_.parameter + "'s gradient", fault_.rank);
  }

 private:
  // A stuck or slow rank is so from the start of its step; a dead or failing one after it. A
  // preemption notice comes at the start, so that the step it is in is the one saved.
  bool fires_at_begin() const {
    return fault_.kind == FaultKind::kDelay || fault_.kind == FaultKind::kHang || fault_.kind == FaultKind::kPreempt;
  }
  bool fires_at_end() const {
    return fault_.kind == FaultKind::kKill || (fault_.kind == FaultKind::kThrow && fault_.when.empty()) ||
           fault_.kind == FaultKind::kFlip || fault_.kind == FaultKind::kFlipState;
  }

  // Under hprun the notice goes to hprun, which forwards it to every rank as a cluster's would;
  // waiting for it here makes sure the step in progress carries the request. Without hprun the
  // request is made directly.
  void preempt(int64_t step) {
    log::warn("injected fault: preemption notice at the start of step ", step);
    if (!job::dir()) {
      request_stop(SIGTERM);
      return;
    }
    ::kill(::getppid(), SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (stop_requested() == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    HP_CHECK(
        stop_requested() != 0, "injected fault: preempt: hprun (pid ", ::getppid(),
        ") did not forward SIGTERM within 10 s; is the program's stop handler installed (hp::train::stop_on_signals)?");
  }

  // True the first time in this job that the fault reaches its step.
  bool claim() {
    if (fired_) return false;
    fired_ = true;
    return claim_once(fault_);
  }

  // claim(), or for a fault that fires in every run of its step, true again in a rerun of it.
  bool claim_run(int64_t step) {
    if (fault_.always && fired_ && fired_step_ == step) return true;
    if (!claim()) return false;
    fired_step_ = step;
    return true;
  }

  Fault fault_;
  at::Tensor parameter_;
  std::vector<at::Tensor> gradients_;
  StateOf state_;
  bool fired_ = false;
  int64_t fired_step_ = 0;
};

}  // namespace

std::vector<Fault> parse_faults(const std::string& spec, const std::string& source, int first_index) {
  std::vector<Fault> faults;
  for (const std::string& text : split(spec, ','))
    if (!text.empty()) faults.push_back(parse_fault(text, first_index + static_cast<int>(faults.size()), source));
  return faults;
}

std::vector<Fault> injected_faults(const std::string& configured, int world_size, int64_t steps) {
  std::vector<Fault> faults = parse_faults(configured, "resilience.faults");
  if (const char* spec = std::getenv(kSpecEnv)) {
    const std::vector<Fault> from_env = parse_faults(spec, kSpecEnv, static_cast<int>(faults.size()));
    faults.insert(faults.end(), from_env.begin(), from_env.end());
  }
  check_faults_fire(faults, world_size, steps);
  return faults;
}

void check_faults_fire(const std::vector<Fault>& faults, int world_size, int64_t steps) {
  for (const Fault& fault : faults)
    HP_CHECK(fault.rank < world_size && fault.step <= steps, fault.source, ": '", fault.text, "' is for rank ",
             fault.rank, " at step ", fault.step, ", but the run has ", world_size, " ranks and ", steps,
             " steps: it would never fire");
}

std::vector<std::shared_ptr<Callback>> fault_callbacks(const std::vector<Fault>& faults, int rank,
                                                       const models::ModelParts& parts,
                                                       torch::optim::Optimizer& optimizer) {
  std::vector<std::shared_ptr<Callback>> callbacks;
  for (Fault fault : faults) {
    if (fault.rank != rank || fault.kind == FaultKind::kDamageCopy) continue;  // fires in a recovery: damages_copy
    at::Tensor parameter;
    if (fault.kind == FaultKind::kFlip || fault.kind == FaultKind::kFlipGrad || fault.kind == FaultKind::kFlipState ||
        fault.kind == FaultKind::kNan) {
      const auto named = parts.named_parameters();
      auto it = named.begin();
      if (!fault.parameter.empty())
        it = std::find_if(named.begin(), named.end(), [&](const auto& p) { return p.first == fault.parameter; });
      if (it == named.end()) {
        std::string some;
        for (size_t i = 0; i < named.size() && i < 4; ++i) some += (i ? ", " : "") + named[i].first;
        HP_FAIL(fault.source, ": '", fault.text, "': rank ", rank, " has no parameter '", fault.parameter,
                "' to flip (it has ", some, named.size() > 4 ? ", ..." : "", ")");
      }
      fault.parameter = it->first;
      parameter = it->second;
    }
    FaultCallback::StateOf state_of;
    if (fault.kind == FaultKind::kFlipState)
      state_of = [&optimizer, model = parts.model,
                  prefix = "optim." + fault.parameter + "."]() -> std::pair<std::string, at::Tensor> {
        dcp::StateDict state;
        dcp::add_optimizer_state(state, optimizer, *model);
        const auto it = state.tensors.lower_bound(prefix);
        if (it == state.tensors.end() || it->first.rfind(prefix, 0) != 0) return {prefix, at::Tensor()};
        return *it;
      };
    callbacks.push_back(std::make_shared<FaultCallback>(
        fault, parameter, fault.kind == FaultKind::kSpike ? parts.parameters() : std::vector<at::Tensor>{},
        std::move(state_of)));
  }
  return callbacks;
}

bool damages_copy(const std::vector<Fault>& faults, int rank, int64_t step) {
  for (const Fault& fault : faults)
    if (fault.kind == FaultKind::kDamageCopy && fault.rank == rank && fault.step == step) return claim_once(fault);
  return false;
}

}  // namespace hp::train::detail

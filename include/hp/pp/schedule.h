// Pipeline schedules as data: for each rank, the ordered list of actions it runs: forward, full
// backward, backward-input (dx), backward-weight (dw), and the sends and receives between stages.
// Builders make the standard schedules; validate() proves a schedule complete and deadlock-free
// before anything runs; a CSV form lets users write their own; simulate() computes the makespan
// and bubble of a schedule from per-action costs; to_svg() draws it as a timeline.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hp::pp {

enum class ActionKind : uint8_t {
  kForward,         // F
  kBackward,        // B: input and weight gradients together
  kBackwardInput,   // I: input gradient only (dx), on the critical path
  kBackwardWeight,  // W: weight gradient (dw), after I of the same stage and micro-batch
  kSendForward,     // SEND_F: the stage's output activation to the next stage's rank
  kRecvForward,     // RECV_F: the stage's input activation from the previous stage's rank
  kSendBackward,    // SEND_B: the stage's input gradient to the previous stage's rank
  kRecvBackward,    // RECV_B: the stage's output gradient from the next stage's rank
};

struct Action {
  ActionKind kind;
  int stage;
  int micro_batch;
  std::string str() const;                       // "2F5": stage 2 forward of micro-batch 5; "0SEND_B1", "3W0", ...
  static Action parse(const std::string& text);  // the inverse of str(); throws hp::Error
  bool operator==(const Action& o) const { return kind == o.kind && stage == o.stage && micro_batch == o.micro_batch; }
  bool is_compute() const { return kind <= ActionKind::kBackwardWeight; }
};

struct Schedule {
  std::string name;
  int ranks = 0;
  int stages = 0;
  int micro_batches = 0;
  std::vector<int> stage_rank;                // the rank each stage runs on
  std::vector<std::vector<Action>> programs;  // per rank, in order
};

// One stage per rank. GPipe: all forwards, then all backwards.
Schedule gpipe(int ranks, int micro_batches);
// One stage per rank. 1F1B: ranks - 1 - r warm-up forwards, then one forward / one backward,
// so a stage holds at most `ranks` micro-batches of activations.
Schedule one_f_one_b(int ranks, int micro_batches);
// `stages_per_rank` stages per rank, stage s on rank s % ranks (Megatron's interleaved 1F1B).
Schedule interleaved_1f1b(int ranks, int stages_per_rank, int micro_batches);
// Zero-bubble V with unit costs (see zero_bubble_v with costs, below).
Schedule zero_bubble_v(int ranks, int micro_batches);
struct ActionCosts;
// The names schedule_by_name knows, "gpipe, 1f1b, ...", for messages.
const std::string& schedule_names();
// The stages of schedule `name` on `ranks` ranks (`stages_per_rank` is interleaved's); 0 for a
// name schedule_by_name does not know.
int64_t schedule_stages(const std::string& name, int64_t ranks, int64_t stages_per_rank = 2);
// Whether schedule `name` is of the zero-bubble family: it splits the backward into I and W, and
// orders its actions for costs.
bool orders_for_costs(const std::string& name);
// Those names, "zbv, zbh1, ...", for messages.
const std::string& cost_ordered_schedule_names();
// Whether schedule `name` places its stages in a V (rank r holds stages r and 2 ranks - 1 - r, so
// the first and the last stage share rank 0).
bool places_in_a_v(const std::string& name);
// The builder named `name` (gpipe | 1f1b | interleaved | zbv | zbh1 | zbh2 | vhalf | vmin);
// `stages_per_rank` is
// interleaved's; the zero-bubble builders order for `costs` (unit costs when not given). An
// unknown name is an error listing the known ones.
Schedule schedule_by_name(const std::string& name, int ranks, int micro_batches, int stages_per_rank = 2);
Schedule schedule_by_name(const std::string& name, int ranks, int micro_batches, int stages_per_rank,
                          const ActionCosts& costs);

// Adds the sends and receives that the compute actions need across ranks (a schedule written with
// compute actions only, as in CSV files, can be completed with it). Replaces existing ones.
void add_communication(Schedule& schedule);

// Throws hp::Error naming the problem unless: every action runs on its stage's rank; every
// (stage, micro-batch) has one forward and either one full backward or one I and one W (I first);
// every receive has its matching send; and running the programs with blocking receives and
// buffered sends finishes (no deadlock, e.g. a send/receive cycle; the message shows each
// rank's blocked action).
void validate(const Schedule& schedule);

// CSV: a header "rank,actions" and one row per rank with its actions (Action::str()) separated by
// spaces; stage placement is implied by the actions. from_csv validates.
std::string to_csv(const Schedule& schedule);
Schedule from_csv(const std::string& csv, const std::string& name = "csv");

struct StageCosts {
  double forward = 1.0, backward_input = 1.0, backward_weight = 1.0;
};

struct ActionCosts {
  double forward = 1.0, backward_input = 1.0, backward_weight = 1.0;  // full backward = I + W
  double send = 0.0;                                                  // latency of a send/receive pair
  // Time a rank spends after each compute action (bookkeeping, posting messages) before it can
  // start the next one; idle, not busy.
  double overhead = 0.0;
  // Stage s's own F, I and W at index s, where stages differ (the first holds the embedding, the
  // last the head and the loss); empty: the three values above for every stage.
  std::vector<StageCosts> by_stage;

  // The cost of a compute action of `kind` on `stage` (B: I + W).
  double of(ActionKind kind, int stage) const;
  // Throws hp::Error naming what is wrong unless every cost is positive (send and overhead >= 0)
  // and by_stage is empty or has one entry per stage.
  void check(int stages, const std::string& who) const;
};

// The zero-bubble family (Qi et al., "Zero Bubble Pipeline Parallelism", 2023). The backward is
// split into I (dx) and W (dw); each builder places actions for the given costs (profile first, as
// the paper does; unit costs by default): W passes go where they end before the rank's next input
// arrives, or where the rank's activation cap forces them. Activation memory is counted in
// micro-batches of one stage, from its F to its W.
//
// ZB-H1: one stage per rank, 1F1B's memory (at most `ranks` micro-batches on every rank); at equal
// costs about a third of 1F1B's bubble.
Schedule zero_bubble_h1(int ranks, int micro_batches, const ActionCosts& costs = {});
// ZB-H2: one stage per rank, a longer warm-up (2 (ranks - r) - 1 forwards on rank r) and at most
// 2 ranks - 1 micro-batches per rank; at equal costs and micro_batches >= 2 ranks no rank idles
// between its first and last action (per_stage_bubble 0).
Schedule zero_bubble_h2(int ranks, int micro_batches, const ActionCosts& costs = {});
// ZB-V: two stages per rank in a V (rank r holds stages r and 2 ranks - 1 - r, so the first and the
// last stage share rank 0), at most 2 ranks stage micro-batches (each half a 1F1B stage: 1F1B's
// peak) per rank. The order is the paper's: a warm-up of forwards sized to the cap, then rounds in
// which each rank runs one I and one F, W passes filling the waits. Several variants of the fill
// (and the first, greedy order) are built, for `costs` and for unit costs, and the one whose
// simulated bubble under `costs` is lowest is returned. (Every zero-bubble builder returns its
// unit-cost order when nothing built for `costs` idles less under them.)
Schedule zero_bubble_v(int ranks, int micro_batches, const ActionCosts& costs);

// V-Half and V-Min (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): ZB-V's V
// placement with less activation memory, ordered by repeating the paper's building block per
// micro-batch. Rank r holds at most 2 ((ranks + 2) / 2) (V-Half) or 2 ((ranks + 4) / 3) (V-Min)
// stage micro-batches, each half a 1F1B stage: about a half and a third of 1F1B's peak. The bubble
// grows as memory shrinks: at equal costs (p 2-8 tested) V-Half idles at most half of 1F1B's
// time, V-Min at most two thirds. Candidates: the block's own order placed for `costs` (every
// action as early as its inputs allow), and the paper's generator's order; the one idling least
// under `costs` is returned.
Schedule v_half(int ranks, int micro_batches, const ActionCosts& costs = {});
Schedule v_min(int ranks, int micro_batches, const ActionCosts& costs = {});

// The most activations a rank of `schedule` holds at once, in micro-batches of a 1F1B stage (one
// ranks-th of the model): peak_in_flight's largest, times ranks / stages (a V stage counts half).
double peak_memory_in_1f1b_stages(const Schedule& schedule);
// Of the named schedules (gpipe, 1f1b, interleaved with 2 stages per rank, the zero-bubble family
// and V-Half / V-Min), each built for `costs`, the one with the lowest simulated bubble under them
// among those that hold at most `max_stages` (peak_memory_in_1f1b_stages); the first named of
// equals. Throws hp::Error naming the least any of them holds when none fits.
Schedule lowest_bubble_within(int ranks, int micro_batches, double max_stages, const ActionCosts& costs = {});

// The most stage micro-batches whose activations each rank holds at once (from an F to the B or
// W of the same stage and micro-batch), from the programs.
std::vector<int> peak_in_flight(const Schedule& schedule);

struct TimedAction {
  Action action;
  int rank;
  double start, end;
};

struct Simulation {
  double makespan = 0.0;
  double bubble = 0.0;  // whole step: 1 - busy compute time / (ranks x makespan)
  // The papers' metric: the worst rank's 1 - busy / (its last end - its first start), so a rank's
  // late start and early finish are not counted (the next step's work could go there).
  double per_stage_bubble = 0.0;
  std::vector<TimedAction> timeline;
};

// Replays the programs with the costs: each rank runs its actions in order; a receive waits for its
// send (+ latency). Validates first.
Simulation simulate(const Schedule& schedule, const ActionCosts& costs = {});

// A timeline measured on `ranks` ranks (PipelineExecutor::measured_step) as a Simulation: times
// from its first action, the makespan, and the bubble over its compute actions.
Simulation measured(std::vector<TimedAction> timeline, int ranks);

// The costs a measured step shows: the mean time of its F, I and W actions, overall and per stage
// (of its full B actions, half each, when it has no I and W); the send latency: the median time
// from a send's start to the end of its receive, over receives that were waiting before the send
// started (0 without any); and the overhead: each rank's time outside compute actions and
// receives, per compute action. Times of processes on one machine.
ActionCosts measured_costs(const Simulation& measured);

// "F,I,W" or "F,I,W,send": numbers (F, I, W above 0, send 0 or more, all at most 1e9), nothing
// else, not even spaces; nullopt otherwise.
std::optional<ActionCosts> parse_costs(const std::string& text);

// A timeline picture: one row per rank, one box per compute action (colour by kind, labelled with
// the micro-batch, and the stage when a rank has several).
std::string to_svg(const Schedule& schedule, const Simulation& simulation, const std::string& title = "");

}  // namespace hp::pp

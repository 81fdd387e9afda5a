// The schedule timeline as SVG: ranks as rows, compute actions as boxes coloured by kind.
#include <algorithm>
#include <cstdio>
#include <set>
#include <sstream>

#include "hp/pp/schedule.h"

namespace hp::pp {
namespace {

const char* colour(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return "#4e79a7";
    case ActionKind::kBackward:
      return "#59a14f";
    case ActionKind::kBackwardInput:
      return "#8cd17d";
    case ActionKind::kBackwardWeight:
      return "#f28e2b";
    default:
      return "#bab0ac";
  }
}

std::string fixed(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

}  // namespace

std::string to_svg(const Schedule& s, const Simulation& sim, const std::string& title) {
  const double left = 70, top = 40, row = 30, width = 960, legend = 30;
  const double scale = sim.makespan > 0 ? width / sim.makespan : 1.0;
  std::vector<std::set<int>> stages_on(s.ranks);
  for (int stage = 0; stage < s.stages; ++stage) stages_on[s.stage_rank[stage]].insert(stage);
  std::ostringstream out;
  const double height = top + row * s.ranks + legend + 20;
  out << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\""
      << fixed(left + width + 20) << "\" height=\"" << fixed(height) << "\" font-family=\"sans-serif\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"" << fixed(left)
      << "\" y=\"24\" font-size=\"15\">" << (title.empty() ? s.name : title) << " — " << s.ranks << " ranks, "
      << s.stages << " stages, " << s.micro_batches << " micro-batches, bubble " << fixed(100.0 * sim.bubble)
      << "%</text>\n";
  for (int r = 0; r < s.ranks; ++r)
    out << "<text x=\"8\" y=\"" << fixed(top + row * r + row * 0.65) << "\" font-size=\"12\">rank " << r << "</text>\n";
  for (const TimedAction& t : sim.timeline) {
    if (!t.action.is_compute() || t.end <= t.start) continue;
    const double x = left + t.start * scale, w = (t.end - t.start) * scale, y = top + row * t.rank + 3;
    std::string label = std::to_string(t.action.micro_batch);
    if (stages_on[t.rank].size() > 1) label += "s" + std::to_string(t.action.stage);
    out << "<rect x=\"" << fixed(x) << "\" y=\"" << fixed(y) << "\" width=\"" << fixed(w) << "\" height=\""
        << fixed(row - 6) << "\" fill=\"" << colour(t.action.kind) << "\" stroke=\"white\"><title>" << t.action.str()
        << "</title></rect>\n";
    if (w >= 14)
      out << "<text x=\"" << fixed(x + w / 2) << "\" y=\"" << fixed(y + row * 0.55)
          << "\" font-size=\"10\" fill=\"white\""
          << " text-anchor=\"middle\">" << label << "</text>\n";
  }
  const double ly = top + row * s.ranks + 18;
  double lx = left;
  for (const auto& [kind, name] :
       std::vector<std::pair<ActionKind, const char*>>{{ActionKind::kForward, "forward"},
                                                       {ActionKind::kBackward, "backward"},
                                                       {ActionKind::kBackwardInput, "backward dx (I)"},
                                                       {ActionKind::kBackwardWeight, "backward dw (W)"}}) {
    out << "<rect x=\"" << fixed(lx) << "\" y=\"" << fixed(ly - 10) << "\" width=\"12\" height=\"12\" fill=\""
        << colour(kind) << "\"/><text x=\"" << fixed(lx + 16) << "\" y=\"" << fixed(ly) << "\" font-size=\"12\">"
        << name << "</text>\n";
    lx += 150;
  }
  out << "</svg>\n";
  return out.str();
}

}  // namespace hp::pp
